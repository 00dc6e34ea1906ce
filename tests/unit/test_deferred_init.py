"""Deferred construction (lightning_par.parallel.deferred_init): build on meta, materialise a subset bit-exactly."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lightning_par.examples.gpt import GPT, GPTConfig
from lightning_par.parallel.deferred_init import DEFAULT_THRESHOLD, DeferredInitError, deferred_init

ROOT = Path(__file__).resolve().parents[2]


class PlainBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)


class PlainLM(nn.Module):
    """A tutorial-style LM: default PyTorch init, blocks in an nn.ModuleList, a tied head."""

    def __init__(self, vocab: int = 200, dim: int = 96, n_layers: int = 4, max_len: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight


class Tricky(nn.Module):
    """Construction that reads random values, writes through views, reseeds, copies layers and casts."""

    def __init__(self, n: int = 96):
        super().__init__()
        w = torch.empty(n, n).normal_()
        self.doubled = nn.Parameter(w * 2)  # reads a tensor with a pending random init
        scale = w.abs().max().item() if w.sum() > 0 else -1.0  # data-dependent control flow
        self.scaled = nn.Parameter(torch.ones(n) * scale)
        self.trunc = nn.Parameter(torch.empty(n, n))
        nn.init.trunc_normal_(self.trunc, std=1.0, a=-1.5, b=1.5)  # rejection sampling: a data-dependent loop
        self.ortho = nn.Parameter(torch.empty(n, 2 * n))
        nn.init.orthogonal_(self.ortho)  # QR of a random matrix
        torch.manual_seed(1234)
        self.views = nn.Parameter(torch.zeros(2 * n, n))
        self.views.data[: n // 2].uniform_(-1, 1)
        self.views.data[n // 2:, ::2].normal_(3.0)  # a strided view
        gen = torch.Generator().manual_seed(7)
        self.own_gen = nn.Parameter(torch.randn(n, n, generator=gen).to(torch.float64))
        layer = nn.Linear(n, 2 * n)
        self.clones = nn.ModuleList(copy.deepcopy(layer) for _ in range(2))
        nn.init.xavier_uniform_(self.clones[1].weight)
        self.clones.to(torch.bfloat16)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)
        self.register_buffer("angles", torch.outer(torch.arange(2048).float(), inv_freq), persistent=False)
        self.copied = nn.Parameter(torch.empty(n, n))
        with torch.no_grad():
            self.copied.copy_(torch.arange(n * n, dtype=torch.float32).reshape(n, n))
            self.copied.mul_(self.doubled.t())
        assert not self.copied.is_meta and self.copied.device.type == "cpu"


class RandomFactories(nn.Module):
    """Parameters made by random factory ops (randn, rand, randint, randperm, normal, randn_like), not init calls."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(300, 200) * 0.02)
        self.b = nn.Parameter(torch.rand(300, 200, dtype=torch.float64))
        self.c = nn.Parameter(torch.randint(0, 10, (300, 100)).float())
        self.register_buffer("perm", torch.randperm(30000))
        self.d = nn.Parameter(torch.normal(0.5, 2.0, (300, 100)))
        self.e = nn.Parameter(torch.randn_like(self.a))


def gpt(tie: bool = False) -> GPT:
    return GPT(GPTConfig.from_preset("tiny", tie_embeddings=tie))


def gpt_float64() -> GPT:
    """Built under another default dtype (as a precision plugin's init context does); materialised outside it."""
    torch.set_default_dtype(torch.float64)
    try:
        return GPT(GPTConfig.from_preset("tiny"))
    finally:
        torch.set_default_dtype(torch.float32)


def llama(tie: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config)


MODELS = {
    "gpt": gpt,
    "gpt_tied": lambda: gpt(tie=True),
    "gpt_float64": gpt_float64,
    "llama": llama,
    "llama_tied": lambda: llama(tie=True),
    "plain": PlainLM,
    "tricky": Tricky,
    "random_factories": RandomFactories,
}


def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict([*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)])


def eager(build, seed: int = 0):
    torch.manual_seed(seed)
    model = build()
    return model, torch.get_rng_state()


def deferred(build, seed: int = 0, threshold: int = DEFAULT_THRESHOLD):
    torch.manual_seed(seed)
    with deferred_init(threshold) as record:
        model = build()
    record.capture(model)
    return model, record


def assert_same(expected: torch.Tensor, actual: torch.Tensor, name: str) -> None:
    assert not actual.is_meta, name
    assert (actual.dtype, actual.shape, actual.stride()) == (expected.dtype, expected.shape, expected.stride()), name
    assert torch.equal(actual, expected), name


