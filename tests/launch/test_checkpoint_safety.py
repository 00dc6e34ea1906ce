"""Checkpoints that are safe to crash in and safe to load (issue 11): a save becomes visible only when complete, a
damaged checkpoint is refused with the file named, loading unpickles nothing but tensors and plain values, and a
plain single-file Lightning checkpoint resumes under a sharded layout.

Most tests save and load in this process (DCP without a process group: one rank); two launch ranks."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lightning_par.plugins import checkpoint_files, sharded_checkpoint
from lightning_par.plugins.checkpoint_files import CheckpointError
from tests.conftest import EPOCH_STEPS, PARITY_STEPS, RUNS, launch_of
from tests.harness import TINY_JOB, _report_args, base_env, free_port, launch_cli, launching, max_rel_diff

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group is initialised


def no_barrier() -> None:
    pass


def tiny(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and an AdamW with two parameter groups, after one step (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    optimizer = torch.optim.AdamW([{"params": [model[0].weight]},
                                   {"params": [model[0].bias, *model[1].parameters()], "weight_decay": 0.0}],
                                  betas=(0.9, 0.95))
    model(torch.randn(2, 16)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def lightning_dict(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, by_name: bool = True) -> dict:
    """What Lightning hands the strategy, with the values JSON lacks: tensors, tuples, non-string keys, inf/nan,
    numpy arrays (an RNG state). ``by_name``: the optimizer state as our strategies save it (else as Lightning does
    in one file, by position)."""
    optimizer_state = sharded_checkpoint.optimizer_state(model, optimizer) if by_name else optimizer.state_dict()
    return {
        "state_dict": model.state_dict(), "optimizer_states": [optimizer_state],
        "epoch": 0, "global_step": step, "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"kth_value": torch.tensor(float("inf")),
                                                             "best_k_models": {"a.ckpt": torch.tensor(0.5)}}},
        "lr_schedulers": [{"base_lrs": [1e-3, 1e-3], "last_epoch": step, "lr_lambdas": [None]}],
        "hyper_parameters": {"betas": (0.9, 0.95), "score": float("nan"), "by_id": {1: "a", (2, 3): [4]}},
        "rng": {"numpy": ("MT19937", np.arange(6, dtype=np.uint32), 3, 0, 0.0),
                "torch": torch.Generator().manual_seed(7).get_state()},
    }


def save(path, step: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = tiny(seed)
    sharded_checkpoint.save(lightning_dict(model, optimizer, step), path, is_writer=True, barrier=no_barrier)
    return model, optimizer


def load(path, **kwargs) -> tuple[dict, nn.Module, torch.optim.Optimizer]:
    model, optimizer = tiny(seed=1)
    meta = sharded_checkpoint.load(path, model, [optimizer], **kwargs)
    return meta, model, optimizer


def assert_same_state(a: tuple, b: tuple) -> None:
    for (name, x), y in zip(a[0].state_dict().items(), b[0].state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    for x, y in zip(a[1].state_dict()["state"].values(), b[1].state_dict()["state"].values(), strict=True):
        assert all(torch.equal(x[k], y[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_round_trip_restores_weights_optimizer_and_metadata(tmp_path):
    path = tmp_path / "epoch=0-step=3.ckpt"
    saved = save(path, step=3)
    meta, *loaded = load(path)
    assert_same_state(saved, loaded)
    expected = lightning_dict(*saved, step=3)
    del expected["state_dict"], expected["optimizer_states"]
    assert meta.keys() == expected.keys()
    assert meta["hyper_parameters"]["betas"] == (0.9, 0.95) and meta["hyper_parameters"]["by_id"] == {1: "a",
                                                                                                      (2, 3): [4]}
    assert np.isnan(meta["hyper_parameters"]["score"])
    kind, key, *rest = meta["rng"]["numpy"]
    assert kind == "MT19937" and key.dtype == np.uint32 and np.array_equal(key, np.arange(6)) and rest == [3, 0, 0.0]
    assert torch.equal(meta["rng"]["torch"], expected["rng"]["torch"])
    assert meta["callbacks"] == expected["callbacks"] and meta["lr_schedulers"] == expected["lr_schedulers"]
    # the metadata is plain JSON, the manifest lists every other file, and nothing is left beside the checkpoint
    assert json.loads((path / "meta.json").read_text())["checkpoint"]["global_step"] == 3
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(manifest) == sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert all(manifest[name]["bytes"] == (path / name).stat().st_size for name in manifest)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_save_interrupted_before_its_manifest_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    first = save(path, step=3)

    def crash(root, files):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(checkpoint_files, "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        save(path, step=6, seed=2)
    monkeypatch.undo()
    partial = checkpoint_files.partial_path(path)
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    meta, *loaded = load(path)
    assert meta["global_step"] == 3
    assert_same_state(first, loaded)
    with pytest.raises(CheckpointError, match=r"last\.ckpt\.partial is not a complete lightning-par checkpoint: "
                                              r"manifest\.json is missing\. It was not written to the end"):
        load(partial)
    second = save(path, step=6, seed=2)  # the next save clears the interrupted one
    assert load(path)[0]["global_step"] == 6 and not partial.exists()
    assert_same_state(second, load(path)[1:])


def test_a_crash_between_the_two_renames_keeps_the_previous_checkpoint_findable(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    first = save(path, step=3)
    replace = os.replace

    def crash_after_moving_aside(src, dst):
        replace(src, dst)
        if dst == checkpoint_files.aside_path(path):
            raise KeyboardInterrupt("killed between the renames")

    monkeypatch.setattr(os, "replace", crash_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        save(path, step=6, seed=2)
    monkeypatch.undo()
    aside = tmp_path / "last.old.ckpt"
    assert not path.exists() and aside.is_dir()
    # Lightning's ckpt_path="last" takes any "last*.ckpt" in the directory: the previous checkpoint stays findable
    from lightning.pytorch.callbacks import ModelCheckpoint
    assert ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(None) == {str(aside)}
    with pytest.warns(UserWarning, match="last.old.ckpt, the checkpoint it replaced"):
        meta, *loaded = load(path)
    assert meta["global_step"] == 3
    assert_same_state(first, loaded)
    save(path, step=6, seed=2)  # puts the previous one back first, then replaces it
    assert load(path)[0]["global_step"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def _truncate(file):
    file.write_bytes(file.read_bytes()[:-100])


def _flip_a_byte(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("name,damage,match", [
    ("__0_0.distcp", _truncate, r"__0_0\.distcp is truncated or corrupted: \d+ bytes, \d+ when it was saved"),
    ("__0_0.distcp", _flip_a_byte, r"__0_0\.distcp is corrupted: its CRC-32 differs"),
    (".metadata", _flip_a_byte, r"\.metadata is corrupted: its CRC-32 differs"),
    ("meta.json", _flip_a_byte, r"meta\.json is corrupted: its CRC-32 differs"),
    ("meta_values.pt", os.remove, r"meta_values\.pt is missing: the checkpoint is incomplete"),
    ("manifest.json", _truncate, r"manifest\.json is corrupted \(JSONDecodeError"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, name, damage, match):
    path = tmp_path / "epoch=0-step=3.ckpt"
    save(path, step=3)
    damage(path / name)
    model, optimizer = tiny(seed=1)
    before = [p.clone() for p in model.parameters()]
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=match):
        sharded_checkpoint.load(path, model, [optimizer])
    size = sum(p.stat().st_size for p in path.iterdir())
    print(f"{name} ({damage.__name__}): refused in {1e3 * (time.perf_counter() - start):.1f} ms ({size} bytes)")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "nothing was loaded"


class Payload:
    """Unpickling it creates the directory ``marker``: the proof that loading ran code from the checkpoint."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _plant(path, name: str, payload: bytes) -> None:
    """What an attacker can do: replace a file and rewrite the manifest to match."""
    (path / name).write_bytes(payload)
    names = sorted(p.name for p in path.iterdir() if p.name != checkpoint_files.MANIFEST)
    checkpoint_files.write_manifest(path, checkpoint_files.describe(path, names))


