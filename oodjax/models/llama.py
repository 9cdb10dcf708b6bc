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

from oodjax.models.config import DecoderConfig, hf_value, layer_windows
from oodjax.models.layers import Attention, CausalLM, Decoder, GatedMLP, LayerInputs, RMSNorm
from oodjax.models.rope import RopeConfig, rope_cos_sin

# transformers' LlamaConfig / SmolLM3Config defaults for keys a config.json may omit.
_DEFAULT_KEYS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads pad_token_id "
    "tie_word_embeddings rope_theta rms_norm_eps"
).split()
_DEFAULTS: dict[str, dict[str, Any]] = {  # config.json values, as ``raw``'s
    model_type: dict(zip(_DEFAULT_KEYS, values, strict=True))
    for model_type, values in {
        "llama": (32000, 4096, 11008, 32, 32, None, None, False, 10_000.0, 1e-6),
        "smollm3": (128256, 2048, 11008, 36, 16, 4, 128004, True, 2_000_000.0, 1e-6),
        "qwen2": (151936, 4096, 22016, 32, 32, 32, None, False, 10_000.0, 1e-6),
        "mistral": (32000, 4096, 14336, 32, 32, 8, None, False, 10_000.0, 1e-6),
        "phi3": (32064, 3072, 8192, 32, 32, None, 32000, False, 10_000.0, 1e-5),
    }.items()
}
_DEFAULTS["qwen3"] = {**_DEFAULTS["qwen2"], "head_dim": 128}  # Qwen3Config's are Qwen2Config's, but head_dim
# Older names Phi3Config reads as "longrope".
_PHI3_LONGROPE_ALIASES = ("su", "yarn")


def _layer_windows(raw: Mapping[str, Any], num_layers: int, rope_layers: tuple[bool, ...]) -> tuple[int | None, ...]:
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
    return layer_windows(raw, derived, window)


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
    fused_projections: bool  # Phi-3: qkv_proj and gate_up_proj instead of q/k/v_proj and gate/up_proj

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, remat: str = "none") -> LlamaConfig:
        model_type = raw["model_type"]
        defaults = _DEFAULTS[model_type]
        base = DecoderConfig.hf_fields(raw, defaults, remat=remat)
        layers = base["num_hidden_layers"]
        theta = defaults["rope_theta"]
        rope = _phi3_rope(raw) if model_type == "phi3" else RopeConfig.from_hf(raw, default_theta=theta)
        attention_bias = hf_value(raw, "attention_bias", False)
        rope_layers = _smollm3_rope_layers(raw, layers) if model_type == "smollm3" else (True,) * layers
        return cls(
            **base,
            intermediate_size=hf_value(raw, "intermediate_size", defaults["intermediate_size"]),
            hidden_act=hf_value(raw, "hidden_act", "silu"),
            rms_norm_eps=hf_value(raw, "rms_norm_eps", defaults["rms_norm_eps"]),
            qkv_bias=model_type == "qwen2" or attention_bias,  # Qwen2's q/k/v always have one, its o never
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type == "qwen3",
            mlp_bias=hf_value(raw, "mlp_bias", False),
            rope=rope,
            rope_layers=rope_layers,
            layer_windows=_layer_windows(raw, layers, rope_layers),
            fused_projections=model_type == "phi3",
        )


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.self_attn = Attention(
            config,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            fused=config.fused_projections,
            qk_norm=dict(eps=config.rms_norm_eps) if config.qk_norm else None,
            dtype=dtype,
            rngs=rngs,
        )
        self.mlp = GatedMLP(config, use_bias=config.mlp_bias, fused=config.fused_projections, dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def __call__(self, hidden: jax.Array, *inputs: jax.Array, **per_layer: jax.Array) -> jax.Array:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), *inputs, **per_layer)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(Decoder):
    layer_class = LlamaDecoderLayer

    def layer_inputs(self, positions: jax.Array, dtype: jnp.dtype) -> LayerInputs:
        # Llama casts the float32 cos/sin tables to the activations' dtype before rotating.
        tables = rope_cos_sin(positions, self.config.rope, self.config.head_dim, dtype)
        return tables, {"use_rope": jnp.asarray(self.config.rope_layers)}


class LlamaForCausalLM(CausalLM):
    config_class = LlamaConfig
    model_class = LlamaModel
