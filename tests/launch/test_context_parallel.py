"""Context parallel (cp): each sequence split over cp ranks, at parity with one process.

In-process: the rank grid with cp between dp and tp, the load-balanced shards, the errors raised before launch; on
two gloo processes (spawned here, seconds): the all-gathered attention and the token-weighted loss against the
whole sequence's, values and gradients, with ``-100`` targets spread unevenly over the shards. Launches (the CLI,
``tests.conftest.CP_RUNS``): the example GPT at cp=2 with SGD (default run); Hugging Face Llama and Qwen2 at cp=2,
and cp2 x ZeRO-3 dp2 on all three (full run). tp2 x pp2 x cp2 is in ``tests/launch/hybrid3d_matrix.py``.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_par import Hybrid3DStrategy, LayoutError, LayoutStrategy
from lightning_par.examples.gpt import GPT, GPTConfig
from lightning_par.examples.gpt2 import GPT2, GPT2Config
from lightning_par.parallel.context_parallel import check_takes_positions, shard_positions
from lightning_par.parallel.layout import Layout
from lightning_par.topology import ParallelDims
from tests.conftest import CP_RUNS, run_cases, steps_of
from tests.harness import launch_cli, max_rel_diff, spawn

LOSS_RTOL = 1e-5


def test_cp_lies_between_dp_and_tp():
    dims = ParallelDims.resolve(16, tp=2, pp=2, cp=2)
    assert dims.dp == 2 and dims.shape == (2, 2, 2, 2)
    assert dims.coordinates(5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert dims.groups("cp")[:2] == [[0, 2], [1, 3]]  # two ranks apart: tp is innermost
    assert dims.group_of(0, "dp") == [0, 4]
    assert "rank -> (pp, dp, cp, tp)" in dims.rank_table() and "cp=2" in dims.describe()
    assert "rank -> (pp, dp, tp)" in ParallelDims.resolve(4, tp=2).rank_table()  # no cp column without cp


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_cover_the_sequence_once_and_balance_the_causal_work(cp):
    shards = [shard_positions(32, cp, r) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(32))
    assert shards[0][:32 // (2 * cp)].tolist() == list(range(32 // (2 * cp)))  # rank 0: the first chunk and the last
    assert shards[0][-1] == 31
    work = [int((s + 1).sum()) for s in shards]  # keys each rank's queries attend to under the causal mask
    assert len(set(work)) == 1


def test_bad_layouts_are_refused_before_launch():
    with pytest.raises(LayoutError, match=r"tp=1 x pp=1 x cp=4 = 4 does not divide the world size 6"):
        ParallelDims.resolve(6, cp=4)
    with pytest.raises(LayoutError, match="cp=0 is not a valid size"):
        Layout(cp=0)
    with pytest.raises(LayoutError, match="sequence_parallel=True with cp > 1"):
        Layout(cp=2, tp=2, sequence_parallel=True)
    with pytest.raises(LayoutError, match=r"sequence length is 30. Use a sequence length divisible by 4 \(e.g. 32\)"):
        shard_positions(30, 2, 0)
    with pytest.raises(LayoutError, match="does not divide the world size 3"):
        Trainer(accelerator="cpu", devices=3, strategy=LayoutStrategy(cp=2), logger=False)
    assert Hybrid3DStrategy(tp=1, pp=1, cp=2).layout.cp == 2


def test_a_model_whose_positions_stay_local_is_refused():
    check_takes_positions(GPT(GPTConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64)))
    # learned positions from arange of the local length: every rank but the first would be silently wrong
    with pytest.raises(LayoutError, match="GPT2.forward has no `position_ids` argument"):
        check_takes_positions(GPT2(GPT2Config(n_layer=1, n_embd=32, n_head=2)))


def test_chunked_attention_is_refused_by_name():
    """Llama-4's chunked attention: the ring computes plain causal attention over the whole sequence, so the chunks
    were ignored (the conformance matrix: 6e-3 off one process under cp2, silently). Refused before the first step."""
    transformers = pytest.importorskip("transformers")
    from contextlib import ExitStack

    from lightning_par.parallel.context_parallel import HF_ATTENTION, use_hf_attention

    config = transformers.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           intermediate_size_mlp=64, num_hidden_layers=4, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=16, num_local_experts=2,
                                           attention_chunk_size=8)
    assert "chunked_attention" in config.layer_types
    model = transformers.Llama4ForCausalLM(config)
    with ExitStack() as undo, pytest.raises(LayoutError, match=r"context parallel: Llama4ForCausalLM uses chunked "
                                                               r"attention \(config.attention_chunk_size=8\)"):
        use_hf_attention(model, undo)
    assert model.config._attn_implementation != HF_ATTENTION, "nothing changed"
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                                   num_attention_heads=2, intermediate_size=64))
    with ExitStack() as undo:
        assert use_hf_attention(llama, undo)


def test_batches_are_cut_alike_or_refused():
    from lightning_par.parallel.context_parallel import ContextParallel

    cp = ContextParallel(group=None, size=2, rank=1)  # cutting communicates nothing
    ids = torch.arange(33).expand(2, -1)
    out = cp.shard({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    assert out["input_ids"][0].tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    assert out["labels"].equal(out["input_ids"]) and cp.positions.tolist() == out["input_ids"][0].tolist()
    assert cp.targets[0].tolist() == [t + 1 for t in out["input_ids"][0].tolist()]  # shifted on the whole sequence
    inputs, targets = cp.shard((ids[:, :32], ids[:, 1:33]))
    assert inputs[0, -1] == 23 and targets[0, -1] == 24
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    with pytest.raises(LayoutError, match="a padding attention_mask"):
        cp.shard({"input_ids": ids, "attention_mask": padded})
    with pytest.raises(LayoutError, match="sequence length is 30"):
        cp.shard((ids[:, :30], ids[:, :30]))
    with pytest.raises(LayoutError, match="accepts a tuple"):
        cp.shard([ids])


def test_a_forward_whose_attention_bypassed_context_parallel_is_refused():
    from torch import nn

    from lightning_par.parallel.context_parallel import ContextParallel, install

    class OwnAttention(nn.Module):  # attention written by hand: it would see only the shard
        def forward(self, x, position_ids=None):
            scores = (x @ x.transpose(-1, -2)).softmax(-1)
            return scores @ x

    cp = ContextParallel(group=None, size=2, rank=0)
    model = OwnAttention()
    install(model, cp, n_blocks=1)
    inputs, _ = cp.shard((torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)))
    model(torch.randn(1, 4, 3))  # outside a step the model is the plain model: nothing added, nothing checked
    assert cp.positions_given == 0
    with cp.step(), pytest.raises(LayoutError, match="only 0 attention calls went through the context-parallel"):
        model(torch.randn(1, 4, 3))
    assert cp.positions_given == 1


def test_the_example_gpt_with_global_positions_equals_the_whole_sequence():
    """What a cp rank computes of its shard's tokens, given their global positions, is what the whole sequence
    gives at those positions (everything but attention is per token; attention here sees only causal prefixes)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16))
    tokens = torch.randint(0, 256, (2, 16))
    whole = model(tokens)
    prefix = model(tokens[:, :8], position_ids=torch.arange(8).expand(2, -1))
    torch.testing.assert_close(prefix, whole[:, :8])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the largest magnitude of ``b``."""
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-30))


def _gradients_over_cp(grad: torch.Tensor) -> torch.Tensor:
    """What the data-parallel owners make of one rank's gradient: the average over the (two) cp ranks."""
    import torch.distributed as dist

    grad = grad.clone()
    dist.all_reduce(grad)
    return grad / 2


