"""The figures a GPU run logs, checked on CPU with the CUDA device faked: MFU's peak by device name and TF32, the
planner's preset for the detected GPU, the pipeline timeline on CUDA events, tokens/s timed after a device sync,
the memory peaks per window. Nothing here has run on a GPU."""

from __future__ import annotations

import os
import types
import warnings

import pytest
import torch

import lightning_par.callbacks as callbacks
from lightning_par.callbacks import MemoryPerRank, TokensPerSecond, cuda_run_peak_bytes
from lightning_par.parallel.pipeline.timeline import ScheduleRecorder
from lightning_par.planner.hardware import GPUS, PRESETS, detect_gpu, load_hardware
from lightning_par.strategies.planned import default_hardware
from lightning_par.utilization import peak_flops, tf32_matmuls

CUDA = torch.device("cuda", 0)
H100_SXM = "NVIDIA H100 80GB HBM3"  # what CUDA calls the SXM5 card


@pytest.fixture
def gpu_name(monkeypatch):
    """Set the name ``torch.cuda.get_device_name`` gives."""
    def set_name(name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return set_name


@pytest.fixture
def tf32(monkeypatch):
    """TF32 as the three settings say: the legacy flag, the new one, the float32 matmul precision."""
    def set_tf32(allow: bool = False, new: str = "none", precision: str = "highest") -> None:
        monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(allow_tf32=allow, fp32_precision=new))
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: precision)
    set_tf32()
    return set_tf32


