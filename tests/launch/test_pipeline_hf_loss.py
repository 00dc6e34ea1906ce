"""A LightningModule written the Hugging Face way (dict batches, ``loss = self.model(**batch).loss``, no
``loss_fn`` / ``compute_loss``) under pipeline layouts: the last stage computes the model's own loss
(``ForCausalLMLoss``: labels shifted, ``-100`` ignored), the token mean over the whole batch.

Two launches of ``tests/launch/pipeline_hf_loss.py`` (2 ranks: pp2; 4 ranks: tp2 x pp2) train tiny Llama and Qwen2
models through ``Trainer.fit`` on left-padded batches with ``-100`` prompt labels -- micro-batches of different token
counts -- next to one process on the same batches; the 2-rank launch also runs the steps a pipeline cannot split.
One CLI launch checks that a model without a loss of its own fails at setup with one error per rank and nothing
else. The rest runs in this process.
"""

from __future__ import annotations

import json

import pytest
import torch

from lightning_par.parallel.pipeline.adapter import PipelineOutput
from lightning_par.parallel.pipeline.loss import ModelLoss, counted_tokens
from tests.conftest import full_run
from tests.harness import launch_command, launch_matrix, max_rel_diff
from tests.launch.pipeline_hf_loss import (
    BALANCING_CASES,
    BATCH,
    CASES,
    ERROR_CASES,
    MICROBATCHES,
    STEPS,
    HFStyleLM,
    make_rows,
)

pytest.importorskip("transformers")

PARITY_RTOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory, cache_dir, request):
    """``results(world)``: the cases of one rank count, all in one launch on first use (the default run: the cases
    not marked ``full``; the 2-rank launch also runs the error cases)."""
    full = full_run(request.config)
    out: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in out:
            names = [n for n, case in CASES.items() if case.world == world and (full or not case.full)]
            errors = list(ERROR_CASES) if world == 2 else []
            balancing = [n for n, case in BALANCING_CASES.items() if world == 2 and (full or not case.full)]
            root = tmp_path_factory.mktemp(f"pipeline_hf_loss_{world}")
            path = root / "results.json"
            run = launch_matrix(root, cache_dir, "tests.launch.pipeline_hf_loss",
                                ["--out", str(path), "--cases", *names, "--errors", *errors,
                                 "--balancing", *balancing], nproc=world,
                                timeout=600).check()
            print(f"pipeline_hf_loss on {world} ranks: {len(names)} fits + {len(errors)} errors in {run.seconds:.1f} s")
            out[world] = json.loads(path.read_text())
        return out[world]

    return get


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.launch(ranks=c.world, full=c.full))
                                  for n, c in CASES.items()])
def test_hugging_face_step_matches_one_process(results, name):
    """Per-step training losses and the validation loss (``self.model(**batch).loss`` in validation_step, forward
    only through the stages) within 1e-5 of one process, on batches whose micro-batches count different tokens."""
    case = CASES[name]
    result = results(case.world)[name]
    diff = max_rel_diff(result["pipeline"], result["reference"])
    val = max_rel_diff(result["val"], [result["reference_val"]])
    print(f"{name}: train {diff:.2e} over {STEPS} steps ({result['reference'][0]:.3f} -> "
          f"{result['reference'][-1]:.3f}), val {val:.2e}, {result['seconds']:.1f} s")
    assert len(result["pipeline"]) == STEPS and diff <= PARITY_RTOL
    assert len(result["val"]) == 1 and val <= PARITY_RTOL
    assert result["reference"][-1] < result["reference"][0] - 0.3, "the model must learn for parity to mean much"
    # the batches make a mean of micro-batch means a different number: parity needs the token mean
    assert len(set(result["micro_counts"])) == MICROBATCHES
    gap = abs(result["mean_of_means"] - result["token_mean"]) / result["token_mean"]
    assert gap > 10 * PARITY_RTOL, gap


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_a_step_the_pipeline_cannot_split_fails_alike_on_every_rank(results, name):
    """A step that scales the returned loss, or calls the model without labels, is refused with one clear error
    on every rank (not chained to another), and the next fit of the same processes runs."""
    errors = results(2)[name]["errors"]
    _, expected = ERROR_CASES[name]
    assert len(errors) == 2
    for error in errors:
        assert error.startswith(f"LayoutError: {expected}"), error
        assert "[chained" not in error, error


