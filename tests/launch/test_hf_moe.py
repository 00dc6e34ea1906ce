"""Hugging Face mixture-of-experts models under the layouts without expert parallelism (issue 29, first slice).

(a) tp2 from the model's own published plan -- ``packed_colwise`` on the fused expert gate|up weights, ``rowwise`` on
    down, ``moe_tp_experts`` on the experts module -- through ``Trainer.fit``, per-step losses within 1e-5 of one
    process, plain SGD and AdamW, with the router's load-balancing loss off and on (the model computes it from all
    layers' router logits of the whole batch; tp does not split tokens, so it must match exactly). ZeRO-3 over dp2
    and a 2-stage 1F1B pipeline on the same tiny models, at parity too (load-balancing loss off); on 4 ranks (full
    set), dp2 x tp2 and tp2 x pp2; and tp2 resumed from its checkpoint in a new Trainer after 3 of the 6 steps
    (full set). All in launches of ``tests/launch/hf_moe.py``, one per rank count: the default
    set's one launch (2 ranks) runs two fits, the refusals and the styles alone (each published plan of qwen3_moe,
    mixtral, deepseek_v3, qwen2_moe and olmoe applied without Lightning: one step's loss, every gradient and the
    gradient norm against one process, each rank's slices of the experts, the DCP checkpoint; a user's plain PyTorch
    MoE, and the experts self-check); the full set adds the other fits.
(c) Expert parallel from the model's own ep plan (``ep_dispatch_experts``, ``grouped_gemm``): ep2 on 2 ranks for
    qwen3_moe and mixtral (SGD and AdamW, the load-balancing loss off and on), deepseek_v3 (SGD, AdamW), qwen2_moe,
    olmoe and gpt_oss, and at ZeRO-3; on 4 ranks ep2 x dp2 at ZeRO-1 and ZeRO-3, and ep2 beside tp2 on attention at
    ZeRO-1 (full set; the default set's 2-rank launch runs qwen3_moe ep2 SGD with the loss on). Losses within 1e-5 of
    one process whose loss is the mean of the model's loss on each rank's share of the batch (the per-rank
    load-balancing loss); each rank 1/ep of the expert bytes and of their AdamW state. In this process, the ep plans
    resolved and the refusals. Inside a pipeline (full set): ep2 x pp2 on 4 ranks under 1F1B and ZBV for qwen3_moe,
    mixtral and deepseek_v3 (SGD; qwen3_moe AdamW under 1F1B), dp2 x tp2 x pp2 x ep2 on 8 ranks (qwen3_moe); with
    context parallel, ep2 x cp2 on 2 ranks (the three, SGD; qwen3_moe and mixtral with the load-balancing loss, each
    cp rank's term on its own tokens); each rank 1/ep of its stage's expert bytes. In this process, the experts
    declared before the split stay declared on each stage's copy.
(b) In this process: the resolved plans of qwen3_moe, qwen2_moe, mixtral, olmoe and deepseek_v3 at tp2, and the
    refusals of what ``moe_tp_experts`` cannot split exactly, each naming the module, the style and the fix.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_par import LayoutError
from lightning_par.parallel.expert_parallel import check_expert_parallel
from lightning_par.parallel.experts_ep import declare_planned_experts, resolve_ep_plan
from lightning_par.parallel.tensor_parallel import check_layout_plan, planned_split_dim, resolve_tp_plan
from tests.conftest import full_run
from tests.harness import launch_matrix, max_rel_diff
from tests.launch.hf_moe import ARCHS, CASES, ERROR_CASES, STEPS, moe_model

transformers = pytest.importorskip("transformers")

PARITY_RTOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory, cache_dir, request):
    """``results(world)``: the cases of this run on ``world`` ranks (the default set: those not marked ``full``), in
    one launch on first use; the 2-rank launch also runs the refusals and the styles alone."""
    full = full_run(request.config)
    out: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in out:
            # (only the fits whose parity test this session runs: `-k` selects what a launch trains)
            chosen = {item.callspec.params.get("name") for item in request.session.items if hasattr(item, "callspec")}
            names = [n for n, case in CASES.items() if case.world == world and (full or not case.full) and n in chosen]
            extra = ["--errors", *ERROR_CASES, "--styles"] if world == 2 else []
            root = tmp_path_factory.mktemp(f"hf_moe_{world}")
            path = root / "results.json"
            run = launch_matrix(root, cache_dir, "tests.launch.hf_moe", ["--out", str(path), "--cases", *names, *extra],
                                nproc=world, timeout=max(900, 120 * len(names))).check()
            print(f"hf_moe on {world} ranks: {len(names)} fits{' + the refusals and styles' if extra else ''} in "
                  f"{run.seconds:.1f} s")
            out[world] = json.loads(path.read_text())
        return out[world]

    return get


def _part(launched: dict, name: str):
    """One part of a shared launch; its error, if it raised, fails only the tests reading it."""
    part = launched[name]
    if isinstance(part, dict) and "error" in part:
        pytest.fail(f"{name} failed in the shared launch: {part['error']}")
    return part


# -- (a) parity with one process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.launch(ranks=c.world, full=c.full))
                                  for n, c in CASES.items()])
def test_moe_model_trains_as_one_process(results, name):
    case = CASES[name]
    result = _part(results(case.world), name)
    diff = max_rel_diff(result["fit"], result["reference"])
    print(f"{name}: max relative per-step loss difference {diff:.2e} over {STEPS} steps "
          f"({result['reference'][0]:.3f} -> {result['reference'][-1]:.3f}), {result['seconds']:.1f} s; "
          f"load-balancing term {result['aux_terms'][0]:.4f}; experts on rank 0: {result['placements'][0]}")
    assert len(result["fit"]) == STEPS and diff <= PARITY_RTOL
    assert result["reference"][-1] < result["reference"][0] - 1.0, "the model must learn for parity to mean much"
    if case.aux:  # the load-balancing term is in the loss, far above the tolerance
        assert min(result["aux_terms"]) > 1e3 * PARITY_RTOL * max(result["reference"])
    if case.scope == "global":  # its reference: one process on whole batches
        _check_other_scope(result, "the per-rank (micro_batch) loss's reference")
    if "ep" in case.layout:
        _check_expert_parallel(case, result)
    elif "tp" in case.layout and not case.resume:  # each rank its slice of every expert: gate|up packed, down by input
        assert len(result["placements"]) == case.world
        for rank, held in enumerate(result["placements"]):
            # (with dp2, FSDP2's replicas add a Replicate() over dp before the tp placement)
            assert "_StridedShard(dim=1, sf=2)" in held["gate_up_proj"], (rank, held)
            assert held["gate_up_proj"].endswith(" local (4, 32, 64) of (4, 64, 64)"), (rank, held)
            assert "Shard(dim=2)" in held["down_proj"] and "_StridedShard" not in held["down_proj"], (rank, held)
            assert held["down_proj"].endswith(" local (4, 64, 16) of (4, 64, 32)"), (rank, held)


def _check_expert_parallel(case, result):
    """ep2 from the model's own ep plan: each rank holds 2 of the 4 experts of every layer (``Shard(0)`` over ep,
    replicated over tp beside tensor parallel), 1/ep of the expert bytes and of their AdamW state; with the
    load-balancing loss on, the reference is per rank (the mean of each rank's loss on its share), which a
    one-process run on whole batches is not."""
    ep, stage = case.layout["ep"], case.layout.get("zero_stage", 0)
    expert_dp = case.world // case.layout.get("tp", 1) // case.layout.get("pp", 1) // ep
    # ZeRO over the experts' replicas: parameters 1/expert_dp more at stage 3, optimizer state at stages 1-3
    params_over, state_over = ep * (expert_dp if stage == 3 else 1), ep * (expert_dp if stage >= 1 else 1)
    assert len(result["placements"]) == case.world
    for rank, held in enumerate(result["placements"]):
        if "pp" in case.layout and not held["bytes"]["total"]:  # a stage of DeepSeek-V3's dense first layer only
            assert case.arch == "deepseek_v3" and held == {"bytes": {"held": 0, "total": 0, "state": 0, "states": 0}}
            continue
        placement = "(Shard(dim=0), Replicate())" if "tp" in case.layout else "(Shard(dim=0),)"
        if stage == 3:  # FSDP2 shards the rank's ep slice further over expert_dp (on dimension 0 too)
            placement = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert held["gate_up_proj"].startswith(placement), (rank, held)
        assert held["down_proj"].startswith(placement), (rank, held)
        local = f" local ({4 // params_over}, "
        assert local in held["gate_up_proj"] and " of (4, " in held["gate_up_proj"], (rank, held)
        sizes = held["bytes"]
        assert sizes["held"] * params_over == sizes["total"] > 0, (rank, sizes)
        if case.optimizer == "adamw":  # exp_avg and exp_avg_sq of this rank's share of the experts only
            assert sizes["state"] * state_over == 2 * sizes["total"] and sizes["states"] > 0, (rank, sizes)
        else:
            assert sizes["states"] == 0, (rank, sizes)
    if case.aux and case.scope is None:
        _check_other_scope(result, "one process on whole batches (the global scope's reference)")


def _check_other_scope(result, what):
    """The reference of the other load-balancing scope is another function, well beyond the parity tolerance: the
    test tells the two apart."""
    other = max_rel_diff(result["other_scope"], result["reference"])
    print(f"  {what} differs by {other:.2e}")
    assert other > 10 * PARITY_RTOL


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_published_moe_plan_gives_one_process_gradients(results, arch):
    """``apply_tensor_parallel`` alone on 2 ranks, one step with the load-balancing loss on (DeepSeek-V3 routes without
    one): the loss, every gradient and the global gradient norm against one process, each rank's slices of the
    experts, and the DCP checkpoint as one process's state dict."""
    for rank, applied in enumerate(_part(results(2), "styles")):
        got = applied[arch]
        print(f"{arch} rank {rank}: loss {got['loss_rel']:.1e}, worst gradient {got['grad_rel']:.1e} ({got['worst']}), "
              f"gradient norm {got['norm_rel']:.1e}")
        assert got["loss_rel"] <= PARITY_RTOL and got["grad_rel"] <= PARITY_RTOL
        assert got["all_dtensors"] and got["norm_rel"] <= PARITY_RTOL  # the global gradient norm of one process
        assert got["checkpoint_equal"]  # DCP holds the one-process tensors: any layout, or one process, reads it
        # rank r: rows [r*I/2, (r+1)*I/2) of gate and the same of up; the same columns of down
        assert got["gate_up_slices"] and got["down_slices"]
        assert got["aux"] == (arch != "deepseek_v3")


@pytest.mark.launch(ranks=2)
def test_experts_of_a_users_moe_are_self_checked_at_setup(results):
    """A plain PyTorch MoE declaring transformers' plan: its experts match one process; experts that squash their
    output after down would not be a sum of the ranks' slices, and the self-check at setup refuses them by name."""
    for applied in _part(results(2), "styles"):
        got = applied["user_experts"]
        print(f"user's experts: worst gradient {got['grad_rel']:.1e}; squashed: {got['squashed_error']}")
        assert got["grad_rel"] <= PARITY_RTOL
        assert got["squashed_error"].startswith(
            "UserMoE.experts (SquashedExperts) computes another function (largest difference from the unsplit module")
        assert "when 'moe_tp_experts' splits it over tp=2" in got["squashed_error"]


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_a_refused_moe_layout_is_one_error_on_every_rank(results, name):
    """Refused at setup before any collective: the same LayoutError on both ranks, not followed by another (the
    teardown of a model still on the meta device raised "Cannot copy out of meta tensor" over it once). The packed
    experts under ZeRO-1; the global scope of the load-balancing loss under pp (each stage forms its layers' terms
    from its own tokens there)."""
    errors = results(2)[name]["errors"]
    _, _, expected = ERROR_CASES[name]
    assert len(errors) == 2
    for error in errors:
        assert error.startswith(expected), error
        assert "[chained" not in error and "meta" not in error, error


# -- (b) plans and refusals, in this process ------------------------------------------------------------------------
def _model(arch: str):
    """The tiny ``arch`` model with its experts' split declared (:data:`~tests.launch.hf_moe.EXPERTS_TP_PLAN`)."""
    return moe_model(arch)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_published_moe_plans_resolve(arch):
    model = _model(arch)
    plan = resolve_tp_plan(model, 2)
    experts = "model.layers.1.mlp.experts"
    assert plan[experts] == "moe_tp_experts:gate_up_proj=packed_colwise,down_proj=rowwise"
    assert plan["model.layers.1.mlp.gate"] == "replicate"  # the router: every rank routes every token
    assert not any(name.endswith(("gate_up_proj", "down_proj")) and name.startswith(experts) for name in plan)
    # the planner's view of each expert parameter: the dimension tp splits
    module = model.get_submodule(experts)
    assert planned_split_dim(plan[experts], module, "gate_up_proj") == 1
    assert planned_split_dim(plan[experts], module, "down_proj") == 2
    if arch == "deepseek_v3":  # a dense first layer, the shared experts a Megatron MLP
        assert plan["model.layers.0.mlp.gate_proj"] == plan["model.layers.1.mlp.shared_experts.up_proj"] == "colwise"
        assert plan["model.layers.1.mlp.shared_experts"] == "block_input"
        assert plan["model.layers.1.self_attn.q_a_proj"] == "replicate"
        if "mla_kv_a_proj" in model.tp_plan.values():  # MLA attention split by heads (transformers >= 5.2x)
            assert plan["model.layers.1.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj:8"  # qk_rope_head_dim
            assert plan["model.layers.1.self_attn.kv_b_proj"] == plan["model.layers.1.self_attn.q_b_proj"] == "colwise"
            assert plan["model.layers.1.self_attn.o_proj"] == "rowwise"
        else:  # (5.17: attention replicated)
            assert plan["model.layers.1.self_attn.kv_a_proj_with_mqa"] == "replicate"


class _Experts(nn.Module):
    """An experts module as transformers writes one, with knobs for what cannot be split."""

    def __init__(self, bias: bool = False, dims: int = 3):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 36, 32) if dims == 3 else torch.zeros(36, 32))
        self.down_proj = nn.Parameter(torch.zeros(4, 32, 32))
        if bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(4, 32))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class _NoWeights(_Experts):
    def forward(self, hidden_states, top_k_index):
        return hidden_states


