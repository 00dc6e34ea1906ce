"""A Hugging Face MoE model's load-balancing loss under the strategy's ``aux_loss_scope``, in one process: the
statistics lightning_par sums over the ranks give the model's own loss, their sum over two halves of a batch the
loss of the whole batch, and the hook that installs the global scope refuses a model computing another loss.
(Across ranks, against one process: tests/launch/test_hf_moe.py, the ``*_global`` cases.)"""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_par.parallel.router import (
    BALANCING_HOOK,
    GlobalLoadBalancing,
    apply_router_statistics,
    balancing_loss,
    balancing_models,
    balancing_statistics,
)
from lightning_par.topology import LayoutError

transformers = pytest.importorskip("transformers")
from tests.launch.hf_moe import EP_ARCHS, moe_model  # noqa: E402

#: the architectures whose causal LM adds a load-balancing loss (DeepSeek-V3 balances without one)
BALANCED = [arch for arch in EP_ARCHS if arch != "deepseek_v3"]


def _batch(rows: int = 4, length: int = 16, pad: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    ids = torch.randint(0, 256, (rows, length))
    mask = torch.ones_like(ids)
    if pad:  # the last rows' first tokens are padding (left padding, as generation batches are)
        mask[rows // 2:, :pad] = 0
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}


def _stats(model, out, mask=None) -> torch.Tensor:
    return balancing_statistics(out.router_logits, model.num_experts, model.num_experts_per_tok, mask)


@pytest.mark.parametrize("arch", BALANCED)
@pytest.mark.parametrize("pad", [0, 5])
def test_the_statistics_give_the_models_own_loss_and_add_up_over_a_split_batch(arch, pad):
    model = moe_model(arch, aux=0.2)
    batch = _batch(pad=pad)
    mask = batch["attention_mask"] if pad else None
    with torch.no_grad():
        whole = model(**batch)
        halves = [model(**{k: v[r::2] for k, v in batch.items()}) for r in range(2)]
    assert set(balancing_models(model)) == {""}
    # found through a subclass defined elsewhere too (what FSDP2 makes of a sharded module's class)
    model.__class__ = type(f"Sharded{type(model).__name__}", (type(model),), {"__module__": __name__})
    assert set(balancing_models(model)) == {""}
    # the model's own per-forward loss, from the same router logits
    torch.testing.assert_close(balancing_loss(_stats(model, whole, mask), model.num_experts), whole.aux_loss.float(),
                               rtol=1e-6, atol=1e-7)
    summed = sum(_stats(model, out, batch["attention_mask"][r::2] if pad else None) for r, out in enumerate(halves))
    torch.testing.assert_close(summed, _stats(model, whole, mask), rtol=1e-6, atol=1e-5)
    global_loss = balancing_loss(summed, model.num_experts)
    torch.testing.assert_close(global_loss, whole.aux_loss.float(), rtol=1e-6, atol=1e-7)
    # ... which the per-rank losses' mean is not (the reason for the global scope)
    per_rank = sum(float(out.aux_loss) for out in halves) / 2
    assert abs(per_rank - float(whole.aux_loss)) > 1e-5


def test_the_hook_replaces_the_per_rank_term_by_the_global_one_in_the_loss_and_its_gradient():
    """One rank's view, the other rank's statistics added by a stand-in for the sum over ranks: the output's
    ``aux_loss`` is the whole batch's, its ``loss`` this half's language-model loss plus the coefficient times it,
    and the router's gradient that of that loss (the model's own per-rank term cancels)."""
    model = moe_model("qwen3_moe", aux=0.2)
    batch = _batch()
    first, second = ({k: v[r::2] for k, v in batch.items()} for r in range(2))
    with torch.no_grad():
        other = _stats(model, model(**second))
        whole = model(**batch)
    plain = model(**first)
    language = (plain.loss - model.router_aux_loss_coef * plain.aux_loss).detach()
    handle = model.register_forward_hook(GlobalLoadBalancing(model, lambda s: s + other), with_kwargs=True)
    hooked = model(**first)
    handle.remove()
    torch.testing.assert_close(hooked.aux_loss, whole.aux_loss.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(hooked.loss, language + model.router_aux_loss_coef * whole.aux_loss, rtol=1e-6,
                               atol=1e-7)
    gate = model.model.layers[0].mlp.gate.weight
    (grad,) = torch.autograd.grad(hooked.loss, gate)
    expected = model(**first)
    stats = _stats(model, expected) + other
    loss = expected.loss - model.router_aux_loss_coef * expected.aux_loss \
        + model.router_aux_loss_coef * balancing_loss(stats, model.num_experts)
    (want,) = torch.autograd.grad(loss, gate)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-9)
    # the per-rank term's gradient is not what trains: it differs from the global term's
    (local,) = torch.autograd.grad(plain.loss, gate)
    assert (local - want).abs().max() > 1e-4 * want.abs().max()


def test_a_model_computing_another_balancing_loss_is_refused_on_its_first_forward(monkeypatch):
    model = moe_model("mixtral", aux=0.2)
    module = sys.modules[type(model).__module__]
    own = module.load_balancing_loss_func
    monkeypatch.setattr(module, "load_balancing_loss_func", lambda *a, **k: 2 * own(*a, **k))
    model.register_forward_hook(GlobalLoadBalancing(model, lambda s: s), with_kwargs=True)
    with pytest.raises(RuntimeError, match=r"aux_loss_scope='global': MixtralForCausalLM's load-balancing loss is .* "
                                           r"Use aux_loss_scope='micro_batch'"):
        model(**_batch())


def test_the_scope_is_said_installed_once_and_refused_without_a_router():
    model = moe_model("olmoe", aux=0.2)
    batch = _batch()
    with torch.no_grad():
        own = model(**batch)
    for _ in range(2):  # a second setup (fit after validate) replaces the hook, never stacks it
        line = apply_router_statistics(model, None, 1, "global")
    assert line == ("router: OlmoeForCausalLM's load-balancing loss (coefficient 0.2), scope global (all layers' "
                    "statistics summed over the 1 data-parallel ranks)")
    assert len(model._forward_hooks) == 1 and getattr(model, BALANCING_HOOK) is not None
    with torch.no_grad():
        hooked = model(**batch)
    torch.testing.assert_close(hooked.loss, own.loss, rtol=1e-6, atol=1e-7)  # one rank: the same loss
    assert "scope micro_batch (the model's own" in apply_router_statistics(model, None, 1)
    assert not model._forward_hooks
    off = apply_router_statistics(moe_model("qwen3_moe", aux=False), None, 1)
    assert "load-balancing loss off" in off
    with pytest.raises(LayoutError, match="aux_loss_scope='global' but DeepseekV3ForCausalLM has no router"):
        apply_router_statistics(moe_model("deepseek_v3"), None, 1, "global")
    assert apply_router_statistics(moe_model("deepseek_v3"), None, 1) is None


def test_the_strategys_scope_replaces_the_example_layers_own_and_sequence_parallel_refuses_a_balancing_loss():
    from dataclasses import replace

    from lightning_par.examples.moe import MOE_PRESETS, MoEGPT
    from lightning_par.parallel.router import router_layers

    model = MoEGPT(replace(MOE_PRESETS["tiny"], aux_loss_coef=0.01))
    assert {m.aux_loss_scope for m in router_layers(model).values()} == {"micro_batch"}
    assert "scope global" in apply_router_statistics(model, None, 1, "global")
    assert {m.aux_loss_scope for m in router_layers(model).values()} == {"global"}
    with pytest.raises(LayoutError, match=r"sequence_parallel=True with a load-balancing loss \(layers.0.mlp\)"):
        apply_router_statistics(model, None, 1, sequence_parallel=True)
    with pytest.raises(LayoutError, match="sequence_parallel=True with a load-balancing loss"):
        apply_router_statistics(moe_model("qwen3_moe", aux=0.2), None, 1, sequence_parallel=True)
    # the loss off: nothing to refuse
    assert "off" in apply_router_statistics(MoEGPT(MOE_PRESETS["tiny"]), None, 1, sequence_parallel=True)


# -- under a pipeline: each layer's term on its own stage -----------------------------------------------------------
def _layer_terms(model, router_logits, mask) -> torch.Tensor:
    """One process's semantics: coefficient x the sum over the layers of the model's own function of each layer's
    logits alone."""
    function = sys.modules[type(model).__module__].load_balancing_loss_func
    return model.router_aux_loss_coef * sum(function((x,), model.num_experts, model.num_experts_per_tok, mask)
                                            for x in router_logits)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_under_pp_each_layer_starts_its_own_term_in_the_backward_from_its_blocks_output(arch):
    """The hooks a pipeline installs (on the whole model here, one stage): the model called as a stage returns no
    loss of the router logits (output_router_logits=False), each block starts coefficient x its router's term in the
    backward, and the gradient of the language-model loss is then that of LM + the sum of the layers' terms -- not
    of transformers' coupled loss, nor of LM alone. The started values sum to the same number."""
    from lightning_par.parallel.router import (
        LAYER_BALANCING_HOOKS,
        apply_aux_loss_in_backward,
        apply_layer_balancing,
        router_logit_modules,
        started_aux_losses,
    )

    batch = _batch(pad=5)
    mask = batch["attention_mask"]
    model, reference = moe_model(arch, aux=0.2), moe_model(arch, aux=0.2)
    blocks = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert router_logit_modules(model) == {f"{b}.mlp.gate": 0 for b in blocks}
    line = apply_layer_balancing(model, [model], blocks)
    assert "load-balancing loss is the sum of its MoE layers' terms" in line and "0.2" in line
    given = apply_aux_loss_in_backward(model, lambda: 1.0)
    assert set(given) == set(blocks)
    out = model(input_ids=batch["input_ids"], attention_mask=mask)
    assert out.aux_loss is None and out.router_logits is None  # the stage computes no loss of its logits
    lm = model.loss_function(out.logits, batch["labels"], model.config.vocab_size)
    lm.backward()
    started = started_aux_losses(given, 1)

    ref = reference(**batch)  # (the model's own output: LM + coefficient x the coupled loss)
    lm_ref = ref.loss - reference.router_aux_loss_coef * ref.aux_loss
    layers = _layer_terms(reference, ref.router_logits, mask)
    coupled = reference.router_aux_loss_coef * ref.aux_loss
    (lm_ref + layers).backward()
    torch.testing.assert_close(started, layers.detach(), rtol=1e-6, atol=0)
    assert abs(float(layers.detach() - coupled.detach())) > 1e-3  # another function than transformers' own
    diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), reference.parameters(),
                                                                      strict=True))
    router = model.get_submodule("model.layers.0.mlp.gate").weight.grad
    lm_only = torch.autograd.grad(model.loss_function(reference(input_ids=batch["input_ids"], attention_mask=mask)
                                                      .logits, batch["labels"], model.config.vocab_size),
                                  reference.get_submodule("model.layers.0.mlp.gate").weight)[0]
    print(f"{arch}: gradient diff {diff:.2e}; router gradient without the terms "
          f"{float((router - lm_only).abs().max()):.2e} away; layers' terms {float(layers):.4f} vs coupled "
          f"{float(coupled):.4f}")
    assert diff < 1e-6 and float((router - lm_only).abs().max()) > 1e-4
    # a second setup replaces the hooks, not adds to them
    handles = getattr(model, LAYER_BALANCING_HOOKS)
    apply_layer_balancing(model, [model], blocks)
    assert len(getattr(model, LAYER_BALANCING_HOOKS)) == len(handles) and not set(
        map(id, handles)) & set(map(id, getattr(model, LAYER_BALANCING_HOOKS)))


