"""MegatronTPStrategy: loss parity with one process for tensor, sequence and 2D (dp x tp) parallelism, tied
embeddings, a Hugging Face Llama trained from its own plan, global-norm clipping, checkpoints, and clear errors."""

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_par import LayoutError, MegatronTPStrategy
from lightning_par.examples.gpt import GPT, GPTConfig
from lightning_par.parallel.tensor_parallel import check_sequence_length, resolve_tp_plan
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS, launch_of, run_cases, steps_of
from tests.harness import launch_cli, max_rel_diff

PARITY_RTOL = 1e-5

#: parallel run -> its single-process reference
PARITY = {
    "tp2": "single",
    "tp4": "single_kv4",
    "tp2_sp": "single",
    "tp4_sp": "single_kv4",
    "dp2_tp2_sp": "single",
    "tp2_sp_tied": "single_tied",
    "dp2_tp2_accum_clip": "single_clip",
    "zero3_dp2_tp2_accum_clip": "single_clip",
    "hf_tp2": "hf_single",
}


@pytest.mark.parametrize("name", run_cases([(n, (n, r)) for n, r in PARITY.items()]))
def test_tensor_parallel_matches_single_process(runs, name):
    run, reference = runs(name), runs(PARITY[name])  # the run first: it may be a full-run-only launch
    steps = steps_of(name)  # (the full run's 4-rank fits: one epoch, against the reference's first)
    diff = max_rel_diff(run.losses(), reference.losses(steps=steps))
    val_diff = max_rel_diff(run.losses("val/loss"), reference.losses("val/loss", steps))
    print(f"{name}: max relative per-step train loss difference {diff:.2e} over {steps} steps, "
          f"val {val_diff:.2e}")
    assert len(run.losses()) == steps
    assert diff <= PARITY_RTOL and val_diff <= PARITY_RTOL


@pytest.mark.parametrize("name", run_cases(["dp2_tp2_accum_clip", "zero3_dp2_tp2_accum_clip"], "single_clip"))
def test_clipping_uses_the_global_gradient_norm(runs, name):
    # every parameter is a DTensor on the mesh, so clip_grad_norm_ reduces over tp (and dp for FSDP2) shards
    norms, reference_norms = runs(name).grad_norms(), runs("single_clip").grad_norms()
    print(f"{name}: gradient norms {norms} vs one process {reference_norms}")
    assert max_rel_diff(norms, reference_norms) <= 1e-4
    assert min(reference_norms) > 0.5  # large enough that clipping acts


@launch_of("dp2_tp2_sp")
def test_ranks_and_sampler_follow_the_mesh(runs):
    reports = runs("dp2_tp2_sp").reports
    assert [r["coordinates"] for r in reports] == [{"pp": 0, "dp": d, "cp": 0, "tp": t} for d in (0, 1) for t in (0, 1)]
    assert reports[0]["groups"]["tp"] == [0, 1] and reports[0]["groups"]["dp"] == [0, 2]
    # the tp ranks of one replica see the same samples, the two replicas different ones
    assert reports[0]["first_batches"] == reports[1]["first_batches"] != reports[2]["first_batches"]


@launch_of("tp2", "single")
def test_parameters_are_split_over_tp(runs):
    report = runs("tp2").state_reports()[0]
    single = runs("single").state_reports()[0]
    # numel counts DTensors globally: the same model; the bytes each rank holds are about half
    assert report["numel"] == single["numel"]
    ratio = report["bytes"]["parameters"] / single["bytes"]["parameters"]
    print(f"tp2 holds {ratio:.3f} of the parameter bytes per rank")
    assert 0.5 <= ratio < 0.53  # the norm weights (a few hundred floats) stay replicated


def _sample(log: str) -> str:
    rule = "-" * 60
    return log.split("Sampled from the trained model:\n" + rule + "\n", 1)[1].split("\n" + rule, 1)[0]


