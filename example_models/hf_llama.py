"""The Hugging Face Llama LightningModule; it now lives with Qwen2 and Mistral in ``example_models.hf_causal_lm``."""

from example_models.hf_causal_lm import HFCausalLMLightningModule, HFLlamaLightningModule

__all__ = ["HFCausalLMLightningModule", "HFLlamaLightningModule"]
