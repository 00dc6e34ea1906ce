"""The example MoE GPT, ``ep`` in the layout and expert parallel's refusals (one process; the multi-rank parity is
tests/launch/test_expert_parallel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_par import (
    Hybrid3DStrategy,
    Layout,
    LayoutError,
    LayoutStrategy,
    ParallelDims,
    PipelineStrategy,
    ZeroStrategy,
)
from lightning_par.examples import GPT, GPT_PRESETS, MOE_PRESETS, MoEConfig, MoEGPT
from lightning_par.examples.moe import MoEFeedForward
from lightning_par.parallel.expert_parallel import _regroup, check_expert_parallel, expert_layers
from lightning_par.parallel.gradient_sync import DDPSync
from lightning_par.parallel.parallelize import ParallelizeConfig, parallelize
from lightning_par.parallel.parts import split
from lightning_par.parallel.pipeline.loss import check_layer_losses
from lightning_par.parallel.stage_plan import SCHEDULES
from lightning_par.plugins.layout_checkpoints import LayoutCheckpoints


def moe(**overrides) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(MoEConfig(**{**vars(MOE_PRESETS["tiny"]), **overrides}))


# -- ep in the layout ------------------------------------------------------------------------------------------------
def test_ep_groups_are_consecutive_data_parallel_ranks():
    dims = ParallelDims.resolve(8, dp=4, tp=2, ep=2)
    assert dims.expert_dp == 2
    assert dims.expert_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # dp neighbours, one tp coordinate
    assert dims.expert_groups("expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "experts over ep=2" in dims.describe() and "expert_dp groups: [0, 4]" in dims.rank_table()
    with_cp = ParallelDims.resolve(4, dp=1, cp=4, ep=2)  # carved from dp x cp
    assert with_cp.expert_groups("ep") == [[0, 1], [2, 3]] and with_cp.expert_groups("expert_dp") == [[0, 2], [1, 3]]
    plain = ParallelDims.resolve(8, tp=2)
    assert plain.ep == 1 and "ep" not in plain.describe() and "ep groups" not in plain.rank_table()


@pytest.mark.parametrize("world,kwargs,match", [
    (6, dict(ep=4), r"ep=4 does not divide dp=6: .*Choose an ep that divides 6"),
    (8, dict(cp=2, ep=3), r"ep=3 does not divide dp=4 x cp=2 = 8"),
])
def test_an_ep_that_does_not_divide_dp_x_cp_is_refused(world, kwargs, match):
    with pytest.raises(LayoutError, match=match):
        ParallelDims.resolve(world, **kwargs)


def test_an_invalid_ep_is_refused():
    with pytest.raises(LayoutError, match="ep=0 is not a valid size"):
        Layout(ep=0)


def test_the_ep_option_and_its_names():
    assert ZeroStrategy(stage=0, ep=2).layout.ep == 2 and LayoutStrategy(ep=4).layout.ep == 4
    assert LayoutStrategy(cp=2, ep=2).layout.cp == 2  # experts over the cp ranks of a replica
    assert ZeroStrategy(stage=3, ep=2).layout.zero_stage == 3  # the other weights' ZeRO beside the experts
    for stage in (0, 1, 2, 3):  # attention over tp, experts over ep, under every ZeRO stage
        assert LayoutStrategy(tp=2, ep=2, zero_stage=stage).layout.tp == 2
    assert LayoutStrategy(tp=2, ep=2, zero_stage=1, sequence_parallel=True).layout.sequence_parallel
    assert ZeroStrategy(stage=2, ep=2, offload_optimizer=True).layout.offload_optimizer
    for schedule in SCHEDULES:  # each pipeline stage's experts over the ep ranks of its coordinate
        assert PipelineStrategy(pp=2, ep=2, schedule=schedule, zero_stage=3).layout.ep == 2
    assert Hybrid3DStrategy(tp=2, pp=2, ep=2).layout.ep == 2  # (ZeRO-1 by default)
    assert Layout(ep=2).shards_parameters  # a model built in configure_model materialises only its experts
    assert not Layout().shards_parameters
    strategy = Trainer(accelerator="cpu", devices=2, strategy="zero0_ep2", logger=False).strategy
    assert isinstance(strategy, ZeroStrategy) and strategy.layout.ep == 2 and strategy.dims.expert_dp == 1
    with pytest.raises(LayoutError, match="ep=4 does not divide dp=2"):
        Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(ep=4), logger=False)


# -- expert parallel's refusals, before any collective -----------------------------------------------------------------
def test_a_model_without_experts_is_refused():
    torch.manual_seed(0)
    with pytest.raises(LayoutError, match=r"ep=2 but GPT has no expert layers.*MoEFeedForward.*ep=1"):
        check_expert_parallel(GPT(GPT_PRESETS["tiny"]), 2)


def test_experts_that_ep_does_not_divide_are_refused_naming_the_layer():
    with pytest.raises(LayoutError, match=r"layers\.0\.mlp has 4 experts, which ep=3 does not divide.*\[1, 2, 4\]"):
        check_expert_parallel(moe(), 3)
    assert list(check_expert_parallel(moe(), 4)) == ["layers.0.mlp", "layers.1.mlp"]


def test_a_declared_parameter_not_stacked_over_the_experts_is_refused():
    model = moe()
    for layer in expert_layers(model).values():
        layer.expert_parameters = ("w_gate", "router")
    with pytest.raises(LayoutError, match=r"layers\.0\.mlp\.router is declared in expert_parameters but is not"):
        check_expert_parallel(model, 2)


class NoCollectives:
    """A mesh of 2 ranks whose process group must never be asked for."""

    def __getitem__(self, name):
        return self

    def size(self) -> int:
        return 2

    def get_group(self):
        raise AssertionError("a collective was reached before the refusal")


def test_parallelize_refuses_a_dense_model_before_any_collective():
    torch.manual_seed(0)
    mesh = NoCollectives()
    parts = split(GPT(GPT_PRESETS["tiny"]), need_blocks=False)
    config = ParallelizeConfig(device=torch.device("cpu"), dp_mesh=mesh, tp_mesh=mesh, expert_mesh=mesh)
    with pytest.raises(LayoutError, match="has no expert layers"):
        parallelize(parts, config, shard=lambda p: p.stages)


def test_an_expert_parallel_layout_saves_sharded_checkpoints():
    """Each ep rank holds other experts: its checkpoints are DCP directories every rank writes, never one file."""
    assert Layout(ep=2).sharded_checkpoint and not Layout().sharded_checkpoint
    assert LayoutCheckpoints(SimpleNamespace(layout=Layout(ep=2))).sharded


def test_arrived_tokens_are_regrouped_by_expert_then_source():
    # 2 sources x 2 local experts: source 0 sent 2 rows for expert 0 and 1 for expert 1; source 1: 0 and 3
    order = _regroup([[2, 1], [0, 3]], torch.device("cpu"))
    assert order.tolist() == [0, 1, 2, 3, 4, 5]  # [s0e0 s0e0 | s1e0 (none)] then [s0e1 | s1e1 x3]
    order = _regroup([[1, 2], [3, 1]], torch.device("cpu"))
    # arrived: s0e0 [0], s0e1 [1, 2], s1e0 [3, 4, 5], s1e1 [6]; by expert: e0 (s0, s1), e1 (s0, s1)
    assert order.tolist() == [0, 3, 4, 5, 1, 2, 6]


# -- inside a pipeline -----------------------------------------------------------------------------------------------
def test_a_pipeline_ranks_part_may_hold_no_expert_layer_but_the_model_must():
    model = moe()
    assert check_expert_parallel(model.layers["0"], 2, part=True)  # a stage with one of the MoE blocks
    assert check_expert_parallel(model.embed, 2, part=True) == {}  # a stage without any: nothing to split there
    with pytest.raises(LayoutError, match="has no expert layers"):
        check_expert_parallel(model.embed, 2)


class Buckets:
    """A deferring owner's buckets, recording what it was given to all-reduce instead of reducing."""

    def __init__(self) -> None:
        self.launched: list[torch.Tensor] = []

    def launch(self, grads) -> None:
        self.launched += grads

    def finish(self) -> None:
        pass


