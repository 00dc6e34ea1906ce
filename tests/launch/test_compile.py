"""torch.compile per block (lightning_par/parallel/compile.py): options, recompile counting, and compiled vs eager
per-step losses within 1e-4 under ZeRO-3, tp2 (plain SGD), pp2 ZBV and tp2 x pp2 (tests/launch/compile_matrix.py, full
run), plus cheap in-process checks in the default run."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lightning_par.parallel.compile import BlockCompiler, CompileOptions
from lightning_par.topology import LayoutError
from tests.conftest import launch_of, uses_run
from tests.harness import Run, launch_matrix, max_rel_diff
from tests.launch.compile_matrix import CASES, STEPS

COMPILED_RTOL = 1e-4  # inductor may reorder float operations


@pytest.mark.parametrize("value, message", [
    (dict(modes="max-autotune"), "unknown option"),
    (dict(backend="no_such_backend"), "not registered"),
    (dict(backend="aot_eager", mode="max-autotune"), "inductor mode"),
    (dict(dynamic="yes"), "dynamic"),
    (dict(mode="max-autotune", options={"trace.enabled": True}), "not both"),
    ("yes", "not valid"),
])
def test_bad_compile_options_are_refused(value, message):
    with pytest.raises(LayoutError, match=message):
        CompileOptions.of(value)


def test_compile_true_means_inductor_one_graph_per_shape():
    assert CompileOptions.of(True) == CompileOptions(backend="inductor", dynamic=False)
    assert CompileOptions.of(False) is None and CompileOptions.of({"fullgraph": True}).fullgraph


def test_every_strategy_takes_compile_and_refuses_bad_options_before_launch():
    from lightning_par import Hybrid3DStrategy, MegatronTPStrategy, PipelineStrategy, ZeroStrategy

    for cls in (ZeroStrategy, MegatronTPStrategy, PipelineStrategy, Hybrid3DStrategy):
        assert cls(compile=True).compile_options == CompileOptions()
        assert cls(compile={"mode": "max-autotune"}).compile_options.mode == "max-autotune"
        assert cls().compile_options is None
        with pytest.raises(LayoutError, match="unknown option"):
            cls(compile={"fulgraph": True})


class _CallCounter(torch.nn.Module):
    """A block whose forward reads a Python int that changes every call: dynamo guards on it and recompiles."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


def test_a_block_that_recompiles_is_counted_and_warned():
    block = _CallCounter()
    compiler = BlockCompiler(CompileOptions(backend="eager"))
    compiler(block)
    with pytest.warns(RuntimeWarning, match="compiled again"):
        for _ in range(3):
            block(torch.ones(2, 4))
    summary = compiler.summary(block)
    assert (summary.graphs, summary.inputs, summary.recompiles) == (3, 1, 2)
    assert any("calls" in reason for reason in summary.reasons)  # dynamo's reason names the attribute


