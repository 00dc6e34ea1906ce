"""``lightning-par plan``: will it fit, and which layout is fastest -- answered before launching.

    lightning-par plan --config configs/demo.yaml      # the fit config: its model, ranks, strategy and batch
    lightning-par plan --config configs/demo.yaml --world 16 --hardware h100-sxm   # the same run on 16 GPUs
    lightning-par plan --model=lightning_par.examples.GPTLightningModule --model.preset=8b --world 8
    lightning-par plan --model=lightning_par.examples.GPTLightningModule --model.preset=8b --world 16 --hardware a100 \\
        --gpu-memory 40 --seq 4096 --global-batch 256 --json plan.json
    lightning-par plan --model=lightning_par.examples.HFLlamaLightningModule --model.n_layers=8 --world 4 --hardware cpu
    lightning-par plan --hf-config path/to/config.json --world 8
    lightning-par plan --model=lightning_par.examples.GPTLightningModule --model.preset=1b --layout dp=2,tp=2,pp=2

The command stands above :mod:`lightning_par.planner` and the strategies: a fit config's ``trainer.strategy`` is read
into a layout by the strategy itself (:mod:`lightning_par.fit_config`), and ``strategy="planned"`` uses the planner.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

# what the parser needs imports no torch (``lightning-par plan --help`` answers at once); the planner itself is
# imported in _main
from lightning_par.fit_config import FitPlan, read_fit_config
from lightning_par.parallel.stage_plan import SCHEDULES
from lightning_par.planner.hardware import PRESETS, load_hardware
from lightning_par.planner.runtime import PRECISIONS, RUNTIMES
from lightning_par.topology import RECOMPUTE_KINDS, LayoutError, check_number, is_number

if TYPE_CHECKING:
    from lightning_par.planner.plan import Workload

_LAYOUT_KEYS = ("dp", "tp", "pp", "ep", "zero", "schedule", "v", "sp", "recompute", "precision", "m")


def _csv(kind: type, allowed: Any = None):
    def parse(text: str) -> list:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        bad = [v for v in values if allowed is not None and v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not in {list(allowed)}")
        return values
    return parse


def _positive(kind: type):
    """An argparse type: a positive ``int`` (or finite ``float``); 0, negative, nan and inf are refused."""
    def parse(text: str) -> int | float:
        value = kind(text)  # a ValueError here: argparse's "invalid int value"
        if not is_number(value, integer=kind is int, above=0):
            raise argparse.ArgumentTypeError(f"{text} is not valid: use a positive "
                                             f"{'integer' if kind is int else 'finite number'}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-par plan", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Plan a layout before launching: bytes per rank (parameters, gradients, optimizer states, "
                    "activations), traffic per group, bubble and predicted step time of every layout of a model on "
                    "N ranks. The model is built on the meta device (no weights are allocated).",
        epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--config", help="a lightning-par fit config (YAML): plan its model (model.class_path, "
                                    "init_args), ranks (trainer.devices x num_nodes), strategy, precision, "
                                    "data.seq_len and batch_size; the options below override it")
    p.add_argument("--model", help="class path of a LightningModule or nn.Module, e.g. "
                                   "lightning_par.examples.GPTLightningModule; init arguments as --model.NAME=VALUE")
    p.add_argument("--hf-config", help="a Hugging Face config.json (or its folder) instead of --model")
    p.add_argument("--world", type=_positive(int), help="number of ranks (devices); default: the product of --layout")
    p.add_argument("--layout", help="one layout, e.g. dp=2,tp=2,pp=2 (prints its rank table) or with "
                                    "zero=1,schedule=1f1b,v=2,sp=1,recompute=full,precision=bf16-mixed,m=8; ep=2: "
                                    "experts over 2 of the dp ranks")
    p.add_argument("--hardware", help=f"a preset ({', '.join(PRESETS)}) or a JSON/YAML file of "
                                      "lightning_par.planner.hardware.Hardware fields (default h100-sxm; cpu for a "
                                      "--config with trainer.accelerator: cpu)")
    p.add_argument("--gpu-memory", type=_positive(float), help="device memory in GiB (overrides the hardware's)")
    p.add_argument("--micro-batch", type=_positive(int), help="sequences per micro-batch (default 1)")
    p.add_argument("--seq", type=_positive(int), help="sequence length (default: the model's longest, at most 8192)")
    p.add_argument("--global-batch", type=_positive(int),
                   help="sequences per optimizer step (default 8 x world x micro-batch)")
    p.add_argument("--optimizer", help="adamw (2 states, the default), sgd (none), sgd_momentum (1)")
    p.add_argument("--zero", type=_csv(int, (0, 1, 2, 3)), default=[0, 1, 2, 3], help="ZeRO stages to consider")
    p.add_argument("--schedules", type=_csv(str, SCHEDULES), default=list(SCHEDULES), help="pipeline schedules")
    p.add_argument("--virtual", type=_csv(int), default=[2, 4], help="virtual stages of the interleaved schedules")
    p.add_argument("--recompute", type=_csv(str, RECOMPUTE_KINDS), default=list(RECOMPUTE_KINDS),
                   help=f"activation recompute kinds to consider (default: {','.join(RECOMPUTE_KINDS)})")
    p.add_argument("--precision", type=_csv(str, PRECISIONS), default=list(PRECISIONS),
                   help=f"precisions to consider (default: {','.join(PRECISIONS)})")
    p.add_argument("--max-tp", type=_positive(int), help="largest tensor-parallel size (default: devices per node)")
    p.add_argument("--runtime", choices=list(RUNTIMES), default="lightning-par",
                   help="how the training runtime overlaps communication: lightning-par (the default: what this "
                        "version does), megatron-2021 (Narayanan et al. 2021: nothing overlapped), megatron-overlap "
                        "(Megatron-core with --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap)")
    p.add_argument("--tp-comm-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="tensor-parallel collectives pipelined with the matrix products (default: the runtime's)")
    p.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile: the ops between matrix products fused into one kernel (default: the "
                        "runtime's)")
    p.add_argument("--no-prune", action="store_true",
                   help="estimate every layout, also those whose model state and one micro-batch's activations "
                        "alone exceed the device (by default they are left out before their schedules are run)")
    p.add_argument("--exposed", action="store_true",
                   help="add the exposed dp / tp / pp communication seconds per step to the table")
    p.add_argument("--top", type=_positive(int), default=15, help="rows to print (default 15)")
    p.add_argument("--all", action="store_true", help="print every layout")
    p.add_argument("--runnable", action="store_true", help="only layouts this version of lightning-par runs")
    p.add_argument("--json", dest="json_out", help="write every estimate to this JSON file")
    p.add_argument("--write-config", metavar="PATH",
                   help="write a fit config (YAML) that trains the fastest layout that fits and runs: the --config "
                        "given with its strategy, precision, devices and batch replaced, or a new one for --model "
                        "(add your data: section); run it with lightning-par fit --config PATH")
    p.add_argument("--block-types", help="comma-separated class names of the repeated blocks, where they cannot be "
                                         "found from the model")
    return p


def _split_model_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    rest, model_args = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--model."):
            key, eq, value = arg[len("--model."):].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise LayoutError(f"{arg} needs a value")
                value = argv[i + 1]
                i += 1
            model_args[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, model_args


def parse_layout(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key not in _LAYOUT_KEYS:
            raise LayoutError(f"--layout item {item!r}: use KEY=VALUE with KEY in {list(_LAYOUT_KEYS)}, e.g. "
                              "dp=2,tp=2,pp=2.")
        if key in ("schedule", "recompute", "precision"):
            out[key] = value
        elif key == "sp":
            out[key] = value.lower() in ("1", "true", "yes", "y")
        else:  # sizes, micro-batches and virtual stages at least 1; a ZeRO stage at least 0
            number = int(value) if value.strip().lstrip("-").isdigit() else value
            check_number(f"--layout {key}", number, "an integer >= 0" if key == "zero" else "a positive integer",
                         integer=True, minimum=0 if key == "zero" else 1)
            out[key] = number
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except LayoutError as err:
        print(f"lightning-par plan: {err}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    rest, model_args = _split_model_args(argv)
    args = parser().parse_args(rest)
    from lightning_par.planner.model import build_model, inspect_model
    from lightning_par.planner.plan import Planner, Workload, rank_table
    from lightning_par.planner.report import band_legend, header, rank_breakdown, summary, table, write_json

    fit = read_fit_config(args.config) if args.config else FitPlan()
    if fit.model and not args.hf_config:
        args.model = args.model or fit.model
        model_args = {**fit.model_args, **model_args} if args.model == fit.model else model_args
    if not args.model and not args.hf_config:
        parser().error("give --config FIT.yaml, --model=CLASS (with --model.NAME=VALUE init arguments) or "
                       "--hf-config PATH")
    layout = parse_layout(args.layout) if args.layout else dict(fit.layout)
    args.world = args.world or (None if args.layout else fit.world)
    args.hardware = args.hardware or fit.hardware or "h100-sxm"
    args.seq = args.seq or fit.seq
    if not args.layout and args.micro_batch is None and args.global_batch is None:
        args.micro_batch, args.global_batch = fit.micro_batch, fit.global_batch
    args.micro_batch = args.micro_batch or 1
    if args.config:
        vocab = f", vocabulary {fit.vocab_size} (the data's tokenizer)" if fit.vocab_size else ""
        print(f"from {args.config}: {args.model}, {args.world or '?'} ranks, layout "
              f"{','.join(f'{k}={v}' for k, v in layout.items()) or 'any'}{vocab}", file=sys.stderr)
    world = args.world
    if world is None:
        if not {"dp", "tp", "pp"} & set(layout):
            parser().error("give --world N (or a --layout with dp, tp and pp)")
        world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    hw = load_hardware(args.hardware)
    if args.gpu_memory is not None:
        hw = replace(hw, memory_gib=args.gpu_memory)
    print(f"building {args.model or args.hf_config} on the meta device ...", file=sys.stderr)
    obj = build_model(args.model, model_args, hf_config=args.hf_config)
    from lightning.pytorch import LightningModule

    if args.write_config and not isinstance(obj, LightningModule):  # said before the planning, not after
        raise LayoutError(f"--write-config {args.write_config}: {type(obj).__name__} is not a LightningModule, which "
                          "a fit config needs; plan --model=YOUR_LIGHTNING_MODULE.")
    info = inspect_model(obj, args.block_types.split(",") if args.block_types else None)
    seq = args.seq or info.default_seq_len
    global_batch = args.global_batch or 8 * world * args.micro_batch
    if "m" in layout:  # micro-batches per step given: the global batch follows
        global_batch = layout["m"] * (world // (layout.get("tp", 1) * layout.get("pp", 1))) * args.micro_batch
    work = Workload(args.micro_batch, seq, global_batch)
    runtime = RUNTIMES[args.runtime]
    runtime = replace(runtime, **{k: v for k, v in (("tp_comm_overlap", args.tp_comm_overlap),
                                                     ("compiled", args.compiled)) if v is not None})
    planner = Planner(info, hw, work, args.optimizer, max_tp=args.max_tp or max(hw.devices_per_node, 1),
                      runtime=runtime)
    # a forward the trace cannot run (a Hugging Face MoE's routing) is refused here, once, rather than per layout
    planner.trace(1, "none", args.precision[0] if "precision" not in layout else layout["precision"])
    print(header(info.description, hw, work, world, planner.optimizer))

    if layout:
        dp = layout.get("dp", "auto")
        tp, pp = layout.get("tp", 1), layout.get("pp", 1)
        print("\n" + rank_table(world, dp, tp, pp, layout.get("ep", 1)))
        dp = world // (tp * pp)
        fixed = {k: layout[k] for k in ("zero", "schedule", "v", "sp", "recompute", "precision") if k in layout}
        estimates, skipped = planner.plan(
            world, zero_stages=[fixed["zero"]] if "zero" in fixed else args.zero,
            schedules=[fixed["schedule"]] if "schedule" in fixed else args.schedules,
            recompute=[fixed["recompute"]] if "recompute" in fixed else args.recompute,
            precisions=[fixed["precision"]] if "precision" in fixed else args.precision,
            virtual=[fixed["v"]] if "v" in fixed else args.virtual,
            sequence_parallel=[fixed["sp"]] if "sp" in fixed else (False, True),
            sizes=[(dp, tp, pp)], expert_parallel=[layout["ep"]] if "ep" in layout else None,
            prune=not args.no_prune)
    else:
        print(f"planning every layout of {world} ranks ...", file=sys.stderr)
        estimates, skipped = planner.plan(world, zero_stages=args.zero, schedules=args.schedules,
                                          recompute=args.recompute, precisions=args.precision, virtual=args.virtual,
                                          prune=not args.no_prune)
    if args.runnable:
        estimates = [e for e in estimates if e.runs_today]
    shown = estimates if args.all else estimates[:args.top]
    print()
    if shown:
        print(table(shown, exposed=args.exposed, hardware=hw.name))
        if len(shown) < len(estimates):
            print(f"   ... {len(estimates) - len(shown)} more (--all prints them, --json writes them)")
        print(band_legend(shown, hw.name))
    print()
    print(summary(estimates, skipped, hw))
    if layout and estimates:
        print()
        print(rank_breakdown(estimates[0], hw.name))
    _print_fit_command(args, model_args, estimates, work, obj)
    if args.json_out:
        write_json(args.json_out, estimates, {
            "model": info.description, "hardware": hw.to_dict(), "runtime": asdict(runtime), "world": world,
            "workload": {"micro_batch": work.micro_batch, "seq_len": work.seq_len,
                         "global_batch": work.global_batch}, "optimizer": planner.optimizer,
            "left_out": skipped,
        })
        print(f"\nwrote {len(estimates)} layouts to {args.json_out}")
    return 0


def _print_fit_command(args: argparse.Namespace, model_args: dict[str, str], estimates: list, work: Workload,
                       model: Any) -> None:
    """The fit command of the fastest layout that fits and runs (and with --write-config, its YAML); for a plain
    ``nn.Module`` or an --hf-config, which ``lightning-par fit`` cannot take, what a script gives the Trainer."""
    from lightning.pytorch import LightningModule

    from lightning_par.planner.command import (
        batch_settings,
        fit_command,
        fit_config,
        strategy_args,
        trainer_precision,
        write_fit_config,
    )

    winner = next((e for e in estimates if e.fits and e.runs_today), None)
    if winner is None or not isinstance(model, LightningModule):
        if args.write_config:
            raise LayoutError(f"--write-config {args.write_config}: no fit config to write: no layout fits and runs "
                              "today.")
        if winner is not None:
            c = winner.candidate
            batch, accumulate = batch_settings(c, work)
            options = ", ".join(f"{k}={v!r}" for k, v in strategy_args(c).items())
            print(f"\nto train the fastest that fits and runs ({c.label()}) from a LightningModule holding "
                  f"{type(model).__name__}:\n  Trainer(devices={c.world}, strategy=lightning_par.LayoutStrategy("
                  f"{options}), precision={trainer_precision(c)!r}"
                  + (f", accumulate_grad_batches={accumulate}" if accumulate > 1 else "")
                  + f"), with batches of {batch} sequence(s) of {work.seq_len} tokens")
        return
    c = winner.candidate
    print(f"\nto train the fastest that fits and runs ({c.label()}):")
    if args.write_config:
        base = yaml.safe_load(Path(args.config).read_text()) if args.config else None
        config = fit_config(c, work, base, args.model, model_args)
        write_fit_config(args.write_config, config, c.label())
        print(f"  lightning-par fit --config {args.write_config}    (written now)")
    else:
        print("  " + fit_command(c, work, args.config, args.model, model_args))
    if not args.config:
        batch, _ = batch_settings(c, work)
        print(f"  with your data module (--data=CLASS, or a data: section) giving {batch} sequence(s) of "
              f"{work.seq_len} tokens per batch")


__all__ = ["main", "parse_layout"]

if __name__ == "__main__":
    sys.exit(main())
