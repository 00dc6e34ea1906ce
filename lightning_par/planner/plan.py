"""Every layout of a model on N ranks, and for each: bytes per rank, traffic per group, bubble, step time.

A layout here is what :class:`lightning_par.parallel.layout.Layout` describes, plus the precision: data, tensor and
pipeline sizes, ZeRO stage, pipeline schedule and virtual stages, sequence parallel, recompute. For each one
:func:`estimate` predicts, per rank:

- **model state**: parameters, gradients and optimizer states, counted per tensor as the engine holds them: the
  tensor-parallel shard of each parameter (:meth:`ModelInfo.tp_split`), only the units of the rank's pipeline stages
  (a tied embedding/head once per rank holding it), then the ZeRO stage across data parallel (1: optimizer states
  ``/dp``; 2: + gradients; 3: + parameters, each tensor split on dim 0 with padding as FSDP2 does). Bytes per
  element by precision and ZeRO stage: :func:`element_bytes` (a separate fp32 master copy is counted with the
  optimizer states); Adam keeps 2 states, SGD none;
- **activations**: the bytes each unit saves for one micro-batch (:mod:`lightning_par.planner.trace`) times the
  micro-batches the schedule holds at once, from the schedule's own action order
  (:mod:`lightning_par.planner.schedule`): GPipe all ``m``, 1F1B ``p - rank`` on rank ``rank``, the others as torch
  orders them; plus what lives only for part of the step (ZeRO-3's gathered blocks -- under a pipeline the
  whole stage and its unsharded gradients --, ZeRO-2's full gradients under a pipeline, the flat gradient buffer
  of the pipeline's data-parallel all-reduce);
- **experts** (a mixture-of-experts model, :class:`~lightning_par.planner.model.Experts`): under expert parallel
  ``ep`` each rank holds 1/ep of every expert weight (dimension 0), and the ZeRO stage shards that slice again over
  the ``expert_dp = dp x cp / ep`` ranks holding the same experts, as the engine does (a second ZeRO partitioner
  on ``expert_dp`` at ZeRO-1/2, FSDP2 groups on it at ZeRO-3): the same formulas and bytes per element as the other
  weights, with ``expert_dp`` in place of ``dp x cp``; the other weights as without experts;
- **traffic per step**, bytes each rank sends with ring algorithms, by group: ``dp`` (the ZeRO formulas on the
  rank's own parameters; the experts' over ``expert_dp``: all-reduced at ZeRO-0, reduce-scattered and all-gathered
  at ZeRO 1-3), ``ep`` (the token exchange: see :meth:`Planner.all_to_all_bytes`), ``tp`` (an
  all-reduce -- or with sequence parallelism a reduce-scatter plus an all-gather -- per row-parallel output in
  forward and per column-parallel input in backward, again in the recomputed forward), ``pp`` (each micro-batch's
  activation to the next stage and its gradient back);
- **time**: each stage's forward and backward per micro-batch from the traced ops on the hardware model
  (:mod:`lightning_par.planner.hardware`: GEMMs at an efficiency by their shape, the other ops bound by memory,
  fused under ``compiled``), tensor-parallel collectives inside them (exposed, or pipelined with the GEMMs), the
  schedule run with those costs and the transfer time between stages (makespan and bubble), then the
  data-parallel communication the compute does not hide -- per :class:`Runtime`: gradients reduced in buckets
  under the last backward or after each rank's schedule (ranks that finish early hide theirs under the others'
  cooldown), ZeRO-1/2's parameter all-gather waited for or hidden under the next forward, ZeRO-3's gathers
  prefetched block by block -- and the optimizer step (memory bound). ``Estimate.exposed`` gives the exposed
  seconds per group. Bytes per element of each part of the state and of the traffic follow the precision
  (:func:`element_bytes`: ``bf16-mixed-master`` moves 6 bytes per parameter over dp).

Whether the engine runs a layout is asked of the engine itself: :class:`Layout` is constructed and its
:class:`LayoutError` kept as the note. Nothing here lists the engine's refusals, so the planner follows the engine as
it grows; a layout it refuses is planned and marked, not dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_par.parallel.layout import Layout
from lightning_par.parallel.pipeline.split import plan_stages
from lightning_par.parallel.recompute import RECOMPUTE_KINDS
from lightning_par.parallel.stage_plan import SCHEDULES, StagePlan
from lightning_par.parallel.tensor_parallel import takes_block_input
from lightning_par.planner.hardware import GiB, Hardware
from lightning_par.planner.model import ModelInfo, ParamInfo, TPSplit
from lightning_par.planner.runtime import MEGATRON_2021, MEGATRON_OVERLAP, RUNTIMES, Runtime  # noqa: F401
from lightning_par.planner.schedule import (
    Simulation,
    action_order,
    extrapolate,
    rank_of_stage,
    simulate,
    steady_microbatches,
)
from lightning_par.planner.trace import PRECISIONS, ModelTrace, UnitTrace, saved_bytes, trace_model
from lightning_par.topology import LayoutError, ParallelDims

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
#: ops per parameter tensor in one optimizer step off the GPU (torch's single-tensor path, its default on CPU):
#: AdamW's step count, decay, two moment updates, square root, bias correction, epsilon and update; SGD's one
OPTIMIZER_OPS = {"adamw": 10, "adam": 10, "sgd": 1, "sgd_momentum": 3}
#: DTensor ops per tensor-parallel module (one entry of the resolved plan) per micro-batch, forward and backward
#: together: its input redistributed or wrapped, the op on the sharded weight, its output unwrapped, each again in
#: the backward
TP_MODULE_DTENSOR_OPS = 6


@dataclass(frozen=True)
class Candidate:
    """One layout and precision to estimate."""

    dp: int
    tp: int
    pp: int
    zero_stage: int = 0
    schedule: str | None = None  # pp > 1
    virtual_stages: int = 1
    n_microbatches: int = 1  # per optimizer step: pipeline micro-batches (pp > 1) or accumulation steps (pp = 1)
    sequence_parallel: bool = False
    recompute: str = "none"
    precision: str = "bf16-mixed"
    cp: int = 1  # context parallel: each sequence split over cp ranks
    ep: int = 1  # expert parallel: each expert layer's experts split over ep of the dp x cp ranks

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def label(self) -> str:
        sched = "-" if self.pp == 1 else self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1
                                                         and self.schedule not in ("zbv", "dualpipev") else "")
        return (f"dp{self.dp}{f' cp{self.cp}' if self.cp > 1 else ''}{f' ep{self.ep}' if self.ep > 1 else ''} "
                f"tp{self.tp}"
                f"{'+sp' if self.sequence_parallel else ''} pp{self.pp} z{self.zero_stage} "
                f"{sched} rc={self.recompute} {self.precision}")

    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, zero_stage=self.zero_stage,
                      schedule=self.schedule or "1f1b", n_microbatches=self.n_microbatches if self.pp > 1 else None,
                      virtual_stages=self.virtual_stages if self.pp > 1 else None,
                      sequence_parallel=self.sequence_parallel, recompute=self.recompute)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes: ``global_batch`` sequences of ``seq_len`` tokens in micro-batches of
    ``micro_batch`` sequences per data-parallel replica."""

    micro_batch: int = 1
    seq_len: int = 2048
    global_batch: int = 8


