"""Parameters the forward never reaches under DistributedDataParallel (ZeRO-0 with replicas; issue 40's matrix: a
multimodal model's audio or vision tower under ep2 / cp2): refused at the first step's end, before any update, naming
the modules -- not torch's "Expected to have finished reduction" at the second forward after a step whose buckets
were left unreduced. In this process, on a gloo group of one (DDP's reducer is the same)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_par.parallel.gradient_sync import _refuse_unused
from lightning_par.topology import LayoutError


class WithATower(nn.Module):
    def __init__(self):
        super().__init__()
        self.text = nn.Linear(4, 4)
        self.audio_tower = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))  # never called by forward

    def forward(self, x):
        return self.text(x)


def _first_step(model: nn.Module) -> DistributedDataParallel:
    ddp = DistributedDataParallel(model)
    ddp(torch.randn(2, 4)).sum().backward()
    return ddp


def test_unused_parameters_are_named_before_the_first_update(one_process_group):
    torch.manual_seed(0)
    with pytest.raises(LayoutError, match=r"4 parameters of WithATower got no gradient in the first step "
                                          r"\(audio_tower.0, audio_tower.1\).*requires_grad_\(False\)"):
        _refuse_unused(_first_step(WithATower()), None)


def test_frozen_or_used_parameters_pass(one_process_group):
    model = WithATower()
    model.audio_tower.requires_grad_(False)
    _refuse_unused(_first_step(model), None)
    _refuse_unused(_first_step(nn.Linear(4, 4)), None)
