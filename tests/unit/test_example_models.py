import copy
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.examples import (
    GPT,
    GPT_PRESETS,
    MLP,
    GPTConfig,
    GPTLightningModule,
    MLPDataModule,
    MLPLightningModule,
    TokenPerplexity,
    causal_lm_loss,
    num_params,
)
from lightning_par.examples.gpt import Attention, apply_rope, rope_cos_sin


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("tie", [False, True])
def test_num_params_small_presets(preset, tie):
    config = GPTConfig.from_preset(preset, tie_embeddings=tie)
    assert count(GPT(config)) == num_params(config) == config.num_params()


@pytest.mark.parametrize("preset", ["125m", "350m", "1b", "3b"])
def test_num_params_large_presets_on_meta(preset):
    config = GPTConfig.from_preset(preset, n_layers=1, vocab_size=1000)
    with torch.device("meta"):
        model = GPT(config)
    assert count(model) == num_params(config)


def test_8b_formula_is_in_the_billions():
    assert 5e9 < num_params(GPT_PRESETS["8b"]) < 1e10
    assert 7e9 < num_params(GPTConfig.from_preset("8b", vocab_size=128256)) < 9e9


def test_tied_embeddings_share_storage():
    untied = GPTConfig.from_preset("tiny")
    tied = GPTConfig.from_preset("tiny", tie_embeddings=True)
    model = GPT(tied)
    assert model.head.weight is model.embed.weight
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert num_params(untied) - num_params(tied) == untied.vocab_size * untied.dim
    assert count(GPT(untied)) - count(model) == untied.vocab_size * untied.dim


def test_pipeline_units_order():
    model = GPT(GPT_PRESETS["tiny"])
    assert model.pipeline_units() == ["embed", "layers.0", "layers.1", "norm", "head"]
    assert list(GPT.pp_plan) == ["embed", "layers", "norm", "head"]


def test_module_names_match_tp_plan():
    model = GPT(GPT_PRESETS["tiny"])
    names = {name for name, _ in model.named_modules()}
    for pattern in GPT.tp_plan:
        assert pattern.replace("*", "0") in names


def test_forward_shapes_and_loss():
    torch.manual_seed(0)
    config = GPT_PRESETS["tiny"]
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, config.vocab_size)
    loss = causal_lm_loss(logits, tokens)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.5  # near-uniform predictions at init
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, config.max_seq_len + 1, dtype=torch.long))


def test_same_seed_same_weights():
    config = GPT_PRESETS["tiny"]
    torch.manual_seed(123)
    a = GPT(config)
    torch.manual_seed(123)
    b = GPT(config)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_pipeline_stage_keeps_fqns_and_runs_on_hidden():
    torch.manual_seed(0)
    full = GPT(GPT_PRESETS["tiny"])
    tokens = torch.randint(0, 256, (2, 8))
    stage = copy.deepcopy(full)
    del stage.layers["0"]
    stage.embed = None

    full_names = dict(full.named_parameters())
    stage_names = [name for name, _ in stage.named_parameters()]
    assert stage_names and all(name in full_names for name in stage_names)
    assert "layers.1.attn.q_proj.weight" in stage_names
    assert not any(name.startswith(("layers.0.", "embed.")) for name in stage_names)
    assert stage.pipeline_units() == ["layers.1", "norm", "head"]

    with torch.no_grad():
        hidden = full.layers["0"](full.embed(tokens))
        torch.testing.assert_close(stage(hidden), full(tokens))

        # A middle stage: no norm/head either, returns hidden states.
        stage.norm = None
        stage.head = None
        assert stage(hidden).shape == hidden.shape


def test_gqa_attention_matches_explicit_reference():
    torch.manual_seed(0)
    config = GPTConfig(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    attn = Attention(config)
    x = torch.randn(2, 10, config.dim)
    B, T, hd = 2, 10, config.head_dim

    q = attn.q_proj(x).view(B, T, config.n_heads, hd).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, config.n_kv_heads, hd).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, config.n_kv_heads, hd).transpose(1, 2)
    cos, sin = rope_cos_sin(T, hd, config.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = config.n_heads // config.n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, config.dim)
    torch.testing.assert_close(attn(x), attn.o_proj(y))


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["tiny"])
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :-1], model(changed)[:, :-1])


