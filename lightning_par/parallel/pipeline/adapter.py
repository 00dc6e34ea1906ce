"""How a pipeline stage calls the model it is a piece of, for any model: ours, a Hugging Face one, a plain one.

Every stage module is the whole model with the other stages' units removed (:mod:`.split`), so a stage runs the
model's own ``forward``. What differs between stages is only what goes in and what comes out:

* the **first stage** gets the model's input (token ids); every **later stage** gets the hidden states the stage
  before it produced;
* every stage returns **one tensor** (the schedule sends it on, or the last stage's loss takes it).

Three kinds of model:

* **Hugging Face** (a ``PreTrainedModel`` with ``config.base_model_pp_plan``): both ends are read from its own
  plans, with nothing per architecture. The first entry of the base plan (``embed_tokens: (["input_ids"],
  ["inputs_embeds"])``) names the keyword of the first stage's input and the keyword that takes hidden states
  instead (the forward does ``if inputs_embeds is None: inputs_embeds = self.embed_tokens(input_ids)``); the head's
  ``_pp_plan`` (``lm_head: (["hidden_states"], ["logits"])``) names the output field. A stage whose ``lm_head`` was
  removed returns its hidden states in ``.logits``.
* **A model declaring** ``pipeline_units()`` (``lightning_par.examples.GPT``): called positionally; its forward
  skips the units set to ``None``.
* **Any other model** (blocks found in an ``nn.ModuleList``): a later stage runs the forward on the model's own
  input, the units before the stage's returning zeros of their output shapes (:class:`~.split.RemovedUnit`,
  ``"shape"``), and the received activation is injected as the input of the stage's first unit (a forward pre-hook
  for the length of the call). So the forward may combine its leading units as it likes
  (``tok_emb(ids) + pos_emb(positions)``, scaling, dropout): what they produce on a later stage is discarded. The
  units after the stage pass their input through (the stage returns its hidden states).

This is written here rather than taken from ``torch.distributed.pipelining``: its tracing frontend (``pipeline()``
with ``torch.export``) cannot trace Hugging Face forwards (data-dependent masks, caches, ``ModelOutput``), and its
manual ``PipelineStage`` expects a module that already maps one stage's input tensors to its output tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lightning_par.parallel.blocks import is_hf_model
from lightning_par.parallel.pipeline.split import feeds_by_injection
from lightning_par.topology import LayoutError


@dataclass(frozen=True)
class StageIO:
    """How to call a model's forward on one stage, and how to read its output.

    Attributes:
        input_key: keyword of the model input on the first stage (``"input_ids"``), or None: positional.
        hidden_key: keyword that takes hidden states on a later stage (``"inputs_embeds"``), or None: positional.
        output_key: field of the model's output that holds the stage output (``"logits"``), or None: the output
            itself, or its first element when it is a tuple / ``ModelOutput``.
        takes_mask: whether the forward takes an ``attention_mask`` keyword.
        constant: keywords passed on every call (``use_cache=False``: a pipeline stage keeps no cache).
        inject: a later stage runs the forward on the model's input (``model_inputs=``) and gets the received
            activation injected into its first unit (models that neither declare units nor have a Hugging Face
            plan).
    """

    input_key: str | None = None
    hidden_key: str | None = None
    output_key: str | None = None
    takes_mask: bool = False
    constant: dict[str, Any] = field(default_factory=dict)
    inject: bool = False


def _parameters(module: nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return {}


def stage_io(model: nn.Module) -> StageIO:
    """The :class:`StageIO` of ``model``: from its Hugging Face pipeline plans, or positional for other models."""
    params = _parameters(model)
    takes_mask = "attention_mask" in params
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) if is_hf_model(model) else None
    if not plan:
        return StageIO(takes_mask=takes_mask, inject=feeds_by_injection(model))
    first_inputs, first_outputs = next(iter(plan.values()))
    input_key, hidden_key = first_inputs[0], first_outputs[0]
    for key in (input_key, hidden_key):
        if key not in params:
            raise LayoutError(
                f"{type(model).__name__}'s base_model_pp_plan starts with {next(iter(plan))!r}: {first_inputs} -> "
                f"{first_outputs}, but its forward takes no `{key}` keyword, so a stage after the first cannot be "
                "fed the hidden states of the one before it."
            )
    # the head's plan names the output; a base model without a head returns its hidden states first
    head_plan = {k: v for k, v in (getattr(model, "_pp_plan", None) or {}).items() if "." not in k}
    output_key = next(iter(head_plan.values()))[1][0] if head_plan else None
    constant = {"use_cache": False} if "use_cache" in params else {}
    return StageIO(input_key, hidden_key, output_key, takes_mask, constant)


def first_tensor(output: Any, key: str | None = None) -> Tensor:
    """The tensor a stage passes on: ``output[key]`` (a ``ModelOutput`` field), or ``output`` itself, or its first
    element (a tuple, or a ``ModelOutput`` without ``key``)."""
    if isinstance(output, Tensor):
        return output
    if key is not None:
        value = output.get(key) if isinstance(output, Mapping) else getattr(output, key, None)
        if isinstance(value, Tensor):
            return value
    if isinstance(output, Mapping):  # a ModelOutput: its fields that are set, in order
        output = tuple(v for v in output.values() if v is not None)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise LayoutError(f"a pipeline stage must produce a tensor to pass on, but the model returned "
                      f"{type(output).__name__}; return the logits (or hidden states) as a tensor, or as the first "
                      "element of a tuple.")


class _Injection:
    """A forward pre-hook replacing a unit's first input by ``x``, on its first call only."""

    def __init__(self, x: Tensor) -> None:
        self.x, self.fired = x, False

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.fired:
            return None
        self.fired = True
        if args:
            return (self.x, *args[1:]), kwargs
        name = next(n for n in _parameters(module) if n != "self")
        return args, {**kwargs, name: self.x}