def _attention_and_loss(rank: int) -> dict[str, float]:
    """The ring attention and the token-weighted loss on this rank's shard of a whole sequence whose
    ``-100`` targets fall unevenly on the shards, against the whole sequence in one process (float64)."""
    import torch.distributed as dist

    from lightning_par.parallel.context_parallel import ContextParallel, sequence_attention
    from lightning_par.parallel.pipeline.batches import next_token_targets

    torch.manual_seed(0)  # the same whole sequence on both ranks
    B, H, KV, T, D, V = 2, 4, 2, 16, 8, 11
    q, k, v = (torch.randn(B, h, T, D, dtype=torch.float64, requires_grad=True) for h in (H, KV, KV))
    logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    labels[:, 2:7] = -100  # counted tokens differ between the shards
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), next_token_targets(labels).reshape(-1))
    (out.square().sum() + loss).backward()
    expected = [t.grad.clone() for t in (q, k, v, logits)]
    for t in (q, k, v, logits):
        t.grad = None
    cp = ContextParallel(group=dist.group.WORLD, size=2, rank=rank)
    batch = cp.shard({"input_ids": torch.zeros(B, T, dtype=torch.long), "labels": labels})
    index = cp.positions
    with cp.step():
        cp.positions_given = 1  # (a model's forward would have been given them)
        local = sequence_attention(q[:, :, index], k[:, :, index], v[:, :, index], enable_gqa=True)
        mean = cp.mean_loss(lambda lg, tg: torch.nn.functional.cross_entropy(lg.reshape(-1, V), tg.reshape(-1)))
        local_loss = mean(logits[:, index], next_token_targets(batch["labels"]))  # the shard's own shift is ignored
        (local.square().sum() * 2 + local_loss).backward()  # x 2: the owners average the attention term over cp
    result = {"attention": _rel(local, out[:, :, index]), "loss": _rel(local_loss, loss)}
    for name, t, want in zip("qkv", (q, k, v), expected, strict=False):
        result[f"grad_{name}"] = _rel(_gradients_over_cp(t.grad), want)
    result["grad_logits"] = _rel(_gradients_over_cp(logits.grad), expected[3])
    return result


