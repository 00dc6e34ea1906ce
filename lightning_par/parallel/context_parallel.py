"""Context parallel: each sequence split over the ``cp`` ranks, attention still over the whole sequence.

Three pieces, each owned here and applied by someone else in a fixed place:

* **the transform** (:func:`apply_context_parallel`), applied by :func:`~lightning_par.parallel.parallelize.parallelize`
  to this rank's parts, after tensor parallel: global ``position_ids`` into the modules that run the model (the
  model holding the blocks, or each pipeline stage), a check that every block's attention came through here, a Hugging
  Face model's attention implementation, and the loss made the whole sequence's. It returns the
  :class:`ContextParallel` of this rank, which can :meth:`~ContextParallel.remove` all of it;
* **the batch transform** (:meth:`ContextParallel.shard`, cutting with
  :func:`~lightning_par.parallel.pipeline.batches.shard_sequence`): a batch reaches every ``cp`` rank of a replica
  whole (the sampler is over dp only) and each rank keeps its share, with causal load balancing (``2 * cp`` chunks,
  rank ``i`` keeps ``i`` and ``2 * cp - 1 - i``);
* **the step context** (:meth:`ContextParallel.step`), entered by the strategy around the step's forward and around
  its backward (for a pipeline, around the schedule, which runs both): a torch function mode under which
  ``F.scaled_dot_product_attention`` is the ring attention (:func:`sequence_attention`) and the hooks and the loss are
  live. Outside it the model is the plain model: torch's own attention, no positions added, the loss unchanged.
  Autograd does not carry a torch function mode into backward, so a block recomputed there re-enters it
  (:func:`recompute_contexts`, given to recompute by ``parallelize``); a GPU implementation whose
  switch is process state is live in backward through the step context around it.

Everything but attention is per token, so it runs on the shard as it is. Attention is ring attention over the cp
group: the shards' keys and values travel the ring; at each step the pair (local queries, block in hand) is one SDPA
call that is either fully visible, causal on its diagonal or partly skipped by the load balancing's chunk order, and
the partial outputs are merged by their log-sum-exp; no mask and nothing of size [T / cp, T] is made, so the flash
kernels apply and memory grows as T / cp. Backward recomputes each pair from the merged output and log-sum-exp. One
implementation serves a model whose attention calls ``F.scaled_dot_product_attention`` (the example GPT) and Hugging
Face models (Llama, Qwen2, ...: an implementation registered in ``AttentionInterface``, :data:`HF_ATTENTION`, set on
the model's config, with no mask function, so the model makes no local mask).

torch's ``torch.distributed.tensor.experimental.context_parallel`` is the same ring on CUDA, but over DTensors and
with no rule for the CPU kernel, hence the ring written here (see the comment above :class:`_RingAttention`); the step
context is where a GPU implementation would be entered instead.

The positions must be global for the model to be right: rotary tables from ``position_ids`` (Hugging Face models,
the example GPT) are; a learned position embedding indexed by ``arange`` of the local length is not. A model whose
forward takes no ``position_ids`` is refused (:func:`check_takes_positions`); a forward whose attention did not come
here is refused after its first call.

The loss is the mean over every counted token of the whole sequence: each rank's share (its token-loss sum over the
replica's token count) is summed over cp in forward (:meth:`ContextParallel.sum_over_cp`), so every cp rank reports
the replica's loss, and its gradient is scaled by cp in backward, because the data-parallel owners average gradients
over dp x cp.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from lightning_par.parallel.pipeline.batches import (
    IGNORE_INDEX,
    check_sequence_length,
    refuse_padding,
    sequence_ids,
    shard_positions,
    shard_sequence,
)
from lightning_par.parallel.pipeline.loss import ModelLoss
from lightning_par.topology import LayoutError

__all__ = ["HF_ATTENTION", "ContextParallel", "apply_context_parallel", "check_sequence_length",
           "check_takes_positions", "sequence_attention", "shard_positions"]

#: the attention implementation name registered with Hugging Face's ``AttentionInterface``
HF_ATTENTION = "lightning_par_context_parallel"

#: torch's own attention, whatever a recompute wrapper has put in ``F`` meanwhile (selective recompute swaps it)
_TORCH_SDPA = F.scaled_dot_product_attention


class _SumOverCP(torch.autograd.Function):
    """Forward: the sum over the cp group. Backward: the gradient times cp (the owners then average over cp)."""

    @staticmethod
    def forward(ctx: Any, share: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
        ctx.size = size
        total = share.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad * ctx.size, None, None


class _StepAttention(TorchFunctionMode):
    """The step context's mode: torch's ``F.scaled_dot_product_attention`` becomes :func:`sequence_attention`."""

    def __init__(self, context: ContextParallel) -> None:
        super().__init__()
        self.context = context

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _TORCH_SDPA:
            return _attention_call(self.context, *args, **kwargs)
        return func(*args, **kwargs)


@dataclass
class ContextParallel:
    """This rank's context parallel: its cp group, the positions of the batch it is working on, and what the
    transform set on the model (:meth:`remove` undoes it)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    positions: Tensor | None = None  # this rank's global positions of the current batch [T / cp] (or [B, T / cp])
    #: packed documents of the forward in progress: each token's document [B, T], the whole sequence in order
    documents: Tensor | None = None
    #: the positions the model was given in the forward in progress (its own attention mask derives from them)
    model_positions: Tensor | None = None
    _local_mask: Tensor | None = field(default=None, repr=False)  # the model's mask from them, made once per forward
    targets: Tensor | None = None  # a dict batch: next-token targets of its labels, this rank's share
    attention_calls: int = 0  # in the model's forward in progress
    positions_given: int = 0  # forwards given this batch's positions since it was cut
    padding_checked: bool = False  # the next batch's attention_mask was checked on the host (check_padding)
    #: the mode of the step in progress (None outside a step: the model is the plain model)
    _mode: _StepAttention | None = field(default=None, repr=False)
    _undo: ExitStack = field(default_factory=ExitStack, repr=False)
    #: for the setup line: where the positions go, and the loss made the whole sequence's
    described: str = ""

    @classmethod
    def on(cls, mesh: DeviceMesh) -> ContextParallel:
        """The context of this rank on the ``cp`` mesh."""
        return cls(group=mesh.get_group(), size=mesh.size(), rank=mesh.get_local_rank())

    # -- the batch ---------------------------------------------------------------------------------------------
    def shard(self, batch: Any) -> Any:
        """The batch transform: this rank's share of ``batch`` (a tuple ``(inputs, targets)`` or a Hugging Face
        dict), cut along the sequence; its positions (and a dict's shifted targets) are kept for the step."""
        cut = shard_sequence(batch, self.size, self.rank, padding_checked=self.padding_checked)
        self.padding_checked = False
        self.positions, self.targets, self.positions_given = cut.positions, cut.targets, 0
        return cut.batch

    def shard_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A step's ``(batch, ...)`` with the batch cut (:meth:`shard`)."""
        return (self.shard(args[0]), *args[1:]) if args else args

    def check_padding(self, batch: Any) -> None:
        """Refuse a dict batch's padding ``attention_mask`` while the batch is still on the host (before it is
        moved): there the check costs nothing, where on the device it would stop the host every step."""
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if isinstance(mask, Tensor) and mask.device.type == "cpu":
            refuse_padding(mask)
            self.padding_checked = True

    # -- the step ----------------------------------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        return self._mode is not None

    @contextmanager
    def step(self) -> Generator[None, None, None]:
        """The step context: entered around the step's forward and around its backward (nested entries are one)."""
        if self._mode is not None:
            yield None
            return
        self._mode = _StepAttention(self)
        try:
            with self._mode:
                yield None
        finally:
            self._mode = None

    # -- positions into the model ------------------------------------------------------------------------------
    def position_ids(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The forward's keywords with this batch's global ``position_ids`` [1, T / cp] added where none were given
        (for a forward pre-hook); None when there is nothing to add."""
        self.documents = self.model_positions = self._local_mask = None
        given = kwargs.get("position_ids")
        if self.positions is None and given is None:
            return None
        length = self.positions.size(-1) if self.positions is not None else given.size(-1)
        seq = next((v for v in (*args, *kwargs.values()) if isinstance(v, Tensor) and v.dim() >= 2), None)
        if seq is not None and seq.size(1) != length:
            raise LayoutError(
                f"context parallel: the model was called on a sequence of {seq.size(1)} tokens, not on this step's "
                f"shard ({length} tokens); under cp only the training, validation and test steps "
                "cut their batches (generation and predict_step are not supported: run them without cp).")
        self.positions_given += 1
        if given is not None:  # the batch's own positions, cut (packed documents): the ring keeps to documents
            self.model_positions = given
            self.documents = self._whole_sequence_documents(given)
            return None
        positions = self.positions if self.positions.dim() == 2 else self.positions.unsqueeze(0)
        self.model_positions = positions
        if self.positions.dim() == 2:  # a dict batch's position_ids the step did not give the model itself
            self.documents = self._whole_sequence_documents(positions)
        return {**kwargs, "position_ids": positions}

    def _whole_sequence_documents(self, local: Tensor) -> Tensor | None:
        """Each token's document [B, T] over the whole sequence, from every cp rank's positions (all-gathered):
        transformers' rule (a document starts where a position does not follow the one before by 1) needs the
        sequence in order. None when every row is one document."""
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(shards, local, group=self.group)
        length = local.size(-1) * self.size
        whole = torch.empty(*local.shape[:-1], length, dtype=local.dtype, device=local.device)
        for rank, shard in enumerate(shards):
            whole[..., shard_positions(length, self.size, rank, device=local.device)] = shard
        return sequence_ids(whole)

    def local_mask(self) -> Tensor | None:
        """The block-causal mask [B, 1, T / cp, T / cp] that the positions the model was given make of this rank's
        shard alone (what a model that masks packed documents itself, like the example GPT, passes to attention);
        None without positions or when they hold one document per row."""
        given = self.model_positions
        if given is None and self.positions is not None:  # (a caller that gave the shard's positions itself)
            given = self.positions if self.positions.dim() == 2 else self.positions.unsqueeze(0)
        if self._local_mask is None and given is not None:
            ids = sequence_ids(given)
            if ids is not None:
                n = ids.size(-1)
                causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
                self._local_mask = ((ids[..., :, None] == ids[..., None, :]) & causal).unsqueeze(-3)
        return self._local_mask

    # -- the loss ----------------------------------------------------------------------------------------------
    def sum_over_cp(self, share: Tensor) -> Tensor:
        """``share`` summed over the cp ranks (forward); backward scales by cp, undoing the owners' cp average."""
        if not self.positions_given:  # the loss of a forward that ran without this batch's positions
            raise LayoutError("context parallel: the model computed a loss on this step's shard without being given "
                              "its global position_ids (the strategy's hook on the model did not run); this is a "
                              "bug, please report it with the layout.")
        return _SumOverCP.apply(share, self.group, self.size)

    def token_count(self, targets: Tensor) -> Tensor:
        """The counted targets (not ``-100``) of the whole sequence: this rank's, summed over cp."""
        count = (targets != IGNORE_INDEX).sum().to(torch.float64)
        dist.all_reduce(count, group=self.group)
        return count

    def mean_loss(self, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        """``loss_fn(outputs, targets)`` (a token mean of one shard) made the token mean of the whole sequence while
        a step runs (``loss_fn`` itself outside one)."""

        def loss(outputs: Tensor, targets: Tensor) -> Tensor:
            if not self.in_step:
                return loss_fn(outputs, targets)
            if self.targets is not None and self.targets.shape == targets.shape:
                targets = self.targets  # a dict batch's labels shifted on the whole sequence, not on the shard
            local = loss_fn(outputs, targets)
            counted = (targets != IGNORE_INDEX).sum()
            share = local * counted / self.token_count(targets).clamp(min=1).to(local.dtype)
            return self.sum_over_cp(share)

        return loss

    def model_loss(self, loss_function: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """A Hugging Face model's ``loss_function`` made the token mean (or the sum over ``num_items_in_batch``) of
        the whole sequence while a step runs; the labels are shifted on the whole sequence (:attr:`targets`), not on
        the shard."""

        def loss(logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: Any = None,
                 shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
            if not self.in_step:
                return loss_function(logits=logits, labels=labels, vocab_size=vocab_size,
                                     num_items_in_batch=num_items_in_batch, shift_labels=shift_labels, **kwargs)
            if shift_labels is None:
                if self.targets is None or self.targets.shape != labels.shape:
                    raise LayoutError("context parallel: the model's labels are not the shard of the batch's labels "
                                      "this step cut; pass the batch's 'labels' to the model as they are.")
                shift_labels = self.targets
            total = self.token_count(shift_labels) if num_items_in_batch is None else num_items_in_batch
            local_sum = loss_function(logits=logits, labels=labels, vocab_size=vocab_size, num_items_in_batch=1,
                                      shift_labels=shift_labels, **kwargs)
            total = torch.as_tensor(total, dtype=local_sum.dtype, device=local_sum.device)
            return self.sum_over_cp(local_sum / total.clamp(min=1))

        return loss

    # -- undoing the transform ---------------------------------------------------------------------------------
    def remove(self) -> None:
        """Undo what :func:`apply_context_parallel` set on the model: hooks, attention implementation, loss."""
        self._undo.close()


def _step_mode() -> _StepAttention | None:
    """The mode of the step in progress on this thread (on the torch function mode stack), or None."""
    from lightning_par._compat import function_mode_stack

    return next((m for m in reversed(function_mode_stack()) if isinstance(m, _StepAttention)), None)


def recompute_contexts() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """``checkpoint``'s ``context_fn`` for a block recomputed under cp (called as its forward starts): the forward
    runs in the step already; the recomputation, inside backward, gets the step's attention again (autograd does not
    carry a torch function mode into backward). A function of this module, not a method: torch.compile takes a
    plain function as a ``context_fn``."""
    mode = _step_mode()
    return nullcontext(), (_StepAttention(mode.context) if mode is not None else nullcontext())


def _active() -> ContextParallel:
    """The context of the step in progress on this thread."""
    mode = _step_mode()
    if mode is not None:
        return mode.context
    raise LayoutError("context-parallel attention ran outside a context-parallel step: the model was called on a "
                      "shard's attention outside the training, validation or test step (its Hugging Face "
                      f"attention is {HF_ATTENTION!r} from the layout's setup on).")


@torch.compiler.disable  # a graph break in a compiled block: the ring's sends and receives run eagerly
def sequence_attention(query: Tensor, key: Tensor, value: Tensor, *, is_causal: bool = True,
                       scale: float | None = None, dropout_p: float = 0.0, enable_gqa: bool = False,
                       context: ContextParallel | None = None) -> Tensor:
    """Attention of this rank's queries [B, H, T / cp, D] over the whole sequence: ring attention over the cp group
    (:class:`_RingAttention`), no mask. ``context``: default, the step's in progress."""
    context = context if context is not None else _active()
    context.attention_calls += 1
    if dropout_p:
        raise LayoutError(
            f"context parallel: attention dropout (p={dropout_p}) is not supported: the attention is computed per "
            "pair of sequence chunks and recomputed in backward, which would need each pair's dropout pattern "
            "replayed. Set the model's attention dropout to 0 (e.g. attention_dropout=0.0), or train without cp.")
    heads, kv_heads = query.size(1), key.size(1)
    if kv_heads != heads and (not enable_gqa or heads % kv_heads):
        raise LayoutError(f"context parallel: {heads} query heads over {kv_heads} key/value heads needs "
                          "enable_gqa=True and a whole number of query heads per key/value head.")
    if key.size(2) != query.size(2) or value.size(2) != query.size(2):
        raise LayoutError(f"context parallel: queries, keys and values must be this rank's shard of one sequence; "
                          f"got lengths {query.size(2)}, {key.size(2)} and {value.size(2)} (a key/value cache is not "
                          "supported under cp).")
    documents = context.documents
    if documents is not None and not is_causal:
        raise LayoutError("context parallel: packed documents need causal attention (is_causal=True); this "
                          "attention is not causal.")
    return _RingAttention.apply(query, key, value, context, is_causal, scale, documents)


# -- ring attention ---------------------------------------------------------------------------------------------------
# Why a ring written here: torch's ``torch.distributed.tensor.experimental.context_parallel`` is this ring, but it
# takes DTensor inputs on a DeviceMesh (it rewrites the model's buffers in place and swaps the SDPA op on DTensors),
# and its op table holds only CUDA's flash, efficient and cuDNN kernels: torch 2.13 has no rule for the CPU kernel
# (``_scaled_dot_product_flash_attention_for_cpu``), so it cannot run on CPU/gloo, where this project is tested.
# Why a ring and not an all-gather of K/V followed by per-pair attention: each rank then holds only its own K/V
# (O(T / cp)) in forward and backward -- an all-gather keeps the whole sequence's K/V per layer for backward (cp x
# the ring's) -- and the sends overlap the attention of the chunk pair in hand.
#
# Rank r holds chunks r and 2cp-1-r of the sequence (causal load balancing). At ring step i it holds the K/V of rank
# s = r - i (mod cp); under the causal mask that block is one SDPA call, never a mask:
#   s == r: its own shard, causal (the early chunk precedes the late one, so is_causal over the two is exact);
#   s <  r: every query of r sees chunk s (earlier than both of r's chunks) and not chunk 2cp-1-s (later);
#   s >  r: only r's late chunk 2cp-1-r sees anything: both of s's chunks, in full.
# Partial outputs are merged by their log-sum-exp; backward recomputes each pair's gradient from the merged output
# and log-sum-exp (exact: softmax(s_ij - lse_i) of the pair is its share of the whole row), with the K/V travelling
# the ring again and their gradients travelling with them, back to their owner after cp hops.


@dataclass(frozen=True)
class _Kernel:
    """One device's SDPA that returns its log-sum-exp, and its backward, as (q, k, v) -> (out, lse [B, H, T])."""

    device: str

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None,
                mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        from lightning_par import _compat

        if self.device == "cpu":
            out, lse = _compat.sdpa_flash_cpu(q, k, v, 0.0, causal, attn_mask=_bias(mask, q), scale=scale)[:2]
        elif mask is not None:  # packed documents: the memory-efficient kernel, which takes an additive bias
            out, lse = _compat.sdpa_efficient_cuda(q, k, v, _bias(mask, q), True, 0.0, False, scale=scale)[:2]
            lse = lse[..., :q.size(2)]
        elif q.dtype in (torch.float16, torch.bfloat16):
            out, lse = _compat.sdpa_flash_cuda(q, k, v, 0.0, causal, False, scale=scale)[:2]
        else:  # the memory-efficient kernel pads its log-sum-exp to a multiple of 32 queries
            out, lse = _compat.sdpa_efficient_cuda(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
            lse = lse[..., :q.size(2)]
        return out, lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 scale: float | None, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        from lightning_par import _compat

        if self.device == "cpu":
            return _compat.sdpa_flash_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=_bias(mask, q),
                                                   scale=scale)
        if mask is not None:
            padded = F.pad(lse, (0, -lse.size(-1) % 32))
            return _compat.sdpa_efficient_cuda_backward(dout, q, k, v, _bias(mask, q), out, padded, None, None, 0.0,
                                                        [True, True, True, False], False, scale=scale)[:3]
        if q.dtype in (torch.float16, torch.bfloat16):  # no dropout: the RNG state and varlen offsets are unused
            return _compat.sdpa_flash_cuda_backward(dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0,
                                                    causal, None, None, scale=scale)
        padded = F.pad(lse, (0, -lse.size(-1) % 32))
        return _compat.sdpa_efficient_cuda_backward(dout, q, k, v, None, out, padded, None, None, 0.0,
                                                    [True, True, True, False], causal, scale=scale)[:3]


def _bias(mask: Tensor | None, q: Tensor) -> Tensor | None:
    """A boolean mask [B, 1, Tq, Tk] as the kernels take it: an additive bias of the queries' dtype (0 or -inf) over
    every head, its rows' stride a multiple of 16 elements (the memory-efficient kernel's alignment)."""
    if mask is None:
        return None
    b, _, rows, cols = mask.shape
    bias = torch.zeros(b, 1, rows, cols + (-cols) % 16, dtype=q.dtype, device=q.device)[..., :cols]
    bias.masked_fill_(~mask, float("-inf"))
    return bias.expand(b, q.size(1), rows, cols)


def _expand_heads(tensor: Tensor, groups: int) -> Tensor:
    """Key/value heads repeated for their query heads (GQA), for kernels that take equal head counts."""
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=1)


def _fold_heads(grad: Tensor, groups: int) -> Tensor:
    """The gradient of :func:`_expand_heads`: each key/value head's query-head group summed."""
    if groups == 1:
        return grad
    b, h, t, d = grad.shape
    return grad.view(b, h // groups, groups, t, d).sum(2)


class _Ring:
    """Sends to the next cp rank and receives from the previous one, asynchronously."""

    def __init__(self, context: ContextParallel) -> None:
        self.group = context.group
        self.next = dist.get_global_rank(self.group, (context.rank + 1) % context.size)
        self.prev = dist.get_global_rank(self.group, (context.rank - 1) % context.size)

    def shift(self, tensor: Tensor, tag: int = 0) -> Callable[[], Tensor]:
        """Start sending ``tensor`` on; returns a wait giving the previous rank's tensor. (K/V blocks and their
        gradients may be in flight together: told apart by ``tag``.)"""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, received, self.prev, self.group, tag)])

        def wait() -> Tensor:
            for work in works:
                work.wait()
            return received

        return wait


def _pairs(rank: int, size: int, causal: bool) -> Iterator[tuple[str, str, bool]]:
    """Per ring step (the K/V of rank ``rank - step`` in hand): the local query rows and the block's key rows of
    the step's one SDPA call (``"all"``, or the ``"first"`` / ``"second"`` chunk), and whether it is causal."""
    for step in range(size):
        source = (rank - step) % size
        if not causal:
            yield "all", "all", False
        elif source == rank:
            yield "all", "all", True
        elif source < rank:
            yield "all", "first", False
        else:
            yield "second", "all", False


def _rows(part: str, length: int) -> slice:
    half = length // 2
    return {"all": slice(None), "first": slice(0, half), "second": slice(half, length)}[part]


class _RingAttention(torch.autograd.Function):
    """Exact causal (or full) attention of the local shard over the whole sequence, a ring over the cp group."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, context: ContextParallel, causal: bool,
                scale: float | None, documents: Tensor | None = None) -> Tensor:
        kernel = _Kernel(query.device.type)
        groups = query.size(1) // key.size(1)
        ring = _Ring(context)
        length = query.size(2)
        # the partial results merged in fp32 (bf16 outputs would lose the merge's precision), the input's if wider
        acc = torch.promote_types(query.dtype, torch.float32)
        q = query.contiguous()
        block = torch.stack([key, value]).contiguous()  # one message per step: [2, B, KV, T / cp, D]
        out: Tensor | None = None
        lse: Tensor | None = None
        for step, (rows, cols, pair_causal) in enumerate(_pairs(context.rank, context.size, causal)):
            wait = ring.shift(block) if step < context.size - 1 else None  # the next block travels meanwhile
            r, c = _rows(rows, length), _rows(cols, length)
            mask = _document_mask(documents, context, step, r, c, length)
            if mask is not None and not bool(mask.any()):  # no query of this pair sees a key of its documents
                if wait is not None:
                    block = wait()
                continue
            k, v = (_expand_heads(t[:, :, c], groups) for t in block)
            part_out, part_lse = kernel.forward(q[:, :, r].contiguous(), k, v, pair_causal and mask is None, scale,
                                                mask)
            part_out, part_lse = part_out.to(acc), part_lse.to(acc)
            if mask is not None:  # a query that sees no key here: nothing to merge (the kernel's lse says 0)
                seen = mask.any(-1)
                part_lse = part_lse.masked_fill(~seen, float("-inf"))
                part_out = part_out.masked_fill(~seen.unsqueeze(-1), 0.0)
            if out is None or lse is None:  # step 0: the own shard, whose causal diagonal every query sees
                out, lse = part_out, part_lse
            else:
                merged = torch.logaddexp(lse[:, :, r], part_lse)
                out[:, :, r] = (out[:, :, r] * (lse[:, :, r] - merged).exp().unsqueeze(-1)
                                + part_out * (part_lse - merged).exp().unsqueeze(-1))
                lse[:, :, r] = merged
            if wait is not None:
                block = wait()
        assert out is not None and lse is not None
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.context, ctx.causal, ctx.scale, ctx.documents = context, causal, scale, documents
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        context: ContextParallel = ctx.context
        kernel = _Kernel(query.device.type)
        groups = query.size(1) // key.size(1)
        ring = _Ring(context)
        length = query.size(2)
        acc = torch.promote_types(query.dtype, torch.float32)
        q, dout = query.contiguous(), grad_out.contiguous()
        dq = torch.zeros(query.shape, dtype=acc, device=query.device)
        block = torch.stack([key, value]).contiguous()
        # the gradient of the K/V block in hand travels the ring with it, back to the block's owner
        grads = torch.zeros(block.shape, dtype=acc, device=block.device)
        for step, (rows, cols, pair_causal) in enumerate(_pairs(context.rank, context.size, ctx.causal)):
            wait_block = ring.shift(block) if step < context.size - 1 else None
            r, c = _rows(rows, length), _rows(cols, length)
            mask = _document_mask(ctx.documents, context, step, r, c, length)
            if mask is None or bool(mask.any()):  # (a pair with nothing visible adds no gradient)
                k, v = (_expand_heads(t[:, :, c], groups) for t in block)
                dq_part, dk, dv = kernel.backward(dout[:, :, r].contiguous(), q[:, :, r].contiguous(), k, v,
                                                  out[:, :, r].contiguous(), lse[:, :, r].contiguous(),
                                                  pair_causal and mask is None, ctx.scale, mask)
                dq[:, :, r] += dq_part
                grads[0][:, :, c] += _fold_heads(dk, groups)
                grads[1][:, :, c] += _fold_heads(dv, groups)
            if context.size > 1:  # (a group of one sends nothing: a rank cannot send to itself over gloo)
                grads = ring.shift(grads, tag=1)()  # after cp hops the gradients are home
            if wait_block is not None:
                block = wait_block()
        return dq.to(query.dtype), grads[0].to(key.dtype), grads[1].to(value.dtype), None, None, None, None


def _document_mask(documents: Tensor | None, context: ContextParallel, step: int, rows: slice, cols: slice,
                   length: int) -> Tensor | None:
    """Packed documents: which keys of the ring step's block (that of rank ``rank - step``) each local query sees,
    [B, 1, queries, keys] -- earlier or the same token of the same document -- or None without documents."""
    if documents is None:
        return None
    total = length * context.size
    mine = shard_positions(total, context.size, context.rank, device=documents.device)[rows]
    theirs = shard_positions(total, context.size, (context.rank - step) % context.size, device=documents.device)[cols]
    same = documents[:, mine, None] == documents[:, None, theirs]
    return (same & (mine[:, None] >= theirs[None, :])).unsqueeze(1)


def _attention_call(context: ContextParallel, query: Tensor, key: Tensor, value: Tensor,
                    attn_mask: Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention``'s signature, answered by :func:`sequence_attention` (within a step)."""
    if attn_mask is not None:
        # a mask the model made from its positions (packed documents, the example GPT) covers only this shard; the
        # ring applies the documents over the whole sequence instead. Any other mask is refused.
        expected = context.local_mask()
        if expected is None or attn_mask.shape != expected.shape or not torch.equal(attn_mask, expected):
            raise LayoutError(
                "context parallel: the model called scaled_dot_product_attention with an explicit attn_mask, made "
                "for the local shard of the sequence; only is_causal=True (or no mask), or the block-causal mask of "
                "packed documents made from the position_ids the model was given, can be applied over the whole "
                "sequence. Use is_causal=True, or train without cp.")
        is_causal = True
    return sequence_attention(query, key, value, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                              enable_gqa=enable_gqa, context=context)


def hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """A Hugging Face attention function (``AttentionInterface``): [B, H, T, D] in, [B, T, H, D] out."""
    if kwargs.get("sliding_window") is not None:
        raise LayoutError("context parallel: sliding-window attention is not supported; use a model without it.")
    gqa = query.size(1) != key.size(1)
    causal = getattr(module, "is_causal", True)
    out = sequence_attention(query, key, value, is_causal=causal, scale=scaling,
                             dropout_p=dropout if module.training else 0.0, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def use_hf_attention(model: nn.Module, undo: ExitStack | None = None) -> bool:
    """Set a Hugging Face model's attention to :func:`hf_attention` (``undo`` gets the way back); False when
    ``model`` is no such model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, hf_attention)
    configs = {id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None),
                                                              "_attn_implementation_internal")}
    for sub in configs.values():
        _check_plain_causal(type(model).__name__, sub)
    _check_mask_not_read(model)
    for sub in configs.values():
        if undo is not None:
            undo.callback(setattr, sub, "_attn_implementation_internal", sub._attn_implementation_internal)
        sub._attn_implementation_internal = HF_ATTENTION
    return True


def _check_plain_causal(name: str, config: Any) -> None:
    """Refuse, before the first step, a config whose layers use chunked attention (Llama-4's ``attention_chunk_size``):
    context parallel's ring computes plain causal attention over the whole sequence, so the chunks would be ignored --
    trained 6e-3 off one process, silently, before this check (the conformance matrix)."""
    kinds = set(getattr(config, "layer_types", None) or ())
    chunk = getattr(config, "attention_chunk_size", None)
    if "chunked_attention" in kinds or (isinstance(chunk, int) and not kinds):
        raise LayoutError(
            f"context parallel: {name} uses chunked attention (config.attention_chunk_size={chunk}), whose mask the "
            "ring attention does not apply (it computes plain causal attention over the whole sequence). Train it "
            "without cp.")


def _check_mask_not_read(model: nn.Module) -> None:
    """Refuse a layer whose forward reads the attention mask's values (``attention_mask[:, 0]``: HY-V4's sparse-
    attention indexer picking each query's keys): under cp the ring applies causality over the whole sequence and
    transformers builds no mask for it, so the layer would get None (a crash on one rank at the first step, before
    this check: the conformance matrix). Models (``PreTrainedModel``s) build the mask and are not asked."""
    from transformers import PreTrainedModel

    seen: set[type] = set()
    for name, module in model.named_modules():
        kind = type(module)
        if kind in seen or isinstance(module, PreTrainedModel):
            continue
        seen.add(kind)
        try:
            reads = "attention_mask" in inspect.signature(kind.forward).parameters and \
                re.search(r"\battention_mask\s*\[", inspect.getsource(kind.forward)) is not None
        except (OSError, TypeError, ValueError):
            continue
        if reads:
            raise LayoutError(
                f"context parallel: {kind.__name__} ({name}) reads the attention mask's values in its forward, "
                "but under cp the ring attention applies causality over the whole sequence and no mask is built "
                "for the layers. Train it without cp.")


def check_takes_positions(model: nn.Module) -> None:
    """Refuse a model whose forward takes no ``position_ids``: under cp its positions would be the shard's local
    ones (0..T/cp-1), silently wrong."""
    if not _takes_positions(model):
        raise LayoutError(
            f"context parallel gives each rank a load-balanced share of the sequence, so the model must take the "
            f"global positions of its tokens: {type(model).__name__}.forward has no `position_ids` argument (a "
            "position embedding from `arange` of the local length would be wrong on every rank but the first). "
            "Accept `position_ids` [batch, sequence] and use them for the positions (rotary tables or a position "
            "embedding), as Hugging Face models and lightning_par.examples.GPT do; or train without cp.")


def _takes_positions(model: nn.Module) -> bool:
    # the class's forward: a pipeline stage's instance forward is the stage adapter's, which passes them on
    try:
        return "position_ids" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


def install(model: nn.Module, context: ContextParallel, n_blocks: int) -> list[Any]:
    """Hooks on ``model`` (a module called with the batch's inputs), live while a step runs: global position ids
    into its forward, and a check that its ``n_blocks`` blocks' attention ran here. Returns the hook handles."""

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not context.in_step:
            return None
        context.attention_calls = 0
        added = context.position_ids(args, kwargs)
        return None if added is None else (args, added)

    def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if context.in_step and context.attention_calls < n_blocks:
            raise LayoutError(
                f"context parallel: {type(module).__name__} holds {n_blocks} blocks but only "
                f"{context.attention_calls} attention calls went through the context-parallel attention, so some "
                "attention saw only this rank's share of the sequence. The attention must call "
                "F.scaled_dot_product_attention (is_causal=True, no attn_mask) or be a Hugging Face attention "
                "(AttentionInterface); train this model without cp.")

    return [model.register_forward_pre_hook(before, with_kwargs=True), model.register_forward_hook(after)]


def _model_running(root: nn.Module, blocks: Sequence[nn.Module]) -> nn.Module:
    """The module that runs ``root``'s blocks on the batch's inputs: the outermost module between ``root``
    (exclusive) and the blocks' container whose forward takes ``position_ids`` (a ``GPT``, a ``LlamaForCausalLM``),
    else the outermost of them (refused by :func:`check_takes_positions`); ``root`` when it holds the blocks."""
    ids = {id(b) for b in blocks}
    parents = [name.split(".")[:-1] for name, m in root.named_modules() if id(m) in ids]
    if not parents:
        raise LayoutError(f"context parallel needs the model's repeated blocks inside {type(root).__name__}; none "
                          "were found (declare them with block_types=).")
    common: list[str] = []
    for parts in zip(*parents, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    chain = [root.get_submodule(".".join(common[:i])) for i in range(1, len(common) + 1)]
    return next((m for m in chain if _takes_positions(m)), chain[0] if chain else root)


def apply_context_parallel(root: nn.Module, stages: Sequence[nn.Module], blocks: Sequence[nn.Module],
                           mesh: DeviceMesh, pipelined: bool = False) -> ContextParallel:
    """Apply context parallel to this rank's part of the model (``root``, the LightningModule; its ``stages`` under
    pp; the ``blocks`` it holds): see the module docstring. Refused, alike on every rank: a model that takes no
    ``position_ids``, or that has no loss cp can make the whole sequence's. Returns this rank's context."""
    runs = list(stages) if pipelined else [_model_running(root, blocks)]
    for module in runs:
        check_takes_positions(module)
    context = ContextParallel.on(mesh)
    loss = _wrap_loss(context, root, pipelined)
    for module in runs:
        use_hf_attention(module, context._undo)
        inside = {id(m) for m in module.modules()}
        for handle in install(module, context, sum(id(b) in inside for b in blocks)):
            context._undo.callback(handle.remove)
    context.described = (f"global position_ids into {type(runs[0]).__name__}, {loss} the token mean of the whole "
                         "sequence")
    return context


def _wrap_loss(context: ContextParallel, root: nn.Module, pipelined: bool) -> str:
    """Make the loss the step computes the whole sequence's (undone by :meth:`ContextParallel.remove`)."""
    name = type(root).__name__
    if callable(getattr(root, "loss_fn", None)):
        own = vars(root).get("loss_fn")  # an instance attribute, restored; else the class's method shows again
        context._undo.callback(lambda: setattr(root, "loss_fn", own) if own is not None
                               else vars(root).pop("loss_fn", None))
        root.loss_fn = context.mean_loss(root.loss_fn)
        return f"{name}.loss_fn"
    model = next((m for m in root.modules() if ModelLoss.of(m) is not None), None)
    if model is None:
        raise LayoutError(
            f"context parallel (cp={context.size}) computes the loss over every token of the whole sequence, so it "
            f"must know the loss: {name} defines no loss_fn(outputs, targets) and holds no Hugging Face causal LM "
            "with a loss of its own. Define loss_fn (a token mean) and compute the step's loss with it, or train a "
            "Hugging Face *ForCausalLM returning `self.model(**batch).loss`.")
    if pipelined:
        raise LayoutError(
            f"context parallel with pipeline parallel computes the loss on the last stage, per micro-batch, from "
            f"{name}.loss_fn(outputs, targets); the model's own loss ({type(model).__name__}.loss_function) is not "
            "supported there. Define loss_fn (a token mean) and compute_loss(batch), as "
            "lightning_par.examples.HFCausalLMLightningModule does, or train without pp or without cp.")
    previous = model.loss_function
    context._undo.callback(setattr, model, "loss_function", previous)
    model.loss_function = context.model_loss(previous)
    return f"{type(model).__name__}.loss_function"
