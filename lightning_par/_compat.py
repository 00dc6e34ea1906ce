"""Every private torch, Lightning and jsonargparse name lightning-par uses, in one place.

Private names change between releases without notice, so lightning-par is tested against a range of minor releases
of each (:data:`TESTED`, the ranges pyproject.toml declares; torch 2.11 to 2.15, each run by
``tests/compat/run.sh``). Importing this module (``import lightning_par`` does) checks the installed versions: one
outside the range stops the import with one message naming the tested range, unless ``LIGHTNING_PAR_ALLOW_UNTESTED=1``
turns it into one warning. Every private name is then loaded here, at import, with the older spelling each supported
release needs (:func:`private`'s ``fallbacks``), so a release that lacks one fails at once with an ImportError naming
it -- not with an AttributeError deep in a run.
No other module of lightning_par imports a private name or reaches one as ``torch.x._y``, and the private
Lightning attributes that steer a run go through the accessors below (tests/unit/test_compat.py checks both). Private
attributes of objects (a ShardedTensor's ``_local_shards``; FSDP2's ``_fsdp_param_groups`` and a module's
``_trainer``, read with a fallback) stay where they are used.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.version import Version

#: the oldest and newest minor release tested of each package whose private names are used (pyproject.toml declares
#: the same ranges; tests/compat/run.sh runs the smoke set on each torch of the range, docs/compat.md has the results)
TESTED = {"torch": ("2.11", "2.15"), "lightning": ("2.6", "2.6"), "jsonargparse": ("4.53", "4.53")}
ALLOW_UNTESTED = "LIGHTNING_PAR_ALLOW_UNTESTED"


class UntestedVersionError(ImportError):
    """An installed torch, lightning or jsonargparse of a minor release lightning-par was not tested with."""


def installed_versions() -> dict[str, str]:
    """The installed version of each package of :data:`TESTED`: its ``__version__`` (a source build of torch may
    have no package metadata), else its metadata's, else ``"missing"``."""
    out = {}
    for package in TESTED:
        try:
            out[package] = str(importlib.import_module(package).__version__)
        except (ImportError, AttributeError):
            try:
                out[package] = version(package)
            except PackageNotFoundError:
                out[package] = "missing"
    return out


def _minor(text: str) -> tuple[int, ...] | None:
    try:
        return Version(text).release[:2]
    except ValueError:
        return None


def _in_range(package: str, installed: str) -> bool:
    low, high = (Version(v).release[:2] for v in TESTED[package])
    minor = _minor(installed)
    return minor is not None and low <= minor <= high


def tested_range(package: str) -> str:
    """The tested releases of ``package`` in words: ``torch 2.11 to 2.15`` or ``lightning 2.6``."""
    low, high = TESTED[package]
    return f"{package} {low}.x" if low == high else f"{package} {low} to {high}"


def _tested(package: str) -> str:
    """A pip requirement for the tested range of ``package``."""
    low, high = TESTED[package]
    if low == high:
        return f"{package}=={low}.*"
    major, minor = high.split(".")
    return f"{package}>={low},<{major}.{int(minor) + 1}"


def check_versions(installed: dict[str, str] | None = None) -> list[str]:
    """Raise :class:`UntestedVersionError` when an installed package is not the tested minor release, or warn once
    where ``LIGHTNING_PAR_ALLOW_UNTESTED=1``. Returns the untested packages (empty when all are tested)."""
    installed = installed_versions() if installed is None else installed
    untested = [p for p, v in installed.items() if not _in_range(p, v)]
    if not untested:
        return []
    found = ", ".join(f"{p} {installed[p]}" for p in untested)
    message = (f"lightning-par is tested with {', '.join(tested_range(p) for p in TESTED)} and uses private "
               f"names of them that change between releases; found {found}. Install the tested versions "
               f"(pip install {' '.join(repr(_tested(p)) for p in untested)}), or set {ALLOW_UNTESTED}=1 to try "
               "anyway (a private name that is gone then fails at import, named).")
    if os.environ.get(ALLOW_UNTESTED, "") not in ("", "0"):
        warnings.warn(message, UserWarning, stacklevel=2)
        return untested
    raise UntestedVersionError(message)


