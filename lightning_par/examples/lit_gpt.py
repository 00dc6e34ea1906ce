"""GPT wrapped as a LightningModule, with a perplexity metric that works from the loss alone."""

import math
from dataclasses import replace

import lightning as L
import torch
import torchmetrics

from lightning_par.data import vocab_size_from_data
from lightning_par.examples.gpt import GPT, GPTConfig, causal_lm_loss


class TokenPerplexity(torchmetrics.Metric):
    """exp(total negative log-likelihood / total tokens), accumulated from mean losses.

    It aggregates from the loss, so it never needs the full logits: a vocab-parallel loss that never
    materializes them can still feed it.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss_mean: torch.Tensor, n_tokens: int | torch.Tensor) -> None:
        n_tokens = torch.as_tensor(n_tokens, dtype=torch.float64, device=self.count.device)
        self.nll_sum += loss_mean.detach().to(torch.float64) * n_tokens
        self.count += n_tokens

    def compute(self) -> torch.Tensor:
        return torch.exp(self.nll_sum / self.count)


class GPTLightningModule(L.LightningModule):
    """A byte-level GPT language model trained with AdamW and a warmup + cosine learning-rate schedule.

    Batches are tuples `(inputs, targets)` of LongTensor [B, T], or `(inputs, targets, position_ids)` of packed
    documents (`TextDataModule(pack_documents=True)`: the model attends within each document). The network is built in
    `configure_model()`, so a strategy can build it on every rank after seeding (or on the meta device).

    Args:
        preset: Name of a model size in `GPT_PRESETS` ("tiny", "small", "125m", "350m", "1b", "3b", "8b").
        vocab_size: Vocabulary size; ``None``: the data module's (``trainer.datamodule.vocab_size``: 256 for UTF-8
            bytes, a tokenizer's padded length), or the preset's (256) without one (e.g. ``lightning-par plan``).
        tie_embeddings: Share one weight matrix between the input embedding and the output head.
        n_layers: Override the preset's number of transformer blocks (None keeps the preset's).
        n_kv_heads: Override the preset's number of key/value heads (tensor parallelism needs tp to divide it).
        lr: Peak learning rate, reached after the warmup.
        weight_decay: AdamW weight decay, applied only to matrices (>= 2-D parameters).
        betas: AdamW betas.
        warmup_steps: Number of optimizer steps of linear warmup.
        min_lr_ratio: Final learning rate of the cosine decay, as a fraction of `lr`.
        optimizer: "adamw" (with the warmup + cosine schedule) or "sgd" (plain SGD at a constant `lr`: no momentum,
            no weight decay).
    """

    model_type: type[GPT] = GPT  # what configure_model builds from `config` (examples/moe.py: MoEGPT)
    # predict_step: the first `predict_prompt_len` input tokens are the prompt for this many new tokens.
    predict_prompt_len = 16
    predict_new_tokens = 32
    #: the batch's position_ids (packed documents) reach the model (TextDataModule(pack_documents=True) checks it)
    takes_position_ids = True

    def __init__(
        self,
        preset: str = "tiny",
        vocab_size: int | None = None,
        tie_embeddings: bool = False,
        n_layers: int | None = None,
        n_kv_heads: int | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        optimizer: str = "adamw",
    ):
        super().__init__()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={optimizer!r} is not available; use 'adamw' or 'sgd'.")
        self.save_hyperparameters()
        overrides = {"tie_embeddings": tie_embeddings}
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        if n_layers is not None:
            overrides["n_layers"] = n_layers
        if n_kv_heads is not None:
            overrides["n_kv_heads"] = n_kv_heads
        self.config = GPTConfig.from_preset(preset, **overrides)  # validates early, before any weights exist
        self.model: GPT | None = None
        self.train_ppl = TokenPerplexity()
        self.val_ppl = TokenPerplexity()
        self.test_ppl = TokenPerplexity()

    def configure_model(self):
        if self.model is None:
            # a subclass whose __init__ takes no vocab_size has none in hparams: its preset's (or the data's) holds
            recorded = "vocab_size" in self.hparams
            given = self.hparams.vocab_size if recorded else None
            vocab_size = vocab_size_from_data(self, given, default=self.config.vocab_size)
            self.config = replace(self.config, vocab_size=vocab_size)
            if recorded:
                self.hparams.vocab_size = vocab_size  # what the checkpoint records, so the model is rebuilt alike
            self.model = self.model_type(self.config)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            return self.model(tokens)
        return self.model(tokens, position_ids=position_ids)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one (micro-)batch. A pipeline strategy calls it on the last stage, inside its schedule."""
        return causal_lm_loss(logits, targets)

    def compute_loss(self, batch) -> torch.Tensor:
        """The batch's mean loss. Every step gets its loss here, so a pipeline strategy can answer it instead
        (its schedule runs forward and backward across the stages) while the step's logging stays the same."""
        inputs, targets, *positions = batch  # (inputs, targets[, position_ids])
        return self.loss_fn(self(inputs, *positions), targets)

    def _loss(self, batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        inputs, targets = batch[:2]
        return self.compute_loss(batch), (targets != -100).sum(), inputs.size(0)

    def training_step(self, batch, batch_idx):
        loss, n_tokens, batch_size = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, on_step=True, batch_size=batch_size)
        self.train_ppl(loss, n_tokens)  # forward (not update) so the per-step value can be logged
        self.log("train/ppl", self.train_ppl, on_step=True, on_epoch=False, batch_size=batch_size)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, n_tokens, batch_size = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, on_epoch=True, batch_size=batch_size)
        self.val_ppl.update(loss, n_tokens)
        self.log("val/ppl", self.val_ppl, on_step=False, on_epoch=True, batch_size=batch_size)

    def test_step(self, batch, batch_idx):
        loss, n_tokens, batch_size = self._loss(batch)
        self.log("test/loss", loss, sync_dist=True, on_epoch=True, batch_size=batch_size)
        self.test_ppl.update(loss, n_tokens)
        self.log("test/ppl", self.test_ppl, on_step=False, on_epoch=True, batch_size=batch_size)

    def predict_step(self, batch, batch_idx):
        """Sampled continuations [B, predict_new_tokens] of the first `predict_prompt_len` input tokens."""
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        prompt = inputs[:, : self.predict_prompt_len]
        return self.model.generate(prompt, self.predict_new_tokens)[:, prompt.size(1):]

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        if hp.optimizer == "sgd":
            # plain SGD (no momentum, no weight decay, constant lr): its step is linear in the gradient, so a
            # gradient off by a constant factor shows in the loss -- what parity tests need
            return torch.optim.SGD(params, lr=hp.lr)
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # norm weights
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))

        total_steps = self.trainer.estimated_stepping_batches
        warmup, min_ratio = hp.warmup_steps, hp.min_lr_ratio

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if not math.isfinite(total_steps):
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def sample_text(self, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8) -> str:
        """Continue `prompt` (UTF-8 bytes as tokens; an empty prompt starts from a newline), or with the data
        module's Hugging Face tokenizer when it has one.

        Tokens >= 256 (possible only with a larger vocab_size) are dropped from the decoded bytes.
        """
        self.configure_model()
        tokenizer = getattr(getattr(self._trainer, "datamodule", None), "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "eos_token_id"):  # a Hugging Face tokenizer
            ids = tokenizer(prompt)["input_ids"] or [tokenizer.eos_token_id]
            out = self.model.generate(torch.tensor([ids], device=self.device), max_new_tokens, temperature=temperature)
            return tokenizer.decode([t for t in out[0].tolist() if t < len(tokenizer)], skip_special_tokens=True)
        data = prompt.encode("utf-8") or b"\n"
        tokens = torch.tensor([list(data)], dtype=torch.long, device=self.device)
        out = self.model.generate(tokens, max_new_tokens, temperature=temperature)
        return bytes(t for t in out[0].tolist() if t < 256).decode("utf-8", errors="replace")