class _Exit:
    """A forward hook keeping the first tensor a stage's last unit returns (on its first call of a forward)."""

    def __init__(self) -> None:
        self.output: Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.output is None:
            self.output = first_tensor(output)


def stage_forward(module: nn.Module, io: StageIO, first: bool, entry: nn.Module | None = None,
                  last_unit: nn.Module | None = None) -> Callable[..., Tensor]:
    """``forward(x, attention_mask=None, model_inputs=None) -> Tensor`` for one stage's module, installed as its
    instance ``forward``. ``entry`` is the stage's first unit, into which a later stage of an ``inject`` model puts
    ``x`` while the forward runs on ``model_inputs`` (the model's own input for this micro-batch). ``last_unit``: the
    last unit of a stage before the last, whose output the stage passes on -- not the model's output, which is
    computed after the removed later units (a logit scale or soft-cap after the head is the last stage's, run by
    the model's own forward there; :func:`~.chain.check_chain` accepts what derives from the last unit alone).

    The stage module keeps the model's class and parameter names (a wrapper module would prefix them); this
    function calls the class's own forward with the stage's input under the right keyword.
    """
    model_forward = type(module).forward
    key = io.input_key if first else io.hidden_key
    inject = io.inject and not first
    if inject and entry is None:
        raise ValueError("a later stage of a model fed by injection needs its first unit (entry=)")

    def forward(x: Tensor, attention_mask: Tensor | None = None, model_inputs: Tensor | None = None,
                **model_kwargs: Any) -> Tensor:
        # model_kwargs: what a forward pre-hook adds for the model (context parallel's global position_ids)
        kwargs = {**io.constant, **model_kwargs}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        kept = _Exit() if last_unit is not None else None
        exit_handle = last_unit.register_forward_hook(kept) if last_unit is not None else None
        try:
            output = _run(x, model_inputs, kwargs)
        finally:
            if exit_handle is not None:
                exit_handle.remove()
        if kept is not None:
            if kept.output is None:
                raise LayoutError(f"the forward of {type(module).__name__} did not call "
                                  f"{type(last_unit).__name__}, the last unit of this pipeline stage, so the stage "
                                  "had nothing to pass on.")
            y = kept.output
        else:
            y = first_tensor(output, io.output_key)
        # A removed head passes a view of the hidden states through (Hugging Face slices them for `logits_to_keep`);
        # torch's split backward (zero-bubble schedules) detaches stage outputs in place, which a view refuses.
        return y.clone() if y._base is not None else y

    def _run(x: Tensor, model_inputs: Tensor | None, kwargs: dict[str, Any]) -> Any:
        if inject:
            if model_inputs is None:
                raise LayoutError(f"a later pipeline stage of {type(module).__name__} runs the model's forward on "
                                  "the model's own input: pass it as model_inputs=")
            injection = _Injection(x)
            handle = entry.register_forward_pre_hook(injection, with_kwargs=True)
            try:
                output = model_forward(module, model_inputs, **kwargs)
            finally:
                handle.remove()
            if not injection.fired:
                raise LayoutError(f"the forward of {type(module).__name__} did not call {type(entry).__name__}, the "
                                  "first unit of this pipeline stage, so the stage's input went nowhere.")
            return output
        if key is None:
            return model_forward(module, x, **kwargs)
        return model_forward(module, **{key: x}, **kwargs)

    return forward


class PipelineOutput(dict):
    """The pipeline's output when it is called the way a Hugging Face model is (``model(input_ids=...)``): a dict
    that also reads as attributes and by position, like a ``ModelOutput`` (``out.logits``, ``out[0]``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            why = (" (given labels, the pipeline computes the loss on the last stage and gathers no logits; call the "
                   "model without labels for them)" if "loss" in self else "")
            raise AttributeError(f"{name!r}: this pipeline output holds only {list(self)}{why}") from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return tuple(self.values())[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple:
        return tuple(self.values())
