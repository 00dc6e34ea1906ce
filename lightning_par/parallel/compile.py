"""``torch.compile`` per block, with every graph it compiles counted.

Why per block, and in place: a whole-model compile would trace through the pipeline runtime, the FSDP2 hooks and the
Lightning step, and wrap the model in an ``OptimizedModule`` whose parameter names start with ``_orig_mod.``.
Compiling each repeated block with ``nn.Module.compile`` (torchtitan does the same) replaces only the block's call:
the module tree, its parameter names and so every checkpoint stay as they were, and the code between blocks
(pipeline sends, FSDP2 gathers, the vocab-parallel loss) runs eagerly as before. The blocks of one shape share one
graph -- the compiled code is cached per code object and parameters are graph inputs, not constants -- so a model of
32 equal blocks compiles once, not 32 times.

Where it goes: after tensor parallel and recompute, before data-parallel sharding (torchtitan's order,
:func:`~lightning_par.parallel.parallelize.parallelize`). Tensor parallel first, so the graph is traced with the
DTensor parameters the block runs with; recompute first, so its ``checkpoint`` is traced into the graph (the
compiled backward then recomputes too); FSDP2 last, because its hooks must stay outside the graph (dynamo skips
them) to gather and free the parameters around each block. Compilation itself is lazy: the first call of a block
traces it, on the real (materialised, sharded) parameters.

Recompilations: with ``dynamic=False`` (the default here) a block compiles once per distinct input -- its shapes,
dtypes and whether autograd records (training and evaluation are two graphs) -- and never again for the same input.
A compile for an input already compiled means a guard failed for another reason (a Python value the block reads
that changes between calls, a hook that alters the module): every call then pays a compile, until dynamo's
recompile limit makes it fall back to eager. :class:`BlockCompiler` counts each graph per block and input and
names such recompiles (:meth:`BlockCompiler.summary`), so a strategy can warn and log them.
"""

from __future__ import annotations

import functools
import time
import warnings
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_par._compat import (
    AsyncCollectiveTensor,
    TorchCompileInductorWrapper,
    TorchCompileWrapper,
    dynamo_guard_failures,
    functorch_config,
)
from lightning_par.topology import LayoutError

#: ``torch.compile`` modes (``None`` = ``"default"``)
COMPILE_MODES: tuple[str | None, ...] = (None, "default", "reduce-overhead", "max-autotune",
                                         "max-autotune-no-cudagraphs")


#: why a block compiled into CUDA graphs is refused (CompileOptions)
CUDA_GRAPHS_WHY = ("a graph replays fixed memory addresses: FSDP2 gathers each block's parameters into new buffers "
                   "every step, tensor parallel hands blocks AsyncCollectiveTensors whose collectives are still in "
                   "flight, and pipeline stages run a block on several micro-batches in a schedule's order, so the "
                   "graphs would be re-recorded each step or replay stale inputs")


