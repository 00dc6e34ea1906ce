"""lightning_par.measure: state bytes by unique storage, collectives counted on a real 2-rank gloo group."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_par.measure import CommCounter, state_bytes, traffic_formula, zero_formula
from tests.harness import spawn_reports


def _adam_after_one_step(module: nn.Module) -> torch.optim.Adam:
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return optimizer


def test_state_bytes_plain_module_with_adam():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = _adam_after_one_step(module)
    psi = sum(p.numel() for p in module.parameters())
    measured = state_bytes(module, [optimizer])
    assert (measured["parameters"], measured["gradients"], measured["optimizer_states"]) == (4 * psi, 4 * psi, 8 * psi)
    assert measured["total"] == 16 * psi
    assert measured["by_device"] == {c: {"cpu": b} for c, b in zip(
        ("parameters", "gradients", "optimizer_states"), (4 * psi, 4 * psi, 8 * psi), strict=True)}
    assert {k: v for k, v in zero_formula(0, psi, 4).items()} == {
        "parameters": 4 * psi, "gradients": 4 * psi, "optimizer_states": 8 * psi, "total": 16 * psi}


def test_views_into_one_flat_buffer_count_once():
    """Parameters as views into one flat buffer (as the ZeRO-1/2 partitioner packs them), grads likewise."""
    module = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    psi = sum(p.numel() for p in module.parameters())
    flat, flat_grad = torch.zeros(psi + 3), torch.zeros(psi + 3)  # 3 elements of padding
    offset = 0
    for p in module.parameters():
        p.data = flat[offset:offset + p.numel()].view_as(p)
        p.grad = flat_grad[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    measured = state_bytes(module, [])
    assert measured["parameters"] == 4 * (psi + 3)  # the whole storage, padding included
    assert measured["gradients"] == 4 * (psi + 3)
    assert measured["optimizer_states"] == 0
    # a storage reached from two categories counts in the first
    module[0].weight.grad = flat[:128].view(16, 8)
    shared = state_bytes(module, [])
    assert (shared["parameters"], shared["gradients"]) == (4 * (psi + 3), 4 * (psi + 3))
    module[1].weight.grad = module[1].bias.grad = module[0].bias.grad = None
    assert state_bytes(module, [])["gradients"] == 0


def test_optimizer_only_params_grads_count_and_step_counters_skipped():
    """ZeRO-1/2 shard parameters live only in the optimizer: their grads count; Adam's 0-dim step does not."""
    module = nn.Linear(4, 4)
    shard = nn.Parameter(torch.zeros(10))
    optimizer = torch.optim.Adam([shard])
    shard.grad = torch.ones(10)
    optimizer.step()
    measured = state_bytes(module, [optimizer])
    assert measured["parameters"] == 4 * 20
    assert measured["gradients"] == 4 * 10
    assert measured["optimizer_states"] == 8 * 10