def test_loading_unpickles_no_object_from_the_dcp_metadata(tmp_path):
    path, marker = tmp_path / "a.ckpt", tmp_path / "code_ran"
    save(path, step=3)
    _plant(path, ".metadata", pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata refers to posix\.mkdir, which is not part of DCP's "
                                              r"metadata: refusing to unpickle it"):
        load(path)
    assert not marker.exists()


def test_loading_unpickles_no_object_from_the_metadata_unless_weights_only_is_false(tmp_path):
    path, marker = tmp_path / "a.ckpt", tmp_path / "code_ran"
    save(path, step=3)
    buffer = io.BytesIO()
    torch.save([Payload(marker)], buffer)
    _plant(path, "meta_values.pt", buffer.getvalue())
    for weights_only in (None, True):
        with pytest.raises(CheckpointError, match=r"meta_values\.pt holds objects that loading with "
                                                  r"weights_only=True refuses"):
            load(path, weights_only=weights_only)
    assert not marker.exists()
    with pytest.raises(Exception):  # noqa: B017 -- trusted on request: the payload runs (and breaks the metadata)
        load(path, weights_only=False)
    assert marker.is_dir()


class WithExtraState(nn.Linear):
    """A module whose state holds an arbitrary object (DCP stores it as pickled bytes, not as a tensor)."""

    extra = None

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state) -> None:
        self.extra = state