#: optional packages lightning-par reads the behaviour of, tested the same way (pyproject's extras declare the range;
#: tests/compat/transformers.sh runs their tests on the oldest and newest release, docs/compat.md has the results):
#: transformers' published plans, its model classes and their forwards. Checked when a model of it is first seen
OPTIONAL_TESTED = {"transformers": ("5.17", "5.25")}


@functools.cache
def check_optional(package: str) -> str | None:
    """Like :func:`check_versions` for one package of :data:`OPTIONAL_TESTED`, once per process: an untested
    release raises :class:`UntestedVersionError` in one line (a warning with ``LIGHTNING_PAR_ALLOW_UNTESTED=1``).
    Returns the installed version (None where it is not installed)."""
    try:
        found = str(importlib.import_module(package).__version__)
    except (ImportError, AttributeError):
        return None
    return check_optional_version(package, found)


def check_optional_version(package: str, found: str) -> str:
    """:func:`check_optional`'s check of the version ``found`` (not cached)."""
    low, high = (Version(v).release[:2] for v in OPTIONAL_TESTED[package])
    minor = _minor(found)
    if minor is not None and low <= minor <= high:
        return found
    first, last = OPTIONAL_TESTED[package]
    major, newest = last.split(".")
    message = (f"lightning-par is tested with {package} {first} to {last} (the plans and forwards of its models "
               f"change between releases); found {package} {found}. Install "
               f"'{package}>={first},<{major}.{int(newest) + 1}', or set {ALLOW_UNTESTED}=1 to try anyway.")
    if os.environ.get(ALLOW_UNTESTED, "") not in ("", "0"):
        warnings.warn(message, UserWarning, stacklevel=2)
        return found
    raise UntestedVersionError(message)


def missing_name_error(package: str, name: str) -> ImportError:
    """The error for a private ``name`` of ``package`` that the installed release does not have."""
    found = installed_versions().get(package, "?")
    return ImportError(f"lightning-par needs {name}, a private name of {package} that {package} {found} does not have "
                       f"(lightning-par is tested with {tested_range(package)}): install {_tested(package)!r}.")


def private(package: str, module: str, attribute: str, fallbacks: tuple[str, ...] = ()) -> Any:
    """``module.attribute`` (``attribute`` may be dotted; ``module`` may be one of ``package``'s public modules when
    only the spelling changed between releases); else the first of ``fallbacks`` (the names older or newer releases of
    the tested range give the same thing, each ``"module:attribute"`` or an attribute of ``module``) that exists; else
    :func:`missing_name_error` naming the first."""
    for candidate in (f"{module}:{attribute}", *fallbacks):
        where, _, name = candidate.rpartition(":") if ":" in candidate else (module, "", candidate)
        try:
            value: Any = importlib.import_module(where)
            for part in name.split("."):
                value = getattr(value, part)
        except (ImportError, AttributeError):
            continue
        return value
    raise missing_name_error(package, f"{module}.{attribute}")


check_versions()

# ----------------------------------------------------------------------------------------------------------------------
# torch
# ----------------------------------------------------------------------------------------------------------------------
# FSDP2's ``replicate`` (DDP on DTensors over a (dp, tp) mesh, data_parallel.py): the public DDP wrapper takes
# neither DTensor parameters nor a 2-D mesh.
replicate = private("torch", "torch.distributed._composable.replicate_with_fsdp", "replicate")
# ZeRO-1/2 flat shards and ZeRO-3 blocks written to / read from DCP (plugins/*checkpoint.py): DTensor cannot express
# a flat, uneven shard of a parameter, and DCP reads any ShardedTensor layout into any other.
Shard = private("torch", "torch.distributed._shard.sharded_tensor", "Shard")
ShardedTensor = private("torch", "torch.distributed._shard.sharded_tensor", "ShardedTensor")
ShardMetadata = private("torch", "torch.distributed._shard.sharded_tensor", "ShardMetadata")
# the CUDA allocator's event history (benchmarks/gpu_check.py: which allocations are alive at a setup peak that
# exceeds its bound); torch has no public spelling of it
cuda_record_memory_history = private("torch", "torch.cuda.memory", "_record_memory_history")
cuda_memory_snapshot = private("torch", "torch.cuda.memory", "_snapshot")
ShardedTensorMetadata = private("torch", "torch.distributed._shard.sharded_tensor.metadata", "ShardedTensorMetadata")
TensorProperties = private("torch", "torch.distributed._shard.sharded_tensor.metadata", "TensorProperties")
# a ShardedTensor built without a process group (zero_state.blocks_tensor): its public constructors need one
make_wrapper_subclass = private("torch", "torch", "Tensor._make_wrapper_subclass")
# puts a value at a DCP path inside a nested state dict (sharded_checkpoint.py); DCP has no public setter
set_element = private("torch", "torch.distributed.checkpoint._traverse", "set_element")
# where a DTensor's local shard lies in the global tensor; DTensor has no public method for it
compute_local_shape_and_global_offset = private("torch", "torch.distributed.tensor._utils",
                                                "compute_local_shape_and_global_offset")
