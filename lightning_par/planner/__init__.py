"""Plan a layout before launching: will it fit, and which layout is fastest.

``lightning-par plan`` (:mod:`lightning_par.plan_cli`, outside this package: it reads a fit config, whose strategy
only the strategies can answer, and the strategies use the planner) builds the model on the meta device
(:mod:`~lightning_par.planner.model`), traces its units on fake tensors (:mod:`~lightning_par.planner.trace`: bytes
saved for backward, FLOPs and bytes moved per op), orders each pipeline schedule as torch runs it
(:mod:`~lightning_par.planner.schedule`), and estimates every layout on a hardware model
(:mod:`~lightning_par.planner.plan`, :mod:`~lightning_par.planner.hardware`). No Lightning import: like
:mod:`lightning_par.parallel`, it is plain PyTorch and arithmetic.
"""

import importlib
from typing import Any

#: each name this package exports -> its module, imported on first use (``lightning-par plan --help`` needs no torch)
_WHERE = {
    "PRESETS": "hardware", "Hardware": "hardware", "load_hardware": "hardware",
    "ModelInfo": "model", "build_model": "model", "inspect_model": "model",
    "MEGATRON_2021": "runtime", "MEGATRON_OVERLAP": "runtime", "RUNTIMES": "runtime", "Runtime": "runtime",
    "Candidate": "plan", "Estimate": "plan", "Planner": "plan", "Workload": "plan", "element_bytes": "plan",
    "rank_table": "plan",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = [
    "MEGATRON_2021",
    "MEGATRON_OVERLAP",
    "PRESETS",
    "RUNTIMES",
    "Candidate",
    "Estimate",
    "Hardware",
    "ModelInfo",
    "Planner",
    "Runtime",
    "Workload",
    "build_model",
    "element_bytes",
    "inspect_model",
    "load_hardware",
    "rank_table",
]
