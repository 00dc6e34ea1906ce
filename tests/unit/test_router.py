"""The example MoE's router in one process: the capacity rule, the scopes' shared formula, the logged figures, and the
MFU's FLOPs from active parameters. (Across ranks: tests/launch/test_router.py.)"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from lightning_par.examples.gpt import GPT_PRESETS, causal_lm_loss
from lightning_par.examples.lit_gpt import GPTLightningModule
from lightning_par.examples.moe import MOE_PRESETS, MoEConfig, MoEFeedForward, MoEGPT, MoEGPTLightningModule
from lightning_par.parallel.router import (
    SumOverRanks,
    apply_aux_loss_in_backward,
    load_metrics,
    reset_router_load,
    router_layers,
    router_load,
    started_aux_losses,
)
from lightning_par.utilization import active_parameter_count, model_flops_per_token

TINY = MOE_PRESETS["tiny"]  # dim 64, 4 experts of 96, top-2, 2 layers


def _layer(**overrides) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(replace(TINY, **overrides))
    for w in (layer.w_gate, layer.w_up, layer.w_down):
        torch.nn.init.normal_(w, std=0.05)
    return layer


def _by_hand(layer: MoEFeedForward, x: torch.Tensor, capacity: int | None) -> tuple[torch.Tensor, int]:
    """Each token's experts one pair at a time, in token order, an expert taking at most ``capacity`` of them."""
    chosen, weights, _ = layer.route(x)
    taken, dropped, y = [0] * layer.num_experts, 0, torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(layer.top_k):
            e = int(chosen[t, k])
            if capacity is not None and taken[e] >= capacity:
                dropped += 1
                continue
            taken[e] += 1
            h = F.silu(x[t] @ layer.w_gate[e]) * (x[t] @ layer.w_up[e])
            y[t] += weights[t, k] * (h @ layer.w_down[e])
    return y, dropped


@pytest.mark.parametrize("factor", [None, 0.5, 1.0, 1.25])
def test_capacity_keeps_each_experts_first_tokens_and_drops_the_rest(factor):
    layer = _layer(capacity_factor=factor)
    x = torch.randn(50, TINY.dim)
    with torch.no_grad():
        y = layer(x)
    capacity = None if factor is None else math.ceil(factor * 50 * 2 / 4)  # ceil(cf x tokens x top_k / E)
    expected, dropped = _by_hand(layer, x, capacity)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    assert layer.dropped_tokens == dropped
    assert int(layer.tokens_per_expert.sum()) == 100  # routed pairs, before the capacity
    if factor is None:
        assert dropped == 0
    if factor == 0.5:
        assert dropped > 0  # at most `capacity` pairs kept per expert, the rest dropped
        assert dropped == sum(max(0, c - capacity) for c in layer.tokens_per_expert.tolist())


def test_capacity_output_of_a_dropped_token_is_its_residual_only():
    """A token dropped by both its experts: the layer gives 0 (no shared expert), the block's residual carries it."""
    layer = _layer(capacity_factor=0.25)  # capacity ceil(0.25 x 8 x 2 / 4) = 1: one pair per expert
    x = torch.randn(8, TINY.dim)
    with torch.no_grad():
        y = layer(x)
    # 4 experts x 1 pair each: at most 4 tokens get an output, the others exactly 0
    assert int((y.abs().sum(dim=1) == 0).sum()) >= 8 - 4
    assert layer.dropped_tokens == 16 - 4


def test_global_scope_in_one_process_is_the_whole_batchs_loss():
    """One process, no strategy: both scopes compute the Switch loss of its tokens, ``E sum_e f_e P_e``."""
    layer = _layer(aux_loss_coef=0.1)
    glob = _layer(aux_loss_coef=0.1, aux_loss_scope="global")
    x = torch.randn(40, TINY.dim)
    layer(x), glob(x)
    chosen, _, probs = layer.route(x)
    fraction = torch.bincount(chosen.flatten(), minlength=4).float() / 80
    expected = 4 * (fraction * probs.mean(dim=0)).sum()
    torch.testing.assert_close(layer.aux_loss, expected)
    torch.testing.assert_close(glob.aux_loss, expected)
    # a global scope on one rank: the sum over ranks is the identity, meta tensors pass untouched
    glob.router_statistics = SumOverRanks(None, 1)
    glob(x)
    torch.testing.assert_close(glob.aux_loss, expected)
    assert SumOverRanks(None, 2)(torch.empty(3, device="meta")).is_meta


