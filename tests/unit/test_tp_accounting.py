"""Tensor parallelism held to its formulas: collectives per block, bytes sent per rank, activations saved.

One transformer block of the example GPT is split by lightning-par's TP engine over 2 and 4 gloo ranks (started
once per module, see ``benchmarks/tensor_parallel.py``), with and without sequence parallelism. Counts come from
what the ranks issue (a dispatch mode below DTensor), bytes from the buffers' sizes and the ring formulas, saved
activations from ``saved_tensors_hooks``; each is compared with Megatron's numbers and with the exact formula of
this block.
"""

import pytest
import torch
from torch import nn

from benchmarks.tensor_parallel import BATCH, BLOCK, SEQ, STEP_LAYERS, formulas, measure_tp, measure_unsharded
from lightning_par.parallel.tp_accounting import (
    CollectiveRecord,
    block_activation_formula,
    megatron_activation_formula,
    megatron_traffic_formula,
    ring_sent_bytes,
    saved_activation_bytes,
    split_by_tp,
)

FP32 = 4
SBH = SEQ * BATCH * BLOCK["dim"]


@pytest.fixture(scope="module")
def ranks():
    """``{t: [per-rank result]}``: t = 2 also measures the hand-written plan and a whole training step."""
    return {2: measure_tp(2, impls=("engine", "hand"), with_step=True),
            4: measure_tp(4, impls=("engine",), with_step=False)}


@pytest.fixture(scope="module")
def unsharded():
    return measure_unsharded()


def _blocks(ranks, t, sp, impl="engine"):
    blocks = [r["blocks"][f"{impl}{'+sp' if sp else ''}"] for r in ranks[t]]
    for b in blocks:
        assert "error" not in b, b.get("error")
    return blocks


# ----------------------------------------------------------------------------------------------------------------------
# pure arithmetic
# ----------------------------------------------------------------------------------------------------------------------
def test_megatron_formulas_reduce_to_the_tables_rows():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B shapes
    assert megatron_activation_formula(s, b, h, a, 1) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert megatron_activation_formula(s, b, h, a, 8) == pytest.approx(s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert megatron_activation_formula(s, b, h, a, 8, sp=True) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / 8)
    # one all-reduce of n bytes sends 2n(t-1)/t; two per pass
    assert megatron_traffic_formula(s, b, h, 4, element_size=2)["forward"] == 2 * 2 * (s * b * h * 2) * 3 / 4
    # sequence parallelism divides our norm region by t, nothing else
    ours = {sp: block_activation_formula(s, b, h, a, 8, 4 * h, 8, sp) for sp in (False, True)}
    assert ours[False]["total"] - ours[True]["total"] == pytest.approx(ours[False]["norms"] * (1 - 1 / 8))


def test_ring_formula_per_kind():
    recs = [CollectiveRecord(kind, 100, 4, n, False, "m")
            for kind, n in (("all_reduce", 4), ("all_gather", 4), ("reduce_scatter", 4), ("all_reduce", 1))]
    assert ring_sent_bytes(recs) == 2 * 400 * 3 / 4 + 400 * 3 / 4 + 400 * 3 / 4  # a group of one sends nothing


def test_saved_bytes_count_each_storage_once_and_skip_parameters():
    lin = nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    # both matmuls save x (one storage), both save the weight (excluded); relu saves its output
    _, saved = saved_activation_bytes(lambda: torch.relu(lin(x)) + lin(x), exclude=lin.parameters())
    assert saved.nbytes == x.nbytes + 4 * 8 * 4
    assert len(saved.entries) == 2


def test_split_by_tp_recovers_replicated_and_sharded_parts():
    fit = split_by_tp({1: 10 + 8, 2: 10 + 4, 4: 10 + 2})
    assert (fit["replicated"], fit["sharded"], fit["max_relative_residual"]) == (10, 8, 0)


# ----------------------------------------------------------------------------------------------------------------------
# traffic, measured on t ranks
# ----------------------------------------------------------------------------------------------------------------------
def _split(ops):
    """``(kind, nbytes)`` ops -> (kinds of those moving one [b, s, h] activation, the other ops)."""
    act = sorted(k for k, n in ops if n == SBH * FP32)
    return act, [(k, n) for k, n in ops if n != SBH * FP32]


@pytest.mark.parametrize("t", [2, 4])
def test_block_without_sp_issues_two_all_reduces_per_pass(ranks, t):
    for block in _blocks(ranks, t, sp=False):
        assert block["forward"] == {"all_reduce": 2}
        assert block["backward"] == {"all_reduce": 2}
        # each reduces the whole activation [b, s, h]
        assert block["forward_ops"] == block["backward_ops"] == [("all_reduce", SBH * FP32)] * 2


@pytest.mark.parametrize("t", [2, 4])
def test_block_with_sp_issues_all_gathers_and_reduce_scatters(ranks, t):
    for block in _blocks(ranks, t, sp=True):
        # f: all-gather before attention and MLP; g: reduce-scatter after them; swapped in backward
        for phase in ("forward", "backward"):
            act, other = _split(block[f"{phase}_ops"])
            assert act == ["all_gather"] * 2 + ["reduce_scatter"] * 2, phase
            if phase == "forward":
                assert other == []
        # Besides: the norms ran on sequence shards, so each rank's norm-weight gradient covers its tokens only and
        # must be summed over the group -- at most one all-reduce of h elements per norm.
        _, other = _split(block["backward_ops"])
        print(f"t={t} SP backward, besides the activations: {other}")
        assert len(other) <= 2 and all(op == ("all_reduce", BLOCK["dim"] * FP32) for op in other)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("t", [2, 4])
