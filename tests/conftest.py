"""Shared launches: each multi-rank run is made once per session (on first use) and checked by many tests."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness import Run, close_process_group, launch_cli, launch_matrix, launch_torchrun

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

# pipeline parallel: every schedule at pp=2 and pp=4 (one replica: each rank sees the whole batch of 8), and tied
# embeddings on the two ends of 4 ranks (1f1b) and on one rank holding both ends of a V (zbv). The `runs` fixture
# makes all of one size in one launch of tests/pipeline_matrix.py (the same job as `job`); the CLI arguments here
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
# dp x tp with accumulation and clipping, against single_accum_clip: replicas (stage 0) and FSDP2 2D (stage 3)
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
# (4 ranks), in the full run. tp2 x pp2 x cp2 (8 ranks) is in tests/hybrid3d_matrix.py.
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
# checkpoints, the planner. `pytest --full` (or LIGHTNING_PAR_FULL=1) adds the launches below, which repeat what the
# default set checks at more sizes or in more combinations (each is a multi-rank launch of 20-100 s on 2 cores).
#: runs of `RUNS` (and fixtures) made only in the full run; a test that needs one is skipped in the default run
FULL_ONLY_RUNS = {
    *(f"pp4_{s}" for s in PIPELINE_SCHEDULES), "pp4_tied_1f1b", "dp2_pp2_accum_clip", "single_kv4", "tp4", "tp4_sp",
    "dp2_tp2_sp", "tp2_sp_tied", "dp2_tp2_accum_clip", "zero3_dp2_tp2_accum_clip", "zero1_dp4_accum_clip",
    "zero2_dp4_accum_clip", "zero3_dp4_accum_clip", "zero2_offload_dp2", "hf_zero3_dict", "hf_tp2_dict", "multinode",
    "hybrid3d_8_ranks_full", "hybrid3d_4_ranks_full", "gpt2_untied_adamw", "plain_lm_tp2_sgd",
    *(name for name in CP_RUNS if name != "cp2_sgd"), "qwen2_single_sgd",
    "compile_matrix",  # compiled vs eager: ZeRO 0-3, tp2 (and SP), pp2 under each schedule, tp2 x pp2 (4 ranks)
    "lightning_contract_full",  # Lightning's contract under tp2 x pp2 (4 ranks), ZeRO-0 and ZeRO-2
    "readme_model_4_ranks",  # the README's recipe under tp2 x pp2 (tests/test_readme_model.py), ~35 s
}
#: tests (node id prefixes) that launch ranks themselves, run only in the full run
FULL_ONLY_TESTS = (
    "tests/test_checkpoint_safety.py::test_sigkill_of_every_rank_mid_save",
    "tests/test_faults.py::test_a_killed_rank_is_named_at_once_and_the_job_resumes",
    "tests/test_checkpoint_safety.py::test_a_stage0_single_file_checkpoint_resumes_under_zero3",
    "tests/test_hybrid3d.py::test_a_3d_checkpoint_resumes",
    "tests/test_hybrid3d.py::test_layouts_the_model_cannot_take",
    "tests/test_pipeline_strategy.py::test_bf16_true",
    "tests/test_pipeline_strategy.py::test_checkpoint_reshards",
    "tests/test_pipeline_strategy.py::test_a_batch_that_does_not_split",
    "tests/test_pipeline_strategy.py::test_resume_from_pipeline_checkpoint",
    "tests/test_tensor_parallel.py::test_a_layout_the_model_cannot_take",
    "tests/test_tp_any_model.py::test_lightning_par_fit_refuses_the_users_model_at_setup",
    "tests/test_tensor_parallel.py::test_validate_from_a_tensor_parallel_checkpoint",
    "tests/test_zero.py::test_resume_from_sharded_checkpoint",
    "tests/test_data_parallel.py::test_evaluation_from_checkpoint_reproduces_the_fit",
    "tests/test_data_parallel.py::test_predict_runs_forward_only_under_the_strategy",  # (pipeline predict stays)
    "tests/test_pipeline_timeline.py::test_measured_bubble",
    "tests/test_pipeline_zero.py",
    "tests/test_zero_3d.py",
    "tests/test_precision.py::test_bf16_mixed_tracks_fp32_over_50_steps",  # 5 fits of 50 steps, ~75 s
    "tests/test_precision.py::test_bf16_mixed_master_tracks_fp32_with_adamw_and_sgd",  # 11 fits of 20 steps, ~65 s
    "tests/test_reshard.py::test_bf16_mixed_resumes_from_its_fp32_master_weights[zero1_master_dp2]",  # ~45 s
    "tests/test_export.py::test_start_from_a_hf_directory_under_other_layouts",
    "tests/test_restart.py::test_the_readme_checkpoint_commands_work_as_written",  # 5 launches, 2-3 min
    "tests/test_context_parallel.py::test_a_model_with_local_positions_is_refused_at_setup_on_every_rank",
    "tests/test_compile.py::test_split_backward_weight_gradients_are_exact_with_inductor",  # a cold inductor compile
    "tests/test_peers.py::test_every_pair_trains_alike",  # 8 launches, about 90 s
    # moved to the full run to keep the default set near its budget (2026-11-26; each still covered by default:)
    "tests/test_gpu_check.py",  # the GPU check's CPU rehearsal, ~90 s (ran on an H200: docs/gpu.md)
    "tests/test_faults.py::test_a_frozen_rank_0_is_named",  # a frozen rank 1 stays in the default run
    "tests/test_data_parallel.py::test_per_step_loss_matches_single_process[dp4_run]",  # dp2 stays
    "tests/test_share_memory.py::test_each_rank_materialises_only_its_share[ZeRO-3, dp=4]",  # dp=2 stays
    "tests/test_share_memory.py::test_pretrained_weights_go_straight_into_the_shards[ZeRO-3, dp=4]",
    "tests/test_planned.py::test_planned_on_4_ranks",  # the planner's choices stay, in-process
    "tests/test_compat.py::test_import_on_an_untested_torch",  # the version table stays, in-process
    "tests/test_install.py::test_pipeline_demo_runs_without_the_extras",  # the installed-package test stays
    "tests/test_example_models.py::test_gpt_lightning_module_trains",  # trained by every parity launch
    "tests/test_example_models.py::test_mlp_lightning_module_trains",
    "tests/test_clean_exit.py::test_a_thread_inside_a_store_call_at_exit",  # CLI runs must still exit 0
    "tests/test_elastic.py::test_a_run_resumed_on_another_world_size",  # 3 launches (4, 2, 4 ranks), about 2 min
    "tests/test_elastic.py::test_two_torchrun_agents_one_lost",  # a reference, 2 agents, a SLURM requeue
    "tests/test_elastic.py::test_a_torchrun_agent_that_joins",  # 2 agents, the second joining mid-run
)


def full_run(config: pytest.Config) -> bool:
    return bool(config.getoption("--full") or os.environ.get("LIGHTNING_PAR_FULL"))


def need_full(config: pytest.Config, name: str) -> None:
    """Skip the calling test in the default run when it needs the full-run-only launch ``name``."""
    if name in FULL_ONLY_RUNS and not full_run(config):
        pytest.skip(f"{name}: a launch of the full run only (pytest --full)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="also run the launches that repeat the default set's checks at more sizes (about 45 min)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if full_run(config):
        return
    skip = pytest.mark.skip(reason="a launch of the full run only (pytest --full)")
    for item in items:
        if item.nodeid.startswith(FULL_ONLY_TESTS):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _environment_as_found():
    """Each test leaves ``os.environ`` as it found it: an in-process Trainer sets LOCAL_RANK, NODE_RANK, MASTER_PORT
    and PL_GLOBAL_SEED there, and a later launch that inherited LOCAL_RANK hung at "Initializing distributed"
    (Lightning took it for an already-started rank; seen in the default run, 2026-11-26)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


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


