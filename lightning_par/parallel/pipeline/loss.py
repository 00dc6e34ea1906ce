"""A Hugging Face causal LM's own loss, computed on the last pipeline stage one micro-batch at a time.

A LightningModule written the Hugging Face way returns ``self.model(**batch).loss``: the model computes its loss
from ``labels`` with its ``loss_function`` (``ForCausalLMLoss``: the labels shifted left by one, ``-100`` ignored,
the mean over the tokens left). Under a pipeline the logits exist only on the last stage and one micro-batch at a
time, so :class:`ModelLoss` calls the same ``loss_function`` there, per micro-batch, with
``num_items_in_batch`` set so that the micro-batch losses combine to the loss of the whole batch: the sum of the
micro-batch's token losses over the number of counted tokens in the batch, whatever the padding and ``-100`` labels
put in each micro-batch (a mean of micro-batch means would weigh a token of a short micro-batch more).

The pipeline averages its ``m`` micro-batch losses (``loss_fn`` of a LightningModule returns a mean per
micro-batch), so each is returned ``m`` times its share: ``num_items_in_batch = N / m``, and the average of the
``m`` losses is ``sum / N``, as is the gradient once the runtime scales each by ``1 / m``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.parallel.blocks import is_hf_model
from lightning_par.parallel.expert_parallel import expert_layers
from lightning_par.parallel.pipeline.batches import IGNORE_INDEX, next_token_targets
from lightning_par.parallel.router import AUX_LOSS_IN_BACKWARD, layer_balancing_refusal
from lightning_par.topology import LayoutError

#: the Hugging Face loss functions whose token count :class:`ModelLoss` knows (``transformers.loss.loss_utils``)
KNOWN_LOSSES = ("ForCausalLMLoss",)


def counted_tokens(labels: Tensor) -> int:
    """The tokens a causal-LM loss counts in ``labels`` (Hugging Face's convention: aligned with the inputs, shifted
    inside the loss, ``-100`` ignored): the shifted labels that are not ``-100``."""
    return int((next_token_targets(labels) != IGNORE_INDEX).sum())


class ModelLoss:
    """The loss a Hugging Face causal LM computes in its forward when given ``labels``, for a pipeline's last stage.

    Build it with :meth:`of` (None for a model without such a loss); :meth:`for_batch` gives the loss function of
    one batch's micro-batches.
    """

    def __init__(self, loss_function: Callable[..., Tensor], vocab_size: int, name: str) -> None:
        self.loss_function = loss_function
        self.vocab_size = vocab_size
        self.name = name

    @classmethod
    def of(cls, model: nn.Module) -> ModelLoss | None:
        """``model``'s own loss if it is a Hugging Face causal LM whose forward takes ``labels`` and whose
        ``loss_function`` is one whose token count is known here; else None."""
        if not is_hf_model(model):
            return None
        try:
            takes_labels = "labels" in inspect.signature(type(model).forward).parameters
        except (TypeError, ValueError):
            takes_labels = False
        if not takes_labels:
            return None
        # the property warns and falls back to the causal-LM loss for an unknown loss_type: ask only when it is known
        if getattr(model, "loss_type", None) != "ForCausalLM" and "_loss_function" not in vars(model):
            return None
        function = model.loss_function
        name = getattr(function, "__name__", type(function).__name__)
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        if name not in KNOWN_LOSSES or not isinstance(vocab_size, int):
            return None
        return cls(function, vocab_size, f"{type(model).__name__}.loss_function ({name})")

    def for_batch(self, labels: Tensor, n_microbatches: int,
                  num_items_in_batch: Any = None) -> Callable[[Tensor, Tensor], Tensor]:
        """``loss(logits, labels)`` of each of the ``n_microbatches`` micro-batches of a batch with ``labels``:
        ``n_microbatches`` times the micro-batch's share of the batch loss (see the module docstring).
        ``num_items_in_batch``: the count the user passed to the model call (Hugging Face Trainer's), if any."""
        items = counted_tokens(labels) if num_items_in_batch is None else num_items_in_batch
        if isinstance(items, Tensor):
            items = float(items)
        share = items / n_microbatches

        def loss(logits: Tensor, micro_labels: Tensor) -> Tensor:
            return self.loss_function(logits=logits, labels=micro_labels, vocab_size=self.vocab_size,
                                      num_items_in_batch=share)

        return loss


def last_stage_loss(module: nn.Module, model: nn.Module, model_loss: ModelLoss | None,
                    pp: int) -> Callable[[Any, Any], Tensor] | None:
    """The loss a pipeline's last stage computes for ``module`` (a LightningModule holding ``model``): its
    ``loss_fn`` (its step then gets the batch loss from ``compute_loss``), or None -- the model's own
    (``model_loss``), for a step written the Hugging Face way (``self.model(**batch).loss``). Refused, alike on every
    rank and before any collective, when there is neither."""
    name = type(module).__name__
    if callable(getattr(module, "loss_fn", None)):
        if not callable(getattr(module, "compute_loss", None)):
            raise LayoutError(
                f"pipeline parallel (pp={pp}): {name} defines loss_fn() but no compute_loss(batch): "
                "the strategy answers compute_loss with the batch loss after the schedule ran, so the step must "
                "get its loss through it (default: `self.loss_fn(self(inputs), targets)`), as "
                "lightning_par.examples.GPTLightningModule does.")
        # read at each call: a transform applied after the split (context parallel's token mean over the whole
        # sequence) wraps loss_fn on the module
        return lambda outputs, targets: module.loss_fn(outputs, targets)
    if model_loss is None:
        raise LayoutError(
            f"pipeline parallel (pp={pp}) computes the loss on the last stage, inside the schedule, "
            f"so it must know the loss: {name} defines no loss_fn(), and its model {type(model).__name__} is "
            "not a Hugging Face causal LM with a loss of its own. Either train a Hugging Face *ForCausalLM and return "
            "`self.model(**batch).loss` from training_step (labels in the batch); or define "
            "`loss_fn(outputs, targets)` (the loss of one micro-batch) and get the step's loss from "
            "`compute_loss(batch)` (default: `self.loss_fn(self(inputs), targets)`), as "
            "lightning_par.examples.GPTLightningModule does.")
    config = getattr(model, "config", None)
    coefficient = getattr(config, "router_aux_loss_coef", 0) if getattr(config, "output_router_logits", False) else 0
    # the model's `.loss` adds a term of all layers' router logits, which live on different stages: the runtime forms
    # it as the sum of each layer's term on its stage (router.apply_layer_balancing), beside the last stage's
    # language-model loss; a model whose layers' terms cannot be found that way is refused
    if coefficient and (why := layer_balancing_refusal(model)) is not None:
        raise LayoutError(
            f"pipeline parallel (pp={pp}): {type(model).__name__} adds its routers' load-balancing loss to its "
            f"`.loss` (config.output_router_logits=True, router_aux_loss_coef={coefficient}), from the router "
            f"logits of all its layers, which live on different stages, and {why}. Set config.router_aux_loss_coef=0 "
            "(or output_router_logits=False) to train under pp, or train with the load-balancing loss without pp "
            "(tp, ZeRO).")
    return None


def check_layer_losses(model: nn.Module, pp: int) -> None:
    """Refuse expert layers that keep a load-balancing loss for the step to add (``aux_loss_coef > 0``) and cannot
    start its backward from their output (no ``aux_loss_backward``, see :mod:`lightning_par.parallel.router`): under
    a pipeline the schedule backpropagates the last stage's loss alone, so the term would be silently dropped.
    :class:`~lightning_par.examples.moe.MoEFeedForward` can (the runtime gives it one). ``model``: the whole model,
    before the split (the same verdict on every rank)."""
    balanced = [n for n, m in expert_layers(model).items()
                if _positive(getattr(m, "aux_loss_coef", 0)) and not hasattr(m, AUX_LOSS_IN_BACKWARD)]
    if balanced:
        raise LayoutError(
            f"pipeline parallel (pp={pp}): {', '.join(balanced[:3])}{' ...' if len(balanced) > 3 else ''} of "
            f"{type(model).__name__} compute a load-balancing loss (aux_loss_coef > 0) that the step adds to the "
            "loss, but under a pipeline the schedule backpropagates the last stage's loss_fn alone and the layers "
            f"live on different stages. Declare `{AUX_LOSS_IN_BACKWARD} = None` on the layer class and pass the "
            f"output through it (`y = self.{AUX_LOSS_IN_BACKWARD}(y, coef * aux_loss)` when set), as "
            "lightning_par.examples.moe.MoEFeedForward does; or set aux_loss_coef=0 to train under pp.")


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def kept_activations(module: nn.Module, started: Any = ()) -> list[str]:
    """The tensors of the forward's graph that ``module``'s submodules keep as attributes after a forward
    (``"layers.3.mlp.aux_loss"``), less those of layers whose load-balancing loss starts its backward in the layer
    (``started``: their names). Such a tensor is kept for a loss term the step computes later -- a router's auxiliary
    loss, a z-loss, an extra head's output. Under pp it lives on its stage, whose backward the schedule has already
    run from the last stage's loss alone, so the term cannot be trained on: :func:`refuse_kept_activations`.
    None of the 157 causal LMs of transformers 5.25 keeps one (their balancing loss comes from returned logits)."""
    found = []
    for name, sub in module.named_modules():
        if name in started:
            continue
        for attribute, value in vars(sub).items():
            values = value if isinstance(value, list | tuple) else (value,)
            if any(isinstance(v, torch.Tensor) and v.grad_fn is not None for v in values):
                found.append(f"{name}.{attribute}" if name else attribute)
    return found


def refuse_kept_activations(kept: list[str], ranks: list[int], pp: int) -> None:
    """After the first training step, on every pipeline rank alike (``ranks``: the pipeline ranks that found some;
    ``kept``: this rank's own)."""
    if not ranks:
        return
    where = (f"{', '.join(kept[:3])}{' ...' if len(kept) > 3 else ''} (on this rank's stage)" if kept else
             f"modules of the stages of pipeline ranks {ranks}")
    raise LayoutError(
        f"pipeline parallel (pp={pp}): {where} keep a tensor of the forward's graph as a module attribute after the "
        "forward -- a loss term the step adds from it (an auxiliary or load-balancing loss read from the layers) "
        "would be computed on its stage after the schedule already ran that stage's backward from the last stage's "
        "loss alone, so it would not be trained on. Refused at the first step, before any update. Start the term's "
        f"backward in the layer: declare `{AUX_LOSS_IN_BACKWARD} = None` on the layer class and return "
        f"`self.{AUX_LOSS_IN_BACKWARD}(y, coef * aux)` when it is set (lightning_par.examples.moe.MoEFeedForward "
        "does; docs/moe.md); keep a value only logged detached (`.detach()`); or train without pp.")
