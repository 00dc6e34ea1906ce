"""Shared launches: each multi-rank run is made once per session and checked by many tests."""

from __future__ import annotations

import pytest

from tests.harness import Run, launch_cli, launch_torchrun

PARITY_STEPS = 20
GLOBAL_BATCH = 8


def _job(batch: int) -> list[str]:
    return [f"--trainer.max_steps={PARITY_STEPS}", f"--data.batch_size={batch}", "--trainer.limit_val_batches=2",
            f"--trainer.val_check_interval={PARITY_STEPS // 2}"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def single_run(tmp_path_factory, cache_dir) -> Run:
    """The reference: one process, Lightning's default single-device strategy, the whole global batch."""
    root = tmp_path_factory.mktemp("single")
    return launch_cli(root, cache_dir, [*_job(GLOBAL_BATCH), "--trainer.strategy=auto"],
                      devices=1).check()


@pytest.fixture(scope="session")
def dp2_run(tmp_path_factory, cache_dir) -> Run:
    root = tmp_path_factory.mktemp("dp2")
    args = [*_job(GLOBAL_BATCH // 2), "--trainer.strategy=zero0", "--trainer.enable_checkpointing=true"]
    return launch_cli(root, cache_dir, args, devices=2).check()


@pytest.fixture(scope="session")
def dp4_run(tmp_path_factory, cache_dir) -> Run:
    root = tmp_path_factory.mktemp("dp4")
    strategy = ["--trainer.strategy=lightning_par.ZeroStrategy", "--trainer.strategy.stage=0"]
    return launch_cli(root, cache_dir, [*_job(GLOBAL_BATCH // 4), *strategy], devices=4).check()


@pytest.fixture(scope="session")
def multinode_run(tmp_path_factory, cache_dir) -> Run:
    """2 nodes x 2 ranks through torchrun over loopback."""
    root = tmp_path_factory.mktemp("multinode")
    return launch_torchrun(root, cache_dir, [*_job(GLOBAL_BATCH // 4), "--trainer.strategy=zero0"],
                           nnodes=2, nproc_per_node=2).check()
