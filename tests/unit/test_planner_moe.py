"""The planner on a mixture-of-experts model: active vs total parameters, the experts' bytes per rank under ep, the
all-to-all bytes per step, and ep in the search (issue 29). Numbers are computed here from the example's config."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lightning_par.examples.gpt import GPT, GPT_PRESETS, GPTConfig
from lightning_par.examples.moe import MOE_PRESETS, MoEGPT
from lightning_par.parallel.layout import Layout
from lightning_par.planner.command import strategy_args
from lightning_par.planner.hardware import load_hardware
from lightning_par.planner.model import build_model, inspect_model
from lightning_par.planner.plan import Candidate, Planner, Workload, element_bytes
from lightning_par.planner.trace import trace_model
from lightning_par.topology import LayoutError

SMALL = MOE_PRESETS["small"]  # 8 experts, top-2, a shared expert, 4 layers
SEQ = 64


@pytest.fixture(scope="module")
def small():
    return inspect_model(build_model(MoEGPT, {"config": SMALL}))


def planner(info, optimizer="adamw", global_batch=8) -> Planner:
    return Planner(info, load_hardware("cpu"), Workload(1, SEQ, global_batch), optimizer)


def expert_numel(config) -> int:
    return config.n_layers * config.n_experts * 3 * config.dim * config.expert_ffn_dim


def test_active_and_total_parameters_and_the_flops_of_the_active_ones(small):
    assert small.numel == SMALL.num_params() and small.active_numel == SMALL.active_params()
    assert small.experts.numel == expert_numel(SMALL)
    assert small.experts.layers == {f"layers.{i}.mlp": (8, 2) for i in range(SMALL.n_layers)}
    assert f"{SMALL.active_params():,}" in small.description and "8 experts, top-2 in 4 layers" in small.description
    # the trace routes evenly: its FLOPs are those of a dense GPT whose FFN is the k experts + the shared one,
    # plus the router's (2 x tokens x dim x E per layer forward, twice that backward)
    dense_cfg = GPTConfig(**{**vars(GPT_PRESETS["small"]),
                             "ffn_dim": SMALL.top_k * SMALL.expert_ffn_dim + SMALL.shared_ffn_dim})
    dense = inspect_model(build_model(GPT, {"config": dense_cfg}))
    assert dense.numel == SMALL.active_params() - SMALL.n_layers * SMALL.dim * SMALL.n_experts
    moe_trace, dense_trace = trace_model(small, seq_len=SEQ), trace_model(dense, seq_len=SEQ)
    router = SMALL.n_layers * 2 * SEQ * SMALL.dim * SMALL.n_experts
    for phase, factor in (("forward", 1), ("backward", 2)):
        flops = [sum(getattr(t, phase).total_flops for t in tr.units.values()) for tr in (moe_trace, dense_trace)]
        assert flops[0] - flops[1] == factor * router


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_experts_are_one_ep_th_per_rank_then_sharded_over_expert_dp_by_the_stage(small, zero):
    p = planner(small)
    experts = expert_numel(SMALL)
    dense = small.numel - experts
    got = p.state_bytes(Candidate(4, 1, 1, zero, precision="fp32", ep=2))[0]
    # fp32 AdamW: 4 bytes a parameter, 4 a gradient, 8 of states. dp 4, ep 2: each rank holds half the experts,
    # and the stage shards that half again over its expert_dp = 2 ranks (every expert tensor splits evenly here)
    shard = math.ceil(dense / 4)
    if zero == 3:  # FSDP2: each dense tensor split on dim 0 with padding
        shard = sum(math.ceil(q.shape[0] / 4) * math.prod(q.shape[1:]) for q in small.params
                    if q.name not in small.experts.params)
    held, sharded = experts // 2, experts // 4
    want_params = 4 * ((shard + sharded) if zero == 3 else (dense + held))
    want_grads = 4 * ((shard + sharded) if zero >= 2 else (dense + held))
    want_states = 8 * ((shard + sharded) if zero >= 1 else (dense + held))
    assert (got["parameters"], got["gradients"], got["optimizer_states"]) == (want_params, want_grads, want_states)
    # docs/moe.md's per-rank formulas for the experts alone: E/ep, and E/(ep x expert_dp) where the stage shards
    alone = p.state_bytes(Candidate(4, 1, 1, zero, precision="fp32", ep=2))[0]["optimizer_states"] - 8 * (
        shard if zero >= 1 else dense)
    assert alone == 8 * (experts // 4 if zero >= 1 else experts // 2)
    # ep = 1: the experts as any weight (all of them per rank; at ZeRO-3 a 1/4 shard of each)
    whole = p.state_bytes(Candidate(4, 1, 1, zero, precision="fp32"))[0]
    assert whole["parameters"] == 4 * (shard + math.ceil(experts / 4) if zero == 3 else small.numel)
    # ep = 4 (expert_dp 1): a quarter of the experts per rank, nothing to shard them over
    four = p.state_bytes(Candidate(4, 1, 1, zero, precision="fp32", ep=4))[0]
    assert four["optimizer_states"] - 8 * (shard if zero >= 1 else dense) == 8 * experts // 4


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_experts_bf16_masters_are_fp32_shards_over_expert_dp(small, zero):
    """bf16-mixed-master at ZeRO 1-2: bf16 experts (ZeRO-3: FSDP2's fp32 shards), fp32 gradients (ZeRO-2: the
    expert_dp shard) and fp32 masters and AdamW states, sharded over expert_dp."""
    p = planner(small)
    experts = expert_numel(SMALL)
    with_ep = p.state_bytes(Candidate(4, 1, 1, zero, precision="bf16-mixed-master", ep=2))[0]
    dense = [q for q in small.params if q.name not in small.experts.params]  # their bytes as without experts
    d_state = p._state_bytes(dense, small.tp_split(1), Candidate(4, 1, 1, zero, precision="bf16-mixed-master"),
                             element_bytes("bf16-mixed-master", zero), 2)
    own = [with_ep[k] - d for k, d in zip(("parameters", "gradients", "optimizer_states"), d_state, strict=True)]
    quarter = experts // 4
    if zero == 3:
        assert own == [4 * quarter, 4 * quarter, 8 * quarter]
    else:
        assert own == [2 * experts // 2, 4 * (quarter if zero == 2 else experts // 2), (8 + 4) * quarter]


def test_all_to_all_and_expert_gradient_bytes_per_step(small):
    p = planner(small, optimizer="sgd", global_batch=8)
    m = 2  # micro-batches per replica: 8 sequences over dp 4
    c = Candidate(4, 1, 1, 0, n_microbatches=m, precision="fp32", ep=2)
    e = p.estimate(c)
    # per layer and micro-batch, one forward: 2 (dispatch + combine) x tokens x top_k x dim x 4 bytes x (ep-1)/ep;
    # the backward as much again
    one = 2 * SEQ * SMALL.top_k * SMALL.dim * 4 * (2 - 1) / 2
    assert e.comm_bytes["ep"] == m * SMALL.n_layers * 2 * one
    full = p.estimate(replace(c, recompute="full"))
    assert full.comm_bytes["ep"] == m * SMALL.n_layers * 3 * one  # the recomputed forward exchanges again
    # dense gradients all-reduced over dp 4, each expert's over the 2 ranks holding it (expert_dp)
    experts = expert_numel(SMALL)
    assert e.comm_bytes["dp"] == pytest.approx(2 * 4 * (small.numel - experts) * 3 / 4 + 2 * 4 * experts / 2 / 2)
    # ZeRO 1-3: each expert's gradient reduce-scattered over its expert_dp ranks and its slice all-gathered there
    # (ZeRO-3: FSDP2 gathers each micro-batch's forward and backward, the root group -- the parameters outside the
    # blocks -- once, kept gathered from one to the other), the others' over dp 4
    root = sum(q.numel for q in small.params if not any(u in small.blocks for u in q.units))
    for zero, gathers in ((1, 1), (2, 1), (3, 2 * m)):
        z = p.estimate(replace(c, zero_stage=zero))
        want = (1 + gathers) * 4 * ((small.numel - experts) * 3 / 4 + experts / 2 / 2)
        want -= m * 4 * root * 3 / 4 if zero == 3 else 0
        assert z.comm_bytes["dp"] == pytest.approx(want), zero
    assert e.exposed["ep"] > 0 and e.step_time > p.estimate(replace(c, ep=1)).step_time - 1e-12
    assert "ep" not in p.estimate(replace(c, ep=1)).comm_bytes
    assert strategy_args(c)["ep"] == 2 and "ep2" in c.label()


def test_ep_in_the_search_follows_the_layout_and_the_experts(small, monkeypatch):
    p = planner(small)
    found, skipped = p.candidates(4, zero_stages=(0, 1), recompute=("none",), precisions=("fp32",),
                                  schedules=("1f1b",), sequence_parallel=(False,))
    sizes = {(c.dp, c.tp, c.pp, c.ep, c.zero_stage) for c in found}
    assert {(4, 1, 1, 1, 0), (4, 1, 1, 2, 0), (4, 1, 1, 4, 0), (2, 2, 1, 2, 1), (2, 1, 2, 1, 0)} <= sizes
    # nothing of ep is refused by the layout any more: ep with pp (every schedule), tp at every ZeRO stage, sp
    everything, skipped = p.candidates(4, zero_stages=(0, 1, 2, 3), recompute=("none",), precisions=("fp32",),
                                       schedules=("1f1b", "zbv"), sequence_parallel=(False, True))
    with_ep = {(c.dp, c.tp, c.pp, c.ep, c.zero_stage, c.schedule, c.sequence_parallel) for c in everything if c.ep > 1}
    assert {(2, 1, 2, 2, z, s, False) for z in range(4) for s in ("1f1b", "zbv")} <= with_ep
    assert {(2, 2, 1, 2, z, None, sp) for z in range(4) for sp in (False, True)} <= with_ep
    assert not any("ep=" in reason and "divide" not in reason for reason in skipped), skipped
    estimate = p.estimate(next(c for c in everything if (c.tp, c.pp, c.ep, c.zero_stage) == (1, 2, 2, 3)))
    assert estimate.runs_today and estimate.comm_bytes["ep"] > 0, estimate.note
    # what the layout would refuse with ep is asked of Layout at runtime (not copied): left out, and counted
    from lightning_par.planner import plan as plan_module

    class Refusing(Layout):
        def __post_init__(self):
            if self.ep > 1 and self.pp > 1:
                raise LayoutError("ep with pp is refused here: a stand-in refusal")
            super().__post_init__()

    monkeypatch.setattr(plan_module, "Layout", Refusing)
    found, skipped = p.candidates(4, zero_stages=(0,), recompute=("none",), precisions=("fp32",),
                                  schedules=("1f1b",), sequence_parallel=(False,))
    assert not any(c.ep > 1 and c.pp > 1 for c in found) and any(c.ep == 1 and c.pp > 1 for c in found)
    assert skipped["ep with pp is refused here"] == 1  # dp2 x pp2 x ep2
    # ep must divide the experts and dp; a dense model gets no ep
    six = inspect_model(build_model(MoEGPT, {"config": replace(MOE_PRESETS["tiny"], n_experts=6)}))
    found, skipped = planner(six).candidates(4, zero_stages=(0,), recompute=("none",), precisions=("fp32",),
                                             schedules=("1f1b",), sequence_parallel=(False,))
    assert {c.ep for c in found if c.dp == 4} == {1, 2} and skipped["ep=4: does not divide dp=4 and the experts"]
    dense = inspect_model(build_model(GPT, {"config": GPT_PRESETS["tiny"]}))
    found, _ = planner(dense).candidates(4, zero_stages=(0,), recompute=("none",), precisions=("fp32",))
    assert found and {c.ep for c in found} == {1}


def _hf_moe(arch: str, **overrides):
    """The tiny ``arch`` config of the HF MoE tests (2 layers, 4 experts, top-2; DeepSeek-V3's first layer dense),
    built as ``plan --hf-config`` builds it, on the meta device."""
    pytest.importorskip("transformers")
    import transformers

    from tests.launch.hf_moe import EP_ARCHS, moe_config

    config = moe_config(arch, False)
    for key, value in overrides.items():
        setattr(config, key, value)
    return inspect_model(build_model(getattr(transformers, EP_ARCHS[arch]), {"config": config}))


#: arch -> (MoE layers, the experts' FFN width) of the tiny configs
HF_MOE = {"qwen3_moe": (2, 32), "mixtral": (2, 32), "deepseek_v3": (1, 32), "qwen2_moe": (2, 32), "olmoe": (2, 32)}


@pytest.mark.parametrize("arch", list(HF_MOE))
def test_a_hugging_face_moe_is_described_and_traced_with_balanced_routing(arch):
    """The experts from the model's own ep plan: total and active parameters from the config's dimensions, and the
    traced FLOPs of the experts those of top_k experts per token (the trace's stand-in for transformers' kernel):
    one more expert per token adds exactly 2 x tokens x 3 x hidden x ffn per MoE layer forward, twice that
    backward."""
    layers, ffn = HF_MOE[arch]
    hidden, experts, top_k = 64, 4, 2
    info = _hf_moe(arch)
    stacked = layers * experts * 3 * hidden * ffn  # gate|up [E, 2f, d] and down [E, d, f] per MoE layer
    assert info.experts.numel == stacked and set(info.experts.layers.values()) == {(experts, top_k)}
    assert info.active_numel == info.numel - stacked * (1 - top_k / experts)
    assert f"{info.active_numel:,}" in info.description
    one = _hf_moe(arch, num_experts_per_tok=1)
    traced = [trace_model(i, seq_len=SEQ) for i in (info, one)]
    for phase, factor in (("forward", 1), ("backward", 2)):
        flops = [sum(getattr(t, phase).total_flops for t in tr.units.values()) for tr in traced]
        assert flops[0] - flops[1] == factor * layers * 2 * SEQ * 3 * hidden * ffn, (phase, flops)


def test_plan_searches_ep_for_a_hugging_face_moe_and_refuses_gpt_oss_in_one_line(tmp_path, capsys):
    from lightning_par.plan_cli import main as plan
    from tests.launch.hf_moe import moe_config

    for arch in ("qwen3_moe", "gpt_oss"):
        moe_config(arch, False).save_pretrained(tmp_path / arch)
    common = ["--world", "4", "--hardware", "cpu", "--seq", "32", "--precision", "fp32", "--recompute", "none"]
    assert plan(["--hf-config", str(tmp_path / "qwen3_moe"), *common, "--layout", "dp=4,ep=2,zero=1"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "mixture of experts: 4 experts, top-2 in 2 layers" in out and "(82,816)" in out, out[:600]
    # gpt-oss's attention (sinks, sliding windows) does not run in the unit trace: one line naming the unit
    assert plan(["--hf-config", str(tmp_path / "gpt_oss"), *common]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lightning-par plan: GptOssForCausalLM's unit model.layers.0 does not run on fake "
                           "tensors") and "docs/moe.md" in last, last


def test_the_experts_bytes_of_a_hugging_face_moe_per_rank_under_ep():
    """The planner's expert state per rank for qwen3_moe under ep2 x expert_dp2: the same formulas as the example's
    (E/ep, and E/(ep x expert_dp) where the ZeRO stage shards)."""
    info = _hf_moe("qwen3_moe")
    p = planner(info)
    experts = info.experts.numel
    for zero, sharded in ((0, False), (1, True)):
        got = p.state_bytes(Candidate(4, 1, 1, zero, precision="fp32", ep=2))[0]["optimizer_states"]
        dense = info.numel - experts
        assert got - 8 * (math.ceil(dense / 4) if sharded else dense) == 8 * experts // (4 if sharded else 2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_the_mfu_of_a_hugging_face_moe_counts_its_active_parameters(arch):
    """``train/mfu``'s FLOPs per token of a Hugging Face MoE (experts found from its ep plan, not declared: no ep)
    are 6 x its active parameters + the attention term, the active ones computed here from the config."""
    pytest.importorskip("transformers")
    from lightning_par.utilization import model_flops_per_token
    from tests.launch.hf_moe import HFMoELM

    module = HFMoELM(arch)
    module.configure_model()
    total = sum(p.numel() for p in module.parameters())
    layers, ffn = HF_MOE[arch]
    active = total - layers * 4 * 3 * 64 * ffn // 2  # top-2 of 4 experts: half of each MoE layer's experts unused
    flops, how = model_flops_per_token(module, total, 32)
    assert flops == 6 * active + 12 * 2 * 64 * 32, how
    assert f"{active:,} active parameters of {total:,}" in how
