"""Rotary position embeddings, as transformers computes them for every rope type our families use.

The frequency tables mirror ``modeling_rope_utils`` step by step in float32,
so cos and sin agree with PyTorch's to the last bit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# The RoPE parameters read as the config gives them (None where it has none).
_AS_GIVEN = "low_freq_factor high_freq_factor beta_fast beta_slow attention_factor mscale mscale_all_dim".split()


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters as transformers standardises them (``config.rope_parameters``)."""

    rope_type: str = "default"
    theta: float = 10_000.0
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None  # longrope's per-frequency divisors, within the original context
    long_factor: tuple[float, ...] | None = None  # ... and beyond it

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], *, default_theta: float) -> RopeConfig:
        """Read both the transformers-5 ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``."""
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"config.json: rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
        if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
        required = {
            "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
            "longrope": ("short_factor", "long_factor"),
        }
        for key in required.get(rope_type, ()):
            if params.get(key) is None:
                raise ValueError(f"config.json: rope_type {rope_type!r} needs {key!r} in its rope parameters")
        original = None
        factor = params.get("factor")
        if rope_type in ("llama3", "yarn", "longrope"):
            # As transformers: a top-level original_max_position_embeddings wins, then the
            # rope parameters', then max_position_embeddings.
            original = raw.get("original_max_position_embeddings") or params.get(
                "original_max_position_embeddings", raw.get("max_position_embeddings")
            )
            if original is None:
                raise ValueError(f"config.json: rope_type {rope_type!r} needs original_max_position_embeddings")
            if rope_type in ("yarn", "longrope") and factor is None:
                factor = raw["max_position_embeddings"] / original
        return cls(
            rope_type=rope_type,
            theta=float(params.get("rope_theta", raw.get("rope_theta", default_theta))),
            factor=factor,
            original_max_position_embeddings=original,
            truncate=params.get("truncate", True),
            short_factor=_factors(params.get("short_factor")),
            long_factor=_factors(params.get("long_factor")),
            **{key: params.get(key) for key in _AS_GIVEN},
        )


def _factors(values: Any) -> tuple[float, ...] | None:
    """A config's list of factors as a tuple (the config is hashed as a jit static), or None."""
    return None if values is None else tuple(float(v) for v in values)


def rope_frequencies(rope: RopeConfig, head_dim: int, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale, mirroring ``modeling_rope_utils`` step by step
    in float32, so the tables agree with PyTorch's to the last bit; ``seq_len`` matters to longrope alone."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    # The float32 power rounded once from float64, as torch's is: numpy's SIMD float32
    # power is off by an ulp on some CPUs (AVX-512), which angles of 1e4 rad magnify.
    pos_freqs = (np.float64(np.float32(rope.theta)) ** exponents.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / pos_freqs
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / np.float32(rope.factor), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq), 1.0
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(rope, pos_freqs, seq_len)
    return _yarn_inv_freq(rope, head_dim, pos_freqs)


def _llama3_inv_freq(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context = rope.original_max_position_embeddings
    assert factor is not None and low is not None and high is not None and old_context is not None  # from_hf's
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
    factor, base, original = rope.factor, rope.theta, rope.original_max_position_embeddings
    assert factor is not None and original is not None  # from_hf sets both for yarn

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None and rope.mscale and rope.mscale_all_dim:
        attention_factor = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
    elif attention_factor is None:
        attention_factor = mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast or 32), correction_dim(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_extrapolation = np.float32(1.0) / pos_freqs
    inv_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32), attention_factor


def _longrope_inv_freq(rope: RopeConfig, pos_freqs: np.ndarray, seq_len: int | None) -> tuple[np.ndarray, float]:
    original, factor = rope.original_max_position_embeddings, rope.factor
    short, long = rope.short_factor, rope.long_factor
    assert original is not None and factor is not None and short is not None and long is not None  # from_hf's
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = long if seq_len and seq_len > original else short
    if len(factors) != len(pos_freqs):
        raise ValueError(f"config.json: longrope has {len(factors)} factors, not head_dim / 2 = {len(pos_freqs)}")
    return np.float32(1.0) / (np.asarray(factors, np.float32) * pos_freqs), attention_factor


def rope_cos_sin(
    positions: jax.Array, rope: RopeConfig, head_dim: int, dtype: jnp.dtype = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, S, head_dim] for integer ``positions`` [B, S], computed in float32 and cast to ``dtype``
    (Llama and Gemma rotate in the activations' dtype, OLMo2 in float32).

    Longrope picks its factors by the row length S, as transformers does, so
    a packed row longer than the original context gets the long factors for
    every prompt in it.
    """
    inv_freq, scale = rope_frequencies(rope, head_dim, seq_len=positions.shape[1])
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(angles) * scale).astype(dtype), (jnp.sin(angles) * scale).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [B, S, heads, head_dim], computed in cos's dtype and cast back to x's."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x * cos + rotated * sin).astype(x.dtype)
