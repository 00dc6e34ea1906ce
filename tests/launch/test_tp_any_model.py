"""Tensor parallelism on a model the engine was not written around: the GPT-2-style ``lightning_par.examples.GPT2``
(learned positions, LayerNorms and linears with biases, MLP linears as direct children of the block, tied embeddings),
plus the RNG tracker for dropout and clear errors for plans that cannot be applied.

(a) Parity with one process through the CLI, 20 fp32 steps: tied with plain SGD, untied with AdamW (4 launches).
(b) One 2-rank launch without Lightning (``tests/launch/tp_any_model_worker.py``): gradients against one process (tied,
    untied, with and without sequence parallelism), dropout masks across the tp ranks, bad plans on rank 0 while
    rank 1 issues no collective.
(c) Bad plans, in-process (``resolve_tp_plan`` needs no process group).
(d) A fused q|k|v projection (``packed_colwise``): in the launch of (b), plain SGD at parity with one process, the
    checkpoint as the one-process tensors, the deferred build, and the setup self-check refusing ``colwise`` and a
    global head count by name; in the full run, the example ``PlainLM`` through the CLI at tp2 against one process,
    and its tp2 checkpoint validated in one process.
"""

import json
import re

import pytest
import torch
from torch import nn

from lightning_par import LayoutError
from lightning_par.examples.gpt2 import GPT2, GPT2Config
from lightning_par.parallel.tensor_parallel import resolve_tp_plan
from tests.conftest import GLOBAL_BATCH, PARITY_STEPS, job, uses_run
from tests.harness import Run, launch_cli, launch_cli_group, launch_matrix, max_rel_diff

PARITY_RTOL = 1e-5
GPT2_MODEL = "--model=lightning_par.examples.GPT2LightningModule"
TIED_SGD = ["--model.tie_embeddings=true", "--model.optimizer=sgd", "--model.lr=0.2"]
UNTIED_ADAMW = ["--model.tie_embeddings=false", "--model.optimizer=adamw"]
PLAIN_LM = "--model=lightning_par.examples.PlainLMLightningModule"
PLAIN_SGD = ["--model.optimizer=sgd", "--model.lr=0.2", "--model.n_layers=4"]