def test_dtensor_counts_its_local_shard(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(6, 5)
    module = nn.Module()
    module.weight = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    measured = state_bytes(module, [])
    assert measured["parameters"] == 4 * module.weight.to_local().numel() == 4 * 30
    assert module.weight.numel() == 30  # the global count, as the StateReport probe reports it


def test_formulas():
    assert zero_formula(1, 100, 4) == {"parameters": 400, "gradients": 400, "optimizer_states": 200, "total": 1000}
    assert zero_formula(2, 100, 4)["gradients"] == 100
    assert zero_formula(3, 100, 4) == {"parameters": 100, "gradients": 100, "optimizer_states": 200, "total": 400}
    assert traffic_formula(0, 100, 4) == traffic_formula(2, 100, 4) == 150
    assert traffic_formula(3, 100, 4) == 225
    assert traffic_formula(3, 100, 1) == 0
    with pytest.raises(ValueError):
        zero_formula(4, 1, 1)


# ----------------------------------------------------------------------------------------------------------------------
# Two real ranks over gloo
# ----------------------------------------------------------------------------------------------------------------------
def _counted(counter: CommCounter) -> dict:
    return {"sent": counter.sent_elements(), "calls": counter.calls(),
            "records": [list(r) for r in counter.records]}


def _two_rank_worker(rank: int, world: int, store: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    report = {}
    try:
        # plain collectives, including the deprecated spellings that call the new ones (counted once)
        with CommCounter() as c:
            dist.all_reduce(torch.ones(10))
            dist.reduce_scatter_tensor(torch.empty(6), torch.ones(12))
            dist.all_gather_into_tensor(torch.empty(12), torch.ones(6))
            dist.broadcast(torch.ones(4), src=0)
            c.pause()
            dist.all_reduce(torch.ones(1000))  # not counted
            c.resume()
        dist.all_reduce(torch.ones(1000))  # uninstalled: not counted
        report["plain"] = _counted(c)

        # FSDP2: one unit per Linear; the root holds no parameters of its own
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
        report["numel"] = sum(p.numel() for p in model.parameters())
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        with CommCounter() as c:
            model(torch.randn(4, 16)).sum().backward()
        report["fsdp2"] = _counted(c)

        # DDP: C++ all-reduce, seen through the comm hook; the hook's own dist.all_reduce is not counted twice
        torch.manual_seed(0)
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)))
        with CommCounter(process_group=ddp.process_group) as c:
            ddp.register_comm_hook(c, CommCounter.ddp_comm_hook)
            ddp(torch.full((2, 16), float(rank))).sum().backward()
        report["ddp"] = _counted(c)
        # averaged as without the hook: both ranks hold the same gradient, the mean of their own
        report["ddp_grad"] = ddp.module[0].bias.grad.tolist()
        # DDP's reducer and FSDP2's state hold the process group: let them go, and every rank finish its work, before
        # the group is destroyed (else a gloo thread can outlive it and abort the process at exit)
        del ddp, model
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def two_rank_reports(tmp_path_factory):
    return spawn_reports(_two_rank_worker, tmp_path_factory.mktemp("comm"))


@pytest.mark.launch(ranks=2)
def test_plain_collectives_counted(two_rank_reports):
    for report in two_rank_reports:
        plain = report["plain"]
        assert plain["calls"] == {"all_reduce": 1, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}
        assert [r[:3] for r in plain["records"]] == [
            ["all_reduce", 10, 2], ["reduce_scatter", 12, 2], ["all_gather", 12, 2], ["broadcast", 4, 2]]
        assert plain["sent"] == {"all_reduce": 10.0, "reduce_scatter": 6.0, "all_gather": 6.0, "broadcast": 2.0}


@pytest.mark.launch(ranks=2)
def test_fsdp2_forward_backward_counted(two_rank_reports):
    for report in two_rank_reports:
        psi, fsdp = report["numel"], report["fsdp2"]
        # every Linear unit all-gathered in forward and again in backward, its gradients reduce-scattered once
        assert fsdp["calls"] == {"all_reduce": 0, "reduce_scatter": 3, "all_gather": 6, "broadcast": 0}
        assert {r[3] for r in fsdp["records"]} == {"all_gather_single", "reduce_scatter_single"}
        # padding to a multiple of the world size: at most a few elements per unit
        assert fsdp["sent"]["all_gather"] == pytest.approx(2 * psi / 2, rel=1e-2)
        assert fsdp["sent"]["reduce_scatter"] == pytest.approx(psi / 2, rel=1e-2)
        assert sum(fsdp["sent"].values()) == pytest.approx(traffic_formula(3, psi, 2), rel=1e-2)


@pytest.mark.launch(ranks=2)
def test_ddp_comm_hook_counted_once(two_rank_reports):
    psi = 16 * 32 + 32 + 32 * 8 + 8
    for report in two_rank_reports:
        ddp = report["ddp"]
        assert {r[3] for r in ddp["records"]} == {"ddp_comm_hook"}
        assert sum(r[1] for r in ddp["records"]) == psi
        assert ddp["sent"]["all_reduce"] == traffic_formula(0, psi, 2) == psi
    assert two_rank_reports[0]["ddp_grad"] == two_rank_reports[1]["ddp_grad"]
