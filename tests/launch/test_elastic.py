"""Elastic resume (docs/elastic.md): an attempt on another world size goes on as the same run.

In one process (default set, a few seconds): a checkpoint saved mid-epoch with 8 samples per loader batch, resumed with
4 per loader batch (what halving dp does to the loader-global batch): the accumulation doubles by itself and the
per-step losses are the uninterrupted run's. Launched (``--full``): ZeRO-3 dp4 -> dp2 -> dp4 and dp2 x tp2 -> tp2.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal

import pytest
import torch

from tests.harness import launching, max_rel_diff
from tests.launch.resume_worker import MAX_STEPS, SAVE_EVERY, user_loader
from tests.probes import StepLosses

LOSS_RTOL = 1e-6


def _fit(root, batch, ckpt=None, keep=True, accumulate=1, log_root=None, samples=None, limit=None, strategy="auto"):
    """The tiny GPT (plain SGD) over the user's 96 shuffled samples in loader batches of ``batch``, 18 optimizer
    steps; returns the trainer and {step: loss over the step's global batch}. ``samples``: that many instead, in a
    loader with ``drop_last=True``; ``limit``: the Trainer's limit_train_batches; ``strategy``: the Trainer's."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_par.examples import GPTLightningModule
    from lightning_par.run.data_order import DataParallelSampler
    from lightning_par.run.data_position import resumable_train_loader
    from lightning_par.run.elastic import AttemptProgress

    class OneRank(StepLosses):  # no process group in one process
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.pending += float(outputs["loss"])
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
                self.steps[trainer.global_step - 1] = self.pending
                self.pending = 0.0

    pl.seed_everything(1234)
    root.mkdir(parents=True, exist_ok=True)
    losses = OneRank(root / "steps.json")
    saves = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=SAVE_EVERY, save_top_k=-1)] if keep else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=MAX_STEPS,
                         accumulate_grad_batches=accumulate, limit_val_batches=0, limit_train_batches=limit,
                         logger=TensorBoardLogger(log_root or root, name="tb", version=0),
                         log_every_n_steps=1, enable_checkpointing=bool(saves), enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[losses, *saves, AttemptProgress()])
    model = GPTLightningModule(preset="tiny", n_layers=2, optimizer="sgd", lr=0.2)
    dataset = user_loader(batch).dataset
    if samples is not None:
        tokens = torch.randint(0, 256, (samples, 33), generator=torch.Generator().manual_seed(1))
        dataset = [(row[:-1], row[1:]) for row in tokens]
    loader = resumable_train_loader(torch.utils.data.DataLoader(
        dataset, batch_size=batch, sampler=DataParallelSampler(dataset, shuffle=True, seed=3),
        drop_last=samples is not None), trainer)
    trainer.fit(model, loader, ckpt_path=ckpt)
    return trainer, losses.steps


