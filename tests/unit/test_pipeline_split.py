"""Pipeline stage split: balance, contiguity, names kept, stages reproduce the full model, errors, tied weights."""

import itertools
import random

import pytest
import torch
import torch.nn as nn

from lightning_par.examples import GPT, MLP, GPTConfig
from lightning_par.parallel.pipeline import (
    assign_units,
    declared_units,
    plan_stages,
    split_model,
    stage_indices,
    stage_rank,
    tied_parameter_groups,
)
from lightning_par.topology import LayoutError


def gpt(n_layers: int = 4, tie: bool = False) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
                       tie_embeddings=tie)
    return GPT(config)


def gpt_units(n_layers: int) -> list[str]:
    return ["embed", *(f"layers.{i}" for i in range(n_layers)), "norm", "head"]


def stage_cost(stages: list[list[str]], costs: list[float], units: list[str]) -> float:
    cost = dict(zip(units, costs, strict=True))
    return max(sum(cost[u] for u in stage) for stage in stages)


def brute_force_best(costs: list[float], n_stages: int) -> float:
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def check_partition(units: list[str], stages: list[list[str]], n_stages: int) -> None:
    assert len(stages) == n_stages
    assert all(stages), "every stage holds at least one unit"
    assert [u for stage in stages for u in stage] == units, "contiguous, in order, every unit once"
    assert stages[0][0] == units[0] and stages[-1][-1] == units[-1]


# -- assign_units --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n_layers", "n_stages", "expected"), [
    (4, 1, [gpt_units(4)]),
    (4, 2, [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "head"]]),
    (4, 4, [["embed", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "head"]]),
    (8, 3, [["embed", "layers.0", "layers.1", "layers.2"], ["layers.3", "layers.4", "layers.5"],
            ["layers.6", "layers.7", "norm", "head"]]),
    # fewer blocks than stages: the units themselves are balanced by count
    (2, 4, [["embed", "layers.0"], ["layers.1"], ["norm"], ["head"]]),
    (1, 4, [["embed"], ["layers.0"], ["norm"], ["head"]]),
])
def test_assign_by_count(n_layers, n_stages, expected):
    assert assign_units(gpt_units(n_layers), n_stages) == expected


def test_assign_by_count_without_extra_units():
    units = [f"layers.{i}" for i in range(5)]
    assert assign_units(units, 2) == [units[:3], units[3:]]
    assert assign_units(declared_units(MLP(8, 6)), 3) == [["layers.0", "layers.1"], ["layers.2", "layers.3"],
                                                            ["layers.4", "layers.5"]]
    # no blocks at all: plain count balance
    assert assign_units(["a", "b", "c"], 2) == [["a", "b"], ["c"]]


def test_assign_by_cost_hand_checked():
    units = list("abcdef")
    assert assign_units(units, 3, [1, 1, 1, 1, 1, 10]) == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert assign_units(units, 2, [5, 1, 1, 1, 1, 5]) == [["a", "b", "c"], ["d", "e", "f"]]
    assert assign_units(units, 2, {"a": 9, "b": 1, "c": 1, "d": 1, "e": 1, "f": 1}) == [["a"], list("bcdef")]
    # an expensive head pushes a block off the last stage, unlike the count rule
    head_heavy = dict.fromkeys(gpt_units(4), 1.0) | {"embed": 0.0, "norm": 0.0, "head": 1.5}
    assert assign_units(gpt_units(4), 2, head_heavy) == [["embed", "layers.0", "layers.1", "layers.2"],
                                                          ["layers.3", "norm", "head"]]
    # equal costs: the same split as the count rule, remainder to the earlier stages
    assert assign_units(units, 4, [1] * 6) == [["a", "b"], ["c", "d"], ["e"], ["f"]]
    assert assign_units(units, 6, [0] * 6) == [[u] for u in units]


def test_assign_by_cost_is_optimal():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.randint(0, 9) for _ in range(n)]
        units = [f"u{i}" for i in range(n)]
        stages = assign_units(units, k, costs)
        check_partition(units, stages, k)
        assert stage_cost(stages, costs, units) == brute_force_best(costs, k), (costs, k, stages)
        float_costs = [rng.random() for _ in range(n)]
        stages = assign_units(units, k, float_costs)
        assert stage_cost(stages, float_costs, units) == pytest.approx(brute_force_best(float_costs, k), abs=1e-12)


