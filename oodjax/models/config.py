"""The configuration every model family shares, read from a Hugging Face ``config.json``.

Configs are frozen (hashable) so a model's config is static under ``jax.jit``.
Each family reads its keys with ``hf_value`` and transformers' defaults, so a
config.json means here exactly what it means to transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from oodjax.models.layers import check_remat


def hf_value(raw: Mapping[str, Any], key: str, default: Any) -> Any:
    """``raw[key]``, or transformers' ``default`` when the key is absent or null (as its configs treat null)."""
    value = raw.get(key)
    return default if value is None else value


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Fields the engine relies on for any family."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    pad_token_id: int | None
    tie_word_embeddings: bool
    remat: str = "none"  # a name of layers.REMAT_POLICIES: what each scanned layer keeps for the backward pass
    final_logit_softcapping: float | None = None  # Gemma 2: logits are cap * tanh(logits / cap)
    attention: str = "auto"  # a name of flash_attention.IMPLEMENTATIONS: the attention kernel

    def __post_init__(self):
        check_remat(self.remat)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