def test_the_deferring_zero0_owner_of_a_pipeline_leaves_the_experts_out():
    model = moe()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    experts = [p for layer in expert_layers(model).values() for n, p in layer.named_parameters(recurse=False)
               if n in layer.expert_parameters]
    sync = DDPSync(NoCollectives(), 25.0, deferred=True)
    sync.experts = SimpleNamespace(parameters=experts)
    sync.module, sync.reducer = model, Buckets()
    sync.start_grad_sync(list(model.layers["0"].parameters()))  # a stage's last backward: its buckets
    sync.finish_grad_sync()  # the rest
    launched = {id(g) for g in sync.reducer.launched}
    assert len(launched) == len(sync.reducer.launched) == len(list(model.parameters())) - len(experts) == 17
    assert not launched & {id(p.grad) for p in experts}  # averaged over their own replicas in finalize instead


def test_a_load_balancing_loss_under_a_pipeline_is_refused_only_for_layers_that_cannot_start_its_backward():
    check_layer_losses(moe(aux_loss_coef=0.01), 2)  # the example's layer takes an aux_loss_backward
    check_layer_losses(moe(), 2)
    # a layer that keeps its loss for the step to add and has no aux_loss_backward: the example's, without the hook
    own_loss = type("OwnLoss", (nn.Module,), {k: v for k, v in vars(MoEFeedForward).items()
                                             if k not in ("aux_loss_backward", "__dict__", "__weakref__")})
    model = moe(aux_loss_coef=0.01)
    for block in model.layers.values():
        block.mlp.__class__ = own_loss
    with pytest.raises(LayoutError, match=r"pp=2.*layers.0.mlp, layers.1.mlp of MoEGPT compute a load-balancing "
                                          r"loss.*aux_loss_backward = None.*aux_loss_coef=0"):
        check_layer_losses(model, 2)


