"""The Hugging Face Llama LightningModule; it now lives with Qwen2 and Mistral in
``lightning_par.examples.hf_causal_lm``."""

from lightning_par.examples.hf_causal_lm import HFCausalLMLightningModule, HFLlamaLightningModule

__all__ = ["HFCausalLMLightningModule", "HFLlamaLightningModule"]
