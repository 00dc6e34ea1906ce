"""Packed documents under tp2, pp2 and cp2 against the same documents unpacked in one process, in one launch.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.launch.packed_documents_worker OUT_DIR \
        [CASE ...]

for tests/launch/test_packed_documents.py. Each case is one ``Trainer.fit`` of the example GPT (plain SGD) on
batches of packed documents, ``(inputs, targets, position_ids)`` as ``TextDataModule(pack_documents=True)`` makes
them (:func:`lightning_par.data.collate_packed`): every row holds whole documents, the same number per row (so a
pipeline's micro-batch mean is the token mean). Every rank writes ``OUT_DIR/rank{R}.json``: per case, each step's
loss; rank 0 adds, from the run's initial weights gathered from every rank, one process on the same documents
unpacked (each its own row, padded with ``-100`` targets: ``unpacked``) and packed (``packed``), and packed with
attention across documents (``crossing``: what the parity must not match).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_par import LayoutStrategy, PipelineStrategy
from lightning_par.data import collate_packed, document_positions
from lightning_par.examples import GPTLightningModule
from lightning_par.examples.gpt import GPT, causal_lm_loss
from tests.harness import close_process_group

STEPS, ROWS, SEQ, LR = 3, 2, 32, 0.5
DOCS_PER_ROW = 3
CASES = {"tp2": lambda: LayoutStrategy(tp=2), "pp2": lambda: PipelineStrategy(pp=2, n_microbatches=ROWS),
         "cp2": lambda: LayoutStrategy(cp=2)}


def documents(seed: int = 0) -> list[list[torch.Tensor]]:
    """Per step, ``ROWS * DOCS_PER_ROW`` documents (bytes 1..255 ending with the NUL separator) of ``SEQ + 1``
    tokens a row."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        docs = []
        for _ in range(ROWS):
            cuts = sorted(torch.randperm(SEQ - 1, generator=gen)[:DOCS_PER_ROW - 1].add(1).tolist())
            for start, end in zip([0, *cuts], [*cuts, SEQ + 1], strict=True):
                doc = torch.randint(1, 256, (end - start,), generator=gen)
                doc[-1] = 0
                docs.append(doc)
        steps.append(docs)
    return steps


def packed(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = [torch.cat(docs[i:i + DOCS_PER_ROW]) for i in range(0, len(docs), DOCS_PER_ROW)]
    return collate_packed([(row, document_positions(row, 0)) for row in rows])


def unpacked(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(d) for d in docs) - 1
    inputs = torch.zeros(len(docs), length, dtype=torch.long)
    targets = torch.full((len(docs), length), -100)
    for i, doc in enumerate(docs):
        inputs[i, :len(doc) - 1], targets[i, :len(doc) - 1] = doc[:-1], doc[1:]
    return inputs, targets


def module() -> GPTLightningModule:
    return GPTLightningModule(preset="tiny", n_layers=2, optimizer="sgd", lr=LR)


class Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        mine = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in pl_module.named_parameters()}
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, mine)
        self.initial = {n.removeprefix("model."): t for stage in stages for n, t in stage.items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(name: str, root: Path) -> Record:
    pl.seed_everything(1234)
    record = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=CASES[name](), max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, default_root_dir=root / name, callbacks=[record])
    loader = torch.utils.data.DataLoader([packed(docs) for docs in documents()], batch_size=None)
    trainer.fit(module(), loader)
    return record


def one_process(initial: dict[str, torch.Tensor], form: str) -> list[float]:
    """Per-step losses of one process from ``initial``: the documents ``unpacked``, ``packed``, or packed with
    attention across documents (``crossing``)."""
    model = GPT(module().config)
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for docs in documents():
        if form == "unpacked":
            inputs, targets = unpacked(docs)
            logits = model(inputs)
        else:
            inputs, targets, positions = packed(docs)
            logits = model(inputs, position_ids=positions) if form == "packed" else model(inputs)
        loss = causal_lm_loss(logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    names = sys.argv[2:] or list(CASES)
    report: dict = {}
    for name in names:
        record = fit(name, out)
        report[name] = {"losses": record.losses}
        if dist.get_rank() == 0:
            report[name].update({form: one_process(record.initial, form) for form in ("unpacked", "packed",
                                                                                       "crossing")})
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
