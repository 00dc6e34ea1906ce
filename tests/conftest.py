"""Shared launches: each multi-rank run is made once per session (on first use) and checked by many tests."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

from tests import harness
from tests.harness import Run, close_process_group, launch_cli, launch_cli_group, launch_matrix, launch_torchrun

PARITY_STEPS = 20
EPOCH_STEPS = 10  # two short epochs: checkpoints at the epoch boundary make resumption exact
GLOBAL_BATCH = 8
CLIP = 0.5
SGD_LR = 0.2  # plain SGD runs (no momentum, no clipping): a gradient off by a constant factor moves the loss


def job(batch: int, accumulate: int = 1, clip: bool = False) -> list[str]:
    """The common 20-step job with a per-rank batch; optionally gradient accumulation and clipping."""
    args = [f"--trainer.max_steps={PARITY_STEPS}", f"--data.batch_size={batch}", "--trainer.limit_val_batches=2",
            f"--trainer.limit_train_batches={EPOCH_STEPS * accumulate}",
            f"--trainer.accumulate_grad_batches={accumulate}",
            "--trainer.callbacks+=tests.probes.GradNorms",
            "--sample_tokens=0"]  # the text sampled after fit: only where a test reads it (it costs seconds per rank)
    return args + ([f"--trainer.gradient_clip_val={CLIP}"] if clip else [])


def probes(root) -> list[str]:
    """Keep every checkpoint, and measure traffic and state bytes of optimizer step 3 on every rank."""
    return ["--trainer.enable_checkpointing=true", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.save_top_k=-1", f"--trainer.callbacks.dirpath={root / 'ckpt'}",
            "--trainer.callbacks+=tests.probes.StateReport", f"--trainer.callbacks.path={root / 'reports'}"]


#: name -> (devices, arguments); launched lazily by the `runs` fixture
RUNS: dict[str, tuple[int, list[str]]] = {
    "single": (1, [*job(GLOBAL_BATCH), "--trainer.strategy=auto", "--sample_tokens=24"]),
    # the one-process reference of the runs with accumulation: each optimizer step's whole batch at once (the same
    # gradient), clipped. Under accumulation lightning-par logs the step's loss, the mean over its micro-batches --
    # this run's loss -- where Lightning's own single device logs the last micro-batch's. One validation batch of
    # the whole batch: the samples of the accumulating runs' two
    "single_clip": (1, [*job(GLOBAL_BATCH, clip=True), "--trainer.strategy=auto", "--trainer.limit_val_batches=1"]),
    "dp2": (2, [*job(GLOBAL_BATCH // 2), "--trainer.strategy=zero0", "--trainer.enable_checkpointing=true"]),
    "dp4": (4, [*job(GLOBAL_BATCH // 4), "--trainer.strategy=lightning_par.ZeroStrategy",
                "--trainer.strategy.stage=0"]),
}
for _stage in (1, 2, 3):
    RUNS[f"zero{_stage}_dp2"] = (2, [*job(GLOBAL_BATCH // 2), f"--trainer.strategy=zero{_stage}"])
    RUNS[f"zero{_stage}_dp4_accum_clip"] = (
        4, [*job(GLOBAL_BATCH // 8, accumulate=2, clip=True), f"--trainer.strategy=zero{_stage}"])
RUNS["zero2_offload_dp2"] = (2, [*job(GLOBAL_BATCH // 2), "--trainer.strategy=zero2_offload"])

# pipeline parallel: every schedule at pp=2 and pp=4 (one replica: each rank sees the whole batch of 8), and tied
# embeddings on the two ends of 4 ranks (1f1b) and on one rank holding both ends of a V (zbv). The `runs` fixture
# makes all of one size in one launch of tests/launch/pipeline_matrix.py (the same job as `job`); the CLI arguments here
# serve the launches that continue from their checkpoints.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev")
PIPELINE_TIED = {2: "zbv", 4: "1f1b"}
PIPELINE_MATRIX = {pp: [*(f"pp{pp}_{s}" for s in PIPELINE_SCHEDULES), f"pp{pp}_tied_{PIPELINE_TIED[pp]}"]
                   for pp in (2, 4)}
for _pp in (2, 4):
    for _schedule in PIPELINE_SCHEDULES:
        RUNS[f"pp{_pp}_{_schedule}"] = (_pp, [*job(GLOBAL_BATCH), f"--trainer.strategy=pipeline{_pp}_{_schedule}"])
RUNS["dp2_pp2_accum_clip"] = (4, [*job(GLOBAL_BATCH // 4, accumulate=2, clip=True),
                                  "--trainer.strategy=lightning_par.PipelineStrategy", "--trainer.strategy.pp=2",
                                  "--trainer.strategy.schedule=zero_bubble", "--trainer.strategy.n_microbatches=2"])
RUNS["single_tied"] = (1, [*job(GLOBAL_BATCH), "--trainer.strategy=auto", "--model.tie_embeddings=true"])
SGD = ["--model.optimizer=sgd", f"--model.lr={SGD_LR}"]
RUNS["single_sgd"] = (1, [*job(GLOBAL_BATCH), "--trainer.strategy=auto", *SGD])
RUNS["single_tied_sgd"] = (1, [*job(GLOBAL_BATCH), "--trainer.strategy=auto", "--model.tie_embeddings=true", *SGD])
# the engine matrix's model (weights drawn per rank unless the engine syncs them), plain SGD:
# tests/launch/test_engine.py
RUNS["single_rank_seeded_sgd"] = (1, [*job(GLOBAL_BATCH), "--trainer.strategy=auto",
                                      "--model=tests.launch.engine_matrix.RankSeededGPT"])

# tensor parallel: the tp ranks of one replica all see the replica's batch (GLOBAL_BATCH / dp). tp=4 needs 4 kv heads
# (the tiny preset has 2), so it has its own single-process reference. Only tp2_sp samples text after fit (generation
# under tensor + sequence parallelism, 24 tokens): sampling is most of a tensor-parallel launch's time on CPU.
KV4 = ["--model.n_kv_heads=4"]
HF_LLAMA = ["--model=lightning_par.examples.HFLlamaLightningModule", "--model.n_layers=4", "--model.n_kv_heads=2"]


def tp_job(batch: int, strategy: str, *extra: str, accumulate: int = 1, clip: bool = False) -> list[str]:
    return [*job(batch, accumulate, clip), f"--trainer.strategy={strategy}", *extra]


RUNS["single_kv4"] = (1, tp_job(GLOBAL_BATCH, "auto", *KV4))
RUNS["tp2"] = (2, tp_job(GLOBAL_BATCH, "megatron_tp2", "--trainer.enable_model_summary=true"))  # its line: test_logs
RUNS["tp4"] = (4, tp_job(GLOBAL_BATCH, "megatron_tp4", *KV4))
RUNS["tp2_sp"] = (2, tp_job(GLOBAL_BATCH, "megatron_tp2_sp", "--sample_tokens=24"))
RUNS["tp4_sp"] = (4, tp_job(GLOBAL_BATCH, "megatron_tp4_sp", *KV4))
RUNS["dp2_tp2_sp"] = (4, tp_job(GLOBAL_BATCH // 2, "megatron_tp2_sp"))
RUNS["tp2_sp_tied"] = (2, tp_job(GLOBAL_BATCH, "megatron_tp2_sp", "--model.tie_embeddings=true"))
# dp x tp with accumulation and clipping, against single_clip (the same steps in one process): replicas (stage 0)
# and FSDP2 2D (stage 3)
RUNS["dp2_tp2_accum_clip"] = (4, tp_job(GLOBAL_BATCH // 4, "megatron_tp2", accumulate=2, clip=True))
RUNS["zero3_dp2_tp2_accum_clip"] = (4, tp_job(GLOBAL_BATCH // 4, "megatron_tp2_zero3", accumulate=2, clip=True))
RUNS["hf_single"] = (1, tp_job(GLOBAL_BATCH, "auto", *HF_LLAMA))
RUNS["hf_tp2"] = (2, tp_job(GLOBAL_BATCH, "megatron_tp2", *HF_LLAMA))
# batches as Hugging Face collators make them ({input_ids, labels, attention_mask}), against the tuple-batch reference
HF_DICT = [*HF_LLAMA, "--data.batch_format=dict"]
RUNS["hf_zero3_dict"] = (2, tp_job(GLOBAL_BATCH // 2, "zero3", *HF_DICT))
RUNS["hf_tp2_dict"] = (2, tp_job(GLOBAL_BATCH, "megatron_tp2", *HF_DICT))

# context parallel (each sequence split over cp ranks): the example GPT with SGD in the default run (6 steps, against
# single_sgd's first 6); Hugging Face Llama (tuple batches, AdamW) and Qwen2 (dict batches, SGD), and cp2 x ZeRO-3 dp2
# (4 ranks), in the full run (one epoch: ONE_EPOCH_RUNS). tp2 x pp2 x cp2 (8 ranks) is in
# tests/launch/hybrid3d_matrix.py.
CP_STEPS = 6
QWEN2 = ["--model=lightning_par.examples.HFCausalLMLightningModule", "--model.arch=qwen2", "--model.n_layers=4",
         "--model.n_kv_heads=2"]
RUNS["cp2_sgd"] = (2, [*tp_job(GLOBAL_BATCH, "context_parallel2", *SGD), f"--trainer.max_steps={CP_STEPS}"])
RUNS["hf_cp2"] = (2, tp_job(GLOBAL_BATCH, "context_parallel2", *HF_LLAMA))
RUNS["qwen2_single_sgd"] = (1, tp_job(GLOBAL_BATCH, "auto", *QWEN2, *SGD))
RUNS["qwen2_cp2_dict_sgd"] = (2, tp_job(GLOBAL_BATCH, "context_parallel2", *QWEN2, *SGD, "--data.batch_format=dict"))
_CP_ZERO3 = ["--trainer.strategy.zero_stage=3"]
RUNS["zero3_dp2_cp2_sgd"] = (4, tp_job(GLOBAL_BATCH // 2, "context_parallel2", *_CP_ZERO3, *SGD))
RUNS["hf_zero3_dp2_cp2_dict"] = (4, tp_job(GLOBAL_BATCH // 2, "context_parallel2", *_CP_ZERO3, *HF_DICT))
RUNS["qwen2_zero3_dp2_cp2_sgd"] = (4, tp_job(GLOBAL_BATCH // 2, "context_parallel2", *_CP_ZERO3, *QWEN2, *SGD))
CP_RUNS = {"cp2_sgd": "single_sgd", "hf_cp2": "hf_single", "qwen2_cp2_dict_sgd": "qwen2_single_sgd",
           "zero3_dp2_cp2_sgd": "single_sgd", "hf_zero3_dp2_cp2_dict": "hf_single",
           "qwen2_zero3_dp2_cp2_sgd": "qwen2_single_sgd"}  # run -> its single-process reference


# -- the default run and the full run -----------------------------------------------------------------------------
# CI runs the default set in under 15 minutes on 2 cores: every strategy and 3D at parity, the engine's guarantees,
# checkpoints, the planner. `pytest --full` (or LIGHTNING_PAR_FULL=1) adds the launches that repeat what the default
# set checks at more sizes or in more combinations (each a multi-rank launch of 20-100 s on 2 cores).
#
# A test that starts processes says so: ``@pytest.mark.launch(ranks=N)`` (N: the most processes one of its launches
# starts), ``full=True`` for the full run only -- on the test, or on one case (``pytest.param(..., marks=...)``). The
# harness's launch functions fail a test that launches without the marker, or more ranks than it declares; a test
# that uses a run of `RUNS` or a shared launch fixture needs the marker even when another test made the launch. What
# is full-only is the markers: ``pytest --collect-only -q -m "launch and full"`` lists it (tests/README.md).
#: runs of `RUNS` (and shared launches) of the full run only: a test that uses one must be marked ``full=True``
FULL_ONLY_RUNS = {
    *(f"pp4_{s}" for s in PIPELINE_SCHEDULES), "pp4_tied_1f1b", "dp2_pp2_accum_clip", "single_kv4", "tp4", "tp4_sp",
    "dp2_tp2_sp", "tp2_sp_tied", "dp2_tp2_accum_clip", "zero3_dp2_tp2_accum_clip", "zero1_dp4_accum_clip",
    "zero2_dp4_accum_clip", "zero3_dp4_accum_clip", "zero2_offload_dp2", "hf_zero3_dict", "hf_tp2_dict", "multinode",
    "hybrid3d_8_ranks_full", "hybrid3d_4_ranks_full", "gpt2_untied_adamw", "plain_lm_tp2_sgd",
    *(name for name in CP_RUNS if name != "cp2_sgd"), "qwen2_single_sgd",
    "compile_matrix",  # compiled vs eager: ZeRO 0-3, tp2 (and SP), pp2 under each schedule, tp2 x pp2 (4 ranks)
    "lightning_contract_4_ranks_full",  # Lightning's contract under tp2 x pp2 and cp2 x pp2 (4 ranks)
    "lightning_contract_2_ranks_full",  # ... and under ZeRO-0, ZeRO-2 and cp2, beside the default set's 2-rank layouts
    "readme_model_4_ranks",  # the README's recipe under tp2 x pp2 (tests/launch/test_readme_model.py), ~35 s
}
#: ranks of the shared launches that are not in `RUNS`
OTHER_LAUNCHES = {"multinode": 4, "hybrid3d_8_ranks_full": 8, "hybrid3d_4_ranks_full": 4, "hybrid3d_8": 8,
                  "hybrid3d_4": 4, "compile_matrix": 4, "lightning_contract_4_ranks_full": 4,
                  "lightning_contract_2_ranks_full": 2, "readme_model_4_ranks": 4,
                  "gpt2_untied_adamw": 2, "plain_lm_tp2_sgd": 2,
                  **{f"pp{pp}_tied_{schedule}": pp for pp, schedule in PIPELINE_TIED.items()}}


def launch_of(*names: str, ranks: int = 1, full: bool = False) -> pytest.MarkDecorator:
    """The marker of a test that uses the runs ``names`` (of `RUNS`, or a shared launch of `OTHER_LAUNCHES`): their
    most ranks (at least ``ranks``, for a launch of its own), full-only if one of them is (or ``full``)."""
    ranks = max(ranks, *(RUNS[n][0] if n in RUNS else OTHER_LAUNCHES[n] for n in names))
    return pytest.mark.launch(ranks=ranks, full=full or any(n in FULL_ONLY_RUNS for n in names))


def run_cases(names, *shared: str) -> list:
    """``parametrize`` values, one per run of ``names``, each marked for that run and the runs ``shared`` by every
    case (its reference). ``names``: run names, or (value, run name or names) pairs."""
    cases = []
    for entry in names:
        value, used = (entry, (entry,)) if isinstance(entry, str) else entry
        used = (used,) if isinstance(used, str) else tuple(used)
        cases.append(pytest.param(*value if isinstance(value, tuple) else (value,),
                                  marks=launch_of(*used, *shared)))
    return cases


def full_run(config: pytest.Config) -> bool:
    return bool(config.getoption("--full") or os.environ.get("LIGHTNING_PAR_FULL"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="also run the tests marked launch(full=True): launches that repeat the default set's "
                          "checks at more sizes (about an hour on 2 cores)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "launch(ranks, full=False): the test starts up to `ranks` processes (training runs, torchrun "
                   "agents, spawned gloo ranks); full=True: only in the full run (--full or LIGHTNING_PAR_FULL=1)")
    config.addinivalue_line(
        "markers", "full: a test that launches nothing, only in the full run (an in-process fit kept out of the "
                   "default set for time)")


def _launch_marker(item: pytest.Item) -> tuple[int, bool] | None:
    marker = item.get_closest_marker("launch")
    if marker is None:
        return None
    ranks, full = marker.kwargs.get("ranks"), marker.kwargs.get("full", False)
    if marker.args or not isinstance(ranks, int) or ranks < 1 or not isinstance(full, bool) or \
            set(marker.kwargs) - {"ranks", "full"}:
        raise pytest.UsageError(f"{item.nodeid}: write the marker as launch(ranks=N, full=False), not {marker}")
    return ranks, full


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="the full run only (pytest --full)")
    for item in items:
        declared = _launch_marker(item)
        if declared and item.get_closest_marker("full"):
            raise pytest.UsageError(f"{item.nodeid}: a launching test says full-only as launch(..., full=True)")
        if declared and item.path.parent.name == "unit":
            raise pytest.UsageError(f"{item.nodeid} launches ranks: its file belongs in tests/launch/")
        full_only = item.get_closest_marker("full") is not None or (declared is not None and declared[1])
        if full_only and not full_run(config):
            item.add_marker(skip)


# -- the rule's guard: a test that launches carries the marker --------------------------------------------------------
#: (baseid, name) of the shared fixtures (module or session scope) that launched: every test using one is checked
_launching_fixtures: set[tuple[str, str]] = set()
_fixtures_being_set_up: list[pytest.FixtureDef] = []


class LaunchRuleError(Exception):
    """A test launches processes and does not say so (see "the default run and the full run" in tests/conftest.py)."""


def _check(item: pytest.Item, ranks: int, what: str, full: bool = False) -> None:
    declared = _launch_marker(item)
    if declared is None:
        raise LaunchRuleError(f"{item.nodeid} {what} {ranks} rank(s) without a launch marker: "
                              f"decorate it with @pytest.mark.launch(ranks={ranks})")
    if ranks > declared[0]:
        raise LaunchRuleError(f"{item.nodeid} {what} {ranks} ranks but is marked launch(ranks={declared[0]})")
    if full and not declared[1]:
        raise LaunchRuleError(f"{item.nodeid} {what} a launch of the full run: mark it launch(..., full=True)")


def uses_run(name: str) -> None:
    """Check the running test's marker against the shared launch ``name`` (its ranks, and whether it is full-only),
    whether or not this test is the one that makes it."""
    if _running:
        ranks = RUNS[name][0] if name in RUNS else OTHER_LAUNCHES[name]
        _check(_running[-1], ranks, f"uses the run {name!r} of", full=name in FULL_ONLY_RUNS)


_running: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    def guard(ranks: int) -> None:
        _check(item, ranks, "launches")
        _launching_fixtures.update((f.baseid, f.argname) for f in _fixtures_being_set_up if f.scope != "function")
        _launching_fixtures.update(_getters_on_stack(item))

    harness.launch_guard = guard
    _running.append(item)
    try:
        return (yield)
    finally:
        harness.launch_guard = None
        _running.pop()


def _getters_on_stack(item: pytest.Item) -> set[tuple[str, str]]:
    """Shared fixtures that hand out a getter launching on first use (``runs(name)``): (baseid, name) of each whose
    getter is on the call stack now, so the tests that later get a cached run from it are checked too."""
    found = set()
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_qualname.split(".<locals>.", 1)[0]
        if ".<locals>." in frame.f_code.co_qualname and name in item.fixturenames:
            module = Path(frame.f_code.co_filename).resolve()
            baseid = module.relative_to(item.config.rootpath).as_posix()
            found.add((baseid.removesuffix("/conftest.py") if module.name == "conftest.py" else baseid, name))
        frame = frame.f_back
    return found


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request):
    _fixtures_being_set_up.append(fixturedef)
    try:
        return (yield)
    finally:
        _fixtures_being_set_up.pop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """A test that reuses a shared fixture's launch carries the marker as its first user did."""
    if _launch_marker(item) is None:
        for baseid, name in _launching_fixtures:
            if name in item.fixturenames and item.nodeid.startswith(baseid):
                raise LaunchRuleError(f"{item.nodeid} uses {name!r}, a fixture that launches ranks, without a launch "
                                      f"marker: decorate it with @pytest.mark.launch(ranks=N)")


