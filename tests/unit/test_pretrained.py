"""Pretrained weights read by slices (lightning_par/plugins/pretrained.py), in one process: the slice reader, the
checks made before anything is read, and the refusal of pickled weights. The launched runs (ZeRO-3, tp2, pp2,
tp2 x pp2 at parity with one process) are in tests/launch/test_export.py, the memory they save in
tests/launch/test_share_memory.py."""

from __future__ import annotations

import itertools
from contextlib import ExitStack

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_par.parallel.deferred_init import deferred_init
from lightning_par.parallel.materialize import materialize_share
from lightning_par.plugins.checkpoint_files import CheckpointError
from lightning_par.plugins.pretrained import PretrainedWeights, _Weights


def test_a_slice_is_read_alone_and_equals_the_tensors_slice(tmp_path):
    tensors = {"w": torch.randn(6, 10, 4), "b": torch.randn(12).to(torch.bfloat16), "s": torch.tensor(3.0),
               "i": torch.randint(0, 9, (5, 7))}
    save_file(tensors, tmp_path / "x.safetensors")
    with ExitStack() as stack:
        weights = _Weights(tmp_path / "x.safetensors", stack)
        for name, full in tensors.items():
            assert torch.equal(weights.piece(name, None), full)
            # every way of cutting each dimension into its first part, its middle and its end
            cuts = [[slice(0, n), slice(0, max(1, n // 2)), slice(n // 3, n), slice(1, max(2, n - 1))]
                    for n in full.shape]
            for slices in itertools.product(*cuts):
                assert torch.equal(weights.piece(name, slices), full[slices]), (name, slices)


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def test_a_mismatch_is_named_before_anything_is_read(tmp_path):
    good = _Two()
    state = {k: v for k, v in good.model.state_dict().items()}
    save_file({**state, "0.weight": torch.zeros(16, 9)}, tmp_path / "shape.safetensors")
    save_file({**state, "1.bias": torch.zeros(4, dtype=torch.int64)}, tmp_path / "dtype.safetensors")
    save_file({k: v for k, v in state.items() if k != "1.bias"}, tmp_path / "missing.safetensors")
    with deferred_init(threshold=0) as record:  # checked on the meta device: nothing allocated, nothing read
        target = _Two()
    with pytest.raises(CheckpointError, match=r"0\.weight: shape \[16, 9\] in the file, \[16, 8\]"):
        PretrainedWeights(tmp_path / "shape.safetensors").check(target)
    with pytest.raises(CheckpointError, match=r"1\.bias: torch\.int64 in the file, torch\.float32"):
        PretrainedWeights(tmp_path / "dtype.safetensors").check(target)
    with pytest.raises(CheckpointError, match=r"not in the file, first \['1\.bias'\]"):
        PretrainedWeights(tmp_path / "missing.safetensors").check(target)
    assert all(p.is_meta for p in target.parameters())
    # bf16 weights into an fp32 model are fine (cast); the file fills every name, so no initialisation is computed
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, tmp_path / "bf16.safetensors")
    weights = PretrainedWeights(tmp_path / "bf16.safetensors")
    fills = weights.check(target)
    record.capture(target)
    stats = materialize_share(target, record, torch.device("cpu"), skip=fills)
    assert stats["transient_bytes"] == 0  # nothing was replayed
    assert weights.load(target) == 4
    for name, value in target.model.state_dict().items():
        assert torch.equal(value, state[name].to(torch.bfloat16).float())


def test_pickled_weights_are_refused_with_the_reason(tmp_path):
    (tmp_path / "hf").mkdir()
    torch.save(_Two().model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickled .bin weights.*safe_serialization=True"):
        PretrainedWeights(tmp_path / "hf").check(_Two())
