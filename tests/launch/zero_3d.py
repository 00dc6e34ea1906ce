"""ZeRO-1/2 with tensor parallel and with pipeline-style gradient accumulation, without Lightning, on 4 gloo ranks.

    python -m torch.distributed.run --standalone --nproc_per_node=4 -m tests.launch.zero_3d OUT_DIR

for tests/launch/test_zero_3d.py. Every rank writes ``OUT_DIR/rank{N}.json``:

* ``tp``: dp2 x tp2 (mesh ``(dp, tp)``), the tiny GPT (4 blocks, tp plan applied, then
  :class:`~lightning_par.parallel.zero.ZeroPartitioner` over dp), ZeRO-1 and ZeRO-2 x plain SGD and AdamW, 20
  fp32 steps: per-step loss against one process training on the same global batches (computed on rank 0 and
  broadcast), the pre-step global gradient norm (from the shards' DTensor placements), the bytes held per rank
  after step 3 (``measure.state_bytes``), and the collectives of step 3 (``measure.CommCounter``);
* ``accumulate``: dp2 x tp2, ZeRO-1 and ZeRO-2, AdamW, 5 steps of what a pipeline does under Lightning's gradient
  accumulation: 2 batches per optimizer step, each run as 2 micro-batch backwards with ``defer_reduction``;
  ``require_sync`` False on the first batch, ``finish_gradient_sync()`` after each batch. Collectives counted per
  batch; parity with one process. ``toggle``: the same with ``require_sync`` False during the micro-batches and
  True just before ``finish_gradient_sync()`` (no ``defer_reduction``);
* ``pp_tied``: a real pipeline (``PipelineRuntime``, 1F1B, pp2 x dp2) of the tiny GPT with tied embeddings (the
  embedding on the first stage, its copy as the head on the last), ZeRO-1 and ZeRO-2 with ``defer_reduction``,
  the tied copies' gradients summed over pp before the dp reduce-scatter, 10 AdamW steps: parity, copies equal;
* ``errors``: a second micro-batch backward with buckets reduced in backward is refused, not silently lost;
* ``checkpoint``: dp2 x tp2 ZeRO-2 AdamW saved after 3 steps with ``plugins.sharded_checkpoint`` (DCP), loaded into
  a differently initialised model: the next 3 losses equal those of the run that went on. The shards being DTensors
  on the (dp, tp) mesh is what keeps the two tp ranks' optimizer states apart in the checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_par.examples.gpt import GPT, GPTConfig, causal_lm_loss
from lightning_par.measure import CommCounter, local_numel, state_bytes
from lightning_par.parallel.grad_norm import global_grad_norm
from lightning_par.parallel.tensor_parallel import apply_tensor_parallel
from lightning_par.parallel.zero import ZeroPartitioner
from tests.harness import close_process_group

LAYERS = 4
SEQ = 32
BATCH = 8  # global batch: 4 samples per data-parallel rank
STEPS = 20
ACC_STEPS = 2
PP_STEPS = 10
BUCKET_MB = 0.25  # several buckets of each kind in the tiny model
MEASURED = 3  # state bytes and collectives of this step (1-based)
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.2),  # plain: no momentum, no weight decay
              "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1)}


def config(tied: bool = False) -> GPTConfig:
    return GPTConfig.from_preset("tiny", n_layers=LAYERS, tie_embeddings=tied)


def batches(n: int) -> torch.Tensor:
    """``n`` global batches of byte sequences from the embedded corpus (the Python standard library's sources), in
    order: text, so the model trains and the gradient norm is not rounding noise."""
    from lightning_par.data import default_corpus_files

    raw = b"".join(Path(f).read_bytes() for f in default_corpus_files(n * BATCH * (SEQ + 1)))
    tokens = torch.frombuffer(bytearray(raw[:n * BATCH * (SEQ + 1)]), dtype=torch.uint8).long()
    return tokens.view(n, BATCH, SEQ + 1)


def make_model(tied: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(config(tied))


# -- the single process --------------------------------------------------------------------------------------------
def reference(optimizer_name: str, data: torch.Tensor, tied: bool = False) -> dict:
    """One process, whole global batches: per-step loss and pre-step gradient norm."""
    model = make_model(tied)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    losses, norms = [], []
    for batch in data:
        optimizer.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def on_rank0(fn, *args, **kwargs):
    """Run ``fn`` on rank 0 only (the other ranks wait) and give its result to every rank."""
    holder = [fn(*args, **kwargs) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


# -- dp x tp -------------------------------------------------------------------------------------------------------
def tp_model(mesh: DeviceMesh):
    model = make_model()
    plan = apply_tensor_parallel(model, mesh["tp"])
    return model, plan


def local_batch(batch: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    per = BATCH // dp
    return batch[dp_rank * per:(dp_rank + 1) * per]


def mean_over_dp(loss: torch.Tensor, mesh: DeviceMesh) -> float:
    value = loss.detach().clone()
    dist.all_reduce(value, group=mesh["dp"].get_group())
    return value.item() / mesh["dp"].size()


def tp_case(mesh: DeviceMesh, stage: int, optimizer_name: str, data: torch.Tensor) -> dict:
    model, plan = tp_model(mesh)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    partitioner = ZeroPartitioner(model, [optimizer], mesh["dp"], stage, BUCKET_MB)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses, norms, out = [], [], {}
    counter = CommCounter(enabled=False).install()
    start = time.perf_counter()
    try:
        for step, batch in enumerate(data, start=1):
            tokens = local_batch(batch, dp_rank, dp)
            optimizer.zero_grad(set_to_none=True)
            counter.enabled = step == MEASURED  # this step's reduce-scatters and all-gathers (not the norm's sums)
            with plan.loss_context():
                loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
            partitioner.finish_gradient_sync()
            counter.pause()
            norms.append(float(global_grad_norm(partitioner.norm_grads())))
            counter.enabled = step == MEASURED
            optimizer.step()
            partitioner.gather_parameters()
            counter.pause()
            losses.append(mean_over_dp(loss, mesh))
            if step == MEASURED:
                out["bytes"] = {k: v for k, v in state_bytes(model, [optimizer]).items() if k != "by_device"}
                out["calls"] = counter.calls()
                out["sent"] = counter.sent_elements()
    finally:
        counter.uninstall()
    out.update(
        losses=losses, norms=norms, seconds=time.perf_counter() - start,
        buckets=len(partitioner.buckets),
        kinds=[b.kind for b in partitioner.buckets],
        norm_groups=[flag for _, flag in partitioner.norm_groups()],
        bucket_numel=sum(b.flat.numel() for b in partitioner.buckets),
        local_numel=local_numel(model), numel=sum(p.numel() for p in model.parameters()),
        dtensor_params=all(isinstance(p, DTensor) for p in model.parameters()),
        params_in_buckets=all(
            p._local_tensor.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
            for b in partitioner.buckets for p in b.params),
        shard_meshes=sorted({str(b.shard.device_mesh.mesh_dim_names) + str(b.shard.placements)
                             for b in partitioner.buckets}),
    )
    partitioner.remove()
    return out


def accumulate_case(mesh: DeviceMesh, stage: int, data: torch.Tensor, defer: bool) -> dict:
    """Each optimizer step: 2 Lightning batches (the first with require_sync False), each of 2 micro-batch
    backwards, as a pipeline schedule runs them; ``finish_gradient_sync()`` after each batch, as the engine calls
    it. ``defer``: ``defer_reduction=True``; else ``require_sync`` is lowered during the micro-batches instead."""
    model, plan = tp_model(mesh)
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    partitioner = ZeroPartitioner(model, [optimizer], mesh["dp"], stage, BUCKET_MB, defer_reduction=defer)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses, per_batch_calls = [], []
    with CommCounter() as counter:
        for batch in data:
            tokens = local_batch(batch, dp_rank, dp)  # 4 samples: 2 batches x 2 micro-batches of 1
            optimizer.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for half in range(2):
                last_batch = half == 1
                counter.reset()
                partitioner.require_sync = last_batch if defer else False  # Lightning's block_backward_sync
                for micro in range(2):
                    sample = tokens[2 * half + micro:2 * half + micro + 1]
                    with plan.loss_context():
                        loss = causal_lm_loss(model(sample[:, :-1]), sample[:, 1:]) / 4
                        loss.backward()
                    total += loss.detach()
                during = counter.calls()
                if not defer:
                    partitioner.require_sync = last_batch
                partitioner.finish_gradient_sync()
                per_batch_calls.append({"during_backward": during, "with_finish": counter.calls()})
            optimizer.step()
            partitioner.gather_parameters()
            losses.append(mean_over_dp(total, mesh))
    out = {"losses": losses, "calls": per_batch_calls, "buckets": len(partitioner.buckets)}
    partitioner.remove()
    return out


def second_backward_is_refused(mesh: DeviceMesh) -> str:
    model, plan = tp_model(mesh)
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    partitioner = ZeroPartitioner(model, [optimizer], mesh["dp"], 1, BUCKET_MB)
    tokens = local_batch(batches(1)[0], mesh["dp"].get_local_rank(), mesh["dp"].size())
    message = "no error"
    try:
        for _ in range(2):
            with plan.loss_context():
                causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    except RuntimeError as err:
        message = str(err)
    for bucket in partitioner.buckets:  # what the first backward launched: let it finish on every rank
        if bucket.work is not None:
            bucket.work.wait()
    partitioner.remove()
    return message


def checkpoint_case(mesh: DeviceMesh, data: torch.Tensor, path: Path) -> dict:
    from lightning_par.parallel import zero_state
    from lightning_par.plugins import sharded_checkpoint

    def build(seed: int):
        torch.manual_seed(seed)
        model = GPT(config())
        plan = apply_tensor_parallel(model, mesh["tp"])
        optimizer = OPTIMIZERS["adamw"](model.parameters())
        return model, plan, optimizer, ZeroPartitioner(model, [optimizer], mesh["dp"], 2, BUCKET_MB)

    def step(model, plan, optimizer, partitioner, batch) -> float:
        tokens = local_batch(batch, mesh["dp"].get_local_rank(), mesh["dp"].size())
        optimizer.zero_grad(set_to_none=True)
        with plan.loss_context():
            loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        partitioner.finish_gradient_sync()
        optimizer.step()
        partitioner.gather_parameters()
        return mean_over_dp(loss, mesh)

    first = build(0)
    for batch in data[:3]:
        step(*first, batch)
    model, _, optimizer, _ = first
    states = [zero_state.optimizer_state(model, optimizer, first[3])]
    sharded_checkpoint.save({"state_dict": model.state_dict(), "optimizer_states": states}, path,
                            is_writer=dist.get_rank() == 0, barrier=dist.barrier)
    continued = [step(*first, batch) for batch in data[3:6]]
    second = build(1)
    sharded_checkpoint.load(path, second[0], [second[2]], states=zero_state.ZeroStates(second[3]))
    resumed = [step(*second, batch) for batch in data[3:6]]
    return {"continued": continued, "resumed": resumed}


# -- a real pipeline with tied copies ------------------------------------------------------------------------------
def pipeline_case(mesh: DeviceMesh, stage: int, data: torch.Tensor) -> dict:
    from lightning_par.parallel.parts import split
    from lightning_par.parallel.pipeline.runtime import PipelineRuntime, resolve_schedule

    model = make_model(tied=True)
    microbatches = 4
    choice = resolve_schedule("1f1b", mesh["pp"].size(), microbatches)
    runtime = PipelineRuntime(split(model, choice, mesh["pp"]), mesh["pp"], causal_lm_loss,
                              loss_scale=1.0 / microbatches, device=torch.device("cpu"))
    optimizer = OPTIMIZERS["adamw"](runtime.module.parameters())
    partitioner = ZeroPartitioner(runtime.module, [optimizer], mesh["dp"], stage, BUCKET_MB, defer_reduction=True)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses, norms, reduce_scatters = [], [], []
    with CommCounter() as counter:
        for batch in data:
            tokens = local_batch(batch, dp_rank, dp)
            optimizer.zero_grad(set_to_none=True)
            loss = runtime.train_step(tokens[:, :-1], tokens[:, 1:])
            counter.reset()
            # ZeRO-1/2: the tied copies' gradients summed over pp FIRST (finish moves every param.grad into the
            # buckets), then the dp reduce-scatter
            runtime.sum_tied_gradients()
            partitioner.finish_gradient_sync()
            reduce_scatters.append(counter.calls()["reduce_scatter"])
            grads = partitioner.norm_grads(exclude=runtime.counted_elsewhere())
            norms.append(float(global_grad_norm(grads, runtime.group)))
            optimizer.step()
            partitioner.gather_parameters()
            losses.append(mean_over_dp(loss, mesh))
    tied = {n: p for n, p in runtime.module.named_parameters() if n in ("embed.weight", "head.weight")}
    (name, copy), = tied.items()
    copies = [None] * dist.get_world_size()
    dist.all_gather_object(copies, (mesh["pp"].get_local_rank(), name, copy.detach().clone()))
    mine = [c for c in copies if c[0] != mesh["pp"].get_local_rank()]
    out = {"losses": losses, "norms": norms, "reduce_scatters": reduce_scatters, "buckets": len(partitioner.buckets),
           "tied_name": name,
           "tied_copies_max_diff": max(float((copy.detach() - c[2]).abs().max()) for c in mine)}
    partitioner.remove()
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    result: dict = {"rank": rank}
    data = batches(STEPS)

    start = time.perf_counter()
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    refs = {name: on_rank0(reference, name, data) for name in OPTIMIZERS}
    result["reference"] = refs
    result["tp"] = {f"zero{stage}_{name}": tp_case(mesh, stage, name, data)
                    for stage in (1, 2) for name in OPTIMIZERS}
    result["tp_seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    result["accumulate"] = {f"zero{stage}": accumulate_case(mesh, stage, data[:ACC_STEPS], defer=True)
                            for stage in (1, 2)}
    result["toggle"] = {"zero2": accumulate_case(mesh, 2, data[:ACC_STEPS], defer=False)}
    result["errors"] = {"second_backward": second_backward_is_refused(mesh)}
    result["checkpoint"] = checkpoint_case(mesh, data, out_dir / "ckpt")
    result["accumulate_seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    pp_mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    result["pp_reference"] = on_rank0(reference, "adamw", data[:PP_STEPS], tied=True)
    result["pp_tied"] = {f"zero{stage}": pipeline_case(pp_mesh, stage, data[:PP_STEPS]) for stage in (1, 2)}
    result["pp_seconds"] = time.perf_counter() - start

    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