@pytest.fixture(autouse=True)
def _environment_as_found():
    """Each test leaves ``os.environ`` as it found it: an in-process Trainer sets LOCAL_RANK, NODE_RANK, MASTER_PORT
    and PL_GLOBAL_SEED there, and a later launch that inherited LOCAL_RANK hung at "Initializing distributed"
    (Lightning took it for an already-started rank; seen in the default run, 2026-11-26). And the default process
    group: an in-process Trainer under a lightning-par strategy starts one, which a later test would find
    ("trying to initialize the default process group twice"); one a module fixture started is left to it."""
    import torch.distributed as dist

    saved, had_group = dict(os.environ), dist.is_initialized()
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
    if not had_group and dist.is_initialized():
        close_process_group()


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone (world size 1), for in-process tests of code that communicates."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        close_process_group()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


#: runs of `RUNS` made together, one after another in one launch (tests/launch/cli_matrix.py: one start-up instead of
#: one each), on the first request of any: the single-process references of the parity tests, the 2-rank runs (the ZeRO
#: matrix, tensor and context parallel) and the full set's 4-rank runs. A member of the full run only joins its
#: launch in the full run. Under torchrun (TorchElasticEnvironment): dp4 stays a launch of its own, the default
#: set's run through Lightning's own launcher (LightningEnvironment, tests/launch/test_data_parallel.py).
SHARED_LAUNCHES = {
    "references": ("single", "single_clip", "single_tied", "single_sgd", "single_tied_sgd", "hf_single",
                   "single_rank_seeded_sgd", "single_kv4", "qwen2_single_sgd"),
    "two_ranks": ("dp2", "zero1_dp2", "zero2_dp2", "zero3_dp2", "zero2_offload_dp2", "tp2", "tp2_sp", "hf_tp2",
                  "tp2_sp_tied", "hf_zero3_dict", "hf_tp2_dict", "cp2_sgd", "hf_cp2", "qwen2_cp2_dict_sgd"),
    "four_ranks": ("zero1_dp4_accum_clip", "zero2_dp4_accum_clip", "zero3_dp4_accum_clip", "tp4", "tp4_sp",
                   "dp2_tp2_sp", "dp2_tp2_accum_clip", "zero3_dp2_tp2_accum_clip", "dp2_pp2_accum_clip",
                   "zero3_dp2_cp2_sgd", "hf_zero3_dp2_cp2_dict", "qwen2_zero3_dp2_cp2_sgd"),
}

