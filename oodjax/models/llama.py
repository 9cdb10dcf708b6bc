"""The Llama family: Llama, SmolLM2 ("llama"), SmolLM3 ("smollm3"), Qwen2/Qwen2.5 ("qwen2"), Qwen3 ("qwen3"),
Mistral ("mistral") and Phi-3 ("phi3").

As transformers computes them: pre-RMSNorm blocks, SwiGLU, grouped-query
attention, RoPE with its scaling variants. The variants: SmolLM3's
``no_rope_layers`` (0: no position encoding); Qwen2's q/k/v bias; Qwen3's
per-head RMSNorm of q and k; Mistral's sliding window on every layer;
Phi-3's fused ``qkv_proj`` and ``gate_up_proj``, kept fused as its
checkpoints and peft's adapters name them. Sliding windows are per layer
(``layer_windows``), scanned with the weights.
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

# transformers' LlamaConfig / SmolLM3Config defaults for keys a config.json may omit.
_DEFAULT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "pad_token_id",
    "tie_word_embeddings",
    "rope_theta",
    "rms_norm_eps",
)
_DEFAULTS = {
    model_type: dict(zip(_DEFAULT_KEYS, values, strict=True))
    for model_type, values in {
        "llama": (32000, 4096, 11008, 32, 32, None, None, False, 10_000.0, 1e-6),
        "smollm3": (128256, 2048, 11008, 36, 16, 4, 128004, True, 2_000_000.0, 1e-6),
        "qwen2": (151936, 4096, 22016, 32, 32, 32, None, False, 10_000.0, 1e-6),
        "mistral": (32000, 4096, 14336, 32, 32, 8, None, False, 10_000.0, 1e-6),
        "phi3": (32064, 3072, 8192, 32, 32, None, 32000, False, 10_000.0, 1e-5),
    }.items()
}
_DEFAULTS["qwen3"] = _DEFAULTS["qwen2"]  # Qwen3Config's are Qwen2Config's
# Older names Phi3Config reads as "longrope".
_PHI3_LONGROPE_ALIASES = ("su", "yarn")


def layer_windows(raw: Mapping[str, Any], num_layers: int, rope_layers: tuple[bool, ...]) -> tuple[int | None, ...]:
    """Each layer's sliding window, None for full attention, as transformers decides it for the family."""
    model_type = raw["model_type"]
    if model_type == "mistral":
        return (raw.get("sliding_window", 4096),) * num_layers
    window = raw.get("sliding_window")
    if model_type == "phi3":
        return (window,) * num_layers
    if not hf_value(raw, "use_sliding_window", False) or window is None:
        return (None,) * num_layers
    if model_type == "smollm3":
        derived = ["full_attention" if rope else "sliding_attention" for rope in rope_layers]
    else:
        window_from = hf_value(raw, "max_window_layers", 0)
        derived = ["full_attention" if i < window_from else "sliding_attention" for i in range(num_layers)]
    layer_types = hf_value(raw, "layer_types", derived)
    if len(layer_types) != num_layers:
        raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _phi3_rope(raw: Mapping[str, Any]) -> RopeConfig:
    """Phi-3's RoPE: default or longrope (also under its older names), as Phi3Config accepts."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.pop("type", "default"))
    params["rope_type"] = "longrope" if rope_type in _PHI3_LONGROPE_ALIASES else rope_type
    if params["rope_type"] not in ("default", "longrope"):
        raise ValueError(f"config.json: phi3 rope_type {rope_type!r} is not supported; Phi-3 uses default or longrope")
    return RopeConfig.from_hf({**raw, "rope_parameters": params}, default_theta=_DEFAULTS["phi3"]["rope_theta"])


def _smollm3_rope_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers use RoPE: ``no_rope_layers[i] == 1``; by default every ``no_rope_layer_interval``-th has none."""
    interval = hf_value(raw, "no_rope_layer_interval", 4)
    flags = hf_value(raw, "no_rope_layers", [int((i + 1) % interval != 0) for i in range(num_layers)])
    if len(flags) != num_layers:
        raise ValueError(f"config.json: no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(bool(flag) for flag in flags)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm over head_dim on each head of q and k
    mlp_bias: bool
    rope: RopeConfig
    rope_layers: tuple[bool, ...]
    layer_windows: tuple[int | None, ...]  # each layer's sliding window; None = full attention
    fused_projections: bool  # Phi-3: qkv_proj and gate_up_proj instead of q/k/v_proj and gate/up_proj

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, remat: str = "none") -> LlamaConfig:
        model_type = raw["model_type"]
        defaults = _DEFAULTS[model_type]

        def value(key: str) -> Any:
            return hf_value(raw, key, defaults[key])

        hidden, heads, layers = value("hidden_size"), value("num_attention_heads"), value("num_hidden_layers")
        theta = defaults["rope_theta"]
        rope = _phi3_rope(raw) if model_type == "phi3" else RopeConfig.from_hf(raw, default_theta=theta)
        attention_bias = hf_value(raw, "attention_bias", False)
        rope_layers = _smollm3_rope_layers(raw, layers) if model_type == "smollm3" else (True,) * layers
        return cls(
            model_type=model_type,
            vocab_size=value("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=hf_value(raw, "num_key_value_heads", defaults["num_key_value_heads"] or heads),
            head_dim=hf_value(raw, "head_dim", 128 if model_type == "qwen3" else hidden // heads),
            pad_token_id=raw.get("pad_token_id", defaults["pad_token_id"]),
            tie_word_embeddings=value("tie_word_embeddings"),
            remat=remat,
            intermediate_size=value("intermediate_size"),
            hidden_act=hf_value(raw, "hidden_act", "silu"),
            rms_norm_eps=value("rms_norm_eps"),
            qkv_bias=model_type == "qwen2" or attention_bias,  # Qwen2's q/k/v always have one, its o never
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type == "qwen3",
            mlp_bias=hf_value(raw, "mlp_bias", False),
            rope=rope,
            rope_layers=rope_layers,
            layer_windows=layer_windows(raw, layers, rope_layers),
            fused_projections=model_type == "phi3",
        )


class LlamaAttention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        width = config.hidden_size
        q_width = config.num_attention_heads * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
        self.head_dim = config.head_dim
        self.implementation = config.attention
        self.fused = config.fused_projections
        self.q_width, self.kv_width = q_width, kv_width
        linear = dict(dtype=dtype, rngs=rngs, saved_as=ATTENTION_PROJECTION)
        if self.fused:
            # Split into q, k, v after the projection; on a tensor-sharded mesh that split moves activations.
            self.qkv_proj = Linear(
                width, q_width + 2 * kv_width, use_bias=config.qkv_bias, axes=("embed", "heads"), **linear
            )
        else:
            self.q_proj = Linear(width, q_width, use_bias=config.qkv_bias, axes=("embed", "heads"), **linear)
            self.k_proj = Linear(width, kv_width, use_bias=config.qkv_bias, axes=("embed", "kv_heads"), **linear)
            self.v_proj = Linear(width, kv_width, use_bias=config.qkv_bias, axes=("embed", "kv_heads"), **linear)
        self.o_proj = Linear(q_width, width, use_bias=config.o_bias, axes=("heads", "embed"), **linear)
        norm = dict(eps=config.rms_norm_eps, dtype=dtype)
        self.q_norm = nnx.data(RMSNorm(config.head_dim, **norm) if config.qk_norm else None)
        self.k_norm = nnx.data(RMSNorm(config.head_dim, **norm) if config.qk_norm else None)

    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        positions: jax.Array,
        use_rope: jax.Array,
        window: jax.Array | None = None,
    ) -> jax.Array:
        batch, seq, _ = x.shape
        heads = (batch, seq, -1, self.head_dim)
        if self.fused:
            query, key, value = jnp.split(self.qkv_proj(x), [self.q_width, self.q_width + self.kv_width], axis=-1)
        else:
            query, key, value = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        query, key, value = query.reshape(heads), key.reshape(heads), value.reshape(heads)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        # A traced per-layer flag (the layers are scanned): SmolLM3's NoPE layers keep q and k as they are.
        query = jnp.where(use_rope, apply_rope(query, cos, sin), query)
        key = jnp.where(use_rope, apply_rope(key, cos, sin), key)
        out = attention(
            query,
            key,
            value,
            segment_ids,
            scale=self.head_dim**-0.5,
            window=window,
            positions=positions,
            implementation=self.implementation,
        )
        return constrain(self.o_proj(out.reshape(batch, seq, -1)), HIDDEN)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.self_attn = LlamaAttention(config, dtype=dtype, rngs=rngs)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            act=config.hidden_act,
            use_bias=config.mlp_bias,
            dtype=dtype,
            rngs=rngs,
            fused=config.fused_projections,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def __call__(
        self,
        hidden: jax.Array,
        segment_ids: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        positions: jax.Array,
        use_rope: jax.Array,
        window: jax.Array | None = None,
    ) -> jax.Array:
        attended = self.self_attn(self.input_layernorm(hidden), segment_ids, cos, sin, positions, use_rope, window)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, axes=("vocab", "embed"), dtype=dtype, rngs=rngs
        )
        self.layers = stacked_layers(
            lambda rngs: LlamaDecoderLayer(config, dtype=dtype, rngs=rngs), config.num_hidden_layers, rngs
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def __call__(self, input_ids: jax.Array, segment_ids: jax.Array, *, all_layers: bool):
        positions = segment_positions(segment_ids)
        hidden = self.embed_tokens(input_ids)
        # Llama casts the float32 cos/sin tables to the activations' dtype before rotating.
        cos, sin = (t.astype(hidden.dtype) for t in rope_cos_sin(positions, self.config.rope, self.config.head_dim))
        per_layer = (jnp.asarray(self.config.rope_layers), *scanned_windows(self.config.layer_windows))
        hidden, layer_inputs = run_layers(
            self.layers,
            hidden,
            segment_ids,
            cos,
            sin,
            positions,
            remat=self.config.remat,
            per_layer=per_layer,
            all_layers=all_layers,
        )
        hidden = self.norm(hidden)
        return (*layer_inputs, hidden) if all_layers else hidden


class LlamaForCausalLM(CausalLM):
    config_class = LlamaConfig
    model_class = LlamaModel
