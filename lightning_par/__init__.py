"""lightning-par: PyTorch Lightning strategies for data, tensor and pipeline parallel training.

Importing the package registers its strategy names with Lightning's ``StrategyRegistry`` so that
``Trainer(strategy="zero0")`` and ``--trainer.strategy=zero0`` work. It also checks the installed torch and Lightning
against the tested versions (:mod:`lightning_par._compat`) and keeps the example models' old name, ``example_models``,
working (:mod:`lightning_par._aliases`).
"""

import warnings

from lightning_par._light_help import light_help

__version__ = "0.1.0"

if not light_help():  # `lightning-par plan --help` / `export --help` print their help without torch and Lightning
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_par import _aliases, _compat  # noqa: F401  (_compat checks the versions on import)
    from lightning_par.parallel.layout import Layout
    from lightning_par.plugins.checkpoint_io import AtomicCheckpointIO
    from lightning_par.plugins.precision import LayoutPrecision
    from lightning_par.plugins.pretrained import FromPretrained
    from lightning_par.strategies import (
        ALL_STRATEGIES,
        ExpertParallelStrategy,
        Hybrid3DStrategy,
        LayoutStrategy,
        MegatronTPStrategy,
        PipelineStrategy,
        PlannedStrategy,
        ZeroStrategy,
    )
    from lightning_par.topology import LayoutError, ParallelDims

    def _register_strategies() -> None:
        for strategy in ALL_STRATEGIES:
            strategy.register_strategies(StrategyRegistry)

    _register_strategies()
    # Lightning 2.6 builds torch's LeafSpec, deprecated since torch 2.13: every rank printed this at the first step,
    # about Lightning's code, with nothing for the user to change (docs/cli.md lists the warnings that remain)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    _aliases.install()

__all__ = [
    "AtomicCheckpointIO",
    "ExpertParallelStrategy",
    "FromPretrained",
    "Hybrid3DStrategy",
    "Layout",
    "LayoutError",
    "LayoutPrecision",
    "LayoutStrategy",
    "PlannedStrategy",
    "MegatronTPStrategy",
    "ParallelDims",
    "PipelineStrategy",
    "ZeroStrategy",
    "__version__",
]
