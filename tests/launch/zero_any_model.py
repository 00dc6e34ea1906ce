"""ZeRO on models that declare nothing: several fits in one launch, and the ZeRO-1/2 gradient-memory measurement.

Run under torchrun (``tests.harness.launch_matrix``), on 1 rank (the references: Lightning's single-device
strategy) or 2 (``ZeroStrategy(stage=3)``). Each fit gets a fresh model, data module and Trainer on the same seed
and writes ``ROOT/NAME/tb`` (TensorBoard) and ``ROOT/NAME/reports`` (pre-clip gradient norms, and on 2 ranks the
peak of the parameters gathered during the forward of step 3), so :class:`tests.harness.Run` reads it. On 2 ranks,
``--grad-memory`` then measures the gradient bytes held during one backward of the plain model under
:class:`~lightning_par.parallel.zero.ZeroPartitioner` stages 1 and 2, without Lightning, into ``ROOT/grad_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger

from tests.conftest import CLIP, EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS

#: name -> (model, init args, gradient clipping); models are built from lightning_par.examples by name
FITS: dict[str, tuple[str, dict, float | None]] = {
    # plain SGD: no momentum, no clipping -- each step's update is exactly lr x the averaged gradient
    "plain_sgd": ("PlainLMLightningModule", dict(n_layers=8, optimizer="sgd", lr=0.5), None),
    "plain_adamw_clip": ("PlainLMLightningModule", dict(n_layers=8, lr=3e-3), CLIP),
    "hf_llama_clip": ("HFLlamaLightningModule", dict(n_layers=4, n_kv_heads=2, lr=3e-3), CLIP),
    # no nn.ModuleList: ZeRO-3 shards the model as one unit (its blocks are attributes, not a container)
    "one_unit_sgd": ("OneUnitLightningModule", dict(optimizer="sgd", lr=0.2), None),
    # and a parameter on the LightningModule itself: the LightningModule is the unit, gathered by its steps
    "one_unit_loose_sgd": ("OneUnitLightningModule", dict(optimizer="sgd", lr=0.2, loose=True), None),
}
#: the fits whose model has no repeated blocks (nothing gathered per block to meter)
NO_BLOCKS = ("one_unit_sgd", "one_unit_loose_sgd")
MEASURED_STEP = 3  # the forward of this optimizer step (1-based) is metered


class OneUnitLM(torch.nn.Module):
    """PlainLM's layers without an nn.ModuleList: two blocks kept as attributes of their own names."""

    def __init__(self, vocab_size: int, dim: int = 64) -> None:
        from lightning_par.examples.plain_lm import Block

        super().__init__()
        self.tok_emb = torch.nn.Embedding(vocab_size, dim)
        self.first, self.second = Block(dim, 4), Block(dim, 4)
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.second(self.first(self.tok_emb(tokens)))))


def OneUnitLightningModule(loose: bool = False, **kwargs):  # noqa: N802 (a class factory, named as the class)
    """PlainLMLightningModule around :class:`OneUnitLM`; ``loose``: a bias on the logits held by the
    LightningModule itself."""
    from lightning_par.data import vocab_size_from_data
    from lightning_par.examples import PlainLMLightningModule

    class OneUnit(PlainLMLightningModule):
        def __init__(self) -> None:
            super().__init__(**kwargs)
            self.bias = None

        def configure_model(self) -> None:
            if self.model is None:
                self.hparams.vocab_size = vocab_size_from_data(self, self.hparams.vocab_size)
                self.model = OneUnitLM(self.hparams.vocab_size)
                if loose:
                    self.bias = torch.nn.Parameter(torch.zeros(self.hparams.vocab_size))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            logits = self.model(tokens)
            return logits + self.bias if self.bias is not None else logits

    return OneUnit()


class GatheredPeak(pl.Callback):
    """Meter the parameters ZeRO-3 holds gathered during one training forward; write ``gathered_rank{N}.json``."""

    def __init__(self, path: Path, step: int = MEASURED_STEP) -> None:
        self.path, self.step, self.meter = path, step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1 and self.meter is None:
            from lightning_par.measure import GatheredParamMeter

            self.meter = GatheredParamMeter(pl_module).__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.meter is None or not self.meter._handles:
            return
        self.meter.__exit__(None, None, None)
        from lightning_par.parallel.blocks import find_blocks

        found = find_blocks(pl_module)
        blocks = {name: sum(p.numel() * p.element_size() for p in m.parameters())
                  for name, m in zip(found.blocks, found.block_modules(), strict=True)}
        total = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        report = {"peak_bytes": self.meter.peak_bytes, "peak_groups": self.meter.peak_groups,
                  "group_bytes": self.meter.group_bytes, "samples": self.meter.samples,
                  "block_bytes": blocks, "root_bytes": total - sum(blocks.values()), "total_bytes": total}
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"gathered_rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))


