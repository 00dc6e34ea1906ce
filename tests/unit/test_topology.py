"""Rank layout on the (pp, dp, tp) grid, and early, clear rejection of layouts that do not fit."""

import pytest
from lightning.pytorch import Trainer

from lightning_par import Layout, LayoutError, LayoutStrategy, ParallelDims, ZeroStrategy


def test_seed_example_world16_pp4():
    # The seed notes: world 16, pp 4 -> pipeline groups take every 4th rank.
    dims = ParallelDims.resolve(16, pp=4)
    assert (dims.dp, dims.tp, dims.pp) == (4, 1, 4)
    assert dims.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert dims.groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # stage i holds the contiguous block of ranks [i*n/p, (i+1)*n/p)
    assert [dims.coordinates(r)["pp"] for r in range(16)] == [r // 4 for r in range(16)]


def test_tp_innermost_then_dp_then_pp():
    dims = ParallelDims.resolve(16, dp="auto", tp=2, pp=2)
    assert dims.dp == 4
    assert dims.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert dims.group_of(5, "dp") == [1, 3, 5, 7]
    assert dims.group_of(5, "pp") == [5, 13]
    assert dims.coordinates(13) == {"pp": 1, "dp": 2, "cp": 0, "tp": 1}
    for rank in range(16):
        assert dims.rank_of(**dims.coordinates(rank)) == rank


@pytest.mark.parametrize("world,dp,tp,pp", [(8, "auto", 2, 2), (8, 2, 1, 4), (6, 3, 2, 1), (1, 1, 1, 1)])
def test_groups_partition_the_world(world, dp, tp, pp):
    dims = ParallelDims.resolve(world, dp=dp, tp=tp, pp=pp)
    assert dims.world_size == world
    for dim in ("pp", "dp", "tp"):
        ranks = sorted(r for g in dims.groups(dim) for r in g)
        assert ranks == list(range(world))
        assert all(len(g) == getattr(dims, dim) for g in dims.groups(dim))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=8, tp=3), r"tp=3 x pp=1 = 3 does not divide the world size 8"),
        (dict(world_size=8, dp=3, tp=2), r"dp=3 x tp=2 x pp=1 = 6, but the world size is 8.*dp=\"auto\""),
        (dict(world_size=8, tp=0), r"tp=0 is not a valid size"),
        (dict(world_size=8, pp=-2), r"pp=-2 is not a valid size"),
        (dict(world_size=8, dp="two"), r"dp='two' is not a valid size: use a positive integer or \"auto\""),
        (dict(world_size=0), r"world_size=0"),
    ],
)
def test_bad_sizes_say_what_and_how(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        ParallelDims.resolve(**kwargs)


def test_layout_rejects_unavailable_features_with_the_allowed_values():
    with pytest.raises(LayoutError, match=r"zero_stage=5 is not available.*\[0, 1, 2, 3\]"):
        Layout(zero_stage=5)
    with pytest.raises(LayoutError, match="zero_stage=7"):
        ZeroStrategy(stage=7)


def test_layout_that_does_not_fit_fails_in_trainer_before_any_launch():
    # The Trainer resolves the layout in the launching process, so no rank ever starts or waits on a collective.
    with pytest.raises(LayoutError, match="dp=3 x tp=1 x pp=1 = 3, but the world size is 2"):
        Trainer(accelerator="cpu", devices=2, strategy=LayoutStrategy(dp=3), logger=False)


def test_registered_names_resolve_to_our_strategies():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero0", logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.stage == 0
    assert trainer.strategy.dims == ParallelDims(dp=2, tp=1, pp=1)
    assert trainer.strategy.is_distributed
    trainer = Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="lightning_par", logger=False)
    assert trainer.strategy.dims.dp == 4