def test_under_pp_the_global_scope_and_a_model_without_recorded_router_logits_are_refused():
    from lightning_par.parallel.pipeline.loss import last_stage_loss
    from lightning_par.parallel.router import apply_layer_balancing

    model = moe_model("mixtral", aux=0.2)
    apply_router_statistics(model, None, 1, "global")  # (one rank: the hook, summing over itself)
    with pytest.raises(LayoutError, match=r"^aux_loss_scope='global' with pipeline parallel: MixtralForCausalLM's "):
        apply_layer_balancing(model, [model], ["model.layers.0", "model.layers.1"])
    getattr(model, BALANCING_HOOK).remove()
    assert apply_layer_balancing(model, [model], []) is not None  # (blocks unknown: each router's parent)
    holder = torch.nn.Module()
    holder.model = moe_model("mixtral", aux=0.2)
    assert last_stage_loss(holder, holder.model, object(), 2) is None  # trained with the layers' terms
    for module in (holder.model, holder.model.model):  # classes that record no router logits
        module.__class__ = type(f"No{type(module).__name__}", (type(module),), {"_can_record_outputs": {}})
    with pytest.raises(LayoutError, match=r"^pipeline parallel \(pp=2\): NoMixtralForCausalLM adds its routers' "
                       r"load-balancing loss .* and its class records no `router_logits` output"):
        last_stage_loss(holder, holder.model, object(), 2)


