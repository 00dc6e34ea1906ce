"""Train the tiny GPT eagerly and with its blocks compiled, per layout, one ``Trainer.fit`` after another.

Run under torchrun (``tests.harness.launch_matrix``) on 2 ranks (ZeRO-3, tp2, pp2 ZBV) or 4 (tp2 x pp2). The
``user_gpt2_*`` cases train instead :class:`UserGPT2Module`, a GPT-2-style model written here as a user would from
the README (biases everywhere, LayerNorm with bias, the MLP's linears in the block, a ``colwise_gather_output``
head), under tp2 and under ``Hybrid3DStrategy(tp=2, pp=2)`` with its default ZeRO-1. Each case
fits twice on the same seed and data -- ``compile=False``, then ``compile=True`` (inductor) -- with plain SGD (a
gradient off by any factor moves the loss), and writes ``ROOT/NAME_{eager,compiled}/tb`` (per-step losses, read by
:class:`tests.harness.Run`) and, per rank, ``ROOT/NAME_compiled/rank{R}.json``: the compile summary (graphs, distinct
inputs, recompiles, graphs by block) and whether any state-dict key changed.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_par import Hybrid3DStrategy, MegatronTPStrategy, PipelineStrategy, ZeroStrategy
from lightning_par.data import TextDataModule
from lightning_par.examples import GPTLightningModule
from lightning_par.parallel.tensor_parallel import PLAN_STYLES
from tests.conftest import GLOBAL_BATCH, SGD_LR
from tests.harness import checkpoint_worker_main

STEPS = 6
#: what compile=True means here; LIGHTNING_PAR_COMPILE_BACKEND=aot_eager traces without generating code (debugging)
COMPILE = dict(backend=os.environ.get("LIGHTNING_PAR_COMPILE_BACKEND", "inductor"))
#: name -> (ranks, strategy class, its arguments, batch size per rank)
CASES: dict[str, tuple[int, type, dict, int]] = {
    "zero3_dp2": (2, ZeroStrategy, dict(stage=3), GLOBAL_BATCH // 2),
    "tp2": (2, MegatronTPStrategy, dict(tp=2), GLOBAL_BATCH),
    "pp2_zbv": (2, PipelineStrategy, dict(pp=2, schedule="zbv", n_microbatches=2), GLOBAL_BATCH),
    # the rest of "every strategy, every schedule": ZeRO 0-2, sequence parallel, and the other pipeline schedules
    # (one stage per rank, virtual stages, split backward, DualPipeV's two directions)
    "zero0_dp2": (2, ZeroStrategy, dict(stage=0), GLOBAL_BATCH // 2),
    "zero1_dp2": (2, ZeroStrategy, dict(stage=1), GLOBAL_BATCH // 2),
    "zero2_dp2": (2, ZeroStrategy, dict(stage=2), GLOBAL_BATCH // 2),
    "tp2_sp": (2, MegatronTPStrategy, dict(tp=2, sequence_parallel=True), GLOBAL_BATCH),
    "pp2_gpipe": (2, PipelineStrategy, dict(pp=2, schedule="gpipe", n_microbatches=2), GLOBAL_BATCH),
    "pp2_interleaved_1f1b": (2, PipelineStrategy, dict(pp=2, schedule="interleaved_1f1b", n_microbatches=2),
                             GLOBAL_BATCH),
    "pp2_looped_bfs": (2, PipelineStrategy, dict(pp=2, schedule="looped_bfs", n_microbatches=2), GLOBAL_BATCH),
    "pp2_zero_bubble": (2, PipelineStrategy, dict(pp=2, schedule="zero_bubble", n_microbatches=2), GLOBAL_BATCH),
    "pp2_dualpipev": (2, PipelineStrategy, dict(pp=2, schedule="dualpipev", n_microbatches=4), GLOBAL_BATCH),
    "tp2_pp2": (4, Hybrid3DStrategy, dict(tp=2, pp=2, zero_stage=0, schedule="1f1b", n_microbatches=2),
                GLOBAL_BATCH),
    # a model lightning-par did not write (UserGPT2Module); tp2 x pp2 with Hybrid3D's default ZeRO-1 (dp=1 here:
    # the parameters still become views into the ZeRO buckets)
    "user_gpt2_tp2": (2, MegatronTPStrategy, dict(tp=2), GLOBAL_BATCH),
    "user_gpt2_tp2_pp2": (4, Hybrid3DStrategy, dict(tp=2, pp=2, schedule="1f1b", n_microbatches=2), GLOBAL_BATCH),
}
if "packed_colwise" in PLAN_STYLES:  # the fused-qkv model, once tensor parallel has fused projections
    CASES["user_gpt2_fused_tp2"] = (2, MegatronTPStrategy, dict(tp=2), GLOBAL_BATCH)
    CASES["user_gpt2_fused_tp2_pp2"] = (4, Hybrid3DStrategy, dict(tp=2, pp=2, zero_stage=0, schedule="1f1b",
                                                                  n_microbatches=2), GLOBAL_BATCH)


class UserAttention(nn.Module):
    """Causal self-attention with biased projections: separate q/k/v, or (``fused``) one ``qkv`` linear whose output
    is chunked in three, nanoGPT's way. The head count comes from the projection's output (``-1``), so a
    column-parallel split runs this rank's heads."""

    def __init__(self, dim: int, n_heads: int, fused: bool = False) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        if fused:
            self.qkv = nn.Linear(dim, 3 * dim)
        else:
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        parts = self.qkv(x).chunk(3, dim=-1) if hasattr(self, "qkv") else (
            self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = (y.view(b, t, -1, self.head_dim).transpose(1, 2) for y in parts)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class UserBlock(nn.Module):
    """Pre-norm block whose GELU MLP linears sit in the block itself, next to its LayerNorms (GPT-2's layout)."""

    def __init__(self, dim: int, n_heads: int, fused: bool = False) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), UserAttention(dim, n_heads, fused), nn.LayerNorm(dim)
        self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class UserGPT2(nn.Module):
    """Token and learned position embeddings -> ModuleList of blocks -> LayerNorm -> biased head; ``fused``: one
    q|k|v projection per block, declared ``packed_colwise:3``."""

    tp_plan = {
        "blocks.*.attn.q_proj": "colwise", "blocks.*.attn.k_proj": "colwise", "blocks.*.attn.v_proj": "colwise",
        "blocks.*.attn.out_proj": "rowwise", "blocks.*.c_fc": "colwise", "blocks.*.c_proj": "rowwise",
        "head": "colwise_gather_output",
    }

    def __init__(self, vocab: int = 256, dim: int = 64, n_heads: int = 4, n_layers: int = 2, seq: int = 64,
                 fused: bool = False) -> None:
        super().__init__()
        if fused:
            self.tp_plan = {**{k: v for k, v in self.tp_plan.items() if not k.endswith(("q_proj", "k_proj", "v_proj"))},
                            "blocks.*.attn.qkv": "packed_colwise:3"}
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(UserBlock(dim, n_heads, fused) for _ in range(n_layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class UserGPT2Module(pl.LightningModule):
    """The README's "Your own model" module around :class:`UserGPT2`, with plain SGD."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused

    def configure_model(self) -> None:
        if getattr(self, "model", None) is None:
            self.model = UserGPT2(fused=self.fused)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def compute_loss(self, batch) -> torch.Tensor:
        inputs, targets = batch
        return self.loss_fn(self.model(inputs), targets)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=SGD_LR)


class CompileReport(pl.Callback):
    """After fit, per rank: the compile summary and the state-dict keys (they must not change under compile)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        compiler = trainer.strategy.compiler
        report = {"keys": sorted(pl_module.state_dict()),
                  "summary": asdict(compiler.summary(pl_module)) if compiler is not None else None}
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))


def fit_one(root: Path, cache: str, name: str, compiled: bool) -> None:
    devices, strategy_cls, strategy_args, batch = CASES[name]
    pl.seed_everything(1234)
    model = (UserGPT2Module(fused="fused" in name) if name.startswith("user_gpt2")
             else GPTLightningModule(preset="tiny", optimizer="sgd", lr=SGD_LR))
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=False, batch_size=batch, cache_dir=cache)
    out = root / f"{name}_{'compiled' if compiled else 'eager'}"
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy_cls(**strategy_args, compile=compiled and COMPILE),
        max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
        logger=TensorBoardLogger(save_dir=out / "tb"), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[CompileReport(out)], default_root_dir=out,
    )
    trainer.fit(model, data)


def fit(root: Path, cache: str, name: str, _sources: dict) -> None:
    """Both variants of case ``name``: eager, then compiled."""
    for compiled in (False, True):
        fit_one(root, cache, name, compiled)


if __name__ == "__main__":
    checkpoint_worker_main(fit)  # --root --cache --cases (no checkpoints from elsewhere here)