# a packed_colwise parameter (tensor_parallel.py): this rank's slice of each of the N parts of a fused projection
# (q, k, v); DTensor's placement for "split into N parts first, then each part over the mesh" (transformers uses it)
StridedShard = private("torch", "torch.distributed.tensor.placement_types", "_StridedShard")
# the tensor a row-parallel layer returns while its all-reduce runs (measure.py counts the memory inside it)
AsyncCollectiveTensor = private("torch", "torch.distributed._functional_collectives", "AsyncCollectiveTensor")


def _called_late(module: str, attribute: str, fallbacks: tuple[str, ...]) -> Any:
    """A function calling ``module.attribute`` (or the first fallback that exists), looked up on the module at each
    call: code that wraps the module's function (measure.CommCounter) then sees the call."""
    found = private("torch", module, attribute, fallbacks)
    owner = importlib.import_module(module)
    name = next(n for n in (attribute, *fallbacks) if getattr(owner, n, None) is found)

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(owner, name)(*args, **kwargs)

    call.__name__ = name
    return call


# ZeRO-1/2's flat-bucket reduce-scatter and all-gather (parallel/zero.py): public, but torch 2.13 introduced these
# names and deprecated the older ones (a FutureWarning per call), which 2.11 and 2.12 have alone
reduce_scatter_single = _called_late("torch.distributed", "reduce_scatter_single", ("reduce_scatter_tensor",))
all_gather_single = _called_late("torch.distributed", "all_gather_single", ("all_gather_into_tensor",))
# context parallel's ring attention (parallel/context_parallel.py) merges per-chunk attention outputs by their
# log-sum-exp and recomputes each chunk pair's gradient from the merged output and log-sum-exp: only these aten ops
# return the log-sum-exp and take it back (F.scaled_dot_product_attention returns neither). The CPU kernel; CUDA's
# flash (half precision) and memory-efficient (fp32) kernels
sdpa_flash_cpu = private("torch", "torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu.default")
sdpa_flash_cpu_backward = private("torch", "torch",
                                  "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
sdpa_flash_cuda = private("torch", "torch", "ops.aten._scaled_dot_product_flash_attention.default")
sdpa_flash_cuda_backward = private("torch", "torch", "ops.aten._scaled_dot_product_flash_attention_backward.default")
sdpa_efficient_cuda = private("torch", "torch", "ops.aten._scaled_dot_product_efficient_attention.default")
sdpa_efficient_cuda_backward = private("torch", "torch",
                                       "ops.aten._scaled_dot_product_efficient_attention_backward.default")
# a module compiled with ``nn.Module.compile`` runs ``_compiled_call_impl`` (torch's attribute, read by
# ``Module.__call__``; no public accessor), which traces its forward pre-hooks too: ZeRO-1/2's prefetch waits
# (parallel/zero.py) wrap this call instead, so they run eagerly, outside the graph


def compiled_call(module: Any) -> Any:
    """The compiled call ``nn.Module.compile`` installed on ``module``, or None."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: Any, call: Any) -> None:
    module._compiled_call_impl = call


# the process group behind a group name as c10d ops receive it below the dispatcher (tp_accounting.py)
resolve_process_group = private("torch", "torch.distributed.distributed_c10d", "_resolve_process_group")
# dispatch modes see every aten op: deferred init, the planner's trace and the TP accounting are built on them;
# torch has no public dispatch-mode API
TorchDispatchMode = private("torch", "torch.utils._python_dispatch", "TorchDispatchMode")
is_traceable_wrapper_subclass = private("torch", "torch.utils._python_dispatch", "is_traceable_wrapper_subclass")
# context parallel's attention (parallel/context_parallel.py) is a torch function mode entered for the step; a Hugging
# Face attention implementation finds it on the mode stack (torch has no public accessor of the stack)
function_mode_stack = private("torch", "torch.overrides", "_get_current_function_mode_stack")
# shapes without memory for the planner's trace (planner/trace.py); no public fake-tensor API
FakeTensorMode = private("torch", "torch._subclasses.fake_tensor", "FakeTensorMode")
unset_fake_temporarily = private("torch", "torch._subclasses.fake_tensor", "unset_fake_temporarily")
# nested containers of tensors (torch has no public pytree module)
tree_flatten = private("torch", "torch.utils._pytree", "tree_flatten")
tree_leaves = private("torch", "torch.utils._pytree", "tree_leaves")
tree_map = private("torch", "torch.utils._pytree", "tree_map")
# deferred init forces a tensor without re-entering its own __torch_function__, and parses Tensor.to's arguments
# exactly as torch does (deferred_init.py)
DisableTorchFunction = private("torch", "torch._C", "DisableTorchFunction")
parse_to = private("torch", "torch._C._nn", "_parse_to")
# one all-reduce for all gradients of a pipeline stage (pipeline/runtime.py), as DDP's buckets do
flatten_dense_tensors = private("torch", "torch._utils", "_flatten_dense_tensors")
unflatten_dense_tensors = private("torch", "torch._utils", "_unflatten_dense_tensors")
# torch.compile per block (parallel/compile.py): the backend torch.compile builds for a backend name, mode and
# options (no public constructor), and AOTAutograd's buffer-donation switch, which split-backward schedules turn off
# (pytorch issue 161904; there is no public setting)
TorchCompileInductorWrapper = private("torch", "torch", "_TorchCompileInductorWrapper")
TorchCompileWrapper = private("torch", "torch", "_TorchCompileWrapper")
functorch_config = private("torch", "torch._functorch", "config")
# the global gradient norm and its clipping (parallel/grad_norm.py): one kernel per list of same-device, same-dtype
# gradients instead of several per gradient, as torch.nn.utils.clip_grad_norm_ does; torch has no public form
foreach_norm = private("torch", "torch", "_foreach_norm")
foreach_mul_ = private("torch", "torch", "_foreach_mul_")
# expert parallel (parallel/expert_parallel.py): the expert weights, split over ep ranks, left out of DDP (their
# gradients are averaged over their own replicas); DDP's one way to skip parameters is this static method
ddp_ignore_parameters = private("torch", "torch.nn.parallel", "DistributedDataParallel."
                                "_set_params_and_buffers_to_ignore_for_model")
# ... and its token exchange: the differentiable all-to-all with variable splits of the functional collectives (torch
# 2.13 deprecates torch.distributed.nn.functional's in its favour; torchtitan's expert parallel uses it too)
all_to_all_single_autograd = private("torch", "torch.distributed._functional_collectives",
                                     "all_to_all_single_autograd")
# the routers' token counts for the logs (parallel/router.py) leave out a forward recomputed inside the backward
# (activation recompute); autograd tells a backward by its graph task's id (-1 outside one), with no public spelling
current_graph_task_id = private("torch", "torch._C", "_current_graph_task_id")
# every dropout module's base class (parallel/rng.py finds dropout regions by it); torch exports no public base
DropoutNd = private("torch", "torch.nn.modules.dropout", "_DropoutNd")


def dynamo_guard_failures() -> dict:
    """dynamo's record of why each code object recompiled (read only to explain a recompile; imported on first use,
    as importing dynamo at ``import lightning_par`` would cost every run a second). Empty where a release moved it."""
    try:
        from torch._dynamo.utils import guard_failures
    except ImportError:
        return {}
    return guard_failures


_SCHEDULE_LOWERING = "_prepare_schedule_with_comms"


def schedule_order_only(torch_class: type) -> type:
    """``torch_class`` (a pipelining schedule) without the last step of its constructor, which lowers
    ``pipeline_order`` to communication actions for the runtime and takes seconds at large micro-batch counts: the
    planner reads only the compute order. A schedule without that step (a single-stage one) is returned as is."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    if issubclass(torch_class, PipelineScheduleMulti) and not hasattr(torch_class, _SCHEDULE_LOWERING):
        raise missing_name_error("torch", f"{torch_class.__name__}.{_SCHEDULE_LOWERING}")
    return type(torch_class.__name__, (torch_class,), {_SCHEDULE_LOWERING: lambda self, *a, **k: None})