class _LargestOutputs:
    """A dispatch mode noting every aten op's output shapes (what is allocated, inside the kernels' callers)."""

    def __init__(self) -> None:
        from lightning_par._compat import TorchDispatchMode, tree_leaves

        shapes = self.shapes = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                shapes.extend(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
                return out

        self.mode = Mode()

    def quadratic(self, rows: int, cols: int) -> list[tuple[int, ...]]:
        """The shapes holding a [rows, cols] plane (any order of the two, any leading dimensions)."""
        return [s for s in self.shapes if len(s) >= 2 and {s[-2], s[-1]} == {rows, cols}]


def _ring_attention(rank: int) -> dict[str, float]:
    """The ring attention of this rank's shard against plain causal SDPA of the whole sequence in one process
    (float32, outputs and q/k/v gradients), with and without GQA; and the shapes of [T / cp, T] it allocates,
    against those of the mask the all-gather path made (the probe must see those)."""
    import torch.distributed as dist

    from lightning_par.parallel.context_parallel import ContextParallel, sequence_attention

    result: dict[str, float] = {}
    B, H, T, D = 2, 4, 64, 16
    cp = ContextParallel(group=dist.group.WORLD, size=2, rank=rank)
    cp.shard((torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, dtype=torch.long)))
    index = cp.positions
    for name, kv in (("mha", H), ("gqa", 2)):
        torch.manual_seed(0)  # the same sequence on both ranks
        q, k, v = (torch.randn(B, h, T, D, requires_grad=True) for h in (H, kv, kv))
        grad = torch.randn(B, H, T, D)
        whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != H)
        whole.backward(grad)
        expected = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        probe = _LargestOutputs()
        with cp.step(), probe.mode:
            local = sequence_attention(q[:, :, index], k[:, :, index], v[:, :, index], enable_gqa=kv != H)
            local.backward(grad[:, :, index])
        result[f"{name}_out"] = _rel(local, whole[:, :, index])
        for n, t, want in zip("qkv", (q, k, v), expected, strict=True):
            summed = t.grad.clone()
            dist.all_reduce(summed)  # each rank's gradient of its own share of the loss, summed: the whole one's
            result[f"{name}_grad_{n}"] = _rel(summed, want)
        result[f"{name}_quadratic_shapes"] = len(probe.quadratic(T // 2, T))
    # the probe sees the [T / cp, T] mask of the old path (all-gathered keys, mask from global positions)
    old = _LargestOutputs()
    with old.mode:
        keys = torch.randn(B, H, T, D)
        mask = index[:, None] >= torch.arange(T)[None, :]
        torch.nn.functional.scaled_dot_product_attention(torch.randn(B, H, T // 2, D), keys, keys, attn_mask=mask)
    result["old_quadratic_shapes"] = len(old.quadratic(T // 2, T))
    return result


def _hugging_face_model(rank: int, arch: str) -> dict[str, float]:
    """A Hugging Face model called the Hugging Face way, ``model(**batch).loss``, on each rank's shard (labels with a
    different number of ``-100`` per row, so per shard): its attention through the registered implementation, its
    rotary positions from the global ``position_ids``, its own loss over the whole sequence; against the whole
    sequence in one process."""

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.parallel import context_parallel
    from tests.launch.pipeline_hf_loss import HFStyleLM

    torch.manual_seed(0)
    lm = HFStyleLM(arch)
    lm.configure_model()
    model = lm.model
    ids = torch.randint(0, 256, (4, 33))  # seq_len + 1: the last token is dropped under cp
    labels = ids.clone()
    for row, prompt in enumerate((0, 3, 9, 20)):
        labels[row, :prompt] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    whole = model(**batch).loss
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    blocks = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    cp = context_parallel.apply_context_parallel(lm, [lm], blocks, mesh["cp"])  # lm: no loss_fn, the model's own
    with cp.step():
        loss = model(**cp.shard(batch)).loss
        loss.backward()
    grads = max(_rel(_gradients_over_cp(p.grad), expected[n]) for n, p in model.named_parameters())
    cp.remove()  # the model's own attention and loss again
    plain = model(**batch).loss
    return {"loss": _rel(loss, whole), "grads": grads, "removed": _rel(plain, whole)}


def _activation_bytes(rank: int) -> dict[str, float]:
    """One cp rank's saved-for-backward bytes of the tiny GPT's forward and loss on its shard, and the planner's."""
    import torch.distributed as dist

    from lightning_par import examples
    from lightning_par.measure import ActivationMeter
    from lightning_par.parallel.context_parallel import ContextParallel
    from lightning_par.planner import PRESETS, Candidate, Planner, Workload, build_model, inspect_model

    B, T, kwargs = 2, 64, dict(preset="tiny", n_layers=2)
    torch.manual_seed(0)
    lm = examples.GPTLightningModule(**kwargs)
    lm.configure_model()
    tokens = torch.randint(0, 256, (B, T))
    cp = ContextParallel(group=dist.group.WORLD, size=2, rank=rank)
    inputs, targets = cp.shard((tokens, tokens))
    with ActivationMeter(lm.parameters()) as shard, cp.step():
        cp.positions_given = 1
        cp.mean_loss(lm.loss_fn)(lm.model(inputs, position_ids=cp.positions[None]), targets)
    with ActivationMeter(lm.parameters()) as whole:
        lm.loss_fn(lm.model(tokens), tokens)
    planner = Planner(inspect_model(build_model(examples.GPTLightningModule, kwargs)), PRESETS["cpu"],
                      Workload(B, T, B))
    predicted = planner.estimate(Candidate(1, 1, 1, 0, precision="fp32", cp=2)).ranks[0].activations
    return {"shard": shard.seen_bytes, "whole": whole.seen_bytes, "predicted": predicted}


def _transformed_gpt(rank: int, variants: list[str]) -> dict[str, dict[str, float]]:
    """The example GPT under the cp transform (as parallelize applies it), one step of forward and backward in the
    step context, plain and with each recompute (recomputed in backward: the attention must be the ring's there
    too) and compiled blocks; against the whole sequence in one process. After the step, in the same process, torch's
    F.scaled_dot_product_attention is its own and the model called on the whole sequence is the plain model."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par import examples
    from lightning_par.parallel.compile import BlockCompiler, CompileOptions
    from lightning_par.parallel.context_parallel import _TORCH_SDPA, apply_context_parallel, recompute_contexts
    from lightning_par.parallel.recompute import apply_recompute

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    lm = examples.GPTLightningModule(preset="tiny", n_layers=2)
    lm.configure_model()
    tokens = torch.randint(0, 256, (2, 33))
    batch = (tokens[:, :32], tokens[:, 1:])
    whole = copy.deepcopy(lm)
    whole_loss = whole.loss_fn(whole.model(batch[0]), batch[1])
    whole_loss.backward()
    result = {}
    for variant in variants:
        model = copy.deepcopy(lm)
        blocks = list(model.model.layers.values())
        cp = apply_context_parallel(model, [model], blocks, mesh["cp"])
        apply_recompute(blocks, variant if variant in ("full", "selective") else "none", recompute_contexts)
        if variant == "compile":
            compiler = BlockCompiler(CompileOptions.of({"backend": "aot_eager"}))
            for block in blocks:
                compiler(block)
        inputs, targets = cp.shard(batch)
        with cp.step():  # as the strategy enters it: around forward, and around backward
            loss = model.loss_fn(model(inputs), targets)
        with cp.step():
            loss.backward()
        attention_calls = cp.attention_calls
        grads = max(_rel(_gradients_over_cp(p.grad), q.grad) for p, q in
                    zip(model.parameters(), whole.parameters(), strict=True))
        outside = model.model(batch[0])  # no step: the plain model on the whole sequence
        result[variant] = {"loss": _rel(loss, whole_loss), "grads": grads, "attention_calls": attention_calls,
                           "outside": _rel(outside, whole.model(batch[0])), "calls_outside": cp.attention_calls,
                           "torch_sdpa": float(F.scaled_dot_product_attention is _TORCH_SDPA)}
        dist.barrier()
    return result


def _two_ranks(rank: int, store: str, out: str, archs: list[str]) -> None:
    """Every two-rank check in one spawn (one start-up); rank 0 writes the figures to ``out``."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    result = {"attention": _attention_and_loss(rank), "ring": _ring_attention(rank),
              "activations": _activation_bytes(rank),
              **{arch: _hugging_face_model(rank, arch) for arch in archs},
              "gpt": _transformed_gpt(rank, ["plain", "full", "selective", *(["compile"] if "qwen2" in archs else [])])}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, request):
    import json

    from tests.conftest import full_run

    root = tmp_path_factory.mktemp("cp_two_ranks")
    archs = ["llama", "qwen2"] if full_run(request.config) else ["llama"]
    spawn(_two_ranks, (str(root / "store"), str(root / "out.json"), archs), nprocs=2)
    return json.loads((root / "out.json").read_text())


@pytest.mark.launch(ranks=2)
def test_attention_and_loss_over_two_shards_equal_the_whole_sequence(two_ranks):
    got = two_ranks["attention"]
    print(f"two cp shards vs the whole sequence (float64): {got}")
    assert max(got.values()) <= 1e-12


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("layout", ["mha", "gqa"])
def test_ring_attention_equals_causal_sdpa_of_the_whole_sequence(two_ranks, layout):
    got = {k.removeprefix(f"{layout}_"): v for k, v in two_ranks["ring"].items() if k.startswith(f"{layout}_")}
    print(f"cp=2 ring attention vs causal SDPA of the whole sequence, float32, {layout}: {got}")
    assert max(got[k] for k in ("out", "grad_q", "grad_k", "grad_v")) <= 1e-5


@pytest.mark.launch(ranks=2)
def test_ring_attention_allocates_nothing_of_shard_by_sequence_size(two_ranks):
    got = two_ranks["ring"]
    print(f"[T/cp, T] tensors allocated: ring {got['mha_quadratic_shapes']} (GQA {got['gqa_quadratic_shapes']}), "
          f"the all-gather path's mask {got['old_quadratic_shapes']}")
    assert got["old_quadratic_shapes"] >= 1  # the probe sees such a tensor where one is made
    assert got["mha_quadratic_shapes"] == 0 and got["gqa_quadratic_shapes"] == 0


@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.launch(ranks=2)),
                                  pytest.param("qwen2", marks=pytest.mark.launch(ranks=2, full=True))])
def test_a_hugging_face_model_loss_over_two_shards_equals_the_whole_sequence(two_ranks, arch):
    got = two_ranks[arch]
    print(f"{arch}: the model's own loss on two cp shards vs the whole sequence: {got}")
    assert got["loss"] <= 1e-6 and got["grads"] <= 1e-5
    assert got["removed"] <= 1e-6  # remove() gave the model back its own attention and loss


@pytest.mark.parametrize("variant", [*(pytest.param(v, marks=pytest.mark.launch(ranks=2))
                                       for v in ("plain", "full", "selective")),
                                     pytest.param("compile", marks=pytest.mark.launch(ranks=2, full=True))])
def test_the_transform_trains_the_whole_sequence_and_nothing_outside_a_step_sees_it(two_ranks, variant):
    got = two_ranks["gpt"][variant]
    print(f"cp=2 transform, GPT, {variant}: {got}")
    assert got["loss"] <= 1e-6 and got["grads"] <= 1e-5
    # recomputed blocks called the attention again in backward, through the ring
    assert got["attention_calls"] == (4 if variant in ("full", "selective") else 2)
    # after the step, in the same process: torch's own SDPA, and the model is the plain model (nothing redirected)
    assert got["torch_sdpa"] == 1.0 and got["outside"] <= 1e-6 and got["calls_outside"] == got["attention_calls"]


@pytest.mark.launch(ranks=2)
def test_activation_bytes_per_cp_rank_equal_the_planner(two_ranks):
    got = two_ranks["activations"]
    ratio = got["predicted"] / got["shard"]
    print(f"cp=2 activation bytes per rank: measured {got['shard']}, planner {got['predicted']:.0f} (ratio "
          f"{ratio:.3f}); one process, whole sequence: {got['whole']}")
    assert abs(ratio - 1) <= 0.05
    assert got["shard"] < 0.6 * got["whole"]  # half the tokens, plus the gathered keys and values


@pytest.mark.launch(ranks=2, full=True)
def test_a_model_with_local_positions_is_refused_at_setup_on_every_rank(tmp_path, cache_dir):
    run = launch_cli(tmp_path, cache_dir, ["--model=lightning_par.examples.GPT2LightningModule", "--model.n_layers=2",
                                           "--trainer.strategy=context_parallel2", "--trainer.max_steps=2"], devices=2)
    assert run.returncode != 0
    assert run.log.count("GPT2.forward has no `position_ids` argument") >= 2  # both ranks, before any step


@pytest.mark.parametrize("name", run_cases([(n, (n, r)) for n, r in CP_RUNS.items()]))
def test_losses_match_one_process(runs, name):
    run, reference = runs(name), runs(CP_RUNS[name])
    steps = steps_of(name)
    diff = max_rel_diff(run.losses(), reference.losses(steps=steps))
    print(f"{name}: {steps} steps, per-step loss within {diff:.2e} of {CP_RUNS[name]}")
    assert len(run.losses()) == steps and diff <= LOSS_RTOL
    assert reference.losses()[0] - reference.losses(steps=steps)[-1] > 0.2  # the loss moves: a wrong gradient shows
    assert "context parallel over cp=2" in run.log