def test_bytes_sent_per_rank_per_block_equal_the_ring_formula(ranks, t, sp):
    formula = megatron_traffic_formula(SEQ, BATCH, BLOCK["dim"], t, element_size=FP32)
    for block in _blocks(ranks, t, sp):
        # ring bytes of the collectives that move one activation (records of n bytes: numel n, element size 1)
        sent = {ph: ring_sent_bytes(CollectiveRecord(k, n, 1, t, ph == "backward", "")
                                    for k, n in block[f"{ph}_ops"] if n == SBH * FP32)
                for ph in ("forward", "backward")}
        print(f"t={t} sp={sp}: activations sent {sent['forward']:.0f} + {sent['backward']:.0f} bytes per rank, "
              f"formula {formula['forward']:.0f} per pass; all collectives {block['sent_bytes']:.0f}")
        assert sent["forward"] == pytest.approx(formula["forward"], rel=1e-9)
        assert sent["backward"] == pytest.approx(formula["backward"], rel=1e-9)
        # what else was sent is small: norm-weight gradients, h elements each
        assert block["sent_bytes"] - sent["forward"] - sent["backward"] <= 2 * 2 * BLOCK["dim"] * FP32


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_whole_step_layer_traffic_is_layers_times_the_block_formula(ranks, sp):
    step = ranks[2][0]["steps"]["engine+sp" if sp else "engine"]
    assert "error" not in step, step.get("error")
    layers = step["by_place"]["layers"]
    per_layer_pass = megatron_traffic_formula(SEQ, BATCH, BLOCK["dim"], 2, element_size=FP32)["forward"]
    for phase in ("forward", "backward"):
        act, other = _split(layers[phase]["ops"])
        sent = ring_sent_bytes(CollectiveRecord(k, SBH * FP32, 1, 2, False, "") for k in act)
        assert sent == pytest.approx(STEP_LAYERS * per_layer_pass, rel=1e-9)
        per_layer = ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"] if sp else ["all_reduce"] * 2
        assert act == sorted(per_layer * STEP_LAYERS)
        assert all(op == ("all_reduce", BLOCK["dim"] * FP32) for op in other)  # SP: norm-weight gradients
    # the rest of the step (embedding, vocab-parallel loss, head, optimizer) is printed for the record
    print({place: {ph: c["calls"] for ph, c in phases.items()} for place, phases in step["by_place"].items()})
    # every gradient is complete after backward (the norm weights' too, with SP): the optimizer step communicates
    # nothing, so gradient clipping and the update see the true gradients
    assert "optimizer" not in step["by_place"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_engine_matches_the_hand_written_torch_plan(ranks, sp):
    for ours, hand in zip(_blocks(ranks, 2, sp), _blocks(ranks, 2, sp, impl="hand"), strict=True):
        for key in ("forward_ops", "saved_bytes"):
            assert ours[key] == hand[key], key
        # the same activation collectives in backward; torch's SequenceParallel leaves the norm-weight gradients
        # Partial (summed later, where the optimizer first reads them), the engine sums them in backward
        assert _split(ours["backward_ops"])[0] == _split(hand["backward_ops"])[0]


# ----------------------------------------------------------------------------------------------------------------------
# activation memory
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_saved_activations_equal_our_block_formula(ranks, unsharded, t, sp):
    if t == 1 and sp:
        pytest.skip("sequence parallelism needs t > 1")
    f = formulas(t, sp)
    measured = [unsharded["saved_bytes"]] if t == 1 else [b["saved_bytes"] for b in _blocks(ranks, t, sp)]
    for m in measured:
        print(f"t={t} sp={sp}: measured {m} bytes, ours {f['ours_bytes']:.0f}, table 2 {f['megatron_bytes']:.0f} "
              f"(measured / table 2 = {m / f['megatron_bytes']:.3f})")
        assert abs(m / f["ours_bytes"] - 1) <= 0.01


def test_activations_fall_as_one_over_t_and_sp_shards_only_the_norm_region(ranks, unsharded):
    def by_t(sp):
        return {1: unsharded["saved_bytes"], **{t: _blocks(ranks, t, sp)[0]["saved_bytes"] for t in (2, 4)}}

    tp, tp_sp = split_by_tp(by_t(False)), split_by_tp(by_t(True))
    assert tp["max_relative_residual"] < 1e-3 and tp_sp["max_relative_residual"] < 1e-3  # exactly R + S/t
    parts = block_activation_formula(SEQ, BATCH, BLOCK["dim"], BLOCK["n_heads"], BLOCK["n_kv_heads"],
                                     BLOCK["ffn_dim"])
    # Without SP the norms, their outputs and the rope tables are on every rank in full (table 2: 10 sbh).
    assert tp["replicated"] == pytest.approx(parts["norms"] + parts["linear_inputs"] + parts["rope"])
    # SP moves the norm region into the sharded part; what stays whole is the all-gathered input of the
    # column-parallel linears (DTensor saves the gathered tensor, Megatron re-gathers in backward) and rope.
    assert tp_sp["replicated"] == pytest.approx(parts["linear_inputs"] + parts["rope"])
    assert tp_sp["sharded"] - tp["sharded"] == pytest.approx(parts["norms"])
    print(f"replicated bytes per rank: TP {tp['replicated']:.0f} ({tp['replicated'] / SBH:.2f} sbh), "
          f"TP+SP {tp_sp['replicated']:.0f} ({tp_sp['replicated'] / SBH:.2f} sbh); table 2: 10 sbh and 0")
