"""Precision for every layout: which dtype parameters, master weights, gradients, their reduction and the optimizer
states have under each strategy, and the Lightning plugin that applies it.

``Trainer(precision=...)`` under a lightning-par strategy becomes a :class:`LayoutPrecision` (the strategy replaces
the plugin Lightning made); ``Trainer(plugins=[LayoutPrecision("bf16-mixed")])`` does the same explicitly.

``"bf16-mixed"``, per data-parallel owner (``LayoutPrecision.policy`` says it for a layout):

==========================  ==========  ======  ======  ======  ============================================
owner                       parameters  master  grads   reduce  how
==========================  ==========  ======  ======  ======  ============================================
ZeRO-0 (DDP, FSDP2          fp32        = the   fp32    fp32    autocast: bf16 matmuls over fp32 weights (the
``replicate``), tp, pp                  params                  master weights are the parameters themselves)
ZeRO-1/2 (the partitioner)  bf16        fp32    bf16    fp32    bf16 buckets replicated; each rank's fp32 master
                                        shard                   shard is the optimizer's parameter; gradients
                                                                summed in fp32, the average rounded once to bf16
ZeRO-3 (FSDP2)              fp32 shard  = the   fp32    fp32    ``MixedPrecisionPolicy(bf16, fp32)``: shards
                            (bf16 when  shard   shard           gathered as bf16 for compute
                            gathered)
==========================  ==========  ======  ======  ======  ============================================

Autocast is on in every mixed layout (losses, softmax and norms in fp32). Optimizer states are fp32 throughout, so
with Adam the persistent state per rank is the ZeRO paper's: 16 Psi (ZeRO-0), 4 Psi + 12 Psi / N, 2 Psi + 14 Psi / N,
16 Psi / N (:meth:`DtypePolicy.state_bytes`). ZeRO-0 keeps autocast over fp32 weights rather than bf16 replicas with
an fp32 copy: the same 16 Psi, no extra copy step, and it is what DDP, FSDP2 ``replicate`` and the pipeline's own
all-reduce support unchanged.

``"bf16-mixed-master"`` is Megatron-LM's mixed precision with its distributed optimizer, at ZeRO 1-3 only:

==========================  ==========  ======  ======  ======  ============================================
owner                       parameters  master  grads   reduce  how
==========================  ==========  ======  ======  ======  ============================================
ZeRO-1/2 (the partitioner)  bf16        fp32    fp32    fp32    as bf16-mixed, but the gradient buckets are
                                        shard                   fp32 (Megatron's main grads): bf16 grads are
                                                                upcast into them, reduce-scattered and kept in
                                                                fp32, the master's step gradient as they are:
                                                                6 Psi + 12 Psi / N (ZeRO-1), 2 Psi + 16 Psi / N
                                                                (ZeRO-2) with Adam
ZeRO-3 (FSDP2)              fp32 shard  = the   fp32    fp32    the same as bf16-mixed: the fp32 shard is the
                            (bf16 when  shard   shard           master, no bf16 copy at rest (16 Psi / N)
                            gathered)
==========================  ==========  ======  ======  ======  ============================================

ZeRO-0 is refused for it: a full fp32 master copy beside bf16 replicas is 18 Psi per rank, more than bf16-mixed's
16 Psi for the same numerics; use bf16-mixed there. Gradients of several micro-batches (accumulation, pipeline
schedules) add up in the parameters' bf16 ``.grad`` before they are upcast, not in the fp32 buffer as in Megatron.

``"bf16-true"`` (and ``"16-true"``): everything in that dtype (the module converted, Lightning's ``HalfPrecision``).
``"16-mixed"`` needs a loss scaler whose skip-the-step decision every rank shares: that holds where each rank sees the
whole, all-reduced gradient -- ZeRO-0 without tensor or pipeline parallel -- and is refused elsewhere, before launch
(a pipeline skips Lightning's backward, so its scaled-loss backward would never run while the unscale still did).
Clipping is by the whole model's norm in every mode: the strategy computes it over tp, pp and sharded dp.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import Tensor, nn

from lightning_par.parallel.zero import ShardPrecision
from lightning_par.topology import LayoutError

SUPPORTED = ("32-true", "bf16-mixed", "bf16-mixed-master", "bf16-true", "16-true", "16-mixed")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}
_LOW = {"bf16": torch.bfloat16, "16": torch.float16}


@dataclass(frozen=True)
class DtypePolicy:
    """The dtypes of one precision mode under one data-parallel owner.

    Attributes:
        param: the parameters as each rank stores them between steps (ZeRO-3: its shard).
        compute: what matmuls run in.
        master: what the optimizer updates (``param`` where the parameters are the master weights).
        grad: the gradient storage backward accumulates into.
        reduce: the dtype gradients are summed in over data parallel.
        optimizer_state: Adam's moments and the like.
        separate_master: the master is a copy beside the parameters (ZeRO-1/2 under mixed precision).
        autocast: forward runs under ``torch.autocast(compute)``.
        loss_scaling: a GradScaler scales the loss (16-mixed).
    """

    precision: str
    owner: str
    param: torch.dtype
    compute: torch.dtype
    master: torch.dtype
    grad: torch.dtype
    reduce: torch.dtype
    optimizer_state: torch.dtype
    separate_master: bool = False
    autocast: bool = False
    loss_scaling: bool = False

    def describe(self) -> str:
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        master = f"{name(self.master)} {'copy' if self.separate_master else '(the parameters)'}"
        return (f"{self.precision} under {self.owner}: parameters {name(self.param)}, compute {name(self.compute)}"
                f"{' (autocast)' if self.autocast else ''}, master {master}, gradients {name(self.grad)} reduced in "
                f"{name(self.reduce)}, optimizer states {name(self.optimizer_state)}"
                f"{', loss scaling' if self.loss_scaling else ''}")

    def state_bytes(self, numel: int, zero_stage: int, dp: int, optimizer_states: int = 2) -> int:
        """Persistent model-state bytes per rank for ``numel`` (Psi) parameters: parameters + gradient storage +
        separate master + ``optimizer_states`` tensors per parameter (Adam: 2), sharded as ``zero_stage`` shards
        them over ``dp`` ranks. Workspace (reduce buffers, the master's step gradient) is not model state."""
        shard = lambda n, sharded: n // dp if sharded else n  # noqa: E731
        params = shard(numel, zero_stage >= 3) * self.param.itemsize
        grads = shard(numel, zero_stage >= 2) * self.grad.itemsize
        master = shard(numel, zero_stage >= 1) * self.master.itemsize if self.separate_master else 0
        states = shard(numel, zero_stage >= 1) * self.optimizer_state.itemsize * optimizer_states
        return params + grads + master + states


def _owner(zero_stage: int, tp: int, pp: int) -> str:
    if zero_stage in (1, 2):
        return f"ZeRO-{zero_stage} (partitioner)"
    if zero_stage == 3:
        return "ZeRO-3 (FSDP2)"
    return "ZeRO-0 (" + ", ".join(x for x in ("DDP" if tp == 1 else "FSDP2 replicate",
                                               f"tp={tp}" if tp > 1 else "", f"pp={pp}" if pp > 1 else "") if x) + ")"


class LayoutPrecision(Precision):
    """Precision plugin for lightning-par strategies: one of ``"32-true"``, ``"bf16-mixed"``,
    ``"bf16-mixed-master"``, ``"bf16-true"``, ``"16-true"``, ``"16-mixed"``. Lightning's Trainer accepts only its
    own precision flags, so ``"bf16-mixed-master"`` is passed as ``plugins=[LayoutPrecision("bf16-mixed-master")]``.

    Args:
        precision: the mode (``Trainer(precision=...)`` values; see the module docstring for what each keeps in
            which dtype under each strategy).
        device: ``"cpu"`` or ``"cuda"`` for autocast; default: the strategy's device, set in its setup.
        scaler: 16-mixed: a ``torch.amp.GradScaler`` (default: a new one).
    """

    def __init__(self, precision: str = "32-true", device: str | None = None, scaler: Any = None) -> None:
        precision = _ALIASES.get(precision, precision)  # type: ignore[call-overload]
        if precision not in SUPPORTED:
            raise LayoutError(
                f"precision={precision!r} is not supported by lightning-par strategies. Use one of "
                f"{', '.join(SUPPORTED)} (bf16-mixed: bf16 compute with fp32 master weights and optimizer states).")
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self._scaler = scaler
        self._impl: Precision | None = None
        if precision.endswith("-true") and precision != "32-true":
            self._impl = HalfPrecision(precision)  # type: ignore[arg-type]

    @classmethod
    def adopt(cls, plugin: Precision | None) -> LayoutPrecision | None:
        """The plugin a lightning-par strategy uses for ``plugin`` (what the Trainer made, or the user passed)."""
        if plugin is None or isinstance(plugin, LayoutPrecision):
            return plugin
        if type(plugin) in (Precision, MixedPrecision, HalfPrecision):
            device = getattr(plugin, "device", None)
            return cls(plugin.precision, device=device, scaler=getattr(plugin, "scaler", None))
        raise LayoutError(
            f"lightning-par strategies apply precision per layout (bf16 buckets and fp32 master shards, FSDP2 "
            f"mixed precision) and cannot use {type(plugin).__name__}. Pass Trainer(precision=...) with one of "
            f"{', '.join(SUPPORTED)}, or plugins=[LayoutPrecision(...)].")

    # -- the policy --------------------------------------------------------------------------------------------------
    @property
    def mixed(self) -> bool:
        """Autocast over the layout's parameters (bf16-mixed-master included)."""
        return "-mixed" in self.precision

    @property
    def low_dtype(self) -> torch.dtype:
        """The 16-bit dtype of this mode (fp32 for 32-true)."""
        return _LOW.get(self.precision.split("-")[0], torch.float32)

    def check_layout(self, zero_stage: int, tp: int, pp: int) -> None:
        """Refuse a mode this layout cannot run correctly (raised before any process starts)."""
        if self.precision == "bf16-mixed-master" and zero_stage == 0:
            raise LayoutError(
                "precision='bf16-mixed-master' keeps fp32 master weights sharded by ZeRO (Megatron's distributed "
                "optimizer) and needs zero_stage 1, 2 or 3; with ZeRO stage 0 use precision='bf16-mixed' (the same "
                "numerics, 16 bytes per parameter instead of 18).")
        if self.precision == "16-mixed" and (zero_stage != 0 or tp > 1 or pp > 1):
            where = ", ".join(x for x in (f"pp={pp}" if pp > 1 else "", f"tp={tp}" if tp > 1 else "",
                                          f"ZeRO stage {zero_stage}" if zero_stage else "") if x)
            raise LayoutError(
                f"precision='16-mixed' is not supported with {where}: a loss scaler must skip or take each step on "
                "every rank alike, but here each rank checks only its share of the gradient for inf/NaN"
                + (", and the pipeline runs backward inside its schedule, where the loss is not scaled" if pp > 1
                   else "")
                + ". Use precision='bf16-mixed' (no loss scaling needed; fp32 master weights and optimizer states), "
                "or 16-mixed with plain data parallel (ZeRO stage 0, tp=1, pp=1).")

    def check_device(self, device_type: str) -> None:
        """Refuse a bf16 mode on a GPU without native bf16 (before Ampere): torch would emulate it, slowly, or fail in
        the first matmul. Raised when the Trainer hands the strategy this plugin, before any process starts."""
        if self.low_dtype is not torch.bfloat16 or device_type != "cuda" or not torch.cuda.is_available():
            return
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return
        major, minor = torch.cuda.get_device_capability()
        raise LayoutError(
            f"precision={self.precision!r} computes in bf16, which this GPU ({torch.cuda.get_device_name()}, compute "
            f"capability {major}.{minor}) does not support natively (bf16 needs compute capability 8.0 or newer: "
            "A100, H100, H200, L40S, ...). Use precision='16-mixed' (with plain data parallel: ZeRO stage 0, tp=1, "
            "pp=1) or precision='32-true'.")

    def policy(self, zero_stage: int = 0, tp: int = 1, pp: int = 1) -> DtypePolicy:
        """What this mode keeps in which dtype under the layout's data-parallel owner."""
        self.check_layout(zero_stage, tp, pp)
        owner, low, f32 = _owner(zero_stage, tp, pp), self.low_dtype, torch.float32
        if not self.mixed:  # 32-true, bf16-true, 16-true: one dtype for everything
            return DtypePolicy(self.precision, owner, low, low, low, low, low, low)
        if zero_stage in (1, 2):
            grad = f32 if self.precision == "bf16-mixed-master" else low
            return DtypePolicy(self.precision, owner, param=low, compute=low, master=f32, grad=grad, reduce=f32,
                               optimizer_state=f32, separate_master=True, autocast=True,
                               loss_scaling=self.precision == "16-mixed")
        return DtypePolicy(self.precision, owner, param=f32, compute=low, master=f32, grad=f32, reduce=f32,
                           optimizer_state=f32, autocast=True, loss_scaling=self.precision == "16-mixed")

    def shard_precision(self, zero_stage: int) -> ShardPrecision:
        """The dtypes the ZeRO owners take (:class:`~lightning_par.parallel.zero.ShardPrecision`); none outside
        bf16-mixed and bf16-mixed-master (whose ZeRO-1/2 gradient buckets are fp32)."""
        if self.precision not in ("bf16-mixed", "bf16-mixed-master") or zero_stage == 0:
            return ShardPrecision()
        grad = torch.float32 if self.precision == "bf16-mixed-master" else None
        return ShardPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, grad_dtype=grad)


    # -- Lightning's hooks -------------------------------------------------------------------------------------------
    def _amp(self) -> MixedPrecision:
        """Lightning's autocast plugin (and GradScaler for 16-mixed), made once the device is known."""
        if self._impl is None:
            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            amp = "bf16-mixed" if self.precision == "bf16-mixed-master" else self.precision  # the same autocast
            self._impl = MixedPrecision(amp, device, scaler=self._scaler)  # type: ignore[arg-type]
        assert isinstance(self._impl, MixedPrecision)
        return self._impl

    def _delegate(self) -> Precision | None:
        return self._amp() if self.mixed else self._impl

    def convert_module(self, module: nn.Module) -> nn.Module:
        impl = self._delegate()
        return impl.convert_module(module) if impl is not None else module

    def tensor_init_context(self) -> AbstractContextManager:
        impl = self._delegate()
        return impl.tensor_init_context() if impl is not None else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        impl = self._delegate()
        return impl.module_init_context() if impl is not None else nullcontext()

    def forward_context(self) -> AbstractContextManager:
        impl = self._delegate()
        return impl.forward_context() if impl is not None else nullcontext()

    def convert_input(self, data: Any) -> Any:
        impl = self._delegate()
        return impl.convert_input(data) if impl is not None else data

    def convert_output(self, data: Any) -> Any:
        impl = self._delegate()
        return impl.convert_output(data) if impl is not None else data

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        if self.precision == "16-mixed":
            return self._amp().pre_backward(tensor, module)  # scales the loss, then Lightning's hooks
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if self.precision == "16-mixed":
            # unscale before clipping (the LightningModule's clip_gradients comes back to this plugin, whose
            # clip_grad_by_norm the strategy made global), skip the step on inf/NaN, update the scale
            return self._amp().optimizer_step(optimizer, model, closure, **kwargs)
        return super().optimizer_step(optimizer, model, closure, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self._amp().state_dict() if self.precision == "16-mixed" else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.precision == "16-mixed" and state_dict:
            self._amp().load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"LayoutPrecision({self.precision!r})"
