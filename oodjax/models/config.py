"""The configuration every model family shares, read from a Hugging Face ``config.json``.

Configs are frozen (hashable) so a model's config is static under ``jax.jit``.
Each family reads its keys with ``hf_value`` and transformers' defaults, so a
config.json means here exactly what it means to transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from oodjax.models.layers import check_remat


def hf_value(raw: Mapping[str, Any], key: str, default: Any) -> Any:
    """``raw[key]``, or transformers' ``default`` when the key is absent or null (as its configs treat null)."""
    value = raw.get(key)
    return default if value is None else value


def layer_windows(raw: Mapping[str, Any], derived: Sequence[str], window: int | None) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) from ``layer_types``, else the family's ``derived`` list."""
    layer_types = hf_value(raw, "layer_types", derived)
    if len(layer_types) != len(derived):
        raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for {len(derived)} layers")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


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
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window; None (or none given) = full attention

    def __post_init__(self) -> None:
        check_remat(self.remat)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @staticmethod
    def hf_fields(raw: Mapping[str, Any], defaults: Mapping[str, Any], *, remat: str) -> dict[str, Any]:
        """The fields above from a config.json, ``defaults`` being the family's for absent keys (without
        ``num_key_value_heads``: one per attention head; without ``head_dim``: hidden_size / heads)."""

        def value(key: str) -> Any:
            return hf_value(raw, key, defaults[key])

        hidden, heads = value("hidden_size"), value("num_attention_heads")
        return dict(
            model_type=raw["model_type"],
            vocab_size=value("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=value("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=hf_value(raw, "num_key_value_heads", defaults.get("num_key_value_heads") or heads),
            head_dim=hf_value(raw, "head_dim", defaults.get("head_dim") or hidden // heads),
            pad_token_id=raw.get("pad_token_id", defaults["pad_token_id"]),
            tie_word_embeddings=value("tie_word_embeddings"),
            remat=remat,
        )