def test_loading_unpickles_no_object_from_the_dcp_shards(tmp_path):
    path, marker = tmp_path / "a.ckpt", tmp_path / "code_ran"
    module = WithExtraState(2, 2)
    module.extra = Payload(marker)
    sharded_checkpoint.save({"state_dict": module.state_dict()}, path, is_writer=True, barrier=no_barrier)
    with pytest.raises(CheckpointError, match=r"entry 'state_dict\._extra_state' is an object that loading with "
                                              r"weights_only=True refuses"):
        sharded_checkpoint.load(path, WithExtraState(2, 2), [])
    assert not marker.exists()


def test_a_single_file_checkpoint_loads_where_optimizers_hold_the_models_parameters(tmp_path):
    file = tmp_path / "epoch=0-step=3.ckpt"
    saved = tiny(seed=0)
    torch.save(lightning_dict(*saved, step=3, by_name=False), file)  # what Lightning writes at stage 0
    with pytest.raises(CheckpointError, match=r"step=3\.ckpt: loading with weights_only=True refuses an object in "
                                              r"it.*numpy"):
        load(file)  # torch.load's own rule for one file: numpy arrays only on request
    meta, *loaded = load(file, weights_only=False)
    assert_same_state(saved, loaded)
    assert meta["global_step"] == 3 and "state_dict" not in meta
    # ZeRO-1/2 buckets or a pipeline stage: the optimizer's parameters are not the saved ones -- said, not guessed
    model, _ = tiny(seed=1)
    one_group = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match=r"optimizer 0: a single-file checkpoint without parameter names keys "
                                              r"optimizer state by position \(groups of \[1, 3\] parameters\), and "
                                              r"this optimizer holds groups of \[4\] \(one pipeline stage's"):
        sharded_checkpoint.load(file, model, [one_group], weights_only=False)
    # what lightning-par's strategies write names each group's parameters (torch's param_names): any grouping, and a
    # pipeline stage's share, then takes it
    named = lightning_dict(*saved, step=3, by_name=False)
    named["optimizer_states"] = [sharded_checkpoint.with_param_names(saved[0], saved[1], saved[1].state_dict())]
    torch.save(named, file)
    sharded_checkpoint.load(file, model, [one_group], weights_only=False)
    for name, param in model.named_parameters():
        expected = saved[1].state[dict(saved[0].named_parameters())[name]]
        assert torch.equal(one_group.state[param]["exp_avg"], expected["exp_avg"]), name
    stage = nn.Sequential(nn.Linear(16, 16))  # the first "stage": its names are a subset of the file's
    stage[0].load_state_dict(saved[0][0].state_dict())
    first_stage = torch.optim.AdamW(stage.parameters())
    other = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(2, 2))  # names the file lacks
    with pytest.raises(CheckpointError, match=r"lacks 2 of this model's 6 entries, e\.g\. \['2\.weight'"):
        sharded_checkpoint.load(file, other, [torch.optim.AdamW(other.parameters())], weights_only=False)
    sharded_checkpoint.load(file, stage, [first_stage], weights_only=False)
    assert torch.equal(first_stage.state[stage[0].weight]["exp_avg"], saved[1].state[saved[0][0].weight]["exp_avg"])
    torch.save(lightning_dict(*saved, step=3, by_name=False), file)
    shards = torch.optim.AdamW([{"params": [nn.Parameter(torch.zeros(8))]},
                                {"params": [nn.Parameter(torch.zeros(8)) for _ in range(3)]}])
    with pytest.raises(CheckpointError, match=r"holds parameters that are not the model's own"):
        sharded_checkpoint.load(file, model, [shards], weights_only=False)
    file.write_bytes(file.read_bytes()[:-200])
    with pytest.raises(CheckpointError, match=r"step=3\.ckpt is not a readable checkpoint file \(truncated"):
        load(file, weights_only=False)