_INIT_P2P = "_get_init_p2p_neighbors_ops"


def without_p2p_to_itself(stage: Any) -> Any:
    """``stage`` (a ``PipelineStage``) whose first-step handshake leaves out its neighbours on its own rank.

    torch 2.11 and 2.12 open every stage's links by sending a token to the previous and next stage; in a V-shaped
    schedule (zbv, dualpipev) two neighbouring stages share a rank, and gloo cannot send to itself ("Pair is not
    connected"). Stages on one rank hand tensors over directly, so that handshake is never needed; torch 2.13 skips
    it itself. A stage without the method (a later release that renamed it) is returned as it is."""
    ops_of = getattr(stage, _INIT_P2P, None)
    if ops_of is not None:
        setattr(stage, _INIT_P2P, lambda: [op for op in ops_of() if op.group_peer != stage.group_rank])
    return stage


_STAGE_INIT = "_initialize_pp_stages"


def metadata_inference_without_anomaly(schedule: Any) -> Any:
    """``schedule`` whose first-step metadata inference runs with autograd's anomaly mode off.

    On its first step torch 2.13's schedule infers each stage's shapes by running the stage (and on the last stage
    the loss, then backward) on tensors made with ``empty_strided``: uninitialised memory, which may hold NaN, so
    under ``Trainer(detect_anomaly=True)`` that backward raises by chance ("LogSoftmaxBackward0 returned nan
    values"). The real micro-batches still run under anomaly mode. A schedule without the method (another release)
    is returned as it is."""
    init = getattr(schedule, _STAGE_INIT, None)
    if init is None:
        return schedule

    def quiet(*args: Any, **kwargs: Any) -> Any:
        from torch.autograd import set_detect_anomaly

        with set_detect_anomaly(False):
            return init(*args, **kwargs)

    setattr(schedule, _STAGE_INIT, quiet)
    return schedule


