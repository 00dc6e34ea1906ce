"""A pipeline never changes the function: a model whose forward is not the chain of its units is refused at setup.

All in one process: :func:`check_chain` on the models directly, and the pipeline split
(:func:`~lightning_par.parallel.parts.split`) on a fake 2-rank process group (``torch.testing``'s ``fake`` backend:
no communication), as rank 0 and as rank 1, to show that the error comes from the split on every rank, before any
collective.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_par.examples import GPT, GPT2, MLP, GPT2Config, GPTConfig, causal_lm_loss
from lightning_par.examples import PlainLM as ExamplePlainLM
from lightning_par.parallel.blocks import find_blocks
from lightning_par.parallel.deferred_init import deferred_init
from lightning_par.parallel.pipeline import check_chain, model_units, plan_stages
from lightning_par.parallel.stage_plan import StagePlan
from lightning_par.topology import LayoutError
from tests.launch.pipeline_any_model import Case, make_lm

N_BLOCKS = 4
UNITS = ["embed", *(f"blocks.{i}" for i in range(N_BLOCKS)), "norm", "head"]


class SkipLM(nn.Module):
    """Declares nothing (blocks in an nn.ModuleList): embedding, blocks, norm, head -- and, with ``variant``, a way
    of not being a chain. ``"skip"`` is issue 18's model: the embedding's output added after the blocks."""

    def __init__(self, variant: str = "chain"):
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(N_BLOCKS)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h0 = h = self.embed(tokens)
        if self.variant == "scaled_embedding":  # stage 0 glue: discarded on a later stage (fed by injection)
            h = h * 4.0
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.variant == "between_blocks" and i == 1:
                h = torch.tanh(h)
        if self.variant == "skip":
            h = h + h0
        elif self.variant == "skip_in_place":
            h += h0
        elif self.variant == "modified_in_place":
            h.mul_(2.0)
        elif self.variant == "skip_argument":
            return self.head(self.norm(h, h0))
        if self.variant == "scaled_before_head":  # Inkling's width multiplier between the final norm and the head
            return self.head(self.norm(h) / 4.0)
        out = self.head(self.norm(h))
        if self.variant == "post_processed":  # a logit scale after the head: the last stage's (accepted)
            out = out * 0.5
        if self.variant == "soft_capped":  # Gemma-2's final soft-cap: accepted
            out = torch.tanh(out / 30.0) * 30.0
        if self.variant == "post_in_place":
            out.mul_(0.5)
        if self.variant == "post_with_skip":
            out = out + self.head(h0)
        if self.variant == "cast_and_view":  # the same values: accepted
            out = out[:, slice(0, None)].contiguous().float()
        return out


class TwoArgNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x if extra is None else x + extra)


class DeclaredSkipLM(nn.Module):
    """Declares ``pipeline_units()`` (removed units become None, GPT's protocol). ``"skip"``: issue 18's variant,
    which crashed in the stage forward with "'NoneType' object is not callable"; ``"reembed"`` calls the embedding
    again after the blocks; ``"scaled_embedding"`` scales the embedding before the first block (a later stage would
    scale the activation it receives)."""

    def __init__(self, variant: str = "chain"):
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleDict({str(i): nn.Linear(16, 16) for i in range(N_BLOCKS)})
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32)

    def pipeline_units(self) -> list[str]:
        return UNITS

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.variant == "skip":  # no None check: what crashed with 'NoneType' object is not callable
            x = self.embed(tokens)
        else:
            x = self.embed(tokens) if self.embed is not None else tokens
        if self.variant == "scaled_embedding":
            x = x * 4.0
        h = x
        for block in self.blocks.values():
            h = block(h)
        if self.variant == "skip":
            h = h + x
        if self.variant == "reembed":
            h = h + self.embed(tokens)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def check(model: nn.Module, units=None, pp: int = 2, virtual: int = 1, style: str = "loop") -> float:
    """check_chain on the split the runtime would make; a warning (the check could not run) fails the test."""
    units = model_units(model, units)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return check_chain(model, units, plan_stages(model, StagePlan(pp, virtual, style), units=units))


def refusal(model: nn.Module, units=None, **kwargs) -> str:
    with pytest.raises(LayoutError) as info:
        check(model, units, **kwargs)
    message = str(info.value)
    assert "is not the chain of its pipeline units" in message
    assert "form a chain" in message and "pp=1" in message, "the error says how to fix it"
    return message


# -- refused -------------------------------------------------------------------------------------------------------
def test_skip_connection_is_refused_under_pp2_naming_the_unit():
    message = refusal(SkipLM("skip"), UNITS)
    assert "the output of 'embed' is used out of order" in message
    assert "pipeline unit 'norm' (stage 1)" in message
    assert "'embed' (stage 0)" in message


@pytest.mark.parametrize(("variant", "expected"), [
    ("skip_in_place", "the output of 'embed' is used out of order"),
    ("skip_argument", "is given a tensor computed from the output of 'embed' (stage 0) besides its input"),
    ("modified_in_place", "modifies it in place"),
    ("between_blocks", "pipeline unit 'blocks.2' (stage 1) does not take the output of 'blocks.1'"),
    ("post_in_place", "the model's output is not computed from the output of its last pipeline unit 'head' "
                      "alone: the forward modifies it in place"),
    ("post_with_skip", "calls the pipeline unit 'head' (stage 1) more than once"),
])
def test_other_forwards_that_are_not_a_chain_are_refused(variant, expected):
    model = SkipLM(variant)
    if variant == "skip_argument":
        model.norm = TwoArgNorm(16)
    assert expected in refusal(model, UNITS)


@pytest.mark.parametrize(("variant", "expected"), [
    ("skip", "the output of 'embed' is used out of order"),
    ("reembed", "calls the pipeline unit 'embed' (stage 0) more than once, again after 'blocks.3' (stage 1)"),
    ("scaled_embedding", "pipeline unit 'blocks.0' (stage 0) does not take the output of 'embed'"),
])
def test_pipeline_units_model_gets_the_clear_error(variant, expected):
    """Issue 18: the declared variant crashed inside the stage forward ('NoneType' object is not callable)."""
    assert expected in refusal(DeclaredSkipLM(variant))


def test_runtime_refuses_on_every_rank_before_any_collective():
    """The pipeline split on a fake 2-rank group (no communication): each rank raises from split(), the same
    message; the check runs on the model before it is cut."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_par.parallel.parts import split
    from lightning_par.parallel.pipeline.runtime import PipelineRuntime, resolve_schedule

    assert not dist.is_initialized()
    messages = []
    for rank in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            mesh = dist.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
            for model, units in ((SkipLM("skip"), UNITS), (DeclaredSkipLM("skip"), None)):
                with pytest.raises(LayoutError, match="used out of order") as info:
                    split(model, resolve_schedule("1f1b", 2, 2), mesh, units=units)
                messages.append(str(info.value))
            # a chain goes through
            runtime = PipelineRuntime(split(SkipLM(), resolve_schedule("1f1b", 2, 2), mesh, units=UNITS), mesh,
                                      causal_lm_loss, 0.5, torch.device("cpu"))
            assert runtime.chain_check_seconds < 5
        finally:
            dist.destroy_process_group()
    assert messages[:2] == messages[2:], "every rank gives the same error"


# -- accepted ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["chain", "scaled_embedding", "cast_and_view", "post_processed", "soft_capped"])
def test_chains_are_accepted(variant):
    """Stage 0 glue of a model fed by injection is discarded on later stages; casts and full views keep values;
    what the forward computes from the head's output alone (a scale, a soft-cap) runs on the last stage."""
    check(SkipLM(variant), UNITS)
    check(SkipLM(variant), UNITS, pp=4)


def test_glue_between_units_of_the_last_stage_is_accepted_only_there():
    """Issue 40: Inkling divides its final norm's output by a width multiplier before the head. Both are on the last
    stage, which alone runs that step (every earlier stage hands on its last unit's output), so it is accepted; it
    was refused ("'head' (stage 1) does not take the output of 'norm' unchanged") once the check could run on it.
    Where the split cuts between the two, the next stage would get the unscaled activation: still refused."""
    check(SkipLM("scaled_before_head"), UNITS)
    check(SkipLM("scaled_before_head"), UNITS, pp=4)
    with pytest.raises(LayoutError, match=r"pipeline unit 'head' \(stage 1\) does not take the output of 'norm'"):
        check_chain(SkipLM("scaled_before_head"), UNITS, [UNITS[:-1], UNITS[-1:]])


class GroupedExperts(nn.Module):
    """Experts run by ``torch.nn.functional.grouped_mm`` on float32, as transformers' mixture-of-experts layers do
    on the CPU: its meta kernel takes bfloat16 only."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 16, 16) / 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, 16)
        offs = torch.tensor([flat.size(0) // 2, flat.size(0)], dtype=torch.int32, device=h.device)
        return torch.nn.functional.grouped_mm(flat, self.weight, offs=offs).view_as(h)


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="torch without grouped_mm")
def test_grouped_mm_experts_are_checked_on_meta():
    """Issue 40: Cohere2-MoE, Inkling and Beam run their experts by grouped_mm, which failed on the meta device
    ("Expected inputs of BF16 type"), so the check only warned -- and missed their logit scale after the head, which
    every earlier stage then applied to the activation it passed on (pp2 loss 7.1e-4 off one process)."""
    model = SkipLM("post_processed")
    model.blocks[1] = GroupedExperts()
    x = torch.randint(0, 32, (2, 4))
    assert model(x).shape == (2, 4, 32)  # (runs for real on float32)
    found: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the check runs
        check_chain(model, UNITS, plan_stages(model, StagePlan(2, 1, "loop"), units=UNITS), found=found)
    assert found == {"after_last_unit": True}
    model.variant = "skip"  # and it still refuses what is no chain
    assert "the output of 'embed' is used out of order" in refusal(model, UNITS)


def test_a_model_is_checked_only_where_the_split_cuts():
    """One stage: nothing to check. The glue of the injected model's stage 0 is free wherever stage 0 ends."""
    model = SkipLM("skip")
    assert check_chain(model, UNITS, [UNITS]) == pytest.approx(0, abs=1)


def gpt(n_layers: int = 4, tie: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
                         tie_embeddings=tie))


