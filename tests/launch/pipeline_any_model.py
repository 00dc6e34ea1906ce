"""Pipeline parallel on models that declare nothing: Hugging Face causal LMs and a plain nn.ModuleList model.

Run under torchrun on 2 ranks (``tests.harness.launch_matrix``); ``tests/launch/test_pipeline_any_model.py`` reads what
it writes. Each case builds the model the way the engine does (``split(lm, ..., holder=True)``: the blocks found on the
LightningModule, its model replaced by this rank's stages, then ``PipelineRuntime(parts, ...)``), trains it for 20
fp32 steps with the module's own optimizer, and records the per-step losses next to those of one process training
the same model (same seed) on the same batches. Every rank computes that reference itself (no communication), at the
same time, so it costs no extra wall time. Cases run one after another in the same ranks: one start-up for all.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_par.examples import HFCausalLMLightningModule, causal_lm_loss
from lightning_par.parallel.finalize import finalize
from lightning_par.parallel.gradient_sync import DDPSync
from lightning_par.parallel.parts import split
from lightning_par.parallel.pipeline.batches import split_batch
from lightning_par.parallel.pipeline.runtime import PipelineRuntime, resolve_schedule
from tests.harness import close_process_group

SEED = 1234
STEPS = 20
BATCH = 8
SEQ = 32  # tuple batches: inputs [B, 32]; dict batches: input_ids [B, 33] (Hugging Face shifts the labels)
PP = 2
MICROBATCHES = 4


# -- a plain model: embedding, an nn.ModuleList of blocks, norm, head; it declares nothing ------------------------
class PlainBlock(nn.Module):
    """Causal mixing (a learned lower-triangular token mix) and an MLP, both residual."""

    def __init__(self, dim: int, seq: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Parameter(torch.randn(seq, seq) * 0.1)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mix = torch.tril(self.mix[:t, :t])
        x = x + mix @ self.norm(x)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class PlainLM(nn.Module):
    """Token and learned position embeddings summed (not a chain of units: a later stage gets its activation
    injected into its first block), an nn.ModuleList of blocks, a final norm and a head."""

    def __init__(self, vocab: int = 256, dim: int = 32, n_blocks: int = 4, seq: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([PlainBlock(dim, seq) for _ in range(n_blocks)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos(torch.arange(tokens.size(1), device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class PlainLightningModule(L.LightningModule):
    """The plain model with the two hooks a pipeline needs (``loss_fn``, ``compute_loss``) and AdamW."""

    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.lr = lr
        self.model: PlainLM | None = None

    def configure_model(self):
        if self.model is None:
            self.model = PlainLM()

    def forward(self, tokens):
        return self.model(tokens)

    def loss_fn(self, logits, targets):
        return causal_lm_loss(logits, targets)

    def compute_loss(self, batch):
        inputs, targets = split_batch(batch)
        return self.loss_fn(self(inputs), targets)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, sync_dist=True, on_step=True, batch_size=BATCH)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.compute_loss(batch), sync_dist=True, on_epoch=True, batch_size=BATCH)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# -- the cases ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    model: str  # "llama", "qwen2", "mistral" or "plain"
    schedule: str
    optimizer: str = "adamw"
    lr: float = 1e-3
    tied: bool = False
    batches: str = "tuple"  # "tuple", "dict" (all-ones mask) or "padded" (dict, left padding, mask with zeros)
    evaluate: bool = False  # also compare forward-only loss and logits after training

    def reference_key(self) -> tuple:
        return (self.model, self.optimizer, self.lr, self.tied, self.batches)


CASES: dict[str, Case] = {
    "llama_1f1b": Case("llama", "1f1b"),
    "llama_interleaved_1f1b": Case("llama", "interleaved_1f1b"),
    "llama_zbv": Case("llama", "zbv", evaluate=True),
    "qwen2_1f1b": Case("qwen2", "1f1b"),
    "qwen2_interleaved_1f1b": Case("qwen2", "interleaved_1f1b"),
    "qwen2_zbv": Case("qwen2", "zbv"),
    "mistral_sgd_1f1b": Case("mistral", "1f1b", optimizer="sgd", lr=0.1),
    "llama_tied_1f1b": Case("llama", "1f1b", tied=True),
    "llama_dict_1f1b": Case("llama", "1f1b", batches="dict"),
    "qwen2_padded_interleaved_1f1b": Case("qwen2", "interleaved_1f1b", batches="padded", evaluate=True),
    "plain_1f1b": Case("plain", "1f1b", evaluate=True),
    "plain_interleaved_1f1b": Case("plain", "interleaved_1f1b"),
}


#: Through the whole engine (``Trainer.fit`` with ``PipelineStrategy``), on ``TextDataModule`` batches: name ->
#: (case, the data module's batch_format). Compared with the same manual one-process loop as above.
FIT_CASES: dict[str, tuple[Case, str]] = {
    "fit_llama_dict_zbv": (Case("llama", "zbv"), "dict"),
    "fit_plain_1f1b": (Case("plain", "1f1b"), "tuple"),
}
FIT_EPOCH_STEPS = 10  # two epochs of 10 steps, validation (2 batches) after each


def make_lm(case: Case) -> L.LightningModule:
    torch.manual_seed(SEED)
    if case.model == "plain":
        lm = PlainLightningModule()
    else:
        lm = HFCausalLMLightningModule(arch=case.model, n_layers=4, lr=case.lr, optimizer=case.optimizer,
                                       tie_embeddings=case.tied, weight_decay=0.0 if case.optimizer == "sgd" else 0.1)
    lm.configure_model()
    return lm


def corpus_blocks(n: int) -> torch.Tensor:
    """``n`` blocks of ``SEQ + 1`` bytes of real text (the standard library's argparse.py), no download."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_bytes()
    data = torch.tensor(list(text[: n * (SEQ + 1)]), dtype=torch.long)
    return data.view(n, SEQ + 1)


def make_batches(kind: str, n: int) -> list:
    blocks = corpus_blocks(n * BATCH).view(n, BATCH, SEQ + 1)
    out = []
    for block in blocks:
        if kind == "tuple":
            out.append((block[:, :-1], block[:, 1:]))
            continue
        ids, mask = block.clone(), torch.ones_like(block)
        labels = ids.clone()
        if kind == "padded":  # left padding of 0..7 tokens, different per row: micro-batches differ in tokens
            for row in range(BATCH):
                pad = (3 * row) % 8
                ids[row, :pad], mask[row, :pad], labels[row, :pad] = 0, 0, -100
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def reference_loss(lm: L.LightningModule, batch, kind: str) -> torch.Tensor:
    """One process's loss of ``batch``. Padded: the mean of the micro-batch losses, the pipeline's definition
    (documented in batches.py); the forward still runs on the whole batch at once."""
    if kind != "padded":
        return lm.compute_loss(batch)
    inputs, targets = split_batch(batch)
    logits = lm(inputs)
    losses = [lm.loss_fn(y, t) for y, t in zip(logits.tensor_split(MICROBATCHES), targets.tensor_split(MICROBATCHES),
                                                 strict=True)]
    return torch.stack(losses).mean()


def run_reference(case: Case, batches: list, eval_batch) -> dict:
    lm = make_lm(case)
    optimizer = lm.configure_optimizers()
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = reference_loss(lm, batch, case.batches)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    out = {"losses": losses, "names": [n for n, _ in lm.named_parameters(remove_duplicate=False)]}
    with torch.no_grad():
        out["eval_loss"] = reference_loss(lm, eval_batch, case.batches).item()
        inputs, _ = split_batch(eval_batch)
        out["logits"] = lm(inputs)
        if case.batches == "padded":  # how much the mask matters: the same step without it
            unmasked = dict(eval_batch, attention_mask=torch.ones_like(eval_batch["attention_mask"]))
            out["eval_loss_unmasked"] = reference_loss(lm, unmasked, case.batches).item()
    return out


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 -- the message is what the test reads
        return f"{type(err).__name__}: {err}"
    return "no error"


def run_pipeline(case: Case, batches: list, eval_batch, mesh) -> dict:
    lm = make_lm(case)
    choice = resolve_schedule(case.schedule, PP, MICROBATCHES)
    parts = split(lm, choice, mesh["pp"], holder=True)  # what the engine does: lm holds this rank's stages
    runtime = PipelineRuntime(parts, mesh["pp"], lm.loss_fn, loss_scale=1.0 / MICROBATCHES, device=torch.device("cpu"))
    runtime.module.forward = runtime.forward_only
    optimizer = lm.configure_optimizers()
    owner = DDPSync(mesh["dp"], bucket_cap_mb=25.0, deferred=True)  # what the engine picks for ZeRO-0 under pp
    owner.wrap(runtime.module)
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = runtime.train_step(*split_batch(batch))
        finalize(owner, runtime)
        optimizer.step()
        losses.append(loss.item())
    out = {"losses": losses, "units_by_stage": runtime.units_by_stage, "source": parts.found.source,
           "names": [n for n, _ in lm.named_parameters(remove_duplicate=False)]}
    if case.model == "plain" and case.evaluate:  # errors raised alike on every rank, before any communication
        ids = eval_batch[0]
        padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)}
        out["errors"] = [_error(runtime.train_step, padded, eval_batch[1]),
                         _error(runtime.forward_only, ids, position_ids=ids)]
    if case.evaluate:
        out["eval_loss"] = runtime.forward_only(*split_batch(eval_batch)).item()
        inputs, _ = split_batch(eval_batch)
        with torch.no_grad():
            out["logits"] = lm(inputs)  # the LightningModule's own forward, through the pipeline
    return out