def test_config_refuses_an_unknown_scope_or_a_non_positive_capacity():
    with pytest.raises(ValueError, match="aux_loss_scope must be one of micro_batch, global"):
        replace(TINY, aux_loss_scope="per_rank")
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        replace(TINY, capacity_factor=0)
    assert MoEGPTLightningModule(aux_loss_scope="global", capacity_factor=1.5).config.capacity_factor == 1.5


def test_router_load_figures_and_their_reset():
    model = MoEGPT(TINY)
    model.init_weights()
    with torch.no_grad():
        model(torch.randint(0, TINY.vocab_size, (2, 16)))
        model(torch.randint(0, TINY.vocab_size, (2, 16)))
    load = router_load(model)
    assert sorted(load) == ["layers.0.mlp", "layers.1.mlp"] == sorted(router_layers(model))
    counts, dropped = load["layers.0.mlp"]
    assert float(counts.sum()) == 2 * 32 * 2 and float(dropped) == 0  # two forwards of 32 tokens, top-2
    metrics = load_metrics({"l": (torch.tensor([30.0, 10.0, 20.0, 20.0]), torch.tensor(8.0))})
    assert metrics == {"moe/l/max_over_mean": 1.5, "moe/l/dropped_fraction": 0.1, "moe/l/tokens_expert_0": 30.0,
                       "moe/l/tokens_expert_1": 10.0, "moe/l/tokens_expert_2": 20.0, "moe/l/tokens_expert_3": 20.0}
    assert "moe/l/tokens_expert_0" not in load_metrics({"l": (torch.tensor([1.0, 1.0]), torch.tensor(0.0))}, False)
    reset_router_load(model)
    assert float(router_load(model)["layers.0.mlp"][0].sum()) == 0


