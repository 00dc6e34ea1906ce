"""Lightning's own strategy contract under lightning-par's layouts (tests/launch/contract_worker.py, whose docstring
names the Lightning tests ported and every adaptation). One launch of 2 ranks runs ZeRO-1, ZeRO-3, tp2 and pp2 (ZeRO-0,
ZeRO-2 and cp2 too in the full run); tp2 x pp2 and cp2 x pp2 are one launch of 4 ranks, in the full run. Each number
is compared with the one-process reference the worker computes on rank 0 (plain SGD, the same weights and global
batches)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import full_run, uses_run
from tests.harness import launch_matrix
from tests.launch.contract_worker import FIT_STEPS, GLOBAL_BATCH, LAYOUTS

TWO_RANKS = ("zero1", "zero3", "tp2", "pp2")
TWO_RANKS_FULL = ("zero0", "zero2", "cp2")
FOUR_RANKS = ("tp2_pp2", "cp2_pp2")
RTOL = 1e-5


@pytest.fixture(scope="session")
def contract(tmp_path_factory, cache_dir, request):
    """``contract(layout)``: ``(reference, per-rank reports)``; each rank count's layouts in one launch."""
    done: dict[str, tuple[dict, list[dict]]] = {}

    def get(name: str) -> tuple[dict, list[dict]]:
        ranks = 4 if name in FOUR_RANKS else 2
        if name in FOUR_RANKS or name in TWO_RANKS_FULL:
            uses_run(f"lightning_contract_{ranks}_ranks_full")
        if name not in done:
            names = list(FOUR_RANKS) if ranks == 4 else \
                [*TWO_RANKS, *(TWO_RANKS_FULL if full_run(request.config) else ())]
            root = tmp_path_factory.mktemp(f"contract_{ranks}")
            run = launch_matrix(root, cache_dir, "tests.launch.contract_worker",
                                ["--root", str(root), "--layouts", *names], nproc=ranks, timeout=900).check()
            print(f"Lightning contract: {len(names)} layouts on {ranks} ranks in {run.seconds:.0f} s")
            reference = json.loads((root / "reference.json").read_text())
            for n in names:
                reports = [json.loads((root / n / f"rank{r}.json").read_text()) for r in range(ranks)]
                done[n] = (reference, [dict(r, root=str(root / n)) for r in reports])
        return done[name]

    return get


LAYOUT_NAMES = [*TWO_RANKS, *TWO_RANKS_FULL, *FOUR_RANKS]
LAYOUT_CASES = [pytest.param(n, marks=pytest.mark.launch(ranks=4 if n in FOUR_RANKS else 2, full=n not in TWO_RANKS))
                for n in LAYOUT_NAMES]


def close(a: float, b: float, rtol: float = RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(b), 1e-12)