@pytest.mark.parametrize(("pp", "virtual", "style"), [(2, 1, "loop"), (4, 1, "loop"), (2, 2, "loop"), (2, 2, "v")])
def test_example_gpt_passes(pp, virtual, style):
    check(gpt(8, tie=True), pp=pp, virtual=virtual, style=style)


def test_deferred_gpt_passes_and_is_left_untouched():
    """At setup the model is deferred (large tensors on meta); the check runs on a copy."""
    with deferred_init() as record:
        model = gpt(4)
    record.capture(model)
    before = {n: (p.device, p.shape) for n, p in model.named_parameters()}
    check(model)
    assert {n: (p.device, p.shape) for n, p in model.named_parameters()} == before


def test_other_example_models_pass():
    check(MLP(8, 4))
    for model in (GPT2(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=4, n_head=2)),
                  ExamplePlainLM(vocab_size=64, dim=16, n_layers=4, n_heads=2, max_seq_len=16)):
        blocks = find_blocks(model)
        check(model, list(blocks.units))
        check(model, list(blocks.units), pp=4)


@pytest.mark.parametrize("name", ["plain", "llama", "qwen2", "mistral", "llama_tied"])
def test_pipeline_any_model_cases_pass(name):
    """The models tests/launch/pipeline_any_model.py trains under pp=2 (Hugging Face from tiny configs, the plain
    model), as the engine finds their units; the Hugging Face ones run on meta (value queries on the input answered)."""
    lm = make_lm(Case(name.removesuffix("_tied"), "1f1b", tied=name.endswith("_tied")))
    blocks = find_blocks(lm)
    for virtual in (1, 2):
        seconds = check(blocks.root, list(blocks.units), virtual=virtual)
        assert seconds < 10