def test_another_loader_global_batch_keeps_the_step_batch_and_the_position(tmp_path, caplog):
    """Saved at step 5 of a 12-step epoch in loader batches of 8; resumed in loader batches of 4 with the Trainer's
    accumulate_grad_batches=1: it becomes 2 (8 samples per step, as saved), Lightning's batch counters say 10 of 24,
    and steps 5-17 (into the second epoch) equal the uninterrupted run's. One line names the attempt. In loader
    batches of 3 no accumulation reaches 8: refused, naming 6 and 9. An older checkpoint's position (no global
    batch): a warning, and the run goes on."""
    caplog.set_level(logging.INFO)
    _, full = _fit(tmp_path / "full", 8)
    (step5,) = (tmp_path / "full" / "ckpt").glob(f"*step={SAVE_EVERY}.ckpt")
    # logged where the uninterrupted run logged its 18 steps: as if an attempt had got that far, 13 steps are lost
    trainer, resumed = _fit(tmp_path / "half", 4, ckpt=str(step5), keep=False, log_root=tmp_path / "full")
    assert trainer.accumulate_grad_batches == 2 and trainer.global_step == MAX_STEPS
    assert sorted(resumed) == list(range(SAVE_EVERY, MAX_STEPS))
    diff = max_rel_diff([resumed[s] for s in sorted(resumed)], [full[s] for s in range(SAVE_EVERY, MAX_STEPS)])
    print(f"one process, loader batch 8 -> 4 (accumulation 1 -> 2): steps {SAVE_EVERY}-{MAX_STEPS - 1} within "
          f"{diff:.2e}")
    assert diff <= LOSS_RTOL
    assert "accumulate_grad_batches=2 keeps it" in caplog.text
    line = re.search(r"lightning-par: attempt on 1 ranks \(the checkpoint's: 1\).*", caplog.text)
    assert line and "accumulate_grad_batches=2" in line.group(0) and f"at step {SAVE_EVERY}" in line.group(0)
    assert re.search(r"steps lost: 13 \(the last attempt reached step 18, \d+ s ago\)$", line.group(0))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "full" / "tb" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    (entry,) = events.Tensors("elastic/attempt/text_summary")  # the same line, at the resumed step
    assert entry.step == SAVE_EVERY and entry.tensor_proto.string_val[0].decode() == line.group(0)

    with pytest.raises(ValueError, match=r"no accumulation reaches 8: the nearest global batches are 6 "
                                         r"\(accumulate_grad_batches=2\) or 9 \(accumulate_grad_batches=3\).*keep "
                                         r"8, give a per-rank batch of 1, 2, 4, 8 "):
        _fit(tmp_path / "three", 3, ckpt=str(step5), keep=False)

    old = torch.load(step5, weights_only=False)
    for state in old["loops"]["fit_loop"]["state_dict"]["combined_loader"]:
        for key in ("global_batch", "consumed_samples", "accumulate_grad_batches", "world_size"):
            state.pop(key, None)
    torch.save(old, tmp_path / "older.ckpt")
    with pytest.warns(UserWarning, match="the position in its epoch cannot be kept"):
        trainer, _ = _fit(tmp_path / "older", 8, ckpt=str(tmp_path / "older.ckpt"), keep=False)
    assert trainer.global_step == MAX_STEPS


def _logged(root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tb" / "version_0"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


def test_a_resumed_epoch_of_another_loader_batch_ends_where_the_uninterrupted_one_did(tmp_path):
    """ZeRO-1 on one process: 100 samples in loader batches of 8, drop_last (12 steps an epoch, 4 samples dropped),
    saved at step 5; resumed in loader batches of 4 (accumulation 2): the loader alone would give 25 batches, an
    epoch of 12 and a half steps; the epoch is kept at the checkpoint's 96 samples (24 batches), so steps 5-17 (across
    the epoch boundary), the logged train/loss (the mean of the two micro-batches, as one batch of 8 logs) and the
    final weights are the uninterrupted run's. With limit_train_batches (it counts loader batches): refused."""
    from lightning_par import ZeroStrategy

    trainer, full = _fit(tmp_path / "full", 8, samples=100, strategy=ZeroStrategy(stage=1))
    full_weights = {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}
    (step5,) = (tmp_path / "full" / "ckpt").glob(f"*step={SAVE_EVERY}.ckpt")
    trainer, resumed = _fit(tmp_path / "half", 4, ckpt=str(step5), keep=False, samples=100,
                            strategy=ZeroStrategy(stage=1))
    assert trainer.accumulate_grad_batches == 2 and trainer.global_step == MAX_STEPS
    assert trainer.num_training_batches == 24 and sorted(resumed) == list(range(SAVE_EVERY, MAX_STEPS))
    loss_diff = max_rel_diff([resumed[s] for s in sorted(resumed)], [full[s] for s in range(SAVE_EVERY, MAX_STEPS)])
    weights = trainer.lightning_module.state_dict()
    weight_diff = max(float((weights[k] - v).norm() / v.norm()) for k, v in full_weights.items() if v.norm() > 0)
    logged_full, logged = _logged(tmp_path / "full"), _logged(tmp_path / "half")
    steps = sorted(logged)
    assert len(steps) == MAX_STEPS - SAVE_EVERY
    logged_diff = max_rel_diff([logged[s] for s in steps], [logged_full[s] for s in steps])
    print(f"one process, 100 samples, loader batch 8 -> 4 (accumulation 1 -> 2): steps {SAVE_EVERY}-{MAX_STEPS - 1} "
          f"within {loss_diff:.2e}, logged train/loss within {logged_diff:.2e}, final weights within {weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL and logged_diff <= LOSS_RTOL and weight_diff <= 1e-5

    with pytest.raises(ValueError, match=r"limit_train_batches=10 counts loader batches, which hold 4 samples here "
                                         r"and 8 in the checkpoint's run: leave limit_train_batches unset"):
        _fit(tmp_path / "limited", 4, ckpt=str(step5), keep=False, samples=100, limit=10,
             strategy=ZeroStrategy(stage=1))


def _same_run(root, resumed, source, first):
    """(max relative loss difference of steps ``first``.. between ``resumed`` and ``source``, max relative difference
    of their final weights, the resumed case's accumulation)."""
    full, _ = _steps(root, source)
    after, acc = _steps(root, resumed)
    assert sorted(after) == list(range(first, MAX_STEPS))
    loss = max_rel_diff([after[s] for s in range(first, MAX_STEPS)], [full[s] for s in range(first, MAX_STEPS)])
    a, b = torch.load(root / resumed / "weights.pt"), torch.load(root / source / "weights.pt")
    weights = max(float((a[k] - v).norm() / v.norm()) for k, v in b.items() if v.norm() > 0)
    return loss, weights, acc


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.launch(ranks=2)),
                                   pytest.param(3, marks=pytest.mark.launch(ranks=2, full=True))])
