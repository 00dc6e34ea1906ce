"""The conformance matrix: every causal LM of the installed transformers under each layout, against one process.

Each architecture is built from its own config class's defaults shrunk to tiny sizes by one rule for all
(:func:`tiny_config`: the size fields any config may have, nothing written per architecture), on the meta-free CPU,
from a fixed seed. Its cells:

==========  ======  =====================================================================================
layout      ranks   where
==========  ======  =====================================================================================
zero3       2       every architecture (ZeRO-3 over dp2)
tp2         2       those publishing a tp plan (``base_model_tp_plan``), from that plan
pp2         2       those publishing a pp plan (``base_model_pp_plan``): 1F1B, 2 micro-batches
ep2         2       those publishing an ep plan (expert parallel from it, the experts over 2 ranks)
cp2         2       every architecture (context parallel: the sequence over 2 ranks)
tp2_pp2     4       those publishing both
==========  ======  =====================================================================================

A cell is ``parity`` (each of the :data:`STEPS` per-step losses of ``Trainer.fit`` within :data:`RTOL` of one
process's, plain SGD), ``refused: <the first line of lightning-par's setup error>``, or ``fails: <what happened>``
(a wrong loss, a crash: a bug). An architecture whose tiny model cannot run one forward in one process is listed as
``not built`` with the reason (nothing to compare with).

Each layout is one launch of this file as a worker (``--worker``) over all its architectures, one after another; a
case that raises is recorded and the launch goes on; a launch that dies is started again after the case it died in.
Writes a JSON of every cell and (``--markdown``) the table with the counts per layout::

    python benchmarks/hf_matrix.py --markdown docs/models-matrix.md     # everything (about half an hour on 2 cores)
    python benchmarks/hf_matrix.py --archs llama qwen3_moe --layouts tp2 ep2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SEED = 1234
STEPS = 4
BATCH = 4
SEQ = 32
LR = 0.05
RTOL = 1e-5
#: the dtype the models are built in; a cell that misses :data:`RTOL` in float32 is run again in float64
#: (``--dtype``), which tells float32 rounding (gone in float64) from a layout's error (stays)
DTYPE = torch.float32
LAYOUTS: dict[str, dict[str, Any]] = {
    "zero3": {"zero_stage": 3},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "ep2": {"ep": 2},
    "cp2": {"cp": 2},
    "tp2_pp2": {"tp": 2, "pp": 2},
}
#: ranks of each layout's launch
WORLD = {name: 4 if name == "tp2_pp2" else 2 for name in LAYOUTS}

#: the one shrinking rule: each field a config has is set to this (sizes small enough for CPU, divisible by 2 and 4)
TINY: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "sliding_window": 16, "attention_chunk_size": 16, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "attention_dropout": 0.0, "hidden_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
    "attn_pdrop": 0.0, "dropout": 0.0, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
    "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 128, "n_inner": 128, "d_model": 64, "n_heads": 4,
    "n_layers": 2, "num_layers": 2, "ffn_hidden_size": 128, "d_ff": 128, "num_kv_heads": 2, "rotary_dim": 8,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_encoder_layers": 2, "num_decoder_layers": 2,
    "projection_dim": 64, "vision_hidden_size": 64, "text_hidden_size": 64,
}


#: words naming a config's random parts (a float of that name is set to 0): the comparison is of one function
_RANDOM = ("dropout", "pdrop", "layerdrop", "jitter", "drop_path", "noise")


def causal_lms() -> dict[str, str]:
    """``{model type: causal-LM class name}`` of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    """``model_type``'s config from its class defaults with every :data:`TINY` field it has set to the tiny size; a
    per-layer list (``layer_types``) keeps the shortest prefix that holds each kind of layer the default has."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return _shrunk(CONFIG_MAPPING[model_type]())


def _settable(config, name: str) -> bool:
    """A field the constructor takes: present, not None, not a read-only property derived from others."""
    attribute = getattr(type(config), name, None)
    if isinstance(attribute, property) and attribute.fset is None:
        return False
    try:
        return getattr(config, name) is not None
    except Exception:  # noqa: BLE001 -- (a per-layer attribute transformers refuses to read globally)
        return False


def _shrunk(default):
    """``default``'s class built again with the :data:`TINY` sizes, its sub-configs (text, vision...) shrunk alike."""
    from transformers import PretrainedConfig

    fields = {k: v for k, v in TINY.items() if _settable(default, k)
              and (isinstance(v, float) == isinstance(getattr(default, k), float))}  # (a field typed int stays int)
    if isinstance(fields.get("eos_token_id"), int) and isinstance(default.eos_token_id, list):
        fields["eos_token_id"] = [2]
    if "qk_rope_head_dim" in fields and "head_dim" in fields:  # (MLA: the rope width is the head_dim rope uses)
        fields["head_dim"] = fields["qk_rope_head_dim"]
    layer_types = getattr(default, "layer_types", None) if _settable(default, "layer_types") else None
    if isinstance(layer_types, (list, tuple)) and layer_types:
        kinds, n = set(layer_types), 0
        while set(layer_types[:n]) != kinds:
            n += 1
        n = max(n, 2)
        fields["layer_types"], fields["num_hidden_layers"] = list(layer_types[:n]), n
    for name, value in vars(default).items():  # every random part off (dropout, layer drop, router jitter): the
        if isinstance(value, float) and any(w in name for w in _RANDOM) and _settable(default, name):  # same function
            fields[name] = 0.0
    if _settable(default, "output_router_logits"):  # the load-balancing loss off: one function for every layout
        fields["output_router_logits"] = False
    for name, value in vars(default).items():
        if isinstance(value, PretrainedConfig):
            fields[name] = _shrunk(value)
    return type(default)(**fields)


