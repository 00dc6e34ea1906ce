"""A mixture of experts' fused tensors read from a ``save_pretrained`` directory that holds them one per expert
(lightning_par/plugins/pretrained_experts.py), in one process: which file tensors a rank's slice reads, and the
values, for the slices expert parallel (experts ``[2:4]`` of 4, ``Shard(0)`` over ep2) and tensor parallel's
``packed_colwise`` (rows of each projection) give."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from lightning_par.plugins import pretrained
from lightning_par.plugins.pretrained import load_pretrained
from lightning_par.plugins.pretrained_experts import FusedTensor, converted_tensors
from tests.launch.hf_moe import moe_model

pytest.importorskip("transformers")


def _saved(tmp_path, arch: str):
    """A tiny ``arch`` model moved off its initialisation, saved by save_pretrained (one tensor per expert)."""
    model = moe_model(arch)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(tmp_path / arch)
    return model, tmp_path / arch


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_fused_expert_slice_reads_only_its_experts_and_rows(tmp_path, monkeypatch, arch):
    model, path = _saved(tmp_path, arch)
    reads: list[tuple[str, int]] = []
    original = pretrained._SafetensorsFile.read

    def counted(self, name, slices):
        out = original(self, name, slices)
        reads.append((name, out.numel() * out.element_size()))
        return out

    monkeypatch.setattr(pretrained._SafetensorsFile, "read", counted)
    with ExitStack() as stack:
        weights = pretrained._Weights(path, stack)
        converted = converted_tensors(model, weights.names(), weights.shape, weights.dtype)
        weights.convert(converted)
        gate_up, down = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"
        assert isinstance(converted[gate_up], FusedTensor) and converted[gate_up].shape == (4, 64, 64)
        assert converted[down].shape == (4, 64, 32)
        full = dict(model.named_parameters())
        # ep2, rank 1: experts 2 and 3, whole
        for name in (gate_up, down):
            reads.clear()
            piece = weights.piece(name, (slice(2, 4), slice(0, full[name].shape[1]), slice(0, full[name].shape[2])))
            assert torch.equal(piece, full[name][2:4])
            assert sum(n for _, n in reads) == piece.numel() * 4  # only these experts' bytes were read
            assert all(".experts.2." in file or ".experts.3." in file for file, _ in reads), reads
        # tensor parallel's packed_colwise, rank 1 of 2: rows 16:32 of the gate and of the up projection (2 x 32 rows)
        reads.clear()
        rows = [weights.piece(gate_up, (slice(0, 4), slice(i * 32 + 16, i * 32 + 32), slice(0, 64))) for i in (0, 1)]
        assert torch.equal(torch.cat(rows, dim=1), torch.cat([full[gate_up][:, 16:32], full[gate_up][:, 48:64]], 1))
        assert sum(n for _, n in reads) == 2 * 4 * 16 * 64 * 4
        # a slice across both projections and some columns
        assert torch.equal(weights.piece(gate_up, (slice(1, 3), slice(24, 40), slice(8, 16))),
                           full[gate_up][1:3, 24:40, 8:16])
    # the whole model, through load_pretrained: every tensor as saved
    torch.manual_seed(5)
    fresh = moe_model(arch)
    assert load_pretrained(fresh, path, prefix="") == len(fresh.state_dict())
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in fresh.state_dict().items())


def test_a_per_expert_file_missing_an_expert_is_refused_naming_the_fused_tensor(tmp_path):
    model, path = _saved(tmp_path, "qwen3_moe")
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(pretrained.CheckpointError, match=r"not in the file, first \['model.layers.0.mlp.experts."
                                                         r"gate_up_proj'\]"):
        load_pretrained(moe_model("qwen3_moe"), path, prefix="")