class _KindsConfig:
    kinds = ["local", "local", "global", "local"]


class _ByPosition(nn.Module):
    """Picks each layer's setting by its index in the loop, as Gemma-2/3 pick attention (``layer_types[i]``)."""

    def __init__(self):
        super().__init__()
        self.config = _KindsConfig()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.head = nn.Linear(8, 32)

    def forward(self, tokens):
        hidden = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden) * (2.0 if self.config.kinds[i] == "global" else 1.0)
        return self.head(hidden)


class _ByPositionTupled(_ByPosition):
    """The same, its loop not a plain chain of layer outputs (a stand-in could not pass one through)."""

    def forward(self, tokens):
        hidden = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            out = (layer(hidden),)
            hidden = out[0] * (2.0 if self.config.kinds[i] == "global" else 1.0)
        return self.head(hidden)


BY_POSITION_UNITS = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]


def test_a_forward_picking_settings_by_loop_index_keeps_the_index_on_every_stage():
    """The split keeps each layer at its index for such a forward: the stage's list iterates over every slot, the
    other stages' layers passing the hidden states through. Before, stage 1 ran layer 2 ("global") as "local",
    and Gemma-3 trained 5e-5 off one process under pp2, silently."""
    from lightning_par.parallel.pipeline import KeptModuleList
    from lightning_par.parallel.pipeline.chain import check_layer_positions
    from lightning_par.parallel.pipeline.split import stage_view

    model = _ByPosition()
    stages = [BY_POSITION_UNITS[:3], BY_POSITION_UNITS[3:]]
    assert check_layer_positions(model, stages) == ["layers"]
    assert check_layer_positions(model, [BY_POSITION_UNITS]) == []  # one stage: nothing to keep
    later = stage_view(model, stages[1], units=BY_POSITION_UNITS, to_none=False)
    layers = later.layers
    assert isinstance(layers, KeptModuleList) and [int(k) for k in layers._modules] == [2, 3]
    assert len(layers) == 2 and list(layers) == [model.layers[2], model.layers[3]]
    layers.positional = True
    assert len(layers) == 4 and list(layers)[2:] == [model.layers[2], model.layers[3]]
    x = torch.randn(3, 8)
    assert [torch.equal(layer(x), x) for layer in list(layers)[:2]] == [True, True]  # passed through


