"""Terminal tables and JSON for the planner's estimates."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_par.planner.bands import Band, band_for
from lightning_par.planner.hardware import GiB, Hardware
from lightning_par.planner.plan import Estimate, Workload
from lightning_par.planner.trace import NO_FP32_MASTERS

#: after the table, when a precision without fp32 master weights is in it (those rows' precision ends in "*")
NO_MASTERS_NOTE = ("* no fp32 master weights: parameters, gradients and optimizer states are bf16, so an update "
                   "smaller than a weight's bf16 resolution (about 1/256 of it) is lost -- the speed and memory "
                   "of these rows come at that cost. bf16-mixed and bf16-mixed-master keep fp32 weights "
                   "(docs/precision.md); --precision fp32,bf16-mixed,bf16-mixed-master leaves bf16-true out.")


def _precision(precision: str) -> str:
    return precision + "*" if precision in NO_FP32_MASTERS else precision


def _unit(estimates: Sequence[Estimate]) -> tuple[str, float]:
    """GiB, or MiB for small models (the CPU test models)."""
    largest = max((e.worst.total for e in estimates), default=0.0)
    return ("GiB", GiB) if largest >= GiB else ("MiB", 2**20)


def _size(x: float, unit: float) -> str:
    v = x / unit
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _traffic(x: float, unit: float) -> str:
    v = x / unit
    return "0" if x == 0 else f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _schedule(e: Estimate) -> str:
    c = e.candidate
    if c.pp == 1:
        return "-"
    if c.virtual_stages > 1 and c.schedule not in ("zbv", "dualpipev"):
        return f"{c.schedule} v{c.virtual_stages}"
    return c.schedule or "-"


HEADER = ("#", "dp", "tp", "pp", "zero", "schedule", "sp", "recompute", "precision", "m",
          "params", "grads", "optim", "activ", "total", "fits", "dp", "tp", "pp", "bubble", "step s", "tokens/s",
          "MFU", "runs")


EXPOSED = ("dp exp s", "tp exp s", "pp exp s")


def _experts(estimates: Sequence[Estimate]) -> bool:
    """Whether the table shows the expert-parallel columns (ep, and the all-to-all bytes): some layout has ep > 1."""
    return any(e.candidate.ep > 1 for e in estimates)


def _with_ep(cells: tuple[str, ...], ep: str, ep_sent: str) -> tuple[str, ...]:
    """``cells`` in HEADER's order with the ep size after pp and the ep bytes after the pp bytes."""
    return cells[:4] + (ep,) + cells[4:19] + (ep_sent,) + cells[19:]


def bands(estimates: Sequence[Estimate], hardware: str) -> tuple[list[str], dict[str, Band]]:
    """Each estimate's band letter, and the band of each letter (A, B, ... in order of first use)."""
    letters: list[str] = []
    by_kind: dict[str, tuple[str, Band]] = {}
    for e in estimates:
        c = e.candidate
        b = band_for(hardware, c.world, c.tp, c.pp, c.cp, c.precision)
        if b.kind not in by_kind:
            by_kind[b.kind] = (chr(ord("A") + len(by_kind)) if len(by_kind) < 26 else "?", b)
        letters.append(by_kind[b.kind][0])
    return letters, {letter: b for letter, b in by_kind.values()}


def band_legend(estimates: Sequence[Estimate], hardware: str) -> str:
    """What each band letter of the table means: the errors its validation supports, or that it has none."""
    _, legend = bands(estimates, hardware)
    lines = ["error bands (|predicted / measured - 1| where validated; docs/plan.md, \"Calibration and error bands\"):"]
    lines += [f"  {letter}  {b.describe()}" for letter, b in legend.items()]
    return "\n".join(lines)


