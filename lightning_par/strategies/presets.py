"""The strategies users name: presets of the engine (:class:`~lightning_par.strategies.engine.LayoutStrategy`) that fix
part of its layout and take the rest of its options unchanged.

A preset declares its options by name (:func:`engine_options`); their types, defaults and descriptions are the
engine's, written once there. The CLI's per-class help (``--trainer.strategy.help zero``), ``help()`` and
``inspect.signature`` show them all, and a name a preset does not take is a ``TypeError``, as for any function.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from lightning_par.parallel.layout import SUPPORTED_ZERO_STAGES
from lightning_par.parallel.stage_plan import SCHEDULES
from lightning_par.strategies.engine import LayoutStrategy

#: what each data-parallel preset takes besides its layout, in the order its signature lists them
ZERO_OPTIONS = ("offload_optimizer", "offload_parameters")
PIPELINE_OPTIONS = ("schedule", "n_microbatches", "virtual_stages")
RUN_OPTIONS = ("recompute", "aux_loss_scope", "bucket_cap_mb", "block_types", "process_group_backend", "timeout",
               "heartbeat_timeout", "async_save", "nonfinite", "nonfinite_patience", "compile", "checkpoint_io")


def engine_options(*names: str, **defaults: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a preset's ``__init__(self, [its own parameters], **options)`` its whole signature: its own parameters,
    then the engine's options ``names`` in that order, with the engine's types and defaults (``defaults`` replaces
    one). jsonargparse reads that signature (``__signature__``) for the CLI and the descriptions from the engine's
    docstring, as it does for any subclass; the options reach ``__init__`` in ``options``, every one given."""
    engine = inspect.signature(LayoutStrategy.__init__, eval_str=True).parameters
    unknown = set(names) - set(engine) | set(defaults) - set(names)
    if unknown:  # a preset's own mistake, met at import
        raise TypeError(f"engine_options: {sorted(unknown)} are not LayoutStrategy options this preset takes")

    def wrap(init: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(init, eval_str=True)
        params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        params += [engine[n].replace(default=defaults.get(n, engine[n].default)) for n in names]
        signature = own.replace(parameters=params)

        @functools.wraps(init)
        def __init__(*args: Any, **kwargs: Any) -> None:
            bound = signature.bind(*args, **kwargs)  # a TypeError names what this preset does not take
            bound.apply_defaults()
            init(**bound.arguments)

        __init__.__signature__ = signature  # type: ignore[attr-defined]
        return __init__

    return wrap


def _register(cls: type, strategy_registry: Any, presets: dict[str, dict[str, Any]]) -> None:
    for name, init_args in presets.items():
        strategy_registry.register(name, cls, description=f"lightning-par {cls.__name__}({init_args})", **init_args)


class ZeroStrategy(LayoutStrategy):
    """Data parallelism over every rank (tp = pp = 1) with a ZeRO stage.

    Per rank, for fp32 Adam and N data-parallel ranks (the ZeRO paper's accounting):

    ====== ======================================== ============ ========= =========== ====================
    stage  what is sharded                          parameters   gradients Adam states traffic per step
    ====== ======================================== ============ ========= =========== ====================
    0      nothing (DDP: all-reduce)                4Ψ           4Ψ        8Ψ          2Ψ(N-1)/N
    1      optimizer states                         4Ψ           4Ψ        8Ψ/N        2Ψ(N-1)/N
    2      + gradients                              4Ψ           4Ψ/N      8Ψ/N        2Ψ(N-1)/N
    3      + parameters (FSDP2)                     4Ψ/N         4Ψ/N      8Ψ/N        3Ψ(N-1)/N
    ====== ======================================== ============ ========= =========== ====================

    Args:
        stage: ZeRO stage: 0 replicas, gradients all-reduced (DDP); 1 optimizer states sharded; 2 + gradients
            sharded; 3 + parameters sharded (FSDP2).

    The other options are :class:`~lightning_par.strategies.engine.LayoutStrategy`'s.

    ``ep``: expert parallel for a mixture-of-experts model, each layer's experts split over ep of the ranks
    (without offload, so far); :class:`ExpertParallelStrategy` is this preset with ``ep`` first.

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=ZeroStrategy(stage=0))
        # or: lightning-par fit ... --trainer.strategy=zero --trainer.strategy.stage=2
    """

    strategy_name = "zero"

    @engine_options("ep", *ZERO_OPTIONS, *RUN_OPTIONS)
    def __init__(self, stage: int = 0, **options: Any) -> None:
        super().__init__(dp="auto", tp=1, pp=1, zero_stage=stage, **options)

    @property
    def stage(self) -> int:
        return self.layout.zero_stage

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets: dict[str, dict[str, Any]] = {"zero": {}}
        presets.update({f"zero{stage}": {"stage": stage} for stage in SUPPORTED_ZERO_STAGES})
        presets.update({f"zero{stage}_offload": {"stage": stage, "offload_optimizer": True} for stage in (1, 2)})
        presets["zero3_offload"] = {"stage": 3, "offload_optimizer": True, "offload_parameters": True}
        # expert parallel beside each stage (ExpertParallelStrategy's names: ep2, ep4, ep8)
        presets.update({f"zero{stage}_ep{ep}": {"stage": stage, "ep": ep} for stage in SUPPORTED_ZERO_STAGES
                        for ep in (2, 4)})
        _register(cls, strategy_registry, presets)


class MegatronTPStrategy(LayoutStrategy):
    """Megatron-style tensor parallelism over ``tp`` ranks, data parallel (optionally ZeRO-3) across replicas.

    The model declares its split in Hugging Face form (``tp_plan``: module-name patterns -> ``"colwise"``,
    ``"rowwise"``, ``"vocab_parallel"``, ...; a ``transformers`` model's own published plan works unchanged) and
    the engine applies it with DTensor. Attention q/k/v and MLP gate/up are column-parallel, the output projections
    row-parallel; heads and key/value heads are divided over the tp ranks (attention must reshape with the local
    head count); a fused q|k|v ``nn.Linear`` is ``"packed_colwise:3"``; a mixture-of-experts layer's experts
    (transformers' ``"moe_tp_experts"`` with its 3-D expert weights) have each expert's intermediate features
    split. A plan under which a block computes another function is refused at setup by a self-check
    (docs/tensor-parallel.md). A ``"vocab_parallel"`` head keeps the logits split over the vocabulary and the
    cross-entropy runs on the shards. Per transformer block and step, on the tp group (b batch, s sequence, h hidden;
    activations in elements):

    ================== =================================== ===================================== =================
    sequence_parallel  forward                             backward                              norm activations
    ================== =================================== ===================================== =================
    False              2 all-reduce (bsh)                  2 all-reduce (bsh)                    bsh per rank
    True               2 all-gather + 2 reduce-scatter     2 all-gather + 2 reduce-scatter       bsh / tp per rank
    ================== =================================== ===================================== =================

    (An all-reduce moves the same bytes as an all-gather plus a reduce-scatter, so sequence parallelism costs no
    extra traffic and divides the memory of the activations outside the split linears by tp.)

    Args:
        tp: tensor-parallel size; must divide the attention heads, key/value heads, hidden and FFN sizes and the
            vocabulary (checked before training, with the allowed values in the error).
        dp: data-parallel size, or ``"auto"`` for world size / tp.

    The other options are :class:`~lightning_par.strategies.engine.LayoutStrategy`'s.

    Example::

        Trainer(accelerator="gpu", devices=8, strategy=MegatronTPStrategy(tp=4, sequence_parallel=True))
        # or: lightning-par fit ... --trainer.strategy=megatron_tp --trainer.strategy.tp=4 \
        #     --trainer.strategy.sequence_parallel=true
    """

    strategy_name = "megatron_tp"

    @engine_options("tp", "sequence_parallel", "dp", "zero_stage", "ep", *ZERO_OPTIONS, *RUN_OPTIONS, tp=2)
    def __init__(self, **options: Any) -> None:
        super().__init__(pp=1, **options)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets: dict[str, dict[str, Any]] = {cls.strategy_name: {}}  # any size: --trainer.strategy.tp=N
        for tp in (2, 4, 8):
            presets[f"megatron_tp{tp}"] = {"tp": tp}
            presets[f"megatron_tp{tp}_sp"] = {"tp": tp, "sequence_parallel": True}
            presets[f"megatron_tp{tp}_zero3"] = {"tp": tp, "zero_stage": 3}
        _register(cls, strategy_registry, presets)


class PipelineStrategy(LayoutStrategy):
    """Pipeline parallelism: the model split into ``pp`` stages that micro-batches flow through; dp across replicas.

    With ``virtual_stages`` v, there are ``pp * v`` stages, v per rank. The model declares its pipeline units in
    execution order (``pipeline_units()``: embedding, each block, final norm, head); stages are contiguous runs of
    units, balanced by count or by ``stage_costs``, and keep the original parameter names. Each Lightning batch is split
    into ``n_microbatches`` micro-batches that the schedule runs through the stages. The loss is computed on the last
    stage, either the Hugging Face way -- a ``*ForCausalLM`` whose training_step returns ``self.model(**batch).loss``
    (labels in the batch): that call runs the schedule, and the last stage computes the model's own loss, the token
    mean over the whole batch -- or, for any model, with ``loss_fn(outputs, targets)`` (one micro-batch's loss) and
    the step's loss from ``compute_loss(batch)``, which the strategy answers with the batch loss after the schedule
    ran forward and backward. Either way the step's logging works unchanged.

    ================== =========================== ============================== ===============================
    schedule           stages per rank (v)         bubble / compute (ideal)       micro-batches held per stage
    ================== =========================== ============================== ===============================
    gpipe              1                           (p-1)/m                        m
    1f1b               1                           (p-1)/m                        at most p
    interleaved_1f1b   v (default 2)               (p-1)/(m v)                    about p (per virtual stage)
    looped_bfs         v (default 2)               (p-1)/(m v)                    m
    zero_bubble        v (default 2)               about (p-1)/(3 m v)            about p
    zbv                2, in a V                   about 0                        about p
    dualpipev          2, in a V (m >= 2p)         about 0                        about p
    ================== =========================== ============================== ===============================

    Args:
        pp: pipeline-parallel size.
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``zero_bubble``, ``zbv`` or
            ``dualpipev`` (bubble and memory of each in the table of ``help(PipelineStrategy)``).
        dp: data-parallel size, or ``"auto"`` for world size / pp.

    The other options are :class:`~lightning_par.strategies.engine.LayoutStrategy`'s.

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(pp=4, schedule="interleaved_1f1b"))
        # or: lightning-par fit ... --trainer.strategy=pipeline --trainer.strategy.pp=4 --trainer.strategy.schedule=zbv
    """

    strategy_name = "pipeline"

    @engine_options("pp", *PIPELINE_OPTIONS, "dp", "ep", "zero_stage", *ZERO_OPTIONS, "stage_costs", *RUN_OPTIONS,
                    pp=2)
    def __init__(self, **options: Any) -> None:
        super().__init__(tp=1, **options)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="lightning-par PipelineStrategy: any size and "
                                   "schedule (--trainer.strategy.pp=N --trainer.strategy.schedule=NAME)")
        _register(cls, strategy_registry, {f"pipeline{pp}_{schedule}": {"pp": pp, "schedule": schedule}
                                           for pp in (2, 4) for schedule in SCHEDULES})


