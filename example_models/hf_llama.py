"""A Hugging Face ``transformers`` Llama as a LightningModule: a third-party model trained from its own plan.

The network is ``transformers.LlamaForCausalLM`` built from a small config (no download). It carries its own
published tensor-parallel plan (``config.base_model_tp_plan`` plus the head's ``_tp_plan``), which
``MegatronTPStrategy`` applies unchanged; nothing in this file knows about parallelism.
"""

import lightning as L
import torch

from example_models.gpt import causal_lm_loss


class HFLlamaLightningModule(L.LightningModule):
    """A small ``LlamaForCausalLM`` on byte tokens, trained with AdamW; batches are ``(inputs, targets)`` [B, T].

    Args:
        vocab_size: vocabulary size; 256 for the byte-level ``TextDataModule``.
        hidden_size: model width.
        n_layers: number of decoder layers.
        n_heads: attention heads.
        n_kv_heads: key/value heads (grouped-query attention).
        intermediate_size: hidden size of the SwiGLU MLP.
        max_position_embeddings: longest sequence.
        lr: AdamW learning rate (constant; 3e-3 makes this small model's loss spike within 20 steps).
        weight_decay: AdamW weight decay.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        intermediate_size: int = 192,
        max_position_embeddings: int = 256,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def llama_config(self):
        from transformers import LlamaConfig

        hp = self.hparams
        return LlamaConfig(
            vocab_size=hp.vocab_size,
            hidden_size=hp.hidden_size,
            num_hidden_layers=hp.n_layers,
            num_attention_heads=hp.n_heads,
            num_key_value_heads=hp.n_kv_heads,
            intermediate_size=hp.intermediate_size,
            max_position_embeddings=hp.max_position_embeddings,
            tie_word_embeddings=False,
        )

    def configure_model(self):
        if self.model is None:
            from transformers import LlamaForCausalLM

            # the weights come from the global RNG, which Lightning seeded the same on every rank
            self.model = LlamaForCausalLM(self.llama_config())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits

    def _loss(self, batch) -> tuple[torch.Tensor, int]:
        inputs, targets = batch
        return causal_lm_loss(self(inputs), targets), inputs.size(0)

    def training_step(self, batch, batch_idx):
        loss, batch_size = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, on_step=True, batch_size=batch_size)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, batch_size = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, on_epoch=True, batch_size=batch_size)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