# ----------------------------------------------------------------------------------------------------------------------
# Lightning
# ----------------------------------------------------------------------------------------------------------------------
# the strategies launch and join processes as Lightning's own DDP strategy does (strategies/engine.py)
_SubprocessScriptLauncher = private("lightning", "lightning.pytorch.strategies.launchers.subprocess_script",
                                    "_SubprocessScriptLauncher")


def quiet_child_process_observer() -> None:
    """Stop Lightning's child-process observer of this process (rank 0 of its subprocess launcher), if one runs.

    The observer polls the ranks it launched every few seconds and SIGKILLs every process, this one included, once one
    exits non-zero; a rank 0 that waits for its ranks to exit after an error they all raise (``shutdown.
    wait_for_launched_ranks``) would be killed mid-wait. Its loop asks ``_run()`` whether it is done: answering yes
    ends it at its next tick. Where a Lightning release names things otherwise, the observer is left as it is."""
    import threading

    try:
        observer = private("lightning", "lightning.fabric.strategies.launchers.subprocess_script",
                           "_ChildProcessObserver")
    except ImportError:
        return
    for thread in threading.enumerate():
        if isinstance(thread, observer) and hasattr(thread, "_run"):
            thread._run = lambda: True  # type: ignore[method-assign]


distributed_is_initialized = private("lightning", "lightning.fabric.utilities.distributed",
                                     "_distributed_is_initialized")
default_process_group_backend = private("lightning", "lightning.fabric.utilities.distributed",
                                        "_get_default_process_group_backend_for_device")
init_dist_connection = private("lightning", "lightning.fabric.utilities.distributed", "_init_dist_connection")
sync_ddp_if_available = private("lightning", "lightning.fabric.utilities.distributed", "_sync_ddp_if_available")
optimizers_to_device = private("lightning", "lightning.fabric.utilities.optimizer", "_optimizers_to_device")
# the data position a checkpoint saves (data_position.py): Lightning's own protocol and loader rebuild
Stateful = private("lightning", "lightning.fabric.utilities.types", "_Stateful")
update_dataloader = private("lightning", "lightning.pytorch.utilities.data", "_update_dataloader")


def _require_attribute(obj: Any, name: str, where: str) -> None:
    if not hasattr(obj, name):
        raise missing_name_error("lightning", f"{where}.{name}")


