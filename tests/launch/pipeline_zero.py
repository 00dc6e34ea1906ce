"""ZeRO-3 (FSDP2) and tensor parallel inside pipeline stages, at the parallel level (no Lightning), on 4 ranks.

Run under torchrun on 4 ranks (``tests.harness.launch_matrix``); ``tests/launch/test_pipeline_zero.py`` reads the JSON
it writes. Each case builds the example GPT on every rank with the same seed, splits it
(:func:`~lightning_par.parallel.parts.split`), transforms the stages the way the engine does, and runs them with
:class:`~lightning_par.parallel.pipeline.runtime.PipelineRuntime`:

* ``zero3_*``: pp=2 x dp=2, :func:`~lightning_par.parallel.zero.fully_shard_parts` (FSDP2 per block and
  per stage module); the collectives of every step are counted with :class:`~lightning_par.measure.CommCounter`;
* ``tp2_*``: pp=2 x tp=2, :func:`~lightning_par.parallel.tensor_parallel.apply_tensor_parallel` on the rank module
  (``stage=True``: the model's plan, its patterns for other ranks' units skipped); the schedule runs inside the
  plan's ``loss_context()`` (vocabulary-parallel cross-entropy on the last stage).

Every case trains 20 fp32 steps (plain SGD unless named otherwise: no momentum, no clipping) and evaluates with
``forward_only``; rank 0 trains the single-process reference on the same batches and writes both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_par.examples.gpt import GPT, GPTConfig, causal_lm_loss
from lightning_par.measure import CommCounter
from lightning_par.parallel.blocks import find_blocks
from lightning_par.parallel.parts import agreed, split
from lightning_par.parallel.pipeline.fsdp import fsdp_group_count
from lightning_par.parallel.pipeline.runtime import PipelineRuntime, resolve_schedule
from lightning_par.parallel.tensor_parallel import apply_tensor_parallel
from lightning_par.parallel.zero import fully_shard_parts
from tests.harness import close_process_group

SEED = 1234
STEPS = 20
BATCH = 8
SEQ = 32
N_LAYERS = 4
MICROBATCHES = 4
COUNTED_STEP = 3  # 1-based: the first step also infers the stages' shapes with a real forward and backward


@dataclass
class Case:
    schedule: str
    mode: str  # "zero3" (pp2 x dp2) or "tp" (pp2 x tp2)
    optimizer: str = "sgd"
    tied: bool = False
    accumulate: int = 1  # batches per optimizer step (each half the global batch)
    reshard_after_forward: bool = False
    sequence_parallel: bool = False
    microbatches: int = MICROBATCHES
    n_layers: int = N_LAYERS
    steps: int = STEPS


# DTensor operations cost several times more on CPU than plain ones: the tensor-parallel cases use 2 micro-batches
TP = dict(mode="tp", microbatches=2)
CASES: dict[str, Case] = {
    "zero3_1f1b": Case("1f1b", "zero3"),
    "zero3_interleaved_1f1b": Case("interleaved_1f1b", "zero3"),
    "zero3_zbv": Case("zbv", "zero3"),
    "zero3_1f1b_adamw": Case("1f1b", "zero3", optimizer="adamw"),
    "zero3_1f1b_tied": Case("1f1b", "zero3", tied=True),
    "zero3_1f1b_accumulate": Case("1f1b", "zero3", accumulate=2, microbatches=2),
    # torch's default, for comparison: freed after each forward, gathered again (collectives counted, 4 steps)
    "zero3_1f1b_reshard": Case("1f1b", "zero3", reshard_after_forward=True, steps=4),
    # zbv needs the gathered weights from forward to the weight gradients: the runtime keeps them (asked or not)
    "zero3_zbv_reshard": Case("zbv", "zero3", reshard_after_forward=True, steps=4),
    "zero3_zbv_tied": Case("zbv", "zero3", tied=True),  # refused: one parameter in two stages of rank 0
    "tp2_1f1b": Case("1f1b", **TP),
    "tp2_interleaved_1f1b": Case("interleaved_1f1b", **TP),
    "tp2_zbv": Case("zbv", **TP),
    "tp2_sp_1f1b": Case("1f1b", sequence_parallel=True, **TP),
}


def make_config(case: Case) -> GPTConfig:
    return GPTConfig.from_preset("tiny", n_layers=case.n_layers, tie_embeddings=case.tied)


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable sequences: each token a fixed function of the one before, from a random start."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(n):
        tokens = [torch.randint(0, 256, (BATCH,), generator=g)]
        for _ in range(SEQ):
            tokens.append((tokens[-1] * 5 + 3) % 256)
        tokens = torch.stack(tokens, dim=1)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def reference_key(case: Case) -> tuple:
    """What the single-process reference depends on (accumulation and the schedule do not change its math)."""
    return (case.optimizer, case.tied, case.n_layers, case.steps)


def reference(key: tuple, batches, eval_batch) -> dict:
    """One process: the whole model, the whole batch, the same seed and optimizer."""
    optimizer_name, tied, n_layers, steps = key
    torch.manual_seed(SEED)
    model = GPT(make_config(Case("", "", optimizer_name, tied=tied, n_layers=n_layers)))
    optimizer = make_optimizer(optimizer_name, model.parameters())
    losses = []
    for x, y in batches[:steps]:
        optimizer.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = causal_lm_loss(model(eval_batch[0]), eval_batch[1]).item()
    return {"losses": losses, "eval_loss": eval_loss}


def run_case(name: str, case: Case, batches, eval_batch) -> dict:
    rank = dist.get_rank()
    if case.mode == "zero3":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        dp_rank, dp = mesh["dp"].get_local_rank(), 2
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        dp_rank, dp = 0, 1
    torch.manual_seed(SEED)
    model = GPT(make_config(case))
    blocks = find_blocks(model)
    choice = resolve_schedule(case.schedule, 2, case.microbatches)
    tp_plan = []
    sent_shapes: dict[int, list[int]] = {}  # index of the stage on this rank -> shape of its first output

    def prepare(rank_module, stage_modules):
        """What the engine's parallelize does to the parts, written out: tensor parallel, or FSDP2 of the stages."""
        for index, module in enumerate(stage_modules):
            def record(_module, _args, out, index=index) -> None:
                sent_shapes.setdefault(index, list(out.shape))

            module.register_forward_hook(record)
        if case.tied and mesh["pp"].get_local_rank() == 1 and rank_module.head is not None:
            with torch.no_grad():  # the copy on pipeline rank 1: make_tied_copies_equal (after sharding) undoes this
                rank_module.head.weight.add_(1.0)
        if case.mode == "tp":
            # the plan of the whole model, its patterns for units of other ranks skipped (stage=True)
            tp_plan.append(apply_tensor_parallel(rank_module, mesh["tp"], case.sequence_parallel, stage=True))
            return stage_modules
        return fully_shard_parts(model_parts, mesh["dp"], reshard_after_forward=case.reshard_after_forward)

    scale = 1.0 / (case.microbatches * case.accumulate)
    try:
        model_parts = split(model, choice, mesh["pp"], units=list(blocks.units))
        # as the engine runs it: a failure on one pipeline rank is raised on every one
        with agreed(mesh["pp"].get_group(), "prepare its stages"):
            model_parts.stages = prepare(model_parts.pipeline.module, model_parts.stages)
        runtime = PipelineRuntime(model_parts, mesh["pp"], causal_lm_loss, loss_scale=scale, device=torch.device("cpu"))
    except Exception as err:  # noqa: BLE001 -- a refused layout: the message is what the test reads
        return {"error": f"{type(err).__name__}: {err}"}
    runtime.make_tied_copies_equal()
    runtime.module.forward = runtime.forward_only  # what the engine installs: calls go through the pipeline
    optimizer = make_optimizer(case.optimizer, runtime.module.parameters())
    loss_context = tp_plan[0].loss_context if tp_plan else contextlib.nullcontext
    counter = CommCounter(enabled=False).install()
    losses, counts = [], []
    start = time.perf_counter()
    try:
        for step, (x, y) in enumerate(batches[:case.steps]):
            counter.reset()
            counter.resume()
            optimizer.zero_grad(set_to_none=True)
            lo, hi = dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp
            parts = list(zip(x[lo:hi].chunk(case.accumulate), y[lo:hi].chunk(case.accumulate), strict=True))
            total = 0.0
            for i, (px, py) in enumerate(parts):
                runtime.require_sync = i == len(parts) - 1
                with loss_context():
                    total += runtime.train_step(px, py).item() / len(parts)
            runtime.sum_tied_gradients()
            optimizer.step()
            counter.pause()
            counts.append(counter.calls())
            # the loss of the step, averaged over the replicas (each saw its share of the batch)
            value = torch.tensor(total)
            if dp > 1:
                dist.all_reduce(value, group=mesh["dp"].get_group())
            losses.append(value.item() / dp)
            if step == 0:
                first_step_seconds = time.perf_counter() - start
        seconds = time.perf_counter() - start
        counter.reset()
        counter.resume()
        with loss_context():
            eval_loss = runtime.forward_only(eval_batch[0], eval_batch[1]).item()
        counter.pause()
        eval_counts = counter.calls()
        with torch.no_grad():  # another shape, through the rank module (sequence parallel pads it there)
            logits = runtime.module(eval_batch[0][:2, :7])
    finally:
        counter.uninstall()
    stage_groups = fsdp_group_count(runtime.stage_modules, blocks.blocks)
    out = {"losses": losses, "eval_loss": eval_loss, "counts": counts, "eval_counts": eval_counts,
           "fsdp_groups": stage_groups, "stage_ids": runtime.stage_ids,
           "units": [runtime.units_by_stage[i] for i in runtime.stage_ids],
           "logits_shape": list(logits.shape), "seconds": seconds, "first_step_seconds": first_step_seconds,
           "sent_shapes": {str(runtime.stage_ids[i]): v for i, v in sent_shapes.items()}, "rank": rank}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = make_batches(STEPS + 1)
    train, eval_batch = batches[:STEPS], batches[STEPS]
    # the references, one per distinct configuration, computed by the ranks side by side
    keys = sorted({reference_key(CASES[name]) for name in args.cases})
    mine = {key: reference(key, train, eval_batch) for key in keys[rank::dist.get_world_size()]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    references = {key: value for part in gathered for key, value in part.items()}
    results = {}
    for name in args.cases:
        case = CASES[name]
        start = time.perf_counter()
        result = run_case(name, case, train, eval_batch)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, result)
        entry = {"ranks": per_rank, "wall": time.perf_counter() - start}
        if "error" not in result:
            entry["reference"] = references[reference_key(case)]
        results[name] = entry
        if rank == 0:
            print(f"{name}: {entry['wall']:.1f}s", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
