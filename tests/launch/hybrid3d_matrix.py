"""Train the test job under 3D layouts (Hybrid3DStrategy), one ``Trainer.fit`` after another in the same ranks.

Run under torchrun (``tests.harness.launch_matrix``) on 4 ranks (tp2 x pp2) or 8 (dp2 x tp2 x pp2). Each layout gets
a fresh model, data module and Trainer on the same seed -- the job of ``tests.harness.TINY_JOB`` + ``conftest.job``
-- and writes ``ROOT/NAME/tb`` (per-step losses) and ``ROOT/NAME/reports`` (pre-clip gradient norms, via
:class:`tests.probes.GradNorms`) like a CLI launch, so :class:`tests.harness.Run` and the tests read them against the
single-process references of ``tests.conftest.RUNS``. Each rank also writes ``ROOT/NAME/rank{R}.json``: its
coordinates, the data-parallel gradient owner, the units it holds, the parameter bytes it materialised and what it
reduce-scatters per step (ZeRO buckets, FSDP groups); and ``ROOT/NAME/state`` (:class:`tests.probes.StateReport`):
the collectives of optimizer step 3.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.distributed.tensor import DTensor

from lightning_par import Hybrid3DStrategy
from lightning_par.data import TextDataModule
from lightning_par.examples import GPTLightningModule, HFCausalLMLightningModule, HFLlamaLightningModule
from lightning_par.parallel.pipeline.fsdp import fsdp_group_count
from tests.conftest import CLIP, EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS, SGD_LR
from tests.harness import checkpoint_worker_main
from tests.probes import GradNorms, StateReport


@dataclass
class Case:
    """One 3D run: strategy arguments, model arguments, and the single-process run it must match."""

    reference: str  # a tests.conftest.RUNS name
    strategy: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    accumulate: int = 1
    clip: bool = False
    hf: bool = False
    devices: int = 4
    checkpoint: bool = False  # keep every checkpoint (ROOT/NAME/ckpt), for the resume test
    full: bool = False  # in a launch of the full run only (as every 8-rank case)

    @property
    def steps(self) -> int:
        """Optimizer steps: two epochs, or one on 8 ranks, where the steps dominate the launch on 2 cores (measured
        alone: 122 s at 20 steps, 82 s at 10); the tests compare that many steps with the 20-step references."""
        return EPOCH_STEPS if self.devices == 8 else PARITY_STEPS


SGD = dict(optimizer="sgd", lr=SGD_LR)
# DTensor ops cost several times plain ones on CPU: 2 micro-batches per batch (the minimum for pp=2) unless a
# schedule needs more stages' worth
CASES: dict[str, Case] = {
    # tp2 x pp2 (4 ranks, one replica)
    # activation recompute composed per stage: the same trajectory (selective: the attention core; full: blocks)
    "tp2_pp2_1f1b_selective_sgd": Case("single_sgd", dict(schedule="1f1b", n_microbatches=2, recompute="selective"),
                                       SGD),
    "tp2_pp2_sp_interleaved": Case("single", dict(schedule="interleaved_1f1b", n_microbatches=2,
                                                  sequence_parallel=True), checkpoint=True),
    "tp2_pp2_zbv_tied": Case("single_tied", dict(schedule="zbv", n_microbatches=2), dict(tie_embeddings=True)),
    # the tied embedding on pipeline rank 0 and the head on rank 1, both vocabulary-sharded over tp: the tp rank k
    # copies' gradients are summed over pp (SGD: a gradient off by any factor moves the loss; AdamW: the default)
    "tp2_pp2_interleaved_tied_sgd": Case("single_tied_sgd", dict(schedule="interleaved_1f1b", n_microbatches=2),
                                         dict(tie_embeddings=True, **SGD)),
    "tp2_pp2_interleaved_tied": Case("single_tied", dict(schedule="interleaved_1f1b", n_microbatches=2),
                                     dict(tie_embeddings=True), full=True),
    "hf_llama_tp2_pp2_zbv_full": Case("hf_single", dict(schedule="zbv", n_microbatches=2, recompute="full"), hf=True),
    # dp2 x tp2 x pp2 (8 ranks): ZeRO 1, 2 and 3 across the replicas
    "dp2_tp2_pp2_zero1_sgd": Case("single_sgd", dict(schedule="1f1b", n_microbatches=2, zero_stage=1), SGD,
                                  devices=8),
    "dp2_tp2_pp2_zero2_sp_accum_clip": Case("single_clip", dict(
        schedule="interleaved_1f1b", n_microbatches=2, zero_stage=2, sequence_parallel=True), accumulate=2,
        clip=True, devices=8),
    "dp2_tp2_pp2_zero3_zbv_sgd": Case("single_sgd", dict(schedule="zbv", n_microbatches=2, zero_stage=3), SGD,
                                      devices=8),
    # tp2 x pp2 x cp2 (8 ranks, one replica; ZeRO-1 over the flattened dp x cp ranks): each sequence split in two
    "tp2_pp2_cp2_sgd": Case("single_sgd", dict(schedule="1f1b", n_microbatches=2, cp=2), SGD, devices=8),
    "hf_llama_tp2_pp2_cp2": Case("hf_single", dict(schedule="1f1b", n_microbatches=2, cp=2), hf=True, devices=8),
    "qwen2_tp2_pp2_cp2_sgd": Case("qwen2_single_sgd", dict(schedule="1f1b", n_microbatches=2, cp=2),
                                  dict(arch="qwen2", **SGD), hf=True, devices=8),
}


def _tied_digests(pl_module: pl.LightningModule) -> dict[str, str]:
    """sha256 of the bytes this rank holds of each copy of the tied embedding / head weight (a DTensor's shard)."""
    out = {}
    for name, param in pl_module.named_parameters(remove_duplicate=False):
        if name.endswith(("embed.weight", "head.weight")):
            local = (param.to_local() if isinstance(param, DTensor) else param).detach().contiguous().cpu()
            out[name] = hashlib.sha256(local.numpy().tobytes()).hexdigest()
    return out


def _report(trainer: pl.Trainer, path: Path) -> None:
    strategy = trainer.strategy
    own_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                    for p in trainer.lightning_module.parameters())
    owner = strategy.gradient_sync
    partitioner = getattr(owner, "partitioner", None)
    report = {"coordinates": strategy.coordinates, "gradient_sync": owner.name,
              # what is reduce-scattered once per optimizer step: ZeRO-1/2 buckets, or ZeRO-3's FSDP groups
              "buckets": len(partitioner.buckets) if partitioner is not None else None,
              "fsdp_groups": fsdp_group_count(strategy.pipeline.stage_modules, strategy.pipeline.block_names),
              "units": [u for i in strategy.pipeline.stage_ids for u in strategy.pipeline.units_by_stage[i]],
              "param_bytes": own_bytes, "dims": str(strategy.dims.describe())}
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))


