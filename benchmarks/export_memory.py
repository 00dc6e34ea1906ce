"""Peak memory of ``lightning-par export`` against the checkpoint's size: the export streams, one tensor at a time.

A Hugging Face Llama with random weights, tiny in depth but wide (vocabulary 32000, width 1024, MLP 4096, 12 layers,
16 heads / 4 kv heads: 248M parameters, 0.99 GB in fp32), is saved as lightning-par saves it: a sharded DCP directory
through ``sharded_checkpoint.save`` (the engine's format: DCP files, ``meta.json``, manifest; the model entries under
``state_dict.<name>``, the LightningModule class with the hyper-parameters, as the CLI saves them), and a single-file
Lightning checkpoint; model states only (an export never reads the optimizer's). One process saves each tensor in one
piece, read straight from its file; a ZeRO-3 or tensor-parallel checkpoint stores them in pieces, which DCP assembles
into the full tensor (that tensor plus one piece held).

Each export runs in a subprocess of its own (``python -m benchmarks.export_memory --child``): once torch,
transformers and lightning-par are imported it resets the kernel's peak-RSS mark (``/proc/self/clear_refs``; else it
polls ``/proc/self/status``), reads its RSS, runs the ``lightning-par export`` command's ``main``, and reads the peak
(``VmHWM``). Extra = peak - RSS before the export, against the checkpoint's model bytes and its largest tensor.

    python benchmarks/export_memory.py                     # ~1 minute on 2 cores, 3 GB of disk under $TMPDIR
    python benchmarks/export_memory.py --layers 2 --vocab 8000 --hidden 512 --intermediate 2048   # a smoke run
    python benchmarks/export_memory.py --baseline-rev REV  # also the export of git revision REV (e.g. the one
                                                           # before streaming) on the same checkpoints

Prints a table and writes ``benchmarks/results/export_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HF_CLASS = "lightning_par.examples.HFLlamaLightningModule"
#: the benchmark's model: HFLlamaLightningModule arguments
WIDE_LLAMA = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "n_layers": 12, "n_heads": 16,
              "n_kv_heads": 4, "max_position_embeddings": 256}
_MARK = "EXPORT_MEMORY "


# -- the checkpoint ----------------------------------------------------------------------------------------------------
def build_checkpoint(path: Path, fmt: str, model: dict, seed: int = 0) -> dict:
    """Save a random-weight ``HFLlamaLightningModule(**model)`` at ``path`` as lightning-par does: ``fmt`` "dcp"
    (``sharded_checkpoint.save`` by one process, the engine's sharded format) or "single_file" (what Lightning's
    one-process save holds); return the model's tensor count, bytes and largest tensor's bytes."""
    import torch

    from lightning_par.examples import HFLlamaLightningModule
    from lightning_par.plugins import sharded_checkpoint

    torch.manual_seed(seed)
    lm = HFLlamaLightningModule(**model)
    lm.configure_model()
    state = lm.state_dict()
    sizes = [t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values()]
    hparams = {**dict(lm.hparams), "_class_path": HF_CLASS}  # as the lightning-par CLI saves them
    checkpoint = {"state_dict": state, "hyper_parameters": hparams, "epoch": 0, "global_step": 0}
    if fmt == "dcp":
        import warnings

        with warnings.catch_warnings():  # one process without a process group: DCP says so
            warnings.simplefilter("ignore")
            sharded_checkpoint.save(checkpoint, path, is_writer=True, barrier=lambda: None)
    else:
        torch.save(checkpoint, path)
    return {"tensors": len(state), "model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes),
            "parameters": sum(p.numel() for p in lm.parameters())}


# -- one export in a subprocess ----------------------------------------------------------------------------------------
def measure_export(args: list[str], module_file: Path | None = None, timeout: float = 900) -> dict:
    """Run ``lightning-par export ARGS`` in a fresh subprocess and return its memory: ``baseline_bytes`` (RSS once
    everything is imported), ``peak_bytes``, ``extra_bytes`` (their difference), ``seconds`` and the exit ``code``.
    ``module_file``: another copy of ``checkpoint_export.py`` whose ``main`` to run (an older revision)."""
    command = [sys.executable, "-m", "benchmarks.export_memory", "--child", json.dumps(args)]
    if module_file is not None:
        command += ["--module-file", str(module_file)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"export {args} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len(_MARK):])
    result["output"] = "\n".join(ln for ln in done.stdout.splitlines() if not ln.startswith(_MARK))
    return result


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class _PeakPoller(threading.Thread):
    """The largest RSS seen every millisecond: the peak where the kernel's mark cannot be reset."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _status("VmRSS")
        self.running = True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _status("VmRSS"))
            time.sleep(0.001)

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak, _status("VmRSS"))


