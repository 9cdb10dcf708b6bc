"""OLMo2 (allenai/OLMo-2-*), as transformers' ``modeling_olmo2.py`` computes it.

Against Llama: no norm on a block's input but one on each branch's output,
RMSNorms over the full q and k projections before RoPE, the norm weight
applied in float32, and RoPE in float32.
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
    segment_positions,
    stacked_layers,
)
from oodjax.models.partitioning import HIDDEN, constrain
from oodjax.models.rope import RopeConfig, apply_rope, rope_cos_sin


@dataclasses.dataclass(frozen=True, kw_only=True)
class Olmo2Config(DecoderConfig):
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    attention_bias: bool
    rope: RopeConfig

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, remat: str = "none") -> Olmo2Config:
        hidden = hf_value(raw, "hidden_size", 4096)
        heads = hf_value(raw, "num_attention_heads", 32)
        return cls(
            model_type="olmo2",
            vocab_size=hf_value(raw, "vocab_size", 50304),
            hidden_size=hidden,
            num_hidden_layers=hf_value(raw, "num_hidden_layers", 32),
            num_attention_heads=heads,
            num_key_value_heads=hf_value(raw, "num_key_value_heads", heads),
            head_dim=hf_value(raw, "head_dim", hidden // heads),
            pad_token_id=raw.get("pad_token_id", 1),
            tie_word_embeddings=hf_value(raw, "tie_word_embeddings", False),
            remat=remat,
            intermediate_size=hf_value(raw, "intermediate_size", 11008),
            hidden_act=hf_value(raw, "hidden_act", "silu"),
            rms_norm_eps=hf_value(raw, "rms_norm_eps", 1e-5),
            attention_bias=hf_value(raw, "attention_bias", False),
            rope=RopeConfig.from_hf(raw, default_theta=10_000.0),
        )


class Olmo2Attention(nnx.Module):
    def __init__(self, config: Olmo2Config, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        width, bias = config.hidden_size, config.attention_bias
        q_width = config.num_attention_heads * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
        self.head_dim = config.head_dim
        self.implementation = config.attention
        linear = dict(use_bias=bias, dtype=dtype, rngs=rngs, saved_as=ATTENTION_PROJECTION)
        self.q_proj = Linear(width, q_width, axes=("embed", "heads"), **linear)
        self.k_proj = Linear(width, kv_width, axes=("embed", "kv_heads"), **linear)
        self.v_proj = Linear(width, kv_width, axes=("embed", "kv_heads"), **linear)
        self.o_proj = Linear(q_width, width, axes=("heads", "embed"), **linear)
        self.q_norm = RMSNorm(q_width, eps=config.rms_norm_eps, dtype=dtype, scale_in_float32=True)
        self.k_norm = RMSNorm(kv_width, eps=config.rms_norm_eps, dtype=dtype, scale_in_float32=True)

    def __call__(self, x: jax.Array, segment_ids: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        heads = (batch, seq, -1, self.head_dim)
        query = apply_rope(self.q_norm(self.q_proj(x)).reshape(heads), cos, sin)
        key = apply_rope(self.k_norm(self.k_proj(x)).reshape(heads), cos, sin)
        value = self.v_proj(x).reshape(heads)
        out = attention(query, key, value, segment_ids, scale=self.head_dim**-0.5, implementation=self.implementation)
        return constrain(self.o_proj(out.reshape(batch, seq, -1)), HIDDEN)


class Olmo2DecoderLayer(nnx.Module):
    def __init__(self, config: Olmo2Config, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        norm = dict(eps=config.rms_norm_eps, dtype=dtype, scale_in_float32=True)
        self.self_attn = Olmo2Attention(config, dtype=dtype, rngs=rngs)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, act=config.hidden_act, use_bias=False, dtype=dtype, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)

    def __call__(self, hidden: jax.Array, segment_ids: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, segment_ids, cos, sin))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2Model(nnx.Module):
    def __init__(self, config: Olmo2Config, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, axes=("vocab", "embed"), dtype=dtype, rngs=rngs
        )
        self.layers = stacked_layers(
            lambda rngs: Olmo2DecoderLayer(config, dtype=dtype, rngs=rngs), config.num_hidden_layers, rngs
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, scale_in_float32=True)

    def __call__(self, input_ids: jax.Array, segment_ids: jax.Array, *, all_layers: bool):
        positions = segment_positions(segment_ids)
        cos, sin = rope_cos_sin(positions, self.config.rope, self.config.head_dim)
        hidden = self.embed_tokens(input_ids)
        hidden, layer_inputs = run_layers(
            self.layers, hidden, segment_ids, cos, sin, remat=self.config.remat, all_layers=all_layers
        )
        hidden = self.norm(hidden)
        return (*layer_inputs, hidden) if all_layers else hidden


class Olmo2ForCausalLM(CausalLM):
    config_class = Olmo2Config
    model_class = Olmo2Model