def test_zero_on_2_ranks_resumed_on_1_is_the_same_run(tmp_path, cache_dir, stage):
    """ZeRO-1 (ZeRO-3 in the full set; plain SGD) on 2 ranks, per-rank batch 4, 100 samples (drop_last: 12 steps an
    epoch), saved at step 5; resumed on 1 rank (in this process): accumulation 2, the epoch kept at 12 steps, steps
    5-17 and the final weights the uninterrupted run's."""
    from tests.harness import launch_matrix
    from tests.launch import resume_worker

    source = f"zero{stage}_dp2"
    launch_matrix(tmp_path, cache_dir, "tests.launch.resume_worker",
                  ["--root", str(tmp_path), "--cache", str(cache_dir), "--cases", source], nproc=2).check()
    resume_worker.fit(tmp_path, str(cache_dir), f"{source}_to_1", {})
    loss, weights, acc = _same_run(tmp_path, f"{source}_to_1", source, SAVE_EVERY)
    print(f"ZeRO-{stage} 2 -> 1 ranks (accumulation {acc}): steps {SAVE_EVERY}-{MAX_STEPS - 1} within {loss:.2e}, "
          f"final weights within {weights:.2e}")
    assert acc == 2 and loss <= 1e-5 and weights <= 1e-5


# -- launched (--full): 4 ranks -> 2 -> 4 under ZeRO-3 and ZeRO-1, dp2 x tp2 -> tp2 ------------------------------------
@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory, cache_dir):
    """The elastic cases of tests/launch/resume_worker.py, each rank count in one launch: 4 ranks (ZeRO-3 and ZeRO-1
    dp4, dp2 x tp2, planned), 2 ranks (all resumed), 4 ranks (ZeRO-3 and ZeRO-1 back on dp4)."""
    from tests.harness import launch_matrix

    root = tmp_path_factory.mktemp("elastic")
    seconds = {}
    for names, nproc in ((["zero3_dp4", "zero1_dp4", "dp2_tp2", "planned4_text"], 4),
                         (["zero3_dp4_to_dp2", "zero1_dp4_to_dp2", "dp2_tp2_to_tp2", "planned4_to_2"], 2),
                         (["zero3_dp2_back_to_dp4", "zero1_dp2_back_to_dp4"], 4)):
        run = launch_matrix(root, cache_dir, "tests.launch.resume_worker",
                            ["--root", str(root), "--cache", str(cache_dir), "--cases", *names], nproc=nproc).check()
        seconds[tuple(names)] = run.seconds
        print(f"elastic: {names} on {nproc} ranks in {run.seconds:.0f} s")
        (root / f"launch_{nproc}_{names[0]}.log").write_text(run.log)
    return root, seconds


