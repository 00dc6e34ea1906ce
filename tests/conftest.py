"""Shared launches: each multi-rank run is made once per session (on first use) and checked by many tests."""

from __future__ import annotations

import pytest

from tests.harness import Run, launch_cli, launch_torchrun

PARITY_STEPS = 20
EPOCH_STEPS = 10  # two short epochs: checkpoints at the epoch boundary make resumption exact
GLOBAL_BATCH = 8
CLIP = 0.5


def job(batch: int, accumulate: int = 1, clip: bool = False) -> list[str]:
    """The common 20-step job with a per-rank batch; optionally gradient accumulation and clipping."""
    args = [f"--trainer.max_steps={PARITY_STEPS}", f"--data.batch_size={batch}", "--trainer.limit_val_batches=2",
            f"--trainer.limit_train_batches={EPOCH_STEPS * accumulate}",
            f"--trainer.accumulate_grad_batches={accumulate}",
            "--trainer.callbacks+=tests.probes.GradNorms"]
    return args + ([f"--trainer.gradient_clip_val={CLIP}"] if clip else [])


def probes(root) -> list[str]:
    """Keep every checkpoint, and measure traffic and state bytes of optimizer step 3 on every rank."""
    return ["--trainer.enable_checkpointing=true", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.save_top_k=-1", f"--trainer.callbacks.dirpath={root / 'ckpt'}",
            "--trainer.callbacks+=tests.probes.StateReport", f"--trainer.callbacks.path={root / 'reports'}"]


#: name -> (devices, arguments); launched lazily by the `runs` fixture
RUNS: dict[str, tuple[int, list[str]]] = {
    "single": (1, [*job(GLOBAL_BATCH), "--trainer.strategy=auto"]),
    "single_accum_clip": (1, [*job(GLOBAL_BATCH // 2, accumulate=2, clip=True), "--trainer.strategy=auto"]),
    "dp2": (2, [*job(GLOBAL_BATCH // 2), "--trainer.strategy=zero0", "--trainer.enable_checkpointing=true"]),
    "dp4": (4, [*job(GLOBAL_BATCH // 4), "--trainer.strategy=lightning_par.ZeroStrategy",
                "--trainer.strategy.stage=0"]),
}
for _stage in (1, 2, 3):
    RUNS[f"zero{_stage}_dp2"] = (2, [*job(GLOBAL_BATCH // 2), f"--trainer.strategy=zero{_stage}"])
    RUNS[f"zero{_stage}_dp4_accum_clip"] = (
        4, [*job(GLOBAL_BATCH // 8, accumulate=2, clip=True), f"--trainer.strategy=zero{_stage}"])
RUNS["zero2_offload_dp2"] = (2, [*job(GLOBAL_BATCH // 2), "--trainer.strategy=zero2_offload"])


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def runs(tmp_path_factory, cache_dir):
    """``runs(name)``: the finished launch of ``RUNS[name]``, made on first request."""
    done: dict[str, Run] = {}

    def get(name: str, extra: list[str] | None = None) -> Run:
        if name not in done:
            devices, args = RUNS[name]
            root = tmp_path_factory.mktemp(name)
            done[name] = launch_cli(root, cache_dir, [*args, *probes(root), *(extra or [])],
                                    devices=devices).check()
        return done[name]

    return get


@pytest.fixture(scope="session")
def single_run(runs) -> Run:
    """The reference: one process, Lightning's default single-device strategy, the whole global batch."""
    return runs("single")


@pytest.fixture(scope="session")
def dp2_run(runs) -> Run:
    return runs("dp2")


@pytest.fixture(scope="session")
def dp4_run(runs) -> Run:
    return runs("dp4")


@pytest.fixture(scope="session")
def multinode_run(tmp_path_factory, cache_dir) -> Run:
    """2 nodes x 2 ranks through torchrun over loopback."""
    root = tmp_path_factory.mktemp("multinode")
    return launch_torchrun(root, cache_dir, [*job(GLOBAL_BATCH // 4), "--trainer.strategy=zero0"],
                           nnodes=2, nproc_per_node=2).check()
