"""A GPT-2-style causal language model in plain PyTorch, in the spirit of nanoGPT.

Unlike the Llama-style `lightning_par.examples.gpt.GPT` it has learned position embeddings (`wpe`), LayerNorms with a
bias, biased linears, an MLP whose `c_fc`/`c_proj` are direct children of the block, dropout, and (by default)
tied token embedding / output head, as GPT-2 has. Module names follow Hugging Face's GPT-2 where they can; the
attention keeps separate `q_proj`/`k_proj`/`v_proj` instead of GPT-2's fused `c_attn`, because a column-parallel
split of a fused [q | k | v] output would hand each rank a slice across q, k and v instead of whole heads.

The model contains no parallel code. It only declares how it may be split: `tp_plan`, in Hugging Face
`base_model_tp_plan` form.
"""

import math
from dataclasses import dataclass, replace

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_par.data import vocab_size_from_data
from lightning_par.examples.gpt import causal_lm_loss


@dataclass
class GPT2Config:
    """Shapes and hyperparameters (Hugging Face `GPT2Config` names). The default vocabulary is byte-level."""

    vocab_size: int = 256
    n_positions: int = 256  # longest sequence (size of the position embedding table)
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_inner: int | None = None  # hidden size of the MLP; None means 4 * n_embd
    dropout: float = 0.0  # embeddings, attention probabilities and both residual branches
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.n_inner is None:
            self.n_inner = 4 * self.n_embd
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPT2Config.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPT2Config.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with biased projections."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        d = config.n_embd
        self.head_dim = d // config.n_head
        self.dropout = config.dropout
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.c_proj = nn.Linear(d, d)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # The head count comes from the projection outputs (-1), not the config: a column-parallel q/k/v_proj
        # produces only this rank's share of the heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


class Block(nn.Module):
    """Pre-norm GPT-2 block. The MLP's two linears are direct children of the block (no `mlp` submodule)."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.c_fc = nn.Linear(config.n_embd, config.n_inner)
        self.c_proj = nn.Linear(config.n_inner, config.n_embd)
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp_dropout(self.c_proj(h))


class GPT2(nn.Module):
    """GPT-2-style decoder: tokens [B, T] -> logits [B, T, vocab_size]."""

    # Tensor-parallel plan (Hugging Face `base_model_tp_plan` form): module pattern -> style. Everything else
    # (wpe, the LayerNorms) stays replicated.
    tp_plan = {
        "wte": "vocab_parallel",
        "h.*.attn.q_proj": "colwise",
        "h.*.attn.k_proj": "colwise",
        "h.*.attn.v_proj": "colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.c_fc": "colwise",
        "h.*.c_proj": "rowwise",
        "lm_head": "vocab_parallel",  # tied to wte by default: both must be split the same way
    }

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2's initialization, from the global torch RNG in a fixed module order."""
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if name == "lm_head" and self.config.tie_word_embeddings:
                    continue
                # the projections into the residual stream are scaled down with depth (GPT-2 paper)
                scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj") else 1.0
                nn.init.normal_(module.weight, std=std * scale)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.config.n_positions:
            raise ValueError(f"sequence length {T} exceeds n_positions {self.config.n_positions}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8) -> torch.Tensor:
        """Sample `max_new_tokens` continuations of idx [B, T]; temperature <= 0 is greedy."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.n_positions:])[:, -1, :].float()
            if temperature <= 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                next_token = torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_token], dim=1)
        return idx


class GPT2LightningModule(L.LightningModule):
    """The GPT-2-style model as a byte-level language model; batches are `(inputs, targets)` LongTensor [B, T].

    The network is built in `configure_model()`, so a strategy can build it on every rank after seeding.

    Args:
        vocab_size: Vocabulary size; ``None``: the data module's (``trainer.datamodule.vocab_size``: 256 for UTF-8
            bytes, the tokenizer's padded length with a tokenizer), or 256 without a data module.
        n_embd: Model width.
        n_layers: Number of blocks.
        n_heads: Attention heads.
        n_positions: Longest sequence.
        tie_embeddings: Share one matrix between the token embedding `wte` and the output head `lm_head`.
        dropout: Dropout probability (embeddings, attention, residual branches).
        optimizer: "adamw" (weight decay on matrices only) or "sgd" (plain SGD: no momentum, no weight decay).
        lr: Learning rate (constant).
        weight_decay: AdamW weight decay.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        n_embd: int = 64,
        n_layers: int = 4,
        n_heads: int = 4,
        n_positions: int = 256,
        tie_embeddings: bool = True,
        dropout: float = 0.0,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.1,
    ):
        super().__init__()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        self.save_hyperparameters()
        vocab_size = 256 if vocab_size is None else vocab_size  # until configure_model reads the data's
        self.config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layers,
                                 n_head=n_heads, dropout=dropout, tie_word_embeddings=tie_embeddings)
        self.model: GPT2 | None = None

    def configure_model(self):
        if self.model is None:
            vocab_size = vocab_size_from_data(self, self.hparams.vocab_size, default=self.config.vocab_size)
            self.config = replace(self.config, vocab_size=vocab_size)
            self.hparams.vocab_size = vocab_size  # what the checkpoint records, so the model is rebuilt alike
            self.model = GPT2(self.config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one (micro-)batch. A pipeline strategy calls it on the last stage, inside its schedule."""
        return causal_lm_loss(logits, targets)

    def compute_loss(self, batch) -> torch.Tensor:
        """The batch's mean loss; a pipeline strategy answers it with its schedule's loss."""
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
        params = [p for p in self.parameters() if p.requires_grad]
        if hp.optimizer == "sgd":
            return torch.optim.SGD(params, lr=hp.lr, momentum=0.0)
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # biases and LayerNorms
        ]
        return torch.optim.AdamW(groups, lr=hp.lr)

    def sample_text(self, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8) -> str:
        """Continue `prompt` (UTF-8 bytes as tokens; an empty prompt starts from a newline)."""
        self.configure_model()
        data = prompt.encode("utf-8") or b"\n"
        tokens = torch.tensor([list(data)], dtype=torch.long, device=self.device)
        out = self.model.generate(tokens, max_new_tokens, temperature=temperature)
        return bytes(t for t in out[0].tolist() if t < 256).decode("utf-8", errors="replace")