# -- launched: the ranks of a real run ------------------------------------------------------------------------------
@pytest.mark.launch(ranks=2, full=True)
def test_sigkill_of_every_rank_mid_save_leaves_the_previous_checkpoint_loadable_and_last(tmp_path, cache_dir):
    """ZeRO-2 on 2 ranks saves ``last.ckpt`` every 3 steps; in the second save (step 6) every rank is SIGKILLed
    after DCP wrote the shards, before the manifest. ``last.ckpt`` is still step 3, the partial directory is refused,
    and ``ckpt_path="last"`` resumes from step 3."""
    ckpt, crash = tmp_path / "ckpt", tmp_path / "crash"
    common = [f"--data.cache_dir={cache_dir}", "--data.batch_size=4", "--trainer.strategy=zero2",
              "--trainer.limit_val_batches=0", "--sample_tokens=0", "--trainer.enable_checkpointing=true",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", f"--trainer.callbacks.dirpath={ckpt}",
              "--trainer.callbacks.every_n_train_steps=3", "--trainer.callbacks.save_top_k=0",
              "--trainer.callbacks.save_last=true"]
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "lightning_par.cli", "fit", *TINY_JOB, "--trainer.devices=2",
           "--trainer.logger=TensorBoardLogger", *_report_args(killed), *common, "--trainer.max_steps=12",
           "--trainer.callbacks+=tests.launch.checkpoint_crash.PauseMidSave", f"--trainer.callbacks.path={crash}"]
    env = base_env(cache_dir) | {"MASTER_PORT": str(free_port())}
    killed.mkdir()
    launching(2)
    with (killed / "launch.log").open("w") as log:
        # its own process group: Lightning's launcher starts rank 1 as a child of rank 0, so one signal kills all
        proc = subprocess.Popen(cmd, cwd=killed, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 300
            while not (crash / "paused").exists() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.2)
            assert (crash / "paused").exists(), (killed / "launch.log").read_text()[-4000:]
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    for rank in (0, 1):
        pid = int((crash / f"pid{rank}").read_text())
        deadline = time.time() + 10
        while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}"), f"rank {rank} survived"

    last, partial = ckpt / "last.ckpt", ckpt / "last.ckpt.partial"
    assert (crash / "paused").read_text() == str(partial)
    assert sorted(p.name for p in ckpt.iterdir()) == ["last.ckpt", "last.ckpt.partial"]
    assert {p.name for p in partial.iterdir()} >= {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json"}
    with pytest.raises(CheckpointError, match=r"last\.ckpt\.partial is not a complete lightning-par checkpoint"):
        sharded_checkpoint.load(partial, None, [])
    assert json.loads((last / "meta.json").read_text())["checkpoint"]["global_step"] == 3

    resumed = launch_cli(tmp_path / "resumed", cache_dir, [*common, "--trainer.max_steps=5", "--ckpt_path=last"],
                         devices=2).check()
    assert sorted(resumed.scalars()["train/loss"]) == [3, 4], "resumed from step 3, the last complete checkpoint"


@launch_of("dp2", full=True)
def test_a_stage0_single_file_checkpoint_resumes_under_zero3(tmp_path, cache_dir, runs):
    """The data-parallel run's single-file checkpoint at the epoch boundary, resumed under ZeRO-3 on 2 ranks: the
    remaining losses are the uninterrupted run's (weights and AdamW state restored, each rank keeping its shard)."""
    uninterrupted = runs("dp2")
    checkpoint = uninterrupted.checkpoint(step=EPOCH_STEPS)
    assert checkpoint.is_file(), "stage 0 writes one file"
    devices, args = RUNS["zero3_dp2"]
    resumed = launch_cli(tmp_path, cache_dir, [*args, f"--ckpt_path={checkpoint}"], devices=devices).check()
    tail = uninterrupted.losses()[EPOCH_STEPS:]
    diff = max_rel_diff(resumed.losses(), tail)
    print(f"stage-0 file resumed under zero3: max relative loss difference {diff:.2e} over {len(tail)} steps")
    assert len(resumed.losses()) == len(tail) == PARITY_STEPS - EPOCH_STEPS
    assert diff <= 1e-5


# -- one-file checkpoints (one process, stage 0): the default CheckpointIO of every lightning-par strategy -----------
def test_one_file_checkpoints_are_atomic_synced_and_checked(tmp_path, monkeypatch):
    from lightning_par import ZeroStrategy
    from lightning_par.plugins import checkpoint_files
    from lightning_par.plugins.checkpoint_io import AtomicCheckpointIO

    assert isinstance(ZeroStrategy(stage=0).checkpoint_io, AtomicCheckpointIO)
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    stale, fresh = tmp_path / "epoch=0-step=6.ckpt.partial", tmp_path / "other.ckpt.partial"
    stale.write_bytes(b"left by a crashed run")
    os.utime(stale, (0, 0))
    fresh.write_bytes(b"being written by this run")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    io.save_checkpoint({"global_step": 3, "w": torch.ones(2)}, path)
    assert synced and io.load_checkpoint(path)["global_step"] == 3
    # the stale partial swept; the checksum beside the file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.crc32.json", "other.ckpt.partial"]
    # a crash between the two renames of the next save: the previous checkpoint is still found, and loads (its
    # checksum still accepted)
    real_replace = os.replace

    def crash_on_second(src, dst):
        if Path(src) == checkpoint_files.partial_path(path):
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"global_step": 6}, path)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not path.exists() and checkpoint_files.aside_path(path).exists()
    with pytest.warns(UserWarning, match="left by a crash during the save"):
        assert io.load_checkpoint(path)["global_step"] == 3
    io.save_checkpoint({"global_step": 9}, path)  # the next save puts things right
    assert io.load_checkpoint(path)["global_step"] == 9 and not checkpoint_files.aside_path(path).exists()
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(CheckpointError, match=r"last\.ckpt is truncated or corrupted: \d+ bytes, \d+ when it was"):
        io.load_checkpoint(path)
    checkpoint_files.sidecar_path(path).unlink()  # unchecked, torch still finds the damage
    with pytest.warns(UserWarning, match="no checksum"), pytest.raises(CheckpointError, match="not a readable"):
        io.load_checkpoint(path)
    (tmp_path / "sharded.ckpt").mkdir()
    with pytest.raises(CheckpointError, match=r"sharded\.ckpt is a sharded checkpoint.*ZeroStrategy\(stage=0\)"):
        io.load_checkpoint(tmp_path / "sharded.ckpt")


