"""A GPT whose MLP is a mixture of experts (Mixtral / Qwen3-MoE style), in plain PyTorch.

Each block's MLP routes every token to its ``top_k`` of ``n_experts`` SwiGLU experts: a softmax over the experts
(fp32), the top k kept and their weights renormalised to sum to 1, every token computed by each of its experts
(dropless by default: no token ever dropped; ``capacity_factor`` caps each expert, see :meth:`MoEFeedForward.forward`)
and the outputs summed with those weights; an optional shared expert sees every token. The experts of a layer are one
module holding stacked weights (``w_gate``/``w_up`` ``[E, dim, ffn]``, ``w_down`` ``[E, ffn, dim]``), not E modules.

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
from lightning_par.parallel.router import AUX_LOSS_SCOPES, check_global_scope, counts_routing


@dataclass
class MoEConfig(GPTConfig):
    """A :class:`GPTConfig` with a mixture of experts in every block.

    ``expert_ffn_dim``: each expert's hidden size (None: ``ffn_dim``); ``shared_ffn_dim``: a shared expert's (0: none);
    ``aux_loss_coef``: the load-balancing loss's weight (0: off, the default; see :meth:`MoEFeedForward.forward`);
    ``aux_loss_scope``: the tokens its statistics cover, ``"micro_batch"`` (each rank's tokens of each forward, the
    default) or ``"global"`` (summed over the data-parallel ranks, :mod:`lightning_par.parallel.router`);
    ``capacity_factor``: None (dropless, the default) or each expert's capacity as a multiple of an even share.
    """

    n_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int | None = None
    shared_ffn_dim: int = 0
    aux_loss_coef: float = 0.0
    aux_loss_scope: str = "micro_batch"
    capacity_factor: float | None = None

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
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ValueError(f"MoEConfig.aux_loss_scope must be one of {', '.join(AUX_LOSS_SCOPES)}, got "
                             f"{self.aux_loss_scope!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor must be > 0 (or None: dropless), got "
                             f"{self.capacity_factor!r}")

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
    #: set by a strategy under ``aux_loss_scope="global"``: sums a tensor over the data-parallel ranks,
    #: differentiably (:class:`lightning_par.parallel.router.SumOverRanks`); None: this process's tokens only
    router_statistics = None
    #: set by a pipeline strategy: ``aux_loss_backward(output, weighted_aux_loss)`` returns the output and starts the
    #: loss's backward with the output's (:class:`lightning_par.parallel.router.AuxLossInBackward`); None: the step
    #: adds :meth:`MoEGPT.aux_loss` to its loss
    aux_loss_backward = None

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.num_experts, self.top_k, self.aux_loss_coef = config.n_experts, config.top_k, config.aux_loss_coef
        self.aux_loss_scope, self.capacity_factor = config.aux_loss_scope, config.capacity_factor
        e, d, f = config.n_experts, config.dim, config.expert_ffn_dim
        self.router = nn.Linear(d, e, bias=False)
        self.w_gate = nn.Parameter(torch.empty(e, d, f))
        self.w_up = nn.Parameter(torch.empty(e, d, f))
        self.w_down = nn.Parameter(torch.empty(e, f, d))
        shared = config.shared_ffn_dim
        self.shared = FeedForward(replace(config, ffn_dim=shared)) if shared else None
        self.aux_loss: torch.Tensor | None = None  # the last forward's load-balancing loss (aux_loss_coef > 0)
        # for the logs (lightning_par.parallel.router.router_load): (token, choice) pairs routed to each expert and
        # dropped over capacity, summed over the forwards since the logger last read them
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped_tokens = 0

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
        """Route, compute each token's experts, combine; sets ``aux_loss`` when ``aux_loss_coef > 0``.

        Capacity (``capacity_factor`` set): each expert takes at most ``ceil(capacity_factor * N * top_k / E)`` of
        the ``N`` tokens of this forward (this rank's, under data or expert parallel: applied before the tokens
        travel); over it, the tokens latest in the batch's order (flattened [batch, sequence]) are dropped: their
        output from that expert is 0 (the block's residual carries them), their weight is not renormalised.

        Load-balancing loss: ``E * sum_e f_e * P_e``, ``f_e`` the fraction of the (token, choice) pairs the router
        sent to expert e (before any capacity), ``P_e`` the mean router probability of e, over this forward's tokens
        (``aux_loss_scope="micro_batch"``) or over every data-parallel rank's tokens of this forward (``"global"``).
        """
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights, probs = self.route(x)
        # each (token, choice) pair grouped by expert; the stable sort keeps the tokens' order within an expert
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        routed, counts = _routed(flat, self.num_experts)
        counted = counts_routing(x)
        if self.capacity_factor is not None and not x.is_meta:
            order, counts = self._within_capacity(order, routed, x.shape[0], counted)
        if counted:
            self.tokens_per_expert = routed if self.tokens_per_expert is None else self.tokens_per_expert + routed
        grouped = x[order // self.top_k]
        if self.token_exchange is None:
            out = self.experts(grouped, counts)
        else:
            out = self.token_exchange(grouped, counts, self.experts)
        # the dropped pairs' rows stay 0
        combined = out.new_zeros((flat.numel(), out.shape[-1])) if self.capacity_factor is not None \
            else torch.empty_like(out)
        combined = combined.index_copy_(0, order, out).view(-1, self.top_k, shape[-1])
        y = (combined * weights.unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.aux_loss_coef > 0:
            self.aux_loss = self._load_balancing_loss(routed, probs)
            if self.aux_loss_backward is not None:  # a pipeline: this micro-batch's loss trains from here
                y = self.aux_loss_backward(y, self.aux_loss_coef * self.aux_loss)
        return y.view(shape)

    def _within_capacity(self, order: torch.Tensor, routed: torch.Tensor, tokens: int,
                         counted: bool) -> tuple[torch.Tensor, list[int]]:
        """The grouped pairs kept (the first ``capacity`` of each expert's group, in token order) and the kept
        counts; adds the dropped pairs to ``dropped_tokens`` when ``counted``."""
        capacity = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
        starts = torch.cumsum(routed, 0) - routed
        place = torch.arange(order.numel(), device=order.device) - torch.repeat_interleave(starts, routed)
        kept = routed.clamp(max=capacity)
        if counted:
            self.dropped_tokens += int((routed - kept).sum())
        return order[place < capacity], kept.tolist()

    def _load_balancing_loss(self, routed: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        e = self.num_experts
        # numerators and token count in one tensor: one sum over the ranks (differentiable: the probabilities')
        stats = torch.cat([routed.to(probs.dtype), probs.sum(dim=0), probs.new_full((1,), probs.shape[0])])
        if self.aux_loss_scope == "global":
            if self.router_statistics is None:
                if not probs.is_meta:  # (a shape inference, before the strategy sets the sum, computes nothing)
                    check_global_scope(self)  # one process: its tokens are the global batch
            else:
                stats = self.router_statistics(stats)
        tokens = stats[-1]
        fraction, mean_prob = stats[:e] / (tokens * self.top_k), stats[e:2 * e] / tokens
        return e * (fraction * mean_prob).sum()


def _routed(chosen: torch.Tensor, experts: int) -> tuple[torch.Tensor, list[int]]:
    """How many of the ``chosen`` experts are each expert, as a tensor and a list. A tensor on the meta device has no
    values (a shape-only run: the pipeline's check of the units' chain), so its choices are taken as all the first
    expert's."""
    if chosen.is_meta:
        return chosen.new_zeros(experts), [chosen.numel()] + [0] * (experts - 1)
    routed = torch.bincount(chosen, minlength=experts)
    return routed, routed.tolist()


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
        """The weighted sum of the last forward's load-balancing losses over the layers, for the step to add to its
        loss (None when off, or when a pipeline strategy backpropagates them from the layers' outputs)."""
        losses = [m.aux_loss_coef * m.aux_loss for m in self.modules()
                  if isinstance(m, MoEFeedForward) and m.aux_loss is not None and m.aux_loss_backward is None]
        return torch.stack(losses).sum() if losses else None


class MoEGPTLightningModule(GPTLightningModule):
    """:class:`~lightning_par.examples.GPTLightningModule` with the mixture-of-experts GPT (:class:`MoEGPT`).

    Args (besides the dense module's):
        preset: a name in ``MOE_PRESETS`` ("tiny", "small").
        n_experts, top_k, expert_ffn_dim, shared_ffn_dim, aux_loss_coef, aux_loss_scope, capacity_factor: override
            the preset's (None keeps it; see :class:`MoEConfig`).
    """

    model_type = MoEGPT

    def __init__(self, preset: str = "tiny", vocab_size: int | None = None, n_layers: int | None = None,
                 n_experts: int | None = None, top_k: int | None = None, expert_ffn_dim: int | None = None,
                 shared_ffn_dim: int | None = None, aux_loss_coef: float | None = None,
                 aux_loss_scope: str | None = None, capacity_factor: float | None = None, lr: float = 3e-3,
                 weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 10,
                 min_lr_ratio: float = 0.1, optimizer: str = "adamw"):
        if preset not in MOE_PRESETS:
            raise ValueError(f"unknown MoE preset {preset!r}; valid presets: {', '.join(MOE_PRESETS)}")
        super().__init__(preset=preset, vocab_size=vocab_size, n_layers=n_layers, lr=lr, weight_decay=weight_decay,
                         betas=betas, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, optimizer=optimizer)
        given = dict(n_experts=n_experts, top_k=top_k, expert_ffn_dim=expert_ffn_dim, shared_ffn_dim=shared_ffn_dim,
                     aux_loss_coef=aux_loss_coef, aux_loss_scope=aux_loss_scope, capacity_factor=capacity_factor)
        dense = {k: v for k, v in vars(self.config).items() if k in vars(GPT_PRESETS["tiny"])}
        moe = {k: v for k, v in vars(MOE_PRESETS[preset]).items() if k not in dense}
        self.config = MoEConfig(**dense, **{**moe, **{k: v for k, v in given.items() if v is not None}})

    def compute_loss(self, batch) -> torch.Tensor:
        loss = super().compute_loss(batch)
        aux = self.model.aux_loss()
        return loss if aux is None else loss + aux
