"""A GPT whose MLP is a mixture of experts (Mixtral / Qwen3-MoE style), in plain PyTorch.

Each block's MLP routes every token to its ``top_k`` of ``n_experts`` SwiGLU experts: a softmax over the experts
(fp32), the top k kept and their weights renormalised to sum to 1, every token computed by each of its experts
(dropless: no capacity, no token ever dropped) and the outputs summed with those weights; an optional shared expert
sees every token. The experts of a layer are one module holding stacked weights (``w_gate``/``w_up`` ``[E, dim,
ffn]``, ``w_down`` ``[E, ffn, dim]``), not E modules.

As the dense GPT, the model holds no parallel code; it declares what a strategy may split. An expert layer says
which of its parameters are stacked over the experts (``expert_parameters``, dimension 0) and computes the experts
it holds on tokens grouped by expert (:meth:`MoEFeedForward.experts`); between routing and that compute it calls its
``token_exchange`` when a strategy set one (expert parallel: the tokens travel to the ranks holding their experts
and back, :mod:`lightning_par.parallel.expert_parallel`). Unset, the single-process forward below is the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_par.examples.gpt import GPT, GPT_PRESETS, Block, FeedForward, GPTConfig, num_params
from lightning_par.examples.lit_gpt import GPTLightningModule


@dataclass
class MoEConfig(GPTConfig):
    """A :class:`GPTConfig` with a mixture of experts in every block.

    ``expert_ffn_dim``: each expert's hidden size (None: ``ffn_dim``); ``shared_ffn_dim``: a shared expert's (0: none);
    ``aux_loss_coef``: the load-balancing loss's weight (0: off, the default; see :meth:`MoEFeedForward.forward`).
    """

    n_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int | None = None
    shared_ffn_dim: int = 0
    aux_loss_coef: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.expert_ffn_dim is None:
            self.expert_ffn_dim = self.ffn_dim
        for name in ("n_experts", "top_k", "expert_ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} is larger than n_experts={self.n_experts}: each token is routed "
                             "to top_k different experts. Use top_k <= n_experts.")
        if not isinstance(self.shared_ffn_dim, int) or self.shared_ffn_dim < 0:
            raise ValueError(f"MoEConfig.shared_ffn_dim must be an int >= 0 (0: no shared expert), got "
                             f"{self.shared_ffn_dim!r}")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}")

    def num_params(self) -> int:
        """Exact parameter count of ``MoEGPT(self)``: every expert counted (see :meth:`active_params`)."""
        return self._count(self.n_experts)

    def active_params(self) -> int:
        """The parameters one token uses: its ``top_k`` experts instead of all of them."""
        return self._count(self.top_k)

    def _count(self, experts: int) -> int:
        dense_mlp = 3 * self.dim * self.ffn_dim
        moe = self.dim * self.n_experts + experts * 3 * self.dim * self.expert_ffn_dim + 3 * self.dim * \
            self.shared_ffn_dim  # router, experts, shared expert
        return num_params(self) + self.n_layers * (moe - dense_mlp)


MOE_PRESETS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(**{**vars(GPT_PRESETS["tiny"]), "n_experts": 4, "top_k": 2, "expert_ffn_dim": 96}),
    "small": MoEConfig(**{**vars(GPT_PRESETS["small"]), "n_experts": 8, "top_k": 2, "expert_ffn_dim": 192,
                          "shared_ffn_dim": 192}),
}


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts held as stacked weights, plus an optional shared expert."""

    #: the parameters stacked over the experts (dimension 0): what expert parallelism splits
    expert_parameters = ("w_gate", "w_up", "w_down")
    #: set by a strategy (expert parallel): ``token_exchange(tokens, counts, experts)`` sends tokens grouped by
    #: global expert to the ranks holding those experts, runs ``experts`` there and returns the outputs in the same
    #: order; None: this module holds every expert
    token_exchange = None

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.num_experts, self.top_k, self.aux_loss_coef = config.n_experts, config.top_k, config.aux_loss_coef
        e, d, f = config.n_experts, config.dim, config.expert_ffn_dim
        self.router = nn.Linear(d, e, bias=False)
        self.w_gate = nn.Parameter(torch.empty(e, d, f))
        self.w_up = nn.Parameter(torch.empty(e, d, f))
        self.w_down = nn.Parameter(torch.empty(e, f, d))
        shared = config.shared_ffn_dim
        self.shared = FeedForward(replace(config, ffn_dim=shared)) if shared else None
        self.aux_loss: torch.Tensor | None = None  # the last forward's load-balancing loss (aux_loss_coef > 0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens [N, dim] -> (their top-k experts [N, k], the renormalised weights [N, k] in x's dtype, the router's
        probabilities [N, E] in fp32)."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype), probs

    def experts(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts this module holds, on ``tokens`` grouped by expert: ``counts[i]`` rows for its i-th expert
        (as many counts as it holds experts). Returns the outputs in the same order."""
        w_gate, w_up, w_down = (_held(w) for w in (self.w_gate, self.w_up, self.w_down))
        outs = [F.silu(chunk @ w_gate[i]) * (chunk @ w_up[i]) @ w_down[i]
                for i, chunk in enumerate(torch.split(tokens, counts))]
        return torch.cat(outs) if outs else tokens.new_zeros((0, w_down.shape[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights, probs = self.route(x)
        # each (token, choice) pair grouped by expert; the stable sort keeps the tokens' order within an expert
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = _counts(flat, self.num_experts)
        grouped = x[order // self.top_k]
        if self.token_exchange is None:
            out = self.experts(grouped, counts)
        else:
            out = self.token_exchange(grouped, counts, self.experts)
        combined = torch.empty_like(out).index_copy_(0, order, out).view(-1, self.top_k, shape[-1])
        y = (combined * weights.unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.aux_loss_coef > 0:
            # Switch / Mixtral load balancing over this forward's tokens (per micro-batch, and per rank when the
            # batch is split): E * sum_e (fraction of choices routed to e) * (mean probability of e)
            fraction = torch.tensor(counts, dtype=probs.dtype, device=probs.device) / flat.numel()
            self.aux_loss = self.num_experts * (fraction * probs.mean(dim=0)).sum()
        return y.view(shape)


def _counts(chosen: torch.Tensor, experts: int) -> list[int]:
    """How many of the ``chosen`` experts are each expert. A tensor on the meta device has no values (a shape-only
    run: the pipeline's check of the units' chain), so its choices are taken as all the first expert's."""
    if chosen.is_meta:
        return [chosen.numel()] + [0] * (experts - 1)
    return torch.bincount(chosen, minlength=experts).tolist()


def _held(weight: torch.Tensor) -> torch.Tensor:
    """The part of a stacked expert weight this rank holds: the local shard of a DTensor split over the experts."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class MoEBlock(Block):
    mlp_type = MoEFeedForward


class MoEGPT(GPT):
    """The decoder-only GPT of :mod:`lightning_par.examples.gpt` with a mixture of experts as every block's MLP."""

    block_type = MoEBlock
    # attention, embedding and head as in the dense GPT; the experts are split by expert parallelism instead
    tp_plan = {k: v for k, v in GPT.tp_plan.items() if ".mlp." not in k}

    @torch.no_grad()
    def init_weights(self):
        super().init_weights()  # embeddings, linears (router and shared expert included), norms
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                nn.init.normal_(module.w_gate, std=std)
                nn.init.normal_(module.w_up, std=std)
                nn.init.normal_(module.w_down, std=residual_std)

    def aux_loss(self) -> torch.Tensor | None:
        """The weighted sum of the last forward's load-balancing losses over the layers (None when off)."""
        losses = [m.aux_loss_coef * m.aux_loss for m in self.modules()
                  if isinstance(m, MoEFeedForward) and m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


class MoEGPTLightningModule(GPTLightningModule):
    """:class:`~lightning_par.examples.GPTLightningModule` with the mixture-of-experts GPT (:class:`MoEGPT`).

    Args (besides the dense module's):
        preset: a name in ``MOE_PRESETS`` ("tiny", "small").
        n_experts, top_k, expert_ffn_dim, shared_ffn_dim, aux_loss_coef: override the preset's (None keeps it;
            see :class:`MoEConfig`).
    """

    model_type = MoEGPT

    def __init__(self, preset: str = "tiny", vocab_size: int | None = None, n_layers: int | None = None,
                 n_experts: int | None = None, top_k: int | None = None, expert_ffn_dim: int | None = None,
                 shared_ffn_dim: int | None = None, aux_loss_coef: float | None = None, lr: float = 3e-3,
                 weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 10,
                 min_lr_ratio: float = 0.1, optimizer: str = "adamw"):
        if preset not in MOE_PRESETS:
            raise ValueError(f"unknown MoE preset {preset!r}; valid presets: {', '.join(MOE_PRESETS)}")
        super().__init__(preset=preset, vocab_size=vocab_size, n_layers=n_layers, lr=lr, weight_decay=weight_decay,
                         betas=betas, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, optimizer=optimizer)
        given = dict(n_experts=n_experts, top_k=top_k, expert_ffn_dim=expert_ffn_dim, shared_ffn_dim=shared_ffn_dim,
                     aux_loss_coef=aux_loss_coef)
        dense = {k: v for k, v in vars(self.config).items() if k in vars(GPT_PRESETS["tiny"])}
        moe = {k: v for k, v in vars(MOE_PRESETS[preset]).items() if k not in dense}
        self.config = MoEConfig(**dense, **{**moe, **{k: v for k, v in given.items() if v is not None}})

    def compute_loss(self, batch) -> torch.Tensor:
        loss = super().compute_loss(batch)
        aux = self.model.aux_loss()
        return loss if aux is None else loss + aux
