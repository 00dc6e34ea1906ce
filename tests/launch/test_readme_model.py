"""The README's "Your own model" recipe, as written, under every strategy family at parity with one process; and
``block_types=`` for a model whose blocks are not in an ``nn.ModuleList`` (issue 27).

One 2-rank launch of :mod:`tests.launch.readme_model` (default set, about 30 s on 2 cores) fits, in the same ranks:
the README's module under ``zero3``, ``megatron_tp2`` and ``pipeline2_1f1b``; the README's mixture-of-experts code
(its ``MoE`` layer in ``MoELM``, issue 29) under the name ``ep2``; and a model keeping its blocks in an
``nn.Sequential`` as ``self.net``, and one holding them as attributes, each under ZeRO-3 and pp2 with
``block_types=``. A 4-rank launch (full set, about 35 s) fits the README's module under tp2 x pp2
(``Hybrid3DStrategy``). The single-process references run in this process through the same function. 10 fp32 steps
each, global batch 8: the README's AdamW; plain SGD for the models without an nn.ModuleList.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_par.parallel.blocks import find_blocks
from tests.conftest import uses_run
from tests.harness import launch_matrix, max_rel_diff
from tests.launch.readme_model import STEPS, SequentialLM, fit

TOLERANCE = 1e-5  # max relative per-step loss difference against one process (fp32)
LAUNCHES = {2: ["readme_zero3", "readme_tp2", "readme_pp2_1f1b", "moe_ep2", "sequential_zero3", "sequential_pp2_1f1b",
                "attributes_zero3", "attributes_pp2_1f1b"],
            4: ["readme_tp2_pp2"]}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, cache_dir, request):
    """``get(name)``: the per-rank results of a case; each launch made on first use."""
    done: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        devices = next(d for d, names in LAUNCHES.items() if name in names)
        if devices == 4:
            uses_run("readme_model_4_ranks")
        if name not in done:
            root = tmp_path_factory.mktemp(f"readme_model_{devices}")
            run = launch_matrix(root, cache_dir, "tests.launch.readme_model",
                                ["--root", str(root), "--cache", str(cache_dir), "--cases", *LAUNCHES[devices]],
                                nproc=devices).check()
            print(f"readme model: {len(LAUNCHES[devices])} fits on {devices} ranks in {run.seconds:.0f} s")
            for n in LAUNCHES[devices]:
                done[n] = [json.loads((root / n / f"rank{r}.json").read_text()) for r in range(devices)]
        return done[name]

    return get


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """The single-process fits, in this process (one thread, as the launched ranks)."""
    out: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in out:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                out[name] = fit(name, tmp_path_factory.mktemp(name), str(cache_dir))
            finally:
                torch.set_num_threads(threads)
        return out[name]

    return get


def _step_losses(ranks: list[dict], data_parallel: bool) -> list[float]:
    """The global batch's loss per step: the mean over data-parallel ranks (equal shares of the batch), else the
    value every rank returned (they must agree)."""
    if data_parallel:
        return [sum(step) / len(step) for step in zip(*(r["losses"] for r in ranks), strict=True)]
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks), [r["losses"] for r in ranks]
    return ranks[0]["losses"]


@pytest.mark.parametrize("name", [*(pytest.param(n, marks=pytest.mark.launch(ranks=2)) for n in LAUNCHES[2][:3]),
                                  pytest.param("readme_tp2_pp2", marks=pytest.mark.launch(ranks=4, full=True))])
def test_the_readme_recipe_trains_at_parity(name, matrix, reference):
    """README.md's ``MyModule`` around docs/models.md's ``MyLM``, exactly as written (its ``tp_plan`` included): the
    loss of every step within 1e-5 of one process; what ``self.log("train/loss", loss, sync_dist=True)`` logged at
    the last step equals the single process's; under tensor parallel the step saw a plain tensor, not a DTensor."""
    ranks, single = matrix(name), reference("readme_single")
    losses = _step_losses(ranks, data_parallel=name == "readme_zero3")
    assert len(losses) == STEPS
    assert max_rel_diff(losses, single["losses"]) < TOLERANCE, (losses, single["losses"])
    assert losses[-1] != losses[0]  # it trained
    for rank in ranks:
        assert abs(rank["logged"] - single["logged"]) <= TOLERANCE * abs(single["logged"]), (rank, single)
        assert not rank["dtensor_seen"]


