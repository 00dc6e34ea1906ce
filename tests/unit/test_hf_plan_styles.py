"""Every style in every plan the installed transformers publishes is applied or refused on purpose (issue 40).

The walk reads each config of ``CONFIG_MAPPING`` (its ``base_model_tp_plan`` and ``base_model_ep_plan``) and each
causal LM's head plan (``_tp_plan``), without building a model. A style that lightning-par neither applies
(:data:`~lightning_par.parallel.tensor_parallel.PLAN_STYLES`, an alias of one) nor refuses by name
(:data:`~lightning_par.parallel.tensor_parallel.REFUSED_STYLES`) fails the walk, naming the style and the models that
use it: the day a transformers release adds a style, this says so.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from lightning_par import LayoutError
from lightning_par.parallel import experts_ep
from lightning_par.parallel import tensor_parallel as tpmod

transformers = pytest.importorskip("transformers")

APPLIED_TP = {s for s in tpmod.PLAN_STYLES if s != "block_input"} | set(tpmod.STYLE_ALIASES)
APPLIED_EP = (set(experts_ep.EP_STYLES) | set(experts_ep.DENSE_TP_STYLES) | set(experts_ep.ROUTER_STYLES)
              | set(experts_ep.EP_ALIASES))


def published_styles() -> tuple[dict[str, set[str]], dict[str, set[str]], int]:
    """``({tp style: model types}, {ep style: model types}, configs walked)`` of the installed transformers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tp, ep = collections.defaultdict(set), collections.defaultdict(set)
    walked = 0
    for model_type in CONFIG_MAPPING.keys():
        try:
            config = CONFIG_MAPPING[model_type]
        except Exception:  # (a config whose optional dependency is missing: transformers cannot build it either)
            continue
        walked += 1
        head = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        head_plan = dict(getattr(getattr(transformers, head, None), "_tp_plan", None) or {}) if head else {}
        for style in {**dict(getattr(config, "base_model_tp_plan", None) or {}), **head_plan}.values():
            tp[style].add(model_type)
        for style in dict(getattr(config, "base_model_ep_plan", None) or {}).values():
            ep[style].add(model_type)
    return tp, ep, walked


def test_every_published_style_is_applied_or_refused_on_purpose():
    tp, ep, walked = published_styles()
    assert walked > 100, f"only {walked} configs walked: CONFIG_MAPPING was not read"
    print(f"transformers {transformers.__version__}: {walked} configs; tp styles "
          + ", ".join(f"{s} ({len(m)})" for s, m in sorted(tp.items(), key=lambda kv: -len(kv[1])))
          + "; ep styles " + ", ".join(f"{s} ({len(m)})" for s, m in sorted(ep.items())))
    unknown = {s: sorted(m) for s, m in tp.items() if s not in APPLIED_TP and s not in tpmod.REFUSED_STYLES}
    unknown_ep = {s: sorted(m) for s, m in ep.items() if s not in APPLIED_EP and s not in experts_ep.REFUSED_EP_STYLES}
    assert not unknown, (f"transformers {transformers.__version__} publishes tensor-parallel styles lightning-par "
                         f"neither applies nor refuses on purpose: {unknown}. Apply each in "
                         "parallel/tensor_parallel.py or add it to REFUSED_STYLES with the reason.")
    assert not unknown_ep, (f"transformers {transformers.__version__} publishes expert-parallel styles lightning-par "
                            f"neither applies nor leaves out on purpose: {unknown_ep} (parallel/experts_ep.py).")


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)
        self.sinks = nn.Parameter(torch.zeros(2))
        self.num_heads = 2


class _Model(nn.Module):
    def __init__(self, plan: dict[str, str]):
        super().__init__()
        self.layers = nn.ModuleList([_Attention()])
        self.tp_plan = plan


@pytest.mark.parametrize("style", sorted(tpmod.REFUSED_STYLES))
def test_a_refused_style_names_the_entry_the_reason_and_a_layout_that_trains(style):
    model = _Model({"layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise", "layers.*": style})
    with pytest.raises(LayoutError) as refused:
        tpmod.resolve_tp_plan(model, 2)
    message = str(refused.value)
    assert f"_Model.tp_plan['layers.*'] = {style!r} is not applied by lightning-par: " in message, message
    assert tpmod.REFUSED_STYLES[style] in message and "Train _Model with tp=1" in message, message


