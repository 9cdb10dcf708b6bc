"""Fused (flash) attention with segment ids, and the one place that chooses the attention implementation.

``model.attention`` names it:

- ``xla``: ``jax.nn.dot_product_attention`` with an explicit mask: runs
  everywhere and is the exact reference, but materialises the [B, N, T, T]
  scores in float32.
- ``cudnn``: cuDNN's fused attention on NVIDIA GPUs, the row's prompts as a
  [B, 1, T, T] mask; bf16/fp16 and some head sizes only (``cudnn_unsupported``).
- ``pallas_gpu``: the Pallas (Triton) kernel, which takes segment ids.
  Selectable by name only, with a warning: JAX skips its backward test on
  sm80+ GPUs and deprecates the Triton backend.
- ``splash``: TPU splash attention with segment ids.
- ``auto`` (the default): cuDNN on GPU where it applies, splash on TPU, else XLA.

A token attends to the earlier tokens of its own segment (its prompt).
Padding is segment 0 and attends to other padding: harmless, since no real
token reads it, and no query row is fully masked, so nothing is NaN.

Under a mesh each kernel runs per device through ``jax.shard_map``, split as
the query heads are, since the compiler cannot partition a Pallas call.
``_keeping_residuals`` names each kernel's residuals so the remat policies
can keep them rather than run the fused forward again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from jax import Array
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from oodjax.models.partitioning import KV_HEADS, QUERY_HEADS, TOKENS, constrain, logical_to_spec

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas_gpu", "splash")
KERNEL_OF_PLATFORM = {"gpu": "cudnn", "cuda": "cudnn", "tpu": "splash"}
KERNELS = ("cudnn", "pallas_gpu", "splash")

# The name of the attention output (and of a fused kernel's residuals) for the remat policies.
ATTENTION_OUTPUT = "attention_output"

# Each Pallas kernel tiles the sequence in the largest of these blocks that divides it padded to a multiple
# of the smallest; cuDNN takes any even length, so its "block" is 2.
_BLOCKS = {"pallas_gpu": (128, 64), "splash": (512, 256, 128), "cudnn": (2,)}

# What JAX makes of a boolean mask for cuDNN (get_large_negative_number: cuDNN mishandles the difference of
# two larger negative numbers).
_CUDNN_NEGATIVE = {jnp.dtype(jnp.bfloat16): -(2.0**41), jnp.dtype(jnp.float16): -(2.0**15)}

_target: str | None = None


@contextlib.contextmanager
def target_platform(platform: str) -> Iterator[None]:
    """Within it, ``auto`` and interpret mode follow ``platform``, not JAX's default backend, to lower for
    another platform; the choice is made at trace time, so a function traced for another must be traced anew."""
    global _target
    before, _target = _target, platform
    try:
        yield
    finally:
        _target = before


def current_platform() -> str:
    return _target or jax.default_backend()


def block_and_length(kernel: str, length: int) -> tuple[int, int]:
    """(block, padded length) of ``kernel`` on a sequence of ``length``: the length padded to a multiple of the
    kernel's smallest block, and the largest of its blocks dividing that."""
    blocks = _BLOCKS[kernel]
    padded = -(-length // blocks[-1]) * blocks[-1]
    return next(block for block in blocks if padded % block == 0), padded


def resolve(implementation: str, platform: str | None = None) -> str:
    """The implementation ``implementation`` means on ``platform`` (default: ``target_platform``'s, else JAX's
    default backend). ``cudnn`` may still fall back to XLA for shapes it does not take (``cudnn_unsupported``)."""
    if implementation == "pallas_gpu":
        logging.log_first_n(
            logging.WARNING,
            "attention: pallas_gpu (Triton) is selected; its backward pass is unverified on sm80+ GPUs (JAX 0.10.2 "
            "skips its test there: precision issues after CUDA 12.8.1) and JAX 0.11 deprecates it; auto uses cuDNN",
            1,
        )
    if implementation != "auto":
        return implementation
    platform = platform or current_platform()
    kernel = KERNEL_OF_PLATFORM.get(platform)
    if kernel is None:
        logging.log_first_n(
            logging.INFO, "attention: no fused kernel on %s; using XLA's (model.attention=auto)", 1, platform
        )
        return "xla"
    return kernel


def cudnn_unsupported(query: jax.Array, key: jax.Array) -> str | None:
    """Why cuDNN's fused attention does not take these shapes here (None when it does), by JAX's own checks."""
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN takes bf16/fp16, not {query.dtype}"
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (query, key)]
    bias = jax.ShapeDtypeStruct((query.shape[0], 1, query.shape[1], key.shape[1]), query.dtype)
    attend = functools.partial(_cudnn, block=2, scale=1.0, interpret=False)
    try:
        jax.eval_shape(lambda q, k, b: jax.vjp(lambda q: attend(q, k, k, b), q)[0], *shapes, bias)
    except (NotImplementedError, RuntimeError) as error:
        return str(error)
    return None


