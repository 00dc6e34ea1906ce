"""The plans a model declares for a transform -- a tensor-parallel plan (``tp_plan``), an expert-parallel plan
(``ep_plan``) -- found the same way for each kind: on a module itself (a user's module, or a transformers 5 model,
which merges its plans on the instance), or on an older transformers model's config (``base_model_<kind>_plan``,
relative to the base model) and class (``_<kind>_plan``, the head's). Nothing here imports transformers."""

from __future__ import annotations

import re

from torch import nn

from lightning_par._compat import check_optional


def is_hf_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (by what it has: a config, a base-model prefix, ``post_init``). The first
    one seen checks that the installed transformers is a tested release (:func:`~lightning_par._compat.check_optional`:
    its plans and forwards are what the engine reads)."""
    found = hasattr(module, "config") and hasattr(module, "base_model_prefix") and hasattr(module, "post_init")
    if found and type(module).__module__.startswith("transformers."):
        check_optional("transformers")
    return found


def declared_plan(module: nn.Module, kind: str) -> dict[str, str] | None:
    """The ``kind`` plan (``"tp"``, ``"ep"``) ``module`` itself declares, relative to ``module``; None without."""
    plan = getattr(module, f"{kind}_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    if not is_hf_model(module):
        return None
    base = dict(getattr(module.config, f"base_model_{kind}_plan", None) or {})
    prefix = module.base_model_prefix
    if base and prefix and getattr(module, prefix, None) is not None and getattr(module, prefix) is not module:
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    base.update(getattr(type(module), f"_{kind}_plan", None) or {})
    return base or None


def find_plan(module: nn.Module, kind: str) -> tuple[str, nn.Module, dict[str, str]] | None:
    """The first sub-module (pre-order, ``module`` included) that declares a ``kind`` plan: ``(fqn, it, plan)``."""
    for name, sub in module.named_modules():
        plan = declared_plan(sub, kind)
        if plan:
            return name, sub, plan
    return None


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A plan's module pattern as a regex: ``*`` matches one name component (``layers.*.mlp``)."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))
