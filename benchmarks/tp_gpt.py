"""The example GPT tensor-parallel by hand, for Lightning's own ``ModelParallelStrategy`` (the reference for TP).

This is the plan a Lightning user writes inside ``configure_model`` today (torchtitan's Llama plan, adapted to the
example GPT's module names), and the reference ``benchmarks/tensor_parallel.py`` and
``tests/unit/test_tp_accounting.py`` measure lightning-par's TP engine against.

    lightning-par fit --model=benchmarks.tp_gpt.HandTPGPT \
        --trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy \
        --trainer.strategy.data_parallel_size=1 --trainer.strategy.tensor_parallel_size=2 --trainer.devices=2
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from lightning_par.examples import GPTLightningModule


def block_plan(sequence_parallel: bool = False, prefix: str = "") -> dict[str, ParallelStyle]:
    """Megatron TP for one ``lightning_par.examples.gpt.Block``: q/k/v, gate/up column-parallel, o/down row-parallel.

    ``PrepareModuleInput`` on attention and MLP makes their input one DTensor shared by the column-parallel
    linears, so their input gradients are summed locally and reduced once per sub-layer (Megatron's "f").
    With sequence parallelism the norms run on sequence shards, that input is all-gathered and the row-parallel
    outputs are reduce-scattered back to shards.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        plan[f"{prefix}attn_norm"] = SequenceParallel()
        plan[f"{prefix}mlp_norm"] = SequenceParallel()
    for sub, column, row in (("attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
                             ("mlp", ("gate_proj", "up_proj"), "down_proj")):
        # attention also takes the block's position ids (None but under context parallel): no layout
        extra = (None,) if sub == "attn" else ()
        plan[f"{prefix}{sub}"] = PrepareModuleInput(input_layouts=(seq, *extra),
                                                    desired_input_layouts=(Replicate(), *extra))
        for name in column:
            plan[f"{prefix}{sub}.{name}"] = ColwiseParallel()
        plan[f"{prefix}{sub}.{row}"] = RowwiseParallel(output_layouts=seq)
    return plan


def gpt_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The whole GPT as ``GPT.tp_plan`` declares it: vocabulary-parallel embedding, every block as
    :func:`block_plan`, a vocabulary-parallel head whose logits stay ``Shard(-1)`` for ``loss_parallel``."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)}
    plan.update(block_plan(sequence_parallel, prefix="layers.*."))
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    plan["head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    return plan


def apply_hand_plan(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                    block: bool = False) -> nn.Module:
    """``parallelize_module`` with :func:`gpt_plan` (or :func:`block_plan` for a lone block)."""
    plan = block_plan(sequence_parallel) if block else gpt_plan(sequence_parallel)
    return parallelize_module(model, tp_mesh, plan)


class HandTPGPT(GPTLightningModule):
    """``GPTLightningModule`` made tensor-parallel by hand in ``configure_model`` over the strategy's
    ``tensor_parallel`` mesh dimension (no sequence parallelism). The cross-entropy runs on the vocabulary shards
    under ``loss_parallel``, which must cover the loss's backward as well: hence the ``backward`` override."""

    def configure_model(self) -> None:
        super().configure_model()
        if isinstance(self.model.layers["0"].attn.q_proj.weight, DTensor):  # runs again for validate/test
            return
        apply_hand_plan(self.model, self.device_mesh["tensor_parallel"])

    def compute_loss(self, batch):
        with loss_parallel():
            return super().compute_loss(batch)

    def backward(self, loss, *args, **kwargs) -> None:
        with loss_parallel():
            super().backward(loss, *args, **kwargs)

    def sample_text(self, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8) -> str:
        # The CLI samples on rank 0 alone after fit; a sharded forward there would wait for the other ranks.
        return "(not sampled: the model is split across ranks)"


class GPTNoSample(GPTLightningModule):
    """``GPTLightningModule`` unchanged, for lightning-par's own strategies in the benchmark, minus the CLI's
    post-fit sample: 240 tokens generated through tensor-parallel forwards add half a minute to each launch."""

    def sample_text(self, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8) -> str:
        return "(not sampled in the benchmark)"
