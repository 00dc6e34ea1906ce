"""Plan a layout before launching: will it fit, and which layout is fastest.

``lightning-par plan`` (:mod:`lightning_par.planner.cli`) builds the model on the meta device
(:mod:`~lightning_par.planner.model`), traces its units on fake tensors (:mod:`~lightning_par.planner.trace`: bytes
saved for backward, FLOPs and bytes moved per op), orders each pipeline schedule as torch runs it
(:mod:`~lightning_par.planner.schedule`), and estimates every layout on a hardware model
(:mod:`~lightning_par.planner.plan`, :mod:`~lightning_par.planner.hardware`). No Lightning import: like
:mod:`lightning_par.parallel`, it is plain PyTorch and arithmetic.
"""

from lightning_par.planner.hardware import PRESETS, Hardware, load_hardware
from lightning_par.planner.model import ModelInfo, build_model, inspect_model
from lightning_par.planner.plan import (
                                        MEGATRON_2021,
                                        MEGATRON_OVERLAP,
                                        RUNTIMES,
                                        Candidate,
                                        Estimate,
                                        Planner,
                                        Runtime,
                                        Workload,
                                        element_bytes,
                                        rank_table,
)

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