def _steps(root, name, times=False):
    data = json.loads((root / name / "steps.json").read_text())
    steps = {int(k): v for k, v in data["steps"].items()}
    if times:
        return steps, data["accumulate"], {int(k): v for k, v in data["times"].items()}
    return steps, data["accumulate"]


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize(("resumed", "source", "first", "accumulate", "attempt"),
                         [("zero3_dp4_to_dp2", "zero3_dp4", SAVE_EVERY, 2, "on 2 ranks (the checkpoint's: 4); layout "
                           "dp=2 x tp=1 x pp=1"),
                          ("zero3_dp2_back_to_dp4", "zero3_dp4", 10, 1, "on 4 ranks (the checkpoint's: 2); layout "
                           "dp=4 x tp=1 x pp=1"),
                          ("zero1_dp4_to_dp2", "zero1_dp4", SAVE_EVERY, 2, "on 2 ranks (the checkpoint's: 4); layout "
                           "dp=2 x tp=1 x pp=1"),
                          ("zero1_dp2_back_to_dp4", "zero1_dp4", 10, 1, "on 4 ranks (the checkpoint's: 2); layout "
                           "dp=4 x tp=1 x pp=1"),
                          ("dp2_tp2_to_tp2", "dp2_tp2", SAVE_EVERY, 2, "on 2 ranks (the checkpoint's: 4); layout "
                           "dp=1 x tp=2 x pp=1"),
                          ("planned4_to_2", "planned4_text", SAVE_EVERY, None, "on 2 ranks (the checkpoint's: 4); "
                           "layout ")])
def test_a_run_resumed_on_another_world_size_is_the_same_run(elastic_runs, resumed, source, first, accumulate,
                                                             attempt):
    root, _ = elastic_runs
    logs = "".join(p.read_text() for p in root.glob("launch_*.log"))
    assert f"lightning-par: attempt {attempt}" in logs and f"step={first}.ckpt at step {first}" in logs
    full, _ = _steps(root, source)
    after, acc = _steps(root, resumed)
    if accumulate is None:  # planned: the dp the planner chose on 4 ranks and on 2 say what the accumulation must be
        dp = {int(w): int(d) for d, w in re.findall(r"PlannedStrategy: dp=(\d+) x .*\(world (\d+);", logs)}
        accumulate = dp[4] // dp[2]
        print(f"planned: dp={dp[4]} on 4 ranks, dp={dp[2]} on 2: accumulation {accumulate}")
        assert "the planner's fastest layout that fits" in logs
    assert acc == accumulate and sorted(after) == list(range(first, MAX_STEPS))
    diff = max_rel_diff([after[s] for s in range(first, MAX_STEPS)], [full[s] for s in range(first, MAX_STEPS)])
    _, weights, _ = _same_run(root, resumed, source, first)
    print(f"{resumed}: steps {first}-{MAX_STEPS - 1} within {diff:.2e} of {source} (accumulation {acc}), final "
          f"weights within {weights:.2e}")
    assert diff <= LOSS_RTOL and weights <= 1e-5


# -- two torchrun agents, one lost (--full): dp2 x pp2 on 4 ranks, then pp2 on the survivor's 2 --------------------
ELASTIC_STEPS = 20
ELASTIC_JOB = ["--trainer.strategy=lightning_par.PipelineStrategy", "--trainer.strategy.pp=2",
               "--trainer.strategy.schedule=1f1b", "--trainer.strategy.heartbeat_timeout=10", "--data.batch_size=4",
               "--model.optimizer=sgd", "--model.lr=0.2", "--trainer.limit_val_batches=0",
               "--trainer.enable_checkpointing=true", "--checkpoint_every_n_steps=5", "--sample_tokens=0"]


def _cli(root, cache_dir, devices, nodes, max_steps=ELASTIC_STEPS, *extra):
    from tests.harness import TINY_JOB

    return ["-m", "lightning_par.cli", "fit", *TINY_JOB, *ELASTIC_JOB, f"--trainer.devices={devices}",
            f"--trainer.num_nodes={nodes}", f"--trainer.max_steps={max_steps}", "--trainer.logger=TensorBoardLogger",
            f"--trainer.logger.save_dir={root / 'tb'}", f"--trainer.default_root_dir={root}",
            f"--data.cache_dir={cache_dir}", "--trainer.callbacks+=tests.probes.StepLosses",
            f"--trainer.callbacks.path={root / 'steps.json'}", *extra]


def _wait(procs, timeout):
    import subprocess

    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            codes.append(-9)
    return codes


