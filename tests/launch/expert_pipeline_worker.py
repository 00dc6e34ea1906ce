"""Expert parallel inside every pipeline schedule, against one process, in one torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node=N -m tests.launch.expert_pipeline_worker OUT_DIR \
        [CASE ...]

for tests/launch/test_expert_pipeline.py. On 4 ranks (``PipelineStrategy``: pp2 x dp2, the experts of each stage
over ep2 of its two data-parallel ranks) or 8 (``Hybrid3DStrategy``: pp2 x dp2 x tp2), one ``Trainer.fit`` per case
of the example MoE GPT with 4 layers (each rank holds stages of 2 of them), the cases named on the command line
(default: those of this world size):

* ``1f1b_sgd``, ``1f1b_adamw``, ``zbv_sgd``, ``zbv_adamw``: plain SGD and AdamW (with a shared expert) under 1F1B
  and ZBV (zero bubble in a V: 2 stages per rank, backward split into input and weight passes);
* ``gpipe_sgd``, ``interleaved_sgd`` (interleaved 1F1B, 2 stages per rank), ``looped_bfs_sgd``,
  ``zero_bubble_sgd`` (interleaved zero bubble), ``dualpipev_sgd``: the other schedules;
* ``zero1_adamw`` (1F1B), ``zero2_sgd`` (interleaved 1F1B), ``zero3_adamw`` (ZBV): the other weights under ZeRO-1 /
  ZeRO-2 / ZeRO-3;
* ``accumulate`` (1F1B, SGD): 2 Lightning batches per step (the expert gradients of both averaged once);
* ``validate_then_fit`` (ZBV, SGD): ``trainer.validate`` first (the pipeline's forward-only passes exchange tokens
  too; its loss against one process's), then the fit with the same Trainer;
* ``cp2_sgd`` (1F1B): dp1 x cp2 x pp2, each sequence and each stage's experts split over the 2 cp ranks;
* ``tp2_zero1`` (8 ranks): dp2 x tp2 x pp2, ZeRO-1, SGD.

A case named from tests/launch/router_pipeline_worker.py's table (the load-balancing loss inside the schedule) runs
there, in this launch. Then the ``REFUSALS`` named (after a fit: the process group exists): a dense model under
pp2 x ep2, each rank's error gathered (``report["refused"]``).

Each rank also logs the order of its token exchanges in the second batch (forward, and the start of each one's
backward): the ranks of an ep group must run them in the same order, or their all_to_all would pair different
layers' or micro-batches' tokens.

Every rank writes ``OUT_DIR/rank{R}.json`` as tests/launch/expert_parallel_worker.py does (per case: each step's
global loss, the pre-step global gradient norm, the expert bytes this rank holds and of its stages' experts in all);
rank 0 trains one process from the whole model's initial weights (gathered from every stage) on the same global
batches and adds its losses and norms (``reference``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import Hybrid3DStrategy, PipelineStrategy
from lightning_par.examples.gpt import causal_lm_loss
from lightning_par.examples.lit_gpt import GPTLightningModule
from lightning_par.examples.moe import MoEGPT, MoEGPTLightningModule
from lightning_par.parallel.expert_parallel import expert_layers
from tests.harness import close_process_group, every_ranks_error
from tests.launch import router_pipeline_worker
from tests.launch.expert_parallel_worker import PER_RANK, Record, reference, sequences

STEPS, LAYERS = 4, 4
SGD = dict(optimizer="sgd", lr=0.1, n_layers=LAYERS)
ADAMW = dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0, n_layers=LAYERS)
CASES = {  # the module's arguments, the layout besides pp=2, ep=2
    "1f1b_sgd": dict(module=SGD, schedule="1f1b"),
    "zbv_sgd": dict(module=SGD, schedule="zbv"),
    "1f1b_adamw": dict(module={**ADAMW, "shared_ffn_dim": 32}, schedule="1f1b"),
    "zbv_adamw": dict(module={**ADAMW, "shared_ffn_dim": 32}, schedule="zbv"),
    "gpipe_sgd": dict(module=SGD, schedule="gpipe"),
    "interleaved_sgd": dict(module=SGD, schedule="interleaved_1f1b"),
    "zero_bubble_sgd": dict(module=SGD, schedule="zero_bubble"),
    "dualpipev_sgd": dict(module=SGD, schedule="dualpipev"),
    "looped_bfs_sgd": dict(module=SGD, schedule="looped_bfs"),
    "zero1_adamw": dict(module=ADAMW, schedule="1f1b", zero=1),
    "zero2_sgd": dict(module=SGD, schedule="interleaved_1f1b", zero=2),
    "zero3_adamw": dict(module=ADAMW, schedule="zbv", zero=3),
    "accumulate": dict(module=SGD, schedule="1f1b", accumulate=2),
    "validate_then_fit": dict(module=SGD, schedule="zbv", validate_first=True),
    "cp2_sgd": dict(module=SGD, schedule="1f1b", cp=2),
    "tp2_zero1": dict(module=SGD, schedule="1f1b", zero=1, tp=2, world=8),
}


#: refused at setup on every rank alike, before any collective: the module's arguments, and a piece of the message
REFUSALS = {
    "dense_model": (dict(dense=True), "ep=2 but GPTLightningModule has no expert layers"),
}


class LoggedExchange:
    """A layer's token exchange that logs, while ``log`` is not None, each forward exchange (``F layer``) and the
    start of its backward (``B layer``: the gradient of its output arrived), in the order this rank ran them."""

    def __init__(self, name: str, exchange, record: StageRecord) -> None:
        self.name, self.exchange, self.record = name, exchange, record

    def __call__(self, tokens, counts, experts):
        out = self.exchange(tokens, counts, experts)
        log = self.record.exchanges if self.record.logging else None
        if log is not None:
            log.append(f"F {self.name}")
            out.register_hook(lambda grad: log.append(f"B {self.name}"))
        return out


class StageRecord(Record):
    """:class:`Record` on a pipeline rank: the initial weights of every stage, gathered, for the reference; the
    order of the token exchanges in the second step (the first also infers the stages' shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.exchanges: list[str] = []
        self.logging = False

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)  # this rank's stages (expert slices gathered over ep)
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, {n: t.cpu() for n, t in self.initial.items()})
        self.held["stage_parameters"] = sorted(self.initial)
        self.initial = {n: t for stage in stages for n, t in stage.items()}
        for name, layer in expert_layers(pl_module).items():
            layer.token_exchange = LoggedExchange(name, layer.token_exchange, self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.logging = batch_idx == 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.logging = False
        self.held["exchanges"] = self.exchanges


def fit(name: str, root: Path) -> StageRecord:
    case, world = CASES[name], int(os.environ["WORLD_SIZE"])
    accumulate, tp, cp = case.get("accumulate", 1), case.get("tp", 1), case.get("cp", 1)
    pl.seed_everything(1234)
    model = MoEGPTLightningModule(preset="tiny", **case["module"])
    dp = world // 2 // tp // cp
    data = sequences(PER_RANK * dp * STEPS)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=PER_RANK // accumulate, shuffle=False)
    record = StageRecord()
    options = dict(pp=2, ep=2, zero_stage=case.get("zero", 0), schedule=case["schedule"],
                   n_microbatches=PER_RANK // accumulate)
    strategy = Hybrid3DStrategy(tp=tp, cp=cp, **options) if tp > 1 or cp > 1 else PipelineStrategy(**options)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS,
                         accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root / name,
                         callbacks=[record], limit_val_batches=2)
    validated = trainer.validate(model, loader) if case.get("validate_first") else None
    trainer.fit(model, loader)
    if validated is not None:
        record.held["validation_loss"] = validated[0]["val/loss"]
    record.held["schedule"] = strategy.pipeline.describe() if strategy.pipeline is not None else None
    return record


def refused(name: str, root: Path) -> list[str]:
    """Every rank's error of a fit of ``REFUSALS[name]`` under pp2 x ep2 (see :func:`every_ranks_error`)."""
    args = dict(REFUSALS[name][0])
    model = GPTLightningModule(preset="tiny", n_layers=LAYERS) if args.pop("dense", False) else \
        MoEGPTLightningModule(preset="tiny", n_layers=LAYERS, **args)
    data = sequences(PER_RANK * 2)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=1, logger=False,
                         strategy=PipelineStrategy(pp=2, ep=2, n_microbatches=PER_RANK, heartbeat_timeout=None),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root / name)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=PER_RANK)
    return every_ranks_error(lambda: trainer.fit(model, loader))


