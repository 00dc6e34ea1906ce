"""The example GPT sharded with FSDP2, for Lightning's own ``ModelParallelStrategy`` (the reference for ZeRO-3).

    lightning-par fit --model=benchmarks.fsdp2_gpt.FSDP2GPT \
        --trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy \
        --trainer.strategy.data_parallel_size=2 --trainer.strategy.tensor_parallel_size=1 --trainer.devices=2
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_par.examples import GPTLightningModule


class FSDP2GPT(GPTLightningModule):
    """``GPTLightningModule`` with one FSDP2 unit per transformer block and the root unit (embedding, final norm,
    head) on ``GPT`` itself, sharded over the ``data_parallel`` dimension of the strategy's mesh."""

    def configure_model(self) -> None:
        super().configure_model()
        if isinstance(self.model, FSDPModule):  # configure_model runs again for validate/test after fit
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def sample_text(self, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8) -> str:
        # The CLI samples on rank 0 alone after fit; a sharded forward there would wait forever for the other
        # ranks' all-gathers.
        return "(not sampled: the model is sharded across ranks)"
