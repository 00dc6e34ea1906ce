"""bf16-mixed on 2 ranks, in one launch: model-state bytes per rank for ZeRO 0-3, and 50-step loss tracking.

Run under torchrun (``tests.harness.launch_matrix``, 2 ranks). Writes ``ROOT/precision.json`` from rank 0.

* ``state``: for each ZeRO stage, the plain LM (Psi parameters, every dimension even so nothing is padded) under the
  data-parallel owner the engine picks (``choose_gradient_sync``), given ``LayoutPrecision("bf16-mixed")``'s
  ZeRO dtypes, Adam, two steps under its autocast. At the second step (an optimizer step pre-hook, once Adam has
  its state) each rank counts the bytes of distinct storages by role -- the convention of the ZeRO paper's model
  states: parameters the model holds, gradient storage (``param.grad`` / the partitioner's buffers), a separate
  master copy, optimizer state tensors (Adam's scalar ``step`` left out). The fp32 gradient handed to a ZeRO-1/2
  master for the step is workspace, reported beside them.
* ``losses``: ``Trainer.fit`` for 50 steps, 32-true under ZeRO-0 and bf16-mixed under ZeRO 0-3 (AdamW), per-step
  losses from the LightningModule's step output; bf16-mixed-master under ZeRO 1-3 and 32-true, each with AdamW
  and plain SGD (``--fits``), and its state bytes (``--state bf16-mixed-master``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_par import LayoutStrategy
from lightning_par.data import TextDataModule
from lightning_par.examples import GPTLightningModule
from lightning_par.examples.plain_lm import PlainLM, PlainLMLightningModule
from lightning_par.parallel.finalize import finalize
from lightning_par.parallel.gradient_sync import choose_gradient_sync
from lightning_par.parallel.layout import Layout
from lightning_par.parallel.parallelize import ModelParts
from lightning_par.parallel.runners import SingleRunner
from lightning_par.plugins.precision import LayoutPrecision
from tests.harness import close_process_group

LOSS_STEPS = 50
FITS = {"fp32_zero0": ("32-true", 0), "bf16_zero0": ("bf16-mixed", 0), "bf16_zero1": ("bf16-mixed", 1),
        "bf16_zero2": ("bf16-mixed", 2), "bf16_zero3": ("bf16-mixed", 3)}
# bf16-mixed-master (ZeRO 1-3) and its fp32 reference, with AdamW and with plain SGD
for _opt in ("adamw", "sgd"):
    FITS[f"fp32_zero0_{_opt}"] = ("32-true", 0, _opt)
    FITS.update({f"master_zero{s}_{_opt}": ("bf16-mixed-master", s, _opt) for s in (1, 2, 3)})
# tensor and pipeline parallel on the 2 ranks (one replica: its batch is the two replicas' of the others), on the
# example GPT (it declares a tensor-parallel plan), against its fp32 run at dp=2
FITS["gpt_fp32_zero0_sgd"] = ("32-true", 0, "sgd", dict(model="gpt"))
FITS["gpt_master_tp2_zero1_sgd"] = ("bf16-mixed-master", 1, "sgd", dict(model="gpt", tp=2))
FITS["gpt_master_pp2_zero2_sgd"] = ("bf16-mixed-master", 2, "sgd", dict(model="gpt", pp=2, n_microbatches=2))


def _storage(t: Tensor) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t
    storage = local.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def count_state(module: nn.Module, optimizer: torch.optim.Optimizer, partitioner) -> dict[str, int]:
    """Bytes of distinct storages per role (a storage counted once, in the first role that holds it)."""
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "master": 0, "optimizer_states": 0, "workspace": 0}

    def add(role: str, t: Tensor | None) -> None:
        if t is None:
            return
        ptr, nbytes = _storage(t)
        if ptr not in seen:
            seen.add(ptr)
            out[role] += nbytes

    for p in module.parameters():
        add("params", p)
    for p in module.parameters():
        add("grads", p.grad)
    for t in (partitioner.gradient_buffers() if partitioner is not None else []):
        add("grads", t)
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in opt_params:
        add("master", p)  # counted only where it is not the model's own parameter storage
    for p in opt_params:
        for name, value in optimizer.state.get(p, {}).items():
            if isinstance(value, Tensor) and name != "step":
                add("optimizer_states", value)
    # the master's fp32 step gradient: a copy of the bf16 gradient storage under bf16-mixed (workspace); under
    # bf16-mixed-master the fp32 gradient buffer itself (model state)
    stored_fp32 = partitioner is not None and partitioner.grad_dtype == torch.float32
    for p in opt_params:
        add("grads" if stored_fp32 else "workspace", p.grad)
    out["total"] = out["params"] + out["grads"] + out["master"] + out["optimizer_states"]
    return out


def measure_state(stage: int, dp_mesh, precision: str = "bf16-mixed") -> dict:
    plugin = LayoutPrecision(precision, device="cpu")
    torch.manual_seed(0)
    model = PlainLM(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32)
    numel = sum(p.numel() for p in model.parameters())
    sync = choose_gradient_sync(Layout(dp=2, zero_stage=stage), dp_mesh, fitting=True,
                                precision=plugin.shard_precision(stage))
    sync.shard(ModelParts(root=model, stages=[model], blocks=[]))
    wrapped = sync.wrap(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sync.attach(model, [optimizer])
    partitioner = getattr(sync, "partitioner", None)
    report: dict = {}
    step = {"n": 0}

    def at_step(opt, args, kwargs) -> None:
        step["n"] += 1
        if step["n"] == 2:
            report.update(count_state(model, opt, partitioner))

    optimizer.register_step_pre_hook(at_step)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        tokens = torch.randint(0, 256, (2, 17), generator=g)
        with plugin.forward_context():
            logits = wrapped(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        finalize(sync, SingleRunner())
        optimizer.step()
        sync.after_step()
        optimizer.zero_grad(set_to_none=True)
    policy = plugin.policy(stage)
    report.update(numel=numel, formula_from_policy=policy.state_bytes(numel, stage, 2), policy=policy.describe(),
                  param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
                  master_dtypes=sorted({str(p.dtype) for group in optimizer.param_groups for p in group["params"]}))
    sync.unwrap(wrapped)
    return report


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float().clone()
        dist.all_reduce(loss)  # the mean over the data-parallel ranks: what a single process would log
        self.values.append(loss.item() / dist.get_world_size())


def fit(cache: str, precision: str, stage: int, optimizer: str = "adamw", layout: dict | None = None) -> list[float]:
    pl.seed_everything(1234, verbose=False)
    layout = dict(layout or {})
    lr = 3e-3 if optimizer == "adamw" else 0.5
    if layout.pop("model", None) == "gpt":
        model = GPTLightningModule(preset="tiny", n_layers=2, optimizer=optimizer, lr=0.2 if optimizer == "sgd" else lr)
        # (SGD at 0.5 on this GPT swings enough that bf16 rounding grows to 5-8% by step 20)
    else:
        model = PlainLMLightningModule(dim=64, n_layers=2, max_seq_len=32, optimizer=optimizer, lr=lr)
    # Lightning's Trainer takes only its own precision flags: the others go in as the plugin
    flags = dict(plugins=[LayoutPrecision(precision)]) if precision == "bf16-mixed-master" else dict(
        precision=precision)
    batch = 16 if {"tp", "pp"} & set(layout) else 8  # per replica: 2 replicas of 8, or 1 of 16 (tp2, pp2)
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=False, batch_size=batch, cache_dir=cache)
    losses = Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LayoutStrategy(zero_stage=stage, **layout),
                         **flags, max_steps=LOSS_STEPS, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[losses], gradient_clip_val=1.0)
    trainer.fit(model, data)
    assert isinstance(trainer.strategy.precision_plugin, LayoutPrecision)
    return losses.values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--fits", nargs="*", default=list(FITS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--state", nargs="+", default=["bf16-mixed"],
                        help="the precisions of the state-bytes measurement (bf16-mixed-master: ZeRO 1-3)")
    args = parser.parse_args()
    global LOSS_STEPS
    LOSS_STEPS = args.steps
    dist.init_process_group("gloo")
    dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))["dp"]
    result: dict = {"losses": {}}
    for precision in args.state:  # "state_per_rank" (bf16-mixed), "bf16-mixed-master_state_per_rank"
        state = {f"zero{stage}": measure_state(stage, dp_mesh, precision)
                 for stage in (range(4) if precision == "bf16-mixed" else (1, 2, 3))}
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, state)
        result["state_per_rank" if precision == "bf16-mixed" else f"{precision}_state_per_rank"] = ranks
    for name in args.fits:
        result["losses"][name] = fit(args.cache, *FITS[name])
    if dist.get_rank() == 0:
        Path(args.root, "precision.json").write_text(json.dumps(result, indent=1))
    close_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
