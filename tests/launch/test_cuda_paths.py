"""The CUDA and NCCL paths, checked on CPU (docs/zero.md, docs/compile.md; issue 26): the process group backend
chosen for CUDA, the global gradient norm (partial sums on the root device, ``_foreach_norm``, the clip coefficient
kept on the device), the ordering of offloaded gradients' device-to-host copies, ZeRO-1/2/3 offload with clipping
at parity on 2 gloo ranks, stage 1's send buffers freed bucket by bucket, dropout regions only where there is
dropout, and CUDA graphs refused. A CUDA device is faked where the code only reads the device type."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_par import LayoutError
from lightning_par.parallel.grad_norm import clip_grads_, global_grad_norm
from tests.harness import gloo_rank, spawn_reports

BF16, F32 = torch.bfloat16, torch.float32


# -- 1. the process group backend -----------------------------------------------------------------------------------
@pytest.mark.parametrize("device, given, expected", [
    (torch.device("cuda", 0), None, "cpu:gloo,cuda:nccl"),  # CPU tensors in a collective go to gloo
    (torch.device("cpu"), None, "gloo"),
    (torch.device("cuda", 0), "nccl", "nccl"),  # the user's choice wins
    (torch.device("cpu"), "cpu:gloo", "cpu:gloo"),
])
def test_process_group_backend_for_the_device(monkeypatch, device, given, expected):
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.parallel import ParallelStrategy

    from lightning_par.strategies import engine, mesh

    class Joined(Exception):
        pass

    seen = []

    def init_dist_connection(environment, backend, **kwargs):
        seen.append(backend)
        raise Joined  # stop before any process group is made

    monkeypatch.setattr(mesh, "_init_dist_connection", init_dist_connection)  # (the engine's base joins the group)
    monkeypatch.setattr(ParallelStrategy, "setup_environment", lambda self: None)  # the accelerator's device setup
    strategy = engine.LayoutStrategy(zero_stage=1, process_group_backend=given, parallel_devices=[device],
                                     cluster_environment=LightningEnvironment())
    with pytest.raises(Joined):
        strategy.setup_environment()
    assert seen == [expected] and strategy.process_group_backend == expected


# -- 2. the global norm and clipping on one process -----------------------------------------------------------------
def _grads(low_precision: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes_dtypes = [((7, 5), F32), ((4, 4), torch.float64), ((2, 3), F32), ((0,), F32)]
    if low_precision:
        shapes_dtypes += [((3,), BF16), ((11,), torch.float16), ((9,), BF16)]
    return [torch.randn(shape, generator=generator).to(dtype) for shape, dtype in shapes_dtypes]


@pytest.mark.parametrize("low_precision", [False, True])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clipped, and left alone
def test_norm_and_clipping_equal_clip_grad_norm(monkeypatch, max_norm, low_precision):
    grads = _grads(low_precision)
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm)
    exact = sum(float(g.double().square().sum()) for g in grads) ** 0.5
    total = global_grad_norm(grads)
    assert total.dtype == F32 and total.device.type == "cpu"
    assert float(total) == pytest.approx(exact, rel=1e-6)  # fp32 sums of squares, whatever the gradients' dtype
    # clip_grad_norm_ takes each bf16/fp16 gradient's norm in its own dtype: equal up to that rounding
    assert float(total) == pytest.approx(float(expected), rel=1e-6 if not low_precision else 2e-3)
    assert float(total) > 2 * 0.5  # clipping acts at 0.5

    # the coefficient stays a tensor: no host read of the norm (.item(), float(), bool()) while clipping
    def host_read(*_):
        raise AssertionError("clip_grads_ read a device value on the host")

    ours = [g.clone() for g in grads]
    for name in ("item", "__float__", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    clip_grads_(ours, max_norm, total)
    monkeypatch.undo()
    for mine, p in zip(ours, params, strict=True):
        # (with bf16/fp16 gradients clip_grad_norm_'s coefficient comes from its rounded norm, see above)
        rtol = 1e-6 if not low_precision else 1e-2 if mine.dtype in (BF16, torch.float16) else 3e-3
        torch.testing.assert_close(mine, p.grad, rtol=rtol, atol=0)
        if max_norm > float(total):  # not clipped: unchanged, bit for bit
            assert torch.equal(mine, p.grad)


def test_partial_sums_are_reduced_on_the_root_device(one_process_group, monkeypatch):
    """Gradients offloaded to the host have CPU partial sums; NCCL refuses CPU tensors, so each is moved to the root
    device first (here ``meta`` stands for a CUDA device: the sums are on CPU, the root elsewhere)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    grads = [distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Replicate()]),
             distribute_tensor(torch.ones(6), mesh, [Replicate(), Shard(0)]), torch.ones(3)]
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None, **kw: reduced.append(tensor.device.type))
    total = global_grad_norm(grads, device=torch.device("meta"))
    assert reduced == ["meta", "meta"] and total.device.type == "meta"  # one all-reduce per split kind, on the root
    monkeypatch.undo()
    assert float(global_grad_norm(grads)) == pytest.approx((16 + 6 + 3) ** 0.5, rel=1e-7)


