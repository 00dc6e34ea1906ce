"""Context parallel's setup checks of a Hugging Face model, in this process (issue 40's matrix: HY-V4's sparse-
attention indexer reads the attention mask's values, which under cp is not built -- a TypeError on one rank at the
first step before this check)."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_par.parallel.context_parallel import use_hf_attention
from lightning_par.topology import LayoutError

transformers = pytest.importorskip("transformers")


class ReadsTheMask(nn.Module):
    def forward(self, hidden_states, attention_mask=None):
        return hidden_states * attention_mask[:, 0, :, :1]


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def test_a_layer_that_reads_the_masks_values_is_refused_under_cp():
    model = _tiny_llama()
    model.model.layers[0].self_attn.indexer = ReadsTheMask()
    with pytest.raises(LayoutError, match=r"ReadsTheMask \(model.layers.0.self_attn.indexer\) reads the attention "
                                          r"mask's values.*without cp"):
        use_hf_attention(model)


def test_a_model_that_only_passes_the_mask_on_is_not_refused():
    model = _tiny_llama()
    assert use_hf_attention(model)
    assert model.config._attn_implementation != "sdpa"  # the ring's attention set