def _child(args: list[str], module_file: str | None) -> None:
    import gc
    import importlib.util

    # everything an export imports, imported before the baseline
    import safetensors.torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import lightning_par.examples  # noqa: F401
    from lightning_par.plugins import checkpoint_export

    if module_file is not None:
        spec = importlib.util.spec_from_file_location("baseline_checkpoint_export", module_file)
        checkpoint_export = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = checkpoint_export  # its dataclasses look their module up
        spec.loader.exec_module(checkpoint_export)
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset the peak RSS mark (VmHWM) to the current RSS
        poller = None
    except OSError:
        poller = _PeakPoller()
        poller.start()
    baseline = _status("VmRSS")
    start = time.perf_counter()
    code = checkpoint_export.main(args)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") if poller is None else poller.stop()
    print(_MARK + json.dumps({"code": code, "baseline_bytes": baseline, "peak_bytes": peak,
                              "extra_bytes": peak - baseline, "seconds": seconds,
                              "peak_from": "VmHWM" if poller is None else "polling"}), flush=True)


# -- the benchmark -----------------------------------------------------------------------------------------------------
#: (name, checkpoint format, export arguments after CKPT OUT)
HF = ["--hf", "--model-class", HF_CLASS]
EXPORTS = [
    ("--hf (default 5GB: one file)", "dcp", HF),
    ("--hf --max-shard-size 200MB", "dcp", [*HF, "--max-shard-size", "200MB"]),
    ("--hf --max-shard-size 200MB --dtype bf16", "dcp", [*HF, "--max-shard-size", "200MB", "--dtype", "bf16"]),
    ("OUT.safetensors", "dcp", []),
    ("--hf --max-shard-size 200MB", "single_file", [*HF, "--max-shard-size", "200MB"]),
    ("OUT.safetensors", "single_file", []),
]


def _weight_files(out: Path) -> int:
    return len(list(out.glob("*.safetensors"))) if out.is_dir() else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--module-file", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=WIDE_LLAMA["vocab_size"])
    parser.add_argument("--hidden", type=int, default=WIDE_LLAMA["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=WIDE_LLAMA["intermediate_size"])
    parser.add_argument("--layers", type=int, default=WIDE_LLAMA["n_layers"])
    parser.add_argument("--baseline-rev", default=None,
                        help="also run the export of this git revision (its checkpoint_export.py) on the same "
                             "checkpoints, where its command takes the arguments")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "export_memory.json"))
    args = parser.parse_args()
    if args.child is not None:
        _child(json.loads(args.child), args.module_file)
        return
    model = {**WIDE_LLAMA, "vocab_size": args.vocab, "hidden_size": args.hidden,
             "intermediate_size": args.intermediate, "n_layers": args.layers}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        baseline_file = None
        if args.baseline_rev:
            baseline_file = tmp / "baseline_checkpoint_export.py"
            baseline_file.write_text(subprocess.run(
                ["git", "show", f"{args.baseline_rev}:lightning_par/plugins/checkpoint_export.py"], cwd=REPO,
                check=True, capture_output=True, text=True).stdout)
        sizes = {fmt: build_checkpoint(tmp / f"{fmt}.ckpt", fmt, model) for fmt in ("dcp", "single_file")}
        runs = [(name, fmt, extra, None) for name, fmt, extra in EXPORTS]
        if baseline_file is not None:
            runs += [(name, fmt, extra, baseline_file) for name, fmt, extra in EXPORTS
                     if "--max-shard-size" not in extra]  # an option it may lack
        for i, (name, fmt, extra, module_file) in enumerate(runs):
            out = tmp / f"out{i}" if "--hf" in extra else tmp / f"out{i}.safetensors"
            result = measure_export([str(tmp / f"{fmt}.ckpt"), str(out), *extra], module_file)
            size = sizes[fmt]
            code = f"baseline {args.baseline_rev}" if module_file else "this"
            row = {"export": name, "checkpoint": fmt, "version": code,
                   "files": _weight_files(out), **{k: v for k, v in result.items() if k != "output"},
                   "extra_over_checkpoint": result["extra_bytes"] / size["model_bytes"],
                   "extra_over_largest_tensor": result["extra_bytes"] / size["largest_tensor_bytes"]}
            rows.append(row)
            print(f"{row['version']}: {fmt} -> {name}: extra {row['extra_bytes'] / 2**20:.0f} MiB "
                  f"({row['extra_over_checkpoint']:.2f}x the checkpoint) in {row['seconds']:.1f} s", flush=True)
            shutil.rmtree(out) if out.is_dir() else out.unlink()  # disk: one export's output at a time
    size = sizes["dcp"]
    print(f"\nHFLlamaLightningModule {model}: {size['parameters'] / 1e6:.0f}M parameters, {size['tensors']} "
          f"tensors, model {size['model_bytes'] / 2**20:.0f} MiB, largest tensor "
          f"{size['largest_tensor_bytes'] / 2**20:.0f} MiB\n")
    print("| version | checkpoint | export | files | peak extra RSS (MiB) | / model bytes | / largest tensor "
          "| s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['version']} | {r['checkpoint']} | {r['export']} | {r['files']} | {r['extra_bytes'] / 2**20:.0f} | "
              f"{r['extra_over_checkpoint']:.2f} | {r['extra_over_largest_tensor']:.2f} | {r['seconds']:.1f} |")
    result = {"model": model, **size, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
