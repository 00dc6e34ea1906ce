"""lightning-par's registered strategy names: what each one means as a class and options, and a did-you-mean for a
name Lightning does not know.

Lightning answers an unknown ``strategy="..."`` with a generic error that lists a few of its own names; the CLI asks
:func:`unknown_strategy_message` first (before the Trainer is built), so a mistyped lightning-par name is answered
with the closest registered names and the list of lightning-par's. :func:`strategy_spec` turns one of lightning-par's
names into its class path and options, so the CLI can take per-option overrides after a name
(``--trainer.strategy=pipeline2_zbv --trainer.strategy.n_microbatches=8``).
"""

from __future__ import annotations

import difflib
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.strategies import ALL_STRATEGIES


def registered_names() -> list[str]:
    """The strategy names lightning-par registers with Lightning (``zero0``, ``megatron_tp2``, ...), sorted."""
    return sorted(name for name, entry in StrategyRegistry.items() if entry["strategy"] in ALL_STRATEGIES)


def strategy_spec(name: object) -> dict[str, Any] | None:
    """``{"class_path": ..., "init_args": {...}}`` of one of lightning-par's registered names (``"pipeline2_zbv"``
    -> PipelineStrategy with pp=2, schedule="zbv"); ``None`` for anything else (Lightning's own names included)."""
    if not isinstance(name, str):
        return None
    entry = dict.get(StrategyRegistry, name.lower())  # the registry's own get() builds the strategy
    if not entry or entry["strategy"] not in ALL_STRATEGIES:
        return None
    # the package exports every registered class: a config saved from a name keeps working when a file moves
    return {"class_path": f"lightning_par.{entry['strategy'].__name__}", "init_args": dict(entry["init_params"])}


def unknown_strategy_message(name: object) -> str | None:
    """``None`` if ``name`` is not a string or is a strategy name Lightning accepts (``"auto"``, any registered
    name, compared lower-cased as the Trainer does); else one message with the closest names -- lightning-par's
    first, then Lightning's own -- and lightning-par's names listed."""
    if not isinstance(name, str) or name.lower() == "auto" or name.lower() in StrategyRegistry:
        return None
    ours = registered_names()
    others = sorted(set(StrategyRegistry) - set(ours))
    close = difflib.get_close_matches(name.lower(), ours, n=3, cutoff=0.6) or \
        difflib.get_close_matches(name.lower(), others, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (f"unknown strategy name {name!r}.{hint} lightning-par's names: {', '.join(ours)}; every name takes "
            "options after it (--trainer.strategy=zero --trainer.strategy.stage=2), and a class works too "
            "(--trainer.strategy=lightning_par.ZeroStrategy).")
