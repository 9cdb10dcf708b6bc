"""Architecture numbers of the study's checkpoints, for estimates made without downloading them.

Each entry holds the fields of the checkpoint's `config.json` that decide its
parameter count and cost (copied from the Hugging Face hub pages of these
repositories; the hub is not reachable from tests), plus the parameter count
its authors published:
  OPT: Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models",
       Table 1 (2.7B, 6.7B, 13B, 30B);
  OLMo 2: the model cards of allenai/OLMo-2-1124-7B, -13B and OLMo-2-0325-32B
       (7.30B, 13.7B, 32.2B parameters, as listed on the hub);
  SmolLM3: the model card of HuggingFaceTB/SmolLM3-3B (3.08B parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_OPT_COMMON = dict(model_type="opt", vocab_size=50272, max_position_embeddings=2048, enable_bias=True)
_OLMO2_COMMON = dict(model_type="olmo2", vocab_size=100352, attention_bias=False, tie_word_embeddings=False)

ARCHITECTURES: Mapping[str, Mapping[str, Any]] = {
    "facebook/opt-2.7b": dict(
        _OPT_COMMON, hidden_size=2560, word_embed_proj_dim=2560, ffn_dim=10240,
        num_hidden_layers=32, num_attention_heads=32,
    ),
    "facebook/opt-6.7b": dict(
        _OPT_COMMON, hidden_size=4096, word_embed_proj_dim=4096, ffn_dim=16384,
        num_hidden_layers=32, num_attention_heads=32,
    ),
    "facebook/opt-13b": dict(
        _OPT_COMMON, hidden_size=5120, word_embed_proj_dim=5120, ffn_dim=20480,
        num_hidden_layers=40, num_attention_heads=40,
    ),
    "facebook/opt-30b": dict(
        _OPT_COMMON, hidden_size=7168, word_embed_proj_dim=7168, ffn_dim=28672,
        num_hidden_layers=48, num_attention_heads=56,
    ),
    "allenai/OLMo-2-1124-7B": dict(
        _OLMO2_COMMON, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
    ),
    "allenai/OLMo-2-1124-13B": dict(
        _OLMO2_COMMON, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
    ),
    "allenai/OLMo-2-0325-32B": dict(
        _OLMO2_COMMON, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=4096,
    ),
    "HuggingFaceTB/SmolLM3-3B": dict(
        model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008,
        num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=True, max_position_embeddings=65536,
    ),
}

PUBLISHED_PARAMETERS: Mapping[str, float] = {
    "facebook/opt-2.7b": 2.7e9,
    "facebook/opt-6.7b": 6.7e9,
    "facebook/opt-13b": 13e9,
    "facebook/opt-30b": 30e9,
    "allenai/OLMo-2-1124-7B": 7.30e9,
    "allenai/OLMo-2-1124-13B": 13.7e9,
    "allenai/OLMo-2-0325-32B": 32.2e9,
    "HuggingFaceTB/SmolLM3-3B": 3.08e9,
}


def architecture(hub_id: str) -> Mapping[str, Any]:
    """The config.json numbers of a listed checkpoint; an unknown id is an error naming the known ones."""
    if hub_id not in ARCHITECTURES:
        raise KeyError(f"no architecture numbers for {hub_id!r}; known: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[hub_id]
