"""Deferred construction (``lightning_par.parallel.deferred_init``) against eager construction, per GPT preset.

Each measurement runs in a fresh process (so memory freed by an earlier one cannot hide an allocation): the peak RSS
growth (VmHWM, reset through /proc/self/clear_refs, minus the RSS before construction) and the CPU time of

* ``eager``: ``GPT(config)``;
* ``deferred 1/k``: ``GPT(config)`` under ``deferred_init()``, then ``materialize`` of the first n_layers/k blocks
  (what one of k pipeline stages owns). The materialised blocks are checked bit-for-bit against eager ones.

    python benchmarks/deferred_init.py                         # presets 125m and 350m, k = 1 and 4 (~1 minute)
    python benchmarks/deferred_init.py --presets 1b --parts 8  # larger: eager needs 4 bytes per parameter of RAM
    python benchmarks/deferred_init.py --device cuda           # built on cuda:0: the GPU's bytes (not run yet)

With ``--device cuda`` the models are built under ``torch.device("cuda")`` and the memory is the GPU's: the growth
of ``torch.cuda.max_memory_allocated`` (peaks reset before construction) over the bytes allocated before it, and
the same for ``max_memory_reserved``; the CPU time includes a final ``torch.cuda.synchronize``.

Writes benchmarks/results/deferred_init[_cuda].json. Linux only (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Loads the two files it needs by path: importing them through their packages would import Lightning.
_PROBE = """
import contextlib, importlib.util, json, sys, time, torch

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

repo, preset, parts, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), torch.device(sys.argv[4])
cuda = device.type == "cuda"

def place():  # CPU: no device context, exactly as before --device existed
    return torch.device(device) if cuda else contextlib.nullcontext()
gpt = load("gpt", repo + "/lightning_par/examples/gpt.py")
deferred_init = load("deferred_init", repo + "/lightning_par/parallel/deferred_init.py").deferred_init

def status(field):
    return 1024 * int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])

with place(), deferred_init(threshold=0) as warm_up:  # lazy code paths and kernels, before measuring
    tiny = gpt.GPT(gpt.GPTConfig.from_preset("tiny"))
warm_up.materialize(tiny)
del tiny, warm_up
open("/proc/self/clear_refs", "w").write("5")
config = gpt.GPTConfig.from_preset(preset)
if cuda:  # the device's peaks from here on, over what it holds now
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    cuda_base = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
base, start = status("VmRSS"), time.process_time()
torch.manual_seed(0)
stats, keep = {}, []
with place():
    if parts == 0:
        model = gpt.GPT(config)
    else:
        with deferred_init() as record:
            model = gpt.GPT(config)
        record.capture(model)
        blocks = tuple(f"layers.{i}." for i in range(config.n_layers // parts))
        keep = [name for name in record.fqns if name.startswith(blocks)]
        record.materialize(model, keep=keep)
        stats = record.stats
if cuda:
    torch.cuda.synchronize(device)  # the kernels' time, not their launches'
seconds, growth = time.process_time() - start, status("VmHWM") - base
allocated = torch.cuda.max_memory_allocated(device) - cuda_base[0] if cuda else None
reserved = torch.cuda.max_memory_reserved(device) - cuda_base[1] if cuda else None
if keep:  # the kept blocks equal eager ones (built after measuring, on the same device)
    torch.manual_seed(0)
    with place():
        reference = dict(gpt.GPT(config).named_parameters())
    assert all(torch.equal(reference[name], dict(model.named_parameters())[name]) for name in keep)
print(json.dumps({"cpu_s": seconds, "rss_growth_bytes": growth, "param_bytes": 4 * config.num_params(),
                  "kept_bytes": sum(p.numel() * 4 for n, p in model.named_parameters() if not p.is_meta),
                  "device": str(device), "cuda_allocated_growth_bytes": allocated,
                  "cuda_reserved_growth_bytes": reserved, **stats}))
"""


def measure(preset: str, parts: int, device: str = "cpu") -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(REPO), preset, str(parts), device], capture_output=True,
                         text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="125m,350m")
    parser.add_argument("--parts", default="1,4", help="k values: materialise 1/k of the blocks")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: build on cuda:0 and measure the GPU's allocated / reserved growth")
    parser.add_argument("--out", default=None, help="default benchmarks/results/deferred_init[_cuda].json")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    out = args.out or str(REPO / f"benchmarks/results/deferred_init{'_cuda' if cuda else ''}.json")
    memory = "GPU allocated growth MB" if cuda else "peak RSS growth MB"
    rows = []
    print(f"{'preset':>7} {'mode':>12} {'params MB':>10} {'kept MB':>9} {memory:>19} {'CPU s':>7}")
    for preset in args.presets.split(","):
        for parts in [0, *map(int, args.parts.split(","))]:
            row = {"preset": preset, "mode": "eager" if parts == 0 else f"deferred 1/{parts}",
                   **measure(preset, parts, args.device)}
            rows.append(row)
            grown = row["cuda_allocated_growth_bytes"] if cuda else row["rss_growth_bytes"]
            print(f"{preset:>7} {row['mode']:>12} {row['param_bytes'] / 2**20:>10.1f} {row['kept_bytes'] / 2**20:>9.1f}"
                  f" {grown / 2**20:>19.1f} {row['cpu_s']:>7.2f}", flush=True)
    Path(out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
