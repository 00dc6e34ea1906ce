"""Run one pipeline rank: its stage modules, the training schedule, forward-only evaluation, tied gradients.

Training uses the schedules of ``torch.distributed.pipelining``
(:data:`~lightning_par.parallel.stage_plan.SCHEDULES`). Two things are written here because torch lacks them:

* **forward-only passes with changing shapes** (:meth:`PipelineRuntime.forward_only`): a ``PipelineStage`` fixes
  its activation shapes at its first step, but validation sees a short last batch and generation a growing
  sequence. Evaluation therefore sends each activation with a small shape header, stage after stage;
* **gradients of parameters held by several ranks** (a tied embedding and head on the first and last stage):
  summed over the pipeline group before the optimizer step, so every copy takes the same update
  (:meth:`PipelineRuntime.sum_tied_gradients`; :meth:`PipelineRuntime.make_tied_copies_equal` makes the copies
  equal at the start);
* **stages of any model** (:mod:`.split` and :mod:`.adapter`): torch's tracing frontend cannot split a Hugging Face
  model, so each stage is the model with the other stages' units removed, called through a small adapter.

The model's inputs are token ids, or a dict ``{"input_ids": ..., "attention_mask": ...}`` (from
:func:`~lightning_par.parallel.pipeline.batches.split_batch`, for a padded batch): the mask is cut into micro-batches
like the ids and given to every stage, since each stage's attention needs it.

The runtime is built last (split, then transform, then run: :func:`~lightning_par.parallel.parts.split`, then
:func:`~lightning_par.parallel.parallelize.parallelize`): it takes the parts' stage modules as they were transformed
(tensor parallel, recompute, data parallel) and builds torch's ``PipelineStage`` and schedule objects around them.
With ZeRO-3 (FSDP2 stage modules, :func:`~lightning_par.parallel.zero.fully_shard_parts`) torch's schedules
reduce-scatter each FSDP group's gradient once per step, after the last micro-batch's backward, and the
stages keep their parameters gathered from the first forward to that reduce-scatter (see :mod:`.fsdp` for the
counts). The runtime reduces nothing over data parallel itself: the owner does, told that the runtime defers its
reduction (:mod:`lightning_par.parallel.gradient_sync`), and :func:`~lightning_par.parallel.finalize.finalize` ends
each step. The runtime's part: :attr:`PipelineRuntime.grad_sync_func` hears each stage's gradients as the schedule
ends that stage's last backward, and ``require_sync = False`` holds everything back while gradients accumulate.

Everything that can be checked without a process group (schedule name, virtual stages, micro-batch counts) is
checked once, when the :class:`~lightning_par.parallel.stage_plan.StagePlan` is built (by the layout, in the
launching process); the runtime takes the plan as it is.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import pipelining
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_par._compat import metadata_inference_without_anomaly, without_p2p_to_itself
from lightning_par.measure import ActivationMeter
from lightning_par.parallel.parts import ModelParts, TiedCopy
from lightning_par.parallel.pipeline.adapter import PipelineOutput
from lightning_par.parallel.pipeline.batches import split_batch
from lightning_par.parallel.pipeline.loss import kept_activations, refuse_kept_activations
from lightning_par.parallel.pipeline.timeline import ComputeRecord, ScheduleRecorder
from lightning_par.parallel.router import apply_aux_loss_in_backward, apply_layer_balancing, started_aux_losses
from lightning_par.parallel.runners import GradSyncFunc
from lightning_par.parallel.stage_plan import SCHEDULES, StagePlan  # noqa: F401 -- SCHEDULES: the old import path
from lightning_par.topology import LayoutError

# -- point-to-point transfer of tensors whose shape the receiver does not know -------------------------------------
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER = 8  # dtype, ndim, up to 6 dims


def _header(t: Tensor) -> Tensor:
    if t.dim() > _HEADER - 2:
        raise ValueError(f"pipeline activations of {t.dim()} dimensions are not supported (at most {_HEADER - 2})")
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=t.device)


def _isend(t: Tensor, dst: int, group: dist.ProcessGroup) -> list:
    t = t.contiguous()
    return [dist.isend(_header(t), dst=dst, group=group), dist.isend(t, dst=dst, group=group), t]


def _recv(src: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    out = torch.empty([int(d) for d in header[2:2 + ndim]], dtype=dtype, device=device)
    dist.recv(out, src=src, group=group)
    return out


def _forward_parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return set()


def _no_reduce(grad_scale_factor: int) -> None:
    """Stands in for ``PipelineStage.perform_reduce_grad`` while gradients accumulate (the schedule is built with
    ``scale_grads=False``, so there is nothing to scale either)."""


#: the old name of :meth:`StagePlan.for_schedule` (tests and benchmarks build plans with it)
resolve_schedule = StagePlan.for_schedule

def _plain(tensor: Tensor) -> Tensor:
    """The value of a loss: a DTensor's full tensor (a vocabulary-parallel loss is a replicated DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: Tensor) -> Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard (sharded alike on every copy), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _grad_like_param(param: nn.Parameter) -> Tensor:
    """This rank's part of ``param``'s gradient, laid out like ``param`` itself (zeros if it has none yet).

    Autograd may hand a DTensor parameter a gradient with other placements: a vocabulary-parallel embedding
    (``Shard(0)``) gets a ``Replicate()`` one, so its local tensor is the whole table while the tied head's copy on
    another pipeline rank holds its ``Shard(0)`` rows. The gradient is redistributed to the parameter's placements
    (here a local slice, no communication) and put back in ``param.grad``, so both copies sum the same rows."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
        param.grad = grad
    return _local(grad)


def fsdp_modules(modules: Sequence[nn.Module]) -> list[FSDPModule]:
    """The FSDP2 modules inside ``modules`` (each once), outermost first within each module."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule) and id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
    return out