def rows(estimates: Sequence[Estimate], start: int = 1, exposed: bool = False,
         hardware: str | None = None) -> list[tuple[str, ...]]:
    _, unit = _unit(estimates)
    letters = bands(estimates, hardware)[0] if hardware is not None else []
    experts = _experts(estimates)
    out = []
    for i, e in enumerate(estimates, start):
        c, w = e.candidate, e.worst
        out.append((
            str(i), str(c.dp), str(c.tp), str(c.pp), str(c.zero_stage), _schedule(e), "yes" if c.sequence_parallel
            else "-", c.recompute, _precision(c.precision), str(c.n_microbatches),
            _size(w.parameters, unit), _size(w.gradients, unit), _size(w.optimizer_states, unit),
            _size(w.activations + w.transient, unit), _size(w.total, unit), "yes" if e.fits else "NO",
            _traffic(e.comm_bytes["dp"], unit), _traffic(e.comm_bytes["tp"], unit), _traffic(e.comm_bytes["pp"], unit),
            f"{e.bubble:.2f}" if c.pp > 1 else "-", f"{e.step_time:.3g}",
            _rate(e.tokens_per_s), f"{e.mfu:.0%}", "yes" if e.runs_today else "not yet",
        ) + (tuple(f"{e.exposed.get(g, 0.0):.3g}" for g in ("dp", "tp", "pp")) if exposed else ()))
        if experts:
            out[-1] = _with_ep(out[-1], str(c.ep), _traffic(e.comm_bytes.get("ep", 0.0), unit))
        if letters:
            out[-1] = out[-1] + (letters[i - start],)
    return out


