"""What the run does, as the planner models it -- without torch, so that ``lightning-par plan --help`` needs none:
how the training runtime overlaps communication with compute (:class:`Runtime` and its presets) and the precisions
whose bytes the planner counts."""

from __future__ import annotations

from dataclasses import dataclass

#: the precisions the planner counts bytes and time for (:mod:`lightning_par.planner.trace`). ``bf16-mixed``:
#: autocast over fp32 parameters; ``bf16-true``: everything bf16; ``bf16-mixed-master``: bf16 parameters and
#: activations as in ``bf16-true`` (the same trace), fp32 master weights, gradients and optimizer states beside them
#: (Megatron-LM's mixed precision; the bytes are the planner's, see :mod:`.plan`)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "bf16-true", "bf16-mixed-master")
#: precisions that keep no fp32 copy of the weights: each update is rounded to bf16 (plan marks them)
NO_FP32_MASTERS: tuple[str, ...] = ("bf16-true",)


@dataclass(frozen=True)
class Runtime:
    """How the training runtime overlaps communication with compute; the defaults describe lightning-par.

    Attributes:
        dp_overlap: with pp = 1, gradients are reduced in buckets as the last micro-batch's backward produces them
            (DDP, the ZeRO-1/2 partitioner, FSDP2; gradient accumulation holds the reduction back on the other
            micro-batches); False: all of it after the backward.
        pp_dp_overlap: under a pipeline, each rank reduces its gradients in buckets from the start of its last
            gradient-producing backward, under the schedule's cooldown (Megatron's ``--overlap-grad-reduce`` with
            pipelines); False: after the rank's schedule ends. lightning-par's ZeRO-0 owner launches a stage's
            buckets when that stage's last backward *ends* (overlapping only the rank's later actions; ZeRO-1/2
            and ZeRO-3 under pp reduce after the schedule), closer to False, which stays the default.
        param_gather_overlap: ZeRO-1/2's parameter all-gather after the step is hidden behind the next step's first
            forward, bucket by bucket (Megatron's ``--overlap-param-gather``; lightning-par's partitioner now does
            this too, waiting for each bucket in a forward pre-hook); False: the step waits for it. The default stays
            False (conservative) until the hidden share is measured on a GPU.
        tp_comm_overlap: tensor-parallel collectives are split into tp chunks and pipelined with the matrix
            products beside them (Megatron's ``--tp-comm-overlap``, torch's async TP): only what the products
            cannot cover, and the first chunk, is exposed; False: each collective waits, as DTensor TP does.
        p2p_split_over_tp: a stage sends 1/tp of its activation to the next stage and the tp ranks there gather it
            (Megatron's scatter/gather); lightning-par sends the whole activation from every tp rank.
        bucket_mb: data-parallel bucket size (lightning-par's ``Layout.bucket_cap_mb``, 25 MiB).
        compiled: the model runs under ``torch.compile``: the ops between two matrix products are one fused kernel
            (:meth:`~lightning_par.planner.trace.Ops.times`).
    """

    dp_overlap: bool = True
    pp_dp_overlap: bool = False
    param_gather_overlap: bool = False
    tp_comm_overlap: bool = False
    p2p_split_over_tp: bool = False
    bucket_mb: float = 25.0
    compiled: bool = False


#: Megatron-LM as measured in Narayanan et al. 2021 (seed 004, Table 1): gradients all-reduced after the backward
#: pass, activations between stages split over the tp ranks.
MEGATRON_2021 = Runtime(dp_overlap=False, p2p_split_over_tp=True)

#: Megatron-LM (core) as large runs use it today: ``--overlap-grad-reduce --overlap-param-gather
#: --tp-comm-overlap`` with the distributed optimizer, scatter/gather between stages, fused kernels; buckets of
#: 40M parameters in fp32 (its default ``bucket_size``).
MEGATRON_OVERLAP = Runtime(dp_overlap=True, pp_dp_overlap=True, param_gather_overlap=True, tp_comm_overlap=True,
                           p2p_split_over_tp=True, bucket_mb=40e6 * 4 / 2**20, compiled=True)

RUNTIMES: dict[str, Runtime] = {"lightning-par": Runtime(), "megatron-2021": MEGATRON_2021,
                                "megatron-overlap": MEGATRON_OVERLAP}