class _MoE(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts


class _Tiny(nn.Module):
    tp_plan = {"layers.*.experts.gate_up_proj": "packed_colwise", "layers.*.experts.down_proj": "rowwise",
               "layers.*.experts": "moe_tp_experts"}

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([_MoE(experts)])


@pytest.mark.parametrize(
    "experts,plan,tp,match",
    [
        (_Experts(bias=True), {}, 2,
         r"layers.0.experts \(_Experts\) is planned 'moe_tp_experts'.*its 'down_proj_bias' has no split in the plan "
         r"\(it would be counted 2 times\). Plan every parameter"),
        (_Experts(dims=2), {}, 2, r"layers.0.experts.gate_up_proj has shape \(36, 32\), but 'moe_tp_experts' "
                                  r"splits expert parameters of shape \[experts, out, in\]"),
        (_Experts(), {}, 4, r"layers.0.experts.gate_up_proj: dimension 1 is 36, which 'packed_colwise' cannot cut "
                            r"into 8 equal slices \(2 parts x tp=4\)"),
        (_NoWeights(), {}, 2, r"layers.0.experts \(_NoWeights\): its forward takes no routing weights"),
        (_Experts(), {"layers.*.experts": "replicate"}, 2,
         r"splits the parameter layers.0.experts.gate_up_proj \('packed_colwise'\), but its module layers.0.experts "
         r"is planned 'replicate': lightning-par splits a bare parameter only inside a module planned "
         r"'moe_tp_experts'"),
        (_Experts(), {"layers.*.experts.down_proj": "vocab_parallel"}, 2,
         r"down_proj is planned 'vocab_parallel', which lightning-par does not apply to an expert parameter: use one "
         r"of packed_colwise, colwise, rowwise"),
    ],
)
def test_experts_that_cannot_be_split_exactly_are_refused(experts, plan, tp, match):
    model = _Tiny(experts)
    model.tp_plan = {**_Tiny.tp_plan, **plan}
    with pytest.raises(LayoutError, match=match):
        resolve_tp_plan(model, tp)


def test_transposed_or_interleaved_expert_weights_are_refused():
    experts = _Experts()
    experts.is_transposed = True
    with pytest.raises(LayoutError, match=r"stores its expert weights transposed, which 'moe_tp_experts' does not "
                                          r"split.*Remove its entries from the tp plan"):
        resolve_tp_plan(_Tiny(experts), 2)
    experts = _Experts()
    experts.is_concatenated = False
    with pytest.raises(LayoutError, match=r"with gate and up interleaved"):
        resolve_tp_plan(_Tiny(experts), 2)


def test_an_unknown_style_lists_the_styles_lightning_par_applies():
    model = _Tiny(_Experts())
    model.tp_plan = {**_Tiny.tp_plan, "layers.*.experts": "ep_dispatch_experts"}
    with pytest.raises(LayoutError, match=r"'ep_dispatch_experts' is not a style lightning-par applies; use one of: "
                                          r"colwise, packed_colwise, .*replicated_with_grad_allreduce, "
                                          r".*moe_tp_experts"):
        resolve_tp_plan(model, 2)


def test_packed_experts_with_zero_are_refused_with_a_fix_for_experts():
    with pytest.raises(LayoutError, match=r"model.layers.0.mlp.experts is planned 'moe_tp_experts:gate_up_proj="
                                          r"packed_colwise,down_proj=rowwise', which zero_stage=3 cannot shard yet.*"
                                          r"Use zero_stage=0 \(data-parallel replicas\), or ZeRO without tp"):
        check_layout_plan(_model("qwen3_moe"), 2, False, 3)


def test_a_router_planned_replicated_with_grad_allreduce_is_refused():
    """Every rank routes every token: the router's gradient is whole on every rank (the routing weights' gradient is
    summed over tp by moe_tp_experts), so summing it again would multiply it by tp. A q/k norm inside attention keeps
    the style (Qwen3-MoE's own plan)."""
    model = _model("qwen3_moe")
    assert resolve_tp_plan(model, 2)["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.gate": "replicated_with_grad_allreduce"}
    with pytest.raises(LayoutError, match=r"Qwen3MoeForCausalLM.model.layers.0.mlp.gate \(Qwen3MoeTopKRouter\) is "
                                          r"planned 'replicated_with_grad_allreduce'.*the sum would multiply it by 2. "
                                          r"Plan it 'replicate'"):
        resolve_tp_plan(model, 2)


# -- (c) the ep plan, in this process -------------------------------------------------------------------------------
EP_PLAN = {"layers.*.experts.gate_up_proj": "grouped_gemm", "layers.*.experts.down_proj": "grouped_gemm",
           "layers.*.experts": "ep_dispatch_experts"}


def _ep_tiny(experts: nn.Module, plan: dict[str, str] | None = None) -> nn.Module:
    """A user's model declaring an ep plan of its own (strict: a pattern must match)."""
    experts.num_experts = 4
    model = _Tiny(experts)
    model.ep_plan = {**EP_PLAN, **(plan or {})}
    return model


@pytest.mark.parametrize("arch", [*ARCHS, "gpt_oss"])
def test_published_ep_plans_resolve_and_leave_the_experts_out_of_tp(arch):
    """Each model's own ep plan: every MoE layer's experts module with all its parameters stacked over the experts
    (gpt-oss: its biases too); under ep > 1 the tp plan leaves those modules to expert parallel (tensor parallel
    replicates them), so the packed styles ZeRO-1 cannot shard are gone."""
    model = moe_model(arch)
    resolved = resolve_ep_plan(model)
    moe_layers = [f"model.layers.{i}.mlp.experts" for i in range(1 if arch == "deepseek_v3" else 0, 2)]
    stacked = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias") if arch == "gpt_oss" else \
        ("gate_up_proj", "down_proj")
    assert resolved == dict.fromkeys(moe_layers, stacked)
    if arch == "gpt_oss":
        return  # (its tp plan does not split its transposed experts)
    with pytest.raises(LayoutError, match="which zero_stage=1 cannot shard yet"):
        check_layout_plan(model, 2, False, 1)
    check_layout_plan(model, 2, False, 1, ep=2)
    plan = resolve_tp_plan(model, 2, ep=2)
    assert all(plan[name] == "replicate" for name in moe_layers)
    assert not any(style.startswith("moe_tp_experts") for style in plan.values())


def test_hf_experts_declared_from_the_ep_plan_compute_one_process_function():
    """Declared but not split (no token exchange), the dispatching forward is the module's own."""
    model, reference = moe_model("qwen3_moe"), moe_model("qwen3_moe")
    declared = declare_planned_experts(model)
    assert set(check_expert_parallel(model, 2)) == set(declared) == {f"model.layers.{i}.mlp.experts" for i in (0, 1)}
    tokens = torch.randint(0, 256, (2, 16))
    assert torch.equal(model(input_ids=tokens).logits, reference(input_ids=tokens).logits)
    with pytest.raises(LayoutError, match=r"has 4 experts, which ep=3 does not divide.*Use ep in \[1, 2, 4\]"):
        check_expert_parallel(model, 3)


def test_hf_experts_declared_before_a_pipeline_split_stay_declared_on_each_stage():
    """Under pp the engine declares the experts on the whole model, then cuts the stages as copies of it: each copy
    of an experts module keeps the interface, its dispatching forward and local experts bound to the copy (a forward
    bound to the original would split the original's weights and never train the stage's)."""
    from lightning_par.parallel.expert_parallel import prepare_expert_parallel
    from lightning_par.parallel.pipeline.split import rank_module

    model = moe_model("deepseek_v3")  # (its first layer is dense: stage 0 holds no experts)
    prepare_expert_parallel(model, 2)
    units = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    first, last = (rank_module(model, [units[:2], units[2:]], [i], units=units)
                   for i in (0, 1))
    assert check_expert_parallel(first, 2, part=True) == {}
    held = check_expert_parallel(last, 2, part=True)
    assert list(held) == ["model.layers.1.mlp.experts"]
    copy, original = held["model.layers.1.mlp.experts"], model.get_submodule("model.layers.1.mlp.experts")
    assert copy is not original and copy.gate_up_proj is not original.gate_up_proj
    for bound in (copy.forward, copy.experts):
        assert bound.args[0] is copy and bound.args[1].__self__ is copy
    prepare_expert_parallel(last, 2, part=True)  # (again on the rank's part: declared already, left as it is)
    assert copy.forward.args[0] is copy


@pytest.mark.parametrize(
    "experts,plan,match",
    [
        (_Experts(), {"layers.*.experts": "ep_router"},
         r"_Tiny.ep_plan\['layers.\*.experts'\] = 'ep_router' is not a style lightning-par's expert parallel applies; "
         r"it applies 'ep_dispatch_experts' \(an experts module.*and 'grouped_gemm'"),
        (_Experts(bias=True), {},
         r"_Tiny.layers.0.experts \(_Experts\) is planned 'ep_dispatch_experts', but its parameter 'down_proj_bias' "
         r"has no 'grouped_gemm' entry.*Plan _Tiny.layers.0.experts.down_proj_bias 'grouped_gemm'"),
        (_Experts(dims=2), {}, r"_Tiny.layers.0.experts.gate_up_proj is planned 'grouped_gemm' but its shape is "
                               r"\(36, 32\), not stacked over the 4 experts on dimension 0"),
        (_NoWeights(), {}, r"_Tiny.layers.0.experts \(_NoWeights\): its forward takes no routing weights"),
        (_Experts(), {"layers.*.experts": "replicate", "layers.*.experts.down_proj": "grouped_gemm"},
         r"'replicate' is not a style lightning-par's expert parallel applies"),
        (_Experts(), {"layers.*.expert": "ep_dispatch_experts"},
         r"_Tiny.ep_plan names 'layers.\*.expert' \('ep_dispatch_experts'\), but _Tiny has no module of that name"),
    ],
)
def test_an_ep_plan_that_cannot_be_applied_exactly_is_refused(experts, plan, match):
    with pytest.raises(LayoutError, match=match):
        resolve_ep_plan(_ep_tiny(experts, plan))


def test_grouped_gemm_outside_a_dispatching_module_is_refused():
    model = _ep_tiny(_Experts())
    model.ep_plan = {"layers.*.experts.gate_up_proj": "grouped_gemm", "layers.*.experts.down_proj": "grouped_gemm"}
    with pytest.raises(LayoutError, match=r"splits layers.0.experts.gate_up_proj \('grouped_gemm'\), but its module "
                                          r"layers.0.experts is not planned 'ep_dispatch_experts'"):
        resolve_ep_plan(model)