@pytest.mark.parametrize("threshold", [DEFAULT_THRESHOLD, 0], ids=["default_threshold", "everything_deferred"])
@pytest.mark.parametrize("name", list(MODELS))
def test_materialize_all_equals_eager(name, threshold):
    reference, reference_rng = eager(MODELS[name])
    model, record = deferred(MODELS[name], threshold=threshold)
    assert torch.equal(torch.get_rng_state(), reference_rng)  # construction advanced the RNG exactly
    before = tensors(model)
    assert before.keys() == tensors(reference).keys() == set(record.fqns)
    assert any(t.is_meta for t in before.values()) or threshold > 0
    if threshold == 0:
        assert all(t.is_meta for t in before.values())

    torch.manual_seed(99)  # materialize leaves the RNG as it finds it
    rng = torch.get_rng_state()
    record.materialize(model)
    assert torch.equal(torch.get_rng_state(), rng)
    for key, tensor in tensors(reference).items():
        assert_same(tensor, tensors(model)[key], key)
    # ties stay ties
    ties = {id(t) for t in tensors(reference).values()}
    assert len({id(t) for t in tensors(model).values()}) == len(ties)
    # replay held the kept tensors, plus (llama's rotary buffers at threshold 0) the few they were computed from
    assert record.stats["peak_bytes"] <= 1.01 * record.stats["kept_bytes"] or name == "tricky"


def test_materialize_subset_into_a_stage_copy():
    reference, _ = eager(PlainLM)
    model, record = deferred(PlainLM, threshold=1024)
    # a pipeline stage: a copy of the model with every tensor on meta (small real ones too), other ranks' blocks gone
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad) if isinstance(t, nn.Parameter)
                    else torch.empty_like(t, device="meta")) for t in tensors(model).values()}
    stage = copy.deepcopy(model, memo)
    stage.blocks[0] = nn.Identity()
    stage.blocks[1] = nn.Identity()
    stage.tok = stage.pos = None
    keep = {name for name in record.fqns if name.startswith(("blocks.2.", "blocks.3."))}
    record.materialize(stage, keep=keep)

    got = tensors(stage)
    assert set(got) == keep | {"norm.weight", "norm.bias", "head.weight"}
    for name in keep:
        assert_same(tensors(reference)[name], got[name], name)
    for name in set(got) - keep:
        assert got[name].is_meta, name
    assert all(t.is_meta for t in tensors(model).values() if t.numel() >= 1024)  # the original is untouched
    kept_bytes = sum(got[name].untyped_storage().nbytes() for name in keep if got[name].numel() >= 1024)
    assert record.stats["kept_bytes"] == record.stats["peak_bytes"] == kept_bytes


def test_materialize_tied_weight_under_one_name_and_twice():
    reference, _ = eager(lambda: gpt(tie=True))
    model, record = deferred(lambda: gpt(tie=True), threshold=0)
    last = copy.deepcopy(model)
    last.embed = None
    del last.layers["0"]
    record.materialize(last, keep=lambda name: name.startswith(("head.", "norm.", "layers.1.")))
    assert_same(reference.embed.weight, last.head.weight, "head.weight")  # the tie's other name was removed
    assert isinstance(last.head.weight, nn.Parameter) and last.head.weight.requires_grad
    for name, tensor in tensors(last).items():
        assert_same(tensors(reference)[name], tensor, name)

    first = copy.deepcopy(model)  # a second stage from the same record (e.g. the other end of a V schedule)
    record.materialize(first, keep={"embed.weight", "layers.0.attn.q_proj.weight"})
    assert_same(reference.embed.weight, first.embed.weight, "embed.weight")
    assert first.head.weight.is_meta  # tied, but not kept under this name
    assert_same(reference.layers["0"].attn.q_proj.weight, first.layers["0"].attn.q_proj.weight, "q_proj")
    assert first.layers["0"].attn.k_proj.weight.is_meta


def test_deferred_tensors_look_real_during_construction():
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Linear(256, 256)
            seen["is_meta"], seen["device"] = self.big.weight.is_meta, self.big.weight.device
            seen["same"] = self.big.weight.to("cpu") is self.big.weight

    with deferred_init() as record:
        probe = Probe()
    assert seen == {"is_meta": False, "device": torch.device("cpu"), "same": True}
    assert probe.big.weight.is_meta and not probe.big.bias.is_meta  # 65536 elements deferred, 256 real
    assert record.stats["deferred_bytes"] == 256 * 256 * 4


def test_memory_counters_small_gpt():
    config = GPTConfig.from_preset("small")
    model, record = deferred(lambda: GPT(config))
    weight_bytes = 4 * config.dim * config.ffn_dim
    assert record.stats["max_temporary_bytes"] == weight_bytes  # the largest tensor, once
    keep = [name for name in record.fqns if name.startswith("layers.1.")]
    record.materialize(model, keep=keep)
    block_bytes = sum(p.numel() * 4 for name, p in model.named_parameters() if name in keep and p.numel() >= 2**14)
    assert record.stats["peak_bytes"] == record.stats["kept_bytes"] == block_bytes


