"""How a step runs under a layout: the strategy's step hooks, which :class:`~lightning_par.strategies.engine.
LayoutStrategy` delegates here (Lightning requires the methods on the strategy).

- One process's step (pp = 1): Lightning's loop runs forward, backward and the optimizer step as written.
- The pipeline's step (pp > 1: the runner takes over the step): the schedule runs forward and backward of the whole
  batch, and the LightningModule's own ``training_step`` runs with ``compute_loss`` answered by the schedule, so its
  logging is kept; a step written the Hugging Face way (``self.model(**batch).loss``) gets the schedule from its
  model call instead (:meth:`LayoutStep._model_call_step`).
- Every optimizer step first makes its gradients final (:func:`~lightning_par.parallel.finalize.finalize`: the
  tied copies summed over the pipeline, the data-parallel owner's reduction finished), then marks the non-finite
  flag (:mod:`lightning_par.run.bad_steps`), clips by the whole model's gradient norm
  (:mod:`lightning_par.parallel.grad_norm`), and under ``nonfinite="skip"`` discards a bad step's gradients on
  every rank. Under manual optimization that happens inside ``optimizer.step()``, so ``clip_gradients`` is refused.

Here in ``strategies/`` and not in ``parallel/``: it calls the LightningModule's steps, reads the Trainer and writes
to its loggers.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Generator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_par._compat import set_skip_backward, set_step_value, step_value, train_step_metrics
from lightning_par.parallel.finalize import finalize, no_sync
from lightning_par.parallel.grad_norm import clip_grads_, global_grad_norm
from lightning_par.parallel.pipeline.batches import split_batch, unpacked_batch_errors
from lightning_par.topology import LayoutError


class LayoutStep:
    """The step hooks of one :class:`~lightning_par.strategies.engine.LayoutStrategy`.

    It reads the parts the strategy's setup chose -- the runner, the data-parallel owner, the tensor-parallel plan --
    from the strategy at each call, since a later stage of the same model (fit after evaluation) chooses some again.
    """

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        # the optimizer whose clip marks this step's gradient bit from its global norm (see optimizer_step)
        self._clip_marks: Any = None
        self._step_means = _AccumulatedMeans()

    def attach(self, trainer: Any, fitting: bool) -> None:
        """Before a stage of the Trainer runs: a runner that takes over the step (the pipeline) scales each
        micro-batch's loss by 1 / (micro-batches x accumulated batches), and under fit Lightning must not run
        backward or zero the gradients -- the schedule does both (see :meth:`training_step`)."""
        runner = self._strategy._runner
        if runner.takes_over_step:
            accumulate = trainer.accumulate_grad_batches if fitting else 1
            runner.loss_scale = 1.0 / (runner.plan.n_microbatches * accumulate)
            set_skip_backward(trainer, fitting)

    def detach(self) -> None:
        """At teardown: Lightning's backward as it was."""
        lm = self._strategy.lightning_module
        if self._strategy._runner.takes_over_step and lm is not None:
            set_skip_backward(lm.trainer, False)

    # ----------------------------------------------------------------------------------------------------------------
    # Context parallel (cp > 1): each step's batch cut along the sequence, attention over the whole of it while the
    # step runs (lightning_par.parallel.context_parallel; applied in parallelize)
    # ----------------------------------------------------------------------------------------------------------------
    def check_batch(self, batch: Any) -> None:
        """A batch the layout cannot cut (padding under cp) refused as it reaches the device."""
        if self._strategy._context_parallel is not None:
            self._strategy._context_parallel.check_padding(batch)

    def _shard_sequence(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``(batch, ...)`` with the batch cut to this rank's share of each sequence (cp > 1)."""
        cp = self._strategy._context_parallel
        return args if cp is None else cp.shard_args(args)

    # ----------------------------------------------------------------------------------------------------------------
    # Training, evaluation and prediction steps
    # ----------------------------------------------------------------------------------------------------------------
    def training_step(self, lightning_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``lightning_step``: Lightning's own (the strategy's ``super().training_step``), for a step it runs."""
        with unpacked_batch_errors(args[0] if args else None):
            output = self._training_step(lightning_step, *args, **kwargs)
        lm = self._strategy.lightning_module
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        if lm is not None and lm.automatic_optimization and isinstance(batch_idx, int):
            self._step_means.update(lm.trainer, batch_idx)
        return output

    def _training_step(self, lightning_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        strategy = self._strategy
        args = self._shard_sequence(args)
        runner = strategy._runner
        if not runner.takes_over_step:
            with self.loss_context():
                return lightning_step(*args, **kwargs)
        lm = strategy.lightning_module
        assert lm is not None
        batch, batch_idx = args[0], args[1]
        with strategy.precision_plugin.train_step_context():
            if batch_idx % lm.trainer.accumulate_grad_batches == 0:  # where Lightning would zero the gradients
                for optimizer in strategy.optimizers:
                    optimizer.zero_grad(set_to_none=True)
            if runner.model_loss_step:
                return self._model_call_step(lm, *args, **kwargs)
            with self.loss_context():  # a vocab-parallel head (tp > 1) computes its loss on the last stage
                loss = runner.train_step(*split_batch(batch))
            with _loss_given(lm, lambda _batch: loss), _stage_reads(lm):
                output = lm.training_step(*args, **kwargs)
            _refuse_another_loss(lm, output, loss, "`self.compute_loss(batch)`")
            return output

    def _model_call_step(self, lm: Any, *args: Any, **kwargs: Any) -> Any:
        """A training_step written the Hugging Face way, ``loss = self.model(**batch).loss``: the step runs as
        written, and its model call runs the schedule (forward and backward of the whole batch, the model's own loss
        on the last stage) and returns the batch loss. So the step must call the model once, with labels, and
        return that loss as it is (it was backpropagated already); anything else is refused, alike on every rank
        (each runs the same step on a batch of the same form)."""
        runtime = self._strategy.pipeline
        assert runtime is not None
        losses: list[Tensor] = []

        def train_call(*call_args: Any, **call_kwargs: Any) -> Any:
            if losses:
                raise LayoutError(
                    f"{type(lm).__name__}.training_step called the model twice; under pipeline parallel its call runs "
                    "forward and backward of the whole batch through the stages, once per step. Call it once, e.g. "
                    "`loss = self.model(**batch).loss`.")
            with self.loss_context():
                output = runtime.train_call(*call_args, **call_kwargs)
            losses.append(output["loss"])
            return output

        runtime.module.forward = train_call
        try:
            with _stage_reads(lm):
                output = lm.training_step(*args, **kwargs)
        finally:
            runtime.module.forward = runtime.forward_only
        if not losses:
            raise LayoutError(
                f"{type(lm).__name__} defines no loss_fn(), so under pipeline parallel its training_step must get its "
                "loss from the model's own call, `self.model(**batch).loss` (labels in the batch), which runs the "
                "schedule; this training_step did not call the model. Call it, or define `loss_fn(outputs, targets)` "
                "and `compute_loss(batch)` (see lightning_par.examples.GPTLightningModule).")
        _refuse_another_loss(lm, output, losses[0], "the model's `.loss`")
        return output

    def evaluation_step(self, lightning_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A validation or test step (``lightning_step``: Lightning's own of that kind)."""
        batch, args = args[0] if args else None, self._shard_sequence(args)
        with unpacked_batch_errors(batch), self._pipeline_eval_loss(), self.loss_context():
            return lightning_step(*args, **kwargs)

    def predict_step(self, lightning_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        strategy = self._strategy
        if strategy._context_parallel is not None:
            raise LayoutError(f"predict_step under context parallel (cp={strategy.dims.cp}) is not supported: "
                              "predictions (and generation) need the whole sequence on a rank. Predict with a layout "
                              "without cp.")
        with unpacked_batch_errors(args[0] if args else None):
            return lightning_step(*args, **kwargs)

    @contextmanager
    def _pipeline_eval_loss(self) -> Generator[None, None, None]:
        """Evaluation's ``compute_loss`` runs forward-only through the stages; the loss comes from the last. (A
        step written the Hugging Face way needs nothing here: ``self.model(**batch)`` runs forward-only, and given
        labels its output's ``.loss`` is the model's own loss, see ``PipelineRuntime.forward_only``.)"""
        runner = self._strategy._runner
        if not runner.takes_over_step or runner.model_loss_step:
            yield None
            return
        lm = self._strategy.lightning_module
        assert lm is not None
        with _loss_given(lm, lambda batch: runner.forward_only(*split_batch(batch))):
            yield None

    @contextmanager
    def loss_context(self) -> Generator[None, None, None]:
        """Around the step's forward and around its backward: context parallel's step context (its attention over the
        whole sequence); a vocab-parallel head's loss on vocabulary shards, which the step sees as a plain tensor, as
        under any other layout (:func:`_plain_losses`)."""
        strategy = self._strategy
        plan, lm = strategy._tensor_parallel, strategy.lightning_module
        with ExitStack() as stack:
            if strategy._context_parallel is not None:  # attention over the whole sequence, global positions
                stack.enter_context(strategy._context_parallel.step())
            if plan is not None:
                stack.enter_context(plan.loss_context())
                if plan.vocab_parallel_head and lm is not None:
                    stack.enter_context(_plain_losses(lm))
            yield None

    # ----------------------------------------------------------------------------------------------------------------
    # Backward: every data-parallel hook goes to the one owner
    # ----------------------------------------------------------------------------------------------------------------
    def backward(self, lightning_backward: Callable[..., Tensor], closure_loss: Tensor, *args: Any,
                 **kwargs: Any) -> Tensor:
        with self.loss_context():
            return lightning_backward(closure_loss, *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the non-final micro-steps of ``accumulate_grad_batches``."""
        with no_sync(self._strategy.gradient_sync, self._strategy._runner):
            yield None

    # ----------------------------------------------------------------------------------------------------------------
    # The optimizer step: finalize, the non-finite flag, the clip by the whole model's norm, the skip
    # ----------------------------------------------------------------------------------------------------------------
    def global_grad_norm(self, optimizer: Any = None) -> Tensor:
        """The 2-norm of the whole model's gradient (what a single process would compute), on every rank.

        Sums squares over tensor- and data-parallel shards (DTensor placements) and over pipeline stages, a
        parameter held by several pipeline ranks counted once. ``optimizer``: only its parameters (default: all).
        """
        strategy = self._strategy
        optimizers = [optimizer] if optimizer is not None else strategy.optimizers
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        grads = strategy.gradient_sync.norm_grads(params, strategy._runner.counted_elsewhere())
        return global_grad_norm(grads, strategy._runner.group, device=strategy.root_device)

    def clip_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        """Lightning's clip by norm (the precision plugin's ``clip_grad_by_norm``), by the whole model's norm: the
        norm of what one rank holds would clip each shard differently.

        Refused under manual optimization: the gradients are made final (:func:`~lightning_par.parallel.finalize.
        finalize`) inside ``optimizer.step()``, so a ``clip_gradients`` before it would see partial ones."""
        lm = self._strategy.lightning_module
        if lm is not None and not lm.automatic_optimization:
            raise LayoutError("clip_gradients under manual optimization: gradients are made final in optimizer.step()"
                              " (finalize.py), so before it they may be partial. Clip under automatic "
                              "optimization, with Trainer(gradient_clip_val=...).")
        total = self.global_grad_norm(optimizer)
        if self._clip_marks is optimizer:  # this norm is the step's gradient check too
            self._clip_marks = None
            self._strategy.nonfinite_flags.add_grad_norm(total)
        clip_grads_(
            [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None], clip_val,
            total)

    def optimizer_step(self, lightning_step: Callable[..., Any], optimizer: Any, closure: Any, model: Any = None,
                       **kwargs: Any) -> Any:
        """``lightning_step``: Lightning's own (the strategy's ``super().optimizer_step``)."""
        strategy = self._strategy
        flags = strategy.nonfinite_flags
        self._clip_marks = None  # (left set by a step that raised)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        agree_first = flags.policy == "skip" and strategy._run_guard is not None
        # Lightning's clip runs between this closure and the update; under "stop" its global norm marks the gradient
        # bit too (one norm per step, not two). Under "skip" the ranks agree before the clip, which must not run on
        # a discarded step: the closure marks the bit from this rank's gradients then, as without clipping.
        clip_marks = not agree_first and self._lightning_clips_by_norm()

        def checked() -> Any:
            result = closure()
            # the one end of every step for the gradients, before they are checked, clipped and stepped -- unless
            # Lightning's loop skipped the batch (training_step returned None: no backward ran, no gradients)
            lm = strategy.lightning_module
            if result is not None or strategy._runner.takes_over_step or not lm.automatic_optimization:
                finalize(strategy.gradient_sync, strategy._runner)
            # the step's loss and this rank's gradients, marked on the device (no host sync; bad_steps.py)
            flags.add_loss(result)
            if clip_marks:
                self._clip_marks = optimizer
            else:
                flags.add_grads(strategy.gradient_sync.norm_grads(params))
            return result

        if agree_first:
            result = checked()
            assert strategy.lightning_module is not None
            if any(strategy._run_guard.agree_now(strategy.lightning_module.trainer)):
                self._skip_step(optimizer)
                return result
            output = lightning_step(optimizer, lambda: result, model, **kwargs)
        else:
            output = lightning_step(optimizer, checked, model, **kwargs)
        if self._clip_marks is not None:  # no clip ran after all: this rank's gradients (the update leaves them)
            self._clip_marks = None
            flags.add_grads(strategy.gradient_sync.norm_grads(params))
        strategy.gradient_sync.after_step()
        return output

    def _lightning_clips_by_norm(self) -> bool:
        """Whether Lightning's loop clips this step by norm through :meth:`clip_by_global_norm`: automatic
        optimization, ``Trainer(gradient_clip_val > 0)`` by norm, and neither of the LightningModule's clipping hooks
        overridden (an override may clip otherwise, or not at all)."""
        strategy = self._strategy
        lm = strategy.lightning_module
        if lm is None or not strategy.nonfinite_flags.check_grads or not lm.automatic_optimization:
            return False
        trainer = lm.trainer
        return ((trainer.gradient_clip_val or 0) > 0 and (trainer.gradient_clip_algorithm or "norm") == "norm"
                and not is_overridden("configure_gradient_clipping", lm) and not is_overridden("clip_gradients", lm))

    def _skip_step(self, optimizer: Any) -> None:
        """Discard a non-finite step's gradients on every rank (agreed): the optimizer does not step."""
        flags = self._strategy.nonfinite_flags
        optimizer.zero_grad(set_to_none=True)
        flags.skipped += 1
        lm = self._strategy.lightning_module
        assert lm is not None
        trainer = lm.trainer
        for logger in trainer.loggers:  # loggers write on rank 0 only
            logger.log_metrics({"train/skipped_steps": float(flags.skipped)}, step=trainer.global_step)
        rank_zero_info(f"lightning-par: step {trainer.global_step}: non-finite loss or gradient norm; the step's "
                       f"gradients were discarded on every rank ({flags.skipped} skipped so far)")


@contextmanager
def _plain_losses(lm: Any) -> Generator[None, None, None]:
    """Under a vocab-parallel head ``F.cross_entropy`` returns a replicated DTensor, which Lightning's
    ``self.log(..., sync_dist=True)`` cannot all-reduce (c10d has no DTensor rule). While the step runs, the
    LightningModule's ``loss_fn`` returns its plain value (``full_tensor()``: no communication for a replicated
    value, and differentiable) and ``self.log`` takes any DTensor value as its full tensor, so a step written for
    one device logs as written."""
    own = {name: lm.__dict__[name] for name in ("loss_fn", "log") if name in lm.__dict__}
    loss_fn, log = getattr(lm, "loss_fn", None), lm.log
    if callable(loss_fn):
        lm.loss_fn = lambda *args, **kwargs: _plain_value(loss_fn(*args, **kwargs))
    lm.log = lambda name, value, *args, **kwargs: log(name, _plain_value(value), *args, **kwargs)
    try:
        yield None
    finally:
        for name in ("loss_fn", "log"):
            lm.__dict__.pop(name, None)
        lm.__dict__.update(own)


def _plain_value(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _refuse_another_loss(lm: Any, output: Any, loss: Tensor, given: str) -> None:
    """Under a pipeline the schedule already ran the backward of ``loss`` (and Lightning's is skipped), so the step
    must return that tensor itself: a loss computed from it -- scaled, or with terms added such as the routers'
    load-balancing losses read from the layers, which live on different stages -- would train another function than
    one process does, silently. Refused at the first step, before any update."""
    returned = output.get("loss") if isinstance(output, Mapping) else output
    if returned is None or returned is loss:
        return
    raise LayoutError(
        f"{type(lm).__name__}.training_step returned a loss other than {given}: under pipeline parallel that loss "
        "was computed and backpropagated inside the schedule, stage by stage, so a loss computed from it (scaled, or "
        "with terms added, e.g. load-balancing losses read from the layers, which live on different stages) would "
        f"not be trained on. Return {given} as it is; put a scale or extra term of the output in loss_fn(outputs, "
        "targets) (it runs on the last stage); a layer's own auxiliary loss must start its backward in the layer: "
        "declare `aux_loss_backward = None` on the layer class and return `self.aux_loss_backward(y, coef * aux)` "
        "when set, as lightning_par.examples.moe.MoEFeedForward does (docs/pipeline.md); or train without pp.")


@contextmanager
def _stage_reads(lm: Any) -> Generator[None, None, None]:
    """A step that reads a module of another pipeline stage (a layer's attribute, an index of its layer list) fails
    with Python's error, raised in the step's own code (its innermost frame in the LightningModule's file); say why."""
    try:
        yield None
    except (AttributeError, IndexError, KeyError) as err:
        frames = traceback.extract_tb(err.__traceback__)
        if not frames or frames[-1].filename != inspect.getsourcefile(type(lm)):
            raise
        err.add_note(f"lightning-par: {type(lm).__name__}.training_step ran under pipeline parallel, where each rank "
                     "holds the layers of its stage only (the others are pass-through stand-ins); a step that reads "
                     "layers' attributes (e.g. an auxiliary loss) cannot see those of other stages. See "
                     "docs/pipeline.md on auxiliary losses.")
        raise


class _AccumulatedMeans:
    """Under ``accumulate_grad_batches`` > 1, what ``self.log(..., on_step=True)`` in ``training_step`` logs for an
    optimizer step is the mean over its micro-batches (Lightning logs the last micro-batch's): the train loss logged
    is the step's over its whole global batch, as with the same global batch in one loader batch, so an elastic
    attempt that re-derives the accumulation (docs/elastic.md) logs what the uninterrupted run logged."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[Tensor, int, Any]] = {}

    def update(self, trainer: Any, batch_idx: int) -> None:
        accumulate = trainer.accumulate_grad_batches
        if accumulate <= 1:
            return
        if batch_idx % accumulate == 0:  # a new optimizer step's first micro-batch
            self._sums = {}
        for key, metric in train_step_metrics(trainer):
            value = step_value(metric)
            seen = self._sums.get(key)
            if not isinstance(value, Tensor) or not value.is_floating_point() or (seen and seen[2] is value):
                continue  # not logged by this micro-batch (still the mean set at the last one)
            total, count = (seen[0] + value, seen[1] + 1) if seen else (value, 1)
            mean = total / count
            set_step_value(metric, mean)
            self._sums[key] = (total, count, mean)


@contextmanager
def _loss_given(lm: Any, compute_loss: Any) -> Generator[None, None, None]:
    """Run the LightningModule's own step with ``compute_loss`` answered by the pipeline, so its logging is kept."""
    lm.compute_loss = compute_loss
    try:
        yield None
    finally:
        del lm.compute_loss
