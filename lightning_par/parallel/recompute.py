"""Activation recompute per block: trade compute for the activation memory a block holds for backward.

* ``"full"``: a block keeps only its input; its forward runs again inside backward (2sbh bytes per block in 16-bit,
  Korthikanti et al. Table 2).
* ``"selective"``: only the attention core (``scaled_dot_product_attention``: QK^T, softmax, dropout, times V) is
  recomputed -- Megatron's selective recompute: the part whose saved tensors grow with the sequence squared (the
  5as/h term of Table 2) while costing few FLOPs to redo. It keeps q, k and v and drops what the attention kernel
  would save besides (its output, and the score matrix where the kernel is not a fused one).

The block's ``forward`` is replaced on the instance (not wrapped in another module), so parameter names stay those
of the unsplit model -- what checkpoints, the pipeline split and ZeRO-3 grouping all rely on. Apply it after tensor
parallel and before data parallel (FSDP2's hooks then wrap the recomputed forward), as torchtitan orders them.
Written here because torch's ``checkpoint_wrapper`` inserts a module (and a name component), and torch's selective
checkpointing policies cache every saved op output, which holds more than plain autograd for the ops kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_par.topology import RECOMPUTE_KINDS, LayoutError


def check_recompute(kind: str) -> None:
    if kind not in RECOMPUTE_KINDS:
        raise LayoutError(f"recompute={kind!r} is not available; use one of {list(RECOMPUTE_KINDS)} (none keeps "
                          "every activation; selective recomputes the attention core; full recomputes each block).")


#: ``checkpoint``'s ``context_fn``: the contexts its forward and its recomputation run in (see :func:`apply_recompute`)
ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]


@contextmanager
def _attention_recomputed(context_fn: ContextFn | None) -> Iterator[None]:
    inner = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = functools.partial(checkpoint, inner, use_reentrant=False) \
        if context_fn is None else functools.partial(_checkpoint_in, context_fn, inner)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = inner


def _full(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # a call of `checkpoint` in a function of ours, not a partial of it: torch.compile recognises the direct call and
    # traces the recomputation into the block's graph (a partial of `checkpoint` itself is run eagerly, uncompiled)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


# torch.compile takes only dispatch modes from a context_fn: with one, the checkpoint call runs eagerly; the block's
# forward inside it is still compiled, as a frame of its own (recursive=False)
@torch.compiler.disable(recursive=False)
def _checkpoint_in(context_fn: ContextFn, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _selective(forward: Callable[..., Any], *args: Any, context_fn: ContextFn | None = None, **kwargs: Any) -> Any:
    with _attention_recomputed(context_fn):
        return forward(*args, **kwargs)


def apply_recompute(blocks: Sequence[nn.Module], kind: str, context_fn: ContextFn | None = None) -> int:
    """Make each block recompute activations in backward (``kind`` "full" or "selective"); returns how many.

    ``context_fn`` (``checkpoint``'s): what the recomputation must run in besides the forward's autocast and RNG
    state, which backward does not carry: context parallel's attention (its torch function mode is thread-local
    state autograd leaves behind)."""
    check_recompute(kind)
    if kind == "none":
        return 0
    for block in blocks:
        if kind == "full":
            full = _full if context_fn is None else functools.partial(_checkpoint_in, context_fn)
            block.forward = functools.partial(full, block.forward)
        else:
            block.forward = functools.partial(_selective, block.forward, **(
                {} if context_fn is None else {"context_fn": context_fn}))
    return len(blocks)
