"""ZeRO-3 inside a pipeline: FSDP2 on each stage module, as torchtitan runs FSDP with pipeline parallelism.

:func:`fully_shard_stages` applies ``fully_shard`` to each repeated block of a stage, then to the stage module
itself (its root group: whatever the stage holds outside its blocks -- embedding, final norm, head). Each stage
module is then its own FSDP2 root; two stages on one rank (interleaved, V schedules) share no FSDP state.

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
from torch.distributed.device_mesh import DeviceMesh

from lightning_par.parallel.host_memory import fsdp_offload_policy
from lightning_par.topology import LayoutError


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:  # a unit of another stage: removed from this one
        return None


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def stage_blocks(stage_module: nn.Module, blocks: Sequence[str]) -> list[nn.Module]:
    """The blocks among ``blocks`` (names relative to the model root, e.g. ``layers.3`` or ``model.layers.3``)
    that ``stage_module`` holds, in the given order."""
    found = (_submodule(stage_module, name) for name in blocks)
    return [block for block in found if block is not None and _has_params(block)]


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


def fully_shard_stages(stage_modules: Sequence[nn.Module], dp_mesh: DeviceMesh, blocks: Sequence[str], *,
                       reshard_after_forward: bool = False, offload: bool = False,
                       mp_policy: object | None = None) -> list[nn.Module]:
    """ZeRO-3 over ``dp_mesh`` for this rank's pipeline stages: ``fully_shard`` each block a stage holds, then the
    stage module (see the module docstring for what this costs per step). Use it in
    :class:`~lightning_par.parallel.pipeline.runtime.PipelineRuntime`'s ``prepare`` and return its result.

    Args:
        stage_modules: this rank's stage modules (``prepare``'s second argument), transformed in place.
        dp_mesh: the 1-D data-parallel mesh (a tensor-parallel DTensor parameter gets a 2-D sharding).
        blocks: the model's repeated blocks by name relative to the model root (``find_blocks(...).blocks``; those
            a stage does not hold are skipped).
        reshard_after_forward: ``False`` (default) gathers each group once per step; ``True`` frees it after each
            micro-batch's forward (less memory, up to ``2 m`` gathers per block per step).
        offload: keep the parameter shards (and the optimizer step) in host memory (FSDP2 ``CPUOffloadPolicy``).
        mp_policy: an FSDP2 ``MixedPrecisionPolicy``, or None.

    Returns the stage modules, now ``FSDPModule`` roots.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    check_disjoint(stage_modules)
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                  offload_policy=fsdp_offload_policy(offload, dp_mesh.device_type),
                  mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy())
    for module in stage_modules:
        for block in stage_blocks(module, blocks):
            fully_shard(block, **kwargs)
        fully_shard(module, **kwargs)
    return list(stage_modules)


def fsdp_group_count(stage_modules: Sequence[nn.Module], blocks: Sequence[str]) -> int:
    """``G``: the FSDP2 groups :func:`fully_shard_stages` makes on this rank -- one per block, plus one per stage
    holding parameters outside its blocks -- so the reduce-scatters (and, with ``reshard_after_forward=False``, the
    all-gathers) per optimizer step. Counted from the module tree, before or after sharding."""
    total = 0
    for module in stage_modules:
        inner = stage_blocks(module, blocks)
        in_blocks = {id(p) for block in inner for p in block.parameters()}
        total += len(inner) + any(id(p) not in in_blocks for p in module.parameters())
    return total
