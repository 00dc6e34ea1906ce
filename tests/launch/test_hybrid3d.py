"""Hybrid3DStrategy: data x tensor x pipeline parallel inside Lightning, at parity with one process.

Two launches of tests/launch/hybrid3d_matrix.py: tp2 x pp2 on 4 ranks and dp2 x tp2 x pp2 on 8 (one epoch), each
training several layouts (ZeRO 1/2/3 across data parallel; 1F1B, interleaved and ZBV; sequence parallel on and off;
selective and full recompute; tied embeddings; SGD and AdamW; accumulation with clipping; a Hugging Face Llama) against
the single-process runs of tests/conftest.py. Plus the bad-input checks, made before any rank waits.
"""

import json
import re

import pytest
from lightning.pytorch import Trainer

from lightning_par import Hybrid3DStrategy, LayoutError
from lightning_par.examples.gpt import GPT, GPTConfig
from lightning_par.parallel.tensor_parallel import check_tp_plan
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS, job
from tests.harness import Run, launch_cli, max_rel_diff
from tests.launch.hybrid3d_matrix import CASES

LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4
#: the one owner of data-parallel gradients for each case (see lightning_par/parallel/gradient_sync.py)
OWNERS = {"zero1": "zero1", "zero2": "zero2", "zero3": "fsdp2_shard_stages"}


@pytest.fixture
def matrix(hybrid3d_matrix):
    return hybrid3d_matrix


def cases(names) -> list:
    """Each case marked for its launch: its rank count; the 8-rank launch and the cases marked ``full``: --full."""
    return [pytest.param(n, marks=pytest.mark.launch(ranks=c.devices, full=c.full or c.devices == 8))
            for n, c in ((n, CASES[n]) for n in names)]


def _norms(run: Run) -> list[float]:
    return json.loads((run.root / "reports" / "norms_rank0.json").read_text())


@pytest.mark.parametrize("name", cases(CASES))
def test_losses_and_gradient_norms_match_one_process(matrix, runs, name):
    run, _ = matrix(name)
    reference, steps = runs(CASES[name].reference), CASES[name].steps  # (8 ranks: the references' first epoch)
    diff = max_rel_diff(run.losses(), reference.losses(steps=steps))
    norm_diff = max_rel_diff(_norms(run), _norms(reference))
    print(f"{name}: per-step loss {diff:.2e} over {steps} steps, pre-clip gradient norm {norm_diff:.2e} (max "
          f"relative difference)")
    assert len(run.losses()) == steps and diff <= LOSS_RTOL
    assert len(_norms(run)) == 5 and norm_diff <= NORM_RTOL
    assert reference.losses()[0] - reference.losses(steps=steps)[-1] > 0.3  # the loss moves: a wrong gradient shows
    # validation runs forward-only through the tensor-parallel stages (loss from the last stage, vocab-parallel)
    val, val_reference = run.scalars()["val/loss"], reference.scalars()["val/loss"]
    assert val and val.keys() == {step for step in val_reference if step < steps}
    assert max_rel_diff(run.losses("val/loss"), reference.losses("val/loss", steps)) <= LOSS_RTOL


@pytest.mark.parametrize("name", cases(CASES))
def test_each_rank_holds_its_stages_under_one_gradient_owner(matrix, name):
    _, reports = matrix(name)
    stage = CASES[name].strategy.get("zero_stage", 1)
    assert {r["gradient_sync"] for r in reports} == {OWNERS[f"zero{stage}"]}
    by_pp: dict[int, set] = {}
    for report in reports:
        by_pp.setdefault(report["coordinates"]["pp"], set()).add(tuple(report["units"]))
    # the tp and dp ranks of one pipeline rank hold the same units; the pipeline ranks hold different ones
    assert all(len(units) == 1 for units in by_pp.values()) and len(by_pp) == 2
    first, second = (set(next(iter(by_pp[p]))) for p in (0, 1))
    assert not first & second - {"embed", "head"}  # only a V schedule's rank 0 holds both ends


@pytest.mark.parametrize("name", cases(n for n, c in CASES.items() if c.devices == 8 and "cp" not in c.strategy))
def test_zero_with_pipelines_reduces_once_per_optimizer_step(matrix, name):
    # (context parallel reduce-scatters key/value gradients in every attention's backward besides: not counted here)
    """ZeRO-1/2: one reduce-scatter per bucket and one all-gather per bucket per optimizer step, whatever the number
    of micro-batches (2) and accumulated batches (2 in the zero2 case); ZeRO-3: one reduce-scatter and one all-gather
    per FSDP group (a block, or a stage's root)."""
    run, reports = matrix(name)
    for rank, report in enumerate(reports):
        state = json.loads((run.root / "state" / f"state_rank{rank}.json").read_text())
        calls = state["calls"]
        groups = report["fsdp_groups"] if report["gradient_sync"] == "fsdp2_shard_stages" else report["buckets"]
        if rank == 0:
            print(f"{name}: rank 0 reduce-scatters {calls.get('reduce_scatter')} times and all-gathers "
                  f"{calls.get('all_gather')} times per step, for {groups} groups; all calls: {calls}")
        assert groups and calls["reduce_scatter"] == groups and calls["all_gather"] == groups


@pytest.mark.parametrize("name", cases(n for n, c in CASES.items() if c.model.get("tie_embeddings")
                                        and c.strategy["schedule"] != "zbv"))
