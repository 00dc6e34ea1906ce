"""Owners own checkpoint state: the data-parallel owner answers what a rank saves and what a load fills, and its
refresh after a load runs for every layout. In one process (no launch).

ZeRO-1/2 under bf16-mixed is the case where the refresh matters: the optimizer's shards are fp32 master weights apart
from the bf16 buckets the model computes with. A load must fill the masters with the saved fp32 values exactly and
then gather them into the buckets; refreshing the other way round (masters taken from the buckets, what
``ZeroSync.after_load`` did when called) rounds the masters to bf16, and skipping the gather leaves the model
computing with the weights it had before the load.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_par import ZeroStrategy
from lightning_par.examples import GPTLightningModule
from lightning_par.parallel.param_states import PARAM_STATES
from lightning_par.parallel.zero_state import ZeroStates
from tests.harness import close_process_group

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _process_group_closed():
    """An in-process Trainer keeps its process group until the interpreter exits: end it after each test here, so
    later tests of the session can start their own (``trying to initialize the default process group twice``)."""
    yield
    if torch.distributed.is_initialized():
        close_process_group()


def _loader() -> DataLoader:
    tokens = torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(0))
    return DataLoader([(row[:-1], row[1:]) for row in tokens], batch_size=4)


def _trainer(stage: int, steps: int, seed: int) -> tuple[pl.Trainer, GPTLightningModule]:
    pl.seed_everything(seed)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage), precision="bf16-mixed",
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    return trainer, GPTLightningModule(preset="tiny", n_layers=1, vocab_size=256, lr=1e-2, warmup_steps=1)


def _masters(trainer: pl.Trainer) -> list[torch.Tensor]:
    return [bucket.shard.to_local().detach().clone() for bucket in trainer.strategy.gradient_sync.partitioner.buckets]


@pytest.mark.parametrize("source", ["zero2", "one_file"])
def test_a_zero2_bf16_resume_restores_the_fp32_masters_and_gathers_them_into_the_buckets(tmp_path, source):
    """Saved after 3 AdamW steps -- by ZeRO-2 (a DCP directory of its fp32 masters) or by ZeRO-0 (one file of fp32
    weights) -- and restored into a ZeRO-2 bf16-mixed fit that has reached max_steps: the masters equal the saved
    fp32 values bit for bit (not their bf16 rounding), and so do the module's parameters once fit ends (fp32 again),
    Adam's moments the saved."""
    first, model = _trainer(2 if source == "zero2" else 0, 3, seed=1)
    first.fit(model, _loader())
    path = tmp_path / "step3.ckpt"
    first.save_checkpoint(path)
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}  # ZeRO-0: fp32 weights
    if source == "zero2":
        assert isinstance(first.strategy.gradient_sync.states, ZeroStates)
        masters = _masters(first)
        assert any(not torch.equal(m, m.to(BF16).float()) for m in masters)  # fp32 values bf16 cannot hold
    else:
        assert first.strategy.gradient_sync.states is PARAM_STATES
        assert path.is_file() and any(not torch.equal(v, v.to(BF16).float()) for v in saved.values())

    second, resumed = _trainer(2, 3, seed=2)  # other initial weights: everything must come from the checkpoint
    second.fit(resumed, _loader(), ckpt_path=path)  # restores, then stops: max_steps reached
    assert second.global_step == 3
    partitioner = second.strategy.gradient_sync.partitioner
    assert isinstance(second.strategy.gradient_sync.states, ZeroStates)
    names = {id(p): name for name, p in resumed.named_parameters()}
    for bucket in partitioner.buckets:
        master = bucket.shard.to_local()
        # after fit the buckets are the module's fp32 parameters again, holding the masters (restore_parameters)
        assert master.dtype == torch.float32 and bucket.flat.dtype == torch.float32
        assert torch.equal(bucket.flat, master)  # the loaded masters gathered, unrounded
        if source == "one_file":
            for index, param in enumerate(bucket.params):
                begin, end = bucket.region(index)
                want = saved[names[id(param)]].reshape(-1)
                assert torch.equal(master[begin:end], want), names[id(param)]  # the file's fp32 values, exact
    if source == "zero2":  # the saved masters, exact
        for got, want in zip(_masters(second), masters, strict=True):
            assert torch.equal(got, want)
        before, after = first.strategy.optimizers[0], second.strategy.optimizers[0]
        for group_before, group_after in zip(before.param_groups, after.param_groups, strict=True):
            for shard_before, shard_after in zip(group_before["params"], group_after["params"], strict=True):
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(after.state[shard_after][key].to_local(),
                                       before.state[shard_before][key].to_local())


def test_one_file_into_zero1_over_tensor_parallel_dtensors(request, tmp_path):
    """A one-process file loaded where ZeRO-1 buckets hold DTensor (tensor-parallel) parameters: the shards take the
    file's values, and the gather puts them in the model (torch turns the full values it loads into DTensors in
    place; the shards are filled from the file's own tensors)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lightning_par.parallel.zero import ZeroPartitioner
    from lightning_par.plugins import sharded_checkpoint

    request.getfixturevalue("one_process_group")
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    saved = nn.Linear(8, 8).state_dict()
    path = tmp_path / "one.ckpt"
    torch.save({"state_dict": saved, "global_step": 3}, path)
    torch.manual_seed(1)
    layer = nn.Linear(8, 8)
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh["tp"], [Shard(0)]))
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    partitioner = ZeroPartitioner(layer, [optimizer], mesh["dp"], 1)
    with pytest.warns(UserWarning, match="no checksum"):
        meta = sharded_checkpoint.load(path, layer, [optimizer], states=ZeroStates(partitioner))
    assert meta["global_step"] == 3
    assert isinstance(layer.weight, DTensor)
    assert torch.equal(layer.weight.full_tensor(), saved["weight"]) and torch.equal(layer.bias, saved["bias"])
    for bucket in partitioner.buckets:
        assert torch.equal(bucket.shard.to_local(), bucket.own(bucket.flat))
