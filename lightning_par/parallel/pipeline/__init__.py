"""Pipeline parallelism without Lightning: which units each stage holds, and the stage modules themselves."""

from lightning_par.parallel.pipeline.split import (
    STAGE_STYLES,
    TiedParameter,
    assign_units,
    declared_units,
    plan_stages,
    rank_module,
    split_model,
    stage_indices,
    stage_rank,
    stage_view,
    tied_parameter_groups,
)

__all__ = [
    "STAGE_STYLES",
    "TiedParameter",
    "assign_units",
    "declared_units",
    "plan_stages",
    "rank_module",
    "split_model",
    "stage_indices",
    "stage_rank",
    "stage_view",
    "tied_parameter_groups",
]
