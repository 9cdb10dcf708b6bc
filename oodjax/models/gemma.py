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

from oodjax.models.config import DecoderConfig, hf_value
from oodjax.models.layers import (
    ATTENTION_PROJECTION,
    CausalLM,
    Embed,
    GatedMLP,
    Linear,
    RMSNorm,
    attention,
    run_layers,
    scanned_windows,
    segment_positions,
    stacked_layers,
)
from oodjax.models.partitioning import HIDDEN, constrain
from oodjax.models.rope import RopeConfig, apply_rope, rope_cos_sin

# transformers' Gemma2Config / Gemma3TextConfig defaults for keys a config.json may omit.
_DEFAULTS = {
    "gemma2": dict(vocab_size=256000, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(vocab_size=262208, final_logit_softcapping=None, attn_logit_softcapping=None),
}
# Gemma 3's RoPE bases by default: the full layers' (rope_theta) and the sliding layers' (rope_local_base_freq).
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _nullable(raw: Mapping[str, Any], key: str, default: Any) -> Any:
    """``raw[key]`` where present, null included (null turns a soft cap or a window off); else ``default``."""
    return raw[key] if key in raw else default


def _layer_windows(raw: Mapping[str, Any], num_layers: int, pattern: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, None for full attention: ``layer_types``, else all but each ``pattern``-th."""
    derived = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    layer_types = hf_value(raw, "layer_types", derived)
    if len(layer_types) != num_layers:
        raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for {num_layers} layers")
    window = _nullable(raw, "sliding_window", 4096)
    if window is None and "sliding_attention" in layer_types:
        raise ValueError("config.json: layer_types has sliding_attention layers but sliding_window is null")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


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
    layer_windows: tuple[int | None, ...]  # each layer's sliding window; None = full attention

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, remat: str = "none") -> GemmaConfig:
        model_type = raw["model_type"]
        defaults = _DEFAULTS[model_type]
        if raw.get("use_bidirectional_attention"):
            raise ValueError(f"config.json: use_bidirectional_attention is not supported ({model_type} is causal here)")
        layers = hf_value(raw, "num_hidden_layers", 26)
        if model_type == "gemma2":
            rope = local_rope = RopeConfig.from_hf(raw, default_theta=10_000.0)
        else:
            local_rope, rope = _gemma3_ropes(raw, hf_value(raw, "max_position_embeddings", 131072))
        # Gemma 2's pattern is fixed; Gemma 3's config.json may set its own.
        pattern = 2 if model_type == "gemma2" else hf_value(raw, "sliding_window_pattern", 6)
        return cls(
            model_type=model_type,
            vocab_size=hf_value(raw, "vocab_size", defaults["vocab_size"]),
            hidden_size=hf_value(raw, "hidden_size", 2304),
            num_hidden_layers=layers,
            num_attention_heads=hf_value(raw, "num_attention_heads", 8),
            num_key_value_heads=hf_value(raw, "num_key_value_heads", 4),
            head_dim=hf_value(raw, "head_dim", 256),
            pad_token_id=raw.get("pad_token_id", 0),
            tie_word_embeddings=hf_value(raw, "tie_word_embeddings", True),
            remat=remat,
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
            layer_windows=_layer_windows(raw, layers, pattern),
        )


class GemmaAttention(nnx.Module):
    def __init__(self, config: GemmaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        width = config.hidden_size
        q_width = config.num_attention_heads * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
        self.head_dim = config.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        self.implementation = config.attention
        linear = dict(use_bias=config.attention_bias, dtype=dtype, rngs=rngs, saved_as=ATTENTION_PROJECTION)
        self.q_proj = Linear(width, q_width, axes=("embed", "heads"), **linear)
        self.k_proj = Linear(width, kv_width, axes=("embed", "kv_heads"), **linear)
        self.v_proj = Linear(width, kv_width, axes=("embed", "kv_heads"), **linear)
        self.o_proj = Linear(q_width, width, axes=("heads", "embed"), **linear)
        norm = dict(eps=config.rms_norm_eps, dtype=dtype, unit_offset=True)
        self.q_norm = nnx.data(RMSNorm(config.head_dim, **norm) if config.qk_norm else None)
        self.k_norm = nnx.data(RMSNorm(config.head_dim, **norm) if config.qk_norm else None)

    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        positions: jax.Array,
        window: jax.Array | None,
    ) -> jax.Array:
        batch, seq, _ = x.shape
        heads = (batch, seq, -1, self.head_dim)
        query, key = self.q_proj(x).reshape(heads), self.k_proj(x).reshape(heads)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        value = self.v_proj(x).reshape(heads)
        out = attention(
            query,
            key,
            value,
            segment_ids,
            scale=self.scale,
            window=window,
            positions=positions,
            softcap=self.softcap,
            implementation=self.implementation,
        )
        return constrain(self.o_proj(out.reshape(batch, seq, -1)), HIDDEN)


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, config: GemmaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.self_attn = GemmaAttention(config, dtype=dtype, rngs=rngs)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, act=config.hidden_act, use_bias=False, dtype=dtype, rngs=rngs
        )
        norm = dict(eps=config.rms_norm_eps, dtype=dtype, unit_offset=True)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)

    def __call__(
        self,
        hidden: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        global_rope: tuple[jax.Array, jax.Array],
        local_rope: tuple[jax.Array, jax.Array],
        uses_local_rope: jax.Array,
        window: jax.Array | None = None,
    ) -> jax.Array:
        # A traced per-layer flag (the layers are scanned): Gemma 3's sliding layers rotate with the local RoPE.
        cos, sin = (jnp.where(uses_local_rope, local, full) for local, full in zip(local_rope, global_rope))
        attended = self.self_attn(self.input_layernorm(hidden), segment_ids, cos, sin, positions, window)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nnx.Module):
    def __init__(self, config: GemmaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, axes=("vocab", "embed"), dtype=dtype, rngs=rngs
        )
        self.layers = stacked_layers(
            lambda rngs: GemmaDecoderLayer(config, dtype=dtype, rngs=rngs), config.num_hidden_layers, rngs
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, unit_offset=True)

    def __call__(self, input_ids: jax.Array, segment_ids: jax.Array, *, all_layers: bool):
        positions = segment_positions(segment_ids)
        hidden = self.embed_tokens(input_ids)
        # sqrt(hidden_size) rounded to the embedding's dtype first (55.4256 becomes 55.5 in bf16), as transformers does.
        hidden = hidden * jnp.asarray(self.config.hidden_size**0.5, hidden.dtype)
        config = self.config

        def tables(rope: RopeConfig) -> tuple[jax.Array, jax.Array]:
            # cos/sin in float32, cast to the activations' dtype before rotating, as transformers does.
            return tuple(t.astype(hidden.dtype) for t in rope_cos_sin(positions, rope, config.head_dim))

        global_rope = tables(config.rope)
        local_rope = global_rope if config.local_rope == config.rope else tables(config.local_rope)
        sliding = [window is not None for window in config.layer_windows]
        per_layer = (jnp.asarray(sliding), *scanned_windows(config.layer_windows))
        hidden, layer_inputs = run_layers(
            self.layers,
            hidden,
            segment_ids,
            positions,
            global_rope,
            local_rope,
            remat=config.remat,
            per_layer=per_layer,
            all_layers=all_layers,
        )
        hidden = self.norm(hidden)
        return (*layer_inputs, hidden) if all_layers else hidden


class GemmaForCausalLM(CausalLM):
    config_class = GemmaConfig
    model_class = GemmaModel
