"""Bad steps (issue 30): a non-finite step is caught on every rank at once, stops the run naming it (or is skipped
with ``nonfinite="skip"``), and never costs the last finite checkpoint; ``export`` refuses non-finite weights;
``detect_anomaly`` works under a pipeline.

One launch of ``tests/launch/bad_steps_worker.py`` per layout (2 ranks, plain SGD, 12 steps, the default checkpointing:
keep the newest, every 3 steps): ZeRO-2 in the default run (about 45 s), a 2-stage pipeline (1F1B) with ``--full``
(about 55 s, its clean fit under ``detect_anomaly=True``) and ZeRO-2 with ep2 on the example mixture-of-experts GPT
with ``--full``."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from lightning_par.cli import main as cli_main
from lightning_par.examples import GPTLightningModule
from lightning_par.plugins.checkpoint_export import CheckpointTensors
from tests.harness import Run, launch_matrix, max_rel_diff
from tests.launch.bad_steps_worker import BETWEEN_STEP, POISON_STEP, SAVE_EVERY, SKIP_STEP, STEPS

LAYOUTS = {"zero2": False, "pp2": True, "zero2_ep2": True}  # layout -> full run only
#: one 2-rank launch per layout
LAYOUT_CASES = [pytest.param(layout, marks=pytest.mark.launch(ranks=2, full=full)) for layout, full in LAYOUTS.items()]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, cache_dir):
    done: dict[str, Run] = {}

    def get(layout: str) -> Run:
        if layout not in done:
            root = tmp_path_factory.mktemp(f"bad_steps_{layout}")
            done[layout] = launch_matrix(root, cache_dir, "tests.launch.bad_steps_worker",
                                         ["--root", str(root), "--layout", layout], nproc=2, timeout=420).check()
            print(f"bad steps under {layout}: 6 fits in one launch, {done[layout].seconds:.0f} s")
        return done[layout]

    return get


def _case(run: Run, name: str) -> tuple[Run, dict]:
    return Run(run.root / name, 0, run.log, run.seconds), json.loads((run.root / name / "result.json").read_text())


def _losses(run: Run) -> dict[int, float]:
    return run.scalars()["train/loss"]


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_a_poisoned_weight_stops_every_rank_at_that_step_and_the_last_finite_checkpoint_resumes(launched, layout):
    """A NaN written into a weight at step 8: the step's loss and update are not finite. Every rank stops after that
    step (the fit raises on both, the launch exits 0 because the worker catches it), naming step 8, what was not
    finite and the last finite checkpoint; the step-9 save is refused (its weights are NaN) and the keep-the-newest
    checkpointing did not remove step 6, which holds finite weights and resumes to the clean run's losses exactly."""
    run = launched(layout)
    clean, _ = _case(run, "clean")
    stopped, result = _case(run, "nan_stop")
    saved = POISON_STEP // SAVE_EVERY * SAVE_EVERY  # 6: the last save before the poisoned step
    last = run.root / "nan_stop" / "ckpt" / f"epoch=0-step={saved}.ckpt"
    assert result["code"] == 1 and result["step"] == POISON_STEP + 1 and not result["finite_weights"], result
    assert re.fullmatch(
        rf"lightning-par: step {POISON_STEP} was not finite \(the loss on rank \d and the gradient norm\): every rank "
        rf"stopped after it \(nonfinite='stop', nonfinite_patience=1\); the last finite checkpoint is "
        rf"{re.escape(str(last))}\. "
        r"Find the cause .*nonfinite=skip discards such steps instead", result["stopped"]), result["stopped"]
    assert run.log.count(f"lightning-par: step {POISON_STEP} was not finite") == 1  # printed once, by rank 0
    assert re.search(rf"lightning-par: warning: refused to save epoch=0-step={POISON_STEP + 1}\.ckpt after step "
                     rf"{POISON_STEP}: its weights are not finite \(\S+ on rank \d\); the last finite checkpoint: "
                     rf"{re.escape(str(last))}",
                     run.log), run.log[-3000:]
    assert sorted(p.name for p in last.parent.iterdir()) == [last.name]  # the only one, and it was not replaced
    tensors = CheckpointTensors(last)
    assert all(bool(torch.isfinite(t).all()) for name in tensors.entries for t in [tensors.read([name])[name]]
               if t.is_floating_point())
    before = _losses(stopped)
    assert sorted(before) == list(range(POISON_STEP)) and all(math.isfinite(v) for v in before.values())
    resumed, result = _case(run, "resume")
    assert result["resumed_from"] == str(last) and result["finite_weights"]
    after, reference = _losses(resumed), _losses(clean)
    assert sorted(after) == list(range(saved, STEPS)), sorted(after)
    diff = max_rel_diff([after[s] for s in sorted(after)], [reference[s] for s in sorted(after)])
    print(f"{layout}: stopped at step {POISON_STEP}; resumed from step {saved}: within {diff:.1e} of the clean run")
    assert diff <= 1e-6


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_a_weight_poisoned_between_steps_stops_the_run_at_the_save(launched, layout):
    """No step was non-finite, but a weight became NaN after step 5's update (outside any step): the step-6 save
    finds it, refuses to save, and every rank stops there naming the tensor; the step-3 checkpoint stays."""
    run = launched(layout)
    _, result = _case(run, "between")
    last = run.root / "between" / "ckpt" / f"epoch=0-step={BETWEEN_STEP - SAVE_EVERY}.ckpt"
    assert result["code"] == 1 and result["step"] == BETWEEN_STEP, result
    assert re.fullmatch(
        rf"lightning-par: the weights are not finite after step {BETWEEN_STEP - 1} \(\S+ on rank \d\), though no "
        rf"step's loss or gradient norm was: every rank stopped; refused to save epoch=0-step={BETWEEN_STEP}\.ckpt; "
        rf"the last finite checkpoint: {re.escape(str(last))}", result["stopped"]), result["stopped"]
    assert sorted(p.name for p in last.parent.iterdir()) == [last.name]


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_skip_discards_a_non_finite_step_on_every_rank(launched, layout):
    """``nonfinite="skip"``, 2 micro-batches per step, the activations of step 4's first micro-batch made NaN (its
    loss and the step's gradients): the step's gradients are discarded on every rank, ``train/skipped_steps`` is
    logged, and every other step's loss equals a run (the same accumulation) whose step 4 made no update (learning
    rate 0 there) -- which differs from the clean run, so the check can fail."""
    run = launched(layout)
    skipped, result = _case(run, "skip")
    assert result["stopped"] is None and result["finite_weights"], result
    losses, reference, clean = _losses(skipped), _losses(_case(run, "lr0")[0]), _losses(_case(run, "clean")[0])
    assert sorted(losses) == sorted(reference) == list(range(STEPS))
    others = [s for s in range(STEPS) if s != SKIP_STEP]
    diff = max_rel_diff([losses[s] for s in others], [reference[s] for s in others])
    moved = max_rel_diff([clean[s] for s in others], [reference[s] for s in others])
    print(f"{layout}: step {SKIP_STEP} skipped: the other steps within {diff:.1e} of a run without that update "
          f"(the clean run differs by {moved:.1e})")
    assert diff <= 1e-6 and moved > 1e-5
    assert skipped.scalars()["train/skipped_steps"] == {SKIP_STEP: 1.0}
    assert f"lightning-par: step {SKIP_STEP}: non-finite loss or gradient norm; the step's gradients were discarded " \
           "on every rank (1 skipped so far)" in run.log