def set_skip_backward(trainer: Any, skip: bool) -> None:
    """Tell Lightning's loop not to run backward nor zero gradients: a pipeline schedule does both in the step (as
    Lightning's StochasticWeightAveraging does; no public switch exists)."""
    _require_attribute(trainer.fit_loop, "_skip_backward", "Trainer.fit_loop")
    trainer.fit_loop._skip_backward = skip


def uses_distributed_sampler(trainer: Any) -> bool:
    """The Trainer's ``use_distributed_sampler`` argument (the Trainer keeps it on a private connector only)."""
    _require_attribute(trainer, "_accelerator_connector", "Trainer")
    return trainer._accelerator_connector.use_distributed_sampler


def train_step_metrics(trainer: Any) -> list[tuple[str, Any]]:
    """``(key, metric)`` of the tensor values ``self.log(..., on_step=True)`` holds for the current training step,
    each with its ``meta`` and ``_forward_cache`` (what the logger writes at the step): Lightning's result collection,
    private (step.py averages them over accumulated micro-batches)."""
    _require_attribute(trainer, "_results", "Trainer")
    results = trainer._results
    if results is None:
        return []
    return [(key, metric) for key, metric in results.items()
            if getattr(metric, "is_tensor", False) and hasattr(metric, "_forward_cache")
            and getattr(getattr(metric, "meta", None), "on_step", False)]


def step_value(metric: Any) -> Any:
    """What a metric of :func:`train_step_metrics` logs at this step (its private ``_forward_cache``)."""
    return metric._forward_cache


def set_step_value(metric: Any, value: Any) -> None:
    """Make ``value`` what the metric logs at this step (and keeps, for an on_step-only value)."""
    metric._forward_cache = value
    if not metric.meta.on_epoch:
        metric.value = value


def keep_sequential_train_loaders(trainer: Any) -> None:
    """A training DataLoader with a ``SequentialSampler`` (``shuffle=False``) gets Lightning's injected sampler with
    ``shuffle=False``: Lightning's data connector asks for a shuffled one for every training loader
    (``_process_dataloader`` passes ``shuffle=True``), which on one device under ``strategy="auto"`` it never
    injects -- so the same loader would be shuffled under a lightning-par strategy alone (``is_distributed`` is True
    even on one device). Wraps the trainer's ``_data_connector._prepare_dataloader`` once."""
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import SequentialSampler

    _require_attribute(trainer, "_data_connector", "Trainer")
    connector = trainer._data_connector
    _require_attribute(connector, "_prepare_dataloader", "Trainer._data_connector")
    if getattr(connector, "_lightning_par_sequential", False):
        return
    prepare = connector._prepare_dataloader

    def prepared(dataloader: Any, shuffle: bool, mode: Any) -> Any:
        if mode == RunningStage.TRAINING and isinstance(getattr(dataloader, "sampler", None), SequentialSampler):
            shuffle = False
        return prepare(dataloader, shuffle=shuffle, mode=mode)

    connector._prepare_dataloader = prepared
    connector._lightning_par_sequential = True


def set_device_mesh(module: Any, mesh: Any) -> None:
    """Make ``LightningModule.device_mesh`` return ``mesh``, as Lightning's ModelParallelStrategy does (the property
    has no setter)."""
    _require_attribute(module, "_device_mesh", "LightningModule")
    module._device_mesh = mesh


# ----------------------------------------------------------------------------------------------------------------------
# jsonargparse (the CLI, lightning_par/cli.py)
# ----------------------------------------------------------------------------------------------------------------------
# --KEY.help CLASS, the action of a type-hinted option and the value of a --KEY.SUB=VALUE option: the CLI extends
# them so that a registered strategy name takes per-option overrides
ActionHelpClassPath = private("jsonargparse", "jsonargparse._actions", "_ActionHelpClassPath")
ActionTypeHint = private("jsonargparse", "jsonargparse._typehints", "ActionTypeHint")
NestedArg = private("jsonargparse", "jsonargparse._util", "NestedArg")


def logger_version(logger: Any) -> Any:
    """The version a Lightning logger was given, or has chosen already; ``None`` while it has not picked one (it
    takes the next free number when first asked). The loggers keep it in ``_version``, set by their ``version``
    argument."""
    _require_attribute(logger, "_version", type(logger).__name__)
    return logger._version


def set_logger_version(logger: Any, version: Any) -> None:
    """Give a Lightning logger its version after construction (what its ``version`` argument sets)."""
    _require_attribute(logger, "_version", type(logger).__name__)
    logger._version = version
