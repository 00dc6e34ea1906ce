"""The engine itself: replicas identical without a seed, one gradient-sync owner per layout, reductions over data
parallel, and plain-SGD parity for every strategy family (one launch of tests/launch/engine_matrix.py on 4 ranks)."""

import json

import pytest

from tests.conftest import PARITY_STEPS, run_cases
from tests.harness import Run, launch_matrix, max_rel_diff
from tests.launch.engine_matrix import LAYOUTS, PER_STAGE_DRAWS

PARITY_RTOL = 1e-5
#: the owner of data-parallel gradient sync each layout must get (exactly one; see parallel/gradient_sync.py)
OWNERS = {"zero0_dp4": "ddp", "zero1_dp4": "zero1", "zero2_dp4": "zero2", "zero3_dp4": "fsdp2_shard",
          "tp2_dp2": "fsdp2_replicate", "zero3_dp4_full_recompute": "fsdp2_shard",
          "tp2_dp2_selective_recompute": "fsdp2_replicate", "pp2_dp2": "pipeline_allreduce",
          "pp2_dp2_seeded": "pipeline_allreduce"}
UNSEEDED = [name for name in LAYOUTS if not name.endswith("_seeded")]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, cache_dir) -> dict:
    root = tmp_path_factory.mktemp("engine_matrix")
    run = launch_matrix(root, cache_dir, "tests.launch.engine_matrix", ["--root", str(root), "--cache", str(cache_dir)],
                        nproc=4).check()
    print(f"engine matrix: {len(LAYOUTS)} layouts on 4 ranks in {run.seconds:.0f} s")
    return {name: (Run(root / name, 0, run.log, run.seconds),
                   [json.loads((root / name / f"rank{r}.json").read_text()) for r in range(4)]) for name in LAYOUTS}


@pytest.fixture(scope="module")
def sgd_reference(runs) -> Run:
    return runs("single_rank_seeded_sgd")  # one of the shared single-process references


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("name", UNSEEDED)
def test_replicas_start_from_the_same_weights_without_a_seed(matrix, name):
    _, reports = matrix[name]
    for report in reports:
        assert report["params_differing_at_init"] > 0, "the ranks drew different weights (else nothing is tested)"
        assert report["max_rel_err"] == 0.0, f"{name}: a rank kept weights it drew itself: {report}"


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_gradient_sync_owner_per_layout(matrix, name):
    _, reports = matrix[name]
    assert {r["gradient_sync"] for r in reports} == {OWNERS[name]}


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sums_count_each_data_parallel_replica_once(matrix, name):
    _, reports = matrix[name]
    for report in reports:
        dp = report["dp"]
        assert report["strategy_reduce_sum"] == dp  # strategy.reduce: over the data-parallel group
        assert report["ones_sum"] == dp  # self.log(..., reduce_fx="sum", sync_dist=True)
        assert report["steps_seen"] == dp * PARITY_STEPS  # a torchmetrics SumMetric, synced at compute()


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in PER_STAGE_DRAWS])
def test_plain_sgd_matches_one_process(matrix, sgd_reference, name):
    run, _ = matrix[name]
    diff = max_rel_diff(run.losses(), sgd_reference.losses())
    print(f"{name}, plain SGD: max relative per-step loss difference {diff:.2e} over {PARITY_STEPS} steps")
    assert len(run.losses()) == PARITY_STEPS and diff <= PARITY_RTOL
    # the loss moves: a gradient off by a constant factor would show
    reference = sgd_reference.losses()
    assert reference[0] - reference[-1] > 0.3


@pytest.mark.parametrize("name", run_cases(["hf_zero3_dict", "hf_tp2_dict"], "hf_single"))
def test_hugging_face_dict_batches_under_zero3_and_tensor_parallel(runs, name):
    """{input_ids, labels, attention_mask} batches (HF's label shift inside) train as the tuple-batch single process."""
    diff = max_rel_diff(runs(name).losses(), runs("hf_single").losses())
    print(f"{name}: max relative per-step loss difference {diff:.2e}")
    assert len(runs(name).losses()) == PARITY_STEPS and diff <= PARITY_RTOL