@pytest.mark.parametrize("with_costs", [False, True])
def test_assign_partitions_many_shapes(with_costs):
    rng = random.Random(1)
    shapes = [gpt_units(n) for n in range(1, 13)] + [[f"layers.{i}" for i in range(n)] for n in range(1, 13)]
    shapes += [["a", *(f"enc.{i}" for i in range(n)), "bridge", *(f"dec.{i}" for i in range(n)), "z"]
               for n in range(1, 5)]
    for units in shapes:
        for k in range(1, len(units) + 1):
            costs = [rng.random() for _ in units] if with_costs else None
            check_partition(units, assign_units(units, k, costs), k)


def test_count_rule_keeps_non_block_units_with_their_neighbour():
    units = ["a", "enc.0", "enc.1", "bridge", "dec.0", "dec.1", "z"]
    assert assign_units(units, 2) == [["a", "enc.0", "enc.1", "bridge"], ["dec.0", "dec.1", "z"]]


# -- split_model ---------------------------------------------------------------------------------------------------
def names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters()]


@pytest.mark.parametrize("pp", [1, 2, 4, 7])
def test_stages_keep_original_names_and_cover_every_parameter_once(pp):
    model = gpt(4)
    original = dict(model.named_parameters())
    plan = plan_stages(model, pp)
    stages = split_model(model, pp, list(range(pp)))
    seen = []
    for units, stage in zip(plan, stages, strict=True):
        assert stage.pipeline_units() == units
        own = [n for n in original if any(n.startswith(u + ".") for u in units)]
        assert names(stage) == own
        assert list(stage.state_dict()) == own
        for name, param in stage.named_parameters():
            assert torch.equal(param, original[name])
            assert param.data_ptr() != original[name].data_ptr(), "a copy, not the original storage"
        seen += names(stage)
    assert sorted(seen) == sorted(original), "every parameter exactly once"
    assert model.pipeline_units() == gpt_units(4), "the original model is untouched"


@pytest.mark.parametrize("pp", [2, 4])
def test_stages_in_sequence_reproduce_the_full_model(pp):
    model = gpt(4).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = model(tokens)
        h = tokens
        for index in range(pp):
            h = split_model(model, pp, index).eval()(h)
    assert torch.equal(h, expected)


@pytest.mark.parametrize(("pp", "virtual", "style"), [(2, 2, "loop"), (2, 2, "v"), (3, 2, "v"), (2, 3, "loop")])
def test_virtual_stages_in_sequence_reproduce_the_full_model(pp, virtual, style):
    model = gpt(6, tie=True).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    n_stages = pp * virtual
    plan = plan_stages(model, pp, virtual, style)
    by_index = {}
    for rank in range(pp):
        indices = stage_indices(rank, pp, virtual, style)
        modules = split_model(model, n_stages, indices, units_by_stage=plan)
        assert isinstance(modules, list) and len(modules) == len(indices)
        by_index.update(zip(indices, modules, strict=True))
    assert sorted(by_index) == list(range(n_stages))
    with torch.no_grad():
        expected = model(tokens)
        h = tokens
        for index in range(n_stages):
            assert by_index[index].pipeline_units() == plan[index]
            h = by_index[index].eval()(h)
    assert torch.equal(h, expected)


def test_split_with_costs_and_single_index_list():
    model = gpt(4)
    costs = [0, 1, 1, 1, 1, 0, 2.5]  # embed, 4 blocks, norm, head: 3 | 3.5 beats 4 | 2.5
    (stage,) = split_model(model, 2, [1], costs)
    assert stage.pipeline_units() == ["layers.3", "norm", "head"]