class Hybrid3DStrategy(LayoutStrategy):
    """3D parallelism: ``pp`` pipeline stages, each split over ``tp`` tensor-parallel ranks, in ``dp`` replicas.

    One (pp, dp, cp, tp) device mesh (cp: context parallel, 1 unless set): tensor-parallel ranks innermost (adjacent
    ranks, the fastest links), pipeline outermost. The model is built without memory and split into stages first;
    each rank materialises only its own stages (the full model never exists on a rank), then each stage gets, in this
    order, the model's tensor-parallel plan (patterns naming another stage's units are skipped there), activation
    recompute and ZeRO across data parallel. Rank 0 logs the rank table (global rank -> (pp, dp, tp), with cp when
    set) and which units each stage holds.

    ZeRO with pipelines: stages 1 and 2 reduce-scatter each gradient bucket once per optimizer step, after the
    schedule's last backward (not once per micro-batch); stage 3 (FSDP2 per block and per stage) gathers each group
    once per step and reduce-scatters it once, after the last backward. The loss is declared as for
    PipelineStrategy: ``self.model(**batch).loss`` of a Hugging Face causal LM, or ``loss_fn`` + ``compute_loss``.

    Args:
        tp: tensor-parallel size (must divide heads, hidden and FFN sizes and the vocabulary).
        zero_stage: across data parallel: 0 replicas, 1 optimizer states sharded (default), 2 + gradients,
            3 + parameters (FSDP2).
        sequence_parallel: split norms and the residual stream over the sequence too (activations sent between
            stages are then sequence shards, 1 / tp of the bytes).

    The other options are :class:`~lightning_par.strategies.engine.LayoutStrategy`'s.

    Example::

        Trainer(accelerator="gpu", devices=8, strategy=Hybrid3DStrategy(tp=2, pp=2))   # dp = 8 / 4 = 2
        # or: lightning-par fit ... --trainer.strategy=hybrid3d --trainer.strategy.tp=2 --trainer.strategy.pp=2
        # a mixture of experts: each stage's experts over ep=2 of its dp ranks (docs/moe.md)
        Trainer(accelerator="gpu", devices=8, strategy=Hybrid3DStrategy(tp=2, pp=2, ep=2))
    """

    strategy_name = "hybrid3d"

    @engine_options("tp", "pp", "dp", "cp", "ep", "zero_stage", *PIPELINE_OPTIONS, "sequence_parallel", "stage_costs",
                    *ZERO_OPTIONS, *RUN_OPTIONS, tp=2, pp=2, zero_stage=1)
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets: dict[str, dict[str, Any]] = {cls.strategy_name: {}}  # any size: --trainer.strategy.tp=N ...pp=M
        for tp, pp in ((2, 2), (2, 4), (4, 2)):
            presets[f"hybrid3d_tp{tp}_pp{pp}"] = {"tp": tp, "pp": pp}
            presets[f"hybrid3d_tp{tp}_pp{pp}_sp"] = {"tp": tp, "pp": pp, "sequence_parallel": True}
        presets["hybrid3d_tp2_pp2_zero3"] = {"tp": 2, "pp": 2, "zero_stage": 3}
        presets["hybrid3d_tp2_pp2_cp2"] = {"tp": 2, "pp": 2, "cp": 2}
        _register(cls, strategy_registry, presets)


