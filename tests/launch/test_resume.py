"""Exact resume anywhere in an epoch, into any layout.

The training sampler (lightning_par/run/data_order.py) orders each epoch's samples by (seed, epoch, dataset
length) only, and its position -- (epoch, samples consumed, seed) -- is saved with the training loader's state in the
checkpoint (lightning_par/run/data_position.py). A fit resumed from a checkpoint saved mid-epoch (every 5 steps
of a 12-step epoch) must log, with plain SGD, the losses of the uninterrupted run: a replayed or skipped batch would
show at once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from lightning_par.run import data_position
from lightning_par.run.data_order import DataParallelSampler
from lightning_par.run.data_position import resumable_train_loader
from tests.harness import Run, launch_matrix, max_rel_diff
from tests.launch.resume_worker import MAX_STEPS, SAVE_EVERY

LOSS_RTOL = 1e-6


# -- the sampler ---------------------------------------------------------------------------------------------------
def _global_batches(n: int, world: int, batch: int, epoch: int, consumed: int = 0, seed: int = 3) -> list[list[int]]:
    """Each global batch's samples (sorted), as ``world`` ranks with per-rank ``batch`` draw them."""
    per_rank = []
    for rank in range(world):
        sampler = DataParallelSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        assert len(sampler) == -(-n // world)  # a whole epoch's share, also when resumed part-way
        if consumed:
            sampler.resume(epoch, consumed)
        sampler.set_epoch(epoch)
        indices = list(sampler)
        per_rank.append([indices[i:i + batch] for i in range(0, len(indices), batch)])
    return [sorted(sum(batches, [])) for batches in zip(*per_rank, strict=True)]


def test_the_global_order_does_not_depend_on_the_layout():
    """96 samples in global batches of 8: 1, 2, 4 and 8 data-parallel ranks draw the same global batches, another
    epoch a different order; the split is DistributedSampler's (a run that had Lightning's sampler goes on alike)."""
    one = _global_batches(96, 1, 8, epoch=0)
    for world in (2, 4, 8):
        assert _global_batches(96, world, 8 // world, epoch=0) == one
    assert _global_batches(96, 1, 8, epoch=1) != one
    for rank in range(2):
        ours, torchs = (cls(range(96), num_replicas=2, rank=rank, shuffle=True, seed=3)
                        for cls in (DataParallelSampler, DistributedSampler))
        assert list(ours) == list(torchs)


def test_a_resumed_epoch_skips_exactly_what_was_consumed():
    """Resumed 40 samples (5 global batches) into epoch 1, under another layout: the remaining 7 global batches of
    the uninterrupted epoch, then epoch 2 from its start."""
    full = _global_batches(96, 1, 8, epoch=1)
    assert _global_batches(96, 2, 4, epoch=1, consumed=40) == full[5:]
    sampler = DataParallelSampler(range(96), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.resume(1, 40)
    sampler.set_epoch(1)
    assert len(list(sampler)) == 28 and len(sampler) == 48
    sampler.set_epoch(2)  # the next epoch starts at its beginning
    assert len(list(sampler)) == 48
    # an epoch a trainer numbers differently (Lightning after a max_steps stop): later epochs keep the distance
    sampler.resume(1, 40)
    sampler.set_epoch(2)
    assert sampler.epoch == 1 and len(list(sampler)) == 28
    sampler.set_epoch(3)
    assert sampler.epoch == 2
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        sampler.resume(1, 41)


# -- which training loaders get a position, and the one warning for those that cannot ------------------------------
class _Trainer:  # what the position reads (unused before a save)
    pass


class _OwnSampler(RandomSampler):
    pass


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


class _StatefulLoader(DataLoader):  # as torchdata's StatefulDataLoader: Lightning saves its state itself
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_plain_loaders_get_a_resumable_sampler_and_others_one_warning(monkeypatch):
    monkeypatch.setattr(data_position, "_warnings", data_position.WarningCache())
    dataset = list(range(48))
    injected = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, 2, 1, shuffle=True, seed=5))
    loader = resumable_train_loader(injected, _Trainer())
    assert isinstance(loader.sampler, DataParallelSampler) and loader.batch_size == 4
    assert (loader.sampler.num_replicas, loader.sampler.rank, loader.sampler.seed) == (2, 1, 5)
    assert callable(loader.state_dict) and callable(loader.load_state_dict)
    stateful = _StatefulLoader(dataset, batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resumable_train_loader(stateful, _Trainer()) is stateful  # left alone, its sampler too, no warning
    own = DataLoader(dataset, batch_size=4, sampler=_OwnSampler(dataset))
    with pytest.warns(UserWarning, match="will replay that epoch") as record:
        for _ in range(3):  # e.g. reload_dataloaders_every_n_epochs: still one warning
            assert resumable_train_loader(own, _Trainer()) is own
    assert len(record) == 1 and "has its own sampler (_OwnSampler)" in str(record[0].message)
    wrapped = DataLoader(dataset, batch_size=4, sampler=DistributedSamplerWrapper(_OwnSampler(dataset), 2, 0))
    with pytest.warns(UserWarning, match=r"\(_OwnSampler, in Lightning's DistributedSamplerWrapper\)"):
        resumable_train_loader(wrapped, _Trainer())  # what Lightning makes of a user's sampler under a strategy
    with pytest.warns(UserWarning, match="IterableDataset"):
        resumable_train_loader(DataLoader(_Stream(), batch_size=2), _Trainer())


# -- every place Lightning saves from: the samples trained after a resume are the uninterrupted run's ---------------
def _bar_shows(bar):
    """``(description, n, total)`` of Lightning's training bar: rich (the default where rich is installed) or tqdm."""
    if hasattr(bar, "train_progress_bar_id"):
        task = bar.progress.tasks[bar.train_progress_bar_id]
        return task.description.split(":")[0], int(task.completed), int(task.total)
    return bar.train_progress_bar.desc.split(":")[0], bar.train_progress_bar.n, bar.train_progress_bar.total


def _fit_ids(tmp_path, ckpt=None, save_after=None, **trainer_args):
    """A linear model over 48 numbered samples (12 batches of 4, shuffled); returns, for each trained batch, its
    sample numbers and what the run shows there: ``(epoch, batch index, bar description, bar n, bar total)`` (the
    bar as Lightning's tqdm bar stands after the batch)."""
    import lightning.pytorch as pl

    class Ids(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)
            self.seen, self.shown = [], []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch[0].flatten().long().tolist())
            return (self.lin(batch[0]) ** 2).mean()

        def on_train_batch_end(self, outputs, batch, batch_idx):  # after the bar's own update (callbacks first)
            self.shown.append((self.current_epoch, batch_idx, *_bar_shows(self.trainer.progress_bar_callback)))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=True,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path, **trainer_args)
    dataset = torch.utils.data.TensorDataset(torch.arange(48.0).view(-1, 1))
    loader = resumable_train_loader(DataLoader(dataset, batch_size=4, sampler=DataParallelSampler(dataset, seed=7)),
                                    trainer)
    model = Ids()
    trainer.fit(model, loader, ckpt_path=ckpt)
    if save_after:
        trainer.save_checkpoint(save_after)
    return model.seen, model.shown