# -- 3. offloaded gradients: the device-to-host copy is awaited before the CPU step ---------------------------------
class _FakeEvent:
    log: list[str] = []

    def record(self, stream=None) -> None:
        self.log.append(f"record on {stream}")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def test_offloaded_gradient_copies_are_awaited(monkeypatch):
    from unittest import mock

    from lightning_par.parallel.zero import _HostCopies

    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream {device}")
    on_cuda = mock.Mock(device=torch.device("cuda", 1))
    on_cuda.to.return_value = "pinned host copy"
    copies = _HostCopies()
    assert copies.to_host(on_cuda) == "pinned host copy"
    on_cuda.to.assert_called_once_with("cpu", non_blocking=True)
    copies.to_host(on_cuda)
    assert _FakeEvent.log == ["record on stream cuda:1"] * 2
    copies.wait()
    copies.wait()  # nothing left to wait for
    assert _FakeEvent.log == ["record on stream cuda:1"] * 2 + ["synchronize"]
    # CPU gradients: the tensor itself, no event
    cpu = torch.ones(3)
    assert _HostCopies().to_host(cpu) is cpu


def test_finish_gradient_sync_waits_for_the_host_copies(one_process_group, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.parallel.zero import ZeroPartitioner, _HostCopies

    waits = []
    monkeypatch.setattr(_HostCopies, "wait", lambda self: waits.append(len(waits)))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))["dp"]
    model = _small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    part = ZeroPartitioner(model, [optimizer], mesh, 2, offload_optimizer=True)
    _loss(model, _batches(1)[0]).backward()
    assert waits == []
    part.finish_gradient_sync()
    assert waits == [0]


# -- 4. stage 1 frees each bucket's send buffer once the next is launched -------------------------------------------
@pytest.mark.parametrize("overlap, most", [(True, 1), (False, 0)])
def test_stage1_frees_each_send_buffer_when_the_next_bucket_launches(one_process_group, overlap, most):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.parallel.zero import ZeroPartitioner

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))["dp"]
    model = _small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # bf16 buckets reduced in fp32: each bucket's send buffer is an fp32 copy
    part = ZeroPartitioner(model, [optimizer], mesh, 1, bucket_cap_mb=0.002, overlap=overlap, param_dtype=BF16,
                           reduce_dtype=F32)
    assert len(part.buckets) >= 6
    launch, live = part._launch_reduce, []

    def counted(bucket):
        launch(bucket)
        live.append(sum(b.send is not None for b in part.buckets))

    part._launch_reduce = counted
    with torch.autocast("cpu", BF16):
        loss = _loss(model, _batches(1)[0])
    loss.backward()
    print(f"stage 1, overlap={overlap}: send buffers alive after each launch in backward: {live} "
          f"({len(part.buckets)} buckets)")
    assert len(live) == len(part.buckets) and max(live) == most  # (before: every bucket's, until the step)
    part.finish_gradient_sync()
    assert all(b.send is None and b.reduced_chunk is None for b in part.buckets)
    for bucket in part.buckets:  # one rank: the shard's gradient is the whole bucket's, rounded once
        assert bucket.shard.grad.dtype == F32
        assert torch.equal(bucket.shard.grad.to_local(), bucket.flat_grad.float())


# -- 2 and 3 on 2 gloo ranks: offload with clipping, ZeRO-1/2/3, plain SGD -----------------------------------------
STEPS, CLIP_AT = 3, 0.05


def _small_model() -> nn.Module:
    from lightning_par.examples.plain_lm import PlainLM

    torch.manual_seed(0)
    return PlainLM(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=8)


def _batches(n: int) -> list[torch.Tensor]:
    """One batch, ``n`` times: the loss must fall in a few small (clipped) steps."""
    return [torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))] * n


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())