class ExpertParallelStrategy(LayoutStrategy):
    """Expert parallel for a mixture-of-experts model: data parallel over every rank with a ZeRO stage, each expert
    layer's experts split over ``ep`` of the ranks.

    Each rank routes its own tokens as one process would; every expert layer sends them to the ranks holding their
    experts and back with all-to-all (dropless), and each expert's gradient is averaged over the ``world / ep`` ranks
    holding it (docs/moe.md). Per rank, with E the expert weights' elements, Ψ the others', N ranks and fp32 AdamW:
    the experts ``16 E / ep`` bytes at ZeRO-0, and from ZeRO-1 on ZeroStrategy's table at the same stage over the
    ``N / ep`` ranks holding the same experts (states ``8 E / N``; stage 2: + gradients, stage 3: + parameters); the
    others as :class:`ZeroStrategy`'s table at the same stage. Tokens sent per step through the all-to-all, per
    expert layer and micro-batch: ``4 x tokens x top_k x hidden x bytes x (ep - 1) / ep`` (dispatch and combine,
    forward and backward; what ``lightning-par plan`` counts).

    Args:
        ep: expert-parallel size: divides the ranks (x cp) and every expert layer's experts.
        stage: ZeRO stage of the other weights across all ranks (of the experts across their replicas): 0 replicas
            (DDP), 1 optimizer states sharded (default), 2 + gradients, 3 + parameters (FSDP2).

    The other options are :class:`~lightning_par.strategies.engine.LayoutStrategy`'s.

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=ExpertParallelStrategy(ep=2))   # each expert on 2 ranks
        # or: lightning-par fit ... --trainer.strategy=ep2 (or expert_parallel --trainer.strategy.ep=4)
    """

    strategy_name = "expert_parallel"

    @engine_options("cp", *RUN_OPTIONS)
    def __init__(self, ep: int = 2, stage: int = 1, **options: Any) -> None:
        super().__init__(dp="auto", tp=1, pp=1, ep=ep, zero_stage=stage, **options)

    @property
    def ep(self) -> int:
        return self.layout.ep

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets: dict[str, dict[str, Any]] = {cls.strategy_name: {}}  # any size: --trainer.strategy.ep=N
        presets.update({f"ep{ep}": {"ep": ep} for ep in (2, 4, 8)})
        _register(cls, strategy_registry, presets)