@pytest.mark.parametrize("stop", [5, 12])
def test_a_checkpoint_saved_after_fit_or_at_an_epoch_end_resumes_exactly(tmp_path, stop):
    """Lightning resumes a fit that max_steps stopped mid-epoch (step 5), and one saved at an epoch's end (step 12)
    inside the ended epoch (where it would train one batch more): the samples trained after the resume are the
    uninterrupted run's, in the same epochs' orders, and so are the epoch number, the batch index and the progress
    bar ("Epoch 0/-2": rich writes max_epochs - 1, -1 under max_steps; n of the epoch's total). The checkpoint
    that the max_steps stop leaves is named and numbered with the epoch it stopped in (Lightning alone numbers it 1,
    and the resumed run's epochs 1 and 2)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

    full, full_shown = _fit_ids(tmp_path / "full", max_steps=30, enable_checkpointing=True,
                                callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)])  # 12, 24
    assert [s[:2] for s in full_shown] == [(i // 12, i % 12) for i in range(30)]
    assert full_shown[4] == (0, 4, "Epoch 0/-2", 5, 12) and full_shown[29] == (2, 5, "Epoch 2/-2", 6, 6)
    after = tmp_path / "after.ckpt"
    if stop == 5:
        first = tmp_path / "first"
        _fit_ids(first, max_steps=5, save_after=after,
                 callbacks=[ModelCheckpoint(dirpath=first / "ckpt", save_on_train_epoch_end=True)])
        assert [p.name for p in (first / "ckpt").glob("*.ckpt")] == ["epoch=0-step=5.ckpt"]
        assert torch.load(after, weights_only=False)["epoch"] == 0
        # resumed to max_steps=10: the bar's total is the uninterrupted run's min(12 batches, 10 steps), not the
        # 5 steps left (Lightning alone shows "10/5")
        _, short_shown = _fit_ids(tmp_path / "short", ckpt=after, max_steps=10, enable_checkpointing=False)
        assert short_shown == [(0, i, "Epoch 0/-2", i + 1, 10) for i in range(5, 10)]
        _, tqdm_shown = _fit_ids(tmp_path / "tqdm", ckpt=after, max_steps=10, enable_checkpointing=False,
                                 callbacks=[TQDMProgressBar()])  # Lightning's bar where rich is not installed
        assert tqdm_shown == [(0, i, "Epoch 0", i + 1, 10) for i in range(5, 10)]
    else:
        (after,) = (tmp_path / "ckpt").glob("*step=12.ckpt")
    resumed, resumed_shown = _fit_ids(tmp_path / "resumed", ckpt=after, max_steps=30, enable_checkpointing=False)
    assert resumed == full[stop:]
    assert resumed_shown == full_shown[stop:]

# -- one process, Lightning's own strategy: TextDataModule keeps its position ---------------------------------------
def _fit_text(root, cache, ckpt=None, accumulate=1):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_par.data import TextDataModule
    from lightning_par.examples import GPTLightningModule

    class Losses(pl.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    pl.seed_everything(1234)
    losses = Losses()
    keep = [] if ckpt else [ModelCheckpoint(dirpath=root, every_n_train_steps=SAVE_EVERY, save_top_k=-1)]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=MAX_STEPS, limit_train_batches=12 * accumulate,
                         accumulate_grad_batches=accumulate, limit_val_batches=0, logger=False,
                         enable_checkpointing=bool(keep), enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[losses, *keep])
    model = GPTLightningModule(preset="tiny", n_layers=2, optimizer="sgd", lr=0.2)
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=True, batch_size=8, cache_dir=str(cache))
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    return losses.losses, trainer


@pytest.mark.parametrize("accumulate", [1, 2])
def test_text_data_module_resumes_mid_epoch_in_one_process(tmp_path, cache_dir, accumulate):
    """Lightning's single-device strategy, TextDataModule shuffled, a checkpoint every 5 optimizer steps of a 12-step
    epoch (with gradient accumulation, every 10 batches of 24): resumed from step 5, the 13 remaining steps (into the
    second epoch) log the uninterrupted losses."""
    full, _ = _fit_text(tmp_path / "ckpt", cache_dir, accumulate=accumulate)
    (step5,) = (tmp_path / "ckpt").glob(f"*step={SAVE_EVERY}.ckpt")
    resumed, trainer = _fit_text(tmp_path / "unused", cache_dir, ckpt=str(step5), accumulate=accumulate)
    assert trainer.global_step == MAX_STEPS
    done = SAVE_EVERY * accumulate
    diff = max_rel_diff(resumed, full[done:])
    print(f"one process, accumulate={accumulate}: batches {done}-{len(full) - 1} within {diff:.2e}")
    assert len(full) == MAX_STEPS * accumulate and diff <= LOSS_RTOL


# -- launched: ZeRO-1 dp2 with a user's shuffled DataLoader; pp2 (dp=1) resumed under ZeRO-2 dp2 (2 ranks); tp2 x pp2,
#    and tp2 x pp2 resumed under ZeRO-2 dp2 (4 ranks): about 40 s for the whole file on 2 cores ---------------------
@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory, cache_dir):
    """``get(case)``: the Run of a case of tests/launch/resume_worker.py; each rank count's cases in one launch, on
    first use (the ZeRO-2 resume after the 4-rank launch whose checkpoint it continues)."""
    from tests.launch.resume_worker import CASES, step_checkpoint

    root = tmp_path_factory.mktemp("resume")
    out: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in out:
            groups = [["zero1_user", "zero1_user_resumed", "pp2_text", "pp2_text_to_zero2"],
                      ["3d_text", "3d_text_resumed"], ["3d_text_to_zero2"]]
            names = next(g for g in groups if name in g)
            args = ["--root", str(root), "--cache", str(cache_dir), "--cases", *names]
            for source in {CASES[n].source for n in names} - set(names) - {None}:
                args += ["--source", f"{source}={step_checkpoint(get(source).root, SAVE_EVERY)}"]
            run = launch_matrix(root, cache_dir, "tests.launch.resume_worker", args, nproc=CASES[name].devices).check()
            print(f"resume: {names} on {CASES[name].devices} ranks in {run.seconds:.0f} s")
            out.update({n: Run(root / n, 0, run.log, run.seconds) for n in names})
        return out[name]

    return get


# the 3D source's resumes in the full set: the reshard matrix resumes a 3D checkpoint under other layouts by default
@pytest.mark.parametrize(("resumed", "source"), [
    pytest.param("zero1_user_resumed", "zero1_user", marks=pytest.mark.launch(ranks=2)),
    pytest.param("pp2_text_to_zero2", "pp2_text", marks=pytest.mark.launch(ranks=2)),
    pytest.param("3d_text_resumed", "3d_text", marks=pytest.mark.launch(ranks=4, full=True)),
    pytest.param("3d_text_to_zero2", "3d_text", marks=pytest.mark.launch(ranks=4, full=True))])
def test_a_mid_epoch_checkpoint_resumes_with_the_uninterrupted_losses(resume_runs, resumed, source):
    full = resume_runs(source).losses()
    after = resume_runs(resumed).losses()
    diff = max_rel_diff(after, full[SAVE_EVERY:])
    print(f"{resumed}: steps {SAVE_EVERY}-{MAX_STEPS - 1} within {diff:.2e} of {source}")
    assert len(full) == MAX_STEPS and diff <= LOSS_RTOL


@pytest.mark.launch(ranks=2)
def test_a_script_with_the_default_callbacks_logs_throughput_mfu_and_memory(resume_runs):
    """``Trainer(callbacks=lightning_par.callbacks.defaults())`` in a plain script (the ZeRO-1 dp2 source run, no
    CLI): tokens/s and MFU at the end of each 10-step window, memory over the 2 ranks every 10 steps."""
    import re

    run = resume_runs("zero1_user")
    scalars = run.scalars()
    tps, mfu = scalars["train/tokens_per_sec"], scalars["train/mfu"]
    assert sorted(tps) == sorted(mfu) == [10] and sorted(scalars["memory/max_MiB"]) == [10]
    assert 0 < scalars["memory/min_MiB"][10] <= scalars["memory/max_MiB"][10]
    found = re.search(r"train/mfu: ([\d.]+) MFLOP per token .*; peak ([\d.]+) GFLOP/s", run.log)
    assert found, run.log[-3000:]
    mflop, peak = float(found.group(1)), float(found.group(2))
    assert 0 < mfu[10] < 1 and mfu[10] == pytest.approx(tps[10] * mflop * 1e6 / (peak * 1e9), rel=2e-3)
