"""The router's load-balancing loss scopes, a capacity factor and the MoE logs under Lightning, in one torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.launch.router_worker OUT_DIR

for tests/launch/test_router.py. On 2 ranks, one ``Trainer.fit`` (plain SGD, 6 steps, the example tiny MoE GPT with
``aux_loss_coef=0.5``: the load-balancing loss weighs, the scopes differ) per case:

* ``ep2_micro_batch``, ``ep2_global``: ``ZeroStrategy(stage=0, ep=2)`` with each scope of the load-balancing loss;
* ``dp2_micro_batch``, ``dp2_global``: ``ZeroStrategy(stage=0)``, every rank holding every expert;
* ``ep2_capacity``: ep2, ``capacity_factor=1.0`` (tokens over an expert's capacity dropped), the micro-batch scope,
  with a TensorBoard logger, :class:`~lightning_par.callbacks.RouterLoad` (every 2 steps) and
  :class:`~lightning_par.callbacks.TokensPerSecond` (every 2 steps, a given peak of 1 GFLOP/s per device);
* ``ep2_global_accumulate``, ``ep2_micro_batch_accumulate``: ep2 over 2 accumulated micro-batches per step (each
  micro-batch's loss its own: the global scope sums the ranks' statistics of the same micro-batch);
* ``cp2_ep2_global``: ``LayoutStrategy(cp=2, ep=2)`` (dp1 x cp2: each sequence split over the 2 ranks, which split
  the experts too), the global scope: the statistics of the two halves of each sequence summed.

Every rank writes ``OUT_DIR/rank{R}.json``: per case, each step's global loss (the ranks' mean) and, per step, the
(token, choice) pairs each of its routers sent to each expert and dropped. Rank 0 then trains one process from
the same initial weights on the same global batches, computing the case's semantics (``reference``): for the
micro-batch scope (and the capacity), the mean over the ranks' chunks of each chunk's loss (each chunk routed, capped
and balanced alone); for the global scope, the loss of the whole global batch -- of each micro-batch, the mean over
the accumulated ones. It also adds the first step's loss of
the OTHER scope (``other_scope_first_loss``: the scopes must differ by more than the parity's tolerance) and the
TensorBoard scalars of the logged case.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import LayoutStrategy, ZeroStrategy
from lightning_par.callbacks import RouterLoad, TokensPerSecond
from lightning_par.examples.gpt import causal_lm_loss
from lightning_par.examples.moe import MoEFeedForward, MoEGPT, MoEGPTLightningModule
from lightning_par.parallel.router import SumOverRanks
from tests.harness import close_process_group
from tests.launch.expert_parallel_worker import sequences

PER_RANK, STEPS, LR, COEF, PEAK = 4, 6, 0.2, 0.5, 1e9  # COEF: the load-balancing loss weighs (the scopes differ)
CASES = {
    "ep2_micro_batch": dict(ep=2, scope="micro_batch"),
    "ep2_global": dict(ep=2, scope="global"),
    "dp2_micro_batch": dict(ep=1, scope="micro_batch"),
    "dp2_global": dict(ep=1, scope="global"),
    "ep2_capacity": dict(ep=2, scope="micro_batch", capacity_factor=1.0, logs=True),
    "ep2_global_accumulate": dict(ep=2, scope="global", accumulate=2),
    "ep2_micro_batch_accumulate": dict(ep=2, scope="micro_batch", accumulate=2),
    "cp2_ep2_global": dict(ep=2, scope="global", cp=2),
}


def _layers(module: torch.nn.Module) -> list[MoEFeedForward]:
    return [m for m in module.modules() if isinstance(m, MoEFeedForward)]


def _routed(module: torch.nn.Module) -> tuple[list[list[int]], list[int]]:
    """Each layer's routed pairs per expert so far, and its dropped pairs."""
    layers = _layers(module)
    return ([[0] * m.num_experts if m.tokens_per_expert is None else m.tokens_per_expert.tolist() for m in layers],
            [m.dropped_tokens for m in layers])


