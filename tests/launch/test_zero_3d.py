"""ZeRO-1/2 under tensor parallel and with pipeline-style accumulation, at the parallel level (no Lightning).

One 4-rank launch of ``tests/launch/zero_3d.py`` (see its docstring for what each case runs); this reads what every rank
wrote. Formulas, per rank, for Psi parameters in fp32 split over tp tensor-parallel and N data-parallel ranks:
parameters 4 Psi/tp, Adam states 8 Psi/(tp N), gradients at rest 4 Psi/tp (stage 1) or 4 Psi/(tp N) (stage 2);
exactly, with Psi/tp replaced by this rank's local element count plus the buckets' padding.
"""

from __future__ import annotations

import json

import pytest

from lightning_par.measure import traffic_formula, zero_formula
from tests.harness import launch_matrix, max_rel_diff

PARITY_RTOL = 1e-5
NORM_RTOL = 1e-4
TOLERANCE = 0.05  # the Psi/tp formula against the measured bytes: replicated norms and padding make up the rest
DP = TP = 2
TP_CASES = [f"zero{stage}_{opt}" for stage in (1, 2) for opt in ("sgd", "adamw")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, cache_dir) -> list[dict]:
    root = tmp_path_factory.mktemp("zero_3d")
    run = launch_matrix(root, cache_dir, "tests.launch.zero_3d", [str(root / "out")], nproc=4, timeout=300).check()
    print(f"tests.launch.zero_3d on 4 ranks: {run.seconds:.1f} s")
    reports = [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(4)]
    print({k: round(reports[0][k], 1) for k in ("tp_seconds", "accumulate_seconds", "pp_seconds")})
    return reports


# -- dp2 x tp2 ------------------------------------------------------------------------------------------------------
@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", TP_CASES)
def test_zero_with_tensor_parallel_matches_one_process(ranks, name):
    optimizer = name.split("_")[1]
    reference = ranks[0]["reference"][optimizer]
    for report in ranks:
        case = report["tp"][name]
        diff = max_rel_diff(case["losses"], reference["losses"])
        norm_diff = max_rel_diff(case["norms"], reference["norms"])
        print(f"{name} dp2 x tp2 rank {report['rank']}: loss {diff:.2e}, pre-step gradient norm {norm_diff:.2e} "
              f"(max relative over {len(case['losses'])} steps); {case['seconds']:.1f} s")
        assert len(case["losses"]) == 20 and diff <= PARITY_RTOL
        assert norm_diff <= NORM_RTOL  # the global norm from the shards' placements: tp-split summed, replicated once
    assert reference["losses"][-1] < reference["losses"][0] - 1.0  # it trains


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", TP_CASES)
def test_buckets_keep_tp_split_and_tp_replicated_parameters_apart(ranks, name):
    for report in ranks:
        case = report["tp"][name]
        assert set(case["kinds"]) == {"tp_shard", "tp_replicate"}
        assert case["norm_groups"] == [kind == "tp_shard" for kind in case["kinds"]]
        assert case["shard_meshes"] == ["('dp', 'tp')(Shard(dim=0), Replicate())",
                                        "('dp', 'tp')(Shard(dim=0), Shard(dim=0))"]
        # the model's parameters are still DTensors, computing on views into the buckets
        assert case["dtensor_params"] and case["params_in_buckets"]


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", TP_CASES)
def test_state_bytes_per_rank_follow_the_formula(ranks, name):
    stage = int(name[4])
    adam = name.endswith("adamw")
    for report in ranks:
        case = report["tp"][name]
        measured, psi = case["bytes"], case["numel"]
        padded = case["bucket_numel"]  # this rank's local elements plus at most DP - 1 of padding per bucket
        assert 0 <= padded - case["local_numel"] < DP * case["buckets"]
        formula = zero_formula(stage, psi, DP, tp=TP)
        exact = {"parameters": 4 * padded, "gradients": 4 * padded // (DP if stage == 2 else 1),
                 "optimizer_states": 8 * padded // DP if adam else 0}
        for category in ("parameters", "gradients", "optimizer_states"):
            print(f"{name} rank {report['rank']} {category}: {measured[category]} bytes, formula "
                  f"{formula[category]:.0f} (Psi/tp), exact {exact[category]}")
            assert measured[category] == exact[category]
            if category != "optimizer_states" or adam:
                assert abs(measured[category] / formula[category] - 1) <= TOLERANCE


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", TP_CASES)
def test_one_reduce_scatter_and_one_all_gather_per_bucket_over_dp(ranks, name):
    stage = int(name[4])
    for report in ranks:
        case = report["tp"][name]
        assert case["calls"] == {"all_reduce": 0, "reduce_scatter": case["buckets"], "all_gather": case["buckets"],
                                 "broadcast": 0}
        sent = sum(case["sent"].values())
        predicted = traffic_formula(stage, case["local_numel"], DP)  # over dp only, of this rank's tp share
        assert abs(sent / predicted - 1) <= 0.01


# -- many backwards per step: pipeline schedules and Lightning's accumulation --------------------------------------
@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("variant", ["accumulate/zero1", "accumulate/zero2", "toggle/zero2"])
def test_gradients_are_reduce_scattered_once_per_optimizer_step(ranks, variant):
    group, name = variant.split("/")
    reference = ranks[0]["reference"]["adamw"]["losses"]
    nothing = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "broadcast": 0}
    for report in ranks:
        case = report[group][name]
        diff = max_rel_diff(case["losses"], reference[:len(case["losses"])])
        print(f"{variant} rank {report['rank']}: loss {diff:.2e} over {len(case['losses'])} steps of 2 batches x 2 "
              "micro-batches")
        assert diff <= PARITY_RTOL
        once = dict(nothing, reduce_scatter=case["buckets"])
        for batch, calls in enumerate(case["calls"]):
            assert calls["during_backward"] == nothing  # no communication from any micro-batch's backward
            # the first batch of each step (require_sync False): finish does nothing; the last: each bucket once
            assert calls["with_finish"] == (once if batch % 2 else nothing)


