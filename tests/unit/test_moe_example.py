"""The example mixture-of-experts GPT (lightning_par.examples.moe): one process's forward, the reference of expert
parallel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_par.examples import GPT_PRESETS, MOE_PRESETS, MoEConfig, MoEGPT, MoEGPTLightningModule
from lightning_par.examples.moe import MoEFeedForward


def moe(**overrides) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(MoEConfig(**{**vars(MOE_PRESETS["tiny"]), **overrides}))


@pytest.mark.parametrize("shared", [0, 32])
def test_every_token_goes_to_its_top_k_experts_with_renormalised_weights(shared):
    layer = moe(shared_ffn_dim=shared).layers["0"].mlp
    x = torch.randn(3, 5, 64)
    tokens = x.reshape(-1, 64)
    probs = F.softmax(tokens @ layer.router.weight.T, dim=-1)
    top, chosen = probs.topk(2, dim=-1)
    weights = top / top.sum(-1, keepdim=True)
    expected = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):  # token by token, expert by expert: dropless
        for j in range(2):
            e, h = chosen[t, j], tokens[t]
            expected[t] += weights[t, j] * (F.silu(h @ layer.w_gate[e]) * (h @ layer.w_up[e])) @ layer.w_down[e]
        if shared:
            expected[t] += layer.shared(tokens[t:t + 1])[0]
    torch.testing.assert_close(layer(x).reshape(-1, 64), expected, rtol=1e-5, atol=1e-6)
    assert layer.aux_loss is None  # the load-balancing loss is off by default


def test_the_load_balancing_loss_is_the_switch_formula_when_on():
    model = moe(aux_loss_coef=0.01)
    tokens = torch.randint(0, 256, (2, 16))
    layer, inputs = model.layers["0"].mlp, {}
    layer.register_forward_hook(lambda m, args, out: inputs.setdefault("x", args[0]))
    model(tokens)
    x = inputs["x"].reshape(-1, 64)
    probs = F.softmax(layer.router(x), dim=-1)
    counts = torch.bincount(probs.topk(2, dim=-1).indices.flatten(), minlength=4).float()
    expected = 4 * (counts / counts.sum() * probs.mean(0)).sum()
    torch.testing.assert_close(layer.aux_loss, expected)
    assert torch.allclose(model.aux_loss(), 0.01 * sum(model.layers[i].mlp.aux_loss for i in ("0", "1")))


@pytest.mark.parametrize("preset", list(MOE_PRESETS))
def test_parameter_counts_total_and_active(preset):
    config = MOE_PRESETS[preset]
    model = MoEGPT(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    per_expert = 3 * config.dim * config.expert_ffn_dim
    assert config.num_params() - config.active_params() == config.n_layers * (config.n_experts - config.top_k) * \
        per_expert
    assert [type(m) for m in model.modules() if isinstance(m, MoEFeedForward)] == [MoEFeedForward] * config.n_layers


def test_bad_moe_configs_are_refused():
    with pytest.raises(ValueError, match="top_k=5 is larger than n_experts=4"):
        MoEConfig(**{**vars(GPT_PRESETS["tiny"]), "n_experts": 4, "top_k": 5})
    with pytest.raises(ValueError, match="n_experts must be a positive int"):
        MoEConfig(n_experts=0)
    with pytest.raises(ValueError, match="unknown MoE preset 'big'"):
        MoEGPTLightningModule(preset="big")


def test_the_lightning_module_builds_the_moe_model_with_its_overrides():
    module = MoEGPTLightningModule(n_experts=8, top_k=1, shared_ffn_dim=16, optimizer="sgd")
    module.configure_model()
    assert isinstance(module.model, MoEGPT)
    layer = module.model.layers["0"].mlp
    assert (layer.num_experts, layer.top_k, layer.w_gate.shape) == (8, 1, (8, 64, 96))
    assert layer.shared is not None and module.hparams.n_experts == 8
    tokens = torch.randint(0, 256, (2, 9))
    loss = module.compute_loss((tokens[:, :-1], tokens[:, 1:]))
    loss.backward()
    assert layer.w_gate.grad is not None and 5.0 < loss.item() < 6.0  # about ln(256) at initialisation