@dataclass(frozen=True)
class CompileOptions:
    """What ``torch.compile`` is given for each block (see :func:`torch.compile` for each option).

    Attributes:
        backend: a registered backend name (``torch.compiler.list_backends()``): ``"inductor"`` (default; on CPU it
            compiles C++ with the system compiler), ``"aot_eager"`` (traces forward and backward, runs them
            eagerly: a quick check that a block compiles), ``"eager"``, ``"cudagraphs"``, ...
        mode: ``None``/``"default"``, ``"max-autotune"`` (CPU only: on CUDA it records CUDA graphs) or
            ``"max-autotune-no-cudagraphs"`` (inductor only). ``"reduce-overhead"`` (CUDA graphs) is refused, see
            :data:`CUDA_GRAPHS_WHY`.
        fullgraph: refuse graph breaks inside a block (an error names the Python that broke it).
        dynamic: ``False`` (default): one graph per input shape, so same-shaped micro-batches compile once;
            ``None``: torch's automatic dynamic shapes (a second shape compiles a shape-generic graph);
            ``True``: shape-generic from the start.
        options: inductor's config options (``torch._inductor.list_options()``); not together with ``mode``.
    """

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = False
    options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str):
            raise LayoutError(f"compile backend={self.backend!r} is not a backend name; use one of "
                              f"{torch.compiler.list_backends()}, e.g. compile=dict(backend='inductor').")
        backends = torch.compiler.list_backends(exclude_tags=())
        if self.backend not in backends:
            raise LayoutError(f"compile backend={self.backend!r} is not registered with torch; use one of "
                              f"{torch.compiler.list_backends()} (e.g. 'inductor', or 'aot_eager' to check that "
                              "the blocks trace without generating code).")
        if self.mode not in COMPILE_MODES:
            raise LayoutError(f"compile mode={self.mode!r} is not a torch.compile mode; use one of "
                              f"{[m for m in COMPILE_MODES if m]} or leave it unset.")
        if self.mode not in (None, "default") and self.backend != "inductor":
            raise LayoutError(f"compile mode={self.mode!r} is an inductor mode; backend={self.backend!r} takes none. "
                              "Use backend='inductor' or drop the mode.")
        if not isinstance(self.fullgraph, bool):
            raise LayoutError(f"compile fullgraph={self.fullgraph!r} must be true or false.")
        if self.dynamic not in (True, False, None) or isinstance(self.dynamic, int) and not isinstance(
                self.dynamic, bool):
            raise LayoutError(f"compile dynamic={self.dynamic!r} must be false (one graph per shape, the default), "
                              "true or null (torch's automatic dynamic shapes).")
        if self.options is not None and not isinstance(self.options, dict):
            raise LayoutError(f"compile options={self.options!r} must be a dict of inductor options.")
        if self.options and self.mode not in (None, "default"):
            raise LayoutError("compile: give `mode` or `options`, not both (torch.compile takes one of them).")
        graphs = ("mode='reduce-overhead'" if self.mode == "reduce-overhead"
                  else "backend='cudagraphs'" if self.backend == "cudagraphs"
                  else "options={'triton.cudagraphs': True}" if (self.options or {}).get("triton.cudagraphs")
                  else None)
        if graphs is not None:
            raise LayoutError(f"compile {graphs} records CUDA graphs, which lightning-par does not support (untested, "
                              f"and {CUDA_GRAPHS_WHY}). Use mode='default' or 'max-autotune-no-cudagraphs'.")

    def check_device(self, device: torch.device) -> None:
        """Refuse what cannot run on ``device`` (at setup, once the device is known): on CUDA, inductor's
        ``max-autotune`` mode also records CUDA graphs."""
        if device.type == "cuda" and self.mode == "max-autotune":
            raise LayoutError(f"compile mode='max-autotune' records CUDA graphs on CUDA, which lightning-par does not "
                              f"support (untested, and {CUDA_GRAPHS_WHY}). Use mode='max-autotune-no-cudagraphs' "
                              "(the same autotuning without CUDA graphs) or 'default'.")

    def compiler(self, device: torch.device, plan: Any) -> BlockCompiler:
        """The blocks' compiler for a run on ``device`` under the pipeline ``plan`` (a StagePlan: its schedule may
        split backward), after the checks that need the device."""
        self.check_device(device)
        return BlockCompiler(self, split_backward=plan.spec is not None and plan.spec.split_backward)

    @classmethod
    def of(cls, value: bool | dict[str, Any] | CompileOptions | None) -> CompileOptions | None:
        """The options a strategy's ``compile=`` argument means: ``False``/``None`` none (eager), ``True`` the
        defaults, a dict some of the fields (``{"mode": "max-autotune"}``), or a :class:`CompileOptions`."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, CompileOptions):
            return value
        if isinstance(value, dict):
            known = set(cls.__dataclass_fields__)
            unknown = sorted(set(value) - known)
            if unknown:
                raise LayoutError(f"compile={value!r}: unknown option(s) {unknown}; the options are "
                                  f"{sorted(known)}, e.g. compile=dict(mode='max-autotune', fullgraph=True).")
            return cls(**value)
        raise LayoutError(f"compile={value!r} is not valid: give true/false, a dict of options "
                          f"({sorted(cls.__dataclass_fields__)}) or a CompileOptions.")

    def describe(self) -> str:
        changed = {k: v for k, v in asdict(self).items() if v != CompileOptions.__dataclass_fields__[k].default}
        return "torch.compile per block" + (f" ({', '.join(f'{k}={v!r}' for k, v in changed.items())})"
                                            if changed else "")


@dataclass
class GraphRecord:
    """One graph compiled: the block whose call compiled it (its index in :attr:`BlockCompiler.blocks`, or -1 when
    no parameter of a known block is an input), the input it was compiled for, and the seconds the backend took
    (the forward graph; inductor compiles the backward graph at the first backward)."""

    block: int
    key: tuple
    seconds: float


@dataclass
class CompileSummary:
    """What the blocks compiled so far: ``graphs`` in all, ``inputs`` distinct inputs (block class, parameter
    names and shapes, input shapes, grad mode), ``recompiles`` = graphs compiled again for an input compiled before,
    ``by_block`` graphs per block name, ``seconds`` in the backend."""

    graphs: int = 0
    inputs: int = 0
    recompiles: int = 0
    seconds: float = 0.0
    by_block: dict[str, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    def describe(self) -> str:
        blocks = ", ".join(f"{name} {n}" for name, n in self.by_block.items() if n) or "none yet"
        text = (f"{self.graphs} graphs for {self.inputs} distinct block inputs, {self.recompiles} recompiles, "
                f"{self.seconds:.1f} s in the backend; graphs by the block that compiled them: {blocks}")
        return text


class BlockCompiler:
    """Compile blocks in place (``nn.Module.compile``) through one counting backend shared by all of them.

    One backend object for every block matters twice: dynamo reuses a compiled graph only for the backend it was
    compiled with, so equal blocks share one graph; and each graph is compiled by a call of the backend, so calls
    counted are graphs compiled, attributed to the block whose parameters are the graph's inputs.

    ``split_backward``: the pipeline schedule splits each backward into an input half and, later, a weight half
    (zero bubble, ZBV, DualPipeV). AOTAutograd compiles a block's backward as one function, and by default lets it
    reuse ("donate") the saved activations' buffers, which it allows only for a backward run once without
    ``retain_graph`` -- but torch's input half runs with ``retain_graph=True`` so that the weight half can run later
    (the failure of pytorch issue 161904: "This backward function was compiled with non-empty donated buffers").
    Here donation is turned off for these graphs, and the block's compiled backward runs twice: in the input half
    (its weight gradients are computed and dropped) and in the weight half (its input gradient is not needed). The
    gradients are exact; the cost is one more backward of the compiled blocks per micro-batch, in the slots the
    schedule keeps for weight gradients.
    """

    def __init__(self, options: CompileOptions, split_backward: bool = False) -> None:
        self.options = options
        self.split_backward = split_backward
        self._donated_buffer: bool | None = None  # the setting before split_backward turned it off
        if split_backward:
            # read by AOTAutograd when it compiles a backward (lazily, at the first backward) and checked each time
            # a compiled backward runs, so it is switched off for the process until release()
            # (AOTAutograd's config: private, see lightning_par._compat)
            self._donated_buffer = functorch_config.donated_buffer
            functorch_config.donated_buffer = False
        self.blocks: list[nn.Module] = []
        self.records: list[GraphRecord] = []
        # what torch.compile(backend=NAME, mode=..., options=...) would build itself (torch._TorchCompile*Wrapper),
        # made through torch.compile's own code: a throwaway compile of nothing, whose backend we keep
        self._inner = _backend_of(options, split_backward)

    def __call__(self, block: nn.Module) -> None:
        """Compile ``block`` in place: its ``__call__`` runs compiled from its next call on."""
        self.blocks.append(block)
        block.compile(backend=self._count, fullgraph=self.options.fullgraph, dynamic=self.options.dynamic)
        # nn.Module.compile keeps the compiled call in `_compiled_call_impl` (torch's own attribute, read by
        # Module.__call__); it is wrapped, outside the graph, to hand the graph plain tensors (see _plain_inputs)
        block._compiled_call_impl = functools.partial(_plain_inputs, block._compiled_call_impl)

    def _count(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        index, key = self._identify(example_inputs)
        again = sum(r.key == key for r in self.records)
        if again:
            reasons = _guard_failures(last=1)
            warnings.warn(
                f"torch.compile: block {index} ({key[0]}) compiled again for an input it was compiled for already "
                f"(recompile {again}); a guard failed{': ' + reasons[0] if reasons else ''}. Every call that fails "
                "it compiles anew, until dynamo's recompile limit runs the block eagerly. TORCH_LOGS=recompiles "
                "shows each reason.", RuntimeWarning, stacklevel=2)
        start = time.perf_counter()
        compiled = self._inner(gm, example_inputs, **kwargs)
        self.records.append(GraphRecord(index, key, time.perf_counter() - start))
        return compiled

    def _identify(self, example_inputs: list[Any]) -> tuple[int, tuple]:
        """The block whose parameters the graph takes (looked up now: FSDP2 registers its gathered parameters only
        for the block's forward) and the key of the input: block class, each input's parameter name (relative to
        the block) or "input", its type (a plain tensor, a DTensor, an ``AsyncCollectiveTensor`` from a tensor-parallel
        all-reduce still in flight: dynamo guards on it), shape, dtype and DTensor placements, and the grad mode."""
        owner: dict[int, tuple[int, str]] = {}
        for i, block in enumerate(self.blocks):
            for name, param in block.named_parameters():
                owner.setdefault(id(param), (i, name))
        index = -1
        described = []
        for value in example_inputs:
            if isinstance(value, Tensor):
                i, name = owner.get(id(value), (-1, "input"))
                index = i if index < 0 else index
                # a DTensor's placements too: a graph piece between dropout regions (graph breaks) is compiled
                # once per layout of its input, which is no recompile
                layout = str(getattr(value, "placements", ""))
                described.append((name, type(value).__name__, tuple(value.shape), str(value.dtype), layout))
            else:
                described.append(("value", type(value).__name__))
        kind = type(self.blocks[index]).__name__ if index >= 0 else "?"
        return index, (kind, torch.is_grad_enabled(), tuple(described))

    def release(self, root: nn.Module) -> None:
        """Make the blocks eager again, drop dynamo's caches (``torch.compiler.reset``: every compiled graph of the
        process), and give ``root`` fresh parameter objects where tracing left weak references on its own.

        The fake tensors of tracing keep weak references to the real parameters they were made from (torch 2.13:
        they outlive ``torch.compiler.reset``), and ``torch.utils.swap_tensors`` -- which ``Module.to``/``.cpu()``
        use for DTensor parameters, as Lightning's teardown does -- refuses a tensor that has one. A fresh
        ``nn.Parameter`` around the same data (ties kept) has none. FSDP2's parameters are its own (it moves them
        itself) and are left alone. The counts stay."""
        for block in self.blocks:
            block._compiled_call_impl = None
        torch.compiler.reset()
        if self._donated_buffer is not None:
            functorch_config.donated_buffer = self._donated_buffer
            self._donated_buffer = None
        fresh: dict[int, nn.Parameter] = {}
        for module in root.modules():
            if isinstance(module, FSDPModule):
                continue
            for name, param in list(module._parameters.items()):
                if param is not None and weakref.getweakrefcount(param):
                    if id(param) not in fresh:
                        fresh[id(param)] = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
                    module._parameters[name] = fresh[id(param)]

    def summary(self, root: nn.Module | None = None) -> CompileSummary:
        """Counts so far; ``root``: the module holding the blocks, to name them by their parameter names' prefix."""
        names = {id(m): n for n, m in root.named_modules() if n} if root is not None else {}
        seen: Counter[tuple] = Counter(r.key for r in self.records)
        by_block: dict[str, int] = {}
        for i, block in enumerate(self.blocks):
            by_block[names.get(id(block), f"block {i}")] = sum(r.block == i for r in self.records)
        out = CompileSummary(graphs=len(self.records), inputs=len(seen), by_block=by_block,
                             recompiles=sum(n - 1 for n in seen.values()),
                             seconds=sum(r.seconds for r in self.records))
        if out.recompiles:
            out.reasons = _guard_failures()
        return out


