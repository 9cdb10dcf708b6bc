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
from oodjax.models.layers import Attention, CausalLM, Decoder, GatedMLP, LayerInputs, RMSNorm
from oodjax.models.rope import RopeConfig, rope_cos_sin

# transformers' Olmo2Config defaults for keys a config.json may omit.
_DEFAULTS = dict(
    vocab_size=50304,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    pad_token_id=1,
    tie_word_embeddings=False,
)
# OLMo2's RMSNorms apply their weight in float32.
_NORM = dict(scale_in_float32=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Olmo2Config(DecoderConfig):
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    attention_bias: bool
    rope: RopeConfig

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, remat: str = "none") -> Olmo2Config:
        return cls(
            **DecoderConfig.hf_fields(raw, _DEFAULTS, remat=remat),
            intermediate_size=hf_value(raw, "intermediate_size", 11008),
            hidden_act=hf_value(raw, "hidden_act", "silu"),
            rms_norm_eps=hf_value(raw, "rms_norm_eps", 1e-5),
            attention_bias=hf_value(raw, "attention_bias", False),
            rope=RopeConfig.from_hf(raw, default_theta=10_000.0),
        )


class Olmo2DecoderLayer(nnx.Module):
    def __init__(self, config: Olmo2Config, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        norm = dict(eps=config.rms_norm_eps, **_NORM)
        bias = config.attention_bias
        self.self_attn = Attention(
            config, qkv_bias=bias, o_bias=bias, qk_norm=norm, norm_per_head=False, dtype=dtype, rngs=rngs
        )
        self.mlp = GatedMLP(config, use_bias=False, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, **_NORM)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, **_NORM)

    def __call__(self, hidden: jax.Array, *inputs: jax.Array) -> jax.Array:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, *inputs))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2Model(Decoder):
    layer_class = Olmo2DecoderLayer
    norm_options = _NORM

    def layer_inputs(self, positions: jax.Array, dtype: jnp.dtype) -> LayerInputs:
        return rope_cos_sin(positions, self.config.rope, self.config.head_dim), {}  # OLMo2 rotates in float32


class Olmo2ForCausalLM(CausalLM):
    config_class = Olmo2Config
    model_class = Olmo2Model