# -- 1. MFU's peak -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "key"), [
    (H100_SXM, "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA A100-SXM4-40GB", "a100-sxm"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm"), ("NVIDIA A100-PCIE-40GB", "a100-pcie"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie"), ("NVIDIA L40S", "l40s"), ("NVIDIA B200", "b200"),
    ("NVIDIA L40", None), ("NVIDIA GB200", None), ("Tesla T4", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_gpu_names(name, key):
    assert detect_gpu(name) is (GPUS[key] if key else None)


def test_dense_peaks_per_dtype(gpu_name, tf32):
    """Dense datasheet peaks (sparse / 2) per device and dtype, times the world size."""
    def peak(precision: str, world: int = 1) -> float | None:
        found = peak_flops(CUDA, precision, world_size=world, local_ranks=world, num_nodes=1)
        return None if found is None else found.flops

    gpu_name(H100_SXM)
    assert peak("bf16-mixed", 8) == 8 * 989e12 and peak("16-mixed") == 989e12 and peak("bf16-true") == 989e12
    assert peak("32-true") == 67e12  # TF32 off: the CUDA cores
    gpu_name("NVIDIA H100 PCIe")  # no longer the SXM's 989
    assert peak("bf16-mixed") == 756e12 and peak("32-true") == 51e12
    gpu_name("NVIDIA H100 NVL")
    assert peak("bf16-mixed") == 835e12
    gpu_name("NVIDIA H200")
    assert peak("bf16-mixed") == 989e12
    gpu_name("NVIDIA A100 80GB PCIe")
    assert peak("bf16-mixed") == 312e12 and peak("32-true") == 19.5e12
    gpu_name("NVIDIA L40S")
    assert peak("bf16-mixed") == 362e12 and peak("32-true") == 91.6e12
    gpu_name("NVIDIA B200")
    assert peak("bf16-mixed") == 2250e12 and peak("32-true") == 75e12
    gpu_name("Tesla T4")
    assert peak("bf16-mixed") is None
    assert peak_flops(CUDA, "bf16-mixed", 2, 2, 1, per_device=65e12).flops == 130e12  # given: any GPU


@pytest.mark.parametrize("setting", [dict(precision="high"), dict(precision="medium"), dict(allow=True),
                                     dict(new="tf32")])
def test_fp32_peak_is_the_tf32_one_when_tf32_is_on(gpu_name, tf32, setting):
    gpu_name(H100_SXM)
    tf32(**setting)
    found = peak_flops(CUDA, "32-true", world_size=2, local_ranks=2, num_nodes=1)
    assert found.flops == 2 * 494.5e12 and "tf32" in found.source
    gpu_name("NVIDIA A100-SXM4-80GB")
    assert peak_flops(CUDA, "32-true", 1, 1, 1).flops == 156e12
    assert peak_flops(CUDA, "bf16-mixed", 1, 1, 1).flops == 312e12  # TF32 does not touch bf16


def test_tf32_reads_torchs_own_settings():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not tf32_matmuls()
        torch.set_float32_matmul_precision("high")
        assert tf32_matmuls()
    finally:
        torch.set_float32_matmul_precision(before)


def _trainer(device: torch.device, precision: str = "bf16-mixed", **more):
    strategy = types.SimpleNamespace(root_device=device, distributed_sampler_kwargs={})
    fields = dict(precision=precision, world_size=1, num_devices=1, num_nodes=1, is_global_zero=True, loggers=[],
                  global_step=0, accumulate_grad_batches=1)
    return types.SimpleNamespace(strategy=strategy, **{**fields, **more})


def test_mfu_on_a_known_gpu_and_one_warning_on_an_unknown_one(gpu_name, tf32):
    batch = torch.zeros(2, 16, dtype=torch.long)
    gpu_name(H100_SXM)
    known = TokensPerSecond(flops_per_token=6e9)
    assert known._scale(_trainer(CUDA), None, batch) == pytest.approx(6e9 / 989e12, rel=1e-12)
    gpu_name("Tesla T4")
    unknown = TokensPerSecond(flops_per_token=6e9)
    with pytest.warns(UserWarning) as caught:
        assert unknown._scale(_trainer(CUDA), None, batch) == 0.0
    (message,) = [str(w.message) for w in caught]
    assert "Tesla T4" in message and "--tokens_per_sec.peak_flops=FLOPS" in message
    assert "TokensPerSecond(peak_flops=FLOPS)" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: not again at the next window
        assert unknown._scale(_trainer(CUDA), None, batch) == 0.0
    given = TokensPerSecond(flops_per_token=6e9, peak_flops=100e12)
    assert given._scale(_trainer(CUDA), None, batch) == pytest.approx(6e9 / 100e12)


# -- 2. the planner's hardware on CUDA ---------------------------------------------------------------------------
def test_h200_preset():
    h200, h100 = load_hardware("h200"), PRESETS["h100-sxm"]
    assert h200.peak_flops == h100.peak_flops and h200.intra_node_bandwidth == h100.intra_node_bandwidth
    assert h200.memory_bandwidth == pytest.approx(4.8e12 * 0.8) and h200.memory_gib > 139
    assert h200.memory_bandwidth > h100.memory_bandwidth


def test_planned_strategy_plans_with_the_detected_gpu(gpu_name, recwarn):
    assert default_hardware(torch.device("cpu")) == "cpu"
    for name, preset in [(H100_SXM, "h100-sxm"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100")]:
        gpu_name(name)
        assert default_hardware(CUDA) == preset
    assert not recwarn.list, [str(w.message) for w in recwarn.list]
    for name, preset in [("NVIDIA H100 PCIe", "h100-sxm"), ("NVIDIA A100 80GB PCIe", "a100"),
                         ("NVIDIA L40S", "a100"), ("NVIDIA B200", "h200"), ("Tesla T4", "h100-sxm")]:
        gpu_name(name)
        with pytest.warns(UserWarning, match="strategy.hardware=") as caught:
            assert default_hardware(CUDA) == preset
        assert name in str(caught[0].message)


# -- 3. the pipeline timeline on CUDA events ---------------------------------------------------------------------
class _DeviceClock:
    """A fake CUDA device: kernels advance its clock, events read it, the host clock never moves with it."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.syncs = 0
        clock = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at: float | None = None

            def record(self, stream=None) -> None:
                self.at = clock.ms

            def elapsed_time(self, end: Event) -> float:
                assert clock.syncs, "read before the device was synchronised"
                return end.at - self.at

        self.Event = Event

    def synchronize(self, device=None) -> None:
        self.syncs += 1


class _Stage:
    """The three methods a schedule calls; each queues ``ms`` of device work and returns at once."""

    def __init__(self, clock: _DeviceClock, device: torch.device) -> None:
        self.clock, self.device = clock, device
        self.group_rank, self.stage_index, self.has_backward = 0, 0, True

    def forward_one_chunk(self, fwd_chunk_id, args=None, kwargs=None):
        self.clock.ms += 5.0

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        self.clock.ms += 10.0

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        self.clock.ms += 3.0


def test_timeline_on_cuda_takes_the_events_times(monkeypatch):
    clock = _DeviceClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", clock.synchronize)
    stage = _Stage(clock, CUDA)
    clock.ms = 100.0  # the device was busy before: the zero event comes after
    with ScheduleRecorder([stage], barrier=False) as recorder:
        stage.forward_one_chunk(0)
        clock.ms += 2.0  # an idle gap on the device
        stage.backward_one_chunk(0, full_backward=False)
        stage.backward_weight_one_chunk(0)
    assert clock.syncs == 0, "no synchronize during the step"
    got = [(r.kind, r.microbatch, r.full, round(r.start, 9), round(r.end, 9)) for r in recorder.records]
    assert got == [("F", 0, True, 0.0, 0.005), ("B", 0, False, 0.007, 0.017), ("W", 0, True, 0.017, 0.02)]
    recorder.records  # noqa: B018 -- read again: resolved once
    assert clock.syncs == 1


def test_timeline_on_cpu_keeps_the_host_clock(monkeypatch):
    clock = _DeviceClock()
    monkeypatch.setattr(torch.cuda, "Event", None)  # any use of an event fails
    stage = _Stage(clock, torch.device("cpu"))
    with ScheduleRecorder([stage], barrier=False) as recorder:
        stage.forward_one_chunk(0)
        stage.backward_one_chunk(0)
    (forward, backward) = recorder.records
    assert 0 <= forward.start <= forward.end <= backward.start <= backward.end < 1.0  # host seconds, not 5 ms steps
    assert forward.duration < 0.005


# -- 4. tokens/s after a device sync -----------------------------------------------------------------------------
class _Logger:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step) -> None:
        self.logged.append((step, dict(metrics)))


def _run_tokens(monkeypatch, device: torch.device, batches: int, window: int):
    """TokensPerSecond over ``batches`` batches of 2 x 16 tokens; the host clock stands still and each sync waits
    1 s for queued kernels. Returns the logged metrics and the events at which sync was called."""
    now = [0.0]
    events: list[tuple[str, int]] = []
    phase = ["", -1]

    def synchronize(dev=None) -> None:
        assert torch.device(dev) == device
        events.append(tuple(phase))
        now[0] += 1.0

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: now[0])
    logger = _Logger()
    trainer = _trainer(device, loggers=[logger])
    callback = TokensPerSecond(window=window, mfu=False)
    batch = torch.zeros(2, 16, dtype=torch.long)
    for i in range(batches):
        phase[:] = ["start", i]
        callback.on_train_batch_start(trainer, None, batch, i)
        phase[:] = ["end", i]
        trainer.global_step = i + 1
        callback.on_train_batch_end(trainer, None, None, batch, i)
    return logger.logged, events


def test_tokens_per_second_syncs_the_device_at_window_edges_only(monkeypatch):
    logged, events = _run_tokens(monkeypatch, CUDA, batches=6, window=3)
    assert events == [("start", 0), ("end", 2), ("start", 3), ("end", 5)]
    # 3 x 32 tokens over the 1 s the device took: the host clock alone would have given 0 s
    assert logged == [(3, {"train/tokens_per_sec": 96.0}), (6, {"train/tokens_per_sec": 96.0})]


def test_tokens_per_second_never_syncs_on_cpu(monkeypatch):
    _, events = _run_tokens(monkeypatch, torch.device("cpu"), batches=4, window=2)
    assert events == []


# -- 5. memory peaks per window ----------------------------------------------------------------------------------
class _Allocator:
    """torch.cuda's peak counters for one device, by hand."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.resets = 0

    def use(self, allocated: int, reserved: int) -> None:
        self.allocated, self.reserved = allocated, reserved
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)

    def reset(self, device=None) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.resets += 1

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(callbacks, "_RUN_PEAKS", {})


def test_gpu_memory_peaks_per_window(monkeypatch):
    """Setup peaks at 900 MiB (not training's); then steps peak at 300 and 200 MiB inside windows of 2 steps and
    drop back before the window is read."""
    mib = 2**20
    gpu = _Allocator()
    gpu.install(monkeypatch)
    original_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda data, **kw: original_tensor(data, **{**kw, "device": "cpu"}))
    gpu.use(900 * mib, 1000 * mib)  # building the model
    gpu.use(100 * mib, 1000 * mib)
    logger = _Logger()
    trainer = _trainer(CUDA, loggers=[logger])
    callback = MemoryPerRank(every=2, per_rank=True)
    callback.on_train_start(trainer, None)
    for step, (peak, reserved) in enumerate([(300, 1000), (120, 1000), (200, 1200), (150, 1200)], start=1):
        gpu.use(peak * mib, reserved * mib)
        gpu.use(100 * mib, reserved * mib)  # freed before the step ends
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None, None, None, step - 1)
    metrics = dict(logger.logged)
    assert sorted(metrics) == [2, 4]
    assert metrics[2]["memory/allocated_peak_max_MiB"] == 300  # the window's peak, not setup's 900
    assert metrics[4]["memory/allocated_peak_max_MiB"] == 200  # not the earlier window's 300
    assert metrics[2]["memory/reserved_peak_max_MiB"] == 1000 and metrics[4]["memory/reserved_peak_max_MiB"] == 1200
    assert metrics[4]["memory/rank0_allocated_peak_MiB"] == 200 and metrics[4]["memory/allocated_peak_max_rank"] == 0
    assert not any(tag in metrics[2] for tag in ("memory/max_MiB", "memory/rank0_MiB"))  # CPU's RSS tags
    # the whole run's peak survives the resets (tests/probes.py reads it at the end)
    assert cuda_run_peak_bytes(CUDA) == (900 * mib, 1200 * mib)
    assert gpu.resets == 3  # train start and after each read