def test_equal_blocks_share_one_graph_and_keep_their_names():
    from lightning_par.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=64))
    eager = copy.deepcopy(model)
    keys = list(model.state_dict())
    compiler = BlockCompiler(CompileOptions(backend="aot_eager"))
    for block in model.layers.values():
        compiler(block)
    tokens = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        model(tokens).sum().backward()
        eager(tokens).sum().backward()
    with torch.no_grad():  # evaluation: a second graph (autograd does not record), compiled once
        model(tokens)
    summary = compiler.summary(model)
    assert list(model.state_dict()) == keys and not any("_orig_mod" in k for k in keys)
    assert (summary.graphs, summary.inputs, summary.recompiles) == (2, 2, 0), summary
    assert summary.by_block == {"layers.0": 2, "layers.1": 0, "layers.2": 0}
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["full", "selective"])
def test_recompute_is_traced_into_the_blocks_graph(kind):
    """Recompute runs first (parallel/recompute.py replaces the block's forward): the compiled block still makes one
    graph with the recomputation inside, and its gradients are eager's (a forward dynamo skipped would compile
    nothing and run eagerly)."""
    from lightning_par.examples.gpt import Block, GPTConfig
    from lightning_par.parallel.recompute import apply_recompute

    torch.manual_seed(0)
    block = Block(GPTConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64))
    eager = copy.deepcopy(block)
    apply_recompute([block], kind)
    compiler = BlockCompiler(CompileOptions(backend="aot_eager"))
    compiler(block)
    x = torch.randn(2, 16, 32)
    block(x).sum().backward()
    eager(x).sum().backward()
    assert compiler.summary().graphs == 1
    for p, q in zip(block.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.full  # a cold inductor compile
def test_split_backward_weight_gradients_are_exact_with_inductor():
    """Zero-bubble schedules run a compiled block's backward twice (input half with retain_graph=True, then weight
    half): torch's own stage_backward_input / stage_backward_weight, on inductor-compiled GPT blocks, give the eager
    gradients (pytorch issue 161904: donated buffers; inductor's FX graph cache serving a donating backward)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from lightning_par.examples.gpt import Block, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64)
    blocks = torch.nn.Sequential(Block(config), Block(config))
    eager = copy.deepcopy(blocks)
    compiler = BlockCompiler(CompileOptions(), split_backward=True)
    try:
        for block in blocks:
            compiler(block)
        x = torch.randn(2, 16, 32, requires_grad=True)
        grad = torch.randn(2, 16, 32)
        eager(x.detach().clone().requires_grad_()).backward(grad)
        _, groups = stage_backward_input([blocks(x)], [grad], [x], iter(blocks.parameters()))
        stage_backward_weight(iter(blocks.parameters()), groups)
        worst = max((p.grad - q.grad).abs().max().item()
                    for p, q in zip(blocks.parameters(), eager.parameters(), strict=True))
    finally:
        compiler.release(blocks)  # (fresh parameter objects: compare before)
    print(f"split backward, compiled vs eager: largest weight-gradient difference {worst:.1e}")
    assert worst < 1e-4
    assert torch._functorch.config.donated_buffer  # restored by release()


@pytest.mark.parametrize("zero_stage, fused", [(0, False), (1, False), (0, True)])
def test_a_users_gpt2_block_compiles_under_tensor_parallel(one_process_group, zero_stage, fused):
    """A GPT-2-style model written by a user (tests/launch/compile_matrix.py: biases, LayerNorm with bias, the MLP's
    column-parallel linear in the block itself, a gather-output head), split by its plan on a 1-rank tp mesh, trains
    with its blocks compiled as eagerly: one graph, no recompile, losses equal under plain SGD. Under the bug, the
    block's shared column-parallel input became a DTensor graph output without a gradient ("Expected a DTensor
    tangent"), and with ZeRO-1 (Hybrid3D's default) the bucket views gave DTensor wrappers a storage offset other
    than their local tensor's, which dynamo could not rebuild ("set the storage ... on different device meta")."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.parallel.tensor_parallel import PLAN_STYLES, apply_tensor_parallel
    from lightning_par.parallel.zero import ZeroPartitioner
    from tests.launch.compile_matrix import UserGPT2

    if fused and "packed_colwise" not in PLAN_STYLES:
        pytest.skip("the fused-qkv model needs tensor parallel's packed_colwise (not in this tree yet)")
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    eager = UserGPT2(dim=32, n_heads=2, seq=16, fused=fused)
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        apply_tensor_parallel(model, mesh["tp"], rng=False)  # (no dropout: what the strategies do under compile)
    compiler = BlockCompiler(CompileOptions(backend="aot_eager"))
    for block in compiled.blocks:
        compiler(block)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, compiled)]
    partitioner = ZeroPartitioner(compiled, [optimizers[1]], mesh["dp"], 1) if zero_stage else None
    if partitioner is not None:  # the parameters are views into the buckets, wrappers kept consistent with them
        assert all(p.storage_offset() == p.to_local().storage_offset() for p in compiled.parameters())
        assert any(p.to_local().storage_offset() for p in compiled.parameters())
    tokens, targets = torch.randint(0, 256, (2, 2, 16))
    losses: list[list[float]] = [[], []]
    try:
        for _ in range(3):
            for i, (model, optimizer) in enumerate(zip((eager, compiled), optimizers, strict=True)):
                loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                loss.backward()
                if i and partitioner is not None:
                    partitioner.finish_gradient_sync()
                optimizer.step()
                optimizer.zero_grad()
                if i and partitioner is not None:
                    partitioner.gather_parameters()
                losses[i].append(loss.item())
        summary = compiler.summary(compiled)
    finally:
        compiler.release(compiled)
    model_name = "user GPT-2" + (" (fused qkv)" if fused else "")
    print(f"{model_name}, tp mesh of 1, ZeRO-{zero_stage}: eager {losses[0]}, compiled {losses[1]}")
    assert (summary.graphs, summary.recompiles) == (1, 0), summary
    assert losses[0][0] - losses[0][-1] > 0.1  # the steps move the loss: a missing gradient would show
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)


@pytest.fixture(scope="module")
def compile_matrix(request, tmp_path_factory, cache_dir):
    """``get(name)``: (eager Run, compiled Run, per-rank reports) of a CASES entry; one launch per rank count."""
    out: dict[str, tuple[Run, Run, list[dict]]] = {}

    def get(name: str):
        uses_run("compile_matrix")
        devices = CASES[name][0]
        if name not in out:
            names = [n for n, case in CASES.items() if case[0] == devices]
            root = tmp_path_factory.mktemp(f"compile_{devices}")
            run = launch_matrix(root, cache_dir, "tests.launch.compile_matrix",
                                ["--root", str(root), "--cache", str(cache_dir), "--cases", *names], nproc=devices,
                                timeout=1200).check()
            print(f"compile matrix: {len(names)} layouts x (eager, compiled) on {devices} ranks in {run.seconds:.0f} s")
            for n in names:
                reports = [json.loads((root / f"{n}_compiled" / f"rank{r}.json").read_text())
                           for r in range(devices)]
                out[n] = (Run(root / f"{n}_eager", 0, run.log, run.seconds),
                          Run(root / f"{n}_compiled", 0, run.log, run.seconds), reports)
        return out[name]

    return get


@launch_of("compile_matrix")
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_blocks_train_as_eager(compile_matrix, name):
    eager, compiled, reports = compile_matrix(name)
    diff = max_rel_diff(compiled.losses(), eager.losses())
    print(f"{name}: compiled vs eager, max relative per-step loss difference {diff:.2e} over {STEPS} steps")
    assert len(compiled.losses()) == STEPS and diff <= COMPILED_RTOL
    assert eager.losses()[0] - eager.losses()[-1] > 0.3  # plain SGD moves the loss: a wrong gradient would show
    for rank, report in enumerate(reports):
        summary = report["summary"]
        # one graph per block shape: the rank's blocks share the graph its first block compiled, and none again
        assert summary["recompiles"] == 0 and summary["graphs"] == summary["inputs"] == 1, (rank, summary)
        assert not any("_orig_mod" in key for key in report["keys"])
    scalars = compiled.scalars()
    assert scalars["compile/recompiles"] and max(scalars["compile/recompiles"].values()) == 0