#: a tiny model larger than this kept a size the rule does not shrink (counted on the meta device first)
MAX_PARAMETERS = 20_000_000


def build(model_type: str):
    """The tiny model from :data:`SEED` (float32, CPU, the attention transformers picks: sdpa where it can)."""
    import transformers

    config = tiny_config(model_type)
    cls = getattr(transformers, causal_lms()[model_type])
    if not isinstance(config, cls.config_class):  # (a composite config whose causal LM is its text model's)
        config = config.get_text_config()
    with torch.device("meta"):
        count = sum(p.numel() for p in cls(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still builds {count / 1e6:.0f}M parameters (a size field the one rule "
                         "does not shrink)")
    torch.manual_seed(SEED)
    return cls(config).to(DTYPE)


def batches() -> list[dict[str, torch.Tensor]]:
    """:data:`STEPS` batches of :data:`BATCH` rows of real text (bytes of the standard library's argparse.py)."""
    import sysconfig

    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_bytes()
    ids = torch.tensor(list(text[: STEPS * BATCH * SEQ]), dtype=torch.long).view(STEPS, BATCH, SEQ)
    return [{"input_ids": b, "labels": b.clone()} for b in ids]


def reference(model_type: str) -> list[float]:
    """One process: plain SGD on whole batches, the model's own loss."""
    model = build(model_type)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches():
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def published(model_type: str) -> dict[str, bool]:
    """Which plans the architecture publishes (its config class's, and the head's tp plan)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return {kind: bool(getattr(cls, f"base_model_{kind}_plan", None)) for kind in ("tp", "pp", "ep")}


def layouts_for(model_type: str) -> list[str]:
    plans = published(model_type)
    out = ["zero3"]
    out += ["tp2"] if plans["tp"] else []
    out += ["pp2"] if plans["pp"] else []
    out += ["ep2"] if plans["ep"] else []
    out += ["cp2"]
    out += ["tp2_pp2"] if plans["tp"] and plans["pp"] else []
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The worker: one layout, many architectures, one launch
# ---------------------------------------------------------------------------------------------------------------------
def _module(model_type: str):
    import lightning as L

    class MatrixLM(L.LightningModule):
        """A tiny Hugging Face causal LM trained as its documentation shows: ``self.model(**batch).loss``."""

        def __init__(self):
            super().__init__()
            self.model = None

        def configure_model(self):
            if self.model is None:
                self.model = build(model_type)

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.log("train/loss", loss, batch_size=batch["input_ids"].size(0), sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return MatrixLM()


class _Losses:
    def __init__(self):
        import lightning as L

        class Record(L.Callback):
            def __init__(self):
                self.losses: list[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.losses.append(float(trainer.callback_metrics["train/loss"]))

        self.callback = Record()


def strategy_for(layout: dict[str, Any]):
    from lightning_par import LayoutStrategy

    options: dict[str, Any] = {"heartbeat_timeout": None}
    if "pp" in layout:
        options.update(schedule="1f1b", n_microbatches=2)
    return LayoutStrategy(**layout, **options)


def fit(model_type: str, layout: dict[str, Any]) -> list[float]:
    import lightning as L
    import torch.distributed as dist

    world, tp, cp, pp = dist.get_world_size(), layout.get("tp", 1), layout.get("cp", 1), layout.get("pp", 1)
    dp = world // (tp * cp * pp)
    dp_rank = dist.get_rank() // (tp * cp) % dp  # (the mesh is (pp, dp, cp, tp), tp innermost)
    record = _Losses().callback
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy_for(layout), max_epochs=1,
                        num_sanity_val_steps=0, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record])
    rows = [{k: v[r] for k, v in b.items()} for b in batches() for r in range(BATCH)]
    loader = torch.utils.data.DataLoader(rows[dp_rank::dp], batch_size=BATCH // dp, shuffle=False)
    trainer.fit(_module(model_type), loader)
    return record.losses


def worker(layout_name: str, archs: list[str], out: Path, dtype: str) -> None:
    """Fit each architecture under ``layout_name`` in this launch, appending one JSON line per architecture."""
    import torch.distributed as dist

    from tests.harness import case_or_error, close_process_group

    global DTYPE
    DTYPE = getattr(torch, dtype)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for model_type in archs:
        if rank == 0:
            with out.open("a") as f:
                f.write(json.dumps({"arch": model_type, "started": True}) + "\n")
        start = time.perf_counter()
        losses, error = case_or_error(lambda m=model_type: fit(m, LAYOUTS[layout_name]))
        if rank == 0:
            with out.open("a") as f:
                f.write(json.dumps({"arch": model_type, "losses": losses, "error": error,
                                    "seconds": round(time.perf_counter() - start, 1)}) + "\n")
    close_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Built:
    reference: list[float] | None
    error: str | None
    layouts: list[str]


def probe(model_type: str) -> Built:
    """Build the tiny model and run the one-process reference; the error in one line where it cannot."""
    try:
        losses = reference(model_type)
    except Exception as err:  # noqa: BLE001 -- the row says why
        return Built(None, _one_line(err), [])
    if not all(torch.isfinite(torch.tensor(losses))):
        return Built(None, f"non-finite one-process loss {losses}", [])
    return Built(losses, None, layouts_for(model_type))


def _one_line(err: BaseException | str) -> str:
    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    return " ".join(text.split())[:300]


def classify(cell: dict[str, Any], ref: list[float]) -> str:
    """``parity``, ``refused: ...`` (a lightning-par LayoutError at setup) or ``fails: ...``."""
    error = cell.get("error")
    if error:
        message = error.partition(": ")[2] if error.startswith("rank ") else error
        if message.startswith(("LayoutError", "lightning_par.topology.LayoutError")):
            return "refused: " + _one_line(message.partition(": ")[2])
        return "fails: " + _one_line(message)
    losses = cell.get("losses") or []
    if len(losses) != len(ref):
        return f"fails: {len(losses)} steps logged of {len(ref)}"
    # a reference whose loss jumps up (SGD diverging on this tiny model) amplifies rounding from that step on:
    # the steps up to the jump are compared, and the cell says so
    jump = next((i for i in range(1, len(ref)) if ref[i] > 1.1 * ref[i - 1]), len(ref))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[:jump], ref[:jump], strict=True))
    if worst > RTOL:
        return f"fails: loss off by {worst:.1e} (relative)"
    return "parity" if jump == len(ref) else f"unstable: parity for {jump} steps, then the reference diverges"


def verdict(row: dict[str, Any], layout: str) -> str:
    """The cell of ``row`` under ``layout``: :func:`classify` of its float32 run, and where that missed only the
    tolerance, of its float64 run too: ``float64 parity: ...`` when the layout matches one process there (the float32
    difference was rounding, which a tiny model that plain SGD drives hard amplifies), else the float32 failure."""
    cell = classify(row["raw"][layout], row["reference"])
    again = row.get("raw64", {}).get(layout)
    if not cell.startswith("fails: loss off by") or again is None or row.get("reference64") is None:
        return cell
    in64 = classify(again, row["reference64"])
    if in64.startswith(("parity", "unstable")):
        return f"float64 parity: in float32 {cell.removeprefix('fails: ')}; in float64 {in64}"
    return f"{cell}; in float64 {in64.removeprefix('fails: ')}"


def run_layout(layout: str, archs: list[str], root: Path, timeout: float,
               dtype: str = "float32") -> dict[str, dict[str, Any]]:
    """One launch (again after a case it died in) of the worker over ``archs``: ``{arch: cell}``."""
    results: dict[str, dict[str, Any]] = {}
    todo = list(archs)
    while todo:
        lines = root / f"{layout}-{dtype}.jsonl"
        lines.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD[layout]}",
               str(Path(__file__).resolve()), "--worker", layout, "--dtype", dtype, "--out", str(lines),
               "--archs", *todo]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        log = root / f"{layout}-{dtype}.log"
        with log.open("a") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            died = "the launch died"
            while proc.poll() is None:  # a case that runs past `timeout` is taken as hung: the launch is ended
                time.sleep(2)
                if lines.exists() and time.time() - lines.stat().st_mtime > timeout:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    died = f"the case hung (the launch ended after {timeout:.0f} s without progress)"
        started = None
        for line in lines.read_text().splitlines() if lines.exists() else []:
            record = json.loads(line)
            if record.get("started"):
                started = record["arch"]
            else:
                results[record["arch"]] = record
                started = None
        if started is not None:
            results[started] = {"arch": started, "error": f"{died} in this case (see {log.name})"}
        done = set(results)
        todo = [a for a in todo if a not in done]
        if started is None and todo:  # died before the first case: nothing more to learn from a relaunch
            for arch in todo:
                results[arch] = {"arch": arch, "error": f"{died} before this case (see {log.name})"}
            todo = []
    return results


def markdown(rows: dict[str, dict[str, Any]], layouts: list[str], meta: dict[str, Any]) -> str:
    counts = {name: {"parity": 0, "float64 parity": 0, "unstable": 0, "refused": 0, "fails": 0, "cells": 0}
              for name in layouts}
    lines = [f"| architecture | {' | '.join(layouts)} |", f"|---|{'---|' * len(layouts)}"]
    for arch in sorted(rows):
        row = rows[arch]
        if row.get("not_built"):
            lines.append(f"| {arch} | not built: {row['not_built']} |{' |' * (len(layouts) - 1)}")
            continue
        cells = []
        for name in layouts:
            cell = row["cells"].get(name)
            if cell is None:
                cells.append("–")
                continue
            kind = cell.split(":")[0]
            counts[name][kind] += 1
            counts[name]["cells"] += 1
            cells.append(cell.replace("|", "\\|"))
        lines.append(f"| {arch} | {' | '.join(cells)} |")
    built = sum(1 for r in rows.values() if not r.get("not_built"))
    head = [
        "# Every causal LM of transformers under each layout",
        "",
        f"Generated by `python benchmarks/hf_matrix.py --markdown docs/models-matrix.md` on {meta['date']}: "
        f"transformers "
        f"{meta['transformers']}, torch {meta['torch']}, lightning {meta['lightning']}; {len(rows)} causal-LM "
        f"architectures, {built} built from their config defaults shrunk to tiny sizes (one rule for all, "
        f"`hf_matrix.TINY`), {STEPS} steps of plain SGD against one process, parity within {RTOL:g} per step "
        f"(relative). {meta['seconds'] / 60:.0f} min on {meta['machine']}."
        + "".join(f" Re-run on {u['date']} (`--update`, {u['seconds'] / 60:.0f} min): {', '.join(u['layouts'])} of "
                  f"{', '.join(u['archs'])}." for u in meta.get("updates", ())),
        "",
        "| layout | cells | parity | float64 parity | unstable | refused | fails |",
        "|---|---|---|---|---|---|---|",
        *(f"| {n} | {c['cells']} | {c['parity']} ({100 * c['parity'] / max(c['cells'], 1):.0f}%) "
          f"| {c['float64 parity']} | {c['unstable']} | {c['refused']} | {c['fails']} |" for n, c in counts.items()),
        "",
        "A cell is `parity`, `float64 parity` (the float32 run missed the tolerance and the same cell run again in "
        "float64, model and one-process reference alike, is at parity: the float32 difference is rounding), "
        "`unstable` (parity until the one-process reference's loss jumps up -- plain SGD "
        "diverging on that tiny model -- after which rounding is amplified and the steps are not compared), "
        "`refused: <lightning-par's setup error>` or `fails: <what happened>`; `–`: the architecture publishes no "
        "plan for that layout. `not built`: the one rule's tiny config of that architecture does not build or run "
        "in one process (nothing to compare with).",
        "",
    ]
    return "\n".join(head + lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", nargs="*", help="model types (default: every causal LM of the installed "
                                                   "transformers)")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "hf_matrix.json"))
    parser.add_argument("--markdown", help="also write the table here (docs/models.md)")
    parser.add_argument("--root", default="/tmp/hf_matrix", help="launch logs")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a case may run before it counts as hung")
    parser.add_argument("--reclassify", help="a JSON this wrote: classify its cells again and write the table")
    parser.add_argument("--update", action="store_true",
                        help="run only --archs x --layouts and replace those cells in --json (the rest kept, the "
                             "update listed in its meta)")
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.archs, Path(args.out), args.dtype)
        return
    if args.reclassify:
        saved = json.loads(Path(args.reclassify).read_text())
        for row in saved["rows"].values():
            for layout in row.get("raw", {}):
                row["cells"][layout] = verdict(row, layout)
        Path(args.reclassify).write_text(json.dumps(saved, indent=1))
        table = markdown(saved["rows"], saved["layouts"], saved["meta"])
        print(table)
        if args.markdown:
            Path(args.markdown).write_text(table)
        return
    import lightning
    import transformers

    torch.set_num_threads(1)
    start = time.perf_counter()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    archs = args.archs or sorted(causal_lms())
    rows: dict[str, dict[str, Any]] = {}
    for arch in archs:
        built = probe(arch)
        rows[arch] = {"reference": built.reference, "cells": {}, "layouts": built.layouts}
        if built.error:
            rows[arch]["not_built"] = built.error
        print(f"{arch}: {'built' if not built.error else 'not built: ' + built.error[:120]}", flush=True)
    for layout in args.layouts:
        todo = [a for a in archs if layout in rows[a]["layouts"]]
        if not todo:
            continue
        print(f"{layout}: {len(todo)} architectures in one launch of {WORLD[layout]} ranks", flush=True)
        for arch, cell in run_layout(layout, todo, root, args.timeout).items():
            rows[arch].setdefault("raw", {})[layout] = cell
            rows[arch]["cells"][layout] = verdict(rows[arch], layout)
            print(f"  {arch} {layout}: {rows[arch]['cells'][layout][:160]}", flush=True)
        again = [a for a in todo if rows[a]["cells"][layout].startswith("fails: loss off by")]
        if again:  # only the tolerance missed: the same cells in float64 (reference too) say rounding or a bug
            global DTYPE
            DTYPE = torch.float64
            for arch in again:
                rows[arch].setdefault("reference64", probe(arch).reference)
            DTYPE = torch.float32
            print(f"{layout}: {len(again)} architectures again in float64", flush=True)
            for arch, cell in run_layout(layout, again, root, args.timeout, dtype="float64").items():
                rows[arch].setdefault("raw64", {})[layout] = cell
                rows[arch]["cells"][layout] = verdict(rows[arch], layout)
                print(f"  {arch} {layout} float64: {rows[arch]['cells'][layout][:160]}", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "transformers": transformers.__version__, "torch": torch.__version__,
            "lightning": lightning.__version__, "seconds": time.perf_counter() - start,
            "machine": f"{os.cpu_count()} CPU cores (gloo)"}
    layouts = args.layouts
    if args.update:  # the re-run cells into the saved matrix, which must be of the same releases
        saved = json.loads(Path(args.json).read_text())
        if saved["meta"]["transformers"] != meta["transformers"]:
            raise SystemExit(f"--update: {args.json} is of transformers {saved['meta']['transformers']}, this run "
                             f"of {meta['transformers']}: run the whole matrix")
        for arch, row in rows.items():
            old = saved["rows"].setdefault(arch, row)
            old["cells"].update(row["cells"])
            for key in ("raw", "raw64"):
                old.setdefault(key, {}).update(row.get(key, {}))
            if row.get("reference64") is not None:
                old["reference64"] = row["reference64"]
        saved["meta"].setdefault("updates", []).append(
            {"date": meta["date"], "archs": archs, "layouts": args.layouts, "seconds": round(meta["seconds"])})
        rows, meta, layouts = saved["rows"], saved["meta"], saved["layouts"]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "layouts": layouts, "rows": rows}, indent=1))
    table = markdown(rows, layouts, meta)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)


if __name__ == "__main__":
    main()
