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
import warnings
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


# -- bf16-mixed ZeRO-1/2: what a user writes into the module reaches the fp32 masters, and fit leaves the module
# -- in its own dtype holding them
MASTER_STEPS = 6  # steps of one continuous fit; the load / the second fit happens at step MASTER_STEPS // 2


class TableLM(pl.LightningModule):
    """A tiny fp32 LM trained on a fixed table of batches, the next one at each step across fits (the loader's
    contents are ignored): two fits of it see the batches one fit of both would. Plain SGD."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = PlainLM(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        self.table = torch.randint(0, 64, (MASTER_STEPS, 4, 17), generator=g)
        self.seen = 0

    def training_step(self, batch, batch_idx):
        tokens = self.table[self.seen]
        self.seen += 1
        logits = self.model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 1)), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class WriteAt(pl.Callback):
    """At the start of step ``at`` (``"end"``: in ``on_train_end``): the module's weights become ``weights`` (fp32),
    by ``load_state_dict`` or by a direct ``p.copy_()`` under ``no_grad``."""

    def __init__(self, at: int, weights: dict[str, Tensor], how: str) -> None:
        self.at, self.weights, self.how = at, weights, how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            self.write(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.at == "end":  # after the last step (as SWA's callback writes its average)
            self.write(pl_module)

    def write(self, pl_module) -> None:
        if self.how == "load_state_dict":
            pl_module.model.load_state_dict(self.weights)
        else:
            with torch.no_grad():
                for name, p in pl_module.model.named_parameters():
                    p.copy_(self.weights[name])


def _fit_table(module: TableLM, stage: int, steps: int, callbacks=()) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LayoutStrategy(zero_stage=stage),
                         precision="bf16-mixed", max_steps=steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks))
    trainer.fit(module)
    return trainer


def _weights(trainer: pl.Trainer) -> dict[str, Tensor]:
    """What a checkpoint holds (ZeRO-1/2: the masters) after fit, in fp32."""
    state = trainer.strategy.lightning_module_state_dict()
    return {k.removeprefix("model."): v.detach().float().clone() for k, v in state.items()}


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def masters(stage: int, root: str) -> dict:
    """Per case the largest absolute weight difference from its reference (plain SGD, bf16-mixed, ZeRO ``stage``):

    * ``two_fits``: fit 3 steps, then a second Trainer fits the same module 3 more, vs one fit of 6 steps;
    * ``load_state_dict``: a callback restores the initial (fp32) weights at step 3, vs a fresh module fitted on
      batches 3-5 from them;
    * ``copy``: the same with ``p.copy_(initial + 0.25)`` under ``no_grad``, vs a fresh module from the bf16 rounding
      of those weights (what a bf16 parameter holds of the write), and the warning that names them;
    * ``copy_at_end``: that write in ``on_train_end`` (after the last step): the module after fit holds it.

    Also the module's parameter dtypes after fit and the dtypes of a checkpoint saved after the second fit."""
    half = MASTER_STEPS // 2
    out: dict = {}
    whole = TableLM()
    initial = {k: v.detach().clone() for k, v in whole.model.state_dict().items()}
    reference = _weights(_fit_table(whole, stage, MASTER_STEPS))
    split = TableLM()
    _fit_table(split, stage, half)
    out["dtypes_after_fit"] = sorted({str(p.dtype) for p in split.parameters()})
    trainer = _fit_table(split, stage, half)
    out["two_fits"] = _max_diff(_weights(trainer), reference)
    path = Path(root, f"after_two_fits_zero{stage}.ckpt")
    trainer.save_checkpoint(path)
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out["checkpoint_dtypes"] = sorted({str(m.properties.dtype) for k, m in meta.items()
                                       if k.startswith("state_dict.") and hasattr(m, "properties")})
    for how in ("load_state_dict", "copy"):
        # copy: shifted, so that every element's bf16 differs from what training made of it (an element written
        # with the bf16 value it already had keeps its fp32 master, which a fresh start from the bf16 would not)
        weights = initial if how == "load_state_dict" else {k: v + 0.25 for k, v in initial.items()}
        written = TableLM()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _weights(_fit_table(written, stage, MASTER_STEPS, [WriteAt(half, weights, how)]))
        out[f"{how}_warnings"] = [str(w.message) for w in caught if "master" in str(w.message)]
        fresh = TableLM()
        fresh.seen = half
        with torch.no_grad():
            for name, p in fresh.model.named_parameters():  # copy: what a bf16 parameter holds of the write
                p.copy_(weights[name].to(torch.bfloat16) if how == "copy" else weights[name])
        out[how] = _max_diff(got, _weights(_fit_table(fresh, stage, half)))
    # copy_at_end: the same direct write after the last step; the module after fit holds it (as bf16 held it)
    ended = TableLM()
    shifted = {k: v + 0.25 for k, v in initial.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit_table(ended, stage, half, [WriteAt("end", shifted, "copy")])
    out["copy_at_end"] = max((p - shifted[n].to(torch.bfloat16).float()).abs().max().item()
                             for n, p in ended.model.named_parameters())
    out["copy_at_end_warnings"] = [str(w.message) for w in caught if "master" in str(w.message)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--fits", nargs="*", default=list(FITS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--masters", nargs="*", type=int, default=[],
                        help="ZeRO stages of the bf16-mixed master cases (masters())")
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
    for stage in args.masters:
        result[f"masters_zero{stage}"] = masters(stage, args.root)
    if dist.get_rank() == 0:
        Path(args.root, "precision.json").write_text(json.dumps(result, indent=1))
    close_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