class Record(pl.Callback):
    """The initial full weights, each step's global batch and loss, this rank's routed and dropped pairs per step."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.routed: list[list[list[int]]] = []
        self.dropped: list[list[int]] = []
        self._before: tuple[list[list[int]], list[int]] = ([], [])

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                        for n, p in pl_module.named_parameters()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        inputs, targets = batch
        both = torch.cat([inputs, targets[:, -1:]], dim=1)
        group = trainer.strategy.device_mesh["dp"].get_group()  # (the cp ranks of a replica share its batch)
        gathered = [torch.empty_like(both) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, both, group=group)
        self.batches.append(torch.cat(gathered))
        self._before = _routed(pl_module)  # (RouterLoad resets the counts after a logged step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        self.losses.append(float(loss) / dist.get_world_size())
        (before, dropped_before), (after, dropped_after) = self._before, _routed(pl_module)
        self.routed.append([[a - b for a, b in zip(la, lb, strict=True)] for la, lb in zip(after, before, strict=True)])
        self.dropped.append([a - b for a, b in zip(dropped_after, dropped_before, strict=True)])


def _module(case: dict, scope: str | None = None) -> MoEGPTLightningModule:
    return MoEGPTLightningModule(preset="tiny", optimizer="sgd", lr=LR, aux_loss_coef=COEF,
                                 aux_loss_scope=scope or case["scope"], capacity_factor=case.get("capacity_factor"))


def fit(name: str, root: Path) -> Record:
    case, world = CASES[name], int(os.environ["WORLD_SIZE"])
    accumulate, cp = case.get("accumulate", 1), case.get("cp", 1)
    pl.seed_everything(1234)
    data = sequences(PER_RANK * world // cp * STEPS)
    # shuffled (as Lightning shuffled every training loader before lightning-par kept sequential ones in order): the
    # data the sanity bounds below the parity were measured on; the reference reads the batches the fit saw
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=PER_RANK // accumulate, shuffle=True)
    record = Record()
    callbacks = [record]
    logger = False
    if case.get("logs"):
        callbacks += [RouterLoad(every=2), TokensPerSecond(window=2, peak_flops=PEAK)]
        logger = TensorBoardLogger(root / "tb", name=name, version=0)
    strategy = ZeroStrategy(stage=0, ep=case["ep"]) if cp == 1 else LayoutStrategy(cp=cp, ep=case["ep"])
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, accumulate_grad_batches=accumulate,
                         max_steps=STEPS, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root / name, callbacks=callbacks,
                         log_every_n_steps=1)
    trainer.fit(_module(case), loader)
    return record


def _model(case: dict, record: Record, scope: str) -> MoEGPT:
    model = MoEGPT(_module(case, scope).config)
    model.load_state_dict({n.removeprefix("model."): t for n, t in record.initial.items()})
    for layer in _layers(model):
        layer.router_statistics = SumOverRanks(None, 1)  # this process's tokens are the global batch
    return model


def _one_process(case: dict, record: Record, scope: str, steps: int) -> dict:
    """One process from the fit's initial weights over its global batches, with ``scope``'s semantics."""
    model = _model(case, record, scope)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ranks, accumulate = dist.get_world_size() // case.get("cp", 1), case.get("accumulate", 1)
    losses, routed, dropped = [], [], []
    for step in range(min(steps, len(record.batches) // accumulate)):
        before = _routed(model)
        # the micro-batch scope (and a capacity) act on each rank's chunk alone; the global scope on the whole global
        # micro-batch (the ranks' micro-batches of the same index)
        chunks = [chunk for batch in record.batches[step * accumulate:(step + 1) * accumulate]
                  for chunk in (batch.chunk(ranks) if scope == "micro_batch" else [batch])]
        loss = torch.stack([causal_lm_loss(model(c[:, :-1]), c[:, 1:]) + model.aux_loss() for c in chunks]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        after = _routed(model)
        routed.append([[a - b for a, b in zip(la, lb, strict=True)] for la, lb in zip(after[0], before[0],
                                                                                       strict=True)])
        dropped.append([a - b for a, b in zip(after[1], before[1], strict=True)])
    return {"losses": losses, "routed": routed, "dropped": dropped}


@torch.no_grad()
def _cp_shards_first_loss(case: dict, record: Record) -> float:
    """The first step's loss under cp with each rank's load-balancing loss over its own tokens (the micro-batch
    scope): rank r of cp holds chunks r and 2 cp - 1 - r of each sequence; the whole sequence's language-model loss
    plus the ranks' mean of the routers' losses over their tokens."""
    model, cp = _model(case, record, "global"), case["cp"]
    inputs = {}
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m, args[0]))
             for layer in _layers(model)]
    batch = record.batches[0]
    loss = causal_lm_loss(model(batch[:, :-1]), batch[:, 1:])
    for hook in hooks:
        hook.remove()
    chunk = (batch.shape[1] - 1) // (2 * cp)
    shares = []
    for r in range(cp):
        held = [*range(r * chunk, (r + 1) * chunk), *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
        aux = 0.0
        for layer, x in inputs.items():
            tokens = x[:, held].reshape(-1, x.shape[-1])
            chosen, _, probs = layer.route(tokens)
            aux += COEF * layer._load_balancing_loss(torch.bincount(chosen.flatten(), minlength=layer.num_experts),
                                                     probs)
        shares.append(aux)
    return float(loss + sum(shares) / cp)


def reference(name: str, record: Record) -> dict:
    case = CASES[name]
    out = _one_process(case, record, case["scope"], len(record.batches))
    other = "global" if case["scope"] == "micro_batch" else "micro_batch"
    out["other_scope_first_loss"] = _cp_shards_first_loss(case, record) if case.get("cp") else \
        _one_process(case, record, other, 1)["losses"][0]
    return out


def _per_step(per_batch: list[list], accumulate: int) -> list[list]:
    """Counts per micro-batch summed per optimizer step."""
    steps = [per_batch[i:i + accumulate] for i in range(0, len(per_batch), accumulate)]
    return [[_add(*items) for items in zip(*step, strict=True)] for step in steps]


def _add(*items):
    return [_add(*inner) for inner in zip(*items, strict=True)] if isinstance(items[0], list) else sum(items)


def scalars(root: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for event_file in sorted(root.glob("tb/**/events.out.tfevents.*")):
        acc = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    records = {name: fit(name, out) for name in CASES}
    rank, report = dist.get_rank(), {"world": dist.get_world_size()}
    for name, record in records.items():
        # each step's loss: the sum of its micro-batches' (Lightning divides each by the accumulated batches)
        accumulate = CASES[name].get("accumulate", 1)
        losses = [sum(record.losses[i:i + accumulate]) for i in range(0, len(record.losses), accumulate)]
        report[name] = {"losses": losses, "routed": _per_step(record.routed, accumulate),
                        "dropped": _per_step(record.dropped, accumulate)}
        if rank == 0:
            report[name]["reference"] = reference(name, record)
    if rank == 0:
        report["scalars"] = {tag: {str(step): value for step, value in by_step.items()}
                             for tag, by_step in scalars(out).items()}
    report["rank"] = rank
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
