"""Train the layouts ``tests/launch/test_planner.py`` holds ``lightning-par plan`` to, one short ``Trainer.fit`` after
another in the same 4 ranks.

Run under torchrun (``tests.harness.launch_matrix``): the ranks start and join the process group once, then each
layout gets a fresh tiny model and Trainer and runs 1 or 2 optimizer steps on random tokens -- what the planner predicts
does not depend on the data, and a launch per layout would cost a start-up each (most of a launch's time on 2 cores).
Each layout writes ``ROOT/NAME/reports/state_rank{R}.json`` (:class:`tests.probes.StateReport` after optimizer step
1: bytes of parameters, gradients and optimizer states on every rank) and, for a pipeline, ``ROOT/NAME/
pipeline_timeline.json`` (:class:`lightning_par.callbacks.PipelineTimeline` of step 2: the executed action order and
the activation bytes each pipeline rank held at its peak).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import LayoutStrategy, examples
from lightning_par.callbacks import PipelineTimeline
from lightning_par.parallel.layout import Layout
from lightning_par.planner.plan import Candidate
from tests.conftest import GLOBAL_BATCH
from tests.probes import StateReport

WORLD = 4
SEQ = 32
TINY = {"preset": "tiny", "n_layers": 8}  # the model of tests.harness.TINY_JOB
SHORT = {"preset": "tiny", "n_layers": 2}  # under tp: DTensor ops cost several times plain ones on CPU
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev")
PP2_SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")  # a fit costs about a second: the others at pp=4


@dataclass(frozen=True)
class Case:
    """One measured layout: the planner's description of it, and the model (a ``lightning_par.examples`` class)."""

    layout: Candidate
    model: str = "GPTLightningModule"
    kwargs: dict = field(default_factory=lambda: dict(TINY))
    activations: bool = False  # compare the pipeline's peak activation bytes per rank and its bubble

    @property
    def microbatch(self) -> int:
        """Sequences per micro-batch: a replica's share of the global batch, cut into the pipeline's micro-batches."""
        return GLOBAL_BATCH // (self.layout.dp * self.layout.n_microbatches)


def _pp(dp: int, pp: int, schedule: str, zero: int = 0) -> Candidate:
    from lightning_par.parallel.pipeline.runtime import resolve_schedule

    choice = resolve_schedule(schedule, pp)  # the engine's defaults: m = 2 pp, v as the schedule needs
    return Candidate(dp, WORLD // (dp * pp), pp, zero, schedule, choice.virtual_stages, choice.n_microbatches,
                     precision="fp32")


def _flat(dp: int, tp: int, zero: int = 0, sp: bool = False) -> Candidate:
    return Candidate(dp, tp, 1, zero, sequence_parallel=sp, precision="fp32")


#: name -> case. Every ZeRO stage, tp (with sequence parallel, with ZeRO-1 and with FSDP2), a Hugging Face model, tp x
#: pp, every schedule at pp=4, four at dp=2 x pp=2 (with ZeRO 0, 1 and 2 in turn; ZeRO-3 stages once, for state only:
#: the activation meter would count FSDP2's gathered weights as activations)
CASES: dict[str, Case] = {
    **{f"zero{z}_dp4": Case(_flat(4, 1, z)) for z in range(4)},
    "tp4": Case(_flat(1, 4), kwargs={**SHORT, "n_kv_heads": 4}),
    "zero1_dp2_tp2_sp": Case(_flat(2, 2, 1, sp=True), kwargs=SHORT),
    "zero3_dp2_tp2": Case(_flat(2, 2, 3), kwargs=SHORT),
    "hf_zero2_dp2_tp2": Case(_flat(2, 2, 2), "HFLlamaLightningModule", {"n_layers": 2, "n_kv_heads": 2}),
    "tp2_pp2_1f1b": Case(_pp(1, 2, "1f1b"), kwargs=SHORT, activations=True),
    **{f"pp4_{s}": Case(_pp(1, 4, s), activations=True) for s in SCHEDULES},
    **{f"dp2_pp2_{s}": Case(_pp(2, 2, s, zero=i % 3), activations=True) for i, s in enumerate(PP2_SCHEDULES)},
    "zero3_dp2_pp2_zbv": Case(_pp(2, 2, "zbv", zero=3)),
}


#: ep2 x expert_dp2 on the example MoE (AdamW): the experts' own ZeRO over expert_dp (launched apart, full set)
EP_CASES: dict[str, Case] = {
    f"zero{z}_dp4_ep2": Case(Candidate(4, 1, 1, z, precision="fp32", ep=2), "MoEGPTLightningModule", SHORT)
    for z in (1, 3)
}
ALL_CASES = {**CASES, **EP_CASES}


class _Timeline(PipelineTimeline):
    _draw = staticmethod(lambda *args: None)  # the figure costs about a second per fit; the tests read the numbers


def _tokens(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (n, SEQ + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def fit(root: Path, name: str) -> None:
    case = ALL_CASES[name]
    layout = case.layout.layout()
    pl.seed_everything(1234)
    model = getattr(examples, case.model)(**case.kwargs)
    strategy = LayoutStrategy(**{f.name: getattr(layout, f.name) for f in fields(Layout)})
    data = DataLoader(_tokens(4 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH // case.layout.dp)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=2 if case.layout.pp > 1 else 1, logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root / name,
        callbacks=[StateReport(str(root / name / "reports"), step=1), _Timeline(step=1)],
    )
    trainer.fit(model, data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--cases", nargs="*", help="the ALL_CASES to run (default: CASES)")
    args = parser.parse_args()
    for name in args.cases or CASES:
        start = time.perf_counter()
        fit(Path(args.root), name)
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)  # in the launch log, to see what costs


if __name__ == "__main__":
    main()