def test_cpu_memory_is_the_resident_set_and_resets_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", None)  # any reset fails
    logger = _Logger()
    trainer = _trainer(torch.device("cpu"), loggers=[logger], global_step=1)
    callback = MemoryPerRank(every=1)
    callback.on_train_start(trainer, None)
    callback.on_train_batch_end(trainer, None, None, None, 0)
    ((step, metrics),) = logger.logged
    assert step == 1 and sorted(metrics) == ["memory/max_MiB", "memory/max_rank", "memory/mean_MiB", "memory/min_MiB"]
    with open("/proc/self/statm") as f:
        rss_mib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    assert metrics["memory/max_MiB"] == pytest.approx(rss_mib, rel=0.2)


# -- 6. the memory benchmark's --device cuda ---------------------------------------------------------------------
def test_large_model_memory_summary_on_cuda_reads_the_device_bytes():
    from benchmarks.large_model_memory import summarize, table

    gib = 2**30

    def report(rss: float, cuda_reserved: float | None, cuda_setup: float | None, cuda_peak: float | None) -> dict:
        return {"max_rss_bytes": rss * gib, "setup_rss_bytes": 1 * gib, "peak_since_setup_bytes": rss * gib,
                "model_bytes": 4 * gib, "materialized": {"kept_bytes": gib},
                "cuda_max_reserved_bytes": None if cuda_reserved is None else cuda_reserved * gib,
                "cuda_setup_allocated_bytes": None if cuda_setup is None else cuda_setup * gib,
                "cuda_max_allocated_bytes": None if cuda_peak is None else cuda_peak * gib}

    runs = {"one process": [report(6, 10, 0.5, 8.5)], "ZeRO-3, dp=4": [report(3, 4, 0.5, 2.5), report(3, 5, 0.5, 3)]}
    cuda = summarize(runs, device="cuda")["ZeRO-3, dp=4"]
    assert cuda["peak_bytes"] == [4 * gib, 5 * gib] and cuda["peak_ratio"] == 0.5  # reserved: 5 of 10
    assert cuda["growth_ratio"] == 2.5 / 8  # (3 - 0.5) / (8.5 - 0.5)
    cpu = summarize(runs)["ZeRO-3, dp=4"]  # host RSS, as before --device existed
    assert cpu["peak_ratio"] == 0.5 and cpu["growth_ratio"] == 2 / 5
    result = {"hidden": 8, "layers": 1, "device": "cuda", "layouts": summarize(runs, device="cuda")}
    assert "peak CUDA memory reserved at fit start" in table(result)
