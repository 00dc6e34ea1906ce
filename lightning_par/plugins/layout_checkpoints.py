"""A layout's checkpoints, as Lightning's strategy hooks ask for them: one object the engine delegates to.

Two formats, decided by the layout (``Layout.sharded_checkpoint``): ZeRO-0 without tp or pp saves one file, Lightning's
own (through the strategy's CheckpointIO, on rank 0); every other layout a DCP directory that every rank writes
(:mod:`~lightning_par.plugins.sharded_checkpoint`), optionally in the background
(:mod:`~lightning_par.plugins.async_checkpoint`). What goes into a DCP checkpoint, and what a load fills and refreshes,
the data-parallel owner answers (``strategy.gradient_sync.states``): nothing here knows ZeRO from FSDP.

Both formats share the non-finite guard (:class:`~lightning_par.run.bad_steps.CheckpointGuard`: a checkpoint with
non-finite weights is refused and never replaces the last finite one) and the ``last`` link of
``ModelCheckpoint(save_last="link")``, made only once its target is committed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_par._compat import optimizers_to_device
from lightning_par.plugins import checkpoint_files, sharded_checkpoint
from lightning_par.plugins.async_checkpoint import AsyncSaver
from lightning_par.run.bad_steps import CheckpointGuard
from lightning_par.topology import LayoutError

_outside_inference_mode = torch.inference_mode(False)

#: the entry of a sharded checkpoint's meta.json naming the layout that saved it (dp, tp, pp, cp, ep, zero_stage)
SAVED_LAYOUT = "lightning_par_layout"


class LayoutCheckpoints:
    """The checkpoints of ``strategy`` (a :class:`~lightning_par.strategies.engine.LayoutStrategy`), which it reads
    when asked -- ``layout`` (a planned strategy picks it at launch), ``lightning_module``, ``optimizers``,
    ``gradient_sync`` and its collectives -- so it always answers for the layout in force.

    Args:
        strategy: the strategy whose checkpoint hooks delegate here.
        async_save: write sharded checkpoints in the background (DCP's ``async_save``).
    """

    def __init__(self, strategy: Any, async_save: bool = False) -> None:
        self.strategy = strategy
        self.async_save = async_save
        if async_save and not self.sharded:
            raise LayoutError("async_save=True writes sharded (DCP) checkpoints; this layout (ZeRO stage 0 without tp "
                              "or pp) saves one file. Use a ZeRO stage 1-3, tp or pp layout, or Lightning's "
                              "AsyncCheckpointIO plugin for one-file checkpoints.")
        self.guard = CheckpointGuard()
        self.saver: AsyncSaver | None = None  # the background saver (async_save), made once the process group exists
        self.restored_here = False  # the last load restored model and optimizers itself (not Lightning)
        # pp > 1: the unsplit model's state entries (shape, dtype) and parameter names, in order
        self.model_entries: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.model_params: list[str] = []

    @property
    def sharded(self) -> bool:
        """Each rank writes its part (a DCP directory), rather than rank 0 one file."""
        return self.strategy.layout.sharded_checkpoint

    def start(self) -> None:
        """Every rank, once the process group exists: the background saver (it creates a process group of its
        own)."""
        if self.async_save and self.saver is None:
            self.saver = AsyncSaver(self.strategy.is_global_zero, self.strategy.barrier)

    def remember_unsplit(self, module: torch.nn.Module) -> None:
        """Before a pipeline split: the whole model's entries, which :meth:`model_state_dict` answers on every
        stage, and its parameter order (a plain one-file optimizer state refers to it)."""
        self.model_entries = {k: (v.shape, v.dtype) for k, v in module.state_dict().items() if isinstance(v, Tensor)}
        self.model_params = [name for name, _ in module.named_parameters()]

    # -- state ---------------------------------------------------------------------------------------------------
    # (state, save and load run outside inference mode, which a user may call them in: a DTensor's detach() in
    # state_dict() fails on an inference tensor, and loaded weights must stay trainable)
    @_outside_inference_mode
    def model_state_dict(self) -> dict[str, Any]:
        """The whole model's state on every rank, as Lightning's sharded strategies give it
        (``ModelParallelStrategy(save_distributed_checkpoint=True)``): the unsplit model's keys in its order, each
        value as this layout holds it -- a DTensor where parameters are sharded (ZeRO-3, tp), the full replicated
        tensor under ZeRO-0-2 (waited for after ZeRO-1/2's gathers). Under pipeline parallel another stage's entry
        is a meta tensor of its full shape and dtype (held by that stage's ranks; no memory, no communication).
        Sharded checkpoints save their own form (the data-parallel owner's ``states``)."""
        module = self.strategy.lightning_module
        states = self.strategy.gradient_sync.states
        states.wait()  # ZeRO-1/2: the gathers after the step land first
        state = sharded_checkpoint.model_state(module) if self.strategy.layout.shards_parameters else \
            module.state_dict()
        if not self.model_entries:  # no pipeline split: every entry is here
            return state
        return {key: state[key] if key in state else torch.empty(shape, dtype=dtype, device="meta")
                for key, (shape, dtype) in self.model_entries.items()}

    @_outside_inference_mode
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """One file: by position, as Lightning saves it, with the parameters' names. Sharded: keyed by parameter
        name, one entry per parameter and field, with the parameters' full shapes -- the format every layout reads."""
        module = self.strategy.lightning_module
        if not self.sharded:
            return sharded_checkpoint.with_param_names(module, optimizer, optimizer.state_dict())
        return self.strategy.gradient_sync.states.optimizer_state(module, optimizer)

    # -- save ----------------------------------------------------------------------------------------------------
    @_outside_inference_mode
    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        strategy = self.strategy
        if strategy.lightning_module is not None and not self.guard.allow(strategy, filepath):
            return  # non-finite weights never replace the last finite checkpoint (a warning named the step)
        if not self.sharded:
            if strategy.is_global_zero:
                strategy.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        path = Path(strategy.broadcast(str(filepath)))
        # each rank's own entries (DCP writes every entry once); ZeRO-1/2: from the optimizer's shards, the fp32
        # masters under bf16-mixed
        checkpoint["state_dict"] = strategy.gradient_sync.states.model_state(strategy.lightning_module)
        # the layout that wrote it, for people and tools (meta.json): a load reads the shards' own offsets instead
        checkpoint[SAVED_LAYOUT] = {**dataclasses.asdict(strategy.dims), "zero_stage": strategy.layout.zero_stage}
        if self.saver is not None:
            self.saver.save(checkpoint, path)
        else:
            sharded_checkpoint.save(checkpoint, path, is_writer=strategy.is_global_zero, barrier=strategy.barrier)

    def wait(self) -> None:
        """The save in flight commits (or its error is raised): before the run ends."""
        if self.saver is not None:
            self.saver.wait()

    def remove(self, filepath: Any) -> None:
        if self.guard.refused is not None:
            return  # the newest save was refused: what is on disk may be the last finite checkpoint
        if self.strategy.is_global_zero:
            if self.saver is not None:
                self.saver.remove(Path(filepath))  # after the save in flight commits
            else:
                sharded_checkpoint.remove(Path(filepath))

    def own_last_links(self, trainer: Trainer) -> None:
        """Make ``ModelCheckpoint(save_last="link")``'s ``last`` link through :meth:`link_last`. Lightning links
        as soon as ``save_checkpoint`` returns, deleting the old link first; under ``async_save`` the new checkpoint
        does not exist yet, so a crash then would leave ``last`` naming nothing and ``ckpt_path="last"`` would start
        over from step 0. Lightning has no hook for this, hence the callback's (static) method is replaced."""
        if not self.sharded:
            return
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last == "link":
                callback._link_checkpoint = self.link_last  # type: ignore[method-assign]

    def link_last(self, trainer: Trainer, filepath: str, linkpath: str) -> None:
        """Point ``linkpath`` at ``filepath`` atomically, once ``filepath`` is committed (at once for a sync save)."""
        if self.guard.refused is not None:
            return  # refused (non-finite): ``last`` keeps naming the last finite checkpoint
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            if self.saver is not None:
                self.saver.link(Path(filepath), Path(linkpath))
            else:
                checkpoint_files.link(Path(filepath), Path(linkpath))
        self.strategy.barrier()

    # -- load ----------------------------------------------------------------------------------------------------
    @_outside_inference_mode
    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Any lightning-par checkpoint into this layout: a DCP directory from any layout (states by parameter
        name, restored here with the owner's refresh), or one file (Lightning's own format), which a one-file
        layout leaves to Lightning (:meth:`load_model_state`, :meth:`load_optimizer_state`)."""
        strategy = self.strategy
        path = Path(strategy.broadcast(str(checkpoint_path)))
        self.restored_here = self.sharded or checkpoint_files.resolve(path).is_dir()
        if not self.restored_here:
            torch.cuda.empty_cache()  # as Lightning's Strategy.load_checkpoint
            return strategy.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert strategy.lightning_module is not None
        # only a fit restores optimizer states (as Lightning): a test or predict from a checkpoint reads the weights,
        # and a weights-only save has no optimizer states (the optimizers are a previous fit's, if any)
        trainer = getattr(strategy.lightning_module, "_trainer", None)
        fitting = trainer is None or trainer.state.fn == TrainerFn.FITTING
        return sharded_checkpoint.load(path, strategy.lightning_module, strategy.optimizers if fitting else None,
                                       states=strategy.gradient_sync.states, weights_only=weights_only,
                                       model_params=self.model_params)

    @_outside_inference_mode
    def load_model_state(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Lightning's restore of the model from one file (nothing to do when :meth:`load` restored it)."""
        if not self.restored_here:
            self.strategy.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's restore of the optimizers from one file (nothing to do when :meth:`load` restored them)."""
        if self.restored_here:
            return
        for optimizer, state in zip(self.strategy.optimizers, checkpoint["optimizer_states"], strict=False):
            optimizer.load_state_dict(state)
        optimizers_to_device(self.strategy.optimizers, self.strategy.root_device)

    @property
    def lightning_restores_optimizer(self) -> bool:
        """Lightning restores the optimizers (one file under a one-file layout); otherwise :meth:`load` did."""
        return not self.restored_here
