"""Expert parallel (``ZeroStrategy(stage=0, ep=2)``) on the example MoE GPT, against one process.

One launch of ``tests/launch/expert_parallel_worker.py`` per world size (see its docstring): 2 ranks (ep2, each expert
on one rank) in the default set, 4 ranks (ep2 x expert_dp2: each expert on two ranks, its gradient averaged over
them) in the full run. Each launch fits plain SGD, AdamW (with a shared expert), SGD over accumulated batches of a
model built eagerly, SGD with context parallel (cp2, the experts over the cp ranks), the other weights under ZeRO-1
(AdamW), ZeRO-2 (SGD) and ZeRO-3 (AdamW), and SGD after a ``trainer.validate`` of the same model; the tests read every
rank's report.
"""

from __future__ import annotations

import json

import pytest

from lightning_par import ParallelDims
from tests.harness import launch_matrix, max_rel_diff

PARITY_RTOL = 1e-5  # per-step loss against one process
NORM_RTOL = 1e-5  # the pre-step global gradient norm: each expert counted once
EP = 2
CASES = ("sgd", "adamw", "accumulate_eager", "cp2", "zero1_adamw", "zero2_sgd", "zero3_adamw", "validate_then_fit",
         "tp2_zero1", "tp2_zero2_adamw", "tp2_zero0", "tp2_zero3_adamw", "tp2_zero3_sgd")
FOUR_RANKS_ONLY = ("tp2_zero1", "tp2_zero2_adamw", "tp2_zero0", "tp2_zero3_adamw", "tp2_zero3_sgd")
#: the ZeRO stage of each case (0 unless named): the experts' share of it is over their own replicas (expert_dp)
ZERO = {"zero1_adamw": 1, "zero2_sgd": 2, "zero3_adamw": 3, "tp2_zero1": 1, "tp2_zero2_adamw": 2,
        "tp2_zero3_adamw": 3, "tp2_zero3_sgd": 3}
#: the other weights' gradient owner (DDP unless named)
OWNER = {"zero1_adamw": "zero1", "zero2_sgd": "zero2", "zero3_adamw": "fsdp2_shard", "tp2_zero1": "zero1",
         "tp2_zero2_adamw": "zero2", "tp2_zero0": "fsdp2_replicate", "tp2_zero3_adamw": "fsdp2_shard",
         "tp2_zero3_sgd": "fsdp2_shard"}
SIZES = {"cp2": dict(cp=2), **{case: dict(tp=2) for case in FOUR_RANKS_ONLY}}  # the cases' layouts besides dp


def _launch(tmp_path_factory, cache_dir, ranks: int) -> list[dict]:
    root = tmp_path_factory.mktemp(f"expert_parallel_{ranks}")
    run = launch_matrix(root, cache_dir, "tests.launch.expert_parallel_worker", [str(root / "out")], nproc=ranks,
                        timeout=400).check()
    print(f"tests.launch.expert_parallel_worker on {ranks} ranks: {run.seconds:.1f} s")
    return [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def ep2(tmp_path_factory, cache_dir) -> list[dict]:
    return _launch(tmp_path_factory, cache_dir, 2)


@pytest.fixture(scope="module")
def ep2_dp2(tmp_path_factory, cache_dir) -> list[dict]:
    return _launch(tmp_path_factory, cache_dir, 4)


LAUNCHES = [pytest.param("ep2", marks=pytest.mark.launch(ranks=2)),
            pytest.param("ep2_dp2", marks=pytest.mark.launch(ranks=4, full=True))]


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("case", CASES)
def test_losses_and_gradient_norms_match_one_process(request, launch, case):
    ranks = request.getfixturevalue(launch)
    if case in FOUR_RANKS_ONLY and len(ranks) < 4:
        pytest.skip(f"{case} needs 4 ranks")
    reference = ranks[0][case]["reference"]
    for report in ranks:
        run = report[case]
        loss_diff, norm_diff = max_rel_diff(run["losses"], reference["losses"]), max_rel_diff(run["norms"],
                                                                                            reference["norms"])
        print(f"{launch} {case} rank {report['rank']}: loss {loss_diff:.2e}, gradient norm {norm_diff:.2e} (max "
              f"relative over {len(run['losses'])} steps)")
        assert len(run["losses"]) == len(reference["losses"]) == 6
        assert loss_diff <= PARITY_RTOL and norm_diff <= NORM_RTOL
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it trains: the parity is not of a flat line


@pytest.mark.parametrize("launch", LAUNCHES)
def test_each_rank_holds_materialises_and_steps_its_share_of_the_experts(request, launch):
    ranks = request.getfixturevalue(launch)
    for case in (c for c in CASES if c in ranks[0]):
        held = [report[case] for report in ranks]
        dims = ParallelDims.resolve(len(ranks), ep=EP, **SIZES.get(case, {}))
        total = held[0]["expert_bytes_total"]
        # the example tiny MoE: 2 layers x 3 weights of 4 experts x 64 x 96, fp32
        assert total == 2 * 3 * 4 * 64 * 96 * 4
        # a rank holds 1/ep of the experts, and 1/expert_dp of that for what its ZeRO stage shards: optimizer state
        # from stage 1 (AdamW's two moments; SGD keeps none), gradients from stage 2, parameters at stage 3
        stage, replicas, ep_share = ZERO.get(case, 0), dims.expert_dp, total // EP
        for report in held:
            assert report["expert_bytes"] == ep_share // (replicas if stage == 3 else 1), (case, report)
            assert report["expert_grad_bytes"] == ep_share // (replicas if stage >= 2 else 1), (case, report)
            moments = 2 if "adamw" in case else 0
            assert report["expert_state_bytes"] == moments * ep_share // (replicas if stage >= 1 else 1), (case, report)
            assert report["slices_match"]  # its experts' rows of the weights one process drew
            assert report["gradient_sync"] == OWNER.get(case, "ddp")
            assert len(report["expert_names"]) == 6
            if case != "accumulate_eager":  # built deferred: a rank materialised its experts only, never the others'
                assert report["expert_bytes"] <= report["materialized"] <= report["expert_bytes"] + \
                    report["other_bytes"], (case, report)
        # the ep groups the mesh made are the layout's arithmetic (consecutive data-parallel ranks), each rank at its
        # place in its group holding other experts
        for rank, report in enumerate(held):
            [group] = [g for g in dims.expert_groups("ep") if rank in g]
            assert report["ep_group"] == group and report["ep_rank"] == group.index(rank), (case, rank, report)