@dataclass
class RankMemory:
    """Bytes one rank holds (the pipeline rank ``pp_rank``; all its tp and dp peers hold the same)."""

    pp_rank: int
    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    transient: float
    numel: int  # parameters of this rank (its tp shard of its stages), before ZeRO

    @property
    def state(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> float:
        return self.state + self.activations + self.transient


@dataclass
class Estimate:
    """What a layout costs; see the module docstring."""

    candidate: Candidate
    ranks: list[RankMemory]
    comm_bytes: dict[str, float]  # group -> bytes each rank sends per step (the busiest rank)
    bubble: float
    step_time: float
    tokens_per_s: float
    model_tflops_per_device: float
    mfu: float
    fits: bool
    runs_today: bool
    engine_note: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds: pipeline, dp exposed, optimizer
    stage_costs: list[tuple[float, float, float]] = field(default_factory=list)  # per stage: F, B, W seconds
    units_by_stage: list[list[str]] = field(default_factory=list)
    # seconds of communication on the busiest rank's critical path, per group: dp (after the schedule; the rest
    # of dp traffic hides under compute), tp (inside each stage's forward and backward), pp (the fill and drain
    # hops between stages); tp and pp are part of "pipeline"
    exposed: dict[str, float] = field(default_factory=dict)
    # seconds per step a rank keeps its core busy, mean over the pipeline ranks: the step less its idle share of
    # the schedule, plus the pipeline receives it waits in (gloo's receive runs on the rank's core). Where ranks
    # share cores (the ``cpu`` preset's 4 ranks on 2 cores) the work of a layout is this times its ranks
    busy: float = 0.0

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "layout": asdict(self.candidate), "label": self.candidate.label(),
            "bytes_per_rank": {"parameters": worst.parameters, "gradients": worst.gradients,
                               "optimizer_states": worst.optimizer_states, "activations": worst.activations,
                               "transient": worst.transient, "total": worst.total, "pp_rank": worst.pp_rank},
            "by_pp_rank": [asdict(r) for r in self.ranks],
            "comm_bytes_per_step": self.comm_bytes, "bubble": self.bubble, "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s, "model_tflops_per_device": self.model_tflops_per_device,
            "mfu": self.mfu, "fits": self.fits, "runs_today": self.runs_today, "engine_note": self.engine_note,
            "time_breakdown_s": self.breakdown, "exposed_s": self.exposed, "busy_s": self.busy,
        }


def hidden(comm: float, window: float, chunks: int) -> float:
    """The exposed part of ``comm`` seconds of communication sent in ``chunks`` equal pieces, each launched as
    compute spread evenly over ``window`` seconds makes it ready (a bucket of gradients, a chunk of a GEMM): the
    last chunk always waits, and where communication outruns compute the rest of it does too."""
    if comm <= 0:
        return 0.0
    chunks = max(1, chunks)
    return max(comm / chunks, comm - window * (chunks - 1) / chunks)


def not_hidden(comm: float, window: float, chunks: int) -> float:
    """:func:`hidden` on hardware that cannot overlap (``Hardware.overlap`` False): all of ``comm`` is exposed."""
    return max(0.0, comm)


# ----------------------------------------------------------------------------------------------------------------------
# The planner
# ----------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ElementBytes:
    """Bytes per parameter element, by what holds it, for one precision under one ZeRO stage.

    Attributes:
        param: the parameters as stored between steps (ZeRO-3: the shard).
        grad: the gradient storage.
        master: a separate fp32 master copy, counted with the optimizer states (0: the parameters are the master).
        state: one optimizer state.
        reduce: what gradients are summed in over data parallel (the reduce-scatter or all-reduce).
        gather: what parameters are all-gathered in (ZeRO 1-3), and what a gathered ZeRO-3 block holds.
    """

    param: int
    grad: int
    master: int
    state: int
    reduce: int
    gather: int


def element_bytes(precision: str, zero_stage: int) -> ElementBytes:
    """The bytes per element of each part of the model state and of the data-parallel traffic.

    ``fp32`` and ``bf16-true``: one dtype for everything. ``bf16-mixed`` follows lightning-par's policy
    (:mod:`lightning_par.plugins.precision`): autocast over fp32 parameters under ZeRO-0 and ZeRO-3 (FSDP2 gathers
    the fp32 shards as bf16, reduces in fp32); under ZeRO-1/2 bf16 buckets with an fp32 master shard, gradients
    reduced in fp32 and kept in bf16. ``bf16-mixed-master`` is Megatron-LM's mixed precision with its distributed
    optimizer: bf16 parameters, gradients accumulated and reduce-scattered in fp32 (its
    ``accumulate_allreduce_grads_in_fp32``, on for bf16), fp32 master weights and Adam states sharded by ZeRO, the
    parameters all-gathered in bf16 -- 6 bytes of dp traffic per parameter (4 reduced + 2 gathered) and, with Adam,
    the ``6 + 12/d`` bytes per parameter of Megatron's distributed-optimizer table at ZeRO-1. At ZeRO-3 the
    strategies keep FSDP2's fp32 shards as the masters (bf16 gathered, fp32 reduced), as ``bf16-mixed`` does there:
    ``16/d`` bytes per parameter with Adam, measured.
    """
    if precision == "bf16-true":
        return ElementBytes(2, 2, 0, 2, 2, 2)
    if precision in ("bf16-mixed", "bf16-mixed-master") and zero_stage == 3:
        return ElementBytes(4, 4, 0, 4, 4, 2)
    if precision == "bf16-mixed-master":
        return ElementBytes(2, 4, 4, 4, 4, 2)
    if precision == "bf16-mixed" and zero_stage in (1, 2):
        return ElementBytes(2, 2, 4, 4, 4, 2)
    return ElementBytes(4, 4, 0, 4, 4, 4)


