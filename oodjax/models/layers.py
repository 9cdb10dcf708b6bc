"""Building blocks shared by every model family: projections, norms, attention, the layer stack (RoPE: ``rope``).

Each block reproduces what transformers' PyTorch code computes, including
where it upcasts to float32, so that the ports match its logits exactly.
Parameters carry logical axis names (``partitioning.LOGICAL_AXIS_RULES``);
``eager_sharding=False`` keeps models constructible without a mesh, since
the loader places parameters itself. A family's decoder layers are one
module stacked on a leading ``layers`` axis and run by one ``jax.lax.scan``,
so the step compiles one layer whatever the depth.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from oodjax.models.flash_attention import ATTENTION_OUTPUT, attention, soft_cap
from oodjax.models.partitioning import HIDDEN, MLP_HIDDEN, constrain
from oodjax.models.rope import apply_rope

Axes = tuple[str | None, ...]
# What a ``Decoder``'s layers get besides the hidden states: the RoPE tables, and ``run_layers``' ``per_layer``.
LayerInputs = tuple[tuple[Any, ...], dict[str, jax.Array]]
# A decoder's output: the final hidden states, or with ``all_layers`` every layer's input and them.
HiddenStates = jax.Array | tuple[jax.Array, ...]

# Hugging Face initialises weights with normal(0, initializer_range=0.02).
_INIT_STD = 0.02

# Names of the projection outputs the remat policies may keep (``Linear(saved_as=...)``); the attention's
# output is ``ATTENTION_OUTPUT`` (with a fused kernel, its residuals too: ``flash_attention._keeping_residuals``).
ATTENTION_PROJECTION = "attention_projection"
MLP_PROJECTION = "mlp_projection"


# What a decoder layer keeps for the backward pass (launch.costs.RECOMPUTED says what each recomputes).
# "save_dots" keeps the attention's output with a fused kernel's softmax statistics, so the backward pass
# does not run the fused forward again.
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.save_only_these_names(ATTENTION_PROJECTION, MLP_PROJECTION, ATTENTION_OUTPUT),
    "save_dots_except_mlp": jax.checkpoint_policies.save_only_these_names(ATTENTION_PROJECTION, ATTENTION_OUTPUT),
}


def recomputed_in_backward(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``fn`` whose backward pass keeps only its arguments and recomputes the rest from them.

    For a norm's or an adapter's float32 working of a bf16 input: autodiff
    would keep those intermediates, twice the input's bytes, where
    recomputing is one elementwise pass. ``fn``'s arguments must hold every
    array it reads (a ``custom_vjp`` may not close over traced values); a
    ``custom_vjp``, not a nested ``jax.checkpoint``, so a model without a
    remat policy has no remat in it.
    """

    @jax.custom_vjp
    def call(*args: Any) -> jax.Array:
        return fn(*args)

    def forward(*args: Any) -> tuple[jax.Array, tuple[Any, ...]]:
        return fn(*args), args

    def backward(args: tuple[Any, ...], cotangent: jax.Array) -> tuple[Any, ...]:
        return jax.vjp(fn, *args)[1](cotangent)

    call.defvjp(forward, backward)
    return call


