"""ZeRO-3 (FSDP2) and tensor parallel inside pipeline stages.

One 4-rank launch of ``tests/launch/pipeline_zero.py`` (several cases, each 20 fp32 steps against one process): pp=2 x
dp=2 with FSDP2 stage modules under 1F1B, interleaved 1F1B and ZBV -- per-step loss parity, and the all-gathers and
reduce-scatters of every step counted against the formula of :mod:`lightning_par.parallel.pipeline.fsdp` -- plus
tied embeddings, gradient accumulation, AdamW, and pp=2 x tp=2 (with and without sequence parallelism). The rest
runs in this process: the ``prepare`` hook, stage modules' own hooks, the refusal of a parameter shared by two
stages of one rank.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_par import LayoutError
from tests.harness import launch_matrix, max_rel_diff

PARITY_RTOL = 1e-5
ZERO3 = ("zero3_1f1b", "zero3_interleaved_1f1b", "zero3_zbv", "zero3_1f1b_adamw", "zero3_1f1b_tied",
         "zero3_1f1b_accumulate")
RESHARD = ("zero3_1f1b_reshard", "zero3_zbv_reshard")  # 4 steps each
TP = ("tp2_1f1b", "tp2_interleaved_1f1b", "tp2_zbv", "tp2_sp_1f1b")


@pytest.fixture(scope="module")
def results(tmp_path_factory, cache_dir) -> dict:
    root = tmp_path_factory.mktemp("pipeline_zero")
    run = launch_matrix(root, cache_dir, "tests.launch.pipeline_zero", ["--out", str(root / "out.json")], nproc=4,
                        timeout=400).check()
    print(f"tests/launch/pipeline_zero.py on 4 ranks: {run.seconds:.0f} s")
    return json.loads((root / "out.json").read_text())


def expected_groups(units_by_stage: list[list[str]]) -> int:
    """G from the split alone: one FSDP group per block ('layers.N'), plus one per stage holding anything else."""
    return sum(sum(u.startswith("layers.") for u in units) + any(not u.startswith("layers.") for u in units)
               for units in units_by_stage)


def _check_parity(entry: dict, name: str) -> None:
    reference = entry["reference"]
    for rank in entry["ranks"]:
        diff = max_rel_diff(rank["losses"], reference["losses"])
        eval_diff = abs(rank["eval_loss"] - reference["eval_loss"]) / reference["eval_loss"]
        if rank["rank"] == 0:
            print(f"{name}: max relative per-step loss difference {diff:.2e} over {len(rank['losses'])} steps, "
                  f"evaluation {eval_diff:.2e}")
        assert diff <= PARITY_RTOL and eval_diff <= PARITY_RTOL
        assert rank["logits_shape"] == [2, 7, 256], "forward-only with another shape, through the rank module"
    losses = reference["losses"]
    assert len(losses) < 20 or losses[-1] < losses[0] - 0.5  # it trains


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", ZERO3 + RESHARD)
def test_zero3_pipeline_matches_one_process(results, name):
    _check_parity(results[name], name)


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", ZERO3 + RESHARD)
def test_zero3_pipeline_collectives_per_step(results, name):
    """Per optimizer step and rank: one reduce-scatter per FSDP group, whatever the number of micro-batches (4
    here); one all-gather per group with reshard_after_forward=False; evaluation gathers each group once. Asked to
    reshard after forward, 1F1B gathers each block again micro-batch by micro-batch; zbv keeps the gathered weights
    anyway (its weight-gradient half needs them), so it counts as without."""
    entry = results[name]
    for rank in entry["ranks"]:
        groups = expected_groups(rank["units"])
        assert rank["fsdp_groups"] == groups
        steady = rank["counts"][1:]  # the first step also infers the stages' shapes (a real forward and backward)
        if rank["rank"] == 0:
            print(f"{name}: rank 0 holds stages {rank['stage_ids']} = {rank['units']}: G = {groups}; step 1 "
                  f"{rank['counts'][0]}, every later step {steady[0]}; evaluation {rank['eval_counts']}")
        for counts in steady:
            assert counts["reduce_scatter"] == groups
            if name == "zero3_1f1b_reshard":
                # torch's default: blocks freed after each micro-batch's forward, gathered again for its backward
                assert counts["all_gather"] > 2 * groups
            else:
                assert counts["all_gather"] == groups
            # the loss, per batch: summed over the pipeline ranks (every stage's load-balancing terms join the last
            # stage's loss); and the tied gradient, summed once
            batches = 2 if "accumulate" in name else 1
            assert counts["all_reduce"] == batches + (1 if "tied" in name else 0)
            assert counts["broadcast"] == 0
        assert rank["eval_counts"]["reduce_scatter"] == 0
        if name != "zero3_1f1b_reshard":
            assert rank["eval_counts"]["all_gather"] == groups


@pytest.mark.launch(ranks=4, full=True)
def test_zero3_refuses_a_parameter_shared_by_two_stages_of_one_rank(results):
    for rank in results["zero3_zbv_tied"]["ranks"]:
        assert "one parameter is held by two stages of this pipeline rank" in rank["error"]


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", TP)
def test_tensor_parallel_stages_match_one_process(results, name):
    """tp=2 inside each of 2 pipeline stages; ZBV splits backward into input and weight gradients of DTensors."""
    _check_parity(results[name], name)


@pytest.mark.launch(ranks=4, full=True)
def test_sequence_parallel_stages_send_sequence_shards(results):
    """With sequence parallelism a stage's output is this tp rank's half of the sequence, sent to the next stage's
    rank of the same tp coordinate: batch 8 / 2 micro-batches, sequence 32 / tp 2, width 64."""
    for name, seq in (("tp2_1f1b", 32), ("tp2_sp_1f1b", 16)):
        for rank in results[name]["ranks"]:
            if rank["stage_ids"] == [0]:
                assert rank["sent_shapes"]["0"] == [4, seq, 64]


# -- in this process ----------------------------------------------------------------------------------------------
@pytest.fixture
def meshes(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))


def _gpt(n_layers: int = 2, tied: bool = False):
    from lightning_par.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("tiny", n_layers=n_layers, tie_embeddings=tied))


class _Counting(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.full
def test_the_runtime_runs_the_parts_stage_modules_as_transformed(meshes):
    """Split first, transform, then the runtime: torch's stages run the parts' stage modules as they are then (here
    replaced by wrappers), over the rank module the split made."""
    from lightning_par.examples.gpt import causal_lm_loss
    from lightning_par.parallel.parts import split
    from lightning_par.parallel.pipeline.runtime import PipelineRuntime, resolve_schedule

    model = _gpt()
    parts = split(model, resolve_schedule("1f1b", 1, 2), meshes["pp"])
    assert len(parts.stages) == 1 and [len(b) for b in parts.stage_blocks] == [2]
    parts.stages = [_Counting(m) for m in parts.stages]
    runtime = PipelineRuntime(parts, meshes["pp"], causal_lm_loss, 0.5, torch.device("cpu"))
    assert runtime.module is parts.pipeline.module and runtime.stage_modules == parts.stages
    assert runtime.stages[0].submod is runtime.stage_modules[0]
    x = torch.randint(0, 256, (4, 16))
    loss = runtime.train_step(x, x)
    assert runtime.stage_modules[0].calls > 0
    assert loss.item() == pytest.approx(causal_lm_loss(model(x), x).item(), rel=1e-6)


@pytest.mark.full
def test_fsdp_stage_gradients_wait_while_accumulating(meshes):
    """require_sync=False: the schedule's reduce-scatter is skipped and the stage stays gathered, its gradients
    accumulating unreduced; the next batch with require_sync=True reduces both batches' at once. (One rank: FSDP2
    issues no collective over a group of one, so the launched test counts them.)"""
    from torch.distributed.tensor import DTensor

    from lightning_par.examples.gpt import causal_lm_loss
    from lightning_par.parallel.parts import split
    from lightning_par.parallel.pipeline.fsdp import fsdp_group_count
    from lightning_par.parallel.pipeline.runtime import PipelineRuntime, resolve_schedule
    from lightning_par.parallel.zero import fully_shard_parts

    model, reference = _gpt(), _gpt()
    blocks = [f"layers.{i}" for i in range(2)]
    parts = split(model, resolve_schedule("1f1b", 1, 2), meshes["pp"])
    fully_shard_parts(parts, meshes["dp"])
    runtime = PipelineRuntime(parts, meshes["pp"], causal_lm_loss, 0.25, torch.device("cpu"))
    assert fsdp_group_count(runtime.stage_modules, blocks) == 3  # two blocks, and embedding + norm + head
    x = torch.randint(0, 256, (8, 16))
    runtime.train_step(x[:4], x[:4])  # the first step infers shapes
    for p in runtime.module.parameters():
        p.grad = None
    block = runtime.module.layers["0"].mlp.up_proj
    gathered = []
    for i, half in enumerate((slice(0, 4), slice(4, 8))):
        runtime.require_sync = i == 1
        runtime.train_step(x[half], x[half])
        gathered.append(not isinstance(block.weight, DTensor))  # FSDP2 registers the gathered tensor meanwhile
    assert gathered == [True, False]
    causal_lm_loss(reference(x), x).backward()
    expected = dict(reference.named_parameters())
    for name, param in runtime.module.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), expected[name].grad, rtol=1e-5, atol=1e-7)


@pytest.mark.full
def test_a_stage_module_has_its_own_hooks():
    """FSDP2 registers its hooks on each stage module: they must not run when the rank module or another stage
    of the rank is called (and hooks registered on the rank module later stay there)."""
    from lightning_par.parallel.pipeline.split import rank_module, stage_view

    model = _gpt(n_layers=4)
    units = model.pipeline_units()
    by_stage = [units[:3], units[3:]]
    whole = rank_module(model, by_stage, [0, 1])
    calls = []
    whole.register_forward_pre_hook(lambda m, a: calls.append("before split"))
    first, second = (stage_view(whole, keep, units=units) for keep in by_stage)
    first.register_forward_pre_hook(lambda m, a: calls.append("first"))
    whole.register_forward_pre_hook(lambda m, a: calls.append("rank module"))
    x = torch.randint(0, 256, (1, 4))
    second(first(x))
    assert calls == ["before split", "first", "before split"]
    calls.clear()
    whole(x)
    assert calls == ["before split", "rank module"]


@pytest.mark.full
def test_a_parameter_in_two_stages_of_one_rank_cannot_be_sharded():
    from lightning_par.parallel.pipeline.fsdp import check_disjoint, fsdp_group_count
    from lightning_par.parallel.pipeline.split import rank_module, stage_view

    for tied in (False, True):
        model = _gpt(n_layers=4, tied=tied)
        units = model.pipeline_units()
        by_stage = [units[:3], units[3:4], units[4:]]
        whole = rank_module(model, by_stage, [0, 2])  # the two ends of a V on one rank
        views = [stage_view(whole, by_stage[i], units=units) for i in (0, 2)]
        blocks = [u for u in units if u.startswith("layers.")]
        assert fsdp_group_count(views, blocks) == 5  # embed + 2 blocks | 1 block + norm + head
        if tied:
            with pytest.raises(LayoutError, match=r"held by two stages of this pipeline rank \(as 'embed.weight' "
                                                  r"and 'head.weight'\)"):
                check_disjoint(views)
        else:
            check_disjoint(views)
