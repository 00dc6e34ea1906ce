"""Asynchronous sharded saves: the same checkpoint as a synchronous save, committed only when complete, an error
raised at the next save or at teardown, deletions and the ``last`` link held back until the save in flight commits.
Each case runs in a spawned process of its own with a gloo group of one: DCP's background threads and the saver's
process group then end with it, not in pytest's process. The launched run (ZeRO-2 on 2 ranks, resumed from an async
checkpoint, with a ``save_last="link"`` callback) is in tests/launch/test_reshard.py, the stall it saves in
benchmarks/checkpoint_stall.py."""

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_par.plugins import checkpoint_files, sharded_checkpoint
from lightning_par.plugins.checkpoint_files import CheckpointError
from tests.harness import spawn


def _state(seed: int) -> tuple[nn.Module, dict]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    return model, {"state_dict": sharded_checkpoint.model_state(model), "global_step": seed, "epoch": 0}


def _in_a_process_of_its_own(case, tmp_path: Path) -> None:
    spawn(_run, (case, str(tmp_path)), nprocs=1)


def _run(rank: int, case, root: str) -> None:
    from lightning_par.plugins.async_checkpoint import AsyncSaver

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    try:
        case(AsyncSaver(is_writer=True, barrier=dist.barrier), Path(root))
    finally:
        dist.destroy_process_group()


def _commits_when_written(saver, tmp_path: Path) -> None:
    model, checkpoint = _state(seed=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    saver.save(checkpoint, tmp_path / "a.ckpt")
    with torch.no_grad():  # training goes on while the files are written: the save holds its own copy
        for p in model.parameters():
            p.add_(1.0)
    (tmp_path / "old.ckpt").mkdir()
    saver.remove(tmp_path / "old.ckpt")  # Lightning's save_top_k deleting an older one: after the commit
    saver.wait()
    assert (tmp_path / "a.ckpt" / checkpoint_files.MANIFEST).is_file() and not (tmp_path / "old.ckpt").exists()
    assert not list(tmp_path.glob("*.partial"))
    loaded, _ = _state(seed=2)
    meta = sharded_checkpoint.load(tmp_path / "a.ckpt", loaded, [])
    assert meta["global_step"] == 1
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())


def _error_at_the_next_save(saver, tmp_path: Path) -> None:
    saver.save(_state(seed=1)[1], tmp_path / "good.ckpt")
    saver.wait()
    real = checkpoint_files.write_manifest

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    checkpoint_files.write_manifest = disk_full
    try:
        saver.save(_state(seed=2)[1], tmp_path / "bad.ckpt")  # returns: the failure happens in the background
        with pytest.raises(CheckpointError, match=r"asynchronous save of .*bad\.ckpt failed \(OSError: .*No space"):
            saver.save(_state(seed=3)[1], tmp_path / "next.ckpt")  # raised before anything of this one is written
    finally:
        checkpoint_files.write_manifest = real
    assert not (tmp_path / "bad.ckpt").exists() and (tmp_path / "good.ckpt").is_dir()  # never named, never loaded
    saver.save(_state(seed=3)[1], tmp_path / "next.ckpt")
    saver.wait()  # what teardown calls: raises nothing once all went well
    assert (tmp_path / "next.ckpt" / checkpoint_files.MANIFEST).is_file()


def _last_links_after_the_commit(saver, tmp_path: Path) -> None:
    """ModelCheckpoint(save_last="link", save_top_k=1) under async saves: until the new save commits, ``last`` names
    the previous checkpoint, which is kept; then ``last`` names the new one and the previous goes."""
    last = tmp_path / "last.ckpt"
    saver.save(_state(seed=1)[1], tmp_path / "a.ckpt")
    saver.wait()
    saver.link(tmp_path / "a.ckpt", last)
    assert os.readlink(last) == "a.ckpt"
    gate, real = threading.Event(), sharded_checkpoint.finish

    def held(*args):  # the commit waits until the test has looked at the window
        gate.wait(timeout=60)
        real(*args)

    sharded_checkpoint.finish = held
    try:
        saver.save(_state(seed=2)[1], tmp_path / "b.ckpt")
        saver.link(tmp_path / "b.ckpt", last)  # what Lightning does as soon as the save returns
        saver.remove(tmp_path / "a.ckpt")  # save_top_k=1
        # the files are written but not committed: a crash now must leave `last` naming a complete checkpoint
        assert os.readlink(last) == "a.ckpt" and (tmp_path / "a.ckpt" / checkpoint_files.MANIFEST).is_file()
        assert not (tmp_path / "b.ckpt").exists()
        gate.set()
        saver.wait()
    finally:
        gate.set()
        sharded_checkpoint.finish = real
    assert os.readlink(last) == "b.ckpt" and not (tmp_path / "a.ckpt").exists()
    assert not list(tmp_path.glob("*.partial"))
    loaded, _ = _state(seed=3)
    assert sharded_checkpoint.load(last, loaded, [])["global_step"] == 2
    saver.link(tmp_path / "b.ckpt", last)  # nothing in flight: at once, and replacing a link is atomic
    assert os.readlink(last) == "b.ckpt"


@pytest.mark.launch(ranks=1)
def test_an_async_save_commits_when_written_and_loads_like_a_sync_one(tmp_path):
    _in_a_process_of_its_own(_commits_when_written, tmp_path)


@pytest.mark.launch(ranks=1)
def test_an_async_error_is_raised_at_the_next_save_naming_the_checkpoint(tmp_path):
    _in_a_process_of_its_own(_error_at_the_next_save, tmp_path)


@pytest.mark.launch(ranks=1)
def test_last_links_to_an_async_save_only_once_it_commits(tmp_path):
    _in_a_process_of_its_own(_last_links_after_the_commit, tmp_path)


def test_staging_reuses_its_host_buffers_from_one_save_to_the_next():
    """The second save stages into the first save's buffers (no allocation, no re-pinning on a GPU machine) and
    carries the new values; a tensor whose shape changed gets a buffer of its own. (The CUDA branch, a side stream
    into pinned buffers, needs a GPU: benchmarks/gpu_check.py measures its stall.)"""
    from lightning_par.plugins.async_checkpoint import _HostCopy

    stager = _HostCopy()
    model, checkpoint = _state(seed=1)
    first = stager.stage(checkpoint)
    assert isinstance(first, dict)  # CPU tensors: copied in the calling thread
    weight = first["state_dict"]["0.weight"]
    assert torch.equal(weight, model[0].weight) and weight.data_ptr() != model[0].weight.data_ptr()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    checkpoint["state_dict"]["extra"] = torch.ones(3)
    second = stager.stage(checkpoint)
    assert second["state_dict"]["0.weight"].data_ptr() == weight.data_ptr()  # the same buffer, refilled
    assert torch.equal(second["state_dict"]["0.weight"], model[0].weight)
    assert second["global_step"] == 1 and second["state_dict"]["extra"].tolist() == [1.0, 1.0, 1.0]
    checkpoint["state_dict"]["extra"] = torch.ones(4)
    third = stager.stage(checkpoint)
    assert third["state_dict"]["extra"].shape == (4,) and len(stager._buffers) == 2 + len(first["state_dict"])