def test_under_pp_a_recomputed_block_keeps_its_micro_batchs_term():
    """Full recompute, two micro-batches with different padding forwarded before either's backward (1F1B's order
    on a later stage): each block's term is formed outside its recomputed forward, so the mask current when it runs
    again (the other micro-batch's) changes nothing -- the gradients equal LM + each micro-batch's layers' terms."""
    from lightning_par.parallel.recompute import apply_recompute
    from lightning_par.parallel.router import apply_aux_loss_in_backward, apply_layer_balancing

    batch = _batch(rows=4, pad=6)
    batch["attention_mask"][:2, :3] = 0  # (the first micro-batch padded otherwise than the second)
    model, reference = moe_model("qwen3_moe", aux=0.2), moe_model("qwen3_moe", aux=0.2)
    blocks = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    apply_layer_balancing(model, [model], blocks)
    apply_aux_loss_in_backward(model, lambda: 0.5)
    assert apply_recompute([model.get_submodule(b) for b in blocks], "full") == 2
    micro = [{k: v[j:j + 2] for k, v in batch.items()} for j in (0, 2)]
    items = int((batch["labels"][:, 1:] != -100).sum()) / 2  # (each micro-batch's share of the batch's token mean)
    losses = [model.loss_function(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                        use_cache=False).logits,  # (as a stage calls it: no cache to append twice)
                                  b["labels"], model.config.vocab_size, num_items_in_batch=items) for b in micro]
    for loss in reversed(losses):  # (the last micro-batch's mask is current when the first's blocks run again)
        (0.5 * loss).backward()
    expected = 0
    for b in micro:
        out = reference(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        lm = reference.loss_function(out.logits, b["labels"], reference.config.vocab_size, num_items_in_batch=items)
        expected = expected + 0.5 * (lm + _layer_terms(reference, out.router_logits, b["attention_mask"]))
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
