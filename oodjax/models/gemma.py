"""Gemma 2 ("gemma2") and Gemma 3's text model ("gemma3_text"), as transformers' ``modeling_gemma2.py`` /
``modeling_gemma3.py`` compute them.

Against Llama: embeddings scaled by sqrt(hidden_size), norms of ``1 +
weight`` before and after each branch, GeGLU, attention scaled by
``query_pre_attn_scalar ** -0.5``, a tied head, and layers alternating
between a sliding window and full attention. Gemma 2 soft-caps the
attention scores and the final logits; Gemma 3 instead normalises each head
of q and k and rotates its sliding layers with a local, unscaled RoPE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from oodjax.models.config import DecoderConfig, hf_value, layer_windows
from oodjax.models.layers import Attention, CausalLM, Decoder, GatedMLP, LayerInputs, RMSNorm
from oodjax.models.rope import RopeConfig, rope_cos_sin

# transformers' Gemma2Config / Gemma3TextConfig defaults for keys a config.json may omit.
_SHARED_DEFAULTS = dict(
    hidden_size=2304,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    pad_token_id=0,
    tie_word_embeddings=True,
)
_DEFAULTS: dict[str, dict[str, Any]] = {  # config.json values, as ``raw``'s
    "gemma2": dict(_SHARED_DEFAULTS, vocab_size=256000, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(_SHARED_DEFAULTS, vocab_size=262208, final_logit_softcapping=None, attn_logit_softcapping=None),
}
# Gemma 3's RoPE bases by default: the full layers' (rope_theta) and the sliding layers' (rope_local_base_freq).
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# Gemma's RMSNorms store their weight as an offset from one.
_NORM = dict(unit_offset=True)


def _nullable(raw: Mapping[str, Any], key: str, default: Any) -> Any:
    """``raw[key]`` where present, null included (null turns a soft cap or a window off); else ``default``."""
    return raw[key] if key in raw else default


def _layer_windows(raw: Mapping[str, Any], num_layers: int, pattern: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, None for full attention: ``layer_types``, else all but each ``pattern``-th."""
    derived = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    window = _nullable(raw, "sliding_window", 4096)
    if window is None and "sliding_attention" in hf_value(raw, "layer_types", derived):
        raise ValueError("config.json: layer_types has sliding_attention layers but sliding_window is null")
    return layer_windows(raw, derived, window)


