"""A Llama-style decoder-only GPT in plain PyTorch.

The model contains no parallel code. It only *declares* how it may be split:
`tp_plan` (tensor parallelism, Hugging Face style) and `pp_plan` (pipeline stages).
A separate engine reads these declarations and applies them.
"""

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shapes and hyperparameters of a GPT. The default vocabulary is byte-level (256)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: each kv head serves n_heads // n_kv_heads query heads
    ffn_dim: int = 384  # hidden size of the SwiGLU MLP
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GPTConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim = dim // n_heads must be even for rotary embeddings, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        """A copy of `GPT_PRESETS[name]` with some fields replaced, e.g. `from_preset("1b", vocab_size=32000)`."""
        if name not in GPT_PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; valid presets: {', '.join(GPT_PRESETS)}")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; valid fields: {', '.join(sorted(valid))}")
        return replace(GPT_PRESETS[name], **overrides)

    def num_params(self) -> int:
        """Exact parameter count of `GPT(self)`, computed from shapes."""
        return num_params(self)


# The larger presets follow Llama-3 shapes. With the default byte vocabulary the embeddings are tiny,
# so the counts come out somewhat below the names (e.g. "8b" is ~7.0B); pass vocab_size to change that.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=256),
    "small": GPTConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=256),
    "125m": GPTConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=3584, max_seq_len=2048),
    "350m": GPTConfig(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=3584, max_seq_len=2048),
    "1b": GPTConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=4096,
                    rope_theta=500000.0),
    "3b": GPTConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, max_seq_len=4096,
                    rope_theta=500000.0),
    "8b": GPTConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=8192,
                    rope_theta=500000.0),
}


def num_params(config: GPTConfig) -> int:
    """Exact parameter count of `GPT(config)`, computed from shapes (tied weights counted once)."""
    d, kv_dim = config.dim, config.n_kv_heads * config.head_dim
    attn = d * d + 2 * d * kv_dim + d * d  # q, k, v, o
    mlp = 3 * d * config.ffn_dim  # gate, up, down
    block = attn + mlp + 2 * d  # plus the two RMSNorm weights
    embed = config.vocab_size * d
    head = 0 if config.tie_embeddings else config.vocab_size * d
    return embed + config.n_layers * block + d + head


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None,
                 position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim // 2], in fp32; for `position_ids` [B, T] (the tokens' positions,
    0..seq_len-1 when not given) of shape [B, 1, T, head_dim // 2], to broadcast over the heads."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if position_ids is None:
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    else:
        angles = (position_ids.to(device=device, dtype=torch.float32)[..., None] * inv_freq).unsqueeze(-3)
    return angles.cos(), angles.sin()


def document_mask(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The block-causal mask [B, 1, T, T] (True: attend) of packed documents, or None for one document per row.

    A document starts wherever a position does not follow the one before by 1 (transformers' rule for packed
    sequences), so each token attends to the earlier tokens of its own document only.
    """
    if position_ids is None:
        return None
    first = position_ids[..., :1] - 1
    documents = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    if not bool((documents[..., -1] > 0).any()):
        return None
    length = position_ids.size(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((documents[..., :, None] == documents[..., None, :]) & causal).unsqueeze(-3)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape [B, H, T, head_dim] (rotate-half convention: pairs are (i, i + head_dim/2))."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        d, kv_dim = config.dim, config.n_kv_heads * config.head_dim
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: :func:`document_mask` of the positions (packed documents), else causal over the sequence."""
        B, T, _ = x.shape
        # Head counts come from the projection outputs, not the config: under tensor parallelism a
        # column-parallel q_proj/k_proj/v_proj produces only this rank's share of the heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(T, self.head_dim, self.rope_theta, device=x.device, position_ids=position_ids)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    mlp_type: type[nn.Module] = FeedForward  # a mixture of experts in examples/moe.py

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = self.mlp_type(config)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attn_norm(x)
        # (the mask only where documents are packed: a hand-written tp plan lays out the attention's two inputs)
        x = x + (self.attn(h, position_ids) if mask is None else self.attn(h, position_ids, mask))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer: tokens [B, T] -> logits [B, T, vocab_size].

    Pipeline stages are made by deleting parts of a full model: with `embed` set to None the input is
    taken as hidden states [B, T, dim]; with `norm`/`head` set to None they are skipped. `layers` is a
    ModuleDict keyed "0", "1", ... so that the remaining parameters keep their names.
    """

    # Tensor-parallel plan (Hugging Face `base_model_tp_plan` form): module pattern -> style.
    tp_plan = {
        "layers.*.attn.q_proj": "colwise",
        "layers.*.attn.k_proj": "colwise",
        "layers.*.attn.v_proj": "colwise",
        "layers.*.attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "embed": "vocab_parallel",
        "head": "vocab_parallel",  # logits stay vocabulary-sharded for the vocab-parallel cross-entropy
    }
    # Pipeline plan (Hugging Face `base_model_pp_plan` form), in execution order: module -> (inputs, outputs).
    pp_plan = {
        "embed": (["tokens"], ["hidden"]),
        "layers": (["hidden"], ["hidden"]),
        "norm": (["hidden"], ["hidden"]),
        "head": (["hidden"], ["logits"]),
    }

    block_type: type[nn.Module] = Block  # the repeated block (examples/moe.py: one with a mixture of experts)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): self.block_type(config) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """(Re)initialize all parameters from the global torch RNG, in a fixed module order."""
        std = self.config.init_std
        # Residual projections are scaled down so the residual stream's variance does not grow with depth.
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Linear):
                if name == "head" and self.config.tie_embeddings:
                    continue
                is_residual = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, std=residual_std if is_residual else std)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()

    def pipeline_units(self) -> list[str]:
        """`pp_plan` expanded to ordered unit names: ["embed", "layers.0", ..., "norm", "head"].

        Modules that were removed (set to None or deleted from `layers`) are not listed.
        """
        units = []
        for name in self.pp_plan:
            module = getattr(self, name)
            if isinstance(module, nn.ModuleDict):
                units.extend(f"{name}.{key}" for key in module.keys())
            elif module is not None:
                units.append(name)
        return units

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` [B, T]: the tokens' positions in their sequence (default 0..T-1), for a caller that
        gives the model part of a sequence (context parallel), or packed documents: positions that restart at each
        document's first token, whose attention then stays within each document (:func:`document_mask`)."""
        if tokens.size(1) > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens.size(1)} exceeds max_seq_len {self.config.max_seq_len}")
        h = self.embed(tokens) if self.embed is not None else tokens
        mask = document_mask(position_ids)
        for layer in self.layers.values():
            if mask is not None:
                h = layer(h, position_ids, mask)
            else:
                h = layer(h) if position_ids is None else layer(h, position_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)
        return h

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = None) -> torch.Tensor:
        """Sample `max_new_tokens` continuations of tokens [B, T]; returns [B, T + max_new_tokens].

        temperature <= 0 means greedy decoding.
        """
        for _ in range(max_new_tokens):
            context = tokens[:, -self.config.max_seq_len:]
            logits = self(context)[:, -1, :].float()
            if temperature <= 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32. logits [B, T, V], targets [B, T] (-100 is ignored)."""
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
    # Vocabulary-sharded logits (a DTensor, under tensor parallelism) give a replicated DTensor loss; return its
    # plain value, which callers such as Lightning's `self.log(sync_dist=True)` can all-reduce.
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
