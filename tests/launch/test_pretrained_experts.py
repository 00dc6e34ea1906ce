"""A mixture of experts' fused tensors read from a ``save_pretrained`` directory that holds them one per expert
(lightning_par/plugins/pretrained_experts.py): in one process, which file tensors a rank's slice reads, and the
values, for the slices expert parallel (experts ``[2:4]`` of 4, ``Shard(0)`` over ep2) and tensor parallel's
``packed_colwise`` (rows of each projection) give; on 2 spawned ranks (full set), experts held as DTensors
``Shard(0)`` on an ep2 mesh filled by ``load_pretrained``."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

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


def _ep_worker(rank: int, world: int, store: str, out: str) -> None:
    """Rank ``rank`` of an ep2 mesh: the fused experts as DTensors ``Shard(0)`` (as expert parallel holds them), read
    from the per-expert directory ``out/qwen3_moe``; reports what it read and holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from tests.harness import gloo_rank

    with gloo_rank(rank, world, store, out) as report:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        torch.manual_seed(5)
        model = moe_model("qwen3_moe")
        for layer in model.model.layers:
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name)
                local = torch.zeros_like(full[: full.shape[0] // world])
                setattr(experts, name, torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                                            shape=full.shape, stride=full.stride())))
        reads: list[tuple[str, int]] = []
        original = pretrained._SafetensorsFile.read

        def counted(self, name, slices):
            piece = original(self, name, slices)
            reads.append((name, piece.numel() * piece.element_size()))
            return piece

        pretrained._SafetensorsFile.read = counted
        try:
            load_pretrained(model, Path(out) / "qwen3_moe", prefix="")
        finally:
            pretrained._SafetensorsFile.read = original
        saved = torch.load(Path(out) / "saved.pt", weights_only=True)
        held = {n: p.to_local() for n, p in model.named_parameters() if isinstance(p, DTensor)}
        report["held_equal"] = all(torch.equal(v, saved[n][rank * 2:(rank + 1) * 2]) for n, v in held.items())
        report["others_equal"] = all(torch.equal(p, saved[n]) for n, p in model.named_parameters() if n not in held)
        report["experts_read"] = sorted({int(f.split(".experts.")[1].split(".")[0]) for f, _ in reads
                                         if ".experts." in f})
        report["expert_bytes_read"] = sum(n for f, n in reads if ".experts." in f)
        report["expert_bytes_held"] = sum(v.numel() * v.element_size() for v in held.values())


@pytest.mark.launch(ranks=2, full=True)
def test_ep_shards_read_only_their_experts_from_a_per_expert_directory(tmp_path):
    """Two ranks of an ep mesh, each holding 2 of the 4 experts as DTensors ``Shard(0)``: FromPretrained's reader
    gives each exactly its experts' values and reads only their bytes (half of every expert tensor)."""
    from tests.harness import spawn_reports

    model, _ = _saved(tmp_path, "qwen3_moe")
    torch.save(dict(model.state_dict()), tmp_path / "saved.pt")
    reports = spawn_reports(_ep_worker, tmp_path, nprocs=2)
    for rank, report in enumerate(reports):
        assert report["held_equal"] and report["others_equal"], report
        assert report["experts_read"] == [2 * rank, 2 * rank + 1], report
        assert report["expert_bytes_read"] == report["expert_bytes_held"] == 2 * (2 * 64 * 64 + 2 * 64 * 32) * 4