class LayoutReport(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_start(self, trainer, pl_module) -> None:
        _report(trainer, self.path)

    def on_fit_end(self, trainer, pl_module) -> None:
        file = self.path / f"rank{trainer.global_rank}.json"
        report = json.loads(file.read_text())
        report["weights_after_fit"] = _tied_digests(pl_module)
        file.write_text(json.dumps(report, indent=1))


def fit(root: Path, cache: str, name: str) -> None:
    case = CASES[name]
    pl.seed_everything(1234)
    dp = case.devices // (4 * case.strategy.get("cp", 1))
    batch = GLOBAL_BATCH // dp // case.accumulate
    if case.hf and "arch" in case.model:
        model = HFCausalLMLightningModule(n_layers=4, n_kv_heads=2, **case.model)
    elif case.hf:
        model = HFLlamaLightningModule(n_layers=4, n_kv_heads=2, **case.model)
    else:
        model = GPTLightningModule(preset="tiny", n_layers=8, **case.model)
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=False, batch_size=batch, cache_dir=cache)
    trainer = pl.Trainer(
        accelerator="cpu", devices=case.devices, strategy=Hybrid3DStrategy(tp=2, pp=2, **case.strategy),
        max_steps=case.steps, limit_train_batches=EPOCH_STEPS * case.accumulate, limit_val_batches=2,
        accumulate_grad_batches=case.accumulate, gradient_clip_val=CLIP if case.clip else None,
        log_every_n_steps=1, logger=TensorBoardLogger(save_dir=root / name / "tb"),
        enable_checkpointing=case.checkpoint, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root / name,
        callbacks=[GradNorms(), LayoutReport(root / name), StateReport(str(root / name / "state"), step=3),
                   *([ModelCheckpoint(dirpath=root / name / "ckpt", save_top_k=-1)] if case.checkpoint else [])],
    )
    trainer.fit(model, data)


def main() -> None:
    checkpoint_worker_main(lambda root, cache, name, sources: fit(root, cache, name))


if __name__ == "__main__":
    main()
