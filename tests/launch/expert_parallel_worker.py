"""Expert parallel under Lightning, against one process, in one torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node=N -m tests.launch.expert_parallel_worker OUT_DIR

for tests/launch/test_expert_parallel.py. On N ranks (2: ep2; 4: ep2 x expert_dp2), one ``Trainer.fit`` per case of
the example MoE GPT under ``LayoutStrategy(ep=2, ...)``:

* ``sgd`` (plain SGD) and ``adamw`` (AdamW, constant learning rate, with a shared expert): the model built in
  ``configure_model``, so deferred: each rank materialises its experts only;
* ``cp2``: plain SGD under ``LayoutStrategy(cp=2, ep=2)``: each sequence split over the 2 cp ranks, which split the
  experts too (2 ranks: dp1 x cp2; 4 ranks: dp2 x cp2, each expert on 2 ranks);
* ``zero1_adamw``, ``zero2_sgd``, ``zero3_adamw``: ZeRO-1 / ZeRO-2 (optimizer state, and at stage 2 gradients,
  sharded: the other weights' over dp, the experts' over their replicas, expert_dp) and ZeRO-3 (FSDP2: the experts
  their own groups on expert_dp);
* ``tp2_zero0``, ``tp2_zero1``, ``tp2_zero2_adamw``, ``tp2_zero3_adamw``, ``tp2_zero3_sgd`` (4 ranks only): dp2 x
  tp2 under each ZeRO stage: attention, embedding and head split over tp, the experts over ep (each expert weight a
  DTensor on the (ep, tp) mesh, replicated over tp); ``tp2_sp_zero1``, ``tp2_sp_zero3_adamw`` the same with
  sequence parallel (each tp rank routes its own tokens: expert and router gradients summed over tp);
* ``zero2_offload_adamw``, ``zero3_offload_sgd`` (4 ranks only): optimizer offload, the experts' shards too;
* ``bf16_master_zero2`` (4 ranks only): bf16-mixed-master under ZeRO-2, against the same fit with ep=1
  (``bf16_master_zero2_ep1``) rather than an fp32 process;
* ``validate_then_fit``: ``trainer.validate`` first (the model laid out without a gradient owner), then the fit
  with the same Trainer (its owner chosen then must leave the experts out too);
* ``accumulate_eager``: plain SGD over 2 accumulated batches per step (expert gradients accumulate unreduced, then
  are averaged once), of a model built eagerly before the fit from another seed on each rank (the strategy makes
  the replicas equal; the experts are sliced from real tensors).

Every rank writes ``OUT_DIR/rank{R}.json``: per case, the global loss of each step (the ranks' mean), the global
gradient norm before each step (``strategy.global_grad_norm``), the bytes of expert and other parameters it
materialised and holds, of its expert gradients and optimizer state, the expert slices it holds, the gradient
owner. Rank 0 then trains one process, in this process, from the same initial weights (gathered at the start of the
fit) on the same global batches (gathered each batch) and adds its losses and norms (``reference``); the cases
compared with ep=1 take that fit's instead. A second argument (``a,b,...``) runs only those cases, to iterate.
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

from lightning_par import LayoutStrategy
from lightning_par.examples.gpt import causal_lm_loss
from lightning_par.examples.moe import MoEFeedForward, MoEGPT, MoEGPTLightningModule
from lightning_par.parallel.materialize import local_slices
from lightning_par.plugins.precision import LayoutPrecision
from tests.harness import close_process_group

SEQ, PER_RANK, STEPS = 32, 4, 6
CASES = {  # the module's arguments, and how the fit runs
    "sgd": dict(module=dict(optimizer="sgd", lr=0.2)),
    "adamw": dict(module=dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0, shared_ffn_dim=32)),
    "accumulate_eager": dict(module=dict(optimizer="sgd", lr=0.2), accumulate=2, eager=True),
    "cp2": dict(module=dict(optimizer="sgd", lr=0.2), cp=2),
    "zero1_adamw": dict(module=dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0), zero=1),
    "zero2_sgd": dict(module=dict(optimizer="sgd", lr=0.2), zero=2),
    "validate_then_fit": dict(module=dict(optimizer="sgd", lr=0.2), validate_first=True),
    "zero3_adamw": dict(module=dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0), zero=3),
    "tp2_zero1": dict(module=dict(optimizer="sgd", lr=0.2), tp=2, zero=1, world=4),
    "tp2_zero2_adamw": dict(module=dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0), tp=2, zero=2,
                            world=4),
    "tp2_zero0": dict(module=dict(optimizer="sgd", lr=0.2), tp=2, zero=0, world=4),
    "tp2_zero3_adamw": dict(module=dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0), tp=2, zero=3,
                            world=4),
    "tp2_zero3_sgd": dict(module=dict(optimizer="sgd", lr=0.2), tp=2, zero=3, world=4),
    "tp2_sp_zero1": dict(module=dict(optimizer="sgd", lr=0.2), tp=2, zero=1, sp=True, world=4),
    "tp2_sp_zero3_adamw": dict(module=dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0,
                                           shared_ffn_dim=32), tp=2, zero=3, sp=True, world=4),
    "zero2_offload_adamw": dict(module=dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0), zero=2,
                                offload=True, world=4),
    "zero3_offload_sgd": dict(module=dict(optimizer="sgd", lr=0.2), zero=3, offload=True, world=4),
    # bf16-mixed-master: the experts' fp32 masters are the expert partitioner's shards; compared with ep=1 (every
    # weight in the one partitioner over dp), not with an fp32 process
    "bf16_master_zero2": dict(module=dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0), zero=2,
                              precision="bf16-mixed-master", against="bf16_master_zero2_ep1", world=4),
    "bf16_master_zero2_ep1": dict(module=dict(optimizer="adamw", lr=3e-3, warmup_steps=0, min_lr_ratio=1.0), zero=2,
                                  precision="bf16-mixed-master", ep=1, world=4),
}


def sequences(n: int) -> torch.Tensor:
    """``n`` byte sequences of the embedded corpus (text: the model trains, the gradient norm is not noise)."""
    from lightning_par.data import default_corpus_files

    size = n * (SEQ + 1)
    raw = b"".join(Path(f).read_bytes() for f in default_corpus_files(size))
    return torch.frombuffer(bytearray(raw[:size]), dtype=torch.uint8).long().view(n, SEQ + 1)


class Record(pl.Callback):
    """The initial full weights, each step's global batch, loss and pre-step gradient norm, this rank's bytes."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.held: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.strategy.expert_mesh is None:  # ep=1: only the losses and norms, a reference
            return
        # every rank, in the same order: full_tensor() gathers an expert weight over the ep ranks
        self.initial = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                        for n, p in pl_module.named_parameters()}
        # (by name: under ZeRO-3 the other weights are DTensors too, FSDP2's shards)
        experts = {n: p for n, p in pl_module.named_parameters()
                   if n.rsplit(".", 1)[-1] in MoEFeedForward.expert_parameters}
        others = [_held(p) for n, p in pl_module.named_parameters() if n not in experts]
        rank = trainer.strategy.expert_mesh["ep"].get_local_rank()
        self.held = {
            "expert_bytes": sum(p.to_local().numel() * p.element_size() for p in experts.values()),
            "expert_bytes_total": sum(p.numel() * p.element_size() for p in experts.values()),
            "other_bytes": sum(p.numel() * p.element_size() for p in others),  # this rank's part of them
            "materialized": trainer.strategy.materialized.get("kept_bytes"),
            "ep_rank": rank,
            "ep_group": trainer.strategy.expert_mesh["ep"].mesh.tolist(),
            # each expert slice equals its piece of the full tensor (the slice one process's init drew; under ZeRO-3
            # FSDP2's shard of the rank's experts)
            "slices_match": all(torch.equal(p.to_local(), self.initial[n][local_slices(p)])
                                for n, p in experts.items()),
            "expert_names": sorted(experts),
            "gradient_sync": trainer.strategy.gradient_sync.name,
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # the whole batches of the data-parallel ranks (the cp ranks of a replica share theirs; the strategy cuts
        # each sequence inside training_step)
        inputs, targets = batch
        both = torch.cat([inputs, targets[:, -1:]], dim=1)
        group = trainer.strategy.device_mesh["dp"].get_group()
        gathered = [torch.empty_like(both) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, both, group=group)
        self.batches.append(torch.cat(gathered))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms.append(float(trainer.strategy.global_grad_norm(optimizer)))
        if "expert_grad_bytes" not in self.held and trainer.strategy.expert_mesh is not None:
            self.held["expert_grad_bytes"] = sum(t.numel() * t.element_size()
                                                 for t in _expert_grads(trainer.strategy, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        self.losses.append(float(loss) / dist.get_world_size())

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.strategy.expert_mesh is None:
            return
        # the optimizer state this rank holds for its experts (AdamW: two moments of each of its expert weights)
        experts = [p for n, p in pl_module.named_parameters() if n.rsplit(".", 1)[-1] in
                   MoEFeedForward.expert_parameters]
        # (under ZeRO-1/2 the optimizer steps the expert partitioner's shards of them instead)
        partitioner = getattr(trainer.strategy.gradient_sync, "expert_partitioner", None)
        stepped = experts if partitioner is None else [b.shard for b in partitioner.buckets]
        if partitioner is not None:  # the masters the optimizer steps, and the weights the model computes with
            self.held["expert_master"] = sorted({str(b.shard.dtype) for b in partitioner.buckets})
            self.held["expert_master_bytes"] = sum(_held(b.shard).numel() * b.shard.element_size()
                                                   for b in partitioner.buckets)
            self.held["expert_dtype"] = sorted({str(p.dtype) for p in experts})
        state = trainer.optimizers[0].state
        self.held["expert_state_bytes"] = sum(_held(t).numel() * t.element_size() for p in stepped
                                              for t in state.get(p, {}).values() if t.dim() > 0)


def _held(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _expert_grads(strategy, pl_module) -> list[torch.Tensor]:
    """The expert gradient memory this rank holds at the step: its experts' .grad, or under ZeRO-1/2 the expert
    partitioner's (stage 1: the full buckets; stage 2: the owned chunks)."""
    partitioner = getattr(strategy.gradient_sync, "expert_partitioner", None)
    if partitioner is None:
        return [_held(p.grad) for n, p in pl_module.named_parameters()
                if n.rsplit(".", 1)[-1] in MoEFeedForward.expert_parameters and p.grad is not None]
    return [b.flat_grad if b.flat_grad is not None else _held(b.shard.grad) for b in partitioner.buckets]


def fit(name: str, root: Path) -> Record:
    case, world = CASES[name], int(os.environ["WORLD_SIZE"])  # (Lightning joins the process group in fit)
    accumulate, cp, tp = case.get("accumulate", 1), case.get("cp", 1), case.get("tp", 1)
    pl.seed_everything(1234 + (int(os.environ["RANK"]) if case.get("eager") else 0))
    model = MoEGPTLightningModule(preset="tiny", **case["module"])
    if case.get("eager"):
        model.configure_model()  # built whole, here, before the strategy sees it
    data = sequences(PER_RANK * world // cp // tp * STEPS)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=PER_RANK // accumulate, shuffle=False)
    record = Record()
    zero, ep = case.get("zero", 0), case.get("ep", 2)
    strategy = LayoutStrategy(cp=cp, tp=tp, ep=ep, zero_stage=zero, sequence_parallel=case.get("sp", False),
                              offload_optimizer=case.get("offload", False))
    precision = dict(plugins=[LayoutPrecision(case["precision"])]) if "precision" in case else {}
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, **precision,
                         max_steps=STEPS, accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root / name,
                         callbacks=[record], limit_val_batches=2)
    if case.get("validate_first"):
        trainer.validate(model, loader)
    trainer.fit(model, loader)
    return record


def reference(name: str, record: Record, cases: dict | None = None) -> dict:
    """One process: the same initial weights, the ranks' global batches (an optimizer step's accumulated batches
    in one), the module's own optimizer and loss (``cases``: the table ``name`` is in, default this worker's)."""
    case = (CASES if cases is None else cases)[name]
    args, accumulate = case["module"], case.get("accumulate", 1)
    module = MoEGPTLightningModule(preset="tiny", **args)
    module.model = MoEGPT(module.config)
    module.model.load_state_dict({n.removeprefix("model."): t for n, t in record.initial.items()})
    if args["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(module.parameters(), lr=args["lr"])
    else:  # the module's groups (decay on matrices only); warmup_steps=0, min_lr_ratio=1: a constant rate
        params = list(module.parameters())
        optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                       {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                      lr=args["lr"], betas=(0.9, 0.95))
    losses, norms = [], []
    for step in range(len(record.batches) // accumulate):
        batch = torch.cat(record.batches[step * accumulate:(step + 1) * accumulate])
        loss = causal_lm_loss(module.model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters()])))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)  # (a few cases, to iterate by hand)
    records = {name: fit(name, out) for name, case in CASES.items()
               if case.get("world", world) == world and name in only}
    rank, report = dist.get_rank(), {"world": dist.get_world_size()}
    for name, record in records.items():
        # each step's loss: the sum of its batches' (Lightning divides each by the accumulated batches)
        accumulate = CASES[name].get("accumulate", 1)
        losses = [sum(record.losses[i:i + accumulate]) for i in range(0, len(record.losses), accumulate)]
        report[name] = {"losses": losses, "norms": record.norms, **record.held}
        if rank == 0 and "against" in CASES[name]:  # the same precision with ep=1 (fitted on every rank before)
            report[name]["reference"] = {"losses": records[CASES[name]["against"]].losses,
                                         "norms": records[CASES[name]["against"]].norms}
        elif rank == 0 and CASES[name].get("ep", 2) > 1:
            report[name]["reference"] = reference(name, record)
    report["rank"] = rank
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
