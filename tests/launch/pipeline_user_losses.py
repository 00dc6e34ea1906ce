"""A user's own loss terms under a pipeline: a plain PyTorch mixture-of-experts model written from the README (its
layers keep a load-balancing loss, the step adds it), through ``Trainer.fit`` with ``PipelineStrategy(pp=2)``.

Run under torchrun on 2 ranks (``tests.harness.launch_matrix``); ``tests/launch/test_pipeline_user_losses.py`` reads
what it writes. Cases, one after another in the same ranks:

- ``aux_in_compute_loss`` / ``aux_in_training_step``: the layers' losses added in ``compute_loss`` (as the example's
  MoE module does) or in ``training_step``: refused at the first step, on both ranks, before any update;
- ``scaled``: ``training_step`` returns ``2 * loss``: refused;
- ``aux_in_layer``: the same model whose layers start their loss's backward themselves (``aux_loss_backward``):
  plain SGD, per-step losses and final weights against one process computing the same semantics (each micro-batch's
  language-model loss plus its layers' load-balancing losses, the micro-batches' mean).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tests.harness import close_process_group

SEED = 7
STEPS = 4
BATCH = 8
SEQ = 16
VOCAB = 64
MICROBATCHES = 2
COEF = 0.5


class MoEFFN(nn.Module):
    """Softly routed experts (every expert computed, weighted by the router's probabilities) and the Switch
    load-balancing loss of the top-1 choice, kept on the layer as users write it."""

    def __init__(self, dim: int, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, dim, 2 * dim) * 0.2)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * dim, dim) * 0.2)
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)  # [B, T, E]
        hidden = torch.einsum("btd,edf->btef", x, self.w1).relu()
        y = torch.einsum("btef,efd,bte->btd", hidden, self.w2, probs)
        chosen = F.one_hot(probs.argmax(-1), probs.size(-1)).float()
        self.aux = probs.size(-1) * (chosen.mean((0, 1)) * probs.mean((0, 1))).sum()
        return y


class StartsItsLoss(MoEFFN):
    """The same layer, starting its loss's backward itself where a pipeline gives it the hook."""

    aux_loss_backward = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.aux_loss_backward is not None:
            y = self.aux_loss_backward(y, COEF * self.aux)
        return y


class Block(nn.Module):
    def __init__(self, dim: int, layer: type[MoEFFN]):
        super().__init__()
        self.norm, self.ffn = nn.LayerNorm(dim), layer(dim)
        self.mix = nn.Parameter(torch.randn(SEQ, SEQ) * 0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tril(self.mix) @ self.norm(h)
        return h + self.ffn(h)


class PlainMoE(nn.Module):
    def __init__(self, layer: type[MoEFFN], dim: int = 16, n_blocks: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Block(dim, layer) for _ in range(n_blocks)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def aux_loss(self) -> torch.Tensor:
        """The layers' losses the step adds (those a pipeline does not start in the layer)."""
        terms = [b.ffn.aux for b in self.blocks if getattr(b.ffn, "aux_loss_backward", None) is None]
        return COEF * sum(terms) if terms else torch.zeros(())


class UserModule(L.LightningModule):
    def __init__(self, case: str):
        super().__init__()
        self.case = case
        torch.manual_seed(SEED)
        self.model = PlainMoE(StartsItsLoss if case in ("aux_in_layer", "scaled") else MoEFFN)

    def forward(self, tokens):
        return self.model(tokens)

    def loss_fn(self, logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def compute_loss(self, batch):
        inputs, targets = batch
        loss = self.loss_fn(self(inputs), targets)
        return loss + self.model.aux_loss() if self.case in ("aux_in_compute_loss", "aux_in_layer") else loss

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        if self.case == "aux_in_training_step":
            loss = loss + self.model.aux_loss()
        return 2 * loss if self.case == "scaled" else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def reference(seen: list, case: str = "aux_in_layer") -> dict:
    """One process on the batches the fit saw: each micro-batch's loss with its layers' load-balancing losses, the
    micro-batches' mean (``case="scaled"``: without them)."""
    lm = UserModule(case)
    optimizer = lm.configure_optimizers()
    losses = []
    for inputs, targets in seen:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.stack([lm.compute_loss(mb) for mb in zip(inputs.tensor_split(MICROBATCHES),
                                                               targets.tensor_split(MICROBATCHES), strict=True)]).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in lm.named_parameters()}}


class _Losses(L.Callback):
    def __init__(self):
        self.train: list[float] = []
        self.batches: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(outputs["loss"]))


def fit(case: str, root: Path) -> dict:
    from torch.utils.data import DataLoader

    from lightning_par import PipelineStrategy

    lm, losses = UserModule(case), _Losses()
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
                        strategy=PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=MICROBATCHES),
                        default_root_dir=root / case)
    out: dict = {}
    try:
        trainer.fit(lm, DataLoader(batches(), batch_size=None))
    except Exception as err:  # noqa: BLE001 -- the message is what the test reads
        out["error"] = f"{type(err).__name__}: {err}"
    out["losses"] = losses.train
    weights = {n: p.detach() for n, p in lm.named_parameters()}
    out["changed"] = sorted(n for n, p in weights.items() if n in before and not torch.equal(p, before[n]))
    if case == "aux_in_layer":
        ref = reference(losses.batches)
        out["reference"], out["reference_without_aux"] = ref["losses"], reference(losses.batches, "scaled")["losses"]
        out["weight_diff"] = max(((p - ref["weights"][n]).abs().max() / ref["weights"][n].abs().max()).item()
                                 for n, p in weights.items())
    return out


CASES = ("aux_in_compute_loss", "aux_in_training_step", "scaled", "aux_in_layer")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    root = Path(args.root)
    results = {case: fit(case, root) for case in CASES}
    (root / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    close_process_group()


if __name__ == "__main__":
    main()