@pytest.mark.launch(ranks=2)
def test_the_readme_moe_trains_under_ep2_at_parity(matrix, reference):
    """README.md's "Mixture of experts" code as written (the ``MoE`` layer declaring the expert interface, ``MoELM``,
    ``MyMoEModule`` with the README's AdamW) under ``strategy="ep2"``: ExpertParallelStrategy, each rank holding half
    of the expert weights, every step's loss and the logged loss within 1e-5 of one process."""
    ranks, single = matrix("moe_ep2"), reference("moe_single")
    losses = _step_losses(ranks, data_parallel=True)
    assert len(losses) == STEPS and losses[-1] != losses[0]
    assert max_rel_diff(losses, single["losses"]) < TOLERANCE, (losses, single["losses"])
    total = single["experts_held"][1]
    assert single["experts_held"] == [total, total] and total == 4 * 4 * 2 * 64 * 128  # 4 blocks of 4 experts
    for rank in ranks:
        assert rank["strategy"] == "ExpertParallelStrategy" and rank["experts_held"] == [total // 2, total]
        assert abs(rank["logged"] - single["logged"]) <= TOLERANCE * abs(single["logged"]), (rank, single)


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("name", ["sequential_zero3", "sequential_pp2_1f1b", "attributes_zero3",
                                  "attributes_pp2_1f1b"])
def test_block_types_for_blocks_outside_a_module_list(name, matrix, reference):
    """``block_types=[Block]`` (a class under ZeRO-3, a class name under pp) on a model with no nn.ModuleList, held as
    ``self.net``, its blocks in an nn.Sequential or held as attributes ``block0`` ... ``block3``: ZeRO-3 gathers the
    root (embedding, norm, head) and pp splits ``net``; plain SGD at parity."""
    ranks, single = matrix(name), reference(name.split("_")[0] + "_single")
    losses = _step_losses(ranks, data_parallel=name.endswith("zero3"))
    assert max_rel_diff(losses, single["losses"]) < TOLERANCE, (losses, single["losses"])
    for rank in ranks:
        assert abs(rank["logged"] - single["logged"]) <= TOLERANCE * abs(single["logged"]), (rank, single)


# -- where block_types= puts the root (in this process) -----------------------------------------------------------
class _Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.net = model


class _Attributes(nn.Module):
    """Blocks held directly, as attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.first, self.act, self.second = nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)
        self.head = nn.Linear(8, 16)


class _TwoLists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.decoder = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])


def test_the_root_is_the_module_that_holds_the_blocks():
    sequential = find_blocks(_Holder(SequentialLM(dim=8)), ["Block"])
    assert (sequential.path, type(sequential.root).__name__) == ("net", "SequentialLM")
    assert sequential.blocks == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert sequential.units == ("emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head")
    attributes = find_blocks(_Holder(_Attributes()), [nn.Linear])
    assert (attributes.path, attributes.blocks) == ("net", ("first", "second", "head"))
    assert attributes.units == ("emb", "first", "second", "head")  # registration order; the GELU holds nothing
    two = find_blocks(_Holder(_TwoLists()), [nn.Linear])
    assert (two.path, two.units) == ("net", None)  # the lowest common ancestor; no one order of units
    assert two.blocks == ("encoder.0", "encoder.1", "decoder.0", "decoder.1")


def test_the_readme_shows_the_plan_the_tests_train():
    """The README's tp_plan snippet is the plan of docs/models.md's MyLM, which the launches above train."""
    import ast

    from tests.launch.readme_model import REPO, _python_blocks, readme_namespace

    (snippet,) = [b for b in _python_blocks(REPO / "README.md") if b.lstrip().startswith("tp_plan = ")]
    shown = ast.literal_eval(snippet.strip().removeprefix("tp_plan = "))
    assert shown == readme_namespace().MyLM.tp_plan
