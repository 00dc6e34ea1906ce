"""A user's own loss terms under a pipeline (issue 41): a loss term that reads activations of several stages -- the
load-balancing losses a plain PyTorch MoE keeps on its layers, added in ``compute_loss`` or ``training_step`` -- or
a returned loss other than the schedule's is refused at the first step, on every rank, before any update; the same
model whose layers start their loss's backward themselves (``aux_loss_backward``) trains at parity with one process
(plain SGD). One 2-rank launch of ``tests/launch/pipeline_user_losses.py`` (~20 s on 2 cores); the detection itself
in one process below."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_par.parallel.pipeline.loss import kept_activations
from tests.harness import launch_matrix, max_rel_diff
from tests.launch.pipeline_user_losses import STEPS, MoEFFN, PlainMoE, StartsItsLoss

RANKS = 2


@pytest.fixture(scope="module")
def reports(tmp_path_factory, cache_dir) -> list[dict]:
    root = tmp_path_factory.mktemp("pipeline_user_losses")
    run = launch_matrix(root, cache_dir, "tests.launch.pipeline_user_losses", ["--root", str(root)], nproc=RANKS,
                        timeout=300).check()
    print(f"pipeline_user_losses: {run.seconds:.1f} s")
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(RANKS)]


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("case, said", [
    ("aux_in_compute_loss", "keep a tensor of the forward's graph as a module attribute"),
    ("aux_in_training_step", "keep a tensor of the forward's graph as a module attribute"),
    ("scaled", "returned a loss other than `self.compute_loss(batch)`"),
])
def test_a_loss_term_the_schedule_cannot_train_is_refused(reports, case, said):
    for rank, report in enumerate(reports):
        result = report[case]
        print(f"rank {rank} {case}: {result.get('error', 'no error')[:160]}")
        assert result.get("error", "").startswith("LayoutError") and said in result["error"], result
        assert "aux_loss_backward" in result["error"]
        assert result["losses"] == [] and result["changed"] == [], "refused before any update"
    if case != "scaled":  # each rank names what its stage keeps: the layers of the other stage are not named
        names = [set(r[case]["error"].split(" keep ")[0].split(": ", 2)[-1].split(", ")) for r in reports]
        assert any("blocks.0.ffn.aux" in n for n in names[0]) and not any("blocks.0" in n for n in names[1])


@pytest.mark.launch(ranks=2)
def test_a_layer_that_starts_its_loss_trains_at_parity(reports):
    for rank, report in enumerate(reports):
        result = report["aux_in_layer"]
        diff = max_rel_diff(result["losses"], result["reference"])
        print(f"rank {rank}: per-step loss {diff:.2e}, weights {result['weight_diff']:.2e} over {STEPS} SGD steps "
              f"({result['reference'][0]:.4f} -> {result['reference'][-1]:.4f})")
        assert "error" not in result and len(result["losses"]) == STEPS
        assert diff <= 1e-5 and result["weight_diff"] <= 1e-5
        assert max_rel_diff(result["losses"], result["reference_without_aux"]) > 1e-3, "the parity sees the term"


def test_kept_activations_finds_what_a_forward_leaves_on_the_layers():
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    users = PlainMoE(MoEFFN)
    users(tokens)
    assert kept_activations(users) == [f"blocks.{i}.ffn.aux" for i in range(4)]
    assert kept_activations(users, started={"blocks.1.ffn"}) == [f"blocks.{i}.ffn.aux" for i in (0, 2, 3)]
    with torch.no_grad():  # a forward without a graph keeps nothing a loss could train
        fresh = PlainMoE(StartsItsLoss)
        fresh(tokens)
    assert kept_activations(fresh) == []