def _fit(stage: int, offload: bool, mesh, rank: int, world: int) -> dict:
    """``STEPS`` SGD steps with clipping by the global norm, as the strategy does (LayoutStep.clip_by_global_norm)."""
    from lightning_par.parallel.zero import ZeroPartitioner, fully_shard_units

    model = _small_model()
    if stage == 3:
        fully_shard_units(model, mesh, offload=offload)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        part = None
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        part = ZeroPartitioner(model, [optimizer], mesh, stage, bucket_cap_mb=0.002, offload_optimizer=offload)
    losses, norms = [], []
    for tokens in _batches(STEPS):
        loss = _loss(model, tokens[rank * 4 // world:(rank + 1) * 4 // world])
        loss.backward()
        if part is not None:
            part.finish_gradient_sync()
            grads = part.norm_grads()
        else:
            grads = [p.grad for p in model.parameters()]
        total = global_grad_norm(grads, device=torch.device("cpu"))
        clip_grads_([p.grad for g in optimizer.param_groups for p in g["params"]], CLIP_AT, total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if part is not None:
            part.gather_parameters()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(float(reduced) / world)
        norms.append(float(total))
    devices = sorted({p.device.type for g in optimizer.param_groups for p in g["params"]})
    return {"losses": losses, "norms": norms, "optimizer_devices": devices}


def _single_process() -> dict:
    model = _small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    losses, norms = [], []
    for tokens in _batches(STEPS):
        loss = _loss(model, tokens)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_AT)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms}


def _offload_worker(rank: int, world: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_rank(rank, world, store, out) as report:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))["dp"]
        for stage in (1, 2, 3):
            for offload in (False, True):
                report[f"zero{stage}_offload={offload}"] = _fit(stage, offload, mesh, rank, world)
        if rank == 0:
            report["single"] = _single_process()


@pytest.fixture(scope="module")
def offload_reports(tmp_path_factory):
    return spawn_reports(_offload_worker, tmp_path_factory.mktemp("offload"))


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_with_clipping_is_exact_against_no_offload(offload_reports, stage):
    single = offload_reports[0]["single"]
    assert min(single["norms"]) > 10 * CLIP_AT  # clipping acts on every step
    for report in offload_reports:
        plain, offloaded = report[f"zero{stage}_offload=False"], report[f"zero{stage}_offload=True"]
        assert offloaded["optimizer_devices"] == ["cpu"]
        assert offloaded["losses"] == plain["losses"] and offloaded["norms"] == plain["norms"]  # bit for bit
        diff = max(abs(a - b) / b for a, b in zip(offloaded["losses"], single["losses"], strict=True))
        norm_diff = max(abs(a - b) / b for a, b in zip(offloaded["norms"], single["norms"], strict=True))
        print(f"zero{stage} dp2 offload + clip at {CLIP_AT}, plain SGD: loss vs one process {diff:.1e}, "
              f"norm {norm_diff:.1e}")
        assert diff <= 1e-5 and norm_diff <= 1e-5
        assert single["losses"][-1] < single["losses"][0]  # it trains


# -- 5. dropout regions only where there is dropout -----------------------------------------------------------------
def _tp_gpt2(dropout: float):
    from lightning_par.examples.gpt2 import GPT2, GPT2Config

    torch.manual_seed(0)
    return GPT2(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, dropout=dropout))


@pytest.mark.parametrize("dropout, regions", [(0.0, 0), (0.1, 2 * 2 * 4)])  # per forward: 2 blocks x (q, k, v, fc)
def test_tensor_parallel_regions_only_in_blocks_with_dropout(one_process_group, monkeypatch, dropout, regions):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.parallel.blocks import find_blocks
    from lightning_par.parallel.rng import TensorParallelRNG, dropout_at
    from lightning_par.parallel.tensor_parallel import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model = _tp_gpt2(dropout)
    found = find_blocks(model)
    blocks = [found.root.get_submodule(name) for name in found.blocks]
    entered = []
    enter = TensorParallelRNG.enter
    monkeypatch.setattr(TensorParallelRNG, "enter", lambda self, region="": (entered.append(region),
                                                                             enter(self, region))[1])
    plan = apply_tensor_parallel(model, mesh, rng=True, rng_where=dropout_at(blocks, model))
    assert plan.rng is not None  # the tracker (common generator, region() for hand-written dropout) is kept
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens)
    model(tokens)
    print(f"dropout={dropout}: {len(entered)} regions entered in 2 forwards: {sorted(set(entered))}")
    assert len(entered) == regions