def _act_elt(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _ring(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring collective over ``n`` ranks on a buffer of ``nbytes``."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * nbytes * (n - 1) / n


class Planner:
    """Estimates layouts of one model on one hardware; traces are made once per configuration and reused."""

    def __init__(self, info: ModelInfo, hardware: Hardware, workload: Workload, optimizer: str | None = None,
                 max_tp: int | None = None, runtime: Runtime | None = None) -> None:
        self.info, self.hw, self.work = info, hardware, workload
        self.runtime = runtime or Runtime()
        self.optimizer = (optimizer or info.optimizer).lower()
        if self.optimizer not in OPTIMIZER_STATES:
            raise LayoutError(f"optimizer {self.optimizer!r}: use one of {sorted(OPTIMIZER_STATES)}.")
        self.max_tp = max_tp
        self._expert_names = info.experts.params if info.experts is not None else frozenset()
        self._traces: dict[tuple, ModelTrace] = {}
        self._tp_comm: dict[tuple, dict[str, tuple[list[float], list[float]]]] = {}
        self._stages: dict[tuple, list[list[str]]] = {}
        self._simulations: dict[tuple, Simulation] = {}
        self._unit_times: dict[tuple[int, int], tuple[float, float, float, float, float]] = {}
        self._params_of: dict[frozenset[str], list[ParamInfo]] = {}
        self._stage_costs: dict[tuple, tuple[float, ...]] = {}
        self._numels: dict[tuple, tuple[int, int]] = {}
        self._root_numels: dict[tuple, int] = {}  # a rank's parameters outside every block
        self._held: dict[tuple, float] = {}
        self._states: dict[tuple, tuple[float, float, float]] = {}

    # -- pieces that are shared between layouts ------------------------------------------------------------------
    def trace(self, tp: int, recompute: str, precision: str) -> ModelTrace:
        """Unit traces for this tp size; with sequence-parallel attribution where the model allows it."""
        precision = "bf16-true" if precision == "bf16-mixed-master" else precision  # the same model in bf16
        key = (tp, recompute, precision)
        if key not in self._traces:
            sp = False
            if tp > 1:
                try:
                    self.info.tp_split(tp, True)
                    sp = True
                except LayoutError:
                    sp = False
            self._traces[key] = trace_model(self.info, tp, sp, recompute, precision, self.work.micro_batch,
                                            self.work.seq_len)
        return self._traces[key]

    def stages(self, pp: int, v: int, style: str) -> list[list[str]]:
        key = (pp, v, style)
        if key not in self._stages:
            self._stages[key] = plan_stages(list(self.info.units), pp, v, style) if pp > 1 else [list(self.info.units)]
        return self._stages[key]

    def tp_collectives(self, split: TPSplit) -> dict[str, tuple[list[tuple[str, float]], list[tuple[str, float]]]]:
        """Per unit: the activation collectives of one micro-batch as ``(kind, elements of the full buffer)``, in
        forward and in backward. A row-parallel output is all-reduced in forward; the input of a group of
        column-parallel linears (once per ``block_input``) in backward; a column-parallel layer that gathers its
        output (a Hugging Face ``colwise_gather_output`` head) all-gathers it in forward and in backward."""
        key = (split.tp, split.sequence_parallel)
        if key in self._tp_comm:
            return self._tp_comm[key]
        import torch.nn as nn

        root, styles = self.info.root, split.styles
        tokens = self.work.micro_batch * self.work.seq_len
        out: dict[str, tuple[list[tuple[str, float]], list[tuple[str, float]]]] = {}
        for unit in self.info.units:
            fwd: list[tuple[str, float]] = []
            bwd: list[tuple[str, float]] = []
            prefix = unit + "."
            names = [n for n in styles if n == unit or n.startswith(prefix)]
            for name in names:
                style, module = styles[name], root.get_submodule(name)
                if style.startswith("rowwise"):
                    fwd.append(("all_reduce", tokens * module.out_features))
                elif style in ("vocab_parallel", "embedding_rowwise") and isinstance(module, nn.Embedding):
                    fwd.append(("all_reduce", tokens * module.embedding_dim))
                elif style == "embedding_colwise" and isinstance(module, nn.Embedding):
                    fwd.append(("all_gather", tokens * module.embedding_dim))
                elif style.startswith("mla_kv_a_proj:"):  # the shared rope key's gradient, summed over tp
                    bwd.append(("all_reduce", tokens * int(style.partition(":")[2])))
                elif takes_block_input(style):
                    child = next((c for c in names if c.startswith(name + ".")
                                  and styles[c].startswith(("colwise", "packed_colwise"))), None)
                    if child is not None:
                        bwd.append(("all_reduce", tokens * root.get_submodule(child).in_features))
                elif (style.startswith(("colwise", "packed_colwise")) or style == "vocab_parallel") and isinstance(
                        module, nn.Linear):
                    if not takes_block_input(styles.get(name.rpartition(".")[0], "")):
                        bwd.append(("all_reduce", tokens * module.in_features))
                    if style in ("colwise_gather_output", "colwise_rep"):
                        fwd.append(("all_gather", tokens * module.out_features))
                        bwd.append(("all_gather", tokens * module.out_features))
            out[unit] = (fwd, bwd)
        self._tp_comm[key] = out
        return out

    def unit_times(self, unit: UnitTrace, tp_seq: int) -> tuple[float, float, float, float, float]:
        """Seconds of one unit's forward, backward, weight-gradient backward, and the matrix products of its forward
        and backward, on the planner's hardware (cached: a block's trace stands for every block of its kind)."""
        key = (id(unit), tp_seq)
        if key not in self._unit_times:
            compiled = self.runtime.compiled
            f, _, f_mm = unit.forward.times(self.hw, tp_seq, compiled)
            b, w, b_mm = unit.backward.times(self.hw, tp_seq, compiled)
            self._unit_times[key] = (f, b, min(w, b), f_mm, b_mm)
        return self._unit_times[key]

    def all_to_all_bytes(self, c: Candidate, units: Iterable[str], act_elt: int) -> tuple[float, int]:
        """Bytes one rank sends through expert parallel's ``all_to_all`` in one forward of one micro-batch of
        ``units``, and the expert layers among them. Per layer, each of the rank's ``tokens`` (micro_batch x seq_len
        / cp) goes as ``top_k`` copies of its hidden state to the ranks of its experts (dispatch) and comes back
        (combine); with balanced routing a share (ep-1)/ep of the copies leaves the rank:
        ``2 x tokens x top_k x hidden x bytes x (ep-1)/ep``. The backward sends as much again (the gradients of both
        exchanges), a full recompute's forward once more."""
        experts = self.info.experts
        if c.ep == 1 or experts is None:
            return 0.0, 0
        inside = [k for name, (_, k) in experts.layers.items()
                  if any(name == u or name.startswith(u + ".") for u in units)]
        tokens = self.work.micro_batch * self.work.seq_len / c.cp
        return 2 * tokens * sum(inside) * (self.info.hidden_size or 0) * act_elt * (c.ep - 1) / c.ep, len(inside)

    def _local_shape(self, p: ParamInfo, split: TPSplit, ep: int) -> tuple[int, ...]:
        """Shape of ``p`` on one rank before ZeRO: its tensor-parallel shard; an expert weight's 1/ep of dim 0."""
        shape = split.local_shape(p)
        return (shape[0] // ep, *shape[1:]) if ep > 1 and p.name in self._expert_names else shape

    def _local_numel(self, p: ParamInfo, split: TPSplit, ep: int) -> int:
        """Elements of ``p`` on one rank: its tensor-parallel shard; an expert weight's 1/ep."""
        n = split.local_numel(p)
        return n // ep if p.name in self._expert_names else n

    # -- one layout ------------------------------------------------------------------------------------------------
    def estimate(self, c: Candidate) -> Estimate:
        info, hw, work, runtime = self.info, self.hw, self.work, self.runtime
        hide = hidden if hw.overlap else not_hidden
        split = info.tp_split(c.tp, c.sequence_parallel)
        if c.sequence_parallel and work.seq_len % c.tp:
            raise LayoutError(f"sequence_parallel with tp={c.tp} needs a sequence length divisible by {c.tp}, got "
                              f"{work.seq_len}.")
        trace = self.trace(c.tp, c.recompute, c.precision)
        v = c.virtual_stages if c.pp > 1 else 1
        units_by_stage, rank_stages = self.placement(c)
        n_stages = len(units_by_stage)
        m = c.n_microbatches
        tp_seq = c.tp if c.sequence_parallel else 1
        eb, act_elt = element_bytes(c.precision, c.zero_stage), _act_elt(c.precision)
        n_states = OPTIMIZER_STATES[self.optimizer]

        # which node boundaries each group crosses (ranks: tp innermost, then cp, dp, pp outermost)
        per_node = hw.devices_per_node
        tp_span = c.tp > per_node
        cp_span = c.tp * c.cp > per_node
        dp_span = c.tp * c.cp * c.dp > per_node
        pp_span = c.tp * c.cp * c.dp * c.pp > per_node
        ep_span = c.tp * c.ep > per_node  # ep consecutive ranks of dp x cp at one tp coordinate

        def in_node(stride: int, size: int) -> int:
            # ranks of a group (every ``stride``-th rank, ``size`` of them) that share a node: the NICs its rings use
            # there (a collective's; cp's ring of sends and ep's all-to-all go through each rank's own NIC)
            return max(1, min(size, per_node // stride)) if stride < per_node else 1

        if c.cp > 1 and work.seq_len % (2 * c.cp):
            raise LayoutError(f"cp={c.cp} cuts each sequence into {2 * c.cp} chunks: the sequence length "
                              f"{work.seq_len} does not divide by {2 * c.cp}.")

        # -- per stage: units, saved bytes, forward / backward time, tensor-parallel traffic --------------------
        collectives = self.tp_collectives(split) if c.tp > 1 else {}
        tp_bw = hw.bandwidth(tp_span, in_node(1, c.tp))

        def coll_time(ops: Iterable[tuple[str, float]]) -> tuple[float, float]:
            sent, n = 0.0, 0
            for kind, elements in ops:
                # with SP an all-reduce becomes a reduce-scatter plus an all-gather: the same bytes, two calls
                sent += _ring(kind, elements * act_elt, c.tp)
                n += 2 if c.sequence_parallel and kind == "all_reduce" else 1
            return sent, sent / tp_bw + n * hw.latency_s

        def tp_exposed(comm: float, matmuls: float) -> float:
            # overlapped: each collective is cut into tp chunks pipelined with the products beside it
            return hide(comm, matmuls, c.tp) if runtime.tp_comm_overlap else comm

        stage_of_unit = {u: s for s, units in enumerate(units_by_stage) for u in units}
        stage_f, stage_b, stage_w, stage_held, stage_tp_bytes, stage_out = [], [], [], [], [], []
        stage_wgrad: list[float] = []
        stage_released: list[float] = []
        stage_tp_exposed: list[float] = []
        stage_cp_bytes: list[float] = []
        stage_ep_bytes: list[float] = []
        stage_ep_exposed: list[float] = []
        forwards = 2 if c.recompute == "full" else 1
        for s, units in enumerate(units_by_stage):
            # the same stage recurs in many layouts (every ZeRO stage, schedule and dp size): costed once
            key = (id(trace), tp_seq, c.tp, c.sequence_parallel, tp_span, tuple(units), s == n_stages - 1)
            if key not in self._stage_costs:
                traces: list[UnitTrace] = [trace.units[u] for u in units]
                if s == n_stages - 1:
                    traces.append(trace.loss)
                f = b = w = f_mm = b_mm = 0.0
                for t in traces:
                    tf, tb, tw, tfm, tbm = self.unit_times(t, tp_seq)
                    f, b, w, f_mm, b_mm = f + tf, b + tb, w + tw, f_mm + tfm, b_mm + tbm
                fwd_elems = [e for u in units for e in collectives.get(u, ([], []))[0]]
                bwd_elems = [e for u in units for e in collectives.get(u, ([], []))[1]]
                if c.recompute == "full":  # the recomputed forward of the blocks communicates again
                    bwd_elems += [e for u in units if u in info.blocks for e in collectives.get(u, ([], []))[0]]
                fwd_bytes, fwd_comm = coll_time(fwd_elems)
                bwd_bytes, bwd_comm = coll_time(bwd_elems)
                tp_modules = (sum(1 for n in split.styles for u in units if n == u or n.startswith(u + "."))
                              if c.tp > 1 else 0)
                self._stage_costs[key] = (
                    f, b, w, f_mm, b_mm, fwd_bytes + bwd_bytes, fwd_comm, bwd_comm, saved_bytes(traces, tp_seq),
                    # I keeps the output gradients of the ops that read parameters, and the gradient it received
                    sum(t.weight_grad_inputs for t in traces) + traces[-1].output_bytes / tp_seq,
                    sum(t.saved_weight_path for t in traces), trace.units[units[-1]].output_bytes / tp_seq, tp_modules)
            (f, b, w, f_mm, b_mm, tp_bytes, fwd_comm, bwd_comm, held, wgrad, released, out,
             tp_modules) = self._stage_costs[key]
            fwd_t, bwd_t = tp_exposed(fwd_comm, f_mm), tp_exposed(bwd_comm, b_mm)
            # the Python dispatch of the DTensor ops of the tp modules, half in forward and half in backward
            dispatch = TP_MODULE_DTENSOR_OPS / 2 * hw.dtensor_op_overhead_s * tp_modules
            stage_f.append(f + fwd_t + dispatch)
            stage_b.append(b + bwd_t + dispatch)
            stage_w.append(w)
            stage_tp_exposed.append(fwd_t + bwd_t)
            stage_held.append(held)
            stage_wgrad.append(wgrad)
            stage_released.append(released)
            stage_tp_bytes.append(tp_bytes)
            stage_out.append(out)
            if c.cp > 1:
                self._context_parallel(c, units, act_elt, hw.bandwidth(cp_span), hw.latency_s, stage_f, stage_b,
                                       stage_w, stage_held, stage_wgrad, stage_released, stage_tp_bytes, stage_out,
                                       stage_cp_bytes)
                stage_tp_exposed[-1] /= c.cp  # its tp traffic is that of 1/cp of the tokens
            if c.ep > 1:
                # the token exchange waits: the experts need their tokens, the layer its outputs; each forward
                # exchanges the counts, then the tokens, then the outputs, the backward their gradients
                a2a, layers = self.all_to_all_bytes(c, units, act_elt)
                ep_bw = hw.bandwidth(ep_span)  # all-to-all: each rank's own NIC
                f_ep = a2a / ep_bw + 3 * layers * hw.latency_s
                b_ep = (forwards - 1) * f_ep + a2a / ep_bw + 2 * layers * hw.latency_s
                stage_f[-1] += f_ep
                stage_b[-1] += b_ep
                stage_ep_bytes.append((forwards + 1) * a2a)
                stage_ep_exposed.append(f_ep + b_ep)

        # -- the schedule --------------------------------------------------------------------------------------
        pp_bw = hw.bandwidth(pp_span)
        p2p_split = c.tp if runtime.p2p_split_over_tp else 1
        if c.pp > 1:
            rank_of = rank_of_stage(c.schedule, c.pp, v)

            def cost(a) -> float:
                if a.kind == "F":
                    return stage_f[a.stage]
                if a.kind == "B":
                    return stage_b[a.stage]
                if a.kind == "I":
                    return stage_b[a.stage] - stage_w[a.stage]
                return stage_w[a.stage]

            # layouts that differ only in the ZeRO stage run the same schedule with the same costs: simulate it once
            key = (c.schedule, c.pp, m, v, p2p_split, pp_bw, *map(tuple, (stage_f, stage_b, stage_w, stage_out,
                                                                         stage_held, stage_wgrad, stage_released)))
            if key not in self._simulations:
                def run(micro: int) -> Simulation:
                    return simulate(
                        action_order(c.schedule, c.pp, micro, v), n_stages, rank_of, cost,
                        transfer=lambda src, dst: stage_out[min(src, dst)] / p2p_split / pp_bw + hw.latency_s,
                        held=lambda s: stage_held[s], held_for_w=lambda s: stage_wgrad[s],
                        released_by_w=lambda s: stage_released[s])

                short = steady_microbatches(c.schedule, c.pp, m, v)  # thousands of micro-batches: two shorter runs
                self._simulations[key] = run(m) if short is None else extrapolate(run(short), run(2 * short),
                                                                                 short, 2 * short, m)
            sim = self._simulations[key]
            t_pipe, bubble, held_peak = sim.makespan, sim.mean_bubble, sim.peak_held
            grads_peak = [g - h for g, h in zip(sim.peak_with_grads, sim.peak_held, strict=True)]
            rank_end, rank_first, rank_grads = sim.rank_end, sim.rank_first_forward, sim.rank_last_grads
            hop = sum(stage_out[:-1]) / max(1, n_stages - 1) / p2p_split / pp_bw + hw.latency_s

            def receives(r: int) -> float:  # each micro-batch's activation in and its gradient back, per stage
                def t(s: int) -> float:
                    return stage_out[s] / p2p_split / pp_bw + hw.latency_s
                return m * sum((t(s - 1) if s > 0 else 0.0) + (t(s) if s < n_stages - 1 else 0.0)
                               for s in rank_stages[r])
            receive_time = sum(receives(r) for r in range(c.pp)) / c.pp
            pp_exposed = 2 * (c.pp - 1) * hop  # the fill and the drain cross every pipeline hop once
        else:
            t_pipe, bubble, held_peak = m * (stage_f[0] + stage_b[0]), 0.0, [stage_held[0]]
            grads_peak = [0.0]
            rank_end, rank_first, rank_grads = [t_pipe], [0.0], [t_pipe - stage_b[0]]
            pp_exposed = receive_time = 0.0

        # -- memory and traffic per pipeline rank --------------------------------------------------------------
        ranks: list[RankMemory] = []
        dp_bytes_max = tp_bytes_max = pp_bytes_max = ep_bytes_max = ep_exposed_max = opt_numel = 0.0
        n_tensors = 0  # parameter tensors of the fullest rank
        reduce_finish = gather_exposed = tp_exposed_max = 0.0
        bucket = runtime.bucket_mb * 2**20
        dp_bw = hw.bandwidth(dp_span, in_node(c.tp * c.cp, c.dp))
        d = c.dp * c.cp  # gradients are averaged over the dp x cp ranks of a stage
        for r, stage_ids in enumerate(rank_stages):
            rank_units = {u for s in stage_ids for u in units_by_stage[s]}
            params = self._rank_params(rank_units)
            n_tensors = max(n_tensors, len(params))
            numel, tied_numel = self._rank_numel(params, split, c, stage_of_unit)
            expert_numel = sum(self._local_numel(p, split, c.ep) for p in params
                               if p.name in self._expert_names) if c.ep > 1 else 0
            dense_numel = numel - expert_numel
            shards = (d, d // c.ep) if c.zero_stage >= 1 else (1, 1)  # the experts' ZeRO is over expert_dp
            opt_numel = max(opt_numel, dense_numel / shards[0] + expert_numel / shards[1])
            mem = self._state(params, split, c, eb, n_states)
            transient = max(0.0, grads_peak[r])  # a zero-bubble I's output gradients, kept for its W
            blocks = [u for u in rank_units if u in info.blocks]
            root_key = (id(params), split.tp, split.sequence_parallel)
            if root_key not in self._root_numels:
                self._root_numels[root_key] = sum(split.local_numel(p) for p in params
                                                  if not any(u in info.blocks for u in p.units))
            root_numel = self._root_numels[root_key]
            if c.zero_stage == 3 and c.pp == 1:
                # FSDP2 gathers one block at a time (and prefetches the next; a block's experts, its own group on
                # expert_dp, with it); the root group stays gathered
                block_numel = max((sum(self._local_numel(p, split, c.ep) for p in info.unit_params(u))
                                   for u in blocks), default=0)
                transient += (2 * block_numel + root_numel) * eb.gather
            elif c.zero_stage == 3:
                # torch's schedules keep FSDP2 stages gathered through the step and accumulate unsharded gradients,
                # reduce-scattered after the last backward (lightning_par.parallel.pipeline.fsdp)
                transient += numel * (eb.gather + eb.grad) - mem[0] - mem[1]
            elif c.pp > 1 and c.dp * c.cp > 1 and c.zero_stage == 0:
                transient += dense_numel * eb.grad  # the pipeline's flat all-reduce of the gradients (not the experts')
            elif c.pp > 1 and c.zero_stage == 2:
                transient += numel * eb.grad - mem[1]  # full gradients until the one reduce-scatter after the schedule
            ranks.append(RankMemory(r, *mem, held_peak[r], transient, numel))

            # data-parallel traffic of this rank, per step, and how much of it the compute around it hides
            # (the experts' over their expert_dp ranks, by the same stage)
            reduce_kind = "all_reduce" if c.zero_stage == 0 else "reduce_scatter"
            reduce_bytes = _ring(reduce_kind, dense_numel * eb.reduce, d) + _ring(reduce_kind, expert_numel * eb.reduce,
                                                                                  d // c.ep)
            gather_bytes = _ring("all_gather", dense_numel * eb.gather, d) + _ring(
                "all_gather", expert_numel * eb.gather, d // c.ep) if c.zero_stage else 0.0
            n_gathers = (1 if c.pp > 1 else 2 * m) if c.zero_stage == 3 else 1
            dp_bytes = reduce_bytes + n_gathers * gather_bytes
            if c.zero_stage == 3 and c.pp == 1:  # FSDP2 keeps the root group gathered from forward to backward
                dp_bytes -= m * _ring("all_gather", root_numel * eb.gather, d)
            first_f = stage_f[stage_ids[0]]
            if d > 1:
                k = max(1, math.ceil(numel * eb.grad / bucket))  # buckets (ZeRO-3: FSDP2's groups, one per block)
                k3 = len(blocks) + 1
                reduce_t = reduce_bytes / dp_bw + (k3 if c.zero_stage == 3 else k) * hw.latency_s
                gather_t = gather_bytes / dp_bw + (k3 if c.zero_stage == 3 else k) * hw.latency_s if gather_bytes \
                    else 0.0
                if c.zero_stage == 3 and c.pp == 1:
                    # gathered for every micro-batch's forward and again for its backward, each block prefetched
                    # under the one before; the last backward also reduce-scatters each block's gradients
                    fwd = m * hide(gather_t, stage_f[0], k3)
                    bwd = (m - 1) * hide(gather_t, stage_b[0], k3) + hide(gather_t + reduce_t, stage_b[0], k3)
                    reduce_finish = max(reduce_finish, rank_end[r] + fwd + bwd)
                else:
                    overlap = runtime.dp_overlap if c.pp == 1 else runtime.pp_dp_overlap
                    window = rank_end[r] - rank_grads[r]
                    exposed = hide(reduce_t, window, k) if overlap and c.zero_stage != 3 else reduce_t
                    reduce_finish = max(reduce_finish, rank_end[r] + exposed)
                    if c.zero_stage == 3:
                        # each stage gathered at its first forward, block after block; a rank's delay holds up
                        # every stage after it in the fill
                        gather_exposed += hide(gather_t, first_f, k3)
                    elif c.zero_stage and runtime.param_gather_overlap:
                        # launched at the start of the step: the idle start of the rank hides it too
                        gather_exposed = max(gather_exposed, hide(gather_t, first_f, k) - rank_first[r])
                    elif c.zero_stage:
                        gather_exposed = max(gather_exposed, gather_t)  # after the step, waited for
            tp_bytes = m * sum(stage_tp_bytes[s] for s in stage_ids)
            if c.ep > 1:
                ep_bytes_max = max(ep_bytes_max, m * sum(stage_ep_bytes[s] for s in stage_ids))
                ep_exposed_max = max(ep_exposed_max, m * sum(stage_ep_exposed[s] for s in stage_ids))
            tp_exposed_max = max(tp_exposed_max, m * sum(stage_tp_exposed[s] for s in stage_ids))
            pp_bytes = 0.0
            if c.pp > 1:
                for s in stage_ids:
                    if s < n_stages - 1:
                        pp_bytes += m * stage_out[s]
                    if s > 0:
                        pp_bytes += m * stage_out[s - 1]
                pp_bytes += _ring("all_reduce", tied_numel * eb.grad, c.pp)
            dp_bytes_max, tp_bytes_max, pp_bytes_max = (max(dp_bytes_max, dp_bytes), max(tp_bytes_max, tp_bytes),
                                                        max(pp_bytes_max, pp_bytes))

        # -- step time ---------------------------------------------------------------------------------------------
        dp_exposed = max(0.0, reduce_finish - t_pipe) + max(0.0, gather_exposed)
        # read the gradient, read and write the fp32 values and every state, write the parameters where a master
        # is kept apart
        master = eb.master or eb.param
        per_element = eb.grad + 2 * master + 2 * n_states * eb.state + (eb.param if eb.master else 0)
        optimizer_time = opt_numel * per_element / hw.memory_bandwidth
        if c.tp > 1 or c.zero_stage == 3:  # DTensor parameters (TP's, FSDP2's): each op of the step dispatched
            optimizer_time += n_tensors * OPTIMIZER_OPS[self.optimizer] * hw.dtensor_op_overhead_s
        step = t_pipe + dp_exposed + optimizer_time

        tokens = work.global_batch * work.seq_len
        flops_per_mb = 3 * c.tp * (sum(t.forward.total_flops for t in trace.units.values())
                                   + trace.loss.forward.total_flops)
        model_flops = flops_per_mb * work.global_batch / work.micro_batch
        per_device = model_flops / step / c.world
        peak = hw.peak_flops.get("fp32" if c.precision == "fp32" else "bf16", float("nan"))
        worst = max(r.total for r in ranks)
        runs, note = _runs_today(c)
        return Estimate(
            c, ranks, {"dp": dp_bytes_max, "tp": tp_bytes_max, "pp": pp_bytes_max,
                       **({"cp": max(stage_cp_bytes) * m} if c.cp > 1 else {}),
                       **({"ep": ep_bytes_max} if c.ep > 1 else {})}, bubble, step, tokens / step,
            per_device / 1e12, per_device / peak, worst <= hw.usable_bytes, runs, note,
            {"pipeline": t_pipe, "dp_exposed": dp_exposed, "optimizer": optimizer_time},
            list(zip(stage_f, stage_b, stage_w, strict=True)), units_by_stage,
            {"dp": dp_exposed, "tp": tp_exposed_max, "pp": pp_exposed, **({"ep": ep_exposed_max} if c.ep > 1 else {})},
            step - t_pipe * bubble + receive_time,
        )

    def state_bytes(self, c: Candidate) -> list[dict[str, float]]:
        """Parameters, gradients and optimizer states per pipeline rank (no tracing): what
        :func:`lightning_par.measure.state_bytes` measures on each rank."""
        split = self.info.tp_split(c.tp, c.sequence_parallel)
        units_by_stage, rank_stages = self.placement(c)
        out = []
        for stage_ids in rank_stages:
            params = self._rank_params({u for s in stage_ids for u in units_by_stage[s]})
            mem = self._state(params, split, c, element_bytes(c.precision, c.zero_stage),
                              OPTIMIZER_STATES[self.optimizer])
            out.append(dict(zip(("parameters", "gradients", "optimizer_states"), mem, strict=True)))
        return out

    def placement(self, c: Candidate) -> tuple[list[list[str]], list[list[int]]]:
        """The units of each pipeline stage, and the stages of each pipeline rank (with pp = 1: one stage of every
        unit), as :mod:`lightning_par.parallel.pipeline.split` places them."""
        if c.pp == 1:
            return self.stages(1, 1, "loop"), [[0]]
        plan = StagePlan(c.pp, c.virtual_stages, SCHEDULES[c.schedule].style)
        return self.stages(plan.pp, plan.virtual_stages, plan.style), [plan.stages_of(r) for r in range(c.pp)]

    def _rank_numel(self, params: list[ParamInfo], split: TPSplit, c: Candidate,
                    stage_of_unit: dict[str, int]) -> tuple[int, int]:
        """Elements of a rank's parameters (its tp shards), and of those tied across pipeline ranks (summed over
        the pipeline after the schedule)."""
        key = (id(params), split.tp, split.sequence_parallel, c.pp, c.virtual_stages, c.schedule, c.ep)
        if key not in self._numels:
            numel = sum(self._local_numel(p, split, c.ep) for p in params)
            tied = 0
            if c.pp > 1:
                rank_of = rank_of_stage(c.schedule, c.pp, c.virtual_stages)
                tied = sum(split.local_numel(p) for p in params
                           if len({rank_of(stage_of_unit[u]) for u in p.units}) > 1)
            self._numels[key] = (numel, tied)
        return self._numels[key]

    def _context_parallel(self, c: Candidate, units: Sequence[str], act_elt: int, bandwidth: float, latency: float,
                          *per_stage: list[float]) -> None:
        """Make the last stage's figures (appended just now) those of a cp rank: a 1/cp share of the tokens for its
        compute, saved activations, tensor- and pipeline-parallel traffic; plus, per block, the ring attention's
        traffic (:mod:`lightning_par.parallel.context_parallel`): forward passes the rank's keys and values on cp - 1
        times; backward passes them again and their gradients (fp32 or wider) cp times. Nothing more is held: each
        rank keeps only its own keys and values for backward."""
        f, b, w, held, wgrad, released, tp_bytes, out, cp_bytes = per_stage
        for figures in (f, b, w, held, wgrad, released, tp_bytes, out):
            figures[-1] /= c.cp
        blocks = [u for u in units if u in self.info.blocks]
        kv = len(blocks) * self.work.micro_batch * self.work.seq_len * self._kv_per_token() / c.tp * act_elt
        step = kv / c.cp  # every block's message of one ring step
        ring_f = (c.cp - 1) * step
        ring_b = ring_f + c.cp * step * max(4, act_elt) / act_elt
        forwards = 2 if c.recompute == "full" else 1
        f[-1] += ring_f / bandwidth + (c.cp - 1) * len(blocks) * latency
        b[-1] += ((forwards - 1) * (ring_f / bandwidth + (c.cp - 1) * len(blocks) * latency)  # the recompute's ring
                  + ring_b / bandwidth + (2 * c.cp - 1) * len(blocks) * latency)
        cp_bytes.append(forwards * ring_f + ring_b)

    def _kv_per_token(self) -> int:
        """Key and value elements per token of one block (its k_proj and v_proj outputs), else 2 x hidden."""
        first = self.info.blocks[0] if self.info.blocks else None
        found = sum(p.shape[0] for p in self.info.params if first in p.units and p.name.endswith(
            ("k_proj.weight", "v_proj.weight")))
        return found or 2 * (self.info.hidden_size or 0)

    def _rank_params(self, units: set[str]) -> list[ParamInfo]:
        """The parameters a pipeline rank holding ``units`` keeps: theirs, and those outside every unit."""
        key = frozenset(units)
        if key not in self._params_of:
            self._params_of[key] = [p for p in self.info.params if not p.units or any(u in units for u in p.units)]
        return self._params_of[key]

    def _state(self, params: Sequence[ParamInfo], split: TPSplit, c: Candidate, eb: ElementBytes,
               n_states: int) -> tuple[float, float, float]:
        """Parameters, gradients, optimizer states (with a separate master copy) of ``params`` on one rank."""
        key = (id(params), split.tp, split.sequence_parallel, c.dp * c.cp, c.zero_stage, eb, n_states, c.ep)
        if key not in self._states:
            experts = [p for p in params if p.name in self._expert_names] if c.ep > 1 else []
            if experts:  # the others as without experts; the experts' ep slices under ZeRO over expert_dp
                dense = self._state_bytes([p for p in params if p.name not in self._expert_names], split, c, eb,
                                          n_states)
                own = self._state_bytes(experts, split, c, eb, n_states, c.dp * c.cp // c.ep)
                self._states[key] = tuple(a + b for a, b in zip(dense, own, strict=True))
            else:
                self._states[key] = self._state_bytes(params, split, c, eb, n_states)
        return self._states[key]

    def _state_bytes(self, params: Sequence[ParamInfo], split: TPSplit, c: Candidate, eb: ElementBytes,
                     n_states: int, d: int | None = None) -> tuple[float, float, float]:
        """The ZeRO stage's bytes of ``params`` sharded over ``d`` ranks (default dp x cp: the cp ranks of a replica
        shard the states too; the experts: their expert_dp)."""
        d = d or c.dp * c.cp
        full = sum(self._local_numel(p, split, c.ep) for p in params)
        # measured: with replicas (ZeRO-0) the gradient of a vocabulary-parallel embedding is a full-vocabulary
        # tensor on every tp rank (its shard is a view into it); ZeRO-1/2 copy it into their buckets and FSDP2
        # reduce-scatters it into a new shard
        import torch.nn as nn

        embedding_extra = 0
        if c.tp > 1 and c.zero_stage == 0:
            for p in params:
                if split.dims.get(p.name) is not None and isinstance(self.info.root.get_submodule(p.owner),
                                                                     nn.Embedding):
                    embedding_extra += p.numel - split.local_numel(p)
        if c.zero_stage == 3:
            sharded = 0
            for p in params:
                shape = self._local_shape(p, split, c.ep)
                rest = math.prod(shape[1:]) if len(shape) > 1 else 1
                sharded += -(-shape[0] // d) * rest if shape else 1
            return sharded * eb.param, sharded * eb.grad, sharded * (n_states * eb.state + eb.master)
        chunk = -(-full // d)
        grads = chunk if c.zero_stage == 2 else full + embedding_extra
        states = chunk if c.zero_stage >= 1 else full
        return full * eb.param, grads * eb.grad, states * (n_states * eb.state + eb.master)

    # -- all layouts -----------------------------------------------------------------------------------------------
    def candidates(self, world: int, zero_stages: Sequence[int] = (0, 1, 2, 3),
                   schedules: Sequence[str] | None = None, recompute: Sequence[str] = RECOMPUTE_KINDS,
                   precisions: Sequence[str] = PRECISIONS, virtual: Sequence[int] = (2, 4),
                   sequence_parallel: Sequence[bool] = (False, True),
                   sizes: Sequence[tuple[int, int, int]] | None = None,
                   expert_parallel: Sequence[int] | None = None) -> tuple[list[Candidate], dict[str, int]]:
        """Every valid layout for ``world`` ranks (or only the ``(dp, tp, pp)`` in ``sizes``), and why the others
        were left out (reason -> count). A mixture-of-experts model gets each ``ep`` (of ``expert_parallel``, by
        default every size) that divides dp and every layer's experts; a composition the engine refuses with
        experts (:class:`Layout`'s own check, asked here) is left out, not planned."""
        work, info = self.work, self.info
        schedules = list(schedules or SCHEDULES)
        skipped: dict[str, int] = {}

        def skip(reason: str) -> None:
            skipped[reason] = skipped.get(reason, 0) + 1

        out: list[Candidate] = []
        for tp in _divisors(world):
            if sizes is not None and tp not in {t for _, t, _ in sizes}:
                continue
            if self.max_tp is not None and tp > self.max_tp and sizes is None:
                continue
            try:
                info.tp_split(tp)
            except LayoutError as err:
                skip(f"tp={tp}: {str(err).split(':')[0]}")
                continue
            sp_ok = tp > 1 and work.seq_len % tp == 0
            if sp_ok:
                try:
                    info.tp_split(tp, True)
                except LayoutError:
                    sp_ok = False
            for pp in _divisors(world // tp):
                dp = world // (tp * pp)
                if sizes is not None and (dp, tp, pp) not in sizes:
                    continue
                if pp > len(info.units):
                    skip(f"pp={pp}: more stages than the {len(info.units)} pipeline units")
                    continue
                if work.global_batch % (dp * work.micro_batch):
                    skip(f"dp={dp}: the global batch {work.global_batch} does not split into micro-batches of "
                         f"{work.micro_batch} on {dp} replicas")
                    continue
                m = work.global_batch // (dp * work.micro_batch)
                eps: list[int] = []
                for ep in expert_parallel or (_divisors(dp) if info.experts is not None else [1]):
                    if ep > 1 and info.experts is None:
                        skip(f"ep={ep}: the model has no expert layers")
                    elif ep > 1 and (dp % ep or not info.experts.divides(ep)):
                        skip(f"ep={ep}: does not divide dp={dp} and the experts")
                    else:
                        eps.append(ep)
                variants: list[tuple[str | None, int]] = [(None, 1)]
                if pp > 1:
                    variants = []
                    for name in schedules:
                        spec = SCHEDULES[name]
                        vs = [spec.fixed_virtual] if spec.fixed_virtual else [1] if name in ("gpipe", "1f1b") \
                            else list(virtual)
                        for v in vs:
                            if pp * v > len(info.units):
                                skip(f"pp={pp} x v={v}: more stages than units")
                                continue
                            try:
                                StagePlan.for_schedule(name, pp, m, v)
                            except LayoutError:
                                skip(f"{name} with pp={pp}, m={m}, v={v}")
                                continue
                            variants.append((name, v))
                for name, v in variants:
                    for zero in zero_stages:
                        if dp == 1 and zero > 0:
                            continue  # nothing to shard over
                        for sp in sequence_parallel:
                            if sp and not sp_ok:
                                continue
                            for rc in recompute:
                                for prec in precisions:
                                    for ep in eps:
                                        c = Candidate(dp, tp, pp, zero, name, v, m, sp, rc, prec, ep=ep)
                                        refused = _refused_with_experts(c)
                                        if refused:
                                            skip(refused)
                                        else:
                                            out.append(c)
        return out, skipped

    def memory_floor(self, c: Candidate) -> float:
        """A lower bound of the fullest rank's bytes, without running the schedule: its model state (exact) and
        the activations of one micro-batch of its largest stage (every schedule holds at least that at once) --
        of ``m`` micro-batches under GPipe, ``min(m, p - rank)`` under 1F1B (what their orders hold, exactly)."""
        split = self.info.tp_split(c.tp, c.sequence_parallel)
        trace = self.trace(c.tp, c.recompute, c.precision)
        tp_seq = c.tp if c.sequence_parallel else 1
        units_by_stage, rank_stages = self.placement(c)
        eb, n_states = element_bytes(c.precision, c.zero_stage), OPTIMIZER_STATES[self.optimizer]
        last = len(units_by_stage) - 1
        floor = 0.0
        for rank, stage_ids in enumerate(rank_stages):
            params = self._rank_params({u for s in stage_ids for u in units_by_stage[s]})
            held = 0.0
            for s in stage_ids:
                key = (id(trace), tp_seq, tuple(units_by_stage[s]), s == last)
                if key not in self._held:
                    self._held[key] = saved_bytes([trace.units[u] for u in units_by_stage[s]]
                                                  + ([trace.loss] if s == last else []), tp_seq)
                held = max(held, self._held[key])
            in_flight = {"gpipe": c.n_microbatches, "1f1b": min(c.n_microbatches, c.pp - rank)}.get(c.schedule, 1)
            held /= c.cp  # a cp rank holds 1/cp of the tokens' activations (and more: the gathered keys, values)
            floor = max(floor, sum(self._state(params, split, c, eb, n_states)) + in_flight * held)
        return floor

    def plan(self, world: int, prune: bool = True, **kwargs: Any) -> tuple[list[Estimate], dict[str, int]]:
        """Estimate every candidate; fastest first (layouts that fit before those that do not). ``prune``: leave
        out, before simulating their schedules, the layouts whose :meth:`memory_floor` already exceeds the device
        (counted in the returned reasons; the one with the smallest floor is kept, so that something is shown)."""
        candidates, skipped = self.candidates(world, **kwargs)
        if prune and candidates:
            floors = []
            for c in candidates:
                try:
                    floors.append(self.memory_floor(c))
                except LayoutError:
                    floors.append(0.0)  # estimate() says why
            smallest = min(range(len(candidates)), key=floors.__getitem__)
            usable = self.hw.usable_bytes
            reason = (f"cannot fit in {usable / GiB:.3g} GiB: model state and one micro-batch's activations alone "
                      "exceed it")
            kept = [c for i, c in enumerate(candidates) if floors[i] <= usable or i == smallest]
            if len(kept) < len(candidates):
                skipped[reason] = len(candidates) - len(kept)
            candidates = kept
        out = []
        for c in candidates:
            try:
                out.append(self.estimate(c))
            except LayoutError as err:
                key = f"{c.label()}: {err}"
                skipped[key] = skipped.get(key, 0) + 1
        out.sort(key=lambda e: (not e.fits, e.step_time))
        return out, skipped


#: the planner's precision names -> the Trainer's
_TRAINER_PRECISION = {"fp32": "32-true"}


def _runs_today(c: Candidate) -> tuple[bool, str]:
    """Whether the engine runs the layout (its own :class:`Layout` check) in the candidate's precision (the
    precision plugin's list), and why not."""
    from lightning_par.plugins.precision import SUPPORTED, LayoutPrecision  # (Lightning is loaded anyway)

    name = _TRAINER_PRECISION.get(c.precision, c.precision)
    if name not in SUPPORTED:
        return False, f"precision={name!r} is not a precision of this version's strategies ({', '.join(SUPPORTED)})"
    try:
        c.layout()
        LayoutPrecision(name).check_layout(c.zero_stage, c.tp, c.pp)
    except LayoutError as err:
        return False, str(err)
    return True, ""


def _refused_with_experts(c: Candidate) -> str | None:
    """Why the engine refuses ``c`` for its ``ep`` alone (the layout's own check), else None: a layout refused for
    another reason is planned and marked as any other."""
    if c.ep == 1:
        return None
    try:
        c.layout()
        return None
    except LayoutError as err:
        try:
            replace(c, ep=1).layout()
        except LayoutError:
            return None
        return str(err).split(":")[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rank_table(world: int, dp: int | str = "auto", tp: int = 1, pp: int = 1, ep: int = 1) -> str:
    """The start-up rank table of a layout: global rank -> (pp, dp, tp) and the groups."""
    dims = ParallelDims.resolve(world, dp=dp, tp=tp, pp=pp, ep=ep)
    return f"{dims.describe()}\n{dims.rank_table()}"


def bytes_gib(x: float) -> float:
    return x / GiB
