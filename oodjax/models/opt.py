"""OPT (facebook/opt-*), as transformers' ``modeling_opt.py`` computes it.

Two layouts: pre-LayerNorm blocks (125m, 1.3b and up) and the opt-350m one
(``do_layer_norm_before=False``: norms after each residual add, no final norm,
and ``project_in``/``project_out`` because ``word_embed_proj_dim`` differs from
the hidden size). Positions are learned, offset by 2, and count from each
prompt's first token (``segment_positions``), so left padding or packing
several prompts into a row does not shift them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from oodjax.models.config import DecoderConfig, hf_value
from oodjax.models.flash_attention import attention
from oodjax.models.layers import (
    ATTENTION_PROJECTION,
    MLP_PROJECTION,
    CausalLM,
    DecoderStack,
    Embed,
    HiddenStates,
    LayerNorm,
    Linear,
    activation,
    run_layers,
    segment_positions,
    stacked_layers,
)
from oodjax.models.partitioning import HIDDEN, MLP_HIDDEN, constrain

# OPT's learned position table has two extra rows (a fairseq legacy).
POSITION_OFFSET = 2
# transformers' OPTConfig defaults for keys a config.json may omit.
_DEFAULTS = dict(
    vocab_size=50272,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    pad_token_id=1,
    tie_word_embeddings=True,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OPTConfig(DecoderConfig):
    ffn_dim: int
    max_position_embeddings: int
    word_embed_proj_dim: int
    do_layer_norm_before: bool
    remove_final_layer_norm: bool
    enable_bias: bool
    layer_norm_elementwise_affine: bool
    activation_function: str

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, remat: str = "none") -> OPTConfig:
        base = DecoderConfig.hf_fields(raw, _DEFAULTS, remat=remat)
        hidden, heads = base["hidden_size"], base["num_attention_heads"]
        if hidden % heads:
            raise ValueError(f"config.json: hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
        return cls(
            **base | dict(num_key_value_heads=heads, head_dim=hidden // heads),
            ffn_dim=hf_value(raw, "ffn_dim", 3072),
            max_position_embeddings=hf_value(raw, "max_position_embeddings", 2048),
            word_embed_proj_dim=hf_value(raw, "word_embed_proj_dim", hidden),
            do_layer_norm_before=hf_value(raw, "do_layer_norm_before", True),
            remove_final_layer_norm=hf_value(raw, "_remove_final_layer_norm", False),
            enable_bias=hf_value(raw, "enable_bias", True),
            layer_norm_elementwise_affine=hf_value(raw, "layer_norm_elementwise_affine", True),
            activation_function=hf_value(raw, "activation_function", "relu"),
        )


def _layer_norm(config: OPTConfig, dtype: jnp.dtype) -> LayerNorm:
    return LayerNorm(config.hidden_size, eps=1e-5, elementwise_affine=config.layer_norm_elementwise_affine, dtype=dtype)


class OPTAttention(nnx.Module):
    def __init__(self, config: OPTConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        width, bias = config.hidden_size, config.enable_bias
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.implementation = config.attention
        linear = functools.partial(Linear, width, width, dtype=dtype, rngs=rngs, saved_as=ATTENTION_PROJECTION)
        self.q_proj = linear(axes=("embed", "heads"), use_bias=bias)
        self.k_proj = linear(axes=("embed", "heads"), use_bias=bias)
        self.v_proj = linear(axes=("embed", "heads"), use_bias=bias)
        self.out_proj = linear(axes=("heads", "embed"), use_bias=bias)

    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        heads = (batch, seq, self.num_heads, self.head_dim)
        # OPT scales the query before the dot product, not the logits; keep its rounding.
        query = (self.q_proj(x) * self.head_dim**-0.5).reshape(heads)
        key = self.k_proj(x).reshape(heads)
        value = self.v_proj(x).reshape(heads)
        out = attention(query, key, value, segment_ids, scale=1.0, implementation=self.implementation)
        return constrain(self.out_proj(out.reshape(batch, seq, -1)), HIDDEN)


class OPTDecoderLayer(nnx.Module):
    def __init__(self, config: OPTConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        width, bias = config.hidden_size, config.enable_bias
        self.norm_before = config.do_layer_norm_before
        self.act_fn = activation(config.activation_function)
        self.self_attn = OPTAttention(config, dtype=dtype, rngs=rngs)
        self.self_attn_layer_norm = _layer_norm(config, dtype)
        linear = functools.partial(Linear, use_bias=bias, dtype=dtype, rngs=rngs, saved_as=MLP_PROJECTION)
        self.fc1 = linear(width, config.ffn_dim, axes=("embed", "mlp"))
        self.fc2 = linear(config.ffn_dim, width, axes=("mlp", "embed"))
        self.final_layer_norm = _layer_norm(config, dtype)

    def __call__(self, hidden: jax.Array, segment_ids: jax.Array) -> jax.Array:
        hidden = self._residual(hidden, self.self_attn_layer_norm, lambda h: self.self_attn(h, segment_ids))
        return self._residual(hidden, self.final_layer_norm, self._mlp)

    def _mlp(self, hidden: jax.Array) -> jax.Array:
        return constrain(self.fc2(constrain(self.act_fn(self.fc1(hidden)), MLP_HIDDEN)), HIDDEN)

    def _residual(self, hidden: jax.Array, norm: LayerNorm, branch: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """``hidden + branch(...)``, normed before the branch (pre-LN) or after the sum (opt-350m)."""
        return hidden + branch(norm(hidden)) if self.norm_before else norm(hidden + branch(hidden))


class OPTDecoder(nnx.Module):
    def __init__(self, config: OPTConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        width, proj = config.hidden_size, config.word_embed_proj_dim
        self.remat = config.remat
        self.embed_tokens = Embed(config.vocab_size, proj, axes=("vocab", "embed"), dtype=dtype, rngs=rngs)
        self.embed_positions = Embed(
            config.max_position_embeddings + POSITION_OFFSET, width, axes=("positions", "embed"), dtype=dtype, rngs=rngs
        )
        projected = proj != width
        linear = functools.partial(Linear, use_bias=False, dtype=dtype, rngs=rngs)
        self.project_in = nnx.data(linear(proj, width, axes=("word_embed", "embed")) if projected else None)
        self.project_out = nnx.data(linear(width, proj, axes=("embed", "word_embed")) if projected else None)
        has_final_norm = config.do_layer_norm_before and not config.remove_final_layer_norm
        self.final_layer_norm = nnx.data(_layer_norm(config, dtype) if has_final_norm else None)
        self.layers = stacked_layers(
            lambda rngs: OPTDecoderLayer(config, dtype=dtype, rngs=rngs), config.num_hidden_layers, rngs
        )

    def __call__(self, input_ids: jax.Array, segment_ids: jax.Array, *, all_layers: bool) -> HiddenStates:
        mask = segment_ids.astype(jnp.int32)
        positions = segment_positions(mask) + POSITION_OFFSET
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions)
        hidden, layer_inputs = run_layers(self.layers, hidden, mask, remat=self.remat, all_layers=all_layers)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return (*layer_inputs, hidden) if all_layers else hidden


class OPTModel(nnx.Module):
    """Holds the decoder, so parameter paths read ``model.decoder.…`` as in transformers."""

    def __init__(self, config: OPTConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.decoder = OPTDecoder(config, dtype=dtype, rngs=rngs)


class OPTForCausalLM(CausalLM):
    config_class = OPTConfig
    model_class = OPTModel
    head_width = "word_embed_proj_dim"

    def decoder(self) -> DecoderStack:
        assert isinstance(self.model, OPTModel)  # model_class
        return self.model.decoder