def test_a_float_dropout_rate_counts_as_dropout():
    from lightning_par.parallel.rng import has_dropout

    class Attention(nn.Module):
        def __init__(self, rate: float) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.attn_dropout = rate  # handed to scaled_dot_product_attention(dropout_p=...)

    assert has_dropout(Attention(0.1)) and not has_dropout(Attention(0.0))


# -- 6. CUDA graphs refused -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [dict(mode="reduce-overhead"), dict(options={"triton.cudagraphs": True})])
def test_cuda_graphs_are_refused_when_the_strategy_is_made(options):
    from lightning_par import ZeroStrategy

    with pytest.raises(LayoutError, match=r"records CUDA graphs.*FSDP2 gathers.*AsyncCollectiveTensor.*pipeline "
                                          r"stages.*Use mode='default' or 'max-autotune-no-cudagraphs'"):
        ZeroStrategy(stage=3, compile=options)


def test_max_autotune_is_refused_on_cuda_only():
    from lightning_par.parallel.compile import CompileOptions

    options = CompileOptions.of({"mode": "max-autotune"})
    options.check_device(torch.device("cpu"))
    CompileOptions.of({"mode": "max-autotune-no-cudagraphs"}).check_device(torch.device("cuda", 0))
    with pytest.raises(LayoutError, match=r"max-autotune.*records CUDA graphs on CUDA.*max-autotune-no-cudagraphs"):
        options.check_device(torch.device("cuda", 0))


# -- deferred materialisation on a device: what the GPU check found on an H200 (docs/gpu.md) -------------------------
class _Perplexity(nn.Module):
    """A LightningModule-like holder: a deferred model beside a torchmetrics metric built eagerly."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        from lightning_par.parallel.deferred_init import deferred_init

        torch.manual_seed(0)
        with deferred_init(threshold=0) as self.record:
            self.model = nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4))
            self.model.register_buffer("table", torch.arange(4.0))
        self.record.capture(self)
        self.metric = torchmetrics.MeanMetric()


def test_deferred_materialisation_places_parameters_buffers_and_metric_states():
    """Parameters go to ``parameter_device`` (the host, under FSDP2 offload, which refuses GPU-materialised
    parameters), buffers and torchmetrics states (neither parameters nor buffers) to the device, as an eager build's
    ``module.to(device)`` would. Only CPU and meta exist here, so the meta device stands in for the GPU: on an H200,
    ZeRO-3 left the perplexity metric on the host (its first update with a GPU loss failed) and ZeRO-3 offload
    materialised the root's parameters on the GPU (FSDP2 refused them at lazy init)."""
    from lightning_par.parallel.materialize import materialize_share

    holder = _Perplexity()
    assert all(t.is_meta for t in holder.model.state_dict().values())
    assert holder.metric.device == torch.device("cpu")
    device, host = torch.device("meta"), torch.device("cpu")
    materialize_share(holder, holder.record, device, parameter_device=host)
    assert {p.device for p in holder.parameters()} == {host}
    assert holder.model.table.device == device
    assert holder.metric.device == device and holder.metric.mean_value.device == device
    reference = _Perplexity()
    reference.record.materialize(reference)  # every tensor on the host: the same values as one process builds
    for (name, got), want in zip(holder.model.named_parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(got, want), name


def test_offloaded_zero3_owners_keep_parameters_on_host():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from lightning_par.parallel import gradient_sync
    from lightning_par.parallel.host_memory import fsdp_offload_policy

    mesh = type("Mesh", (), {"device_type": "cuda"})()
    assert gradient_sync.FSDPSync(mesh, shard=True, offload=True).parameters_on_host
    assert not gradient_sync.FSDPSync(mesh, shard=True).parameters_on_host
    assert not gradient_sync.FSDPSync(mesh, shard=False, offload=True).parameters_on_host
    assert gradient_sync.FSDPSync(mesh, shard=True, offload=True, deferred=True).parameters_on_host
    assert not gradient_sync.NoSync().parameters_on_host
    # one policy for both FSDP paths: pinned where a device copies to the host, unpinned on a CPU mesh
    assert fsdp_offload_policy(True, "cuda").pin_memory and not fsdp_offload_policy(True, "cpu").pin_memory
    assert not isinstance(fsdp_offload_policy(False, "cuda"), CPUOffloadPolicy)