class Explodes(nn.Module):
    """A unit that fails when copied: proves split_model never copies units of other stages."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.weight

    def __deepcopy__(self, memo):
        raise AssertionError("a unit of another stage was copied")


class Chain(nn.Module):
    def __init__(self, blocks: nn.ModuleDict):
        super().__init__()
        self.blocks = blocks
        self.last = nn.Linear(3, 3)

    def pipeline_units(self):
        return [f"blocks.{key}" for key in self.blocks.keys()] + ["last"]

    def forward(self, x):
        for block in self.blocks.values():
            x = block(x)
        return self.last(x) if self.last is not None else x


def test_other_stages_are_not_copied():
    model = Chain(nn.ModuleDict({"0": nn.Linear(3, 3), "1": Explodes(), "2": Explodes()}))
    stage = split_model(model, 3, 0, units_by_stage=[["blocks.0"], ["blocks.1", "blocks.2"], ["last"]])
    assert names(stage) == ["blocks.0.weight", "blocks.0.bias"]
    assert stage.last is None and list(stage.blocks.keys()) == ["0"]
    stage = split_model(model, 3, 2, units_by_stage=[["blocks.0"], ["blocks.1", "blocks.2"], ["last"]])
    assert names(stage) == ["last.weight", "last.bias"]


# -- stage_indices -------------------------------------------------------------------------------------------------
def test_stage_indices_loop_and_v():
    assert [stage_indices(r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_indices(r, 4, 2, "loop") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_indices(r, 2, 3, "loop") for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [stage_indices(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_indices(r, 2, 4, "v") for r in range(2)] == [[0, 3, 4, 7], [1, 2, 5, 6]]
    for p, v, style in [(1, 1, "loop"), (3, 4, "loop"), (5, 2, "v"), (3, 6, "v")]:
        held = sorted(s for r in range(p) for s in stage_indices(r, p, v, style))
        assert held == list(range(p * v)), "every stage on exactly one rank"
        for r in range(p):
            assert all(stage_rank(s, p, v, style) == r for s in stage_indices(r, p, v, style))


# -- errors --------------------------------------------------------------------------------------------------------
def test_more_stages_than_units():
    message = (r"pp=4 x virtual_stages=2 = 8 stages but the model declares only 7 pipeline units "
               r"\(\['embed', 'layers.0', .*'head'\]\); use at most 7 stages")
    with pytest.raises(LayoutError, match=message):
        plan_stages(gpt(4), 4, 2)
    with pytest.raises(LayoutError, match=r"8 pipeline stages but only 7 pipeline units .*use at most 7 stages"):
        assign_units(gpt_units(4), 8)
    with pytest.raises(LayoutError, match="use at most 7 stages"):
        split_model(gpt(4), 8, 0)


def test_model_without_pipeline_units():
    with pytest.raises(LayoutError, match=r"Sequential declares no pipeline units.*add a `pp_plan` / "
                                          r"`pipeline_units\(\)`.*like lightning_par.examples.GPT"):
        split_model(nn.Sequential(nn.Linear(2, 2)), 1, 0)
    wrapper = nn.Module()
    wrapper.model = gpt(2)
    with pytest.raises(LayoutError, match="Its submodule `model` declares them: split that module instead"):
        plan_stages(wrapper, 2)


def test_bad_virtual_stages_and_styles():
    with pytest.raises(LayoutError, match=r"style='v' needs an even virtual_stages.*got 3.*virtual_stages=2"):
        stage_indices(0, 2, 3, "v")
    with pytest.raises(LayoutError, match="style='v' needs an even virtual_stages"):
        plan_stages(gpt(8), 2, 1, "v")
    with pytest.raises(LayoutError, match="unknown stage style 'zigzag'; use 'loop'"):
        stage_indices(0, 2, 2, "zigzag")
    with pytest.raises(LayoutError, match=r"virtual_stages=0 is not valid: use a positive integer"):
        plan_stages(gpt(4), 2, 0)
    with pytest.raises(LayoutError, match=r"pp_rank=2 is outside the 2 pipeline ranks 0..1"):
        stage_indices(2, 2, 1)
    with pytest.raises(LayoutError, match=r"stage 4 is outside the 4 stages 0..3"):
        stage_rank(4, 2, 2)


def test_bad_costs():
    units = gpt_units(2)
    with pytest.raises(LayoutError, match=r"costs has 3 entries but there are 5 pipeline units.*one cost per unit"):
        assign_units(units, 2, [1, 2, 3])
    with pytest.raises(LayoutError, match=r"costs name unknown pipeline units \['layers.9'\]"):
        assign_units(units, 2, dict.fromkeys(units, 1) | {"layers.9": 1})
    with pytest.raises(LayoutError, match=r"costs has no entry for the pipeline units \['head'\]"):
        assign_units(units, 2, {u: 1 for u in units if u != "head"})
    with pytest.raises(LayoutError, match=r"the cost of pipeline unit 'norm' is -1; costs must be finite and >= 0"):
        assign_units(units, 2, [1, 1, 1, -1, 1])
    with pytest.raises(LayoutError, match="must be finite"):
        assign_units(units, 2, [1, 1, float("nan"), 1, 1])


def test_bad_unit_names_and_plans():
    model = gpt(2)
    with pytest.raises(LayoutError, match=r"units_by_stage names unknown pipeline units \['layers.5'\]"):
        split_model(model, 2, 0, units_by_stage=[["embed", "layers.0"], ["layers.5", "norm", "head"]])
    with pytest.raises(LayoutError, match="non-empty contiguous stages in order"):
        split_model(model, 2, 0, units_by_stage=[["embed", "layers.1"], ["layers.0", "norm", "head"]])
    with pytest.raises(LayoutError, match="units_by_stage has 2 stages but n_stages=3"):
        split_model(model, 3, 0, units_by_stage=[["embed", "layers.0"], ["layers.1", "norm", "head"]])
    with pytest.raises(LayoutError, match=r"stage_index=2: every index must be one of the stages 0..1"):
        split_model(model, 2, 2)
    with pytest.raises(LayoutError, match="repeats a stage"):
        split_model(model, 2, [1, 1])

    class Declares(nn.Module):
        def __init__(self, units, blocks=None):
            super().__init__()
            self.units, self.blocks, self.head = units, blocks, nn.Linear(2, 2)

        def pipeline_units(self):
            return self.units

    with pytest.raises(LayoutError, match=r"pipeline unit 'missing' is not a submodule of Declares"):
        declared_units(Declares(["head", "missing"]))
    with pytest.raises(LayoutError, match=r"lists \['head'\] more than once"):
        declared_units(Declares(["head", "head"]))
    with pytest.raises(LayoutError, match="returned no units"):
        declared_units(Declares([]))
    with pytest.raises(LayoutError, match=r"'blocks.0' sits in an ModuleList.*nn.ModuleDict"):
        declared_units(Declares(["blocks.0", "head"], nn.ModuleList([nn.Linear(2, 2)])))
    with pytest.raises(LayoutError, match=r"pipeline unit 'blocks' contains the units \['blocks.a'\]"):
        declared_units(Declares(["blocks", "blocks.a", "head"], nn.ModuleDict({"a": nn.Linear(2, 2)})))


# -- tied parameters -----------------------------------------------------------------------------------------------
def test_tied_embeddings_are_reported_and_copied_per_stage():
    model = gpt(4, tie=True)
    assert tied_parameter_groups(model, plan_stages(model, 1)) == [], "one stage: nothing shared across stages"
    for pp in (2, 4):
        plan = plan_stages(model, pp)
        groups = tied_parameter_groups(model, plan)
        assert groups == [("embed.weight", [0, pp - 1], {0: "embed.weight", pp - 1: "head.weight"})]
        name, stages = groups[0][:2]
        assert (name, stages) == (groups[0].name, groups[0].stages)
        first, last = split_model(model, pp, [0, pp - 1])
        assert names(first)[0] == "embed.weight" and names(last)[-1] == "head.weight"
        assert torch.equal(first.embed.weight, last.head.weight)
        assert first.embed.weight is not last.head.weight, "each stage trains its own copy"
    assert tied_parameter_groups(gpt(4), plan_stages(gpt(4), 2)) == []


def test_tied_weight_stays_one_parameter_within_a_stage():
    model = gpt(2, tie=True)
    (stage,) = split_model(model, 1, [0])
    assert stage.head.weight is stage.embed.weight
    assert stage.embed.weight is not model.embed.weight
    assert names(stage) == names(model), "deduplicated as in the original"


def test_parameter_outside_every_unit_is_held_by_every_stage():
    model = MLP(4, 3)
    model.scale = nn.Parameter(torch.ones(1))
    groups = tied_parameter_groups(model, plan_stages(model, 3))
    assert groups == [("scale", [0, 1, 2], {0: "scale", 1: "scale", 2: "scale"})]


def test_a_removed_unit_answers_reads_of_its_parameters_on_the_meta_device():
    """A forward that reads a removed unit's parameter without calling it (Hugging Face HY-V4's
    ``hidden.to(self.lm_head.weight.dtype)`` on a stage without the head) gets the meta copy: dtype and shape right,
    and a computation with it fails on the meta device."""
    from lightning_par.parallel.pipeline.split import RemovedUnit, meta_copy

    head = nn.Linear(4, 8).to(torch.bfloat16)
    removed = RemovedUnit("lm_head", "pass", meta_copy(head))
    assert removed.weight.dtype == torch.bfloat16 and removed.weight.shape == (8, 4) and removed.weight.is_meta
    assert not list(removed.parameters())
    with pytest.raises(AttributeError):
        removed.not_an_attribute  # noqa: B018