class _Losses(L.Callback):
    def __init__(self):
        self.train: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(outputs["loss"]))

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append(float(trainer.callback_metrics["val/loss"]))


def fit_case(name: str, cache: str, root: Path) -> dict:
    """``Trainer.fit`` through the engine, and one process's manual loop on the same batches."""
    from lightning_par import PipelineStrategy
    from lightning_par.data import TextDataModule

    case, batch_format = FIT_CASES[name]

    def data():
        return TextDataModule(seq_len=SEQ, max_corpus_bytes=300_000, shuffle=False, batch_size=BATCH,
                              cache_dir=cache, batch_format=batch_format)

    # the reference: the batches in the order the fit sees them (no shuffle), one process, the module's optimizer
    dm = data()
    dm.prepare_data()
    dm.setup()
    train = [b for b, _ in zip(dm.train_dataloader(), range(FIT_EPOCH_STEPS), strict=False)]
    val = [b for b, _ in zip(dm.val_dataloader(), range(2), strict=False)]
    lm = make_lm(case)
    optimizer = lm.configure_optimizers()
    reference, reference_val = [], []
    for _epoch in range(STEPS // FIT_EPOCH_STEPS):
        for batch in train:
            optimizer.zero_grad(set_to_none=True)
            loss = lm.compute_loss(batch)
            loss.backward()
            optimizer.step()
            reference.append(loss.item())
        with torch.no_grad():
            reference_val.append(torch.stack([lm.compute_loss(b) for b in val]).mean().item())

    fitted = make_lm(case)  # built here, from the same seed as the reference (configure_model then keeps it)
    losses = _Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=PP, strategy=PipelineStrategy(pp=PP, schedule=case.schedule,
                                                               n_microbatches=MICROBATCHES),
        max_steps=STEPS, limit_train_batches=FIT_EPOCH_STEPS, limit_val_batches=2, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[losses], default_root_dir=root / name,
    )
    trainer.fit(fitted, data())
    return {"pipeline": losses.train, "reference": reference, "val": losses.val, "reference_val": reference_val}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--fit", nargs="*", default=list(FIT_CASES), help="cases through Trainer.fit")
    parser.add_argument("--cache", default=None, help="datasets cache for the fit cases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (PP, 1), mesh_dim_names=("pp", "dp"))
    references: dict[tuple, dict] = {}
    results = {}
    for name in args.cases:
        case = CASES[name]
        all_batches = make_batches("tuple" if case.batches == "tuple" else case.batches, STEPS + 1)
        batches, eval_batch = all_batches[:STEPS], all_batches[STEPS]
        start = time.perf_counter()
        if case.reference_key() not in references:
            references[case.reference_key()] = run_reference(case, batches, eval_batch)
        reference = references[case.reference_key()]
        reference_seconds = time.perf_counter() - start
        start = time.perf_counter()
        pipeline = run_pipeline(case, batches, eval_batch, mesh)
        seconds = time.perf_counter() - start
        names = [None] * PP
        dist.all_gather_object(names, pipeline["names"])
        result = {
            "pipeline": pipeline["losses"], "reference": reference["losses"], "seconds": seconds,
            "reference_seconds": reference_seconds, "units_by_stage": pipeline["units_by_stage"],
            "source": pipeline["source"], "rank_names": names,
            "reference_names": reference["names"],
        }
        if case.evaluate:
            result["eval_loss"] = [pipeline["eval_loss"], reference["eval_loss"]]
            diff = (pipeline["logits"] - reference["logits"]).abs().max().item()
            result["logits_max_abs_diff"] = diff
            result["logits_max_abs"] = reference["logits"].abs().max().item()
            result["logits_shape"] = list(pipeline["logits"].shape)
        if "errors" in pipeline:
            result["errors"] = pipeline["errors"]
        if "eval_loss_unmasked" in reference:
            result["eval_loss_unmasked"] = reference["eval_loss_unmasked"]
        results[name] = result
        if rank == 0:
            print(f"{name}: {seconds:.1f} s (reference {reference_seconds:.1f} s), first losses "
                  f"{result['pipeline'][:2]} vs {result['reference'][:2]}", flush=True)
    for name in args.fit:
        start = time.perf_counter()
        results[name] = fit_case(name, args.cache, Path(args.out).parent)
        results[name]["seconds"] = time.perf_counter() - start
        if rank == 0:
            print(f"{name}: {results[name]['seconds']:.1f} s (with the reference), first losses "
                  f"{results[name]['pipeline'][:2]} vs {results[name]['reference'][:2]}", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
