"""Any layout resumes any other: a step-10 checkpoint continues under another layout with the same losses.

Sources: one process (Lightning's single file), ZeRO-1 over 2 ranks (bucket shards saved per parameter) and tp2 x pp2
(the 3D matrix's sequence-parallel interleaved run, ZeRO-1 over one replica). Each resume trains steps 10-19 of the
AdamW job (its LR schedule included) and must log the losses of the uninterrupted single process: weights, Adam's
moments and step, the schedule and the data position all survive the move. Launches of tests/launch/reshard_matrix.py
(1 rank, then 2), after the 3D matrix's 4-rank launch, then a third on 4 ranks (one file and ZeRO-1 into 3D).
Two sources are saved by ``trainer.save_checkpoint`` once ``fit`` has returned (ZeRO-1 dp2, and 3D as pp2 with ZeRO-1
over one replica), and resume under tp2 and ZeRO-2 dp2 like the others.
"""

import os

import pytest

from lightning_par.plugins import checkpoint_files
from tests.conftest import EPOCH_STEPS, PARITY_STEPS
from tests.harness import Run, launch_matrix, max_rel_diff
from tests.launch.reshard_matrix import CASES

LOSS_RTOL = 1e-5
RESUMES = [name for name, case in CASES.items() if case.source is not None and case.precision == "32-true"]


@pytest.fixture(scope="module")
def reshard(tmp_path_factory, cache_dir, hybrid3d_matrix):
    """``reshard(case)``: the Run of a case of tests/launch/reshard_matrix.py; each rank count's cases in one launch, on
    first use: 1 rank, then 2 (it resumes the 1-rank source), then 4 (it resumes both sources into 3D)."""
    root = tmp_path_factory.mktemp("reshard")
    out: dict[str, Run] = {}

    def get(name: str) -> Run:
        devices = CASES[name].devices
        for before in (1, 2):
            if before < devices:
                get(next(n for n, case in CASES.items() if case.devices == before))
        if name not in out:
            # the bf16-mixed-master pair (full set only) in a launch of its own
            names = [n for n, case in CASES.items()
                     if case.devices == devices and ("master" in n) == ("master" in name)]
            three_d = hybrid3d_matrix("tp2_pp2_sp_interleaved")[0].checkpoint(step=EPOCH_STEPS)
            sources = ["--source", f"3d={three_d}"]
            sources += [arg for source in ("one_process", "zero1_dp2") if source in out
                        for arg in ("--source", f"{source}={out[source].checkpoint(EPOCH_STEPS)}")]
            run = launch_matrix(root, cache_dir, "tests.launch.reshard_matrix",
                                ["--root", str(root), "--cache", str(cache_dir), "--cases", *names, *sources],
                                nproc=devices).check()
            print(f"reshard matrix: {len(names)} fits on {devices} rank(s) in {run.seconds:.0f} s")
            out.update({n: Run(root / n, 0, run.log, run.seconds) for n in names})
        return out[name]

    return get


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("name", ["one_process", "zero1_dp2", "zero2_async_dp2"])
def test_the_sources_match_one_process(reshard, runs, name):
    """The sources themselves: one process under a lightning-par strategy sees Lightning's single-process batches."""
    diff = max_rel_diff(reshard(name).losses(), runs("single").losses())
    assert len(reshard(name).losses()) == PARITY_STEPS and diff <= LOSS_RTOL


@pytest.mark.launch(ranks=4)
def test_async_saves_link_last_to_the_newest_complete_checkpoint(reshard):
    """ModelCheckpoint(save_last="link", save_top_k=1) beside async saves: after the run, ``last`` is a link to the
    step-20 checkpoint, complete (manifest written), and the only one kept."""
    linked = reshard("zero2_async_dp2").root / "linked"
    last = linked / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == f"epoch=1-step={PARITY_STEPS}.ckpt", os.listdir(linked)
    assert (last / checkpoint_files.MANIFEST).is_file()
    assert sorted(os.listdir(linked)) == [f"epoch=1-step={PARITY_STEPS}.ckpt", "last.ckpt"]


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("name", RESUMES)
def test_a_checkpoint_resumes_under_another_layout(reshard, runs, name):
    resumed = reshard(name).losses()
    expected = runs("single").losses()[EPOCH_STEPS:]
    diff = max_rel_diff(resumed, expected)
    print(f"{name}: steps {EPOCH_STEPS}-{PARITY_STEPS - 1} within {diff:.2e} of one process")
    assert len(resumed) == PARITY_STEPS - EPOCH_STEPS and diff <= LOSS_RTOL


@pytest.mark.parametrize("name", [pytest.param("zero2_bf16_dp2", marks=pytest.mark.launch(ranks=4)),
                                  pytest.param("zero1_master_dp2", marks=pytest.mark.launch(ranks=4, full=True))])
def test_bf16_mixed_resumes_from_its_fp32_master_weights(reshard, name):
    """ZeRO-2 under bf16-mixed (ZeRO-1 under bf16-mixed-master) keeps fp32 master shards beside bf16 parameters: the
    checkpoint holds the masters, so the resumed run repeats the uninterrupted one (restoring the bf16 parameters
    instead would round the masters)."""
    uninterrupted = reshard(name).losses()
    resumed = reshard(f"{name}_resumed").losses()
    diff = max_rel_diff(resumed, uninterrupted[EPOCH_STEPS:])
    print(f"{name} resumed at step {EPOCH_STEPS}: within {diff:.2e} of the uninterrupted run")
    assert len(resumed) == PARITY_STEPS - EPOCH_STEPS and diff <= 1e-6
