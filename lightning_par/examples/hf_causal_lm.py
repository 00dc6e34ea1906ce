"""Hugging Face ``transformers`` causal LMs as LightningModules: third-party models trained from their own plans.

The network is a ``transformers`` ``*ForCausalLM`` (Llama, Qwen2 or Mistral) built from a small config (no
download). It carries its own published tensor-parallel plan (``config.base_model_tp_plan`` plus the head's
``_tp_plan``), which ``MegatronTPStrategy`` applies unchanged, and pipeline plan (``config.base_model_pp_plan`` plus
the head's ``_pp_plan``), from which ``PipelineStrategy`` cuts the stages; nothing in this file knows about
parallelism.

Batches are ``(inputs, targets)`` (``lightning_par.data.TextDataModule``) or dicts as Hugging Face collators make
them, ``{"input_ids", "labels", "attention_mask"}`` (``TextDataModule(batch_format="dict")``), with the labels in
Hugging Face's convention: aligned with ``input_ids``, shifted inside the loss, ``-100`` ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch

from lightning_par.data import vocab_size_from_data
from lightning_par.examples.gpt import causal_lm_loss
from lightning_par.parallel.pipeline.batches import split_batch

#: arch -> (config class, model class) in ``transformers``
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}
OPTIMIZERS = ("adamw", "sgd")


class HFCausalLMLightningModule(L.LightningModule):
    """A small Hugging Face causal LM on byte tokens.

    Args:
        arch: ``"llama"``, ``"qwen2"`` or ``"mistral"``.
        vocab_size: vocabulary size; ``None``: the data module's (``trainer.datamodule.vocab_size``: 256 for the
            byte-level ``TextDataModule``, a tokenizer's padded length), or 256 without one.
        hidden_size: model width.
        n_layers: number of decoder layers.
        n_heads: attention heads.
        n_kv_heads: key/value heads (grouped-query attention).
        intermediate_size: hidden size of the SwiGLU MLP.
        max_position_embeddings: longest sequence.
        lr: learning rate (constant; with AdamW, 3e-3 makes this small model's loss spike within 20 steps).
        weight_decay: weight decay (AdamW's decoupled one; SGD's L2 term).
        tie_embeddings: share one matrix between the input embedding and ``lm_head`` (``tie_word_embeddings``).
        optimizer: ``"adamw"``, or ``"sgd"``: plain SGD, no momentum.
    """

    #: the batch's position_ids (packed documents) reach the model, whose own packed-sequence path keeps attention
    #: within documents (TextDataModule(pack_documents=True) checks it)
    takes_position_ids = True

    def __init__(
        self,
        arch: str = "llama",
        vocab_size: int | None = None,
        hidden_size: int = 64,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        intermediate_size: int = 192,
        max_position_embeddings: int = 256,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        tie_embeddings: bool = False,
        optimizer: str = "adamw",
    ):
        super().__init__()
        if arch not in ARCHITECTURES:
            raise ValueError(f"unknown arch {arch!r}; use one of {sorted(ARCHITECTURES)}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; use one of {list(OPTIMIZERS)}")
        self.arch = arch
        # a subclass that fixes the architecture (HFLlamaLightningModule) takes no `arch` to be rebuilt with
        fixed = [] if "arch" in inspect.signature(type(self).__init__).parameters else ["arch"]
        self.save_hyperparameters(ignore=fixed)
        self.model = None

    def hf_config(self):
        import transformers

        hp = self.hparams
        config_cls = getattr(transformers, ARCHITECTURES[self.arch][0])
        # the size the data asks for, recorded in hparams (so a checkpoint rebuilds the same model)
        hp.vocab_size = vocab_size_from_data(self, hp.vocab_size)
        return config_cls(
            vocab_size=hp.vocab_size,
            hidden_size=hp.hidden_size,
            num_hidden_layers=hp.n_layers,
            num_attention_heads=hp.n_heads,
            num_key_value_heads=hp.n_kv_heads,
            intermediate_size=hp.intermediate_size,
            max_position_embeddings=hp.max_position_embeddings,
            tie_word_embeddings=hp.tie_embeddings,
        )

    def configure_model(self):
        if self.model is None:
            import transformers

            # the weights come from the global RNG, which Lightning seeded the same on every rank
            self.model = getattr(transformers, ARCHITECTURES[self.arch][1])(self.hf_config())

    def forward(self, inputs: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Logits [B, T, V] of token ids [B, T], or of ``{"input_ids", "attention_mask", "position_ids"}``."""
        if isinstance(inputs, Mapping):
            return self.model(**inputs, use_cache=False).logits
        return self.model(input_ids=inputs, use_cache=False).logits

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one (micro-)batch: next-token targets aligned with the logits, -100 ignored. A pipeline
        strategy calls it on the last stage, inside its schedule."""
        return causal_lm_loss(logits, targets)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The batch's mean loss, for a tuple or a dict batch (see ``split_batch``: a dict's labels are shifted to
        next-token targets). A pipeline strategy answers this instead, so the steps below log the same either way."""
        inputs, targets = split_batch(batch)
        return self.loss_fn(self(inputs), targets)

    @staticmethod
    def _batch_size(batch: Any) -> int:
        return (batch["input_ids"] if isinstance(batch, Mapping) else batch[0]).size(0)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, on_step=True, batch_size=self._batch_size(batch))
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, on_epoch=True, batch_size=self._batch_size(batch))

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)


class HFLlamaLightningModule(HFCausalLMLightningModule):
    """A small ``LlamaForCausalLM`` (see :class:`HFCausalLMLightningModule`; ``arch`` is fixed to ``"llama"``)."""

    def __init__(
        self,
        vocab_size: int | None = None,
        hidden_size: int = 64,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        intermediate_size: int = 192,
        max_position_embeddings: int = 256,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        tie_embeddings: bool = False,
        optimizer: str = "adamw",
    ):
        super().__init__("llama", vocab_size, hidden_size, n_layers, n_heads, n_kv_heads, intermediate_size,
                         max_position_embeddings, lr, weight_decay, tie_embeddings, optimizer)

    def llama_config(self):
        return self.hf_config()