@pytest.mark.launch(ranks=2, full=True)
def test_detect_anomaly_under_a_pipeline_runs_clean(launched):
    """The pipeline's clean fit ran under ``detect_anomaly=True`` with the first step's metadata-inference inputs
    (uninitialised memory) filled with NaN: anomaly mode no longer sees them, and the losses are finite (``--full``:
    it is the pp2 launch's)."""
    run = launched("pp2")
    clean, result = _case(run, "clean")
    assert "returned nan values" not in run.log
    assert result["stopped"] is None and result["finite_weights"]
    assert len(_losses(clean)) == STEPS and all(math.isfinite(v) for v in _losses(clean).values())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a DCP checkpoint saved by one process
def test_export_refuses_non_finite_weights_naming_the_tensor(tmp_path, capsys):
    """In one process: a checkpoint holding a NaN in one weight is refused by ``export`` with one line naming that
    tensor, and no file (nor a ``.partial``) is left."""
    from tests.launch.test_export import _built, _save_dcp

    lm = _built(GPTLightningModule, 0, preset="tiny", n_layers=2)
    name = next(n for n, p in lm.model.named_parameters() if n.startswith("layers.1.") and p.dim() == 2)
    with torch.no_grad():
        lm.model.get_parameter(name).view(-1)[3] = math.nan
    ckpt = tmp_path / "step=3.ckpt"
    _save_dcp(lm, ckpt)
    out = tmp_path / "w.safetensors"
    try:
        code = cli_main(["export", str(ckpt), str(out)])
    except SystemExit as exit_:
        code = exit_.code
    printed = capsys.readouterr().out.strip().splitlines()
    assert code == 2, printed
    assert re.fullmatch(rf"lightning-par export: error: {re.escape(name)} holds non-finite values \(1 NaN, 0 inf of "
                        r"\d+\): refused to export it\..*", printed[-1]), printed
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.name]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_flag_is_read_at_once_on_a_cpu_and_one_step_late_on_a_gpu(device):
    """``NonFiniteFlags.local_lagged``, at each optimizer step's end: on a CPU the step's own bits (lag 0); on a GPU
    the previous step's, copied to pinned host memory without a sync (lag 1), so a NaN at step 1 is reported at
    step 2's end. ``local_now`` (``skip``) always reads the step's own. (CUDA: on a GPU machine only.)"""
    from lightning_par.run.bad_steps import GRAD, LOSS, NonFiniteFlags

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    flags = NonFiniteFlags()
    finite, nan = torch.tensor(1.0, device=device), torch.tensor(math.nan, device=device)
    seen = []
    for step, loss in enumerate([finite, nan, finite, finite]):
        flags.add_loss(loss)
        flags.add_grads([torch.full((3,), math.inf if step == 2 else 1.0, device=device)])
        seen.append(flags.local_lagged())
    seen.append(flags.local_lagged())  # the step after: a GPU's last copy
    if device == "cpu":
        assert seen == [(0, 0), (LOSS, 0), (GRAD, 0), (0, 0), (0, 0)]
    else:
        assert seen == [(0, 1), (0, 1), (LOSS, 1), (GRAD, 1), (0, 0)]
    flags.add_loss(nan)
    assert flags.pending() and flags.peek() == LOSS and flags.local_now() == LOSS and not flags.pending()