def table(estimates: Sequence[Estimate], start: int = 1, exposed: bool = False, hardware: str | None = None) -> str:
    """The estimates as a table; ``exposed``: with the exposed communication seconds per group; ``hardware`` (the
    preset's name): with each row's error band (:func:`band_legend` says what each letter means)."""
    body = rows(estimates, start, exposed, hardware)
    experts = _experts(estimates)
    header = (_with_ep(HEADER, "ep", "ep") if experts else HEADER) + (EXPOSED if exposed else ()) + \
        (("band",) if hardware is not None else ())
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    name, _ = _unit(estimates)
    groups = [("", 10 + experts), (f"{name} per rank (the fullest)", 6), (f"{name} sent per step", 3 + experts),
              ("", 5)]
    if exposed:
        groups.append(("exposed comm", 3))
    if hardware is not None:
        groups.append(("", 1))
    lines = []
    top, col = [], 0
    for title, n in groups:
        span = sum(widths[col:col + n]) + 2 * (n - 1)
        top.append(title.center(span) if title else " " * span)
        col += n
    lines.append("  ".join(top).rstrip())
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in body:
        lines.append("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    return "\n".join(lines)


def header(description: str, hw: Hardware, work: Workload, world: int, optimizer: str) -> str:
    nodes = -(-world // hw.devices_per_node)
    return (f"model:    {description}\n"
            f"hardware: {hw.name} ({hw.notes or 'custom'}): {hw.memory_gib:g} GiB per device, "
            f"{hw.reserved_gib:g} GiB reserved, {hw.devices_per_node} per node -> {world} ranks on {nodes} node(s)\n"
            f"workload: global batch {work.global_batch} x {work.seq_len} tokens, micro-batch {work.micro_batch}, "
            f"{optimizer}")


def with_band(e: Estimate, hardware: str) -> str:
    """An estimate's step time and memory with the band its kind of run has (or that it has none)."""
    c = e.candidate
    b = band_for(hardware, c.world, c.tp, c.pp, c.cp, c.precision)
    step = f"{e.step_time:.3g} s per step" + (f" (+-{b.step[0]:.0%} median, +-{b.step[1]:.0%} worst)" if b.step
                                              else "")
    memory = f"{e.worst.total / GiB:.3g} GiB per rank" + (
        f" (+-{b.memory[0]:.0%} median, +-{b.memory[1]:.0%} worst)" if b.memory else "")
    return f"{step}, {memory}" + ("" if b.step or b.memory else " [outside anything measured]")


def summary(estimates: Sequence[Estimate], skipped: dict[str, int], hw: Hardware) -> str:
    fit = [e for e in estimates if e.fits]
    runnable = [e for e in fit if e.runs_today]
    lines = [f"{len(estimates)} layouts planned; {len(fit)} fit in {hw.memory_gib - hw.reserved_gib:g} GiB; "
             f"{len(runnable)} of those run in this version of lightning-par."]
    if fit:
        best = fit[0]
        lines.append(f"fastest that fits: {best.candidate.label()} -- {with_band(best, hw.name)}, "
                     f"{best.tokens_per_s:,.0f} tokens/s, {best.model_tflops_per_device:.3g} TFLOP/s per device "
                     f"(MFU {best.mfu:.0%})" + ("" if best.runs_today else " [not runnable yet]")
                     + (" [no fp32 master weights*]" if best.candidate.precision in NO_FP32_MASTERS else ""))
        masters = next((e for e in fit if e.candidate.precision not in NO_FP32_MASTERS and e.runs_today), None)
        if best.candidate.precision in NO_FP32_MASTERS and masters is not None:
            lines.append(f"fastest with fp32 master weights that runs today: {masters.candidate.label()} -- "
                         f"{masters.step_time:.3g} s per step, {masters.tokens_per_s:,.0f} tokens/s")
    if runnable and (not fit or runnable[0] is not fit[0]):
        r = runnable[0]
        lines.append(f"fastest that runs today: {r.candidate.label()} -- {r.step_time:.3g} s per step, "
                     f"{r.tokens_per_s:,.0f} tokens/s")
    if not fit and estimates:
        small = min(estimates, key=lambda e: e.worst.total)
        lines.append(f"nothing fits: the smallest is {small.candidate.label()} at {small.worst.total / GiB:.1f} GiB "
                     "per rank. Add ranks, recompute, shard more (ZeRO-3, tp, pp), or a smaller micro-batch.")
    if any(e.candidate.precision in NO_FP32_MASTERS for e in estimates):
        lines.append(NO_MASTERS_NOTE)
    if skipped:
        shown = sorted(skipped.items(), key=lambda kv: -kv[1])[:4]
        lines.append("left out: " + "; ".join(f"{reason} ({n})" for reason, n in shown)
                     + (f"; ... ({len(skipped) - 4} more reasons)" if len(skipped) > 4 else ""))
    return "\n".join(lines)


def rank_breakdown(e: Estimate, hardware: str | None = None) -> str:
    """Per pipeline rank: what it holds (its tp and dp peers hold the same)."""
    lines = [f"{e.candidate.label()}: per pipeline rank (GiB)",
             "  pp rank   params   grads   optim   activ  transient   total"]
    for r in e.ranks:
        lines.append(f"  {r.pp_rank:>7}  {r.parameters / GiB:7.2f} {r.gradients / GiB:7.2f} "
                     f"{r.optimizer_states / GiB:7.2f} {r.activations / GiB:7.2f} {r.transient / GiB:10.2f} "
                     f"{r.total / GiB:7.2f}")
    b = e.breakdown
    x = e.exposed
    if hardware is not None:
        lines.append(f"  {with_band(e, hardware)}")
    lines.append(f"  step {e.step_time:.4g} s = pipeline {b['pipeline']:.4g} (of it tp exposed {x.get('tp', 0):.3g}, "
                 f"pp exposed {x.get('pp', 0):.3g}) + data-parallel exposed {b['dp_exposed']:.4g} + optimizer "
                 f"{b['optimizer']:.4g}; bubble {e.bubble:.3f}; sent per step "
                 f"dp {e.comm_bytes['dp'] / GiB:.3g} GiB, tp {e.comm_bytes['tp'] / GiB:.3g} GiB, "
                 f"pp {e.comm_bytes['pp'] / GiB:.3g} GiB"
                 + (f", ep {e.comm_bytes['ep'] / GiB:.3g} GiB (all_to_all; exposed {x.get('ep', 0):.3g} s)"
                    if "ep" in e.comm_bytes else ""))
    if not e.runs_today:
        lines.append(f"  not runnable in this version: {e.engine_note}")
    return "\n".join(lines)


def write_json(path: str | Path, estimates: Sequence[Estimate], meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps({**meta, "layouts": [e.to_dict() for e in estimates]}, indent=1))
