"""The example MoE's load-balancing loss inside pipeline schedules, against one process, in one torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node=N -m tests.launch.router_pipeline_worker OUT_DIR \
        [CASE ...]

for tests/launch/test_router_pipeline.py. On 2 ranks (``PipelineStrategy``: pp2) or 4 (pp2 x ep2: each stage's
experts over ep2 of its two data-parallel ranks), one ``Trainer.fit`` per case of the example MoE GPT with 4 layers
(each rank holds stages of 2 of them), plain SGD, ``aux_loss_coef=0.1``, under 1F1B and ZBV (zero bubble in a V: the
backward split into input and weight passes), with the load-balancing loss's scope ``micro_batch`` or ``global``;
and on 2 ranks 1F1B over 2 accumulated Lightning batches per step (each micro-batch's loss scaled by 1 / (2 x 2)).
Each layer's loss starts its backward from the layer's output (:class:`lightning_par.parallel.router.
AuxLossInBackward`), per micro-batch; the logged loss is the micro-batches' mean of the language-model loss plus
the load-balancing losses, every stage's (the same quantity as without pp).

Every rank writes ``OUT_DIR/rank{R}.json``: per case, each step's logged loss (the ranks' mean), the pre-step global
gradient norm and the runtime's line for the log (``described``). Rank 0 trains one process from the whole model's
initial weights (gathered from every stage) on the same global batches with the same semantics -- each micro-batch's
language-model loss plus its weighted load-balancing losses, the gradient the mean over the micro-batches; a micro-
batch of the global scope is the data-parallel ranks' micro-batches of the same index together -- and adds its
losses and norms (``reference``), and those of the same process with the load-balancing loss's scale halved and
doubled (``halved``, ``doubled``: 2 steps), which the run must not match. tests/launch/expert_pipeline_worker.py
runs a case of this table in its own launch (the default set's).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import PipelineStrategy
from lightning_par.examples.gpt import causal_lm_loss
from lightning_par.examples.moe import MoEGPT, MoEGPTLightningModule
from lightning_par.parallel.expert_parallel import expert_layers
from tests.harness import close_process_group
from tests.launch.expert_parallel_worker import PER_RANK, Record, sequences

STEPS, LAYERS, COEF = 4, 4, 0.1
CASES = {  # schedule, scope, ep (pp=2; the world: 2 x ep), Lightning's accumulated batches per step
    f"pp2{'_ep2' if ep > 1 else ''}_{schedule}_{scope}": dict(schedule=schedule, scope=scope, ep=ep)
    for ep in (1, 2) for schedule in ("1f1b", "zbv") for scope in ("micro_batch", "global")
}
CASES["pp2_1f1b_micro_batch_accumulate"] = dict(schedule="1f1b", scope="micro_batch", ep=1, accumulate=2)


def module_args(name: str) -> dict:
    return dict(preset="tiny", n_layers=LAYERS, optimizer="sgd", lr=0.1, aux_loss_coef=COEF,
                aux_loss_scope=CASES[name]["scope"])


class WholeRecord(Record):
    """:class:`Record` with the initial weights of every stage, gathered (the experts over ep first)."""

    def on_train_start(self, trainer, pl_module) -> None:
        mine = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
                for n, p in pl_module.named_parameters()}
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, mine)
        self.initial = {n: t for stage in stages for n, t in stage.items()}


def fit(name: str, root: Path) -> WholeRecord:
    case, world = CASES[name], int(os.environ["WORLD_SIZE"])
    accumulate = case.get("accumulate", 1)
    pl.seed_everything(1234)
    model = MoEGPTLightningModule(**module_args(name))
    data = sequences(PER_RANK * (world // 2) * STEPS)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=PER_RANK // accumulate, shuffle=False)
    record = WholeRecord()
    strategy = PipelineStrategy(pp=2, ep=case["ep"], schedule=case["schedule"], n_microbatches=PER_RANK // accumulate)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         accumulate_grad_batches=accumulate, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root / name, callbacks=[record])
    trainer.fit(model, loader)
    record.described = strategy.pipeline.describe()
    return record


def reference(name: str, record: WholeRecord, dp: int, scale: float = 1.0, steps: int = STEPS) -> dict:
    """One process on the ranks' global batches: per step, each micro-batch's language-model loss plus ``scale``
    times its layers' weighted load-balancing losses, backpropagated over the number of micro-batches (times the
    accumulated batches); the step's loss is the micro-batches' mean of it."""
    model = MoEGPT(MoEGPTLightningModule(**module_args(name)).config)
    model.load_state_dict({n.removeprefix("model."): t for n, t in record.initial.items()})
    for layer in expert_layers(model).values():  # this process's micro-batch is the global one
        layer.router_statistics = lambda stats: stats
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulate = CASES[name].get("accumulate", 1)
    rows_per_rank = PER_RANK // accumulate  # a Lightning batch of a rank: one row per micro-batch
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for batch in record.batches[step * accumulate:(step + 1) * accumulate]:
            rows = batch.view(dp, rows_per_rank, -1)  # rank r's micro-batch i is row r * rows_per_rank + i
            if CASES[name]["scope"] == "global":  # micro-batch i: every data-parallel rank's i-th together
                micro = [rows[:, i] for i in range(rows_per_rank)]
            else:  # each rank's own
                micro = [rows[r, i:i + 1] for r in range(dp) for i in range(rows_per_rank)]
            for chunk in micro:
                loss = causal_lm_loss(model(chunk[:, :-1]), chunk[:, 1:]) + scale * model.aux_loss()
                (loss / (len(micro) * accumulate)).backward()
                total += loss.item() / (len(micro) * accumulate)
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms}


def reports(records: dict[str, WholeRecord], world: int) -> dict[str, dict]:
    """Each case's report of this rank (on rank 0 with the one-process runs)."""
    out = {}
    for name, record in records.items():
        # each step's loss: the sum of its batches' (Lightning divides each by the accumulated batches)
        accumulate = CASES[name].get("accumulate", 1)
        losses = [sum(record.losses[i:i + accumulate]) for i in range(0, len(record.losses), accumulate)]
        out[name] = {"losses": losses, "norms": record.norms, "described": record.described}
        if dist.get_rank() == 0:
            dp = world // 2
            out[name]["reference"] = reference(name, record, dp)
            out[name]["halved"] = reference(name, record, dp, scale=0.5, steps=2)
            out[name]["doubled"] = reference(name, record, dp, scale=2.0, steps=2)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])
    names = sys.argv[2:] or [name for name, case in CASES.items() if 2 * case["ep"] == world]
    records = {name: fit(name, out) for name in names}
    report = {"world": world, "rank": dist.get_rank(), **reports(records, world)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
