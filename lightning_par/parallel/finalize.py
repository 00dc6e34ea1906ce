"""The end of every training step for the gradients: one function, whatever the layout.

:func:`finalize` runs once per optimizer step, after the last backward and before the non-finite check, clipping and
the optimizer (the strategy calls it from its ``optimizer_step``, for every layout and runner). It makes this rank's
gradients what one process would hold, in the order of Megatron-Core's ``finalize_model_grads``:

1. **reduce over data parallel.** Owners that reduce during backward did so: DDP's reducer, FSDP2 (in backward, or
   in the pipeline schedule's last backward of the step), ZeRO-1/2's overlapped buckets, a deferring ZeRO-0 owner's
   buckets launched per stage. What cannot be reduced yet waits for step 3;
2. **sum the copies of a weight held by several pipeline ranks** (a tied embedding and head), over the pipeline;
3. **finish the reduction** (:meth:`~lightning_par.parallel.gradient_sync.NoSync.finish_grad_sync`): ZeRO-1/2's last
   buckets -- all of them under a pipeline, since a bucket mixes the tied copy with other gradients and each
   pipeline rank's buckets are cut differently: they are reduce-scattered only once the copies are summed, on full
   gradients; a deferring ZeRO-0 owner's tied copies and shared parameters; then every bucket is waited for;
   Expert weights under expert parallel are averaged over the ranks holding the same experts: by the ZeRO 1-3
   owners, which shard them there too, or else right after
   (:class:`~lightning_par.parallel.expert_parallel.ExpertGradients`);
4. **scale**: nothing is left to scale. Each micro-batch's loss carries ``1 / (micro-batches x accumulation)`` and
   every reduction averages; a per-token scale (Megatron's ``num_tokens``) would be applied here.

The sum over the pipeline and the average over data parallel commute, so owners that reduced in step 1 (FSDP2 shards
of both copies are cut alike) and those that reduce in step 3 give the same gradients.

:func:`no_sync` is the other half: Lightning's non-final batches of gradient accumulation, where neither the owner
nor a runner that defers the reduction may reduce anything.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

from lightning_par.parallel.gradient_sync import NoSync
from lightning_par.parallel.runners import Runner


def finalize(owner: NoSync, runner: Runner) -> None:
    """Make this step's gradients final (see the module docstring); a no-op while gradients accumulate."""
    if not owner.enabled:  # a non-final batch of accumulate_grad_batches: the step's last batch reduces all
        return
    runner.sum_tied_gradients()  # (one process holds one copy: nothing to sum)
    owner.finish_grad_sync()
    if owner.experts is not None and not owner.shards_experts:
        owner.experts.finish()


@contextmanager
def no_sync(owner: NoSync, runner: Runner) -> Generator[None, None, None]:
    """No data-parallel reduction inside: the owner holds its own, and a runner that defers it holds back what its
    schedule would start (FSDP2's reduce-scatter after the last micro-batch, a stage's buckets)."""
    owner.set_enabled(False)
    runner.require_sync = False
    try:
        yield None
    finally:
        owner.set_enabled(True)
        runner.require_sync = True