@launch_of("tp2_sp", "single")
def test_generation_under_sequence_parallelism_gives_the_single_process_text(runs):
    # outside the loss the vocab-parallel head returns full logits, and the growing sequence (4 + n tokens, mostly
    # not divisible by tp) is padded on the right for sequence parallelism; same seed, same samples
    text, reference = _sample(runs("tp2_sp").log), _sample(runs("single").log)
    print(f"tp2_sp sampled {text!r}; one process {reference[:len(text)]!r}")
    assert len(text) >= 20 and text[:20] == reference[:20]


@launch_of("tp2", full=True)
def test_validate_from_a_tensor_parallel_checkpoint(tmp_path, cache_dir, runs):
    trained = runs("tp2")
    checkpoint = trained.checkpoint(step=PARITY_STEPS)
    assert checkpoint.is_dir() and (checkpoint / "manifest.json").is_file(), "tp > 1 writes a sharded DCP directory"
    args = [f"--data.batch_size={GLOBAL_BATCH}", "--trainer.limit_val_batches=2", "--trainer.strategy=megatron_tp2",
            f"--ckpt_path={checkpoint}"]
    validated = launch_cli(tmp_path, cache_dir, args, devices=2, command="validate").check()
    (loss,) = validated.losses("val/loss")
    print(f"val/loss after training {trained.losses('val/loss')[-1]:.6f}, validated from checkpoint {loss:.6f}")
    assert abs(loss - trained.losses("val/loss")[-1]) <= 1e-6 * loss
    assert EPOCH_STEPS * 2 == PARITY_STEPS  # the checkpoint at step 20 is the one after the last validation


@pytest.mark.launch(ranks=4, full=True)
def test_a_layout_the_model_cannot_take_fails_on_every_rank_before_training(tmp_path, cache_dir):
    # tp=4 with the tiny preset's 2 kv heads: every rank raises in setup, before any collective, so nothing hangs
    args = ["--trainer.max_steps=2", "--trainer.strategy=megatron_tp4", "--sample_tokens=0"]
    failed = launch_cli(tmp_path, cache_dir, args, devices=4, timeout=120)
    assert failed.returncode != 0 and failed.seconds < 120
    assert "key/value head count (config.n_kv_heads) is 2, which tp=4 does not divide" in failed.log
    assert not list(tmp_path.glob("tb/**/events.out.tfevents.*")) or not failed.scalars().get("train/loss")


# -- bad input: fails before training, in-process, with the module, the sizes and the fix -------------------------
def _gpt(**overrides) -> GPT:
    config = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192)
    return GPT(GPTConfig(**{**config, **overrides}))


@pytest.mark.parametrize(
    "overrides,tp,match",
    [
        ({}, 4, r"key/value head count \(config.n_kv_heads\) is 2, which tp=4 does not divide.*choices: 1, 2"),
        (dict(n_heads=8, n_kv_heads=8, dim=64), 16, r"attention head count \(config.n_heads\) is 8, which tp=16"),
        (dict(ffn_dim=190, n_kv_heads=4), 4, r"FFN size \(config.ffn_dim\) is 190, which tp=4 does not divide"),
        (dict(n_heads=6, n_kv_heads=6, dim=96), 4, r"attention head count \(config.n_heads\) is 6, which tp=4"),
        (dict(vocab_size=250, n_kv_heads=4), 4, r"vocabulary size \(config.vocab_size\) is 250, which tp=4"),
    ],
)
def test_sizes_that_tp_does_not_divide_are_refused(overrides, tp, match):
    with pytest.raises(LayoutError, match=match):
        resolve_tp_plan(_gpt(**overrides), tp)


def test_hidden_size_and_linear_features_are_checked():
    from types import SimpleNamespace

    class Odd(torch.nn.Module):
        tp_plan = {"up": "colwise", "down": "rowwise"}

        def __init__(self, config=None):
            super().__init__()
            self.config = config
            self.up, self.down = torch.nn.Linear(8, 6), torch.nn.Linear(6, 8)

    with pytest.raises(LayoutError, match=r"hidden size \(config.hidden_size\) is 66, which tp=4 does not divide"):
        resolve_tp_plan(Odd(SimpleNamespace(hidden_size=66)), 4)
    # without a config the module shapes alone are checked
    with pytest.raises(LayoutError, match=r"Odd.up \(Linear\): out_features is 6, which tp=4 does not divide"):
        resolve_tp_plan(Odd(), 4)