def _gemma3_ropes(raw: Mapping[str, Any], max_positions: int) -> tuple[RopeConfig, RopeConfig]:
    """(local, global) RoPE: transformers-5's ``rope_parameters`` per layer type, or the older keys."""
    per_type = raw.get("rope_parameters")
    if per_type is None:
        per_type = {
            "sliding_attention": {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq")},
            "full_attention": {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta")},
        }
    elif not set(per_type) <= set(_GEMMA3_THETA):
        raise ValueError(
            f"config.json: gemma3_text rope_parameters must be keyed by layer type {sorted(_GEMMA3_THETA)}; "
            f"got keys {sorted(per_type)}"
        )
    ropes = []
    for layer_type in ("sliding_attention", "full_attention"):
        params = {key: value for key, value in (per_type.get(layer_type) or {}).items() if value is not None}
        one = {"rope_parameters": params, "max_position_embeddings": max_positions}
        ropes.append(RopeConfig.from_hf(one, default_theta=_GEMMA3_THETA[layer_type]))
    return ropes[0], ropes[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig(DecoderConfig):
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    attention_bias: bool
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None  # Gemma 2: attention scores are cap * tanh(scores / cap)
    qk_norm: bool  # Gemma 3: an RMSNorm over head_dim on each head of q and k
    rope: RopeConfig  # the full-attention layers'
    local_rope: RopeConfig  # the sliding layers' (Gemma 2: the same)

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, remat: str = "none") -> GemmaConfig:
        model_type = raw["model_type"]
        defaults = _DEFAULTS[model_type]
        if raw.get("use_bidirectional_attention"):
            raise ValueError(f"config.json: use_bidirectional_attention is not supported ({model_type} is causal here)")
        base = DecoderConfig.hf_fields(raw, defaults, remat=remat)
        if model_type == "gemma2":
            rope = local_rope = RopeConfig.from_hf(raw, default_theta=10_000.0)
        else:
            local_rope, rope = _gemma3_ropes(raw, hf_value(raw, "max_position_embeddings", 131072))
        # Gemma 2's pattern is fixed; Gemma 3's config.json may set its own.
        pattern = 2 if model_type == "gemma2" else hf_value(raw, "sliding_window_pattern", 6)
        return cls(
            **base,
            final_logit_softcapping=_nullable(raw, "final_logit_softcapping", defaults["final_logit_softcapping"]),
            intermediate_size=hf_value(raw, "intermediate_size", 9216),
            hidden_act=hf_value(raw, "hidden_activation", "gelu_pytorch_tanh"),
            rms_norm_eps=hf_value(raw, "rms_norm_eps", 1e-6),
            attention_bias=hf_value(raw, "attention_bias", False),
            query_pre_attn_scalar=hf_value(raw, "query_pre_attn_scalar", 256),
            attn_logit_softcapping=_nullable(raw, "attn_logit_softcapping", defaults["attn_logit_softcapping"]),
            qk_norm=model_type == "gemma3_text",
            rope=rope,
            local_rope=local_rope,
            layer_windows=_layer_windows(raw, base["num_hidden_layers"], pattern),
        )


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, config: GemmaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        norm = dict(eps=config.rms_norm_eps, **_NORM)
        self.self_attn = Attention(
            config,
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            scale=config.query_pre_attn_scalar**-0.5,
            softcap=config.attn_logit_softcapping,
            qk_norm=norm if config.qk_norm else None,
            dtype=dtype,
            rngs=rngs,
        )
        self.mlp = GatedMLP(config, use_bias=False, dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, **_NORM)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, **_NORM)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, **_NORM)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, **_NORM)

    def __call__(
        self,
        hidden: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        global_rope: tuple[jax.Array, jax.Array],
        local_rope: tuple[jax.Array, jax.Array],
        *,
        uses_local_rope: jax.Array,
        window: jax.Array | None = None,
    ) -> jax.Array:
        # A traced per-layer flag (the layers are scanned): Gemma 3's sliding layers rotate with the local RoPE.
        cos, sin = (jnp.where(uses_local_rope, local, full) for local, full in zip(local_rope, global_rope))
        attended = self.self_attn(self.input_layernorm(hidden), segment_ids, positions, cos, sin, window=window)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(Decoder):
    layer_class = GemmaDecoderLayer
    norm_options = _NORM

    def embed(self, input_ids: jax.Array) -> jax.Array:
        hidden = self.embed_tokens(input_ids)
        # sqrt(hidden_size) rounded to the embedding's dtype first (55.4256 becomes 55.5 in bf16), as transformers does.
        return hidden * jnp.asarray(self.config.hidden_size**0.5, hidden.dtype)

    def layer_inputs(self, positions: jax.Array, dtype: jnp.dtype) -> LayerInputs:
        """The full layers' (cos, sin) and the sliding layers', cast to the activations' dtype as transformers does."""
        config = self.config
        global_rope = rope_cos_sin(positions, config.rope, config.head_dim, dtype)
        local_rope = (
            global_rope
            if config.local_rope == config.rope
            else rope_cos_sin(positions, config.local_rope, config.head_dim, dtype)
        )
        sliding = [window is not None for window in config.layer_windows]
        return (global_rope, local_rope), {"uses_local_rope": jnp.asarray(sliding)}


class GemmaForCausalLM(CausalLM):
    config_class = GemmaConfig
    model_class = GemmaModel
