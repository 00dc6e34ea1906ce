"""Example models for lightning-par. They hold no parallel code, only declarations (tp_plan, pp_plan)."""

from example_models.gpt import GPT, GPT_PRESETS, GPTConfig, causal_lm_loss, num_params
from example_models.gpt2 import GPT2, GPT2Config, GPT2LightningModule
from example_models.hf_causal_lm import HFCausalLMLightningModule, HFLlamaLightningModule
from example_models.lit_gpt import GPTLightningModule, TokenPerplexity
from example_models.mlp import MLP, MLPDataModule, MLPLightningModule
from example_models.plain_lm import PlainLM, PlainLMLightningModule

__all__ = [
    "GPT",
    "GPT2",
    "GPT2Config",
    "GPT2LightningModule",
    "GPTConfig",
    "GPT_PRESETS",
    "GPTLightningModule",
    "HFCausalLMLightningModule",
    "HFLlamaLightningModule",
    "MLP",
    "MLPDataModule",
    "MLPLightningModule",
    "PlainLM",
    "PlainLMLightningModule",
    "TokenPerplexity",
    "causal_lm_loss",
    "num_params",
]