def test_a_plan_naming_missing_modules_or_unknown_styles_is_refused():
    model = _gpt()
    model.tp_plan = {**GPT.tp_plan, "layers.*.attn.qkv_proj": "colwise"}
    with pytest.raises(LayoutError, match=r"GPT.tp_plan names 'layers.\*.attn.qkv_proj', but GPT has no module"):
        resolve_tp_plan(model, 2)
    model.tp_plan = {"head": "diagonal"}
    with pytest.raises(LayoutError, match=r"'diagonal' is not a style lightning-par applies; use one of: colwise"):
        resolve_tp_plan(model, 2)


def test_a_model_without_a_plan_gets_a_clear_error():
    with pytest.raises(LayoutError, match=r"Sequential declares no tensor-parallel plan.*Add a `tp_plan`"):
        resolve_tp_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2)


def test_sequence_length_must_divide_with_sequence_parallel():
    check_sequence_length(32, 4)
    with pytest.raises(LayoutError, match=r"sequence length is 30.*divisible by 4 \(e.g. 28 or 32\)"):
        check_sequence_length(30, 4)


def test_resolved_plan_lists_every_module_in_order():
    plan = resolve_tp_plan(_gpt(tie_embeddings=True), 2, sequence_parallel=True)
    assert list(plan)[:4] == ["embed", "layers.0.attn_norm", "layers.0.attn", "layers.0.attn.q_proj"]
    assert plan["layers.0.attn"] == "block_input" and plan["layers.0.attn.o_proj"] == "rowwise"
    assert plan["layers.1.mlp_norm"] == plan["norm"] == "sequence_parallel"
    assert plan["head"] == plan["embed"] == "vocab_parallel"
    assert resolve_tp_plan(_gpt(), 2)["norm"] == "replicate"


def test_hugging_face_llama_plan_is_read_from_the_model():
    pytest.importorskip("transformers")
    from lightning_par.examples import HFLlamaLightningModule

    lm = HFLlamaLightningModule(n_layers=2)
    lm.configure_model()
    plan = resolve_tp_plan(lm, 2)
    assert plan["model.lm_head"] == "colwise_gather_output"  # Hugging Face's own head entry, its meaning kept
    # (transformers >= 5.2x adds the embedding's vocabulary split to every plan; 5.17 replicates it)
    published = lm.model.tp_plan.get("model.embed_tokens", "replicate")
    assert plan["model.model.embed_tokens"] == published in ("embedding_rowwise", "replicate")
    assert plan["model.model.layers.1.self_attn.k_proj"] == "colwise"
    assert plan["model.model.layers.1.self_attn"] == "block_input"
    with pytest.raises(LayoutError, match=r"key/value head count \(config.num_key_value_heads\) is 2, which tp=4"):
        resolve_tp_plan(lm, 4)
    with pytest.raises(LayoutError, match=r"sequence_parallel=True with the Hugging Face model LlamaForCausalLM"):
        resolve_tp_plan(lm, 2, sequence_parallel=True)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp=1, sequence_parallel=True), r"sequence_parallel=True needs tp > 1"),
        (dict(tp=0), r"tp=0 is not a valid size"),
    ],
)
def test_bad_megatron_options_fail_when_the_strategy_is_made(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        MegatronTPStrategy(**kwargs)


def test_registered_megatron_names():
    for name, tp, sp, stage in [("megatron_tp2", 2, False, 0), ("megatron_tp2_sp", 2, True, 0),
                                ("megatron_tp4", 4, False, 0), ("megatron_tp2_zero3", 2, False, 3)]:
        strategy = Trainer(accelerator="cpu", devices=4, strategy=name, logger=False).strategy
        assert isinstance(strategy, MegatronTPStrategy)
        assert (strategy.tp, strategy.sequence_parallel, strategy.layout.zero_stage) == (tp, sp, stage)