@pytest.fixture(scope="module")
def elastic_reference(tmp_path_factory, cache_dir):
    """The uninterrupted run: dp2 x pp2 on 4 ranks of one agent, ELASTIC_STEPS + 5 steps: {step: loss}."""
    import subprocess
    import sys
    import time

    from tests.harness import base_env

    root = tmp_path_factory.mktemp("elastic_reference")
    reference = root / "reference"
    reference.mkdir()
    start = time.time()
    launching(4)
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                          "--no-python", sys.executable, *_cli(reference, cache_dir, 4, 1, ELASTIC_STEPS + 5)],
                         cwd=reference, env=base_env(cache_dir), stdout=(reference / "launch.log").open("w"),
                         stderr=subprocess.STDOUT, timeout=600)
    assert ref.returncode == 0, (reference / "launch.log").read_text()[-4000:]
    print(f"uninterrupted dp2 x pp2 on 4 ranks, {ELASTIC_STEPS + 5} steps: {time.time() - start:.0f} s")
    return _steps(root, "reference")[0]


def _agent(run, cache_dir, port, host, *extra, accumulate=1, env=None):
    """One torchrun agent of 2 ranks in an elastic job (``--nnodes=1:2``, c10d rendezvous on loopback), in its own
    session; ``host``: whether it hosts the rendezvous store."""
    import subprocess
    import sys

    from tests.harness import base_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
           f"--rdzv-conf=is_host={int(host)},last_call_timeout=5", "--max-restarts=1", "--no-python", sys.executable,
           *_cli(run, cache_dir, 2, 2, ELASTIC_STEPS, f"--trainer.accumulate_grad_batches={accumulate}", *extra)]
    log = run / f"agent{1 - int(host)}.log"
    launching(2)
    return subprocess.Popen(cmd, cwd=run, env={**base_env(cache_dir), **(env or {})}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.launch(ranks=4, full=True)
def test_two_torchrun_agents_one_lost_the_survivor_goes_on_as_the_same_run(tmp_path, cache_dir, elastic_reference):
    """Two torchrun agents of 2 ranks each (``--nnodes=1:2``, c10d rendezvous on loopback, ``--max-restarts=1``):
    dp2 x pp2 on 4 ranks; at step 12 the second agent and its ranks are SIGKILLed (a node lost). The survivor's next
    attempt runs on 2 ranks, pp2 with dp re-derived to 1 and accumulation 2 (8 samples per step kept), from the step-10
    checkpoint; its per-step losses equal an uninterrupted 4-rank run's from step 10 on. Then a SLURM-style requeue
    (its variables, 2 nodes of 2 tasks, restart count 2) grows back to 4 ranks for 5 more steps, same check."""
    import subprocess
    import sys
    import time

    from tests.harness import base_env, free_port

    env = base_env(cache_dir)
    full = elastic_reference
    start = time.time()
    run = tmp_path / "run"
    run.mkdir()
    pid_file, killed = run / "agent1.pid", run / "killed.json"
    port = free_port()
    kill = ["--trainer.callbacks+=tests.probes.KillAgentAt", "--trainer.callbacks.step=12",
            f"--trainer.callbacks.pid_file={pid_file}", f"--trainer.callbacks.path={killed}"]
    procs = [_agent(run, cache_dir, port, True, *kill)]
    time.sleep(1)
    procs.append(_agent(run, cache_dir, port, False, *kill))
    pid_file.write_text(str(procs[1].pid))
    codes = _wait(procs, 600)
    log = (run / "agent0.log").read_text()
    print(f"two agents, one lost: {time.time() - start:.0f} s, exit codes {codes}")
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, log[-4000:]
    killed_at = json.loads(killed.read_text())
    assert re.search(r"restart 1 of this job \(TORCHELASTIC_RESTART_COUNT=1\): resuming from \S+step=10\.ckpt", log)
    line = re.search(r"lightning-par: attempt on 2 ranks \(the checkpoint's: 4\).*", log)
    assert line, log[-4000:]
    line = line.group(0)
    print(line)
    assert "dp=1 x tp=1 x pp=2" in line and "accumulate_grad_batches=2" in line
    assert re.search(r"steps lost: 2 \(the last attempt reached step 12, \d+ s ago\)", line)
    after, acc, times = _steps(tmp_path, "run", times=True)
    assert acc == 2 and sorted(after) == list(range(10, ELASTIC_STEPS))
    diff = max_rel_diff([after[s] for s in range(10, ELASTIC_STEPS)], [full[s] for s in range(10, ELASTIC_STEPS)])
    print(f"survivor on 2 ranks: steps 10-{ELASTIC_STEPS - 1} within {diff:.2e} of the uninterrupted 4-rank run; "
          f"{killed_at['step'] - 10} steps lost; {times[10] - killed_at['time']:.0f} s from the kill to the end of "
          "the next attempt's first step")
    assert diff <= LOSS_RTOL

    # grow back: a SLURM requeue (simulated by its variables) with 2 nodes of 2 tasks, 5 more steps on 4 ranks
    master = str(free_port())
    procs = []
    launching(4)
    for rank in range(4):
        slurm = dict(env, SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="2", SLURM_PROCID=str(rank),
                     SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2), SLURM_JOB_NAME="elastic",
                     SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1", SLURM_RESTART_COUNT="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=master)
        procs.append(subprocess.Popen([sys.executable, *_cli(run, cache_dir, 2, 1, ELASTIC_STEPS + 5)], cwd=run,
                                      env=slurm, stdout=(run / f"slurm{rank}.log").open("w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
    codes = _wait(procs, 600)
    log = (run / "slurm0.log").read_text()
    assert codes == [0, 0, 0, 0], log[-4000:]
    assert re.search(r"this attempt runs on 2 node\(s\) \(SLURM_NNODES=2\)", log), log[-4000:]
    assert re.search(r"restart 2 of this job \(SLURM_RESTART_COUNT=2\): resuming from \S+step=20\.ckpt", log)
    line = re.search(r"lightning-par: attempt on 4 ranks \(the checkpoint's: 2\).*", log)
    assert line and "dp=2 x tp=1 x pp=2" in line.group(0) and "accumulate_grad_batches=1" in line.group(0), log[-4000:]
    print(line.group(0))
    back, acc = _steps(tmp_path, "run")
    steps = list(range(ELASTIC_STEPS, ELASTIC_STEPS + 5))
    assert acc == 1 and sorted(back) == steps
    diff = max_rel_diff([back[s] for s in steps], [full[s] for s in steps])
    print(f"grown back to 4 ranks by a SLURM requeue: steps {steps[0]}-{steps[-1]} within {diff:.2e}")
    assert diff <= LOSS_RTOL


def test_a_world_too_small_for_the_model_names_the_smallest_that_fits():
    """strategy='planned' on 2 ranks with memory per rank that only 4 ranks' layouts fit: one error naming 4."""
    from lightning_par import LayoutError
    from lightning_par.strategies.planned import Budget, plan_layouts
    from tests.launch.test_planned import _tiny_gpt

    model = _tiny_gpt()
    args = dict(batch=2, seq_len=32, precision="32-true", optimizer="sgd", zero_stages=(3,))
    with pytest.raises(LayoutError) as nothing:
        plan_layouts(model, Budget(2, 2, 1e-6), search=False, **args)
    least_on_two = float(re.search(r"needs ([\d.e-]+) GiB per rank", str(nothing.value)).group(1))
    with pytest.raises(LayoutError, match=r"on 2 ranks: .* The smallest world that fits: 4 ranks \(dp"):
        plan_layouts(model, Budget(2, 2, least_on_two * 0.99), search=True, **args)


def test_a_layout_that_cannot_fit_the_new_world_is_refused_with_what_would():
    """tp2 x pp2 given, an attempt on 2 ranks: refused in the Trainer (before any rank waits on a collective), one
    message naming the layouts of 2 ranks that split the model no finer and the planner."""
    from lightning.pytorch import Trainer

    from lightning_par import Hybrid3DStrategy, LayoutError

    with pytest.raises(LayoutError, match=r"tp=2 x pp=2 = 4 does not divide the world size 2\..* On 2 ranks: tp=1 x "
                                          r"pp=2 \(dp=1\), tp=2 x pp=1 \(dp=1\), tp=1 x pp=1 \(dp=2\); or "
                                          r"--trainer.strategy=planned"):
        Trainer(accelerator="cpu", devices=2, strategy=Hybrid3DStrategy(tp=2, pp=2), logger=False)


def test_a_node_that_joins_restarts_with_count_0_and_still_continues_the_run(tmp_path, monkeypatch):
    """torchrun restarts the workers when a node joins without counting a restart (TORCHELASTIC_RESTART_COUNT=0): the
    attempt knows it continues the run when the run's last step was recorded under the same TORCHELASTIC_RUN_ID."""
    from lightning_par.run.elastic import PROGRESS_FILE, same_torchelastic_job

    (tmp_path / PROGRESS_FILE).write_text(json.dumps({"step": 7, "torchelastic_run_id": "job-a"}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    assert same_torchelastic_job(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")  # another job: a new run
    assert not same_torchelastic_job(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert not same_torchelastic_job(tmp_path) and not same_torchelastic_job(tmp_path / "missing")


def test_the_cli_takes_the_node_count_from_the_launcher(monkeypatch):
    """An elastic attempt's node count is the launcher's: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, SLURM's
    SLURM_NNODES (not under an interactive `srun --pty bash`, where Lightning does not use SLURM)."""
    from lightning_par.cli import launched_nodes

    for name in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    assert launched_nodes() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert launched_nodes() == (2, "SLURM_NNODES=2")
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")
    assert launched_nodes() is None
    for name, value in dict(TORCHELASTIC_RUN_ID="job", WORLD_SIZE="6", LOCAL_WORLD_SIZE="2", RANK="0",
                            LOCAL_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    assert launched_nodes() == (3, "torchrun: WORLD_SIZE=6, LOCAL_WORLD_SIZE=2")


@pytest.mark.launch(ranks=4, full=True)
def test_a_torchrun_agent_that_joins_grows_the_run_back(tmp_path, cache_dir, elastic_reference):
    """One agent starts the elastic job alone: pp2 on 2 ranks, accumulation 2 (8 samples per step), its steps slowed
    to 3 s. A second agent joins at step 4 or later: torchrun stops the workers (SIGTERM: they save at the step
    boundary) and restarts them on 4 ranks without counting a restart; the attempt knows it continues the run (its
    TORCHELASTIC_RUN_ID), re-derives dp2 x pp2 with accumulation 1, and its losses equal the uninterrupted 4-rank
    run's from the resumed step on -- within 5e-5, since here the steps before the join ran on another layout (pp2 on
    2 ranks, accumulating) and their rounding carries on, the more the later the agent joins (measured 3.5e-6 and
    1.6e-5; a wrong batch or accumulation moves the loss by 1e-2). torchrun's rendezvous store is not shared with the
    workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with it shared, the round after the join waited forever on this
    machine."""
    import time

    from tests.harness import free_port

    run = tmp_path / "run"
    run.mkdir()
    port = free_port()
    start = time.time()
    slow = ["--trainer.callbacks+=tests.probes.SlowSteps", "--trainer.callbacks.seconds=1.5",
            "--trainer.callbacks.world=2"]  # 3 s per step on 2 ranks: the second agent joins mid-run
    own = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs = [_agent(run, cache_dir, port, True, *slow, accumulate=2, env=own)]
    progress = run / "tb" / "lightning_logs" / "version_0" / "lightning_par_progress.json"
    while time.time() - start < 300:
        try:
            if json.loads(progress.read_text())["step"] >= 4:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    joined = time.time()
    procs.append(_agent(run, cache_dir, port, False, *slow, accumulate=2, env=own))
    codes = _wait(procs, 600)
    log = (run / "agent0.log").read_text()
    print(f"an agent joined at {joined - start:.0f} s: {time.time() - start:.0f} s in all, exit codes {codes}")
    assert codes == [0, 0], log[-4000:]
    assert "restart of this job after a node joined" in log, log[-4000:]
    line = re.search(r"lightning-par: attempt on 4 ranks \(the checkpoint's: 2\).*", log)
    assert line and "dp=2 x tp=1 x pp=2" in line.group(0) and "accumulate_grad_batches=1" in line.group(0), log[-4000:]
    print(line.group(0))
    resumed = int(re.search(r"at step (\d+);", line.group(0)).group(1))
    after, acc = _steps(tmp_path, "run")
    steps = list(range(resumed, ELASTIC_STEPS))
    assert acc == 1 and sorted(after) == steps and resumed >= 5
    diff = max_rel_diff([after[s] for s in steps], [elastic_reference[s] for s in steps])
    print(f"grown back to 4 ranks by an agent that joined: steps {resumed}-{ELASTIC_STEPS - 1} within {diff:.2e}")
    assert diff <= 5e-5  # (measured 3.5e-6 and 1.6e-5: the later the join, the more steps of pp2 rounding)