def _flip_a_tensor_byte(file, tensor):
    """Flip one byte inside ``tensor``'s data where ``torch.save`` stored it in ``file``."""
    data = bytearray(file.read_bytes())
    at = data.find(tensor.numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x01
    file.write_bytes(bytes(data))


def test_a_one_file_checkpoint_with_one_flipped_byte_is_refused_naming_the_file(tmp_path):
    """One bit of a weight flipped on disk: torch loads the file without complaint, the checksum saved beside it
    refuses it -- loaded by Lightning's path (AtomicCheckpointIO) and into a sharded layout (sharded_checkpoint)."""
    from lightning_par.plugins.checkpoint_io import AtomicCheckpointIO

    model, _ = tiny(seed=0)
    name, weight = next(iter(model.state_dict().items()))
    io, path = AtomicCheckpointIO(), tmp_path / "epoch=0-step=3.ckpt"
    io.save_checkpoint({"state_dict": model.state_dict(), "global_step": 3}, path)
    _flip_a_tensor_byte(path, weight)
    assert not torch.equal(torch.load(path, weights_only=True)["state_dict"][name], weight)  # torch sees nothing
    match = r"epoch=0-step=3\.ckpt is corrupted: its CRC-32 differs from the one saved with it"
    with pytest.raises(CheckpointError, match=match):
        io.load_checkpoint(path)
    with pytest.raises(CheckpointError, match=match):
        sharded_checkpoint.load(path, tiny(seed=1)[0], [])


def test_a_one_file_checkpoint_without_a_checksum_loads_with_one_warning(tmp_path, recwarn):
    """Lightning's own .ckpt (no sidecar: written by another tool) still loads, with one warning saying it is
    unchecked -- not one per load."""
    from lightning_par.plugins.checkpoint_io import AtomicCheckpointIO

    path = tmp_path / "plain.ckpt"
    torch.save({"global_step": 4, "w": torch.ones(3)}, path)
    io = AtomicCheckpointIO()
    assert io.load_checkpoint(path)["global_step"] == 4
    assert io.load_checkpoint(path)["global_step"] == 4
    unchecked = [w for w in recwarn if "no checksum" in str(w.message)]
    assert len(unchecked) == 1 and "plain.ckpt" in str(unchecked[0].message)
    io.save_checkpoint({"global_step": 5}, path)  # saved over by lightning-par: checked from now on
    assert checkpoint_files.sidecar_path(path).is_file() and io.load_checkpoint(path)["global_step"] == 5


def test_paths_read_from_a_checkpoint_stay_in_its_directory(tmp_path):
    """A crafted manifest naming ../outside, an absolute path or a link out of the directory, and a crafted DCP
    .metadata whose storage path is ../outside, are refused before anything is read."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"a file of the machine")
    for name in ("../outside.bin", str(outside), "escape"):
        path = tmp_path / f"crafted{len(name)}.ckpt"
        save(path, step=3)
        if name == "escape":
            (path / name).symlink_to(outside)
        files = checkpoint_files.read_manifest(path)
        files[name] = {"bytes": outside.stat().st_size, "crc32": checkpoint_files.checksum(outside)}
        checkpoint_files.write_manifest(path, files)
        model, optimizer = tiny(seed=1)
        with pytest.raises(CheckpointError, match="outside"):
            sharded_checkpoint.load(path, model, [optimizer])
    # DCP's metadata: every entry's file renamed to ../<file>, the manifest rewritten to match
    path = tmp_path / "metadata.ckpt"
    save(path, step=3)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = f"../{info.relative_path}"
    _plant(path, ".metadata", pickle.dumps(metadata))
    for weights_only in (None, False):
        model, optimizer = tiny(seed=1)
        with pytest.raises(CheckpointError, match=r"names the file '\.\./__0_0\.distcp', outside its directory"):
            sharded_checkpoint.load(path, model, [optimizer], weights_only=weights_only)


@contextlib.contextmanager
def disk_full_after(limit: int):
    """Writes that would take any file past ``limit`` bytes fail in the kernel, as on a full disk (EFBIG: this
    process's RLIMIT_FSIZE, with SIGXFSZ ignored) -- torch's and DCP's own writers, unpatched."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _one_line_naming(error: BaseException, path: Path) -> str:
    """The error as Python prints it last: one line, naming the checkpoint, with no chained traceback above it."""
    printed = traceback.format_exception(error)
    assert not any("During handling" in part or "direct cause" in part for part in printed)
    line = printed[-1]
    assert line.count("\n") == 1 and f"saving the checkpoint {path} failed" in line, line
    assert "The previous checkpoint is still the latest" in line and "MiB free on its disk" in line
    return line


def test_a_full_disk_during_a_save_is_one_line_naming_the_checkpoint(tmp_path, monkeypatch):
    """Sharded (DCP) and one-file saves that run out of space: one line that names the checkpoint, the interrupted
    save removed, the previous checkpoint intact and loadable."""
    from lightning_par.plugins.checkpoint_io import AtomicCheckpointIO

    path = tmp_path / "last.ckpt"
    first = save(path, step=3)
    with disk_full_after(2000), pytest.raises(CheckpointError) as failure:
        save(path, step=6, seed=2)
    assert "File too large" in _one_line_naming(failure.value, path)  # DCP's 250-line CheckpointException before
    assert not checkpoint_files.partial_path(path).exists()
    meta, *loaded = load(path)
    assert meta["global_step"] == 3
    assert_same_state(first, loaded)

    def no_space(root, files):  # the last write of a save: its manifest
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_files, "write_manifest", no_space)
    with pytest.raises(CheckpointError) as failure:
        save(path, step=6, seed=2)
    monkeypatch.undo()
    assert "(OSError: [Errno 28] No space left on device)" in _one_line_naming(failure.value, path)
    assert load(path)[0]["global_step"] == 3 and not checkpoint_files.partial_path(path).exists()

    io, one = AtomicCheckpointIO(), tmp_path / "one.ckpt"
    io.save_checkpoint({"global_step": 3, "w": torch.ones(4)}, one)
    with disk_full_after(2000), pytest.raises(CheckpointError) as failure:
        io.save_checkpoint({"global_step": 6, "w": torch.ones(4096)}, one)
    _one_line_naming(failure.value, one)  # torch.save alone: "inline_container.cc: unexpected pos"
    assert not checkpoint_files.partial_path(one).exists()
    assert torch.equal(io.load_checkpoint(one)["w"], torch.ones(4))


def test_runs_started_together_get_their_own_version_and_dead_runs_interrupted_saves_go(tmp_path, monkeypatch,
                                                                                        caplog):
    """Two runs that list ``lightning_logs`` before either created ``version_0`` (Lightning alone: both write into
    it, without a word): the second takes ``version_1`` with a warning. A save interrupted in an older version
    directory is removed at the next run's start -- unless the run that holds that directory is still alive."""
    import logging

    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_par import run_dir

    monkeypatch.setattr(run_dir, "_held", [])
    root = tmp_path / "lightning_logs"
    first, second = TensorBoardLogger(tmp_path), TensorBoardLogger(tmp_path)
    listed = second._get_next_version()  # the second run lists the directories before the first creates its own
    monkeypatch.setattr(second, "_get_next_version", lambda: listed)
    run_dir.claim(first, root)
    with pytest.warns(UserWarning, match=rf"{root / 'version_0'} was taken by another run started at the same time: "
                                         rf"this run logs to {root / 'version_1'}\.$"):
        run_dir.claim(second, root)
    assert (first.version, second.version) == (0, 1) and first.log_dir != second.log_dir
    assert run_dir.in_use(root / "version_0") and run_dir.in_use(root / "version_1")

    def interrupted(version: str, name: str, old: bool = True) -> Path:
        partial = root / version / "checkpoints" / name
        (partial / "__0_0.distcp").parent.mkdir(parents=True, exist_ok=True)
        (partial / "__0_0.distcp").write_bytes(b"\0" * 4096)
        for path in (partial / "__0_0.distcp", partial):
            os.utime(path, (0, 0) if old else None)
        return partial

    dead, alive = interrupted("version_7", "step=10.ckpt.partial"), interrupted("version_0", "step=3.ckpt.partial")
    fresh = interrupted("version_7", "step=20.ckpt.partial", old=False)  # written since this process started
    (root / "version_7" / "checkpoints" / "step=5.ckpt").mkdir()  # a complete checkpoint: never touched
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'ab'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(root / "version_7" / run_dir.LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        run_dir.sweep_interrupted(root)
        assert dead.exists() and alive.exists()  # its run is still alive: maybe a save in progress
    finally:
        holder.kill()  # as kill -9: the kernel drops its lock
        holder.wait()
    caplog.set_level(logging.INFO)
    run_dir.sweep_interrupted(root)
    assert not dead.exists() and alive.exists() and fresh.exists()
    assert sorted(p.name for p in dead.parent.iterdir()) == ["step=20.ckpt.partial", "step=5.ckpt"]
    assert f"lightning-par: removed {dead}, a save interrupted in an earlier run (0.0 MiB)" in caplog.text
    for lock in run_dir._held:
        lock.close()