def test_local_params_splits_the_modules_per_head_parameters_over_the_heads():
    """transformers' ``local_params`` (granite_swa, mimo_v2_flash, hy_v4, beam: attention sinks or a per-head gate
    bias, each named by its own ``colwise`` entry): the parameters are split on their head dimension with the heads
    q/k/v give each rank; anything else is refused at setup, naming the entry."""
    attention = {"layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise", "layers.*": "local_params"}
    plan = tpmod.resolve_tp_plan(_Model({**attention, "layers.*.sinks": "colwise"}), 2)
    assert plan["layers.0"] == "local_params:sinks" and plan["layers.0.q_proj"] == "colwise", plan
    style = tpmod.parallel_style(plan["layers.0"], _Attention(), False)
    assert isinstance(style, tpmod.BlockInput) and style.sharded == ("sinks",)
    with pytest.raises(LayoutError, match=r"^_Model.layers.0.sinks \(in _Attention\) is planned 'rowwise' inside "
                                          r"a module planned 'local_params'"):
        tpmod.resolve_tp_plan(_Model({**attention, "layers.*.sinks": "rowwise"}), 2)
    model = _Model({**attention, "layers.*.sinks": "colwise"})
    model.layers[0].sinks = nn.Parameter(torch.zeros(3))  # not a head count
    with pytest.raises(LayoutError, match=r"has shape \(3,\): 'local_params' splits a bare parameter over the heads"):
        tpmod.resolve_tp_plan(model, 2)
    with pytest.raises(LayoutError, match=r"is planned 'local_params', which splits its own per-head parameters .* "
                                          r"but no projection inside it is planned 'colwise'"):
        tpmod.resolve_tp_plan(_Model({"layers.*": "local_params", "layers.*.sinks": "colwise"}), 2)


def test_unit_colwise_is_colwise_where_tp_divides_the_heads():
    plan = tpmod.resolve_tp_plan(_Model({"layers.*.q_proj": "unit_colwise", "layers.*.o_proj": "rowwise"}), 2)
    assert plan["layers.0.q_proj"] == "colwise" and plan["layers.0.o_proj"] == "rowwise"


def test_mla_takes_the_rope_width_from_the_config_or_the_plan():
    model = _Model({"layers.*.q_proj": "colwise", "layers.*.o_proj": "mla_kv_a_proj"})
    with pytest.raises(LayoutError, match=r"'mla_kv_a_proj' needs the width of the shared rope key: the model has no "
                                          r"config.qk_rope_head_dim. Name it in the plan as 'mla_kv_a_proj:R'"):
        tpmod.resolve_tp_plan(model, 2)
    model.tp_plan = {"layers.*.q_proj": "colwise", "layers.*.o_proj": "mla_kv_a_proj:2"}
    assert tpmod.resolve_tp_plan(model, 2)["layers.0.o_proj"] == "mla_kv_a_proj:2"
    model.tp_plan = {"layers.*.q_proj": "colwise", "layers.*.o_proj": "mla_kv_a_proj:8"}  # all 8 outputs rope?
    with pytest.raises(LayoutError, match=r"an nn.Linear whose output ends with the 8 rope-key features"):
        tpmod.resolve_tp_plan(model, 2)
    model.tp_plan = {"layers.*.q_proj": "colwise", "layers.*.o_proj": "mla_kv_a_proj:2"}
    with pytest.raises(LayoutError, match=r"with sequence_parallel=True: the shared rope key"):
        tpmod.resolve_tp_plan(model, 2, sequence_parallel=True)


def test_a_second_rowwise_projection_used_inside_the_region_is_refused():
    """Issue 40: Doge's attention plans ``dt_proj`` (a gate per key/value head, from the value states) 'rowwise'
    next to ``o_proj``: its output, summed over tp, holds every head's gate while the rank holds its own heads only.
    Under tp2 the first forward failed with a shape error -- which Lightning's teardown then hid behind
    "_apply(): Couldn't swap Linear.weight". Now refused at setup, naming the module; two exits of the block's width
    (two branches summed) are left alone."""
    model = _Model({"layers.*.q_proj": "colwise", "layers.*.gate": "rowwise", "layers.*.o_proj": "rowwise"})
    model.layers[0].gate = nn.Linear(8, 2)
    with pytest.raises(LayoutError, match=r"^_Model.layers.0.gate \(2 outputs\) is planned 'rowwise' inside "
                                          r"_Attention \(layers.0\) next to its output projection layers.0.o_proj: "
                                          r".* Train _Model with tp=1"):
        tpmod.resolve_tp_plan(model, 2)
    model.layers[0].gate = nn.Linear(8, 8)  # a second branch of the block's width
    assert tpmod.resolve_tp_plan(model, 2)["layers.0.gate"] == "rowwise"