# -- a user's own MoE: experts in an nn.ModuleList, top_k over the experts ------------------------------------------
class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)


class _ListMoE(nn.Module):
    """The natural layout: a router and an nn.ModuleList of MLPs."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.router = 2, nn.Linear(8, 4)
        self.experts = nn.ModuleList([_MLP() for _ in range(4)])


class _StackedMoE(nn.Module):
    """The interface expert parallel splits (the README's class MoE, without its forward)."""

    expert_parameters = ("w_in", "w_out")
    token_exchange = None

    def __init__(self, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.w_in = nn.Parameter(torch.zeros(num_experts, 8, 16))
        self.w_out = nn.Parameter(torch.zeros(num_experts, 16, 8))

    def experts(self, tokens, counts):
        return tokens


def _model(layer: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.LayerNorm(8), layer))


def test_experts_in_a_module_list_are_refused_naming_the_module_and_the_stacked_shapes():
    with pytest.raises(LayoutError) as refused:
        check_expert_parallel(_model(_ListMoE()), 2)
    said = str(refused.value)
    assert "\n" not in said
    assert said.startswith("ep=2 but 1.1.experts (_ListMoE) keeps its 4 experts as an nn.ModuleList of _MLP")
    assert "fc1_weight [4, 16, 8], fc1_bias [4, 16], fc2_weight [4, 8, 16], fc2_bias [4, 8]" in said
    assert "expert_parameters" in said and "lightning_par/examples/moe.py" in said and "ep=1" in said


def test_a_partly_declared_expert_layer_is_refused_naming_what_it_lacks():
    layer = _StackedMoE()
    del layer.num_experts
    with pytest.raises(LayoutError, match=r"ep=2 but 1\.1 \(_StackedMoE\) declares part of the expert layer "
                                          r"interface, without num_experts: "):
        check_expert_parallel(_model(layer), 2)


@pytest.mark.parametrize("ep", [None, 2])
def test_top_k_over_the_experts_is_refused_at_setup_in_one_line(ep):
    torch.manual_seed(0)
    mesh = NoCollectives()
    parts = split(_model(_StackedMoE(num_experts=4, top_k=5)), need_blocks=False)
    config = ParallelizeConfig(device=torch.device("cpu"), dp_mesh=mesh, tp_mesh=mesh,
                               expert_mesh=mesh if ep else None)
    with pytest.raises(LayoutError) as refused:
        parallelize(parts, config, shard=lambda p: p.stages)
    assert str(refused.value) == ("1.1 (_StackedMoE): top_k=5 is larger than its 4 experts (each token is routed to "
                                  "top_k different experts). Use top_k <= 4.")


def test_top_k_over_a_hugging_face_configs_experts_is_refused():
    model = _model(nn.Linear(8, 8))
    model.config = SimpleNamespace(num_experts_per_tok=4, num_local_experts=2)
    with pytest.raises(LayoutError, match=r"^Sequential \(Sequential\)\.config: top_k=4 is larger than its 2 "):
        check_expert_parallel(model, 2, part=True)
    model.config.num_experts_per_tok = 2
    check_expert_parallel(model, 2, part=True)
