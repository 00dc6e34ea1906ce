"""A plain PyTorch causal language model, written the way a tutorial writes one -- and nothing else.

It declares nothing but a ``tp_plan`` (which tensor parallelism cannot guess): no ``pp_plan``, no
``pipeline_units()``. The strategies find its repeated
blocks themselves (:func:`lightning_par.parallel.blocks.find_blocks`: the ``nn.ModuleList`` of ``Block``), so
``ZeroStrategy(stage=3)`` shards it block by block and ``PipelineStrategy`` can cut it into stages. This is the
"bring your own model" check: if this trains under a strategy, so does a user's model of the same shape.
"""

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_par.data import vocab_size_from_data


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # chunk and -1, not split(d) and n_heads: under tensor parallelism this rank holds 1/tp of q, k and v
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, -1, d // self.n_heads).transpose(1, 2) for y in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PlainLM(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks in an ``nn.ModuleList``, a final norm and a head.

    ``tp_plan``: the fused q|k|v projection is ``packed_colwise:3`` (each rank gets its slice of q, of k and of v;
    plain ``colwise`` would give rank 0 all of q and half of k, and is refused at setup), the MLP is column- then
    row-parallel. The embeddings and the head stay replicated, so the loss is an ordinary tensor.
    """

    tp_plan = {
        "blocks.*.qkv": "packed_colwise:3", "blocks.*.proj": "rowwise",
        "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise",
    }

    def __init__(self, vocab_size: int = 256, dim: int = 64, n_layers: int = 4, n_heads: int = 4,
                 max_seq_len: int = 256):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.blocks = nn.ModuleList([Block(dim, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class PlainLMLightningModule(L.LightningModule):
    """:class:`PlainLM` on the data module's tokens; batches are ``(inputs, targets)`` [B, T]
    (``lightning_par.data``).

    Args:
        vocab_size: vocabulary size; ``None``: the data module's (256 for the byte-level ``TextDataModule``, the
            tokenizer's padded length with a tokenizer), or 256 without a data module.
        dim: model width.
        n_layers: number of blocks.
        n_heads: attention heads.
        max_seq_len: longest sequence (the position embedding's size).
        optimizer: ``"adamw"`` (AdamW with ``weight_decay``) or ``"sgd"`` (plain SGD: no momentum).
        lr: learning rate (constant).
        weight_decay: AdamW weight decay.
    """

    def __init__(self, vocab_size: int | None = None, dim: int = 64, n_layers: int = 4, n_heads: int = 4,
                 max_seq_len: int = 256, optimizer: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.1):
        super().__init__()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        self.save_hyperparameters()
        self.model: PlainLM | None = None

    def configure_model(self):
        if self.model is None:  # built here so a strategy can build it on every rank after seeding
            hp = self.hparams
            hp.vocab_size = vocab_size_from_data(self, hp.vocab_size)  # recorded so a checkpoint rebuilds it alike
            self.model = PlainLM(hp.vocab_size, hp.dim, hp.n_layers, hp.n_heads, hp.max_seq_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean token cross-entropy of one (micro-)batch; a pipeline calls it on its last stage."""
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    def compute_loss(self, batch) -> torch.Tensor:
        """The batch's loss; a pipeline strategy answers it with its schedule's loss."""
        inputs, targets = batch
        return self.loss_fn(self(inputs), targets)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, on_step=True, batch_size=batch[0].size(0))
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, on_epoch=True, batch_size=batch[0].size(0))

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=hp.lr)
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