# Runs in a fresh process, so that memory freed by earlier tests cannot hide an allocation. The two files are loaded
# by path: importing them through their packages would import Lightning (seconds), which the probe does not need.
_RSS_PROBE = textwrap.dedent("""
    import importlib.util, json, sys, torch

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    GPT, GPTConfig = (lambda m: (m.GPT, m.GPTConfig))(load("gpt", sys.argv[1] + "/lightning_par/examples/gpt.py"))
    deferred_init = load("deferred_init", sys.argv[1] + "/lightning_par/parallel/deferred_init.py").deferred_init

    def status(field):
        return 1024 * int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])

    with deferred_init(threshold=0) as warm_up:  # load the code paths (lazy imports, kernels) before measuring
        tiny = GPT(GPTConfig.from_preset("tiny"))
    warm_up.materialize(tiny)
    del tiny, warm_up
    try:
        open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark to the current RSS
    except OSError:
        pass
    base = status("VmRSS")
    config = GPTConfig.from_preset("125m")
    torch.manual_seed(0)
    with deferred_init() as record:
        model = GPT(config)
    record.capture(model)
    keep = [n for n in record.fqns if n.startswith(("layers.0.", "layers.1.", "layers.2."))]
    record.materialize(model, keep=keep)
    print(json.dumps({"growth": status("VmHWM") - base, "full": 4 * config.num_params(), **record.stats}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_rss_building_a_quarter_of_gpt_125m():
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(result)
    quarter = result["kept_bytes"]
    assert 0.24 * result["full"] < quarter < 0.26 * result["full"]  # 3 of 12 blocks
    # The process never held much more than its quarter: not the model, not the temporaries of the other blocks.
    assert result["growth"] < quarter + 32 * 2**20
    assert result["growth"] < 0.35 * result["full"]


def test_errors():
    with deferred_init() as record:
        t = torch.empty(256, 256)
        with pytest.raises(DeferredInitError, match="grows"):
            t.resize_(512, 512)
    with pytest.raises(RuntimeError, match="one construction"):
        with record:
            pass

    source = torch.randn(200, 200)
    with deferred_init() as record:
        module = nn.Module()
        module.weight = nn.Parameter(torch.empty(200, 200))
        with torch.no_grad():
            module.weight.copy_(source)  # a large real tensor, kept by reference
    record.capture(module)
    with pytest.raises(KeyError, match="bias"):
        record.materialize(module, keep={"bias"})
    source.add_(1.0)
    with pytest.raises(DeferredInitError, match="modified in place"):
        record.materialize(module)


class _DecayMask(nn.Module):
    """MiniMax's linear attention in small: a buffer from ``torch.where`` with a Python number on a deferred tensor."""

    def __init__(self, size: int = 64):
        super().__init__()
        rate = torch.rand(size, 1) + 0.5
        steps = torch.arange(size, dtype=torch.float32)
        decay = rate * (steps[:, None] - steps[None, :])
        self.mask = nn.Buffer(torch.exp(torch.where(decay >= 0, -decay, float("-inf"))))
        self.proj = nn.Linear(size, size)


def test_a_python_number_in_torch_where_keeps_its_value():
    """The number became a 0-dim meta tensor at dispatch, its value lost: materialising failed ("Tensor on device
    meta is not on the expected device cpu") -- the conformance matrix's MiniMax under every layout."""
    torch.manual_seed(0)
    eager = _DecayMask()
    torch.manual_seed(0)
    with deferred_init(threshold=0) as record:
        model = _DecayMask()
    assert model.mask.is_meta
    record.materialize(model)
    assert torch.equal(model.mask, eager.mask) and torch.isinf(torch.log(model.mask)).any()
    assert torch.equal(model.proj.weight, eager.proj.weight)


def test_init_module_puts_every_parameter_on_meta_and_materialises_one_process_values():
    """``Trainer.init_module(empty_init=True)`` (the strategy's Construction): small parameters and buffers too are
    on the meta device until setup (as under Lightning's sharded strategies), a tied one stays one Parameter, and
    materialising gives the values one process draws."""
    from lightning_par.strategies.construction import Construction

    def build() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(200, 100), nn.BatchNorm1d(100))
        model.tied = nn.Linear(4, 4, bias=False)
        model.tied.weight = model[0].weight
        return model

    construction = Construction()
    torch.manual_seed(0)
    with construction.init_module():
        model = build()
    on = {name: t.device.type for name, t in model.state_dict(keep_vars=True).items()}
    assert set(on.values()) == {"meta"}, on
    assert model.tied.weight is model[0].weight
    construction.adopt_pending(model)
    construction.take().materialize(model)
    torch.manual_seed(0)
    eager = build()
    assert model.state_dict().keys() == eager.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), eager.state_dict().values(),
                                                 strict=True))
    assert model.tied.weight is model[0].weight and isinstance(model[0].bias, nn.Parameter)