def no_errors(reports: list[dict], *checks: str) -> None:
    for rank, report in enumerate(reports):
        failed = {c: report["errors"][c] for c in checks if c in report["errors"]}
        assert not failed, f"rank {rank}: {failed}"


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_fit_then_validate_test_predict_on_the_same_trainer(contract, layout):
    """test_ddp_integration.py::test_multi_gpu_model_ddp_fit_test, test_trainer.py::test_fit_test_synchronization
    and ::test_model_in_correct_mode_during_stages: each stage runs after fit on the same Trainer and model, with the
    one process's losses; train mode while fitting, eval mode in the others; predictions of each rank's batch."""
    reference, reports = contract(layout)
    context_parallel = "cp" in LAYOUTS[layout]
    no_errors(reports, "fit", "validate", "test", *(() if context_parallel else ("predict",)))
    dp = reports[0]["dp"]
    for report in reports:
        assert [close(a, b) for a, b in zip(report["fit_losses"], reference["train"][:FIT_STEPS], strict=True)] == \
            [True] * FIT_STEPS, (report["fit_losses"], reference["train"])
        assert close(report["validate_loss"], reference["eval"]) and close(report["test_loss"], reference["eval"])
        if context_parallel:  # refused by design: generation needs whole sequences on a rank
            assert "predict_step under context parallel (cp=2) is not supported" in report["errors"]["predict"]
            assert report["modes"] == {"train": True, "validate": False, "test": False}
            continue
        assert report["modes"] == {"train": True, "validate": False, "test": False, "predict": False}
        assert report["predictions"] == [[GLOBAL_BATCH // dp, 32]] * 2  # (32 new tokens per prompt)


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_multiple_stages_with_a_weights_only_checkpoint_in_inference_mode(contract, layout):
    """test_fsdp.py::_run_multiple_stages (test_checkpoint_multi_gpus, test_strategy_checkpoint): after fit (with
    ModelCheckpoint(save_last=True)) and test, a save and a weights-only save over ``last``; then under
    ``torch.inference_mode()`` test and predict of the model and from the weights-only checkpoint, each at the one
    process's loss, the predictions of the model and of the checkpoint equal; the weights stay trainable (the next
    check fits again). Upstream's save-equality check (the saved weights are the model's), from the files here."""
    from lightning_par.plugins.checkpoint_export import read_model_state

    reference, reports = contract(layout)
    no_errors(reports, "multiple_stages")
    for report in reports:
        assert report["ms_last_saved"]
        assert report["ms_optimizer_saved"] == [True, False]  # after-test.ckpt has them; the weights-only none
        assert close(report["ms_test_model"], reference["eval"]) and close(report["ms_test_ckpt"], reference["eval"])
        assert report["ms_inference_params"] == 0
        if "cp" not in LAYOUTS[layout]:
            assert report["ms_predictions"] == [[GLOBAL_BATCH // report["dp"], 32]] * 2
            assert report["ms_predictions_equal"]
    saved = read_model_state(f"{reports[0]['root']}/weights_only.ckpt")
    fitted = read_model_state(f"{reports[0]['root']}/after_fit.ckpt")
    assert saved.keys() == fitted.keys() and all(torch.equal(saved[k], fitted[k]) for k in fitted)


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_optimizer_holds_the_layouts_parameters(contract, layout):
    """test_model_parallel_integration.py::test_tensor_parallel: under tensor parallel every DTensor the optimizer
    holds lives on ``device_mesh["tp"]`` (pipeline stages included)."""
    _, reports = contract(layout)
    no_errors(reports, "fit")
    for report in reports:
        if "tp" in LAYOUTS[layout]:
            assert report["optimizer_meshes"] == ["tp"] and report["optimizer_on_tp_mesh"], report["optimizer_meshes"]
        else:
            assert "tp" not in report["optimizer_meshes"]


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_fit_again_after_evaluating(contract, layout):
    """test_trainer.py::test_repeated_fit_calls_with_max_epochs_and_steps, with one more step: a second fit of the
    same Trainer and model (after validate/test/predict) trains the one process's third step."""
    reference, reports = contract(layout)
    no_errors(reports, "fit_again")
    for report in reports:
        assert len(report["fit_again_losses"]) == FIT_STEPS + 1
        assert close(report["fit_again_losses"][-1], reference["train"][FIT_STEPS])


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_saves_after_every_stage(contract, layout):
    """trainer.save_checkpoint after fit, validate, test and predict (under ZeRO-1 the test stage once dropped the
    partitioner the optimizer's shards need: KeyError 0); evaluation leaves the saved weights as fit left them."""
    from lightning_par.plugins.checkpoint_export import read_model_state

    _, reports = contract(layout)
    no_errors(reports, "save_after_fit", "save_after_validate", "save_after_test", "save_after_predict")
    root = reports[0]["root"]
    first = read_model_state(f"{root}/after_fit.ckpt")
    for stage in ("validate", "test", "predict"):
        later = read_model_state(f"{root}/after_{stage}.ckpt")
        assert later.keys() == first.keys()
        assert all(torch.equal(later[k], first[k]) for k in first), stage


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_lightning_module_state_dict(contract, layout):
    """test_model_parallel_integration.py::test_strategy_state_dict (the sharded form): every rank returns the
    unsplit model's keys in its order; each value is the trained model's (gathered for the comparison); under
    pipeline parallel another stage's entry is a meta tensor, and the stages together hold every entry."""
    reference, reports = contract(layout)
    no_errors(reports, "state_dict")
    held = set()
    for report in reports:
        assert report["state_keys"] == reference["keys"]
        for key, value in report["state_sums"].items():
            if value is None:
                continue
            held.add(key)
            want = reference["sums"][key]
            assert abs(value[0] - want[0]) <= RTOL * want[1] and close(value[1], want[1]), key
    assert held == set(reference["keys"])
    if "pp" in layout:
        assert all(None in r["state_sums"].values() for r in reports)  # a stage holds only its own


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_sharded_checkpoint_to_load_from_checkpoint(contract, layout, tmp_path):
    """test_model_parallel_integration.py::test_load_full_state_checkpoint_into_regular_model,
    test_fsdp.py::test_save_sharded_and_consolidate_and_load: the checkpoint, exported to one Lightning file
    (``export_lightning``; ``lightning-par export CKPT OUT.ckpt``), loads through ``load_from_checkpoint`` with the
    trained weights, and a stock Lightning strategy (ddp) tests it with the one process's loss."""
    from lightning_par.plugins.checkpoint_export import main as export_main

    reference, reports = contract(layout)
    no_errors(reports, "export_load_from_checkpoint", "one_file_into_layout")
    for report in reports:
        assert report["loaded_sums"].keys() == reference["sums"].keys()
        for key, (total, _) in report["loaded_sums"].items():
            assert abs(total - reference["sums"][key][0]) <= RTOL * reference["sums"][key][1], key
        assert close(report["ddp_test_loss"], reference["eval"])
        assert close(report["one_file_test_loss"], reference["eval"])  # and the one file tested under the layout
    # the command line writes the same file
    out = tmp_path / "cli.ckpt"
    assert export_main([f"{reports[0]['root']}/after_test.ckpt", str(out)]) == 0
    written, exported = (torch.load(p, weights_only=True) for p in (out, f"{reports[0]['root']}/exported.ckpt"))
    assert written.keys() == exported.keys() and "optimizer_states" not in written
    assert all(torch.equal(written["state_dict"][k], v) for k, v in exported["state_dict"].items())


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_init_module_empty_init(contract, layout):
    """test_model_parallel_integration.py::test_module_init_context, test_fsdp.py::test_module_init_context:
    under ``Trainer.init_module(empty_init=True)`` every parameter is on the meta device until setup, and the
    strategy materialises them with the values one process draws (the fit is at parity: no uninitialised memory);
    ``empty_init=False`` builds them for real (and that model is validated before it is fitted); a module that
    builds its network in ``configure_model`` gets it built there, as without ``init_module``."""
    reference, reports = contract(layout)
    no_errors(reports, "init_module_empty_True", "init_module_empty_False", "init_module_empty_configure_model")
    for report in reports:
        # every parameter, small ones too (as under Lightning's sharded strategies; the large ones only, once)
        assert len(report["init_True_meta"]) == report["init_True_n_params"] == len(reference["initial_sums"])
        assert report["init_False_meta"] == []
        assert report["init_configure_model_n_params"] == 0  # built by configure_model, at setup
        for empty in (True, False, "configure_model"):
            assert all(close(a, b) for a, b in zip(report[f"init_{empty}_losses"], reference["train"], strict=False))
            assert len(report[f"init_{empty}_losses"]) == FIT_STEPS
            sums = report[f"init_{empty}_initial_sums"]
            assert all(abs(sums[k] - v) <= 1e-6 * max(1.0, abs(v)) for k, v in reference["initial_sums"].items()
                       if k in sums)


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_a_plain_lightning_checkpoint_resumes_with_its_optimizer_state(contract, layout):
    """test_model_parallel_integration.py::test_load_standard_checkpoint_into_distributed_model: a ddp checkpoint
    (optimizer state by position, no parameter names) resumes under the layout with every momentum buffer exact,
    pipeline stages included (each maps the positions to the whole model's parameter order); tested under the
    layout (a model built in ``__init__``, as Lightning's TemplateModel), its weights give ddp's loss."""
    _, reports = contract(layout)
    no_errors(reports, "standard_checkpoint")
    for report in reports:
        assert report["plain_resume_compared"] > 0
        assert report["plain_resume_momentum_max_abs_diff"] == 0.0
        assert close(report["plain_test_loss"], report["plain_ddp_test_loss"])


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_logging_reduces_over_data_parallel_replicas(contract, layout):
    """test_train_loop_logging.py::test_logging_sync_dist_true_ddp and ::test_metric_are_properly_reduced: a
    value per replica (its dp rank + 1), logged with sync_dist, is reduced over the replicas, each counted once
    (the tp and pp ranks of a replica hold the same value)."""
    _, reports = contract(layout)
    for report in reports:
        dp = report["dp"]
        assert report["logged"] == {"sum": dp * (dp + 1) / 2, "mean": (dp + 1) / 2, "max": float(dp)}


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_a_second_trainer(contract, layout):
    """A new Trainer given the fitted model: a model the layout left whole (ZeRO-0-2) is tested as it is, with the
    one process's loss after three steps; one it split or sharded is refused at setup, alike on every rank, naming
    what to do."""
    reference, reports = contract(layout)
    no_errors(reports, "other_trainer")
    sharded = LAYOUTS[layout].get("zero_stage") == 3 or "tp" in LAYOUTS[layout] or "pp" in LAYOUTS[layout]
    for report in reports:
        if sharded:
            assert "was laid out by another Trainer's strategy" in report["other_trainer_refused"]
            assert "ckpt_path=" in report["other_trainer_refused"]
        else:
            assert close(report["other_trainer_test_loss"], reference["eval_after_3"])


def _plain_checkpoint(tmp_path):
    """A two-layer model after one SGD-with-momentum step, and Lightning's one-file checkpoint of it (optimizer state
    by position): ``(model, optimizer, file)``."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    file = tmp_path / "plain.ckpt"
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}, file)
    return model, optimizer, file


def test_a_plain_checkpoint_maps_to_a_pipeline_stage_by_the_models_parameter_order(tmp_path):
    """In one process, no launch: a one-file optimizer state without parameter names (Lightning's own) loads into a
    stage holding some of the model's parameters when it is one group over the whole model in the model's order;
    two groups cannot be mapped and are refused, saying so."""
    from torch import nn

    from lightning_par.plugins import sharded_checkpoint
    from lightning_par.plugins.checkpoint_files import CheckpointError

    model, optimizer, file = _plain_checkpoint(tmp_path)
    order = [name for name, _ in model.named_parameters()]
    stage = nn.Sequential()
    stage.add_module("1", nn.Linear(4, 3))  # the last stage: the model's names "1.weight", "1.bias"
    stage_optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match=r"keys optimizer state by position \(groups of \[4\] parameters\)"):
        sharded_checkpoint.load(file, stage, [stage_optimizer])  # the stage's order alone says nothing
    sharded_checkpoint.load(file, stage, [stage_optimizer], model_params=order)
    for name, param in stage.named_parameters():
        want = optimizer.state[dict(model.named_parameters())[name]]["momentum_buffer"]
        assert torch.equal(stage_optimizer.state[param]["momentum_buffer"], want), name
        assert torch.equal(param.detach(), dict(model.named_parameters())[name].detach())
    grouped = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1,
                              momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    grouped.step()
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [grouped.state_dict()]}, file)
    with pytest.raises(CheckpointError, match=r"under pipeline stages only one group over all the model's "
                                              r"parameters \(4\) in the model's order maps to names"):
        sharded_checkpoint.load(file, stage, [torch.optim.SGD(stage.parameters(), lr=0.1)], model_params=order)


def test_a_checkpoint_tested_or_predicted_from_gives_its_weights_alone(tmp_path):
    """In one process, no launch: ``trainer.test(ckpt_path=...)`` / ``predict`` restore the model only (as Lightning
    does): a file holding optimizer states loads its weights into a model without optimizers (``optimizers=None``),
    where a fit with no optimizer to take them is refused, naming the counts."""
    from torch import nn

    from lightning_par.plugins import sharded_checkpoint
    from lightning_par.plugins.checkpoint_files import CheckpointError

    model, optimizer, file = _plain_checkpoint(tmp_path)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    with pytest.raises(CheckpointError, match="holds 1 optimizer states for 0 optimizers"):
        sharded_checkpoint.load(file, fresh, [])
    sharded_checkpoint.load(file, fresh, None)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
