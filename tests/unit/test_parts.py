"""Split first (lightning_par/parallel/parts.py): the blocks found once, this rank's stages cut, the refusals.

In one process: pp = 1 needs no process group; pp = 2 runs as rank 0 and as rank 1 of a fake 2-rank group
(``torch.testing``'s ``fake`` backend: the split itself never communicates).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_par.examples import GPT, GPTConfig
from lightning_par.parallel.parts import split
from lightning_par.parallel.stage_plan import StagePlan
from lightning_par.topology import LayoutError


def _gpt(tied: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, dim=16, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=8,
                         tie_embeddings=tied))


class Holder(nn.Module):
    """Holds the model as a LightningModule does (``self.model``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class Blockless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)


def test_without_a_pipeline_the_part_is_the_whole_model_and_its_blocks():
    holder = Holder(_gpt())
    parts = split(holder, StagePlan.single(), holder=True)
    assert parts.root is holder and parts.stages == [holder] and not parts.pipelined
    assert parts.block_names == [f"layers.{i}" for i in range(4)] and parts.found.path == "model"
    assert parts.blocks == [holder.model.layers[str(i)] for i in range(4)] and parts.stage_blocks == [parts.blocks]


def test_a_model_without_blocks_is_one_unit_unless_a_transform_needs_them():
    parts = split(Blockless(), need_blocks=False)
    assert parts.found is None and parts.blocks == [] and parts.block_names == []
    with pytest.raises(LayoutError, match="found no repeated blocks"):
        split(Blockless())  # ZeRO-3, recompute and compile need them: the error says how to declare them
    with pytest.raises(LayoutError, match="matches no module"):
        split(Blockless(), block_types=["Block"], need_blocks=False)  # named block types that match nothing


@pytest.fixture
def fake_pp2():
    """Yields a function that runs ``fn(pp_mesh)`` as rank 0 and as rank 1 of a fake 2-rank group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()

    def on_each_rank(fn):
        out = []
        for rank in range(2):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
            try:
                out.append(fn(dist.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))))
            finally:
                dist.destroy_process_group()
        return out

    return on_each_rank


def test_pipeline_split_cuts_this_ranks_stages_into_the_holder(fake_pp2):
    plan = StagePlan.for_schedule("1f1b", 2, 2)

    def cut(mesh):
        holder = Holder(_gpt(tied=True))
        parts = split(holder, plan, mesh, holder=True)
        assert parts.root is holder and holder.model is parts.pipeline.module  # the holder keeps its stages only
        assert len(parts.stages) == 1 and parts.stage_blocks == [parts.blocks]
        return (parts.pipeline.stage_ids, parts.block_names, sorted(n for n, _ in holder.named_parameters()),
                [(t.name, t.source, t.counted_here) for t in parts.pipeline.tied])

    (ids0, blocks0, names0, tied0), (ids1, blocks1, names1, tied1) = fake_pp2(cut)
    assert (ids0, ids1) == ([0], [1]) and (blocks0, blocks1) == (["layers.0", "layers.1"], ["layers.2", "layers.3"])
    assert "model.embed.weight" in names0 and "model.head.weight" in names1  # the unsplit names
    assert not any(n.startswith("model.layers.2") for n in names0)
    # the tied embedding and head: counted on rank 0 (its copy's name there), summed with rank 1's
    assert tied0 == [("embed.weight", 0, True)] and tied1 == [("head.weight", 0, False)]


def test_two_stages_of_one_rank_each_get_their_blocks(fake_pp2):
    plan = StagePlan.for_schedule("interleaved_1f1b", 2, 4)
    (parts0, _) = fake_pp2(lambda mesh: split(_gpt(), plan, mesh))
    assert parts0.pipeline.stage_ids == [0, 2] and len(parts0.stages) == 2
    assert [len(b) for b in parts0.stage_blocks] == [1, 1] and parts0.block_names == ["layers.0", "layers.2"]
    assert parts0.root is parts0.pipeline.module  # a model split alone is its own root


def test_the_split_refuses_what_it_cannot_cut(fake_pp2):
    plan = StagePlan.for_schedule("1f1b", 2, 2)

    class Flat(nn.Module):  # the blocks held by the "LightningModule" itself
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])

    class Scattered(nn.Module):  # blocks of one type under two parents: no known order
        def __init__(self) -> None:
            super().__init__()
            self.left, self.right = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))

    messages = fake_pp2(lambda mesh: [
        pytest.raises(LayoutError, split, Flat(), plan, mesh, holder=True).value,
        pytest.raises(LayoutError, split, Holder(Scattered()), plan, mesh, holder=True, block_types=[nn.Linear]).value,
    ])
    for flat, scattered in messages:
        assert "as a submodule" in str(flat) and "in a known order" in str(scattered)


class ScaledUnmetaLM(nn.Module):
    """Embedding, blocks, norm, head, then a logit scale after the head (Cohere's ``logit_scale``) -- and a block
    whose forward reads a parameter's value, so it does not run on the meta device and the chain check can only
    warn (as it did for every model whose experts run by grouped_mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h) if float(block[0].weight.sum()) > -1e30 else h  # (no value on meta)
        return self.head(self.norm(h)) * 0.0625


def test_earlier_stages_hand_on_their_last_units_output_even_where_the_chain_check_cannot_run(fake_pp2):
    """Issue 40: the stage before the last passed on the model's output, its removed norm and head passing the
    hidden states through and the logit scale after the head applied to them -- wherever the chain check had not
    run (it warns) to say the forward computes after its last unit. Cohere2-MoE trained 7.1e-4 off one process
    under pp2, Inkling 4.7e-4, Beam 1.2e-5. Two stages now compute the whole model's logits."""
    units = ["embed", *(f"blocks.{i}" for i in range(4)), "norm", "head"]
    plan = StagePlan.for_schedule("1f1b", 2, 2)
    torch.manual_seed(0)
    model = ScaledUnmetaLM()
    with pytest.warns(UserWarning, match="could not check"):
        first, last = (parts.stages[0] for parts in fake_pp2(lambda mesh: split(model, plan, mesh, units=units)))
    tokens = torch.randint(0, 32, (2, 4))
    with torch.no_grad():
        handed_on, h = first(tokens), model.embed(tokens)
        for block in model.blocks[:2]:
            h = block(h)
        assert (handed_on - h).abs().max().item() == 0.0  # stage 0's last unit's output, unscaled
        assert (last(handed_on, model_inputs=tokens) - model(tokens)).abs().max().item() == 0.0