def test_embedding_colwise_splits_the_hidden_features():
    class Embedded(nn.Module):
        tp_plan = {"embed": "embedding_colwise"}

        def __init__(self, dim: int):
            super().__init__()
            self.embed = nn.Embedding(16, dim)

    assert tpmod.resolve_tp_plan(Embedded(8), 2)["embed"] == "embedding_colwise"
    assert tpmod.planned_split_dim("embedding_colwise", nn.Embedding(16, 8), "weight") == 1
    with pytest.raises(LayoutError, match=r"embedding_dim is 9, which tp=2 does not divide"):
        tpmod.resolve_tp_plan(Embedded(9), 2)


class _Experts(nn.Module):
    num_experts = 4

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 4))
        self.down_proj = nn.Parameter(torch.zeros(4, 4, 4))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential()
        self.mlp.add_module("up_proj", nn.Linear(4, 8))
        self.experts = _Experts()


class _UserEP(nn.Module):
    """A user's model whose own ep plan names a dense layer colwise (strict: refused)."""

    ep_plan = {"layers.*.mlp.up_proj": "colwise", "layers.*.experts.gate_up_proj": "grouped_gemm",
               "layers.*.experts.down_proj": "grouped_gemm", "layers.*.experts": "ep_dispatch_experts"}

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer()])


class _PublishedEP(_UserEP):
    """The same shaped as a transformers model (config, base_model_prefix, post_init): Gemma-4's kind of ep plan."""

    base_model_prefix = ""
    config = None

    def post_init(self):
        pass


def test_an_ep_plan_splitting_a_dense_layer_leaves_it_to_data_parallel():
    """Gemma-4's published ep plan also names its dense MLP colwise/rowwise: under lightning-par's expert parallel
    the ep ranks hold different tokens, so the MLP stays a whole replica on each (the same function); a user's own
    ep plan naming one is still refused."""
    assert experts_ep.resolve_ep_plan(_PublishedEP()) == {"layers.0.experts": ("gate_up_proj", "down_proj")}
    with pytest.raises(LayoutError, match=r"_UserEP.ep_plan\['layers.\*.mlp.up_proj'\] = 'colwise' is not a style "
                                          r"lightning-par's expert parallel applies"):
        experts_ep.resolve_ep_plan(_UserEP())


class _ConvReader(nn.Module):
    """Qwen3-Next's gated delta net in small: it reads its short convolution's weight itself (without calling the
    ``nn.Conv1d``), next to split projections."""

    tp_plan = {"q": "colwise", "o": "rowwise"}

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, groups=8, padding=2)

    def forward(self, x):
        h = self.q(x).transpose(1, 2)
        h = torch.nn.functional.conv1d(h, self.conv.weight, self.conv.bias, padding=2, groups=8)[..., :x.size(1)]
        return self.o(h.transpose(1, 2))


def test_a_replicated_parameter_read_by_its_parent_is_local_there(one_process_group):
    """A replicated module's parameters are local tensors while its parent runs, not only its own forward: before,
    a DTensor weight met plain activations ("got mixed torch.Tensor and DTensor"), 12 architectures of the matrix."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model, reference = _ConvReader(), _ConvReader()
    reference.load_state_dict(model.state_dict())
    tpmod.apply_tensor_parallel(model, init_device_mesh("cpu", (1,)))
    assert isinstance(model.conv.weight, DTensor)
    x = torch.randn(2, 5, 8)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert isinstance(model.conv.weight, DTensor), "restored after the forward"
    assert torch.allclose(model.conv.weight.grad.full_tensor(), reference.conv.weight.grad, atol=1e-6)


def test_teardown_after_a_failed_run_does_not_replace_its_error(monkeypatch):
    """Issue 40: after Doge's tp2 forward failed, Lightning's teardown could not move the DTensor parameters (the
    failure's traceback still held them) and its "Couldn't swap" error replaced the run's own. A teardown error
    after a failed run is logged; without a failure it is raised."""
    from lightning.pytorch.strategies import ParallelStrategy

    from lightning_par import LayoutStrategy

    def cannot_move(self):
        raise RuntimeError("_apply(): Couldn't swap Linear.weight")

    monkeypatch.setattr(ParallelStrategy, "teardown", cannot_move)
    strategy = LayoutStrategy()
    strategy._failure = ValueError("the run's own error")  # (what on_exception records)
    strategy.teardown()
    strategy._failure = None
    with pytest.raises(RuntimeError, match="Couldn't swap"):
        strategy.teardown()
