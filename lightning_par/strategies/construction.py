"""How the engine takes the LightningModule: built deferred where the layout splits parameters, and laid out once.

``configure_model`` (under ZeRO-3, tp or pp) and ``Trainer.init_module(empty_init=True)`` (under any layout) build
the model without memory (:func:`~lightning_par.parallel.deferred_init.deferred_init`: large tensors on the meta
device, their initialisation recorded). :class:`Construction` keeps that record until setup, where
:func:`~lightning_par.parallel.parallelize.parallelize` materialises each rank's share of it with the values one
process would have drawn. The full model never exists on any rank.

A model is laid out once: a later stage of the same Trainer and model (fit, then validate / test / predict, or fit
again) keeps it split, sliced and sharded; another Trainer's strategy cannot lay it out again.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager

import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules import module as nn_module

from lightning_par._compat import distributed_is_initialized
from lightning_par.parallel.deferred_init import DeferredInit, deferred_init
from lightning_par.topology import LayoutError


class Construction:
    """One strategy's model: the record of its deferred construction until setup, and the model it laid out."""

    def __init__(self) -> None:
        self._pending: DeferredInit | None = None  # Trainer.init_module(empty_init=True)'s, not yet taken
        self._record: DeferredInit | None = None  # taken as the model's, for parallelize to materialise
        self._laid_out: nn.Module | None = None  # the LightningModule this strategy's layout was applied to
        self._token = object()  # marks the models this strategy laid out (see claim)

    def laid_out(self, module: nn.Module | None) -> bool:
        """Whether ``module`` is the one this strategy laid out (a later stage of the same model)."""
        return self._laid_out is not None and self._laid_out is module

    def claim(self, module: nn.Module, sharded: bool, described: str) -> None:
        """Mark ``module`` as this strategy's to lay out; a model another Trainer's strategy split or sharded (its
        DTensors live on that strategy's mesh, a pipeline rank holds only its stages) is refused, alike on every rank,
        before any collective. ``described``: this strategy and its layout, for that error."""
        # (what the strategy that laid it out left on the model: a token of that strategy, not the strategy itself,
        # which the model would keep alive)
        token, theirs_sharded, theirs = getattr(module, "_lightning_par_laid_out", (None, False, ""))
        if token is not None and token is not self._token and theirs_sharded:
            raise LayoutError(
                f"{type(module).__name__} was laid out by another Trainer's strategy ({theirs}: its parameters are "
                "split or sharded across the ranks). Run validate/test/predict (or fit again) on the same Trainer, "
                "or give a new Trainer a new model and the checkpoint (`ckpt_path=`, or `lightning-par export "
                "CKPT OUT.ckpt` and `load_from_checkpoint`).")
        module._lightning_par_laid_out = (self._token, sharded, described)

    def done(self, module: nn.Module) -> None:
        """``module`` is laid out: later stages keep it as it is."""
        self._laid_out = module

    @contextmanager
    def init_module(self) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)``: build deferred, and keep the record until the model is known
        (``configure_model``'s context, or setup). The small tensors it made for real go to the meta device as well
        (their values kept): every parameter and buffer is on meta until setup, as under Lightning's sharded
        strategies."""
        made: list[tuple[nn.Module, str, Tensor]] = []

        def registered(module: nn.Module, name: str, tensor: Tensor | None) -> None:
            if tensor is not None:
                made.append((module, name, tensor))

        hooks = [nn_module.register_module_parameter_registration_hook(registered),
                 nn_module.register_module_buffer_registration_hook(registered)]
        try:
            with deferred_init() as record:
                yield None
        finally:
            for hook in hooks:
                hook.remove()
        record.to_meta(made)
        self._pending = record

    @contextmanager
    def configure_model(self, module_of: Callable[[], nn.Module], shards_parameters: bool
                        ) -> Generator[None, None, None]:
        """Around ``configure_model``: build deferred when the layout splits parameters, or take the model
        ``init_module`` built. ``module_of()`` is the LightningModule (known once the hook has run)."""
        if self._pending is not None and not self._pending.stats["deferred_bytes"] and not self._pending.kept:
            self._pending = None  # init_module built no large tensor: the model is configure_model's to build
        if not shards_parameters and self._pending is None:
            yield None
            return
        if self._pending is not None:  # built under Trainer.init_module(empty_init=True) already
            record, self._pending = self._pending, None
            yield None  # (what configure_model adds now is built eagerly; its small tensors are broadcast below)
        else:
            with deferred_init() as record:
                yield None
        self.adopt(module_of(), record)

    def adopt_pending(self, module: nn.Module) -> None:
        """At setup: an ``init_module(empty_init=True)`` model without a ``configure_model`` hook."""
        if self._pending is not None:
            record, self._pending = self._pending, None
            self.adopt(module, record)

    def adopt(self, module: nn.Module, record: DeferredInit) -> None:
        """Take a deferred construction as ``module``'s: global rank 0's random draws and small tensors on every rank.

        Every rank takes global rank 0's construction: its random draws, replayed for the deferred tensors, and its
        small tensors (made for real), broadcast -- small by definition. The replicas agree, and every share (each
        stage, slice and shard) holds the single process's values, even where ranks drew differently (unseeded, or
        seeded per rank); the weights themselves are never broadcast."""
        if distributed_is_initialized() and dist.get_world_size() > 1:
            states = [record.random_states()]
            dist.broadcast_object_list(states, src=0)
            record.use_random_states(states[0])
            for tensor in module.state_dict().values():
                if isinstance(tensor, Tensor) and not tensor.is_meta:
                    dist.broadcast(tensor, src=0)
            for tensor in record.kept:  # (init_module's small tensors, on meta until materialised)
                dist.broadcast(tensor, src=0)
        record.capture(module)
        self._record = record

    def take(self) -> DeferredInit | None:
        """The record for :func:`~lightning_par.parallel.parallelize.parallelize` (once), or None: built eagerly."""
        record, self._record = self._record, None
        return record

    @staticmethod
    @contextmanager
    def unmaterialised_stays(module: nn.Module | None) -> Generator[None, None, None]:
        """Around Lightning's teardown, which moves the model to the CPU: a model whose setup stopped (a LayoutError)
        before this rank materialised its share has nothing to move, and copying a meta tensor would raise over the
        error the user must see."""
        if module is None or not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            yield None
            return
        module.cpu = lambda: module  # type: ignore[method-assign]
        try:
            yield None
        finally:
            module.__dict__.pop("cpu", None)
