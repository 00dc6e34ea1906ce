"""Tensor parallelism on a model the engine was not written around: the GPT-2-style ``lightning_par.examples.GPT2``
(learned positions, LayerNorms and linears with biases, MLP linears as direct children of the block, tied embeddings),
plus the RNG tracker for dropout and clear errors for plans that cannot be applied.

(a) Parity with one process through the CLI, 20 fp32 steps: tied with plain SGD, untied with AdamW (4 launches).
(b) One 2-rank launch without Lightning (``tests/tp_any_model_worker.py``): gradients against one process (tied,
    untied, with and without sequence parallelism), dropout masks across the tp ranks, bad plans on rank 0 while
    rank 1 issues no collective.
(c) Bad plans, in-process (``resolve_tp_plan`` needs no process group).
"""

import json
import re

import pytest
import torch
from torch import nn

from lightning_par import LayoutError
from lightning_par.examples.gpt2 import GPT2, GPT2Config
from lightning_par.parallel.tensor_parallel import resolve_tp_plan
from tests.conftest import GLOBAL_BATCH, PARITY_STEPS, job, need_full
from tests.harness import Run, launch_cli, launch_matrix, max_rel_diff

PARITY_RTOL = 1e-5
GPT2_MODEL = "--model=lightning_par.examples.GPT2LightningModule"
TIED_SGD = ["--model.tie_embeddings=true", "--model.optimizer=sgd", "--model.lr=0.2"]
UNTIED_ADAMW = ["--model.tie_embeddings=false", "--model.optimizer=adamw"]

#: name -> (devices, arguments): the common 20-step job (8 layers, batch 8) on the GPT-2-style model
RUNS: dict[str, tuple[int, list[str]]] = {
    "single_tied_sgd": (1, [*job(GLOBAL_BATCH), GPT2_MODEL, *TIED_SGD, "--trainer.strategy=auto"]),
    "tp2_tied_sgd": (2, [*job(GLOBAL_BATCH), GPT2_MODEL, *TIED_SGD, "--trainer.strategy=megatron_tp2"]),
    "single_untied_adamw": (1, [*job(GLOBAL_BATCH), GPT2_MODEL, *UNTIED_ADAMW, "--trainer.strategy=auto"]),
    "tp2_untied_adamw": (2, [*job(GLOBAL_BATCH), GPT2_MODEL, *UNTIED_ADAMW, "--trainer.strategy=megatron_tp2"]),
}
PARITY = {"tp2_tied_sgd": "single_tied_sgd", "tp2_untied_adamw": "single_untied_adamw"}


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory, cache_dir, request):
    done: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name.endswith("untied_adamw"):
            need_full(request.config, "gpt2_untied_adamw")
        if name not in done:
            devices, args = RUNS[name]
            done[name] = launch_cli(tmp_path_factory.mktemp(name), cache_dir, args, devices=devices).check()
        return done[name]

    return get


# -- (a) parity with one process ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PARITY))
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
    launch_matrix(root, cache_dir, "tests.tp_any_model_worker", [str(root / "out")], nproc=2, timeout=300).check()
    return [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(2)]


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


def test_recomputed_blocks_replay_their_dropout_masks(two_ranks):
    # activation recompute restores the default generator before re-running a block; the region states are made
    # from it, so the masks inside the regions repeat too, and the gradients equal those without recompute
    for rank in two_ranks:
        print(f"recompute: {rank['recompute']}")
        assert rank["recompute"]["input_grad_equal"] and rank["recompute"]["max_grad_diff"] == 0.0


def test_gpt2_style_dropout_keeps_the_replicas_equal(two_ranks):
    for rank in two_ranks:
        plain, sp = rank["gpt2_dropout"]["sp=False"], rank["gpt2_dropout"]["sp=True"]
        # tensor parallel: embedding dropout and the residual stream are replicated, identical on both ranks
        assert plain["embedding_dropout"]["equal"] and plain["residual_equal"]
        # sequence parallel: each rank holds other tokens, so its masks are its own
        assert not sp["embedding_dropout"]["equal"]
        assert 0.15 <= plain["embedding_dropout"]["dropped_fraction"] <= 0.25


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
