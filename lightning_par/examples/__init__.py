"""Example models for lightning-par. They hold no parallel code, only declarations (tp_plan, pp_plan)."""

from lightning_par.examples.gpt import GPT, GPT_PRESETS, GPTConfig, causal_lm_loss, num_params
from lightning_par.examples.gpt2 import GPT2, GPT2Config, GPT2LightningModule
from lightning_par.examples.hf_causal_lm import HFCausalLMLightningModule, HFLlamaLightningModule
from lightning_par.examples.lit_gpt import GPTLightningModule, TokenPerplexity
from lightning_par.examples.mlp import MLP, MLPDataModule, MLPLightningModule
from lightning_par.examples.moe import MOE_PRESETS, MoEConfig, MoEGPT, MoEGPTLightningModule
from lightning_par.examples.plain_lm import PlainLM, PlainLMLightningModule

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
    "MOE_PRESETS",
    "MoEConfig",
    "MoEGPT",
    "MoEGPTLightningModule",
    "PlainLM",
    "PlainLMLightningModule",
    "TokenPerplexity",
    "causal_lm_loss",
    "num_params",
]