@pytest.mark.launch(ranks=2)
def test_a_model_without_a_loss_of_its_own_fails_at_setup_alone(tmp_path, cache_dir):
    """A LightningModule with neither ``loss_fn`` nor a Hugging Face model: the layout error names both ways, once
    per rank, and nothing follows it (no meta-tensor tracebacks from a teardown)."""
    run = launch_command(tmp_path, cache_dir, [
        "fit", "--model=tests.launch.pipeline_hf_loss.HFStyleLM", "--model.arch=plain",
        "--data=tests.launch.pipeline_hf_loss.RowsDataModule", "--trainer.accelerator=cpu",
        "--trainer.devices=2", "--trainer.strategy=pipeline2_1f1b", "--trainer.max_steps=1", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false"], timeout=120)
    assert run.returncode != 0
    message = ("lightning-par: error: pipeline parallel (pp=2) computes the loss on the last stage, inside the "
               "schedule, so it must know the loss: HFStyleLM defines no loss_fn(), and its model PlainLM is not a "
               "Hugging Face causal LM")
    last = [line for line in run.log.splitlines() if line.strip()][-2:]  # rank 0's and rank 1's last lines
    assert all(line.startswith(message) for line in last), run.log[-3000:]
    assert run.log.count(message) == 2 and "Traceback" not in run.log, run.log[-3000:]
    assert "meta" not in run.log.lower() and "Exception ignored" not in run.log, run.log[-3000:]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.launch(ranks=2, full=c.full))
                                  for n, c in BALANCING_CASES.items()])
def test_a_moe_models_load_balancing_loss_is_each_layers_term_on_its_stage(results, name):
    """A Hugging Face MoE model with its load-balancing loss on (coefficient 0.2) under pp2, 1F1B, 2 micro-batches,
    plain SGD: each layer's term started in the backward on its own stage. The logged per-step losses match one
    process computing the same (LM loss + the sum of the layers' terms per micro-batch, their mean) within 1e-5, and
    the same run without the term is far from them, and so is one with the term logged but not trained (so the parity
    sees the term and its gradient)."""
    result = results(2)[name]
    diff = max_rel_diff(result["pipeline"], result["reference"])
    without, untrained = (max(abs(a - b) for a, b in zip(result["pipeline"], result[k], strict=True))
                          for k in ("without_term", "term_not_trained"))
    print(f"{name}: {diff:.2e} from one process over {STEPS} steps ({result['reference'][0]:.4f} -> "
          f"{result['reference'][-1]:.4f}); without the term {without:.2e} away, with it not trained {untrained:.2e}; "
          f"{result['seconds']:.1f} s")
    assert len(result["pipeline"]) == STEPS and diff <= PARITY_RTOL
    assert without > 1e-4 and untrained > 1e-4
    assert result["reference"][-1] < result["reference"][0] - 0.1, "the model must learn for parity to mean much"


# -- in this process ------------------------------------------------------------------------------------------------
def _hf(arch: str, base: bool = False):
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                               initializer_range=0.5)  # logits far from uniform
    return (getattr(transformers, "LlamaModel" if arch == "llama" else "Qwen2Model") if base
            else getattr(transformers, model_cls))(config)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_micro_batch_losses_add_up_to_the_models_batch_loss(arch):
    """The model's own loss per micro-batch (as the last stage computes it) averages to ``model(**batch).loss``
    of the whole batch -- the token mean -- and differs from a mean of micro-batch means."""
    model = _hf(arch)
    loss = ModelLoss.of(model)
    assert loss is not None and "ForCausalLMLoss" in loss.name
    batch = {k: torch.stack([row[k] for row in make_rows(1)]) for k in ("input_ids", "labels", "attention_mask")}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        whole = model(**batch).loss
        per_micro = loss.for_batch(batch["labels"], MICROBATCHES)
        chunks = zip(logits.tensor_split(MICROBATCHES), batch["labels"].tensor_split(MICROBATCHES), strict=True)
        pipeline = torch.stack([per_micro(y, t) for y, t in chunks]).mean()
        means = torch.stack([model(input_ids=i, attention_mask=a, labels=y).loss for i, y, a in zip(
            *(batch[k].tensor_split(MICROBATCHES) for k in ("input_ids", "labels", "attention_mask")),
            strict=True)]).mean()
    assert counted_tokens(batch["labels"]) == int((batch["labels"][:, 1:] != -100).sum()) < BATCH * 32
    torch.testing.assert_close(pipeline, whole, rtol=1e-6, atol=0)
    assert abs(means - whole) / whole > 1e-3, (means, whole)


def test_only_a_causal_lm_with_its_own_loss_has_one():
    from tests.launch.pipeline_any_model import PlainLM

    assert ModelLoss.of(PlainLM()) is None
    assert ModelLoss.of(_hf("llama", base=True)) is None, "a base model takes no labels"
    assert HFStyleLM.__dict__.get("loss_fn") is None and HFStyleLM.__dict__.get("compute_loss") is None


def test_a_pipeline_output_says_what_it_lacks():
    with pytest.raises(AttributeError, match=r"'logits': this pipeline output holds only \['loss'\] \(given labels"):
        _ = PipelineOutput(loss=torch.zeros(())).logits
    assert PipelineOutput(loss=torch.ones(())).loss == 1 and len(make_rows(1)) == BATCH
