"""Pipeline parallelism without Lightning: which units each stage holds, the stage modules themselves, how a stage
calls any model (ours, Hugging Face, a plain nn.ModuleList model), the batch forms a pipeline accepts, a Hugging Face
model's own loss on the last stage, and what ZeRO-3 (FSDP2) of the stage modules costs."""

from lightning_par.parallel.pipeline.adapter import PipelineOutput, StageIO, stage_forward, stage_io
from lightning_par.parallel.pipeline.batches import ACCEPTED_FORMS, next_token_targets, split_batch
from lightning_par.parallel.pipeline.chain import check_chain
from lightning_par.parallel.pipeline.fsdp import check_disjoint, fsdp_group_count
from lightning_par.parallel.pipeline.loss import ModelLoss
from lightning_par.parallel.pipeline.split import (
    KeptModuleList,
    RemovedUnit,
    TiedParameter,
    assign_units,
    block_units,
    declared_units,
    model_units,
    plan_stages,
    rank_module,
    split_model,
    stage_indices,
    stage_rank,
    stage_view,
    tied_parameter_groups,
)
from lightning_par.parallel.stage_plan import STAGE_STYLES

__all__ = [
    "ACCEPTED_FORMS",
    "STAGE_STYLES",
    "KeptModuleList",
    "ModelLoss",
    "PipelineOutput",
    "RemovedUnit",
    "StageIO",
    "TiedParameter",
    "assign_units",
    "block_units",
    "check_chain",
    "check_disjoint",
    "declared_units",
    "fsdp_group_count",
    "model_units",
    "next_token_targets",
    "plan_stages",
    "rank_module",
    "split_batch",
    "split_model",
    "stage_forward",
    "stage_indices",
    "stage_io",
    "stage_rank",
    "stage_view",
    "tied_parameter_groups",
]