@pytest.mark.launch(ranks=4, full=True)
def test_a_second_backward_while_reducing_in_backward_is_an_error(ranks):
    for report in ranks:
        message = report["errors"]["second_backward"]
        assert "arrived a second time" in message and "defer_reduction = True" in message


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_pipeline_with_tied_copies_matches_one_process(ranks, name):
    reference = ranks[0]["pp_reference"]
    for report in ranks:
        case = report["pp_tied"][name]
        diff = max_rel_diff(case["losses"], reference["losses"])
        norm_diff = max_rel_diff(case["norms"], reference["norms"])
        print(f"pp2 x dp2 1f1b tied {name} rank {report['rank']} ({case['tied_name']}): loss {diff:.2e}, norm "
              f"{norm_diff:.2e}; reduce-scatters per step {case['reduce_scatters']} for {case['buckets']} buckets")
        assert diff <= PARITY_RTOL and norm_diff <= NORM_RTOL
        assert case["reduce_scatters"] == [case["buckets"]] * len(case["losses"])
        assert case["tied_copies_max_diff"] == 0.0  # the embedding and its copy as the head stay equal


@pytest.mark.launch(ranks=4, full=True)
def test_sharded_checkpoint_of_tp_zero_resumes_the_same_run(ranks):
    for report in ranks:
        case = report["checkpoint"]
        diff = max_rel_diff(case["resumed"], case["continued"])
        print(f"dp2 x tp2 ZeRO-2 resumed from a DCP checkpoint, rank {report['rank']}: {diff:.2e}")
        assert diff <= 1e-6


# -- in this process, on one rank ------------------------------------------------------------------------------------
@pytest.mark.full
def test_zero_formula_with_tensor_parallel():
    assert zero_formula(1, 100, 2, tp=2) == {"parameters": 200, "gradients": 200, "optimizer_states": 200,
                                             "total": 600}
    assert zero_formula(2, 100, 2, tp=2)["gradients"] == 100
    assert zero_formula(3, 100, 2, tp=2)["parameters"] == 100
    assert zero_formula(2, 100, 2, tp=1) == zero_formula(2, 100, 2)
    with pytest.raises(ValueError, match="tp must be at least 1"):
        zero_formula(1, 100, 2, tp=0)


@pytest.fixture
def mesh(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))