#: the full run's fits of 4 ranks (one launch) and its context-parallel fits train one epoch, against their references'
#: first 10 steps (``steps_of``): at 4 ranks on 2 cores their steps, not the start-up, are most of the launch (at 20
#: steps the 4-rank launch took 135 s); the default set's runs train two epochs
ONE_EPOCH_RUNS = {*SHARED_LAUNCHES["four_ranks"], "hf_cp2", "qwen2_cp2_dict_sgd"}
assert ONE_EPOCH_RUNS <= FULL_ONLY_RUNS
for _name in ONE_EPOCH_RUNS:
    RUNS[_name] = (RUNS[_name][0], [*RUNS[_name][1], f"--trainer.max_steps={EPOCH_STEPS}"])


def steps_of(name: str) -> int:
    """The optimizer steps the run ``name`` of ``RUNS`` trains (its last ``--trainer.max_steps``)."""
    return int([a for a in RUNS[name][1] if a.startswith("--trainer.max_steps=")][-1].split("=", 1)[1])


@pytest.fixture(scope="session")
def runs(tmp_path_factory, cache_dir, request):
    """``runs(name)``: the finished launch of ``RUNS[name]``, made on first request."""
    done: dict[str, Run] = {}

    def get(name: str, extra: list[str] | None = None) -> Run:
        uses_run(name)
        group = next((g for g, names in SHARED_LAUNCHES.items() if name in names), None)
        if group is not None and name not in done and not extra:
            members = [n for n in SHARED_LAUNCHES[group] if full_run(request.config) or n not in FULL_ONLY_RUNS]
            root = tmp_path_factory.mktemp(group)
            jobs = {n: [*RUNS[n][1], *probes(root / n)] for n in members if n not in done}
            group_runs = launch_cli_group(root, cache_dir, jobs, devices=RUNS[name][0], timeout=300 * len(jobs))
            print(f"{group}: {len(jobs)} runs in one launch, {next(iter(group_runs.values())).seconds:.0f} s")
            done.update(group_runs)
        pp = next((p for p, names in PIPELINE_MATRIX.items() if name in names), None)
        if pp is not None and name not in done:
            # every schedule of one pipeline size in one launch: one start-up instead of eight
            root = tmp_path_factory.mktemp(f"pipeline_matrix_pp{pp}")
            args = ["--root", str(root), "--cache", str(cache_dir), "--pp", str(pp),
                    "--schedules", *PIPELINE_SCHEDULES, "--checkpoint", "1f1b", "--tied", PIPELINE_TIED[pp]]
            matrix = launch_matrix(root, cache_dir, "tests.launch.pipeline_matrix", args, nproc=pp).check()
            for run_name in PIPELINE_MATRIX[pp]:
                done[run_name] = Run(root / run_name, 0, matrix.log, matrix.seconds)
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
    uses_run("multinode")
    root = tmp_path_factory.mktemp("multinode")
    return launch_torchrun(root, cache_dir, [*job(GLOBAL_BATCH // 4), "--trainer.strategy=zero0"],
                           nnodes=2, nproc_per_node=2).check()


@pytest.fixture(scope="session")
def hybrid3d_matrix(tmp_path_factory, cache_dir):
    """``matrix(name)``: ``(Run, per-rank reports)`` of a case; each rank count's cases in one launch, on first use
    (the 8-rank launch, and the cases marked ``full``, in a launch of the full run only). Shared by the 3D tests and
    the reshard matrix."""
    from tests.launch.hybrid3d_matrix import CASES

    out: dict[str, tuple[Run, list[dict]]] = {}

    def get(name: str) -> tuple[Run, list[dict]]:
        devices, full = CASES[name].devices, CASES[name].full or CASES[name].devices == 8
        uses_run(f"hybrid3d_{devices}_ranks_full" if full else f"hybrid3d_{devices}")
        if name not in out:
            names = [n for n, case in CASES.items()
                     if case.devices == devices and (case.full or case.devices == 8) == full]
            root = tmp_path_factory.mktemp(f"hybrid3d_{devices}{'_full' if full else ''}")
            run = launch_matrix(root, cache_dir, "tests.launch.hybrid3d_matrix",
                                ["--root", str(root), "--cache", str(cache_dir), "--cases", *names], nproc=devices,
                                timeout=900).check()
            print(f"3D matrix: {len(names)} layouts on {devices} ranks in {run.seconds:.0f} s")
            for n in names:
                reports = [json.loads((root / n / f"rank{r}.json").read_text()) for r in range(devices)]
                out[n] = (Run(root / n, 0, run.log, run.seconds), reports)
        return out[name]

    return get
