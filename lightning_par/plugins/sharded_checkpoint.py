"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, in parallel.

A checkpoint is a directory: DCP's files for the model and optimizer states, plus ``meta.pt`` with the rest of
Lightning's checkpoint (loops, callbacks, schedulers). It is written as ``NAME.partial`` and renamed to ``NAME``
only after every rank finished and ``meta.pt`` was written last, so a crash part-way leaves no directory that
loads as valid: :func:`load` refuses one without ``meta.pt``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

META = "meta.pt"

# Optimizer state flattened to one entry per parameter and field ("state.layers.0.attn.q_proj.weight.exp_avg",
# "param_groups.layers.0.attn.q_proj.weight.lr"): ranks holding different parameters (pipeline stages) then write
# different keys -- a nested "param_groups" list would be one key, written by one rank -- and a checkpoint loads
# into another split of the parameters.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state(module: nn.Module) -> dict[str, Any]:
    """The model's state keyed by original parameter names (FQNs), as DTensor shards where it is sharded."""
    return get_model_state_dict(module)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQNs (for optimizers over the module's own parameters)."""
    return get_optimizer_state_dict(module, optimizer, options=_FLAT)


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily-made state (a step with zero gradients at lr 0), so DCP can load into it."""
    if optimizer.state:
        return
    saved = []
    for group in optimizer.param_groups:
        saved.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        if lr is not None:
            group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def save(checkpoint: dict[str, Any], path: Path, is_writer: bool, barrier: Callable[[], None]) -> None:
    """Write ``checkpoint`` (Lightning's dict, with sharded "state_dict" and "optimizer_states") to ``path``."""
    partial = path.with_name(path.name + ".partial")
    if is_writer and partial.exists():
        shutil.rmtree(partial)
    barrier()
    sharded = {"state_dict": checkpoint.pop("state_dict")}
    for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
        sharded[f"optimizer_{index}"] = state
    dcp.save(sharded, checkpoint_id=partial)
    barrier()
    if is_writer:
        torch.save(checkpoint, partial / META)  # last: its presence is what makes the directory a checkpoint
        remove(path)
        os.replace(partial, path)
    barrier()


def load(path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], fsdp: bool) -> dict[str, Any]:
    """Load the shards into ``module`` and ``optimizers`` in place; return the rest of Lightning's checkpoint.

    ``fsdp``: the module is sharded with FSDP2 and its optimizers hold its own (DTensor) parameters; otherwise the
    module is replicated and the optimizers hold ZeRO-1/2 shard parameters, keyed by position.
    """
    if not (path / META).is_file():
        raise FileNotFoundError(
            f"{path} is not a complete lightning-par checkpoint (no {META}): it was not written to the end. "
            "Resume from an earlier checkpoint."
        )
    state: dict[str, Any] = {"state_dict": model_state(module) if fsdp else module.state_dict()}
    for index, optimizer in enumerate(optimizers):
        if fsdp:
            state[f"optimizer_{index}"] = optimizer_state(module, optimizer)
        else:
            materialize_optimizer_state(optimizer)
            state[f"optimizer_{index}"] = optimizer.state_dict()
    dcp.load(state, checkpoint_id=path)
    if fsdp:
        set_model_state_dict(module, state["state_dict"])
    else:
        module.load_state_dict(state["state_dict"])
    for index, optimizer in enumerate(optimizers):
        if fsdp:
            set_optimizer_state_dict(module, optimizer, state[f"optimizer_{index}"], options=_FLAT)
        else:
            optimizer.load_state_dict(state[f"optimizer_{index}"])
    return torch.load(path / META, weights_only=False)


def remove(path: Path) -> None:
    """Delete a checkpoint, file or directory."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