@pytest.fixture(scope="session")
def runs(tmp_path_factory, cache_dir, request):
    """``runs(name)``: the finished launch of ``RUNS[name]``, made on first request."""
    done: dict[str, Run] = {}

    def get(name: str, extra: list[str] | None = None) -> Run:
        need_full(request.config, name)
        pp = next((p for p, names in PIPELINE_MATRIX.items() if name in names), None)
        if pp is not None and name not in done:
            # every schedule of one pipeline size in one launch: one start-up instead of eight
            root = tmp_path_factory.mktemp(f"pipeline_matrix_pp{pp}")
            args = ["--root", str(root), "--cache", str(cache_dir), "--pp", str(pp),
                    "--schedules", *PIPELINE_SCHEDULES, "--checkpoint", "1f1b", "--tied", PIPELINE_TIED[pp]]
            matrix = launch_matrix(root, cache_dir, "tests.pipeline_matrix", args, nproc=pp).check()
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
def multinode_run(tmp_path_factory, cache_dir, request) -> Run:
    """2 nodes x 2 ranks through torchrun over loopback."""
    need_full(request.config, "multinode")
    root = tmp_path_factory.mktemp("multinode")
    return launch_torchrun(root, cache_dir, [*job(GLOBAL_BATCH // 4), "--trainer.strategy=zero0"],
                           nnodes=2, nproc_per_node=2).check()


@pytest.fixture(scope="session")
def hybrid3d_matrix(tmp_path_factory, cache_dir, request):
    """``matrix(name)``: ``(Run, per-rank reports)`` of a case; each rank count's cases in one launch, on first use
    (the 8-rank launch, and the cases marked ``full``, in a launch of the full run only). Shared by the 3D tests and
    the reshard matrix."""
    from tests.hybrid3d_matrix import CASES

    out: dict[str, tuple[Run, list[dict]]] = {}

    def get(name: str) -> tuple[Run, list[dict]]:
        devices, full = CASES[name].devices, CASES[name].full or CASES[name].devices == 8
        if full:
            need_full(request.config, f"hybrid3d_{devices}_ranks_full")
        if name not in out:
            names = [n for n, case in CASES.items()
                     if case.devices == devices and (case.full or case.devices == 8) == full]
            root = tmp_path_factory.mktemp(f"hybrid3d_{devices}{'_full' if full else ''}")
            run = launch_matrix(root, cache_dir, "tests.hybrid3d_matrix",
                                ["--root", str(root), "--cache", str(cache_dir), "--cases", *names], nproc=devices,
                                timeout=900).check()
            print(f"3D matrix: {len(names)} layouts on {devices} ranks in {run.seconds:.0f} s")
            for n in names:
                reports = [json.loads((root / n / f"rank{r}.json").read_text()) for r in range(devices)]
                out[n] = (Run(root / n, 0, run.log, run.seconds), reports)
        return out[name]

    return get
