"""Example models for lightning-par. They hold no parallel code, only declarations (tp_plan, pp_plan)."""

from example_models.gpt import GPT, GPT_PRESETS, GPTConfig, causal_lm_loss, num_params
from example_models.hf_llama import HFLlamaLightningModule
from example_models.lit_gpt import GPTLightningModule, TokenPerplexity
from example_models.mlp import MLP, MLPDataModule, MLPLightningModule

__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_PRESETS",
    "GPTLightningModule",
    "HFLlamaLightningModule",
    "MLP",
    "MLPDataModule",
    "MLPLightningModule",
    "TokenPerplexity",
    "causal_lm_loss",
    "num_params",
]