def _tp_module(tp_mesh):
    import torch
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    module = nn.Module()
    module.split = nn.Parameter(distribute_tensor(torch.randn(6, 4), tp_mesh, [Shard(0)]))
    module.norm = nn.Parameter(distribute_tensor(torch.randn(4), tp_mesh, [Replicate()]))
    module.split2 = nn.Parameter(distribute_tensor(torch.randn(3, 5), tp_mesh, [Shard(1)]))
    return module


@pytest.mark.full
def test_tp_parameters_become_bucket_views_and_say_how_to_sum_their_norm(mesh):
    import torch
    from torch.distributed.tensor import DTensor

    from lightning_par.measure import local_numel
    from lightning_par.parallel.zero import ZeroPartitioner

    module = _tp_module(mesh["tp"])
    values = {n: p.full_tensor().clone() for n, p in module.named_parameters()}
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    partitioner = ZeroPartitioner(module, [optimizer], mesh["dp"], 2, defer_reduction=True)
    assert sorted(b.kind for b in partitioner.buckets) == ["tp_replicate", "tp_shard"]
    assert sorted(flag for _, flag in partitioner.norm_groups()) == [False, True]
    assert local_numel(module) == 24 + 4 + 15
    for name, p in module.named_parameters():
        assert isinstance(p, DTensor) and torch.equal(p.full_tensor(), values[name])
    for bucket in partitioner.buckets:
        assert {p._local_tensor.untyped_storage().data_ptr() for p in bucket.params} == {bucket.flat.data_ptr()}
        assert bucket.shard.device_mesh.mesh_dim_names == ("dp", "tp")
    for p in module.parameters():  # two "micro-batch" backwards, nothing reduced until finish
        p.grad = None
    for _ in range(2):
        (module.split.sum() + 2 * module.norm.sum() + 3 * module.split2.sum()).backward()
    assert all(b.work is None and b.flat_grad is None for b in partitioner.buckets)
    partitioner.finish_gradient_sync()
    norm = torch.linalg.vector_norm(torch.cat([g.to_local() for g in partitioner.norm_grads()]))
    expected = torch.tensor([2.0] * 24 + [4.0] * 4 + [6.0] * 15).norm()
    assert torch.allclose(norm, expected)
    # the tied copy another pipeline rank counts is zeroed out of the norm's gradients, not out of the step
    without = torch.cat([g.to_local() for g in partitioner.norm_grads(exclude={id(module.norm)})])
    assert torch.allclose(without.norm(), torch.tensor([2.0] * 24 + [6.0] * 15).norm())
    optimizer.step()
    partitioner.gather_parameters()
    assert torch.allclose(module.norm.full_tensor(), values["norm"] - 4.0)  # the step reached the model
    assert torch.allclose(module.split2.full_tensor(), values["split2"] - 6.0)


@pytest.mark.full
def test_tp_parameters_on_a_mesh_apart_from_dp_are_refused(mesh):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from lightning_par import LayoutError
    from lightning_par.parallel.zero import ZeroPartitioner

    # a tensor-parallel mesh that is not a dimension of dp's mesh. The check is by ranks (the tp dimension of dp's
    # root must hold the same ranks as the parameters' mesh), so in this one-rank world the apart mesh is told
    # apart by its dimension, which dp's root does not have
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("model",))
    module = _tp_module(other)
    with pytest.raises(LayoutError, match="two named dimensions of one DeviceMesh"):
        ZeroPartitioner(module, [torch.optim.SGD(module.parameters(), lr=1.0)], mesh["dp"], 1)
    # the rank check itself: the root's tp dimension and the parameters' mesh must hold the same ranks (a group of
    # other ranks stands in for a mesh this one-rank world cannot build)
    from types import SimpleNamespace

    from lightning_par.parallel.zero import _same_ranks

    root = mesh["dp"]._get_root_mesh()
    assert _same_ranks(root, "tp", mesh["tp"])
    assert _same_ranks(root, "tp", init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))  # equal group: accepted
    assert not _same_ranks(root, "tp", SimpleNamespace(mesh=torch.tensor([1])))
    assert not _same_ranks(root, "model", mesh["tp"])
    two_d = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Replicate(), Replicate()]))
    with pytest.raises(LayoutError, match="on a 2-D mesh"):
        ZeroPartitioner(torch.nn.Module(), [torch.optim.SGD([two_d], lr=1.0)], mesh["dp"], 1)