def validation_reference(name: str, record: StageRecord, dp: int) -> float:
    """One process's loss of the initial weights on what ``trainer.validate`` with ``limit_val_batches=2`` saw: the
    first 2 batches of each of the ``dp`` replicas (Lightning's sampler deals the samples round the replicas), so the
    dataset's first ``2 x dp x PER_RANK`` sequences, each of equal weight in the mean of the batches' means."""
    model = MoEGPT(MoEGPTLightningModule(preset="tiny", **CASES[name]["module"]).config)
    model.load_state_dict({n.removeprefix("model."): t for n, t in record.initial.items()})
    data = sequences(2 * dp * PER_RANK)
    with torch.no_grad():
        return float(causal_lm_loss(model(data[:, :-1]), data[:, 1:]))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])
    names = sys.argv[2:] or [*(name for name, case in CASES.items() if case.get("world", 4) == world), *REFUSALS]
    records = {name: fit(name, out) for name in names if name in CASES}
    balanced = {name: router_pipeline_worker.fit(name, out) for name in names if name in router_pipeline_worker.CASES}
    rank, report = dist.get_rank(), {"world": dist.get_world_size()}
    report.update(router_pipeline_worker.reports(balanced, world))
    report["refused"] = {name: refused(name, out) for name in names if name in REFUSALS}
    for name, record in records.items():
        accumulate = CASES[name].get("accumulate", 1)
        losses = [sum(record.losses[i:i + accumulate]) for i in range(0, len(record.losses), accumulate)]
        report[name] = {"losses": losses, "norms": record.norms, **record.held}
        if rank == 0:
            report[name]["reference"] = reference(name, record, CASES)
            if "validation_loss" in record.held:
                dp = world // 2 // CASES[name].get("tp", 1)
                report[name]["reference"]["validation_loss"] = validation_reference(name, record, dp)
    report["rank"] = rank
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