def test_a_forward_picking_settings_by_loop_index_that_is_no_chain_is_refused():
    from lightning_par.parallel.pipeline.chain import check_layer_positions

    with pytest.raises(LayoutError, match=r"_ByPositionTupled's forward looks up config.kinds\[i\] by each layer's "
                                          r"position in layers, and pipeline stage 1 holds layers 2..3: it would run "
                                          r"layer 2 "
                                          r"with the kinds of layer 0 \('local' instead of 'global'\)"):
        check_layer_positions(_ByPositionTupled(), [BY_POSITION_UNITS[:3], BY_POSITION_UNITS[3:]])
    # a later stage whose layers' kinds agree with those of its positions (layer 3 "local" at position 0): no refusal
    split = [BY_POSITION_UNITS[:4], BY_POSITION_UNITS[4:]]
    assert check_layer_positions(_ByPositionTupled(), split) == []


def test_a_later_unit_that_takes_the_token_ids_is_refused():
    """DeepSeek-V4's decoder layers route their experts by token id (``input_ids`` in the layer's forward); a later
    stage of a Hugging Face model gets ``inputs_embeds``, so the layer would see None there (issue 40's matrix: pp2
    ended with that stage's error while the first stage waited)."""
    from lightning_par.parallel.pipeline.adapter import StageIO
    from lightning_par.parallel.pipeline.chain import check_unit_inputs

    class HashRouted(nn.Linear):
        def forward(self, hidden_states, input_ids=None):
            return super().forward(hidden_states)

    model = nn.Module()
    model.layers = nn.ModuleList([HashRouted(4, 4) for _ in range(4)])
    units = [f"layers.{i}" for i in range(4)]
    hf = StageIO(input_key="input_ids", hidden_key="inputs_embeds")
    with pytest.raises(LayoutError, match=r"HashRouted \(layers.2\) takes the model's `input_ids`.*pp=1"):
        check_unit_inputs(model, units, [units[:2], units[2:]], hf)
    check_unit_inputs(model, units, [units], hf)  # one stage: the model gets its input
    check_unit_inputs(model, units, [units[:2], units[2:]], StageIO(input_key="input_ids", hidden_key="inputs_embeds",
                                                                     inject=True))  # later stages run on the input