def flash_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array, *, scale: float, kernel: str
) -> jax.Array:
    """Causal attention within segments, fused; query [B,T,N,D], key/value [B,T,K,D] (N % K == 0).

    ``kernel`` is ``cudnn``, ``pallas_gpu`` or ``splash`` (``resolve``'s answer).
    Sequences are padded to the kernel's block (``block_and_length``) with segment 0 (padding).
    """
    if kernel not in KERNELS:
        raise ValueError(f"no fused kernel {kernel!r}; one of {KERNELS}")
    if kernel == "pallas_gpu":  # Pallas GPU's kernel wants as many K/V heads as query heads
        key, value = (_repeat_heads(x, query.shape[2]) for x in (key, value))
    length = query.shape[1]
    block, padded = block_and_length(kernel, length)
    pad = padded - length
    if pad:
        query, key, value = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (query, key, value))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    interpret = current_platform() == "cpu"
    run = functools.partial(_KERNELS[kernel], block=block, scale=scale, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    sharded = not mesh.empty and set(mesh.axis_names) >= {"data", "fsdp", "tensor"}
    if sharded:
        heads = logical_to_spec(QUERY_HEADS, query.shape, mesh)
        kv_heads = logical_to_spec(KV_HEADS, key.shape, mesh)
        if kv_heads != heads:  # the tensor axis splits the query heads but not the K/V heads: repeat them
            key, value = (_repeat_heads(x, query.shape[2]) for x in (key, value))
            kv_heads = heads
    masking = _mask_input(kernel, segment_ids.astype(jnp.int32), query.dtype)
    heads_first = kernel == "splash"  # splash takes [B, heads, T, D], the query scaled
    if heads_first:
        query, key, value = (jnp.swapaxes(x, 1, 2) for x in (query * scale, key, value))
    if sharded:
        if heads_first:
            heads, kv_heads = (jax.sharding.PartitionSpec(s[0], s[2], s[1], s[3]) for s in (heads, kv_heads))
        rows = logical_to_spec(TOKENS[:1] + (None,) * (masking.ndim - 1), masking.shape, mesh)
        run = jax.shard_map(run, in_specs=(heads, kv_heads, kv_heads, rows), out_specs=heads, check_vma=False)
    # The layout and scaling happen outside the kernel's VJP, so that its residuals are its arguments
    # (recomputed from the kept projections) besides what it computes (kept, named).
    out = _keeping_residuals(run)(query, key, value, masking)
    if heads_first:
        out = jnp.swapaxes(out, 1, 2)
    return out[:, :length]


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    window: int | jax.Array | None = None,
    positions: jax.Array | None = None,
    softcap: float | None = None,
    implementation: str = "xla",
) -> jax.Array:
    """Causal attention within each prompt; query [B,T,N,D], key/value [B,T,K,D] with N % K == 0 (GQA).

    ``segment_ids`` [B, T] number the prompts of a row (0: padding), each
    seeing only its own earlier tokens, so packing changes no prompt's
    result; why padding is harmless is said where it is made,
    ``oodjax.data.batches``. A sliding ``window`` is measured in
    ``positions`` within the prompt, as transformers' mask is. No fused
    kernel soft-caps its scores (transformers refuses sdpa for Gemma 2 for
    that reason), so windows and caps take the explicit path.
    """
    query, key, value = constrain(query, QUERY_HEADS), constrain(key, KV_HEADS), constrain(value, KV_HEADS)
    segment_ids = segment_ids.astype(jnp.int32)
    kernel = resolve(implementation)
    if kernel == "cudnn" and (unsupported := cudnn_unsupported(query, key)):
        if implementation == "cudnn":
            raise ValueError(f"model.attention=cudnn: {unsupported}")
        logging.log_first_n(logging.INFO, "attention: cuDNN does not apply (%s); using XLA's", 1, unsupported)
        kernel = "xla"
    if kernel != "xla":
        if window is None and softcap is None:
            # Named inside (with the kernel's residuals), where the backward pass reads it.
            out = flash_attention(query, key, value, segment_ids, scale=scale, kernel=kernel)
            return constrain(out, QUERY_HEADS)
        logging.log_first_n(logging.INFO, "attention: sliding windows and soft caps take XLA's path, not %s", 1, kernel)
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
    if window is not None:
        if positions is None:
            raise ValueError("a sliding window needs the tokens' positions in their prompts")
        allowed &= positions[:, :, None] - positions[:, None, :] < window
    if softcap is not None:
        out = _softcapped_attention(query, key, value, allowed, scale=scale, softcap=softcap)
    else:
        out = jax.nn.dot_product_attention(query, key, value, mask=allowed[:, None], scale=scale, is_causal=True)
    return constrain(checkpoint_name(out, ATTENTION_OUTPUT), QUERY_HEADS)


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """``cap * tanh(x / cap)``, in transformers' order of operations: x unchanged near 0, bounded by +-cap."""
    return jnp.tanh(x / cap) * cap