def test_tied_copies_on_two_pipeline_ranks_stay_bit_identical(matrix, name):
    """The embedding (pipeline rank 0) and the head (rank 1) are one tied weight, vocabulary-sharded alike: after
    training, tp rank k's shard of the embedding equals tp rank k's shard of the head, bit for bit."""
    _, reports = matrix(name)
    embed = {r["coordinates"]["tp"]: r["weights_after_fit"]["model.embed.weight"]
             for r in reports if r["coordinates"]["pp"] == 0}
    head = {r["coordinates"]["tp"]: r["weights_after_fit"]["model.head.weight"]
            for r in reports if r["coordinates"]["pp"] == 1}
    assert embed == head and len(set(embed.values())) == 2  # (the two tp shards differ)


@pytest.mark.launch(ranks=4, full=True)
def test_a_3d_checkpoint_resumes_with_the_same_losses(matrix, tmp_path, cache_dir):
    """AdamW under tp2 x pp2 with ZeRO-1 (sequence parallel, interleaved): resuming from the step-10 checkpoint
    reproduces steps 10-19, so the sharded model and optimizer states (Adam's moments included) survive."""
    run, _ = matrix("tp2_pp2_sp_interleaved")
    ckpt = run.checkpoint(step=EPOCH_STEPS)
    args = ["--trainer.strategy=lightning_par.Hybrid3DStrategy", "--trainer.strategy.tp=2", "--trainer.strategy.pp=2",
            "--trainer.strategy.schedule=interleaved_1f1b", "--trainer.strategy.n_microbatches=2",
            "--trainer.strategy.sequence_parallel=true", *job(GLOBAL_BATCH), f"--ckpt_path={ckpt}"]
    resumed = launch_cli(tmp_path, cache_dir, args, devices=4).check()
    diff = max_rel_diff(resumed.losses(), run.losses()[EPOCH_STEPS:])
    print(f"resumed from {ckpt.name}: steps {EPOCH_STEPS}-{PARITY_STEPS - 1} within {diff:.2e}")
    assert diff <= LOSS_RTOL


@pytest.mark.launch(ranks=4)
def test_a_rank_holds_a_fraction_of_the_parameters(matrix):
    """tp2 x pp2: each rank materialises about a quarter of the model (plus its replicated norms and biases)."""
    _, reports = matrix("tp2_pp2_1f1b_selective_sgd")
    total = sum(r["param_bytes"] for r in reports if r["coordinates"]["tp"] == 0) * 2  # tp shards, roughly
    for report in reports:
        assert report["param_bytes"] < 0.35 * total, report


@pytest.mark.launch(ranks=4)
def test_rank_table_and_stages_are_logged(matrix):
    run, _ = matrix("tp2_pp2_1f1b_selective_sgd")
    assert "rank -> (pp, dp, tp)" in run.log and "     3 -> (1, 0, 1)" in run.log
    assert "stage 1 on pipeline rank 1: 6 units (layers.4 .. head)" in run.log


@pytest.mark.parametrize("kwargs,devices,match", [
    (dict(tp=2, pp=2), 6, r"does not divide the world size 6"),
    (dict(tp=2, pp=2, recompute="some"), 4, r"recompute='some'"),
    (dict(tp=2, pp=2, schedule="zbv", virtual_stages=3), 4, r"virtual"),
])
def test_bad_layouts_fail_when_the_trainer_is_made(kwargs, devices, match):
    with pytest.raises(LayoutError, match=match):
        Trainer(accelerator="cpu", devices=devices, strategy=Hybrid3DStrategy(**kwargs), logger=False)


def test_a_tied_weight_split_two_ways_is_refused_before_the_split():
    """The engine checks the whole model's plan before the pipeline split and before any collective (as the launch
    below shows for a head count): the tied embedding and head, later on two pipeline ranks, must split alike."""
    model = GPT(GPTConfig.from_preset("tiny", tie_embeddings=True))
    model.tp_plan = {**GPT.tp_plan, "head": "rowwise"}
    with pytest.raises(LayoutError, match=r"embed.weight and head.weight are one tied parameter, but the plan splits "
                                          r"them differently \(Shard\(0\) as 'vocab_parallel' vs Shard\(1\) as "
                                          r"'rowwise'\)"):
        check_tp_plan(model, 2)


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("args,match", [
    # tp=2 does not divide one key/value head: found on the whole model, before the split, on every rank
    (["--model.n_kv_heads=1"], r"key/value head count .* is 1, which tp=2 does not divide"),
    # 2 pipeline ranks x 3 virtual stages = 6 stages, but a 1-block GPT has 4 units (embed, the block, norm, head)
    (["--model.n_layers=1", "--trainer.strategy.schedule=interleaved_1f1b", "--trainer.strategy.virtual_stages=3"],
     r"6 stages.*4 pipeline units"),
], ids=["tp_does_not_divide_heads", "more_stages_than_units"])
def test_layouts_the_model_cannot_take_fail_on_every_rank_within_seconds(tmp_path, cache_dir, args, match):
    strategy = ["--trainer.strategy=lightning_par.Hybrid3DStrategy", "--trainer.strategy.tp=2",
                "--trainer.strategy.pp=2"]
    run = launch_cli(tmp_path, cache_dir, [*strategy, "--trainer.max_steps=2", *args],
                     devices=4, timeout=200)
    print(f"refused in {run.seconds:.0f} s (start-up included)")
    assert run.returncode != 0 and run.seconds < 120
    last = [line for line in run.log.splitlines() if line.strip()][-1]
    assert last.startswith("lightning-par: error: ") and re.search(match, last), run.log[-3000:]  # one line, last