def fit(root: Path, cache: str, name: str, world: int) -> None:
    from lightning_par import ZeroStrategy, examples
    from lightning_par.data import TextDataModule
    from tests.probes import GradNorms

    model_name, kwargs, clip = FITS[name]
    pl.seed_everything(1234)
    model = (getattr(examples, model_name, None) or globals()[model_name])(**kwargs)
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=False, batch_size=GLOBAL_BATCH // world,
                          cache_dir=cache)
    callbacks: list = [GradNorms()]
    if world > 1 and name not in NO_BLOCKS:
        callbacks.append(GatheredPeak(root / "reports"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=ZeroStrategy(stage=3) if world > 1 else "auto",
        max_steps=PARITY_STEPS, limit_train_batches=EPOCH_STEPS, limit_val_batches=2, log_every_n_steps=1,
        gradient_clip_val=clip, logger=TensorBoardLogger(save_dir=root / "tb"), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, default_root_dir=root,
    )
    trainer.fit(model, data)


def grad_memory(bucket_cap_mb: float) -> dict:
    """Gradient bytes held during one backward of the plain 8-block model, per ZeRO-1/2 variant, on this rank.

    Also checks each variant's shard gradients against the all-reduced (averaged) full gradient.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.examples.plain_lm import PlainLM
    from lightning_par.measure import GradientMeter
    from lightning_par.parallel.zero import ZeroPartitioner

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))["dp"]
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (GLOBAL_BATCH, 32), generator=torch.Generator().manual_seed(1))
    inputs = batch[rank * GLOBAL_BATCH // world:(rank + 1) * GLOBAL_BATCH // world]
    out: dict = {"world": world, "bucket_cap_mb": bucket_cap_mb}
    expected = None
    for variant, stage, overlap in (("stage1", 1, True), ("stage2", 2, True), ("stage2_no_overlap", 2, False)):
        torch.manual_seed(0)
        model = PlainLM(n_layers=8)
        if expected is None:  # the reference: the whole gradient, averaged over the ranks
            torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), inputs.flatten()).backward()
            expected = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))])
            dist.all_reduce(expected)
            expected /= world
            model.zero_grad(set_to_none=True)
            out["numel"] = sum(p.numel() for p in model.parameters())
            out["largest_param_bytes"] = max(p.numel() * p.element_size() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters())
        partitioner = ZeroPartitioner(model, [optimizer], mesh, stage, bucket_cap_mb, overlap=overlap)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), inputs.flatten())
        with GradientMeter(model, [optimizer], extra=partitioner.gradient_buffers) as meter:
            loss.backward()
        after_backward = meter.live_bytes()
        partitioner.finish_gradient_sync()
        # buckets are packed in reverse parameter order, so their owned chunks line up with `expected`'s slices
        error, offset = 0.0, 0
        for bucket in partitioner.buckets:
            numel = sum(p.numel() for p in bucket.params)
            full = torch.zeros(bucket.flat.numel())
            full[:numel] = expected[offset:offset + numel]
            offset += numel
            error = max(error, float((bucket.shard.grad.to_local() - bucket.own(full)).abs().max()))
        out[variant] = {"peak_bytes": meter.peak_bytes, "after_backward_bytes": after_backward,
                        "after_sync_bytes": meter.live_bytes(), "samples": meter.samples,
                        "max_abs_error": error, "buckets": len(partitioner.buckets),
                        "bucket_bytes": [b.flat.numel() * b.flat.element_size() for b in partitioner.buckets],
                        "chunk_bytes": sum(b.chunk * b.flat.element_size() for b in partitioner.buckets)}
        partitioner.remove()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--fits", nargs="*", default=list(FITS))
    parser.add_argument("--grad-memory", action="store_true", help="measure ZeRO-1/2 gradient bytes (2+ ranks)")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.1)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    root = Path(args.root)
    for name in args.fits:
        fit(root / name, args.cache, name, world)
    if args.grad_memory:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        report = grad_memory(args.bucket_cap_mb)
        if dist.get_rank() == 0:
            (root / "grad_memory.json").write_text(json.dumps(report, indent=1))
        dist.barrier()


if __name__ == "__main__":
    main()
