"""What runs a rank's part of the model: one interface for pp = 1 and pp > 1, so the engine asks instead of branching.

:class:`SingleRunner` (pp = 1) leaves the step to Lightning's loop; the pipeline runner is
:class:`~lightning_par.parallel.pipeline.runtime.PipelineRuntime`, whose schedule runs forward and backward itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from lightning_par.parallel.stage_plan import StagePlan

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import Tensor, nn

#: ``grad_sync_func(params)``: the gradients of ``params`` are complete for this step (Megatron-Core's
#: ``config.grad_sync_func``): the data-parallel owner's ``start_grad_sync``
GradSyncFunc = Callable[[Iterable["nn.Parameter"]], None]


class Runner(Protocol):
    """The hooks the engine calls on every layout."""

    plan: StagePlan
    #: True: :meth:`train_step` runs forward and backward, and evaluation's loss comes from :meth:`forward_only`
    #: (Lightning must not run backward); False: Lightning's loop runs the step, and neither is called
    takes_over_step: bool
    #: True: the loss is the model's own, computed when the LightningModule's training_step calls the model with
    #: labels (a Hugging Face causal LM without ``loss_fn``); False: ``loss_fn`` / ``compute_loss``, or pp = 1
    model_loss_step: bool
    #: the group whose ranks hold different stages (the pipeline's): the gradient norm sums over it; None for one
    group: dist.ProcessGroup | None
    #: False on the non-final batches of gradient accumulation: a runner that defers the data-parallel reduction
    #: starts none (set through :func:`~lightning_par.parallel.finalize.no_sync`)
    require_sync: bool
    #: called with a stage's parameters as the runner ends that stage's last backward of a step that synchronises,
    #: so their reduction overlaps the rest of the schedule; None: nobody listens
    grad_sync_func: GradSyncFunc | None

    def counted_elsewhere(self) -> set[int]:
        """ids of this rank's parameters whose gradient another rank counts in the global norm."""

    def make_tied_copies_equal(self) -> None:
        """Make the copies of a parameter held by several ranks equal (collective, at setup)."""

    def sum_tied_gradients(self) -> None:
        """Sum the gradients of those copies, so they take the same step (collective, from
        :func:`~lightning_par.parallel.finalize.finalize`)."""

    def train_step(self, inputs: Any, targets: Tensor) -> Tensor:
        """Forward and backward of one batch; its loss."""

    def forward_only(self, inputs: Any = None, targets: Tensor | None = None) -> Any:
        """Forward without backward: the loss with ``targets``, else the output."""

    def stage_table(self) -> str:
        """Every stage and the rank holding it (logged once, by rank 0)."""

    def describe(self) -> str:
        """This rank's share."""


class SingleRunner:
    """pp = 1: the whole model is one stage on every rank, and Lightning's loop runs the step."""

    takes_over_step = False
    model_loss_step = False
    group = None

    def __init__(self) -> None:
        self.plan = StagePlan.single()
        self.require_sync = True
        self.grad_sync_func: GradSyncFunc | None = None  # (Lightning's backward is one piece: never called)

    def counted_elsewhere(self) -> set[int]:
        return set()

    def make_tied_copies_equal(self) -> None:
        pass  # a tied weight is one Parameter on one stage

    def sum_tied_gradients(self) -> None:
        pass

    def train_step(self, inputs: Any, targets: Tensor) -> Tensor:
        raise RuntimeError("pp = 1: Lightning's loop runs the step (takes_over_step is False)")

    def forward_only(self, inputs: Any = None, targets: Tensor | None = None) -> Any:
        raise RuntimeError("pp = 1: the model's own forward runs (takes_over_step is False)")

    def stage_table(self) -> str:
        return "no pipeline: one stage, the whole model, on every rank"

    def describe(self) -> str:
        return self.stage_table()