#: name -> (devices, arguments): the common 20-step job (8 layers, batch 8) on the GPT-2-style model
RUNS: dict[str, tuple[int, list[str]]] = {
    "single_tied_sgd": (1, [*job(GLOBAL_BATCH), GPT2_MODEL, *TIED_SGD, "--trainer.strategy=auto"]),
    "tp2_tied_sgd": (2, [*job(GLOBAL_BATCH), GPT2_MODEL, *TIED_SGD, "--trainer.strategy=megatron_tp2"]),
    "single_untied_adamw": (1, [*job(GLOBAL_BATCH), GPT2_MODEL, *UNTIED_ADAMW, "--trainer.strategy=auto"]),
    "tp2_untied_adamw": (2, [*job(GLOBAL_BATCH), GPT2_MODEL, *UNTIED_ADAMW, "--trainer.strategy=megatron_tp2"]),
    # the example PlainLM (fused q|k|v, packed_colwise:3), plain SGD
    "plain_lm_single_sgd": (1, [*job(GLOBAL_BATCH), PLAIN_LM, *PLAIN_SGD, "--trainer.strategy=auto"]),
    "plain_lm_tp2_sgd": (2, [*job(GLOBAL_BATCH), PLAIN_LM, *PLAIN_SGD, "--trainer.strategy=megatron_tp2",
                             "--trainer.enable_checkpointing=true",  # (the launch runs in its own directory)
                             "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                             "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.dirpath=ckpt"]),
    "plain_lm_dp2_tp2_sgd": (4, [*job(GLOBAL_BATCH // 2), PLAIN_LM, *PLAIN_SGD, "--trainer.strategy=megatron_tp2"]),
    # (hybrid3d's default ZeRO-1 refuses packed_colwise: see test_packed_colwise_under_zero_is_refused)
    "plain_lm_tp2_pp2_sgd": (4, [*job(GLOBAL_BATCH), PLAIN_LM, *PLAIN_SGD, "--trainer.strategy=hybrid3d_tp2_pp2",
                                 "--trainer.strategy.zero_stage=0"]),
}
PARITY = {"tp2_tied_sgd": "single_tied_sgd", "tp2_untied_adamw": "single_untied_adamw"}


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory, cache_dir, request):
    done: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name.endswith("untied_adamw"):
            uses_run("gpt2_untied_adamw")
        if name.startswith("plain_lm"):
            uses_run("plain_lm_tp2_sgd")
        if name not in done:  # every run of its rank count in one launch (one start-up; all of them --full)
            devices = RUNS[name][0]
            jobs = {n: args for n, (d, args) in RUNS.items() if d == devices and n not in done}
            done.update(launch_cli_group(tmp_path_factory.mktemp(f"gpt2_runs_{devices}"), cache_dir, jobs, devices,
                                         timeout=300 * len(jobs)))
        return done[name]

    return get


# -- (a) parity with one process ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [pytest.param("tp2_tied_sgd", marks=pytest.mark.launch(ranks=2, full=True)),
                                  pytest.param("tp2_untied_adamw", marks=pytest.mark.launch(ranks=2, full=True))])
def test_gpt2_style_model_under_tp2_matches_one_process(gpt2_runs, name):
    reference, run = gpt2_runs(PARITY[name]), gpt2_runs(name)
    diff = max_rel_diff(run.losses(), reference.losses())
    val_diff = max_rel_diff(run.losses("val/loss"), reference.losses("val/loss"))
    norm_diff = max_rel_diff(run.grad_norms(), reference.grad_norms())
    print(f"{name}: max relative per-step train loss difference {diff:.2e} over {PARITY_STEPS} steps, val "
          f"{val_diff:.2e}, gradient norm (first 5 steps) {norm_diff:.2e}; loss {reference.losses()[0]:.3f} -> "
          f"{reference.losses()[-1]:.3f}")
    assert [r["groups"]["tp"] for r in run.reports] == [[0, 1], [0, 1]]  # really split over 2 tp ranks
    assert len(run.losses()) == PARITY_STEPS
    assert min(reference.losses()[-5:]) < reference.losses()[0] - 0.5  # it trained: the comparison means something
    assert diff <= PARITY_RTOL and val_diff <= PARITY_RTOL and norm_diff <= PARITY_RTOL


# -- (b) 2 ranks without Lightning ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, cache_dir) -> list[dict]:
    root = tmp_path_factory.mktemp("tp_any_model_ranks")
    launch_matrix(root, cache_dir, "tests.launch.tp_any_model_worker", [str(root / "out")], nproc=2,
                  timeout=300).check()
    return [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("case", ["tied=False,sp=False", "tied=True,sp=False", "tied=False,sp=True",
                                  "tied=True,sp=True"])
def test_gpt2_style_gradients_match_one_process(two_ranks, case):
    # non-zero biases (GPT-2 starts them at zero): a row-parallel bias added on both ranks would double it
    for rank in two_ranks:
        got = rank["gradients"][case]
        print(f"{case}: loss {got['loss_rel']:.1e}, worst gradient {got['grad_rel']:.1e} ({got['worst']})")
        assert got["loss_rel"] <= PARITY_RTOL and got["grad_rel"] <= PARITY_RTOL
        assert got["tied"] == ("tied=True" in case)
        # every block's q/k/v, c_fc (weights and biases) and both c_proj weights, the embedding and the head
        assert got["n_split"] == 2 * 10 + (1 if got["tied"] else 2)


@pytest.mark.launch(ranks=2)
def test_gpt2_block_issues_megatrons_collectives(two_ranks):
    # one block on [b=2, s=16, h=64]: attention (a region) and c_fc (a direct child of the block next to its norms)
    # each take one input collective shared by their column-parallel linears, and each row-parallel output one
    sbh = 2 * 16 * 64
    for rank in two_ranks:
        plain, sp = rank["block_traffic"]["sp=False"], rank["block_traffic"]["sp=True"]
        assert plain["forward"] == plain["backward"] == [["all_reduce", sbh]] * 2
        assert sp["forward"] == [["all_gather", sbh], ["reduce_scatter", sbh]] * 2
        # with sequence parallelism the LayerNorms run on sequence shards: weight and bias gradients summed over tp
        assert sorted(map(tuple, sp["backward"])) == sorted(
            [("all_gather", sbh), ("reduce_scatter", sbh)] * 2 + [("all_reduce", 64)] * 4)


@pytest.mark.launch(ranks=2)
def test_dropout_masks_differ_inside_the_region_and_agree_outside(two_ranks):
    tracked = [r["rng"]["tracker"] for r in two_ranks]
    for rank in tracked:
        assert rank["drop_in"]["equal"] and rank["drop_out"]["equal"]  # replicated activations
        assert not rank["drop_mid"]["equal"]  # each rank's own FFN features
        assert 0.4 <= rank["drop_mid"]["differing_fraction"] <= 0.6  # independent masks at p = 0.5
        assert rank["outputs_equal"] and rank["default_generator_equal"]
        assert not rank["region_rand_equal"] and rank["outside_rand_equal"]
        assert rank["region_left_default_unadvanced"] and rank["region_replayed"]
    # the ranks were seeded 100 and 101: rank 1 took rank 0's default generator (and said so) and its seed
    assert [r["sync_warning"] for r in tracked] == [False, True]
    assert [r["common_seed"] for r in tracked] == [100 + 2718] * 2
    # without the tracker (ranks seeded alike) the ranks draw the same mask for different features
    untracked = two_ranks[0]["rng"]["no_tracker"]
    assert untracked["drop_mid"]["equal"] and untracked["drop_in"]["equal"]


@pytest.mark.launch(ranks=2)
def test_recomputed_blocks_replay_their_dropout_masks(two_ranks):
    # activation recompute restores the default generator before re-running a block; the region states are made
    # from it, so the masks inside the regions repeat too, and the gradients equal those without recompute
    for rank in two_ranks:
        print(f"recompute: {rank['recompute']}")
        assert rank["recompute"]["input_grad_equal"] and rank["recompute"]["max_grad_diff"] == 0.0


@pytest.mark.launch(ranks=2)
def test_gpt2_style_dropout_keeps_the_replicas_equal(two_ranks):
    for rank in two_ranks:
        plain, sp = rank["gpt2_dropout"]["sp=False"], rank["gpt2_dropout"]["sp=True"]
        # tensor parallel: embedding dropout and the residual stream are replicated, identical on both ranks
        assert plain["embedding_dropout"]["equal"] and plain["residual_equal"]
        # sequence parallel: each rank holds other tokens, so its masks are its own
        assert not sp["embedding_dropout"]["equal"]
        assert 0.15 <= plain["embedding_dropout"]["dropped_fraction"] <= 0.25


@pytest.mark.launch(ranks=2)
def test_bad_plans_fail_before_any_collective(two_ranks):
    # rank 0 applied them while rank 1 waited outside any collective: a collective would have blocked for 60 s
    bad = two_ranks[0]["bad_plans"]
    expected = {
        "conv": r"ConvBlock.conv \(Conv1d\) is planned 'colwise', which splits an nn.Linear over its output features",
        "odd_linear": r"OddLinear.fc \(Linear\): out_features is 7, which tp=2 does not divide",
        "tied_apart": r"wte.weight and lm_head.weight are one tied parameter, but the plan splits them differently",
        "heads": r"attention head count \(config.n_head\) is 3, which tp=2 does not divide",
    }
    for name, pattern in expected.items():
        print(f"{name}: {bad[name]}")
        assert bad[name]["error"] is not None, name
        assert re.search(pattern, bad[name]["error"]), bad[name]["error"]
        assert bad[name]["seconds"] < 5


# -- (c) bad plans and the resolved plan, in-process ----------------------------------------------------------------
def _gpt2(**overrides) -> GPT2:
    return GPT2(GPT2Config(**{"n_layer": 2, **overrides}))


class Conv1D(nn.Module):
    """Like transformers' GPT-2 ``Conv1D``: a linear layer whose weight is stored [in, out]."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


@pytest.mark.parametrize(
    "plan,match",
    [
        ({"h.*.attn": "colwise"}, r"GPT2.h.0.attn \(CausalSelfAttention\) is planned 'colwise'.*holds no parameters "
                                  r"of its own: name the linear layers inside it"),
        ({"ln_f": "rowwise"}, r"GPT2.ln_f \(LayerNorm\) is planned 'rowwise', which splits an nn.Linear over its "
                              r"input features; LayerNorm cannot be split that way"),
        ({"wpe": "colwise"}, r"GPT2.wpe \(Embedding\) is planned 'colwise'"),
        ({"wte": "replicate"}, r"wte.weight and lm_head.weight are one tied parameter.*\(Replicate\(\) as "
                               r"'replicate' vs Shard\(0\) as 'vocab_parallel'\)"),
    ],
)
def test_plans_naming_modules_that_cannot_be_split_are_refused(plan, match):
    model = _gpt2(tie_word_embeddings=True)
    model.tp_plan = {**GPT2.tp_plan, **plan}
    with pytest.raises(LayoutError, match=match):
        resolve_tp_plan(model, 2)


def test_a_transposed_conv1d_or_a_convolution_is_refused():
    model = _gpt2()
    model.h[0].c_fc = Conv1D(256, 64)
    with pytest.raises(LayoutError, match=r"h.0.c_fc \(Conv1D\) is planned 'colwise'.*a Conv1D that stores its "
                                          r"weight transposed"):
        resolve_tp_plan(model, 2)
    model = _gpt2()
    model.h[1].c_proj = nn.Conv2d(256, 64, 1)
    with pytest.raises(LayoutError, match=r"h.1.c_proj \(Conv2d\) is planned 'rowwise'"):
        resolve_tp_plan(model, 2)


@pytest.mark.parametrize(
    "overrides,tp,match",
    [
        (dict(n_embd=96, n_head=6), 4, r"attention head count \(config.n_head\) is 6, which tp=4.*choices: 1, 2"),
        (dict(n_inner=130), 4, r"FFN size \(config.n_inner\) is 130, which tp=4 does not divide"),
        (dict(vocab_size=250), 4, r"vocabulary size \(config.vocab_size\) is 250, which tp=4"),
    ],
)
def test_gpt2_sizes_that_tp_does_not_divide_are_refused(overrides, tp, match):
    with pytest.raises(LayoutError, match=match):
        resolve_tp_plan(_gpt2(**overrides), tp)


def test_gpt2_resolved_plan():
    plan = resolve_tp_plan(_gpt2(), 2)
    # a block holding its norms next to c_fc/c_proj shares its column-parallel input without becoming a DTensor
    assert plan["h.0"] == plan["h.0.attn"] == "block_input"
    assert plan["h.0.c_fc"] == plan["h.0.attn.q_proj"] == "colwise"
    assert plan["h.0.c_proj"] == plan["h.0.attn.c_proj"] == "rowwise"
    assert plan["wpe"] == plan["h.0.ln_1"] == plan["ln_f"] == "replicate"
    assert plan["wte"] == plan["lm_head"] == "vocab_parallel"
    sp = resolve_tp_plan(_gpt2(), 2, sequence_parallel=True)
    assert sp["wpe"] == sp["h.1.ln_2"] == "sequence_parallel"  # positions cut to this rank's share of the sequence


# -- (d) fused projections: packed_colwise, and the setup self-check ----------------------------------------------
@pytest.mark.launch(ranks=2)
def test_fused_qkv_model_under_tp2_matches_one_process_with_plain_sgd(two_ranks):
    for rank in two_ranks:
        fused = rank["fused"]
        diff = max_rel_diff(fused["losses"], fused["ref_losses"])
        print(f"packed_colwise:3, 5 SGD steps: max relative loss difference {diff:.1e}, weights "
              f"{fused['weights_rel']:.1e}; losses {fused['ref_losses']}")
        assert fused["qkv_placement"] == "(_StridedShard(dim=0, sf=3),)"  # each rank: its slice of q, k and v
        assert diff <= PARITY_RTOL and fused["weights_rel"] <= PARITY_RTOL
        assert len(set(fused["ref_losses"])) == 5  # the steps changed the model
        print(f"with sequence parallelism: loss {fused['sp_loss_rel']:.1e}, worst gradient {fused['sp_grad_rel']:.1e}")
        assert fused["sp_loss_rel"] <= PARITY_RTOL and fused["sp_grad_rel"] <= PARITY_RTOL
        assert fused["grad_norm_rel"] <= PARITY_RTOL  # the packed shards counted once each in the global norm


@pytest.mark.launch(ranks=2)
def test_packed_parameters_checkpoint_load_and_materialise_as_the_one_process_tensors(two_ranks):
    for rank in two_ranks:
        fused = rank["fused"]
        assert fused["saved_equal_one_process"] and fused["saved_names"]  # DCP file = one process's state dict
        assert fused["reloaded_equal"]  # read back into another tp2 model: the same shards
        assert fused["materialized_equal"]  # built on meta, split, then filled: the one-process values
        assert fused["pretrained_equal"]  # a one-process .safetensors read into the shards, each part's slice


@pytest.mark.launch(ranks=2)
def test_the_setup_self_check_refuses_colwise_on_a_fused_projection_and_global_heads(two_ranks):
    for rank in two_ranks:
        fused = rank["fused"]
        colwise, heads = fused["colwise"]["error"], fused["global_heads"]["error"]
        print(f"colwise: {colwise}\nglobal heads: {heads}\nview(n_heads, -1): {fused['global_heads_view']['error']}")
        assert colwise.startswith("FusedLM.blocks.0.attn (FusedAttention) computes another function when its plan "
                                  "splits it over tp=2: its forward splits the output of qkv (192 features) into 3 "
                                  "parts")
        assert colwise.endswith("tp_plan['blocks.*.attn.qkv'] = 'packed_colwise:3' (each rank then holds its slice "
                                "of each part).")
        assert heads.startswith("FusedLM.blocks.0.attn (FusedAttention) fails when its plan splits it over tp=2: "
                                "RuntimeError: shape '[2, 4, 4, 16]' is invalid")
        assert "reshape with this rank's head count" in heads and "FusedAttention.n_heads=4" in heads
        # view(b, t, n_heads, -1) runs, with half the head size: caught by the comparison, not by an exception
        view = fused["global_heads_view"]["error"]
        assert re.match(r"FusedLM.blocks.0.attn \(FusedAttention\) computes another function when its plan splits "
                        r"it over tp=2 \(largest difference from the unsplit block", view)
        assert fused["colwise"]["seconds"] < 5 and fused["global_heads"]["seconds"] < 5


@pytest.mark.launch(ranks=2)
def test_the_self_check_is_cheap_and_runs_once(two_ranks):
    fused = two_ranks[0]["fused"]
    print(f"self-check at setup, tp=2: tiny model {fused['self_check_seconds_tiny']:.3f} s, "
          f"{fused['big_params'] / 1e6:.0f}M parameters {fused['self_check_seconds_big']:.3f} s, "
          f"again {fused['self_check_seconds_big_again'] * 1e3:.2f} ms")
    assert fused["big_params"] > 100e6
    assert fused["self_check_seconds_big"] < 10 and fused["self_check_seconds_tiny"] < 2
    # (class, tp, plan) checked already: no block runs (one forward of a block takes longer than this)
    assert fused["self_check_seconds_big_again"] < min(0.05, fused["self_check_seconds_big"] / 10)


class FusedHeads(nn.Module):
    """A fused projection in a module whose head count is called ``heads``."""

    def __init__(self, heads: int = 3, dim: int = 48):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)


class FusedHeadsModel(nn.Module):
    tp_plan = {"layers.*.qkv": "packed_colwise:3", "layers.*.out": "rowwise"}

    def __init__(self, **kwargs):
        super().__init__()
        self.layers = nn.ModuleList([FusedHeads(**kwargs)])


def test_a_head_count_tp_does_not_divide_is_refused_whatever_it_is_called():
    with pytest.raises(LayoutError, match=r"FusedHeadsModel.layers.0 \(FusedHeads\): heads is 3, which tp=2 does not "
                                          r"divide: each tensor-parallel rank holds whole heads.*choices: 1, 3"):
        resolve_tp_plan(FusedHeadsModel(), 2)
    assert resolve_tp_plan(FusedHeadsModel(heads=4), 2)["layers.0.qkv"] == "packed_colwise:3"


@pytest.mark.parametrize(
    "style,tp,match",
    [
        ("packed_colwise:1", 2, r"'packed_colwise:1' is not a style.*'packed_colwise:N' for a fused projection"),
        ("colwise:3", 2, r"'colwise:3' is not a style"),
        ("packed_colwise:3", 4, r"FusedHeadsModel.layers.0.qkv \(Linear\): out_features is 150, which 3 equal parts "
                                r"of tp=4 slices each do not divide"),
    ],
)
def test_packed_colwise_specs_and_sizes_are_checked(style, tp, match):
    model = FusedHeadsModel(heads=10, dim=50)
    model.tp_plan = {**FusedHeadsModel.tp_plan, "layers.*.qkv": style}
    with pytest.raises(LayoutError, match=match):
        resolve_tp_plan(model, tp)


def test_the_example_plain_lm_declares_its_fused_projection():
    from lightning_par.examples.plain_lm import PlainLM

    plan = resolve_tp_plan(PlainLM(n_layers=2), 2)
    assert plan["blocks.0.qkv"] == plan["blocks.1.qkv"] == "packed_colwise:3"
    assert plan["blocks.0.fc1"] == "colwise" and plan["blocks.0.proj"] == plan["blocks.0.fc2"] == "rowwise"
    assert plan["blocks.0"] == "block_input" and plan["tok_emb"] == plan["head"] == "replicate"


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_packed_colwise_under_zero_is_refused(zero_stage):
    from lightning_par.examples.plain_lm import PlainLM
    from lightning_par.parallel.tensor_parallel import check_packed_layout

    plan = resolve_tp_plan(PlainLM(n_layers=2), 2)
    check_packed_layout(plan, zero_stage=0)  # replicas across data parallel: trained at parity (below, --full)
    with pytest.raises(LayoutError, match=rf"blocks.0.qkv is planned 'packed_colwise:3', which zero_stage="
                                          rf"{zero_stage} cannot shard yet.*Use zero_stage=0"):
        check_packed_layout(plan, zero_stage=zero_stage)


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", ["plain_lm_dp2_tp2_sgd", "plain_lm_tp2_pp2_sgd"])
def test_plain_lm_with_data_or_pipeline_parallel_matches_one_process(gpt2_runs, name):
    # packed_colwise under FSDP2's replicate (dp2 x tp2) and on pipeline stages (tp2 x pp2)
    reference, run = gpt2_runs("plain_lm_single_sgd"), gpt2_runs(name)
    diff = max_rel_diff(run.losses(), reference.losses())
    print(f"PlainLM {name} vs one process, SGD: max relative loss difference {diff:.2e} over {PARITY_STEPS} steps")
    assert len(run.losses()) == PARITY_STEPS and diff <= PARITY_RTOL


@pytest.mark.launch(ranks=2, full=True)
def test_plain_lm_under_tp2_matches_one_process_and_its_checkpoint_loads_in_one(gpt2_runs, tmp_path, cache_dir):
    reference, run = gpt2_runs("plain_lm_single_sgd"), gpt2_runs("plain_lm_tp2_sgd")
    diff = max_rel_diff(run.losses(), reference.losses())
    print(f"PlainLM tp2 vs one process, SGD: max relative loss difference {diff:.2e} over {PARITY_STEPS} steps; "
          f"{reference.losses()[0]:.3f} -> {reference.losses()[-1]:.3f}")
    assert [r["groups"]["tp"] for r in run.reports] == [[0, 1], [0, 1]]
    assert min(reference.losses()[-5:]) < reference.losses()[0] - 0.5
    assert diff <= PARITY_RTOL and max_rel_diff(run.losses("val/loss"), reference.losses("val/loss")) <= PARITY_RTOL
    # the tp2 DCP checkpoint holds the one-process tensors: validated in one process, the same loss
    args = [PLAIN_LM, "--model.n_layers=4", f"--data.batch_size={GLOBAL_BATCH}", "--trainer.limit_val_batches=2",
            "--trainer.strategy=zero0", f"--ckpt_path={run.checkpoint(step=PARITY_STEPS)}"]
    (loss,) = launch_cli(tmp_path, cache_dir, args, devices=1, command="validate").check().losses("val/loss")
    print(f"val/loss after the tp2 fit {run.losses('val/loss')[-1]:.6f}, validated in one process {loss:.6f}")
    assert abs(loss - run.losses("val/loss")[-1]) <= 1e-5 * loss


@pytest.mark.launch(ranks=2, full=True)
@pytest.mark.parametrize(
    "args,message",
    [
        (["--model.qkv_style=colwise"],
         "lightning-par: error: FusedLM.blocks.0.attn (FusedAttention) computes another function when its plan "
         "splits it over tp=2: its forward splits the output of qkv (192 features) into 3 parts"),
        (["--model.global_heads=view"],
         "lightning-par: error: FusedLM.blocks.0.attn (FusedAttention) fails when its plan splits it over tp=2: "
         "RuntimeError: shape '[2, 4, 4, 16]' is invalid"),
    ],
    ids=["colwise_on_fused_qkv", "global_head_count"],
)
def test_lightning_par_fit_refuses_the_users_model_at_setup_by_name(tmp_path, cache_dir, args, message):
    # the README's path: a user's LightningModule under megatron_tp2 from the command line, refused before step 1
    argv = ["--model=tests.launch.tp_any_model_worker.FusedLMModule", *args, "--trainer.strategy=megatron_tp2",
            "--trainer.max_steps=2", "--sample_tokens=0"]
    failed = launch_cli(tmp_path, cache_dir, argv, devices=2, timeout=180)
    # one error, once: the refusal is the last line printed (each rank prints it), no traceback after it
    assert failed.returncode != 0 and failed.log.strip().splitlines()[-1].startswith(message), failed.log[-3000:]
