"""Checkpoint state as a data-parallel owner holds it: what a rank saves, and what a load fills, by parameter name.

A sharded checkpoint (:mod:`lightning_par.plugins.sharded_checkpoint`) reads and writes files; what goes into them is
answered here, by the owner of the parameters' data-parallel layout (``NoSync.states`` in
:mod:`~lightning_par.parallel.gradient_sync`). Every answer uses the same keys -- the parameter's name (FQN) in the
unsplit model, ``state.<fqn>.<field>`` and ``param_groups.<fqn>.<key>`` for optimizers, with the full (global)
shapes -- so a checkpoint of any layout loads into any other. :class:`ParamStates` serves optimizers that hold the
model's own parameters (plain, DTensor, FSDP2-sharded) through torch's ``torch.distributed.checkpoint.state_dict``
API; :class:`~lightning_par.parallel.zero_state.ZeroStates` serves ZeRO-1/2, whose optimizers hold bucket shards.

A load ends with the owner's refresh: whatever the layout keeps beside the loaded tensors (ZeRO-1/2's buckets,
gathered from the loaded shards) is made equal to them before the load returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# Optimizer state flattened to one entry per parameter and field ("state.layers.0.attn.q_proj.weight.exp_avg",
# "param_groups.layers.0.attn.q_proj.weight.lr"): ranks holding different parameters (pipeline stages) then write
# different keys -- a nested "param_groups" list would be one key, written by one rank -- and a checkpoint loads
# into another split of the parameters.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
FULL = StateDictOptions(full_state_dict=True)


class ParamStates:
    """The checkpoint state of a model whose optimizers hold its own parameters (every owner but ZeRO-1/2's)."""

    def wait(self) -> None:
        """Let communication still writing the parameters land before they are read."""

    def model_state(self, module: nn.Module) -> dict[str, Any]:
        """The entries of ``module``'s state this rank saves (and a load fills in place): DTensor shards where
        parameters are sharded."""
        return get_model_state_dict(module)

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state in the flat per-parameter format."""
        return get_optimizer_state_dict(module, optimizer, options=FLAT)

    def optimizer_target(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """:meth:`optimizer_state` of an optimizer whose state exists, for a load to fill in place."""
        return self.optimizer_state(module, optimizer)

    def load_model_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        """After a load filled :meth:`model_state`'s tensors: the rest into ``module``, and the refresh."""
        set_model_state_dict(module, state)

    def load_optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """After a load filled :meth:`optimizer_target`'s tensors: the hyper-parameters and the rest."""
        set_optimizer_state_dict(module, optimizer, state, options=FLAT)

    def load_full_model_state(self, module: nn.Module, full: dict[str, Any]) -> None:
        """Whole tensors (as one process holds them) into ``module``: each rank keeps its share. ``full`` is left as
        it was (torch distributes the values of the dict it is given in place)."""
        set_model_state_dict(module, dict(full), options=FULL)

    def optimizer_groups(self, optimizer: torch.optim.Optimizer) -> list[Sequence[Tensor]]:
        """The model parameters of each of ``optimizer``'s groups, in the group's order (what a plain, position-keyed
        optimizer state refers to)."""
        return [group["params"] for group in optimizer.param_groups]

    def load_full_optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """Whole tensors keyed by parameter name (``{"state": {fqn: {...}}, "param_groups": [...]}``) into the
        existing state of ``optimizer`` (:func:`materialize_optimizer_state`): each rank keeps its share."""
        set_optimizer_state_dict(module, optimizer, state, options=FULL)


#: the answers of every owner that holds the model's own parameters
PARAM_STATES = ParamStates()


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily-made state (a step with zero gradients at lr 0), so a load can fill it in place."""
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