@dataclass
class Recording:
    """One recorded training step on this rank: the executed actions and the peak saved activation bytes."""

    records: list[ComputeRecord]
    origin: float
    peak_activation_bytes: int


class PipelineRuntime:
    """This rank's share of a pipeline: the module with its stages' units, the stages, the training schedule.

    Args:
        parts: this rank's part of the model, from :func:`~lightning_par.parallel.parts.split` with the pipeline's
            plan (:class:`StagePlan`, e.g. ``Layout.stage_plan``), already transformed
            (:func:`~lightning_par.parallel.parallelize.parallelize`: tensor parallel, recompute, data-parallel
            sharding): its stage modules are what torch's ``PipelineStage`` objects run.
        pp_mesh: the 1-D pipeline mesh this rank belongs to (the one the parts were split for).
        loss_fn: ``loss_fn(outputs, targets)`` of one micro-batch, on the last stage; or None: the model's own loss
            (a Hugging Face causal LM's ``loss_function``, :class:`~.loss.ModelLoss`), for batches given with
            ``labels=`` (:meth:`train_step`, :meth:`train_call`, :meth:`forward_only`).
        loss_scale: the factor applied to each micro-batch loss before backward (1 / (m * accumulation)).
        device: where the stages compute.

    Hooks registered on the rank module run only when it is called itself (evaluation through
    :meth:`forward_only`), hooks registered on a stage module only when that stage runs.

    Attributes after construction: ``plan``, ``module`` (the rank module: all of this rank's units, original names),
    ``stage_modules`` (the parts' stages), ``stages`` (torch ``PipelineStage`` objects), ``schedule``,
    ``units_by_stage``, ``stage_ids``, ``block_names`` (the repeated blocks this rank holds),
    ``require_sync`` (see :meth:`train_step`), ``model_loss`` (the model's own loss, or None).
    """

    #: the schedule runs forward and backward itself (see :class:`~lightning_par.parallel.runners.Runner`)
    takes_over_step = True

    def __init__(self, parts: ModelParts, pp_mesh: DeviceMesh, loss_fn: Callable[[Any, Any], Tensor] | None,
                 loss_scale: float, device: torch.device) -> None:
        split = parts.pipeline
        if split is None:
            raise LayoutError("the pipeline runtime runs the parts of a pipeline split (split() with a plan of pp > 1)")
        plan, spec = split.plan, split.plan.spec
        if spec is None or plan.pp != pp_mesh.size():
            raise LayoutError(f"the pipeline runtime needs a plan with a schedule for its mesh's pp={pp_mesh.size()}, "
                              f"got {plan}.")
        self.plan = plan
        self.group = pp_mesh.get_group()
        self.pp_rank, self.pp = pp_mesh.get_local_rank(), plan.pp
        self.global_ranks = dist.get_process_group_ranks(self.group)
        self.device = device
        self.units, self.units_by_stage, self.stage_ids = split.units, split.units_by_stage, split.stage_ids
        self.io, self.model_loss = split.io, split.model_loss
        self.module = split.module
        if loss_fn is None and self.model_loss is None:
            raise LayoutError(f"the pipeline was given no loss_fn, and {type(self.module).__name__} has no loss of its "
                              "own that it can compute on the last stage (a Hugging Face causal LM's loss_function).")
        self.chain_check_seconds = split.chain_check_seconds
        self.block_names = parts.block_names
        self.stage_modules = list(parts.stages)
        self.last_rank = plan.rank_of(plan.n_stages - 1)  # pipeline rank that computes the loss
        self._tied = split.tied
        self._tied_grad_meta: list[tuple[list[int], torch.dtype]] | None = None  # local shapes, after the 1st sum
        # False while Lightning accumulates gradients: FSDP stage modules keep their gradients unreduced
        self.require_sync = True
        self._loss_fn = loss_fn
        self._step_loss = loss_fn  # the loss of the current step's micro-batches (see train_step)
        self._micro_losses: list[Tensor] = []
        self.loss_scale = loss_scale  # read per micro-batch: an elastic resume may change the accumulation
        self.record_next = False  # record the next training step's executed schedule and activation memory
        self.recording: Recording | None = None

        self.loss_scale = loss_scale  # (set again when a later fit of the same model accumulates otherwise)
        # each router layer's load-balancing loss starts its backward from the layer's output, scaled as the
        # micro-batch's loss is (the schedule backpropagates the last stage's loss alone)
        # (a Hugging Face MoE model's: each layer's term, from its own router logits; its blocks then declare it)
        self.layer_balancing = apply_layer_balancing(self.module, self.stage_modules, self.block_names)
        self._aux_losses = apply_aux_loss_in_backward(self.module, lambda: self.loss_scale)
        self._kept_checked = False  # see kept_activations: checked on the first training step

        def scaled_loss(outputs: Any, targets: Any) -> Tensor:
            loss = self._step_loss(outputs, targets)
            self._micro_losses.append(_plain(loss.detach()))
            return loss * self.loss_scale

        if spec.split_backward:
            # the weight-gradient half of a backward finds the weights through the stage module's parameters:
            # FSDP2 must keep the gathered ones registered from the forward on (freed after a forward, the
            # sharded ones would be found, and the weight gradients silently lost)
            for module in fsdp_modules(self.stage_modules):
                module.set_reshard_after_forward(False, recurse=False)
        n = plan.n_stages
        self.stages = [without_p2p_to_itself(pipelining.PipelineStage(mod, i, n, device, group=self.group))
                       for i, mod in zip(self.stage_ids, self.stage_modules, strict=True)]
        schedule_cls = getattr(pipelining, spec.torch_class)
        stages = self.stages[0] if spec.torch_class in ("ScheduleGPipe", "Schedule1F1B") else self.stages
        try:
            # scale_grads=False: torch would divide *all* gradients every step, which breaks accumulation over
            # several Lightning batches; the loss is scaled instead
            self.schedule = schedule_cls(stages, n_microbatches=plan.n_microbatches, loss_fn=scaled_loss,
                                         scale_grads=False)
            metadata_inference_without_anomaly(self.schedule)  # detect_anomaly: its inputs are uninitialised
        except ValueError as err:  # raised alike on every rank, before any communication
            raise LayoutError(f"pipeline schedule {plan.schedule!r} with pp={self.pp}, n_microbatches="
                              f"{plan.n_microbatches}, virtual_stages={plan.virtual_stages}: {err}") from err

    @property
    def model_loss_step(self) -> bool:
        """Trained with the model's own loss (built without ``loss_fn``): see :meth:`train_call`."""
        return self._loss_fn is None

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.last_rank

    # -- training ----------------------------------------------------------------------------------------------
    def _model_inputs(self, inputs: Tensor | Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """``(ids, {"attention_mask": mask})`` of the inputs: a tensor, or a dict from ``split_batch``."""
        if isinstance(inputs, Tensor):
            return inputs, {}
        if not isinstance(inputs, Mapping) or not isinstance(inputs.get("input_ids"), Tensor):
            raise LayoutError(f"pipeline inputs must be a tensor or a dict with 'input_ids' (and 'attention_mask'), "
                              f"got {type(inputs).__name__}; see lightning_par.parallel.pipeline.batches.split_batch.")
        unknown = sorted(set(inputs) - {"input_ids", "attention_mask", "position_ids"})
        if unknown:
            raise LayoutError(f"pipeline inputs may hold only 'input_ids', 'attention_mask' and 'position_ids', got "
                              f"also {unknown}.")
        # packed documents: every stage's attention keeps to them (cut into micro-batches like the ids)
        positions = {} if inputs.get("position_ids") is None else {"position_ids": inputs["position_ids"]}
        if positions and "position_ids" not in _forward_parameters(self.module):
            raise LayoutError(f"this batch carries position_ids (packed documents), but {type(self.module).__name__}"
                              ".forward takes no `position_ids`, so the stages' attention would cross documents. Give "
                              "the forward a position_ids argument (as lightning_par.examples.GPT), or do not pack.")
        mask = inputs.get("attention_mask")
        if mask is None or bool(mask.bool().all()):  # nothing masked: the same as no mask
            return inputs["input_ids"], positions
        if not self.io.takes_mask:
            raise LayoutError(
                f"this batch has an attention_mask with zeros (padding), but {type(self.module).__name__}.forward "
                "takes no `attention_mask`, so the pipeline cannot give it to the stages. Pack the sequences "
                "without padding, or give the model's forward an attention_mask argument."
            )
        return inputs["input_ids"], {"attention_mask": mask, **positions}

    def _losses_for(self, targets: Tensor | None, labels: Tensor | None, m: int,
                    num_items_in_batch: Any = None) -> tuple[Callable[[Any, Any], Tensor], Tensor]:
        """The loss of each of a batch's ``m`` micro-batches and what it compares with: ``loss_fn`` and
        ``targets``, or the model's own loss and ``labels`` (Hugging Face's convention, shifted inside the loss)."""
        if (targets is None) == (labels is None):
            raise TypeError("give the pipeline either targets (for loss_fn) or labels= (for the model's own loss)")
        if labels is None:
            if self._loss_fn is None:
                raise LayoutError("this pipeline has no loss_fn: give the batch's labels= for the model's own loss "
                                  f"({self.model_loss.name if self.model_loss else 'none'}).")
            return self._loss_fn, targets
        if self.model_loss is None:
            raise LayoutError(f"{type(self.module).__name__} has no loss of its own that the pipeline can compute on "
                              "the last stage (a Hugging Face causal LM's loss_function): give targets for loss_fn.")
        return self.model_loss.for_batch(labels, m, num_items_in_batch), labels

    def _model_call(self, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Tensor | None, Any]:
        """``(inputs, labels, num_items_in_batch)`` of a call made the way a Hugging Face model is called
        (``model(input_ids=..., attention_mask=..., labels=...)``), checked like a batch (``split_batch``)."""
        kwargs = dict(kwargs)
        input_key = self.io.input_key or "input_ids"
        if args:
            if len(args) > 1 or input_key in kwargs:
                raise TypeError(f"the pipeline's forward takes the model's inputs as one tensor or by keyword "
                                f"({input_key}=, attention_mask=, labels=); it got {len(args)} positional arguments"
                                f"{' and ' + input_key + '=' if input_key in kwargs else ''}.")
            kwargs[input_key] = args[0]
        # a pipeline stage keeps no cache, and the output is read by name either way
        for key, ignored in (("use_cache", (None, False)), ("return_dict", (None, True))):
            if key in kwargs and kwargs[key] in ignored:
                del kwargs[key]
        ids, mask = kwargs.pop(input_key, None), kwargs.pop("attention_mask", None)
        labels, items = kwargs.pop("labels", None), kwargs.pop("num_items_in_batch", None)
        if not isinstance(ids, Tensor) or kwargs:
            raise TypeError(f"the pipeline's forward takes the model's inputs (a tensor, or {input_key}=, "
                            f"attention_mask= and labels=) and targets; it got "
                            f"{'no inputs' if not isinstance(ids, Tensor) else 'also ' + str(sorted(kwargs))}.")
        if labels is None:
            inputs = ids if mask is None else {"input_ids": ids, "attention_mask": mask}
            return inputs, None, None
        batch = {"input_ids": ids, "labels": labels, **({} if mask is None else {"attention_mask": mask})}
        inputs, _ = split_batch(batch)  # the shapes checked, an all-ones mask dropped
        return inputs, labels, items

    def train_call(self, *args: Any, **kwargs: Any) -> PipelineOutput:
        """Training's forward of the rank module, called the way a Hugging Face model is
        (``self.model(**batch)`` with ``labels``): runs :meth:`train_step` -- forward and backward of the whole
        batch through the schedule, the model's own loss on the last stage -- and returns ``{"loss": ...}`` (the
        batch loss, detached, on every pipeline rank). The logits exist only on the last stage, one micro-batch at
        a time: the output has none."""
        inputs, labels, items = self._model_call(args, kwargs)
        if labels is None:
            raise LayoutError(
                "under pipeline parallel the model call in training_step runs forward and backward through the "
                "stages, with the loss computed on the last stage: it needs labels= (the output then holds the "
                "loss only), e.g. `loss = self.model(**batch).loss` with 'labels' in the batch. This call gave "
                "no labels. To compute your own loss from the logits, define loss_fn(outputs, targets) and "
                "compute_loss(batch) instead (see lightning_par.examples.GPTLightningModule).")
        return PipelineOutput(loss=self.train_step(inputs, labels=labels, num_items_in_batch=items))

    def train_step(self, inputs: Tensor | Mapping[str, Tensor], targets: Tensor | None = None, *,
                   labels: Tensor | None = None, num_items_in_batch: Any = None) -> Tensor:
        """Forward and backward of one batch through the schedule; gradients accumulate in the parameters.

        ``inputs`` are the model's input ids, or a dict with ``input_ids`` and ``attention_mask`` (every stage gets
        the mask). The loss: ``loss_fn`` against ``targets``, whose batch loss is the mean of the micro-batch
        losses; or, with ``labels=`` instead (Hugging Face's convention), the model's own loss
        (:class:`~.loss.ModelLoss`), whose batch loss is the token mean over the whole batch, as one process
        computes it (``num_items_in_batch``: the token count to divide by, default the labels' own).
        Returns the batch loss (unscaled) on every pipeline rank, with the load-balancing losses the stages' router
        layers started in the backward added (their micro-batches' mean; see :mod:`lightning_par.parallel.router`).

        FSDP2 stage modules (ZeRO-3): torch's schedule accumulates the micro-batches' gradients unreduced and
        reduce-scatters each FSDP group once after the last backward of the step. With ``require_sync = False``
        (the non-final batches of gradient accumulation) that reduce-scatter is skipped too: the gradients stay
        unreduced (and the parameters gathered) until the step whose ``require_sync`` is True.
        """
        self._step_loss, targets = self._losses_for(targets, labels, self.plan.n_microbatches, num_items_in_batch)
        m = self.plan.n_microbatches
        ids, extra = self._model_inputs(inputs)
        if ids.size(0) % m:
            raise LayoutError(f"the batch of {ids.size(0)} samples does not split into n_microbatches={m} equal "
                              f"micro-batches; use a batch size that is a multiple of {m}, or another n_microbatches.")
        self._micro_losses = []
        args = (ids,) if self.is_first else ()
        kwargs = {"target": targets, "return_outputs": False} if self.is_last else {}
        kwargs.update(extra)  # cut into micro-batches by the schedule and given to every stage
        if self.io.inject:  # later stages run the forward on the model's input (see adapter.py)
            kwargs["model_inputs"] = ids
        deferred = [] if self.require_sync else [s for s in self.stages if isinstance(s.submod, FSDPModule)]
        for stage in deferred:  # keep the gradients unreduced: an instance attribute shadows the method
            stage.perform_reduce_grad = _no_reduce
        try:
            if self.record_next:  # see lightning_par.callbacks.PipelineTimeline
                self.record_next = False
                with ScheduleRecorder(self.stages) as recorder, ActivationMeter(self.module.parameters()) as meter:
                    self.schedule.step(*args, **kwargs)
                self.recording = Recording(recorder.records, recorder.origin, meter.peak_bytes)
            else:
                self.schedule.step(*args, **kwargs)
        finally:
            for stage in deferred:
                del stage.perform_reduce_grad
        # the last m: on its first step torch also calls the loss function to infer the backward's shapes
        micro = self._micro_losses[-m:]
        loss = torch.stack(micro).float().mean() if self.is_last else \
            torch.zeros((), dtype=torch.float32, device=self.device)
        # the step's loss is the same quantity as without pp: the micro-batches' mean of the loss plus the
        # load-balancing losses the layers started, each stage's added (the sum gives every rank the total)
        aux = started_aux_losses(self._aux_losses, m)
        if aux is not None:
            loss = loss + aux.to(loss.device)
        if self._kept_checked:
            dist.all_reduce(loss, group=self.group)
            return loss
        # the first step: the loss's one collective also carries each stage's count of kept activations
        kept = kept_activations(self.module, self._aux_losses)
        counts = torch.zeros(1 + self.pp, dtype=torch.float32, device=loss.device)
        counts[0], counts[1 + self.pp_rank] = loss, len(kept)
        dist.all_reduce(counts, group=self.group)
        self._kept_checked = True
        refuse_kept_activations(kept, [r for r in range(self.pp) if counts[1 + r] > 0], self.pp)
        return counts[0]

    def _from_last(self, tensor: Tensor) -> Tensor:
        dist.broadcast(tensor, src=self.global_ranks[self.last_rank], group=self.group)
        return tensor

    def _tied_copy(self, tied: TiedCopy) -> nn.Parameter | None:
        return self.module.get_parameter(tied.name) if tied.name is not None else None

    @property
    def grad_sync_func(self) -> GradSyncFunc | None:
        """``grad_sync_func(params)``, called while ``require_sync`` as the schedule returns from a stage's last
        backward of the step (``last_backward``: its last B, or W in the zero-bubble schedules) with the stage's
        parameters, less those whose gradient is still to change -- tied copies, summed over the pipeline later, and
        parameters two stages of this rank share -- so the data-parallel owner can start reducing them while the
        schedule runs this rank's remaining actions (Megatron-Core's ``config.grad_sync_func``)."""
        return self._grad_sync_func

    @grad_sync_func.setter
    def grad_sync_func(self, func: GradSyncFunc | None) -> None:
        if func is not None and self._grad_sync_func is None:
            for stage in self.stages:
                for name in ("backward_one_chunk", "backward_weight_one_chunk"):
                    # an instance attribute shadows the method (the schedule calls it by name, with last_backward=)
                    setattr(stage, name, self._reporting(stage, getattr(stage, name)))
        self._grad_sync_func = func

    _grad_sync_func: GradSyncFunc | None = None

    def _reporting(self, stage: Any, backward: Callable[..., Any]) -> Callable[..., Any]:
        """``backward`` that then reports the stage's gradients after its last backward of the step. It keeps
        ``backward``'s signature (``functools.wraps``): the timeline recorder binds the schedule's arguments to it to
        find the micro-batch."""

        @functools.wraps(backward)
        def call(*args: Any, **kwargs: Any) -> Any:
            out = backward(*args, **kwargs)
            if kwargs.get("last_backward") and self.require_sync and self._grad_sync_func is not None:
                late = self._reduced_last()
                self._grad_sync_func([p for p in stage.submod.parameters() if id(p) not in late])
            return out

        return call

    def _reduced_last(self) -> set[int]:
        """ids of the parameters whose gradient changes after their stage's last backward: tied copies (summed
        over the pipeline) and parameters held by more than one stage of this rank."""
        late = {id(p) for tied in self._tied if (p := self._tied_copy(tied)) is not None}
        seen: set[int] = set()
        for stage in self.stages:
            for p in stage.submod.parameters():
                (late if id(p) in seen else seen).add(id(p))
        return late

    def _exchange_meta(self, tied: TiedCopy, local: Tensor | None) -> tuple[list[int], torch.dtype]:
        """The shape and dtype of this rank's part of ``tied``, broadcast from its source rank: ranks without a
        copy learn what to send; ranks with one check that their copy is split like the source's (a collective
        flag, so every rank raises alike)."""
        header = _header(local) if self.pp_rank == tied.source else torch.empty(_HEADER, dtype=torch.int64,
                                                                                 device=self.device)
        dist.broadcast(header, src=self.global_ranks[tied.source], group=self.group)
        ndim = int(header[1])
        shape, dtype = [int(d) for d in header[2:2 + ndim]], _DTYPES[int(header[0])]
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        if local is not None and (list(local.shape) != shape or local.dtype != dtype):
            bad += 1
        dist.all_reduce(bad, group=self.group)
        if int(bad):
            mine = f"{list(local.shape)} {local.dtype}" if local is not None else "no copy"
            raise LayoutError(
                f"the copies of a parameter held on several pipeline ranks ({tied.name or 'a tied weight'}) are split "
                f"differently over the other parallel dimensions (this rank holds {mine}, pipeline rank "
                f"{tied.source} holds {shape} {dtype}): shard / split both copies alike (the same tensor-parallel "
                "style, the same data-parallel sharding).")
        return shape, dtype

    @torch.no_grad()
    def make_tied_copies_equal(self) -> None:
        """Copy each parameter held on several pipeline ranks from the lowest pipeline rank holding it to the
        other copies (what this rank holds of it: a DTensor's local shard). Call on every pipeline rank together,
        at setup; the split copies are equal already when every rank built the model alike."""
        for tied in self._tied:
            param = self._tied_copy(tied)
            local = _local(param) if param is not None else None
            shape, dtype = self._exchange_meta(tied, local)
            buffer = local.detach().contiguous() if local is not None else torch.empty(shape, dtype=dtype,
                                                                                        device=self.device)
            dist.broadcast(buffer, src=self.global_ranks[tied.source], group=self.group)
            if local is not None and buffer.data_ptr() != local.data_ptr():
                local.copy_(buffer)

    def sum_tied_gradients(self) -> None:
        """Sum the gradients of parameters held on several pipeline ranks, so their copies take the same step.

        Call on every pipeline rank together, once per step: :func:`~lightning_par.parallel.finalize.finalize`
        does, after the reductions the schedule ran (ZeRO-3's, shard by shard) and before the owner finishes its
        own (ZeRO-1/2's reduce-scatter, on full gradients). Either way the sum commutes with the data-parallel one;
        the copies must be laid out alike, which the first call checks. The all-reduce runs over the whole pipeline
        group (ranks without a copy add zeros): tied weights are rare and this avoids extra process groups.
        """
        grads = []
        for tied in self._tied:
            param = self._tied_copy(tied)
            grads.append(_grad_like_param(param) if param is not None else None)
        if self._tied_grad_meta is None:  # the gradients' layouts, as the all-reduce will move them
            self._tied_grad_meta = [self._exchange_meta(tied, grad) for tied, grad in zip(self._tied, grads,
                                                                                          strict=True)]
        for grad, (shape, dtype) in zip(grads, self._tied_grad_meta, strict=True):
            if grad is None:
                grad = torch.zeros(shape, dtype=dtype, device=self.device)
            buffer = grad if grad.is_contiguous() else grad.contiguous()
            dist.all_reduce(buffer, group=self.group)
            if buffer is not grad:
                grad.copy_(buffer)

    def counted_elsewhere(self) -> set[int]:
        """ids of this rank's parameter copies whose gradient another pipeline rank counts in the global norm (the
        tied copies not on the lowest pipeline rank holding them). Looked up now: valid for the current
        ``Parameter`` objects (after tensor parallel and FSDP2 replaced them)."""
        out = set()
        for tied in self._tied:
            param = self._tied_copy(tied)
            if param is not None and not tied.counted_here:
                out.add(id(param))
        return out

    # -- forward only ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, inputs: Tensor | Mapping[str, Tensor] | None = None, targets: Tensor | None = None,
                     n_microbatches: int | None = None, **model_kwargs: Any) -> Any:
        """Run ``inputs`` through every stage in micro-batches, without a backward.

        With ``targets``: the loss (mean of the micro-batch losses) on every pipeline rank. Without: the last
        stage's output, on every pipeline rank. Every rank passes the same ``inputs`` (only the first stage reads
        them); shapes may change from call to call.

        It is also the forward of the rank's module (the engine installs it), so it takes a Hugging Face model's
        call too: ``model(input_ids=..., attention_mask=..., use_cache=False)`` returns a :class:`PipelineOutput`
        with the last stage's output under the model's output name (``.logits``); with ``labels=`` as well, one
        with the model's own loss of the batch (``.loss``, the token mean over the whole batch) and no logits.
        """
        called_like_model = inputs is None  # by keyword: the output is the model's (a PipelineOutput)
        labels = items = None
        if not isinstance(inputs, Mapping):  # a tensor, or the model's keywords
            inputs, labels, items = self._model_call(() if inputs is None else (inputs,), model_kwargs)
        elif model_kwargs:
            raise TypeError(f"the pipeline's forward takes a dict of inputs alone; it got also {sorted(model_kwargs)}.")
        ids, extra = self._model_inputs(inputs)
        m = math.gcd(ids.size(0), n_microbatches or self.plan.n_microbatches)  # equal micro-batches
        with_loss = targets is not None or labels is not None
        if with_loss:  # checked before any communication
            loss_fn, targets = self._losses_for(targets, labels, m, items)
        chunks = ids.tensor_split(m)
        # what goes with the ids to every stage (attention_mask, position_ids), cut alike
        extras = [dict(zip(extra, parts, strict=True)) for parts in zip(*(v.tensor_split(m) for v in extra.values()),
                                                                         strict=True)] if extra else [{}] * m
        last_stage = self.plan.n_stages - 1
        handoff: dict[tuple[int, int], Tensor] = {}  # (stage, micro-batch) -> input, between stages of this rank
        pending: list = []
        outputs: list[Tensor] = []
        for stage, module in zip(self.stage_ids, self.stage_modules, strict=True):
            # stages in increasing order, micro-batches in order, sends never wait: every receive is of an
            # earlier (stage, micro-batch) pair, so no rank waits on one that waits on it
            for k in range(m):
                if stage == 0:
                    x = chunks[k]
                elif (stage, k) in handoff:
                    x = handoff.pop((stage, k))
                else:
                    x = _recv(self.global_ranks[self.plan.rank_of(stage - 1)], self.group, self.device)
                kwargs = dict(extras[k])
                if self.io.inject:
                    kwargs["model_inputs"] = chunks[k]
                y = module(x, **kwargs)
                if stage == last_stage:
                    outputs.append(y)
                elif self.plan.rank_of(stage + 1) == self.pp_rank:
                    handoff[(stage + 1, k)] = y
                else:
                    pending += _isend(y, self.global_ranks[self.plan.rank_of(stage + 1)], self.group)
        for work in pending:
            if not isinstance(work, Tensor):
                work.wait()
        # FSDP2 stage modules gathered their parameters in their forward and, not resharding after forward in a
        # pipeline, still hold them: free them now (the optimizer may step the shards before the next call)
        for module in fsdp_modules(self.stage_modules):
            module.reshard()
        if with_loss:
            if self.is_last:
                losses = [loss_fn(y, t) for y, t in zip(outputs, targets.tensor_split(m), strict=True)]
                loss = torch.stack([_plain(x.detach()).float() for x in losses]).mean()
            else:
                loss = torch.zeros((), dtype=torch.float32, device=self.device)
            loss = self._from_last(loss)
            # called like the model with labels: its output holds the loss only (the logits are not gathered)
            return PipelineOutput(loss=loss) if called_like_model else loss
        output = self._broadcast_output(torch.cat(outputs) if self.is_last else None)
        return PipelineOutput({self.io.output_key or "logits": output}) if called_like_model else output

    def _broadcast_output(self, output: Tensor | None) -> Tensor:
        src = self.global_ranks[self.last_rank]
        header = _header(output) if output is not None else torch.empty(_HEADER, dtype=torch.int64,
                                                                         device=self.device)
        dist.broadcast(header, src=src, group=self.group)
        if output is None:
            ndim = int(header[1])
            output = torch.empty([int(d) for d in header[2:2 + ndim]], dtype=_DTYPES[int(header[0])],
                                 device=self.device)
        dist.broadcast(output, src=src, group=self.group)
        return output

    def stage_table(self) -> str:
        """Every stage of the pipeline (not only this rank's): its pipeline rank and the units it holds."""
        lines = [f"pipeline: {self.plan.n_stages} stages, schedule {self.plan.schedule}, "
                 f"{self.plan.n_microbatches} micro-batches"]
        for stage, units in enumerate(self.units_by_stage):
            span = units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]}"
            lines.append(f"  stage {stage} on pipeline rank {self.plan.rank_of(stage)}: {len(units)} units ({span})")
        return "\n".join(lines + ([self.layer_balancing] if self.layer_balancing else []))

    def describe(self) -> str:
        units = [u for i in self.stage_ids for u in self.units_by_stage[i]]
        balanced = [n for n in self._aux_losses if getattr(self.module.get_submodule(n), "aux_loss_coef", 0)
                    or self.layer_balancing]
        return (f"pipeline rank {self.pp_rank}/{self.pp}: stages {self.stage_ids} of {self.plan.n_stages} "
                f"({len(units)} units, {units[0]} .. {units[-1]}), schedule {self.plan.schedule}, "
                f"{self.plan.n_microbatches} micro-batches"
                + (f", the load-balancing losses of {len(balanced)} router layers started from their outputs in the "
                   "backward (added to the logged loss)" if balanced else ""))