def check_remat(name: str) -> str:
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat policy {name!r} is not one of {sorted(REMAT_POLICIES)}")
    return name


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),  # Gemma's GeGLU
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The activation transformers' ACT2FN maps ``name`` to (only those our checkpoints use)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _param(value: jax.Array, axes: Axes) -> nnx.Param[jax.Array]:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Linear(nnx.Module):
    """``y = x @ kernel + bias`` with kernel stored [in, out] (the transpose of torch's weight).

    ``lora`` is a slot for an adapter module; its delta is cast to y's dtype,
    as PEFT does, so fp32 adapters on a bf16 base keep the base's dtype flow.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool,
        axes: tuple[str | None, str | None],
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        saved_as: str | None = None,
    ):
        kernel = _INIT_STD * jax.random.normal(rngs.params(), (in_features, out_features), jnp.float32)
        self.kernel = _param(kernel.astype(dtype), axes)
        self.bias = nnx.data(_param(jnp.zeros((out_features,), dtype), (axes[1],)) if use_bias else None)
        self.lora: Callable[[jax.Array], jax.Array] | None = nnx.data(None)
        self.saved_as = saved_as

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...]
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora is not None:
            y = y + self.lora(x).astype(y.dtype)
        return checkpoint_name(y, self.saved_as) if self.saved_as else y


class Embed(nnx.Module):
    """A lookup table [num_embeddings, features]; HF's ``nn.Embedding`` weight as is."""

    def __init__(self, num_embeddings: int, features: int, *, axes: Axes, dtype: jnp.dtype, rngs: nnx.Rngs):
        table = _INIT_STD * jax.random.normal(rngs.params(), (num_embeddings, features), jnp.float32)
        self.embedding = _param(table.astype(dtype), axes)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)


