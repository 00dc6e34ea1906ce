"""The router's load-balancing loss scopes, a capacity factor and the MoE logs on 2 ranks, against one process.

One launch of ``tests/launch/router_worker.py`` (see its docstring; default set): ep2 and dp2 with each scope of the
load-balancing loss (ep2 also over 2 accumulated micro-batches, and cp2 x ep2 with the global scope), and ep2 with a
capacity factor, TensorBoard logs of the routers' load and MFU.
"""

from __future__ import annotations

import json

import pytest

from tests.harness import launch_matrix, max_rel_diff

PARITY_RTOL = 1e-5  # per-step loss against one process computing the same semantics
#: the two scopes' first losses differ by more than this (relative): the parity above tells them apart
SCOPES_APART = 3e-5
SCOPE_CASES = ("ep2_micro_batch", "ep2_global", "dp2_micro_batch", "dp2_global", "ep2_capacity",
               "ep2_global_accumulate", "ep2_micro_batch_accumulate", "cp2_ep2_global")
ACTIVE_FLOPS = 6 * 131_904 + 12 * 2 * 64 * 32  # the tiny MoE's active parameters (top-2 of 4 experts), seq 32
PEAK = 1e9  # per device, given to TokensPerSecond


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, cache_dir) -> list[dict]:
    root = tmp_path_factory.mktemp("router")
    run = launch_matrix(root, cache_dir, "tests.launch.router_worker", [str(root / "out")], nproc=2,
                        timeout=400).check()
    print(f"tests.launch.router_worker on 2 ranks: {run.seconds:.1f} s")
    return [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(2)]


def _summed(per_rank: list[list]) -> list:
    """Nested lists of counts summed element-wise over the ranks."""
    if isinstance(per_rank[0], list):
        return [_summed(list(items)) for items in zip(*per_rank, strict=True)]
    return sum(per_rank)


@pytest.mark.launch(ranks=2, full=True)  # (the default set's budget; unit tests and the ZBV global case stay)
@pytest.mark.parametrize("case", SCOPE_CASES)
def test_losses_match_one_process_of_the_same_semantics(ranks, case):
    reference = ranks[0][case]["reference"]
    for report in ranks:
        diff = max_rel_diff(report[case]["losses"], reference["losses"])
        print(f"{case} rank {report['rank']}: loss {diff:.2e} (max relative over 6 steps)")
        assert len(report[case]["losses"]) == 6 and diff <= PARITY_RTOL
    # the other scope's loss is not this one's: the parity is of the chosen semantics
    apart = abs(ranks[0][case]["losses"][0] - reference["other_scope_first_loss"]) / reference["losses"][0]
    print(f"{case}: the other scope's first loss is {apart:.2e} apart")
    assert apart > SCOPES_APART
    assert reference["losses"][-1] < reference["losses"][0] - 0.25  # it trains (cp2: 4 sequences a step, 0.36)
    # the routers' choices: the ranks' counts add up to one process's, exactly; dropped only under a capacity
    assert _summed([r[case]["routed"] for r in ranks]) == reference["routed"]
    dropped = _summed([r[case]["dropped"] for r in ranks])
    assert dropped == reference["dropped"]
    if case == "ep2_capacity":
        assert all(d > 0 for step in dropped for d in step)
    else:
        assert not any(d for step in dropped for d in step)


@pytest.mark.launch(ranks=2, full=True)  # (the default set's budget; unit tests and the ZBV global case stay)
def test_router_load_and_active_mfu_in_tensorboard(ranks):
    scalars = {tag: {int(step): v for step, v in by_step.items()} for tag, by_step in ranks[0]["scalars"].items()}
    reference = ranks[0]["ep2_capacity"]["reference"]
    routed, dropped = reference["routed"], reference["dropped"]
    for layer in range(2):
        tag = f"moe/model.layers.{layer}.mlp"
        for step in (2, 4, 6):  # logged every 2 steps: the window of the two steps before
            counts = [a + b for a, b in zip(routed[step - 2][layer], routed[step - 1][layer], strict=True)]
            total = sum(counts)
            assert total == 2 * (2 * 4 * 32 * 2)  # 2 steps x 2 ranks x 4 sequences x 32 tokens x top-2
            assert [scalars[f"{tag}/tokens_expert_{e}"][step] for e in range(4)] == counts
            assert scalars[f"{tag}/max_over_mean"][step] == pytest.approx(max(counts) / (total / 4), rel=1e-6)
            assert 1.0 <= scalars[f"{tag}/max_over_mean"][step] <= 4.0
            window_dropped = dropped[step - 2][layer] + dropped[step - 1][layer]
            assert scalars[f"{tag}/dropped_fraction"][step] == pytest.approx(window_dropped / total, rel=1e-6)
            assert 0 < scalars[f"{tag}/dropped_fraction"][step] < 1
            balance, lost = scalars[f"{tag}/max_over_mean"][step], scalars[f"{tag}/dropped_fraction"][step]
            print(f"{tag} step {step}: tokens per expert {counts}, max/mean {balance:.3f}, dropped {lost:.3f}")
    # MFU from the active parameters: mfu / (tokens/s) = FLOPs per token / (peak x 2 devices)
    for step in (2, 4, 6):
        assert scalars["train/mfu"][step] / scalars["train/tokens_per_sec"][step] == pytest.approx(
            ACTIVE_FLOPS / (2 * PEAK), rel=1e-5)
