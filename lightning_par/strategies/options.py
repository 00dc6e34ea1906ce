"""The engine's options, described once.

:class:`~lightning_par.strategies.engine.LayoutStrategy` takes them; each preset takes a subset by name
(:func:`~lightning_par.strategies.presets.engine_options`). These descriptions are the engine's docstring
(:func:`described`), from which ``help()`` and jsonargparse -- the CLI's ``--trainer.strategy.help NAME`` and its
per-option help, for the engine and every preset -- read them.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

#: the ``Args:`` section of the engine's docstring, in Google style (what jsonargparse's docstring parser reads)
OPTIONS = """
    Args:
        dp: data-parallel size, or ``"auto"`` for world size / (tp * pp * cp).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        cp: context-parallel size: each sequence is split over ``cp`` ranks (causal load balancing: rank i keeps
            chunks i and 2cp-1-i of 2cp), attention runs over the whole sequence (keys and values all-gathered),
            the model gets global ``position_ids``, the loss is the token mean of the whole batch and gradients are
            averaged over dp x cp. The sequence length must divide by 2 * cp (see docs/context-parallel.md).
        ep: expert-parallel size: each mixture-of-experts layer's experts are split over ``ep`` of the dp x cp
            ranks (``ep`` divides dp x cp and the experts), tokens are sent to the rank holding their expert and
            back with all-to-all (dropless: routing as one process), and expert gradients are averaged over the
            ranks holding the same experts (``lightning_par.parallel.expert_parallel``). Composes with ZeRO 0-3 (at
            stages 1-3 the experts' share sharded over their own replicas), offload, cp, tp, sequence parallel,
            every pipeline schedule and sharded checkpoints. Presets: ``ExpertParallelStrategy`` (names ``ep2``,
            ``ep4``, ``ep8``, ``expert_parallel``) and ``zero{0-3}_ep{2,4}``; ``lightning-par plan`` searches ep too.
        zero_stage: ZeRO stage across data parallel: 0 replicas, gradients all-reduced (DDP); 1 optimizer states
            sharded; 2 + gradients sharded; 3 + parameters sharded (FSDP2).
        offload_optimizer: stages 1-3: keep the sharded optimizer state in host memory and run the step there.
        offload_parameters: stage 3: keep the resting parameter shards in host memory too.
        schedule: pp > 1: the pipeline schedule (see ``lightning_par.parallel.stage_plan.SCHEDULES``).
        n_microbatches: pp > 1: micro-batches per batch; default 2 * pp.
        virtual_stages: pp > 1: stages per pipeline rank; default 1, or 2 for the interleaved and V schedules.
        stage_costs: pp > 1: relative cost per pipeline unit (a list, or a dict by unit name) to balance the stages;
            default: balance by unit count.
        sequence_parallel: tp > 1: also split the sequence over the tensor-parallel ranks where activations would
            be replicated (norms, residual stream); each block's all-reduce becomes an all-gather + reduce-scatter.
        recompute: activation recompute per block: ``"none"``, ``"selective"`` (the attention core, Megatron's
            selective recompute) or ``"full"`` (each block keeps only its input and runs forward again in backward).
        compile: ``torch.compile`` each repeated block in place, after tensor parallel and recompute and before
            data-parallel sharding (:mod:`lightning_par.parallel.compile`): ``True``, or a dict of options
            (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``), or a
            :class:`~lightning_par.parallel.compile.CompileOptions` (not in the type hint, so that the command line
            takes true/false or a dict and lists no sub-options). Graphs and recompiles are counted; the fit
            ends with their summary and ``compile/*`` scalars in the logger.
        block_types: the classes (or class names) of the model's repeated blocks, for a model whose blocks cannot
            be found otherwise (see :func:`lightning_par.parallel.blocks.find_blocks`); used by ZeRO-3 and
            data-parallel grouping and by the pipeline split.
        aux_loss_scope: the tokens a mixture-of-experts model's load-balancing loss is computed over:
            ``"micro_batch"`` (each rank's tokens of each forward: transformers' and the anchors' default) or
            ``"global"`` (the routers' statistics summed over the dp x cp ranks of each forward before the loss is
            formed: one process's loss of the whole batch, as Megatron-Core's global auxiliary loss; one small
            all-reduce per forward). For the example MoE's layers and Hugging Face MoE models
            (:mod:`lightning_par.parallel.router`); default: each model's own (the example's ``aux_loss_scope``,
            a Hugging Face model's ``"micro_batch"``).
        bucket_cap_mb: gradient bucket size for the data-parallel all-reduce, in MiB (as in DDP).
        process_group_backend: ``"gloo"``, ``"nccl"`` or a per-device string such as ``"cpu:gloo,cuda:nccl"``;
            by default ``"cpu:gloo,cuda:nccl"`` on CUDA (CPU tensors, e.g. offloaded gradients' norms, can still
            take part in a collective), gloo on CPU.
        timeout: how long a collective may wait before the process group gives up (a last resort: a long one
            also cuts legitimately slow collectives).
        heartbeat_timeout: seconds after which a rank that died or froze is named and every other rank stops
            (exit code 75) instead of waiting in a collective (:mod:`lightning_par.run.heartbeat`); at least
            1.5 (three beats); ``None`` or 0 turns the check off.
        async_save: sharded layouts: write checkpoints in the background with DCP's ``async_save`` (training stalls
            only for the copy to host memory); committed atomically when complete, at most one in flight, an error
            raised at the next save or at teardown (:mod:`lightning_par.plugins.async_checkpoint`).
        nonfinite: what a step whose loss or gradient norm is not finite does, agreed on every rank in the per-step
            flag (:mod:`lightning_par.run.bad_steps`): ``"stop"`` ends the run naming the step (no host sync;
            on a GPU one step late); ``"skip"`` discards the step's gradients (a host sync per step on a GPU).
            Either way a checkpoint with non-finite weights is refused and never replaces the last finite one.
        nonfinite_patience: consecutive non-finite steps before the run stops: default 1 under ``"stop"``, 10 under
            ``"skip"``.
        accelerator: set by the Trainer from ``Trainer(accelerator=...)``; leave unset.
        parallel_devices: set by the Trainer from ``Trainer(devices=...)``; leave unset.
        cluster_environment: set by the Trainer (Lightning, torchrun, SLURM, ...); leave unset.
        checkpoint_io: a CheckpointIO plugin for one-file checkpoints (stage 0); default
            :class:`~lightning_par.plugins.checkpoint_io.AtomicCheckpointIO`.
        precision_plugin: set by the Trainer from ``Trainer(precision=...)`` (made a
            :class:`~lightning_par.plugins.precision.LayoutPrecision`); leave unset.
"""


def described(cls: type[T]) -> type[T]:
    """Append the options' descriptions to ``cls``'s docstring."""
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + OPTIONS
    return cls