class LayerNorm(nnx.Module):
    """torch ``nn.LayerNorm``: statistics and affine in float32, result in the input dtype."""

    def __init__(self, features: int, *, eps: float, elementwise_affine: bool, dtype: jnp.dtype):
        self.eps = eps
        self.scale = nnx.data(_param(jnp.ones((features,), dtype), ("norm",)) if elementwise_affine else None)
        self.bias = nnx.data(_param(jnp.zeros((features,), dtype), ("norm",)) if elementwise_affine else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        affine = () if self.scale is None or self.bias is None else (self.scale[...], self.bias[...])
        return recomputed_in_backward(self._normalise)(x, *affine)

    def _normalise(self, x: jax.Array, *affine: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        if affine:
            scale, bias = affine
            h = h * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return h.astype(x.dtype)


class RMSNorm(nnx.Module):
    """HF's RMSNorm: normalise in float32, then apply the weight.

    Llama casts back to the input dtype *before* the weight; OLMo2 multiplies
    in float32 (``scale_in_float32``), as Gemma does with its weight stored
    as an offset from one (``unit_offset``).
    """

    def __init__(
        self, features: int, *, eps: float, dtype: jnp.dtype, scale_in_float32: bool = False, unit_offset: bool = False
    ):
        self.eps = eps
        self.scale_in_float32 = scale_in_float32
        self.unit_offset = unit_offset
        init = jnp.zeros if unit_offset else jnp.ones
        self.scale = _param(init((features,), dtype), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        return recomputed_in_backward(self._normalise)(x, self.scale[...])

    def _normalise(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        if self.scale_in_float32:
            return (scale * h).astype(x.dtype)
        return scale * h.astype(x.dtype)


class GatedMLP(nnx.Module):
    """Gated feed-forward ``down(act(gate(x)) * up(x))``; ``fused``: one ``gate_up_proj`` [gate | up], Phi-3's."""

    def __init__(self, config: Any, *, use_bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs, fused: bool = False):
        width, inner = config.hidden_size, config.intermediate_size
        self.act_fn = activation(config.hidden_act)
        self.fused = fused
        linear = functools.partial(Linear, use_bias=use_bias, dtype=dtype, rngs=rngs, saved_as=MLP_PROJECTION)
        if fused:
            self.gate_up_proj = linear(width, 2 * inner, axes=("embed", "mlp"))
        else:
            self.gate_proj = linear(width, inner, axes=("embed", "mlp"))
            self.up_proj = linear(width, inner, axes=("embed", "mlp"))
        self.down_proj = linear(inner, width, axes=("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fused:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return constrain(self.down_proj(constrain(self.act_fn(gate) * up, MLP_HIDDEN)), HIDDEN)


# --------------------------------------------------------------------------- attention


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position within its prompt [B, S], so a packed or left-padded prompt gets the positions
    it would have alone."""
    index = jnp.arange(segment_ids.shape[1])[None, :]
    previous = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
    starts = (segment_ids != previous) & (segment_ids != 0)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


# A window no prompt reaches: a layer's traced window when it attends to every earlier token.
FULL_ATTENTION = np.iinfo(np.int32).max


def scanned_windows(layer_windows: Sequence[int | None]) -> dict[str, jax.Array]:
    """Each layer's sliding window (None: full attention) as ``run_layers``' ``per_layer`` ``window``, full
    layers at ``FULL_ATTENTION``; none when no layer slides, so a model without windows builds no window mask."""
    if all(window is None for window in layer_windows):
        return {}
    windows = [FULL_ATTENTION if window is None else window for window in layer_windows]
    return {"window": jnp.asarray(windows, jnp.int32)}


class Attention(nnx.Module):
    """Self-attention with RoPE as the Llama family, OLMo2 and Gemma compute it.

    The families differ in the projections' biases, Phi-3's ``fused`` one
    ``qkv_proj`` (split into q, k, v after the projection; on a
    tensor-sharded mesh that split moves activations), the RMSNorms of q and
    k (``qk_norm``: their options; per head, or OLMo2's over the whole
    projection), the scores' ``scale`` and Gemma 2's ``softcap``.
    """

    def __init__(
        self,
        config: Any,
        *,
        qkv_bias: bool,
        o_bias: bool,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        scale: float | None = None,
        softcap: float | None = None,
        fused: bool = False,
        qk_norm: dict[str, Any] | None = None,
        norm_per_head: bool = True,
    ):
        width, self.head_dim = config.hidden_size, config.head_dim
        self.q_width = config.num_attention_heads * config.head_dim
        self.kv_width = config.num_key_value_heads * config.head_dim
        self.scale = config.head_dim**-0.5 if scale is None else scale
        self.softcap, self.fused, self.norm_per_head = softcap, fused, norm_per_head
        self.implementation = config.attention
        linear = functools.partial(Linear, use_bias=qkv_bias, dtype=dtype, rngs=rngs, saved_as=ATTENTION_PROJECTION)
        if fused:
            self.qkv_proj = linear(width, self.q_width + 2 * self.kv_width, axes=("embed", "heads"))
        else:
            self.q_proj = linear(width, self.q_width, axes=("embed", "heads"))
            self.k_proj = linear(width, self.kv_width, axes=("embed", "kv_heads"))
            self.v_proj = linear(width, self.kv_width, axes=("embed", "kv_heads"))
        self.o_proj = linear(self.q_width, width, axes=("heads", "embed"), use_bias=o_bias)
        q_norm, k_norm = (config.head_dim,) * 2 if norm_per_head else (self.q_width, self.kv_width)
        self.q_norm = nnx.data(None if qk_norm is None else RMSNorm(q_norm, dtype=dtype, **qk_norm))
        self.k_norm = nnx.data(None if qk_norm is None else RMSNorm(k_norm, dtype=dtype, **qk_norm))

    def __call__(
        self,
        x: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        *,
        window: jax.Array | None = None,
        use_rope: jax.Array | None = None,
    ) -> jax.Array:
        """``use_rope``: a traced per-layer flag (the layers are scanned); SmolLM3's NoPE layers keep q and k."""
        batch, seq, _ = x.shape
        if self.fused:
            query, key, value = jnp.split(self.qkv_proj(x), [self.q_width, self.q_width + self.kv_width], axis=-1)
        else:
            query, key, value = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None and not self.norm_per_head:
            query, key = self.q_norm(query), self.k_norm(key)
        heads = (batch, seq, -1, self.head_dim)
        query, key, value = query.reshape(heads), key.reshape(heads), value.reshape(heads)
        if self.q_norm is not None and self.k_norm is not None and self.norm_per_head:
            query, key = self.q_norm(query), self.k_norm(key)
        rotated = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        if use_rope is not None:
            rotated = jnp.where(use_rope, rotated[0], query), jnp.where(use_rope, rotated[1], key)
        out = attention(
            *rotated,
            value,
            segment_ids,
            scale=self.scale,
            window=window,
            positions=positions,
            softcap=self.softcap,
            implementation=self.implementation,
        )
        return constrain(self.o_proj(out.reshape(batch, seq, -1)), HIDDEN)


# --------------------------------------------------------------------------- the decoder stack


# The attribute holding a decoder's stacked layers; Hugging Face names layer i ``...layers.{i}....``.
STACKED = "layers"


def per_layer_paths(path: tuple[Any, ...], num_layers: int) -> list[tuple[str, ...]]:
    """The Hugging Face module paths of a parameter path's per-layer slices, in layer order.

    ``("model", "layers", "mlp", "up_proj")`` -> ``[("model", "layers", "0", "mlp", "up_proj"), ...]``.
    """
    path = tuple(map(str, path))
    if STACKED not in path:
        return [path]
    at = path.index(STACKED) + 1
    return [(*path[:at], str(i), *path[at:]) for i in range(num_layers)]


def stacked_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """``num_layers`` layers as ONE module whose parameters have a leading, named ``layers`` axis."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(rngs)

    return create(rngs)


def run_layers(
    layers: nnx.Module,
    hidden: jax.Array,
    *args: Any,
    remat: str,
    per_layer: dict[str, jax.Array] | None = None,
    all_layers: bool = False,
) -> tuple[jax.Array, list[jax.Array]]:
    """Apply the stacked layers with one ``jax.lax.scan``: layer i is ``layer(hidden, *args, **per_layer[i])``
    (``per_layer``'s arrays sliced at i); returns the output and, with ``all_layers``, every layer's input.

    Each layer folds its index into the shared random streams' keys (LoRA
    dropout), so layers draw independent masks and the pass stays a function
    of the stream's key alone.
    """
    graphdef, params, *shared = nnx.split(layers, nnx.Param, ...)
    num_layers = jax.tree.leaves(params)[0].shape[0]

    def body(carry: jax.Array, xs: tuple[Any, jax.Array, dict[str, jax.Array]]) -> tuple[jax.Array, jax.Array | None]:
        layer_params, index, extra = xs
        layer = nnx.merge(graphdef, layer_params, *shared, copy=True)
        keys = nnx.state(layer, nnx.RngKey)
        nnx.update(layer, jax.tree.map(lambda key: jax.random.fold_in(key, index), keys))
        out = constrain(layer(carry, *args, **extra), HIDDEN)
        return out, (carry if all_layers else None)

    if remat != "none":  # a name its DecoderConfig checked
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    hidden, inputs = jax.lax.scan(body, constrain(hidden, HIDDEN), (params, jnp.arange(num_layers), per_layer or {}))
    return hidden, ([] if inputs is None else list(inputs))


class Decoder(nnx.Module):
    """HF's ``LlamaModel``, ``Olmo2Model`` and ``Gemma2Model``: ``embed_tokens``, the stacked ``layers``, ``norm``.

    A family names its ``layer_class``, its RMSNorms' ``norm_options`` and
    the RoPE ``tables`` its ``layer_inputs`` gives every layer, with what
    differs per layer; layer i is called as ``layer(hidden, segment_ids,
    positions, *tables, **per_layer[i])``, its sliding window in ``window``.
    """

    layer_class: Any
    norm_options: Mapping[str, bool] = MappingProxyType({})

    def __init__(self, config: Any, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, axes=("vocab", "embed"), dtype=dtype, rngs=rngs
        )
        layer_class = self.layer_class
        self.layers = stacked_layers(
            lambda rngs: layer_class(config, dtype=dtype, rngs=rngs), config.num_hidden_layers, rngs
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, **self.norm_options)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        return self.embed_tokens(input_ids)

    def layer_inputs(self, positions: jax.Array, dtype: jnp.dtype) -> LayerInputs:
        """The (cos, sin) tables of ``positions`` every layer gets, and ``run_layers``' ``per_layer``."""
        raise NotImplementedError

    def __call__(self, input_ids: jax.Array, segment_ids: jax.Array, *, all_layers: bool) -> HiddenStates:
        positions = segment_positions(segment_ids)
        hidden = self.embed(input_ids)
        tables, per_layer = self.layer_inputs(positions, hidden.dtype)
        hidden, layer_inputs = run_layers(
            self.layers,
            hidden,
            segment_ids,
            positions,
            *tables,
            remat=self.config.remat,
            per_layer=per_layer | scanned_windows(self.config.layer_windows),
            all_layers=all_layers,
        )
        hidden = self.norm(hidden)
        return (*layer_inputs, hidden) if all_layers else hidden


class DecoderStack(Protocol):
    """What ``CausalLM`` uses of its decoder: a ``Decoder``, or OPT's."""

    embed_tokens: Embed

    def __call__(self, input_ids: jax.Array, segment_ids: jax.Array, *, all_layers: bool) -> HiddenStates: ...


class CausalLM(nnx.Module):
    """What every family shares on top of its decoder: the entry points and the output head.

    A family names its ``config_class`` (reads config.json) and ``model_class``
    (HF's ``model``: the decoder, or OPT's holder of it); ``head_width`` is the
    config field giving ``lm_head``'s input width (untied configs only).
    """

    config_class: Any
    model_class: Callable[..., nnx.Module]
    head_width = "hidden_size"

    def __init__(self, config: Any, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = config
        self.model = self.model_class(config, dtype=dtype, rngs=rngs)
        width, vocab = getattr(config, self.head_width), config.vocab_size
        linear = functools.partial(Linear, use_bias=False, axes=("embed", "vocab"), dtype=dtype, rngs=rngs)
        head = None if config.tie_word_embeddings else linear(width, vocab)
        self.lm_head = nnx.data(head)  # None: the head reuses the input embedding

    def decoder(self) -> DecoderStack:
        assert isinstance(self.model, Decoder)  # every family's ``model`` but OPT's, whose ``decoder`` is its own
        return self.model

    def input_embeddings(self) -> Embed:
        return self.decoder().embed_tokens

    @overload
    def hidden_states(self, input_ids: jax.Array, segment_ids: jax.Array) -> jax.Array: ...
    @overload
    def hidden_states(self, input_ids: jax.Array, segment_ids: jax.Array, *, all_layers: bool) -> HiddenStates: ...
    def hidden_states(self, input_ids: jax.Array, segment_ids: jax.Array, *, all_layers: bool = False) -> HiddenStates:
        """Final hidden states [B, S, H']; with ``all_layers``, HF's ``output_hidden_states`` tuple instead."""
        if input_ids.ndim != 2 or segment_ids.shape != input_ids.shape:  # static shapes: checked once, when traced
            raise ValueError(
                f"input_ids and attention_mask must both be [batch, seq]; got {input_ids.shape} and {segment_ids.shape}"
            )
        return self.decoder()(input_ids, segment_ids, all_layers=all_layers)

    def head_kernel(self) -> jax.Array:
        """[H', vocab]: logits are ``head_logits(hidden_states, head_kernel())``; the embedding's transpose if tied."""
        if self.lm_head is None:  # tied
            return self.input_embeddings().embedding[...].T
        return self.lm_head.kernel[...]

    def head_logits(self, hidden: jax.Array, head: jax.Array) -> jax.Array:
        """Float32 logits of ``hidden`` under ``head`` (or some of its columns), soft-capped where the family
        caps its output: per logit, so the engine may compute only the answer columns."""
        logits = jnp.matmul(hidden, head, preferred_element_type=jnp.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else soft_cap(logits, cap)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Logits [batch, seq, vocab] in float32; ``attention_mask`` is a 0/1 mask or segment ids."""
        return self.head_logits(self.hidden_states(input_ids, attention_mask), self.head_kernel())