def test_generate_length_and_context_crop():
    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny", max_seq_len=8)
    model = GPT(config)
    out = model.generate(torch.zeros(2, 5, dtype=torch.long), max_new_tokens=10, top_k=5)
    assert out.shape == (2, 15)
    greedy = model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=4, temperature=0)
    assert greedy.shape == (1, 7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dim": 65, "n_heads": 4}, "divisible by n_heads"),
        ({"n_heads": 4, "n_kv_heads": 3}, "divisible by n_kv_heads"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 4}, "even"),
        ({"n_layers": 0}, "n_layers"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_from_preset_errors():
    with pytest.raises(ValueError, match="valid presets: tiny, small"):
        GPTConfig.from_preset("huge")
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        GPTConfig.from_preset("tiny", width=3)
    assert GPTConfig.from_preset("1b", vocab_size=1000).vocab_size == 1000
    assert GPT_PRESETS["1b"].vocab_size == 256  # presets are not mutated


def test_token_perplexity():
    metric = TokenPerplexity()
    metric.update(torch.tensor(1.0), 10)
    metric.update(torch.tensor(2.0), 30)
    torch.testing.assert_close(metric.compute(), torch.tensor(math.exp(1.75), dtype=torch.float64))


def text_batches(n_seqs: int = 8, seq_len: int = 32) -> DataLoader:
    data = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 20))
    seqs = torch.stack([data[i * 3: i * 3 + seq_len + 1] for i in range(n_seqs)])
    return DataLoader(TensorDataset(seqs[:, :-1], seqs[:, 1:]), batch_size=n_seqs)


@pytest.mark.full  # trained by every parity launch
def test_gpt_lightning_module_trains():
    torch.manual_seed(0)
    module = GPTLightningModule(preset="tiny", warmup_steps=5)
    module.configure_model()
    batches = text_batches()
    inputs, targets = next(iter(batches))
    with torch.no_grad():
        before = causal_lm_loss(module(inputs), targets).item()

    trainer = make_trainer(max_steps=20, check_val_every_n_epoch=10)
    trainer.fit(module, train_dataloaders=batches, val_dataloaders=batches)
    with torch.no_grad():
        after = causal_lm_loss(module(inputs), targets).item()
    assert after < before - 1.0
    metrics = trainer.callback_metrics
    assert {"train/loss", "train/ppl", "val/loss", "val/ppl"} <= set(metrics)
    torch.testing.assert_close(metrics["val/ppl"].double().log(), metrics["val/loss"].double(), rtol=1e-4, atol=1e-4)

    # The schedule warmed up, then decayed towards min_lr_ratio * lr.
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert module.hparams.min_lr_ratio * module.hparams.lr <= lr < module.hparams.lr

    trainer.test(module, dataloaders=batches, verbose=False)
    assert "test/ppl" in trainer.callback_metrics
    predictions = trainer.predict(module, dataloaders=batches)
    assert predictions[0].shape == (8, GPTLightningModule.predict_new_tokens)
    assert isinstance(module.sample_text("the ", max_new_tokens=8), str)


def test_gpt_lightning_module_overrides():
    module = GPTLightningModule(preset="small", n_layers=1, vocab_size=300, tie_embeddings=True)
    assert module.model is None
    module.configure_model()
    model = module.model
    module.configure_model()  # idempotent
    assert module.model is model
    assert len(model.layers) == 1 and model.head.weight is model.embed.weight
    assert model.tp_plan is GPT.tp_plan
    with pytest.raises(ValueError, match="valid presets"):
        GPTLightningModule(preset="nope")


def test_mlp_declarations():
    mlp = MLP(dim=16, n_layers=4)
    assert mlp.pipeline_units() == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert list(mlp.tp_plan.values()) == ["colwise", "rowwise", "colwise", "rowwise"]
    names = {name for name, _ in mlp.named_modules()}
    assert set(mlp.tp_plan) <= names
    assert "layers.4.fc" not in MLP(dim=16, n_layers=5).tp_plan  # an unpaired last layer stays replicated
    assert mlp(torch.randn(3, 16)).shape == (3, 16)


def test_mlp_datamodule_is_deterministic_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = MLPDataModule(dim=8, n_samples=100, seed=1), MLPDataModule(dim=8, n_samples=100, seed=1)
    a.setup("fit")
    b.setup("fit")
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert len(a.train_set) == 90 and len(a.val_set) == 10


@pytest.mark.full
def test_mlp_lightning_module_trains():
    torch.manual_seed(0)
    data = MLPDataModule(dim=32, n_samples=1024, batch_size=32)
    module = MLPLightningModule(dim=32, n_layers=4, lr=1e-2)
    module.configure_model()
    data.setup("fit")
    x, y = data.val_set.tensors
    with torch.no_grad():
        before = F.mse_loss(module(x), y).item()
    make_trainer(max_steps=120, limit_val_batches=1).fit(module, datamodule=data)
    with torch.no_grad():
        after = F.mse_loss(module(x), y).item()
    assert after < 0.6 * before
