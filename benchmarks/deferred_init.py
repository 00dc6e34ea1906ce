"""Deferred construction (``lightning_par.parallel.deferred_init``) against eager construction, per GPT preset.

Each measurement runs in a fresh process (so memory freed by an earlier one cannot hide an allocation): the peak RSS
growth (VmHWM, reset through /proc/self/clear_refs, minus the RSS before construction) and the CPU time of

* ``eager``: ``GPT(config)``;
* ``deferred 1/k``: ``GPT(config)`` under ``deferred_init()``, then ``materialize`` of the first n_layers/k blocks
  (what one of k pipeline stages owns). The materialised blocks are checked bit-for-bit against eager ones.

    python benchmarks/deferred_init.py                         # presets 125m and 350m, k = 1 and 4 (~1 minute)
    python benchmarks/deferred_init.py --presets 1b --parts 8  # larger: eager needs 4 bytes per parameter of RAM

Writes benchmarks/results/deferred_init.json. Linux only (reads /proc/self/status).
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
import importlib.util, json, sys, time, torch

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

repo, preset, parts = sys.argv[1], sys.argv[2], int(sys.argv[3])
gpt = load("gpt", repo + "/lightning_par/examples/gpt.py")
deferred_init = load("deferred_init", repo + "/lightning_par/parallel/deferred_init.py").deferred_init

def status(field):
    return 1024 * int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])

with deferred_init(threshold=0) as warm_up:  # load lazy code paths and kernels before measuring
    tiny = gpt.GPT(gpt.GPTConfig.from_preset("tiny"))
warm_up.materialize(tiny)
del tiny, warm_up
open("/proc/self/clear_refs", "w").write("5")
config = gpt.GPTConfig.from_preset(preset)
base, start = status("VmRSS"), time.process_time()
torch.manual_seed(0)
stats, keep = {}, []
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
seconds, growth = time.process_time() - start, status("VmHWM") - base
if keep:  # the kept blocks equal eager ones (built after measuring)
    torch.manual_seed(0)
    reference = dict(gpt.GPT(config).named_parameters())
    assert all(torch.equal(reference[name], dict(model.named_parameters())[name]) for name in keep)
print(json.dumps({"cpu_s": seconds, "rss_growth_bytes": growth, "param_bytes": 4 * config.num_params(),
                  "kept_bytes": sum(p.numel() * 4 for n, p in model.named_parameters() if not p.is_meta), **stats}))
"""


def measure(preset: str, parts: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(REPO), preset, str(parts)], capture_output=True,
                         text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="125m,350m")
    parser.add_argument("--parts", default="1,4", help="k values: materialise 1/k of the blocks")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/deferred_init.json"))
    args = parser.parse_args()
    rows = []
    print(f"{'preset':>7} {'mode':>12} {'params MB':>10} {'kept MB':>9} {'peak RSS growth MB':>19} {'CPU s':>7}")
    for preset in args.presets.split(","):
        for parts in [0, *map(int, args.parts.split(","))]:
            row = {"preset": preset, "mode": "eager" if parts == 0 else f"deferred 1/{parts}", **measure(preset, parts)}
            rows.append(row)
            print(f"{preset:>7} {row['mode']:>12} {row['param_bytes'] / 2**20:>10.1f} {row['kept_bytes'] / 2**20:>9.1f}"
                  f" {row['rss_growth_bytes'] / 2**20:>19.1f} {row['cpu_s']:>7.2f}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
