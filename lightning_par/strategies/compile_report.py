"""The fit's ``torch.compile`` summary, for a layout that compiles its blocks (``compile=``,
:mod:`lightning_par.parallel.compile`): a callback the strategy adds to every fit that compiles."""

from __future__ import annotations

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


class CompileReport(Callback):
    """At the end of a fit: rank 0's graphs by block, the most graphs, recompiles and backend seconds of any rank (a
    warning if any recompiled, or if no block compiled), and those three as ``compile/*`` scalars in the loggers.

    It reads the counts of the strategy's ``compiler`` (a :class:`~lightning_par.parallel.compile.BlockCompiler`,
    made at setup); without one it does nothing."""

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        compiler = getattr(trainer.strategy, "compiler", None)
        if compiler is None:
            return
        summary = compiler.summary(pl_module)
        world_size = trainer.world_size
        counts = [(summary.graphs, summary.recompiles, summary.seconds)] * world_size
        if world_size > 1:
            dist.all_gather_object(counts, counts[0])
        graphs, recompiles, seconds = (max(c[i] for c in counts) for i in range(3))
        rank_zero_info(f"torch.compile: rank 0: {summary.describe()}; most on any rank: {graphs} graphs, "
                       f"{recompiles} recompiles, {seconds:.1f} s")
        if graphs == 0:
            rank_zero_warn("torch.compile: no block compiled a graph on any rank; the blocks ran eagerly (a graph "
                           "break before any tensor operation, or a forward replaced by something dynamo skips).")
        if recompiles:
            rank_zero_warn(f"torch.compile: a rank compiled {recompiles} block graph(s) again for inputs compiled "
                           f"before (guards failed){': ' + summary.reasons[-1] if summary.reasons else ''}. Set "
                           "TORCH_LOGS=recompiles to see why; see docs/compile.md.")
        for logger in trainer.loggers:
            logger.log_metrics({"compile/graphs": float(graphs), "compile/recompiles": float(recompiles),
                                "compile/backend_seconds": seconds}, step=trainer.global_step)
