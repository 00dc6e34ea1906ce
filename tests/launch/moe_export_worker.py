"""``lightning-par export --hf`` of a Hugging Face MoE model trained under tensor parallel, in one torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m tests.launch.moe_export_worker OUT [--ep2] ARCH...

for tests/launch/test_moe_checkpoints.py. Per architecture (tiny configs of ``tests.launch.hf_moe``: qwen3_moe,
mixtral; their experts fused modules, ``gate_up_proj [E, 2f, d]``, ``down_proj [E, d, f]``): ``Trainer.fit`` of 2
AdamW steps under tp2 (the experts DTensors split by the model's own plan) saving a DCP checkpoint; then rank 0
exports it (``--hf``: the model's own fused tensors; ``--hf-original-format``: save_pretrained's conversion, one
tensor per expert), loads each directory with ``AutoModelForCausalLM.from_pretrained`` and writes ``OUT/ARCH.json``:
the exported weight files' tensor names and shapes; the loaded weights that differ from torch's own reading of the
checkpoint (``dcp_to_torch_save``) into the model as transformers builds it (none expected); the largest logit
difference against that model and against one process trained on the same batches. Then both ranks fine-tune from
the per-expert directory with ``FromPretrained`` under tp2 and under ZeRO-3 over dp2 (each rank reading only its
share of the fused experts), and rank 0 writes ``OUT/ARCH_pretrained.json``: their losses and one process's, started
from the same directory (and from its own initialisation: what a run that read nothing would log).

``--ep2``: the same under expert parallel instead of tp2 -- trained under ep2 (ZeRO-1: the experts' own partitioner;
each rank half of each batch, its 2 of the 4 experts), exported from that checkpoint, and fine-tuned from the
per-expert directory under ep2; each rank then also records which expert tensors of the files it read
(``ARCH_ep2_reads_rankR.json``). Files are ``ARCH_ep2.json`` and ``ARCH_ep2_pretrained.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.harness import close_process_group
from tests.launch.hf_moe import BATCH, HFMoELM, make_rows, moe_model

STEPS = 2


class ExportableMoELM(HFMoELM):
    """:class:`~tests.launch.hf_moe.HFMoELM` that saves its arguments, from which the export rebuilds the model."""

    def __init__(self, arch: str = "qwen3_moe", optimizer: str = "adamw"):
        super().__init__(arch, optimizer)
        self.save_hyperparameters()


def strategy(layout: str):
    from lightning_par import MegatronTPStrategy, ZeroStrategy

    return {"tp2": lambda: MegatronTPStrategy(tp=2), "zero3": lambda: ZeroStrategy(stage=3),
            "ep2": lambda: ZeroStrategy(stage=1, ep=2)}[layout]()


def main(out: Path, archs: list[str], layout: str = "tp2") -> None:
    dist.init_process_group("gloo")
    rows = make_rows(STEPS)
    dp = 1 if layout == "tp2" else 2
    for arch in archs:
        name = arch if layout == "tp2" else f"{arch}_{layout}"
        root = out / name
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy(layout), max_steps=STEPS,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False, default_root_dir=root,
                            callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1)])
        # tp: every rank the whole batch; ep: replica r rows r, r + 2, ... (its half of each batch)
        share = rows[dist.get_rank() % dp::dp]
        trainer.fit(ExportableMoELM(arch), torch.utils.data.DataLoader(share, batch_size=BATCH // dp, shuffle=False))
        dist.barrier()
        if dist.get_rank() == 0:
            (ckpt,) = sorted((root / "ckpt").glob(f"*step={STEPS}.ckpt"))
            (out / f"{name}.json").write_text(json.dumps(check_export(arch, ckpt, root, rows)))
        dist.barrier()
        # fine-tuning from the exported directory in its per-expert form: under tp2 and ZeRO-3 over dp2, or ep2
        tunes = ("tp2", "zero3") if layout == "tp2" else (layout,)
        losses = {tune: from_pretrained(arch, root / "original", rows, tune, root, out / name) for tune in tunes}
        losses["one_process"] = one_process_from(arch, root / "original", rows)  # every rank (load_pretrained gathers)
        losses["not_loaded"] = one_process_from(arch, None, rows)  # what the runs would log from their own init
        if dist.get_rank() == 0:
            (out / f"{name}_pretrained.json").write_text(json.dumps(losses))
    close_process_group()


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def from_pretrained(arch: str, directory: Path, rows: list[dict], layout: str, root: Path, out: Path) -> list[float]:
    """The losses of :data:`STEPS` AdamW steps started from ``directory`` by ``FromPretrained`` under ``layout``;
    under ep2 each rank writes ``OUT_reads_rankR.json``: the expert tensors of the files it read (name -> bytes)."""
    from lightning_par.plugins import pretrained

    dp = 1 if layout == "tp2" else 2
    record = _Losses()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_progress_bar=False,
                        strategy=strategy(layout),
                        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                        default_root_dir=root / layout, callbacks=[record, pretrained.FromPretrained(str(directory))])
    # replica r takes rows r, r + dp, ...: its share of each batch of one process
    share = rows[dist.get_rank() % dp::dp]
    reads: dict[str, int] = {}
    original = pretrained._SafetensorsFile.read

    def counted(self, name, slices):
        tensor = original(self, name, slices)
        if ".experts." in name:
            reads[name] = reads.get(name, 0) + tensor.numel() * tensor.element_size()
        return tensor

    pretrained._SafetensorsFile.read = counted
    try:
        trainer.fit(ExportableMoELM(arch), torch.utils.data.DataLoader(share, batch_size=BATCH // dp, shuffle=False))
    finally:
        pretrained._SafetensorsFile.read = original
    if layout == "ep2":
        Path(f"{out}_reads_rank{dist.get_rank()}.json").write_text(json.dumps(reads))
    return record.losses


def one_process_from(arch: str, directory: Path | None, rows: list[dict]) -> list[float]:
    from lightning_par.plugins.pretrained import load_pretrained

    lm = ExportableMoELM(arch)
    lm.configure_model()
    if directory is not None:
        load_pretrained(lm, directory)
    optimizer = lm.configure_optimizers()
    losses = []
    for i in range(0, len(rows), BATCH):
        batch = {k: torch.stack([r[k] for r in rows[i:i + BATCH]]) for k in rows[0]}
        loss = lm.model(**batch).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def check_export(arch: str, ckpt: Path, root: Path, rows: list[dict]) -> dict:
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from lightning_par.plugins.checkpoint_export import export_hf

    exported, names, reports = {}, {}, {}
    for style, original in (("fused", False), ("original", True)):
        reports[style] = export_hf(ckpt, root / style, model_class=f"{__name__}.ExportableMoELM",
                                   original_format=original).describe()
        exported[style] = AutoModelForCausalLM.from_pretrained(root / style).eval()
        names[style] = {}
        for file in sorted((root / style).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                names[style].update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})
    # the same checkpoint read by torch's own DCP reader, into the model as transformers builds it
    dcp_to_torch_save(ckpt, root / "dcp.pt")
    state = torch.load(root / "dcp.pt", weights_only=False)["state_dict"]
    read = moe_model(arch).eval()
    read.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    # one process trained on the same batches (AdamW, as the fit)
    trained = ExportableMoELM(arch)
    trained.configure_model()
    batches = [{k: torch.stack([r[k] for r in rows[i:i + BATCH]]) for k in rows[0]} for i in range(0, len(rows), BATCH)]
    optimizer = trained.configure_optimizers()
    for batch in batches:
        trained.model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    ids = batches[0]["input_ids"]
    with torch.no_grad():
        expected, one_process = read(ids).logits, trained.model.eval()(ids).logits
        out = {style: {"vs_dcp_reader": (model(ids).logits - expected).abs().max().item(),
                       "vs_one_process": (model(ids).logits - one_process).abs().max().item()}
               for style, model in exported.items()}
    want = read.state_dict()
    equal = {style: sorted(k for k, v in model.state_dict().items() if not torch.equal(v, want[k]))
             for style, model in exported.items()}
    return {"reports": reports, "names": names, "logits": out, "logit_scale": expected.abs().max().item(),
            "weights_not_equal": equal}

if __name__ == "__main__":
    args = sys.argv[2:]
    main(Path(sys.argv[1]), [a for a in args if a != "--ep2"], "ep2" if "--ep2" in args else "tp2")
