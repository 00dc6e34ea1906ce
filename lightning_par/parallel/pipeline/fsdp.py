"""ZeRO-3 inside a pipeline: FSDP2 on each stage module, as torchtitan runs FSDP with pipeline parallelism.

:func:`~lightning_par.parallel.zero.fully_shard_parts` applies ``fully_shard`` to each repeated block of a stage,
then to the stage module itself (its root group: whatever the stage holds outside its blocks -- embedding, final
norm, head). Each stage module is then its own FSDP2 root; two stages on one rank (interleaved, V schedules) share
no FSDP state.

How torch's schedules drive FSDP2 stage modules (``torch.distributed.pipelining``, torch 2.13): before every
micro-batch's backward the stage sets ``requires_gradient_sync=False`` and ``reshard_after_backward=False``, so the
micro-batches' gradients accumulate unreduced in the gathered parameters; after the stage's last backward of the
step (``perform_reduce_grad``, the ``REDUCE_GRAD`` action) it runs every group's post-backward with sync on: **one
reduce-scatter per FSDP group per step**, whatever the number of micro-batches. The multi-stage schedules also
``UNSHARD`` (all-gather) each stage ahead of its first action and ``RESHARD`` it after its last, keeping at most
three stages of a rank gathered at once.

``reshard_after_forward=False`` (the default here, and torchtitan's choice with pipelines): a group gathered for a
micro-batch's forward stays gathered through every later forward and backward of the step, so it is **gathered once
per step**. Parameters are then held gathered for the whole step on this rank's stages -- the memory of unsharded
parameters for those stages, not 1 / dp of it -- while gradients and optimizer states stay sharded between steps
(and the parameters too, between steps). With ``True`` a block is freed after each micro-batch's forward and
gathered again for its backward (measured, 1F1B, 4 micro-batches, a stage of 2 blocks + root: 15 all-gathers per
step against 3). The schedules that split backward into input and weight gradients (zero_bubble, zbv, dualpipev)
need ``False``: the weight-gradient half finds the weights through the stage module's parameters, which FSDP2
registers gathered only while they are gathered (freed after the forward, the weight gradients were silently lost:
measured, zbv, loss off by 1.5e-2 after 4 steps), so the runtime sets it for those schedules.

Collectives per optimizer step on one rank (FSDP's own; counted by :class:`lightning_par.measure.CommCounter`):

* ``reduce_scatter = G`` and ``all_gather = G``, with ``G = sum over this rank's stages of (blocks in the stage
  + 1 if the stage holds parameters outside its blocks)`` -- :func:`fsdp_group_count`; for at most 3 stages per
  rank (the schedules here hold 1 or 2) and ``reshard_after_forward=False``;
* evaluation (:meth:`~lightning_par.parallel.pipeline.runtime.PipelineRuntime.forward_only`): ``G`` all-gathers
  per call, none reduce-scattered; the runtime reshards the stages at the end of the call.

Plus, outside FSDP: one all-reduce per parameter tied across pipeline ranks (its gradient summed, shard by
shard), and the loss broadcast from the last stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_par.parallel.pipeline.split import held_blocks
from lightning_par.topology import LayoutError


def check_disjoint(stage_modules: Sequence[nn.Module]) -> None:
    """Refuse a parameter held by two stage modules of one rank (a tied embedding and head on the rank holding
    both ends of a V schedule, or a parameter outside every unit with two stages per rank): each stage module is its
    own FSDP2 root and one parameter cannot be sharded by two."""
    owner: dict[int, tuple[int, str]] = {}
    for index, module in enumerate(stage_modules):
        for name, param in module.named_parameters(remove_duplicate=True):
            first = owner.setdefault(id(param), (index, name))
            if first[0] != index:
                raise LayoutError(
                    f"ZeRO-3 with pipeline parallel: one parameter is held by two stages of this pipeline rank (as "
                    f"{first[1]!r} and {name!r}), and each stage is sharded on its own. This happens with tied "
                    "embeddings on the rank that holds both the first and the last stage (zbv / dualpipev). Untie "
                    "the embeddings, use a looped schedule (1f1b, interleaved_1f1b), or use zero_stage 0-2."
                )


def fsdp_group_count(stage_modules: Sequence[nn.Module], blocks: Sequence[str]) -> int:
    """``G``: the FSDP2 groups :func:`~lightning_par.parallel.zero.fully_shard_parts` makes on this rank -- one per
    block, plus one per stage holding parameters outside its blocks -- so the reduce-scatters (and, with
    ``reshard_after_forward=False``, the all-gathers) per optimizer step. Counted from the module tree, before or
    after sharding."""
    total = 0
    for module in stage_modules:
        inner = [module.get_submodule(name) for name in held_blocks(module, blocks)]
        in_blocks = {id(p) for block in inner for p in block.parameters()}
        total += len(inner) + any(id(p) not in in_blocks for p in module.parameters())
    return total
