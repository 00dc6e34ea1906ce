"""A layout: how one model is spread over ranks. Every strategy is a preset of this one description.

All layout rules live here and are checked once: value types and ranges, and the pipeline's stages and schedule (a
:class:`~lightning_par.parallel.stage_plan.StagePlan`), when the layout is made; sizes against the world size in
:meth:`Layout.resolve`, which runs in the launching process before any rank starts or waits on a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_par.parallel.recompute import check_recompute
from lightning_par.parallel.router import check_aux_loss_scope
from lightning_par.parallel.stage_plan import StagePlan, check_positive_int, check_schedule_name
from lightning_par.topology import LayoutError, ParallelDims, Size, _check_size, check_number, is_number

#: ZeRO stages: 0 replicas (DDP), 1 optimizer states sharded, 2 + gradients, 3 + parameters.
SUPPORTED_ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)


@dataclass(frozen=True)
class Layout:
    """What to apply to a model: parallel sizes, the ZeRO stage across data parallel, the pipeline schedule.

    Attributes:
        dp, tp, pp: sizes (``dp="auto"``: world / (tp * pp * cp)).
        cp: context-parallel size: each sequence split over cp ranks (causal load balancing), attention over the
            whole sequence, gradients averaged over dp x cp (:mod:`lightning_par.parallel.context_parallel`).
        ep: expert-parallel size: each mixture-of-experts layer's experts split over ep of the dp x cp ranks,
            tokens sent to their experts and back (:mod:`lightning_par.parallel.expert_parallel`).
        zero_stage: 0 replicas, 1 optimizer states sharded, 2 + gradients, 3 + parameters (FSDP2).
        offload_optimizer, offload_parameters: ZeRO offload to host memory.
        schedule, n_microbatches, virtual_stages, stage_costs: the pipeline (pp > 1).
        sequence_parallel: tp > 1: split norms and the residual stream over the sequence too.
        recompute: activation recompute per block: "none", "selective" (the attention core) or "full".
        block_types: the model's repeated block classes (or class names), where they cannot be found otherwise.
        bucket_cap_mb: gradient bucket size for data-parallel reductions, in MiB.
        aux_loss_scope: the routers' load-balancing loss, ``"micro_batch"`` or ``"global"``
            (:mod:`lightning_par.parallel.router`); None: each model's own.
    """

    dp: Size = "auto"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_parameters: bool = False
    schedule: str = "1f1b"
    n_microbatches: int | None = None
    virtual_stages: int | None = None
    stage_costs: Sequence[float] | dict[str, float] | None = None
    sequence_parallel: bool = False
    recompute: str = "none"
    block_types: Sequence[type | str] | None = None
    bucket_cap_mb: float = 25.0
    aux_loss_scope: str | None = None

    def __post_init__(self) -> None:
        _check_size("dp", self.dp, allow_auto=True)
        _check_size("tp", self.tp, allow_auto=False)
        _check_size("pp", self.pp, allow_auto=False)
        _check_size("cp", self.cp, allow_auto=False)
        _check_size("ep", self.ep, allow_auto=False)
        check_schedule_name(self.schedule)
        for name in ("n_microbatches", "virtual_stages"):  # checked here even where pp = 1 leaves them unused
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_recompute(self.recompute)
        check_aux_loss_scope(self.aux_loss_scope)
        # an int, not a bool or a float: True == 1 and 1.0 == 1 would pass a bare membership test
        if not is_number(self.zero_stage, integer=True) or self.zero_stage not in SUPPORTED_ZERO_STAGES:
            raise LayoutError(
                f"zero_stage={self.zero_stage!r} is not available; this version supports the integers "
                f"{list(SUPPORTED_ZERO_STAGES)} (0 = replicas like DDP, 1 = optimizer states sharded, "
                "2 = + gradients sharded, 3 = + parameters sharded)."
            )
        if self.offload_parameters and self.zero_stage != 3:
            raise LayoutError(
                f"offload_parameters=True needs zero_stage=3 (got {self.zero_stage}): below stage 3 every rank holds "
                "all parameters for compute. Use zero_stage=3, or offload_optimizer=True with stage 1 or 2."
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise LayoutError(
                "offload_optimizer=True needs zero_stage 1, 2 or 3 (got 0): offload moves the sharded optimizer "
                "state to host memory. Use ZeroStrategy(stage=1, offload_optimizer=True) or higher."
            )
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError(
                "sequence_parallel=True needs tp > 1: it splits the sequence over the tensor-parallel ranks. "
                "Set tp to 2 or more, or sequence_parallel=False."
            )
        if self.cp > 1 and self.sequence_parallel:
            raise LayoutError(
                "sequence_parallel=True with cp > 1 is not supported: both split the sequence (sequence parallel "
                "over tp, context parallel over cp) and their composition is untested. Use one of them.")
        check_number("bucket_cap_mb", self.bucket_cap_mb, "a positive, finite number of MiB (default 25)", above=0)
        if self.block_types is not None and (isinstance(self.block_types, str | type) or not all(
                isinstance(t, str | type) for t in self.block_types)):
            raise LayoutError(f"block_types={self.block_types!r} is not valid: give a list of classes or class "
                              "names, e.g. block_types=['Block'].")
        # checked once, here: a bad schedule fails in the launching process, not on the ranks
        plan = StagePlan.for_schedule(self.schedule, self.pp, self.n_microbatches, self.virtual_stages) \
            if self.pp > 1 else StagePlan.single()
        object.__setattr__(self, "_stage_plan", plan)  # not a field: made from the fields

    def resolve(self, world_size: int) -> ParallelDims:
        """The concrete sizes for ``world_size`` ranks, or a :class:`LayoutError` that says how to fix them."""
        return ParallelDims.resolve(world_size, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)

    @property
    def stage_plan(self) -> StagePlan:
        """The pipeline's stages, their ranks and its schedule (``StagePlan.single()`` for pp = 1)."""
        return self._stage_plan  # type: ignore[attr-defined]

    @property
    def shards_parameters(self) -> bool:
        """Parameters are split somewhere (tp, pp, ep or ZeRO-3): states must be keyed by parameter name, and a model
        built in ``configure_model`` is built deferred, each rank materialising its share."""
        return self.zero_stage == 3 or self.pp > 1 or self.tp > 1 or self.ep > 1

    def transforms_blocks(self, compiled: bool) -> bool:
        """A transform works block by block (recompute, compile, context parallel's hooks on the module that runs
        the blocks): the model's blocks must be found. ZeRO-3 groups them where found, else shards the model as one
        unit (:func:`~lightning_par.parallel.zero.fully_shard_parts`)."""
        return self.recompute != "none" or compiled or self.cp > 1

    @property
    def sharded_checkpoint(self) -> bool:
        """Each rank writes its own part of a checkpoint (a DCP directory) rather than rank 0 one file (under ep > 1
        each rank holds other experts: DTensors ``Shard(0)`` that DCP saves once per expert and reshards)."""
        return self.zero_stage > 0 or self.pp > 1 or self.tp > 1 or self.ep > 1