def _plain_inputs(compiled: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a compiled block with each ``AsyncCollectiveTensor`` input made an ordinary tensor first.

    Under tensor parallelism the first block's input is the embedding's output, the result of an asynchronous
    all-reduce (reduce-scatter with sequence parallelism) still wrapped as an ``AsyncCollectiveTensor``. A compiled
    graph given that wrapper as an input returns *no gradient* for it (torch 2.13; eager autograd does): the
    embedding would silently stop learning, and DTensor's redistribute backward fails on the missing gradient.
    ``clone()`` waits for the collective and gives a plain tensor whose gradient autograd routes back to the wrapper
    (a copy of one activation; the graph would wait for the collective at its first use anyway)."""
    args = tuple(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args)
    kwargs = {k: v.clone() if isinstance(v, AsyncCollectiveTensor) else v for k, v in kwargs.items()}
    return compiled(*args, **kwargs)


def _backend_of(options: CompileOptions, split_backward: bool = False) -> Any:
    """The backend ``torch.compile`` builds for ``backend``/``mode``/``options`` (for inductor, the wrapper that
    turns the mode into inductor's config). torch has no public constructor for it (its two wrapper classes come
    from :mod:`lightning_par._compat`).

    ``split_backward``: inductor's FX graph cache is off for these graphs. Its key does not include buffer donation
    (torch 2.13), so a backward compiled elsewhere with donated buffers -- any non-split run of the same block on
    this machine -- would be served from the cache and overwrite saved activations in the input half, leaving the
    weight half wrong (measured: weight gradients off by up to 7.3 on a tiny GPT block)."""
    if options.backend == "inductor":
        inductor = {**(options.options or {}), **({"fx_graph_cache": False} if split_backward else {})}
        return TorchCompileInductorWrapper(options.mode, inductor or None, options.dynamic)
    return TorchCompileWrapper(options.backend, options.mode, options.options, options.dynamic)


def _guard_failures(last: int = 3) -> list[str]:
    """The last reasons dynamo recorded for recompiling (dynamo's ``guard_failures``, through
    :mod:`lightning_par._compat`; an empty list if a torch version moves it)."""
    reasons = [str(reason).splitlines()[0] for code_reasons in dynamo_guard_failures().values()
               for reason in code_reasons]
    return reasons[-last:]