def test_mfu_flops_count_the_active_parameters_of_a_mixture_of_experts():
    module = MoEGPTLightningModule(preset="tiny")
    module.configure_model()
    whole, active = TINY.num_params(), TINY.active_params()
    assert (whole, active) == (205_632, 131_904)  # 2 layers x 3 x 64 x 96 x (4 - 2) experts fewer
    flops, how = model_flops_per_token(module, whole, 32)
    assert flops == 6 * 131_904 + 12 * 2 * 64 * 32 == 840_576
    assert "131,904 active parameters of 205,632" in how
    # a model without a config saying it: the routers' unused experts taken off the whole count
    bare = torch.nn.Sequential(MoEFeedForward(TINY))
    n = sum(p.numel() for p in bare.parameters())
    assert active_parameter_count(bare, n) == (n - 3 * 4 * 64 * 96 // 2, "the routers' top_k of their experts")
    # a dense model: no active count, its FLOPs as before
    dense = GPTLightningModule(preset="tiny")
    assert active_parameter_count(dense, 1000) is None
    assert not isinstance(GPT_PRESETS["tiny"], MoEConfig)


def test_a_forward_recomputed_in_the_backward_is_not_counted_twice():
    layer = _layer(capacity_factor=0.5)
    x = torch.randn(30, TINY.dim, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()  # the layer runs twice
    assert int(layer.tokens_per_expert.sum()) == 60
    once = _layer(capacity_factor=0.5)
    once(x.detach())
    assert layer.dropped_tokens == once.dropped_tokens > 0


def test_the_log_line_says_the_scope_and_the_capacity():
    from lightning_par.parallel.router import describe_routers

    def line(**overrides):
        return describe_routers(router_layers(MoEGPT(replace(TINY, **overrides))), 4)

    assert line() == "router: 2 layers, load-balancing loss off (aux_loss_coef=0), dropless"
    assert line(aux_loss_coef=0.01) == ("router: 2 layers, load-balancing loss scope micro_batch (each rank's tokens "
                                        "of each micro-batch), dropless")
    assert line(aux_loss_coef=0.01, aux_loss_scope="global", capacity_factor=1.25) == (
        "router: 2 layers, load-balancing loss scope global (statistics summed over the 4 data-parallel ranks of "
        "each micro-batch), capacity factor 1.25")


def test_a_global_scope_no_strategy_resolved_is_refused_under_several_processes(monkeypatch):
    """A strategy other than lightning-par's leaves ``router_statistics`` unset: each rank would compute its own loss
    under the global name."""
    import lightning_par.parallel.router as router

    layer = _layer(aux_loss_coef=0.1, aux_loss_scope="global")
    monkeypatch.setattr(router.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(router.dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match="aux_loss_scope='global' but no strategy summed its router statistics"):
        layer(torch.randn(8, TINY.dim))
    layer.router_statistics = SumOverRanks(None, 1)  # what a lightning-par strategy sets on one data-parallel rank
    layer(torch.randn(8, TINY.dim))


@pytest.mark.parametrize("recompute", [False, True])
def test_the_aux_loss_started_from_the_layers_output_gives_the_gradient_of_the_loss_plus_it(recompute):
    """What a pipeline stage does (parallel/pipeline/runtime.py): the layers' load-balancing losses start their
    backward from the layers' outputs with the factor the schedule gives each micro-batch's loss, and only the
    language-model loss is backpropagated; the gradients are those of ``mean over micro-batches (lm + aux)``. A
    block recomputed in the backward (non-reentrant checkpoint) starts it once."""
    config = replace(TINY, aux_loss_coef=0.1, n_layers=2)
    torch.manual_seed(0)
    reference = MoEGPT(config)
    reference.init_weights()
    attached = MoEGPT(config)
    attached.load_state_dict(reference.state_dict())
    m = 4
    given = apply_aux_loss_in_backward(attached, lambda: 1 / m)
    assert list(given) == ["layers.0.mlp", "layers.1.mlp"]
    tokens = torch.randint(0, config.vocab_size, (m, 17))
    aux = 0.0
    for chunk in tokens.split(1):
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        ((causal_lm_loss(reference(inputs), targets) + reference.aux_loss()) / m).backward()
        aux += reference.aux_loss().item() / m
        if recompute:
            x = attached.embed(inputs)
            for block in attached.layers.values():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            logits = attached.head(attached.norm(x))
        else:
            logits = attached(inputs)
        assert attached.aux_loss() is None  # (the step adds nothing: it is in the backward)
        (causal_lm_loss(logits, targets) / m).backward()
    for (name, p), q in zip(reference.named_parameters(), attached.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # for the logged loss: the micro-batches' mean of the started losses, summed over the layers (once each)
    assert abs(float(started_aux_losses(given, m)) / aux - 1) < 1e-6 and started_aux_losses(given, m) is None
    router = attached.layers["0"].mlp.router.weight
    assert router.grad.norm() > 0
    # the term is visible: without it, the routers' gradients differ
    plain = MoEGPT(config)
    plain.load_state_dict(reference.state_dict())
    for chunk in tokens.split(1):
        (causal_lm_loss(plain(chunk[:, :-1]), chunk[:, 1:]) / m).backward()
    assert not torch.allclose(plain.layers["0"].mlp.router.weight.grad, router.grad, rtol=1e-3)


def test_the_aux_loss_in_the_backward_is_the_identity_without_grad():
    layer = _layer(aux_loss_coef=0.1)
    apply_aux_loss_in_backward(layer, lambda: 1.0)
    x = torch.randn(8, TINY.dim)
    with torch.no_grad():
        expected = _layer(aux_loss_coef=0.1)(x)
        torch.testing.assert_close(layer(x), expected)