def _softcapped_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, allowed: jax.Array, *, scale: float, softcap: float
) -> jax.Array:
    """``jax.nn.dot_product_attention``'s XLA path with the scores soft-capped between scaling and masking."""
    batch, length, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    grouped = query.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, key, preferred_element_type=jnp.float32) * scale
    scores = soft_cap(scores, softcap)
    causal = jnp.tril(jnp.ones((length, length), bool))
    # A fully masked row (a padded query) gets uniform weights, as dot_product_attention gives it.
    scores = jnp.where((allowed & causal)[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, value)
    return out.reshape(batch, length, heads, head_dim)


def _mask_input(kernel: str, segment_ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The segment ids [B, T] (Pallas), or cuDNN's additive bias [B, 1, T, T], made here so the backward pass
    recomputes it as an argument rather than keeping it."""
    if kernel != "cudnn":
        return segment_ids
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    exact = dtype not in (jnp.bfloat16, jnp.float16)  # float32: only where XLA stands in for cuDNN (tests)
    negative = jnp.finfo(dtype).min if exact else _CUDNN_NEGATIVE[jnp.dtype(dtype)]
    return jnp.where(same, jnp.zeros((), dtype), negative)


def _repeat_heads(x: jax.Array, heads: int) -> jax.Array:
    groups = heads // x.shape[2]
    return jnp.repeat(x, groups, axis=2) if groups > 1 else x


# A kernel's backward pass: the cotangents of its (query, key, value) from the output's.
_Vjp = Callable[[jax.Array], tuple[jax.Array, ...]]


def _keeping_residuals(run: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``run`` with the residuals its forward pass computes named ``ATTENTION_OUTPUT``.

    A fused kernel's residuals are unnamed values inside its ``custom_vjp``, so a remat policy could not keep
    them and the backward pass would run the fused forward again (naming the output alone does not help: the
    kernel's backward reads its own copy).
    """

    @jax.custom_vjp
    def call(query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array) -> jax.Array:
        return run(query, key, value, segment_ids)

    def forward(query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, _Vjp]:
        out, vjp = jax.vjp(lambda q, k, v: run(q, k, v, segment_ids), query, key, value)
        leaves, tree = jax.tree.flatten(vjp)
        arguments = (query, key, value, segment_ids)
        named = []
        for leaf in leaves:
            if any(leaf is argument for argument in arguments):
                named.append(leaf)
            else:
                named.append(checkpoint_name(leaf, ATTENTION_OUTPUT))
                if leaf is out:
                    out = named[-1]
        if not any(leaf is out for leaf in named):
            out = checkpoint_name(out, ATTENTION_OUTPUT)
        return out, jax.tree.unflatten(tree, named)

    def backward(vjp: _Vjp, cotangent: jax.Array) -> tuple[jax.Array | None, ...]:
        return (*vjp(cotangent), None)

    call.defvjp(forward, backward)
    return call


def _cudnn(q: Array, k: Array, v: Array, bias: Array, *, block: int, scale: float, interpret: bool) -> Array:
    """cuDNN's fused attention: grouped-query heads as they are, the segments as a bias [B, 1, T, T]
    (``_mask_input``; padding attends to padding, so no row is fully masked)."""
    del block, interpret
    return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, is_causal=True, implementation="cudnn")


def _pallas_gpu(q: Array, k: Array, v: Array, segments: Array, *, block: int, scale: float, interpret: bool) -> Array:
    sizes = gpu_attention.BlockSizes(
        block_q=block, block_k=block, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
    )
    return gpu_attention.mha(q, k, v, segments, sm_scale=scale, causal=True, block_sizes=sizes, interpret=interpret)


def _splash(q: Array, k: Array, v: Array, segments: Array, *, block: int, scale: float, interpret: bool) -> Array:
    """Splash per row of [B, heads, T, D], the query already scaled; K/V may have fewer heads."""
    del scale
    heads, length = q.shape[1], q.shape[2]
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((length, length)) for _ in range(heads)])
    # Every block size, forward and backward, is the one block.
    sizes: dict[str, Any] = {
        f.name: block for f in dataclasses.fields(splash.BlockSizes) if f.name.startswith("block_")
    }
    blocks = splash.BlockSizes(**sizes)
    kernel = splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret)
    per_row = lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s))  # noqa: E731
    return jax.vmap(per_row)(q, k, v, segments)


_KERNELS = {"cudnn": _cudnn, "pallas_gpu": _pallas_gpu, "splash": _splash}
