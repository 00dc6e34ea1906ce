"""A LightningModule written the Hugging Face way -- ``loss = self.model(**batch).loss``, no ``loss_fn`` -- trained
through ``Trainer.fit`` under pipeline layouts, next to one process on the same batches.

Run under torchrun (``tests.harness.launch_matrix``) on 2 ranks (pp2) or 4 (tp2 x pp2);
``tests/launch/test_pipeline_hf_loss.py`` reads what it writes. The batches are padded on the left and carry ``-100``
labels over a "prompt" of each row, in amounts that differ from row to row, so the micro-batches hold different
numbers of counted tokens: the batch loss is the token mean over the whole batch only if the pipeline weighs each
micro-batch by its tokens. Rank 0 also trains the reference (the same module and seed, one process,
``self.model(**batch).loss`` on the whole batch).

The error cases run the fit with a step the pipeline cannot split and record what each rank raised.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import close_process_group, every_ranks_error
from tests.launch.pipeline_any_model import corpus_blocks

SEED = 1234
STEPS = 6
VAL_BATCHES = 2
BATCH = 8
MICROBATCHES = 4  # 2 rows each
LR = {"sgd": 0.5, "adamw": 3e-3}


class HFStyleLM(L.LightningModule):
    """A tiny Hugging Face causal LM (config built here, no download) trained as its documentation shows: dict
    batches, ``self.model(**batch).loss``. No ``loss_fn``, no ``compute_loss``.

    ``step``: ``"hf"`` (the above); ``"scaled"`` returns ``2 * loss``, ``"no_labels"`` calls the model without
    labels and computes its own cross-entropy -- two steps a pipeline cannot split. ``arch="plain"``: a model that
    is not a Hugging Face one (it has no loss of its own), for the error a pipeline gives at setup."""

    def __init__(self, arch: str = "llama", optimizer: str = "sgd", lr: float | None = None, step: str = "hf",
                 aux: float = 0.0):
        super().__init__()
        self.arch, self.optimizer, self.step, self.aux = arch, optimizer, step, aux
        self.lr = lr if lr is not None else LR[optimizer]
        self.model = None

    def configure_model(self):
        if self.model is None:
            import transformers

            if self.arch == "plain":  # not a Hugging Face model: no loss of its own
                from tests.launch.pipeline_any_model import PlainLM

                self.model = PlainLM(vocab=256)
                return
            if self.arch in MOE_ARCHS:  # a tiny mixture-of-experts model, its load-balancing loss at `aux`
                from tests.launch.hf_moe import moe_model

                self.model = moe_model(self.arch, self.aux)
                return
            config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                     "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[self.arch]
            config = getattr(transformers, config_cls)(vocab_size=256, hidden_size=32, num_hidden_layers=4,
                                                       num_attention_heads=4, num_key_value_heads=2,
                                                       intermediate_size=64, max_position_embeddings=64)
            self.model = getattr(transformers, model_cls)(config)

    def training_step(self, batch, batch_idx):
        if self.step == "no_labels":
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
        loss = self.model(**batch).loss
        self.log("train/loss", loss, batch_size=BATCH)
        return 2 * loss if self.step == "scaled" else loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.model(**batch).loss, batch_size=BATCH, sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


class RowsDataModule(L.LightningDataModule):
    """The padded rows of :func:`make_rows` as dict batches, for a launch through the CLI."""

    def train_dataloader(self):
        return torch.utils.data.DataLoader(make_rows(2), batch_size=BATCH)


@dataclass(frozen=True)
class Case:
    arch: str
    optimizer: str
    strategy: dict[str, Any] = field(default_factory=dict)  # Hybrid3DStrategy when it has tp, else Pipeline
    world: int = 2
    accumulate: int = 1
    step: str = "hf"
    full: bool = False  # in the full run only (pytest --full)
    microbatches: int = MICROBATCHES
    aux: float = 0.0  # a mixture-of-experts model's router_aux_loss_coef
    lr: float | None = None


#: mixture-of-experts models (tests/launch/hf_moe.py's tiny ones)
MOE_ARCHS = ("qwen3_moe", "mixtral")
#: their load-balancing loss under pp2 (1F1B, 2 micro-batches): each layer's term on its stage, against one process
#: computing the same (:func:`balancing_reference`); the default set runs the first
BALANCING_CASES: dict[str, Case] = {
    f"{arch}_aux_1f1b_sgd": Case(arch, "sgd", {"schedule": "1f1b"}, microbatches=2, aux=0.2, lr=0.2,
                                 full=arch != "qwen3_moe")
    for arch in MOE_ARCHS
}


CASES: dict[str, Case] = {
    # pp2
    "llama_1f1b_sgd": Case("llama", "sgd", {"schedule": "1f1b"}),
    "qwen2_zbv_adamw": Case("qwen2", "adamw", {"schedule": "zbv"}),
    "llama_zbv_adamw": Case("llama", "adamw", {"schedule": "zbv"}, full=True),
    "qwen2_1f1b_sgd": Case("qwen2", "sgd", {"schedule": "1f1b"}, full=True),
    "llama_gpipe_sgd": Case("llama", "sgd", {"schedule": "gpipe"}, full=True),
    "llama_interleaved_1f1b_sgd": Case("llama", "sgd", {"schedule": "interleaved_1f1b"}, full=True),
    "llama_looped_bfs_sgd": Case("llama", "sgd", {"schedule": "looped_bfs"}, full=True),
    "llama_zero_bubble_sgd": Case("llama", "sgd", {"schedule": "zero_bubble"}, full=True),
    "llama_dualpipev_sgd": Case("llama", "sgd", {"schedule": "dualpipev"}, full=True),
    "qwen2_1f1b_sgd_accumulate2": Case("qwen2", "sgd", {"schedule": "1f1b"}, accumulate=2, full=True),
    # tp2 x pp2
    "llama_tp2_pp2_1f1b_adamw": Case("llama", "adamw", {"tp": 2, "schedule": "1f1b"}, world=4, full=True),
    "qwen2_tp2_pp2_zbv_sgd": Case("qwen2", "sgd", {"tp": 2, "schedule": "zbv"}, world=4, full=True),
    "llama_tp2_pp2_zbv_sgd": Case("llama", "sgd", {"tp": 2, "schedule": "zbv"}, world=4, full=True),
    "qwen2_tp2_pp2_1f1b_adamw": Case("qwen2", "adamw", {"tp": 2, "schedule": "1f1b"}, world=4, full=True),
}
#: steps the pipeline cannot split: (case, the start of the error every rank must raise)
ERROR_CASES: dict[str, tuple[Case, str]] = {
    "scaled_loss": (Case("llama", "sgd", {"schedule": "1f1b"}, step="scaled"),
                    "HFStyleLM.training_step returned a loss other than the model's `.loss`"),
    "no_labels": (Case("llama", "sgd", {"schedule": "1f1b"}, step="no_labels"),
                  "under pipeline parallel the model call in training_step runs forward and backward"),
}


def make_rows(n_batches: int) -> list[dict[str, torch.Tensor]]:
    """``n_batches * BATCH`` rows of real text, each padded on the left (mask 0, label -100) and with a "prompt"
    whose labels are -100: a different number of counted tokens per row, and per micro-batch."""
    blocks = corpus_blocks(n_batches * BATCH)
    generator = torch.Generator().manual_seed(SEED)
    rows = []
    for i, ids in enumerate(blocks):
        pad = [0, 22, 3, 26, 8, 0, 17, 12][(i + i // BATCH) % BATCH]  # rotated per batch
        prompt = int(torch.randint(0, 5, (), generator=generator))
        ids, mask = ids.clone(), torch.ones_like(ids)
        labels = ids.clone()
        ids[:pad], mask[:pad] = 0, 0
        labels[:pad + prompt] = -100
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return rows


def batches_of(rows: list[dict]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.stack([r[k] for r in rows[i:i + BATCH]]) for k in rows[0]} for i in range(0, len(rows), BATCH)]


def make_lm(case: Case) -> HFStyleLM:
    torch.manual_seed(SEED)
    lm = HFStyleLM(case.arch, case.optimizer, lr=case.lr, step=case.step, aux=case.aux)
    lm.configure_model()
    return lm


def reference(case: Case, train: list[dict], val: list[dict]) -> dict:
    """One process: the module's own step on whole batches, its optimizer, Lightning's accumulation; the loss of each
    optimizer step is the mean over its accumulated batches (what lightning-par logs for it)."""
    lm = make_lm(case)
    optimizer = lm.configure_optimizers()
    losses, accumulated = [], []
    for i, batch in enumerate(train):
        loss = lm.model(**batch).loss
        (loss / case.accumulate).backward()
        accumulated.append(loss.item())
        if (i + 1) % case.accumulate == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(sum(accumulated) / len(accumulated))
            accumulated.clear()
    with torch.no_grad():
        val_loss = torch.stack([lm.model(**b).loss for b in val]).mean().item()
        # what a mean of micro-batch means would give on the first validation batch (the test must be able to fail)
        micro = [{k: v[j:j + BATCH // MICROBATCHES] for k, v in val[0].items()}
                 for j in range(0, BATCH, BATCH // MICROBATCHES)]
        mean_of_means = torch.stack([lm.model(**b).loss for b in micro]).mean().item()
        token_mean = lm.model(**val[0]).loss.item()
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in micro]
    return {"losses": losses, "val": val_loss, "mean_of_means": mean_of_means, "token_mean": token_mean,
            "micro_counts": counts}


def balancing_reference(case: Case, train: list[dict], coefficient: float, trained: bool = True) -> list[float]:
    """One process, the semantics a pipeline gives a mixture-of-experts model's load-balancing loss: per batch, the
    language-model loss (the token mean over the batch) plus the mean over the micro-batches of ``coefficient`` x
    the sum over the layers of the model's own ``load_balancing_loss_func`` of that layer's router logits of the
    micro-batch (its rows' mask) -- Megatron's per-layer term, not transformers' one loss over all layers.
    ``trained=False``: the term added to the logged loss only (no gradient), as a pipeline that dropped it from the
    backward would log it."""
    import sys

    lm = make_lm(case)
    model, optimizer = lm.model, lm.configure_optimizers()
    function = sys.modules[type(model).__module__].load_balancing_loss_func
    m, losses = case.microbatches, []
    for batch in train:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
        loss = model.loss_function(out.logits, batch["labels"], model.config.vocab_size)
        rows = batch["input_ids"].size(0) // m
        span = rows * batch["input_ids"].size(1)  # a micro-batch's rows of each layer's [tokens, experts] logits
        terms = [sum(function((x[j * span:(j + 1) * span],), model.num_experts, model.num_experts_per_tok,
                              batch["attention_mask"][j * rows:(j + 1) * rows]) for x in out.router_logits)
                 for j in range(m)]
        term = coefficient * torch.stack(terms).mean()
        loss = loss + (term if trained else term.detach())
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


class _Losses(L.Callback):
    def __init__(self):
        self.train: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # what each optimizer step logged (under accumulation: the mean over its batches, at its last one)
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.train.append(float(trainer.callback_metrics["train/loss"]))

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append(float(trainer.callback_metrics["val/loss"]))


def fit(case: Case, rows: list[dict], val_rows: list[dict], root: Path, heartbeat: bool = True) -> _Losses:
    from lightning_par import Hybrid3DStrategy, PipelineStrategy

    options = dict(case.strategy, pp=2, n_microbatches=case.microbatches)
    if not heartbeat:
        options["heartbeat_timeout"] = None
    strategy = Hybrid3DStrategy(**options) if "tp" in options else PipelineStrategy(**options)
    losses = _Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=case.world, strategy=strategy, max_epochs=1,
        limit_train_batches=STEPS * case.accumulate, limit_val_batches=VAL_BATCHES, num_sanity_val_steps=0,
        accumulate_grad_batches=case.accumulate, use_distributed_sampler=False,  # dp=1, batches in order
        logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses], default_root_dir=root,
    )
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False)
    val_loader = torch.utils.data.DataLoader(val_rows, batch_size=BATCH, shuffle=False)
    trainer.fit(make_lm(case), loader, val_loader)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=[])
    parser.add_argument("--errors", nargs="*", default=[])
    parser.add_argument("--balancing", nargs="*", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {}
    root = Path(args.out).parent
    for name in args.cases:
        case = CASES[name]
        assert case.world == world, f"{name} runs on {case.world} ranks, this launch has {world}"
        rows = make_rows(STEPS * case.accumulate + VAL_BATCHES)
        train_rows, val_rows = rows[:-VAL_BATCHES * BATCH], rows[-VAL_BATCHES * BATCH:]
        start = time.perf_counter()
        losses = fit(case, train_rows, val_rows, root / name)
        seconds = time.perf_counter() - start
        if rank == 0:
            ref_start = time.perf_counter()
            ref = reference(case, batches_of(train_rows), batches_of(val_rows))
            results[name] = {"pipeline": losses.train, "val": losses.val, "reference": ref["losses"],
                             "reference_val": ref["val"], "seconds": seconds,
                             "reference_seconds": time.perf_counter() - ref_start,
                             **{k: ref[k] for k in ("mean_of_means", "token_mean", "micro_counts")}}
            print(f"{name}: {seconds:.1f} s, losses {losses.train[:3]} vs {ref['losses'][:3]}", flush=True)
    for name in args.balancing:
        case = BALANCING_CASES[name]
        train_rows = make_rows(STEPS)
        start = time.perf_counter()
        losses = fit(case, train_rows, train_rows[:BATCH], root / name)
        seconds = time.perf_counter() - start
        if rank == 0:
            batches = batches_of(train_rows)
            results[name] = {"pipeline": losses.train, "seconds": seconds,
                             "reference": balancing_reference(case, batches, case.aux),
                             "without_term": balancing_reference(case, batches, 0.0),
                             "term_not_trained": balancing_reference(case, batches, case.aux, trained=False)}
            print(f"{name}: {seconds:.1f} s, losses {losses.train[:3]} vs {results[name]['reference'][:3]}", flush=True)
    for name in args.errors:
        case, _ = ERROR_CASES[name]
        rows = make_rows(2)
        errors = every_ranks_error(partial(fit, case, rows[:BATCH], rows[BATCH:], root / name, heartbeat=False))
        if rank == 0:
            results[name] = {"errors": errors}
            print(f"{name}: {errors[0][:160]}", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
