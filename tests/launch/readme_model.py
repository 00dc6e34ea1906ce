"""The README's "Your own model" code, as written, trained under a strategy; and a model whose blocks sit in an
``nn.Sequential`` (no ``nn.ModuleList``), trained with ``block_types=``.

:func:`readme_namespace` takes the ```python blocks from docs/models.md (``Block``, ``MyLM`` and its ``tp_plan``)
and from the README's "Your own model" (``MyModule``) and runs them, minus the README's last statement (its
``trainer = L.Trainer(...)`` line: each fit here makes its own Trainer). :func:`fit` trains one case and returns the
per-step losses the step returned, the value logged as ``train/loss`` (``sync_dist=True``) at the last step, and
whether the step saw a DTensor. Run under torchrun (``tests.harness.launch_matrix``) it fits several cases in the
same ranks, one after another, and writes ``ROOT/NAME/rank{R}.json``; the single-process references are fitted in
the test's own process by the same :func:`fit`.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par import Hybrid3DStrategy, MegatronTPStrategy, PipelineStrategy, ZeroStrategy
from lightning_par.data import TextDataModule
from tests.harness import checkpoint_worker_main

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 8
STEPS = 10


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def readme_source() -> str:
    """docs/models.md's model (the block that defines ``MyLM``), then the README's ``MyModule`` without its final
    ``trainer = ...`` statement."""
    (model,) = [b for b in _python_blocks(REPO / "docs" / "models.md") if "class MyLM" in b]
    (module,) = [b for b in _python_blocks(REPO / "README.md") if "class MyModule" in b]
    head, sep, trainer_line = module.rpartition("\ntrainer = ")
    assert sep and "L.Trainer(" in trainer_line and "\n" not in trainer_line.strip(), "README's recipe changed shape"
    return model + "\n" + head + "\n"


def readme_namespace() -> types.ModuleType:
    module = types.ModuleType("readme_code")
    exec(compile(readme_source(), "README.md + docs/models.md", "exec"), module.__dict__)  # noqa: S102
    return module


def readme_moe_source() -> str:
    """The README's "Mixture of experts" code (``MoE`` ... ``MyMoEModule``) without its final ``trainer = ...``."""
    (block,) = [b for b in _python_blocks(REPO / "README.md") if "class MoE(" in b]
    head, sep, trainer_line = block.rpartition("\ntrainer = ")
    assert sep and "L.Trainer(" in trainer_line and 'strategy="ep2"' in trainer_line, "README's MoE changed shape"
    return head + "\n"


def readme_moe_namespace() -> types.ModuleType:
    """The README's MoE code run after its "Your own model" code (whose ``MyModule`` it extends)."""
    module = readme_namespace()
    exec(compile(readme_moe_source(), "README.md (Mixture of experts)", "exec"), module.__dict__)  # noqa: S102
    return module


# -- a model without an nn.ModuleList: its blocks in an nn.Sequential, found only through block_types= -------------
class Block(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class SequentialLM(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, dim)
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(4)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.emb(tokens))))


class AttributesLM(SequentialLM):
    """The same blocks held directly, as ``block0`` ... ``block3``, and called one after another."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__(dim)
        del self.blocks
        for i in range(4):
            setattr(self, f"block{i}", Block(dim))
        self.norm, self.head = self._modules.pop("norm"), self._modules.pop("head")  # registered after the blocks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for i in range(4):
            x = getattr(self, f"block{i}")(x)
        return self.head(self.norm(x))


class SequentialModule(pl.LightningModule):
    """The model as ``self.net`` (not ``self.model``), plain SGD; ``held="attributes"`` for :class:`AttributesLM`."""

    def __init__(self, dim: int = 64, held: str = "sequential") -> None:
        super().__init__()
        self.dim, self.held = dim, held

    def configure_model(self) -> None:
        if getattr(self, "net", None) is None:
            self.net = (AttributesLM if self.held == "attributes" else SequentialLM)(self.dim)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def compute_loss(self, batch):
        inputs, targets = batch
        return self.loss_fn(self.net(inputs), targets)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


# -- the cases -----------------------------------------------------------------------------------------------------
#: name -> (model, strategy factory or None for one process, devices, data-parallel size)
CASES = {
    "readme_single": ("readme", None, 1, 1),
    "readme_zero3": ("readme", lambda: ZeroStrategy(stage=3), 2, 2),
    "readme_tp2": ("readme", lambda: MegatronTPStrategy(tp=2), 2, 1),
    "readme_pp2_1f1b": ("readme", lambda: PipelineStrategy(pp=2, schedule="1f1b"), 2, 1),
    "readme_tp2_pp2": ("readme", lambda: Hybrid3DStrategy(tp=2, pp=2, schedule="1f1b", n_microbatches=2), 4, 1),
    "moe_single": ("moe", None, 1, 1),
    "moe_ep2": ("moe", lambda: "ep2", 2, 2),  # the README's name, as written
    "sequential_single": ("sequential", None, 1, 1),
    "sequential_zero3": ("sequential", lambda: ZeroStrategy(stage=3, block_types=[Block]), 2, 2),
    "sequential_pp2_1f1b": ("sequential", lambda: PipelineStrategy(pp=2, schedule="1f1b", block_types=["Block"]), 2,
                            1),
    "attributes_single": ("attributes", None, 1, 1),
    "attributes_zero3": ("attributes", lambda: ZeroStrategy(stage=3, block_types=[Block]), 2, 2),
    "attributes_pp2_1f1b": ("attributes", lambda: PipelineStrategy(pp=2, schedule="1f1b", block_types=["Block"]), 2,
                            1),
}


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.dtensor_seen = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.dtensor_seen |= isinstance(loss, DTensor)
        self.losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
        if not hasattr(self, "experts_held"):  # the expert weights' elements this rank holds, and of the model
            held = [((p.to_local() if isinstance(p, DTensor) else p).numel(), p.numel())
                    for n, p in pl_module.named_parameters()
                    if n.rpartition(".")[2] in ("w_in", "w_out")]
            self.experts_held = [sum(h for h, _ in held), sum(t for _, t in held)]


def fit(name: str, root: Path, cache: str) -> dict:
    kind, strategy, devices, dp = CASES[name]
    pl.seed_everything(1234)
    if kind == "moe":
        model = readme_moe_namespace().MyMoEModule()
    else:
        model = readme_namespace().MyModule() if kind == "readme" else SequentialModule(held=kind)
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=False, batch_size=GLOBAL_BATCH // dp,
                          cache_dir=cache)
    record = _Record()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy() if strategy else "auto",
                         max_steps=STEPS, limit_val_batches=0, log_every_n_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[record], default_root_dir=root)
    trainer.fit(model, data)
    return {"losses": record.losses, "logged": float(trainer.callback_metrics["train/loss"]),
            "dtensor_seen": record.dtensor_seen, "experts_held": record.experts_held,
            "strategy": type(trainer.strategy).__name__}


def fit_and_report(root: Path, cache: str, name: str, sources: dict) -> None:
    out = root / name
    result = fit(name, out, cache)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))


def main() -> None:
    checkpoint_worker_main(fit_and_report)


if __name__ == "__main__":
    main()
