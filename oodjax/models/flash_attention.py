"""Fused (flash) attention with segment ids, and the one place that chooses the attention implementation.

``model.attention`` names it:

- ``xla``: ``jax.nn.dot_product_attention`` with an explicit mask
  (``layers.attention``). Runs everywhere and is the exact reference, but
  materialises the [B, N, T, T] scores in float32.
- ``pallas_gpu``: the Pallas (Triton) flash-attention kernel of
  ``jax.experimental.pallas.ops.gpu.attention``, which takes segment ids, so
  one prompt per row and packed rows alike run fused on NVIDIA GPUs.
- ``splash``: TPU splash attention (``jax.experimental.pallas.ops.tpu``) with
  a causal mask and segment ids.
- ``auto`` (the default): the fused kernel of the platform the step runs on,
  XLA where there is none (CPU), said once in the log.

Both kernels see a row as segments: a token attends to the earlier tokens
of its own segment (its prompt). Padding is segment 0 and attends to other
padding, which is harmless: no real token attends to it and its outputs are
never read. On CPU a kernel named explicitly runs in Pallas' interpret mode,
which is how the tests check its parity with XLA; it is slow, and meant for
nothing else.

Under a mesh each kernel runs per device through ``jax.shard_map``, split as
the logical-axis rules split the query heads (rows over data x fsdp, heads
over tensor), since the compiler cannot partition a Pallas call itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from oodjax.models.partitioning import QUERY_HEADS, TOKENS, logical_to_spec

IMPLEMENTATIONS = ("auto", "xla", "pallas_gpu", "splash")
KERNEL_OF_PLATFORM = {"gpu": "pallas_gpu", "tpu": "splash"}

# Each kernel tiles the sequence in blocks of one of these sizes, the largest that divides the sequence
# padded to a multiple of the smallest (a bucket of 160 tokens runs in blocks of 64 on GPU, one of 640 in
# blocks of 128 on TPU): a block must divide the sequence.
_BLOCKS = {"pallas_gpu": (128, 64), "splash": (512, 256, 128)}


def block_and_length(kernel: str, length: int) -> tuple[int, int]:
    """(block, padded length) of ``kernel`` on a sequence of ``length``: the length padded to a multiple of the
    kernel's smallest block, and the largest of its blocks dividing that."""
    blocks = _BLOCKS[kernel]
    padded = -(-length // blocks[-1]) * blocks[-1]
    return next(block for block in blocks if padded % block == 0), padded


def check_implementation(implementation: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return implementation


def resolve(implementation: str, platform: str | None = None) -> str:
    """The implementation ``implementation`` means on ``platform`` (default: JAX's default backend)."""
    check_implementation(implementation)
    if implementation != "auto":
        return implementation
    platform = platform or jax.default_backend()
    kernel = KERNEL_OF_PLATFORM.get(platform)
    if kernel is None:
        logging.log_first_n(
            logging.INFO, "attention: no fused kernel on %s; using XLA's (model.attention=auto)", 1, platform
        )
        return "xla"
    return kernel


def flash_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array, *, scale: float, kernel: str
) -> jax.Array:
    """Causal attention within segments, fused; query [B,T,N,D], key/value [B,T,K,D] (N % K == 0).

    ``kernel`` is ``pallas_gpu`` or ``splash`` (``resolve``'s answer).
    Sequences are padded to the kernel's block (``block_and_length``) with segment 0 (padding).
    """
    if kernel not in KERNEL_OF_PLATFORM.values():
        raise ValueError(f"no fused kernel {kernel!r}; one of {sorted(KERNEL_OF_PLATFORM.values())}")
    groups = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(x, groups, axis=2) if groups > 1 else x for x in (key, value))
    length = query.shape[1]
    block, padded = block_and_length(kernel, length)
    pad = padded - length
    if pad:
        query, key, value = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (query, key, value))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    interpret = jax.default_backend() == "cpu"
    run = functools.partial(_KERNELS[kernel], block=block, scale=scale, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and set(mesh.axis_names) >= {"data", "fsdp", "tensor"}:
        heads = logical_to_spec(QUERY_HEADS, query.shape, mesh)
        segments = logical_to_spec(TOKENS, segment_ids.shape, mesh)
        run = jax.shard_map(run, in_specs=(heads, heads, heads, segments), out_specs=heads, check_vma=False)
    return run(query, key, value, segment_ids.astype(jnp.int32))[:, :length]


def _pallas_gpu(query, key, value, segment_ids, *, block: int, scale: float, interpret: bool) -> jax.Array:
    sizes = gpu_attention.BlockSizes(
        block_q=block, block_k=block, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
    )
    return gpu_attention.mha(
        query, key, value, segment_ids, sm_scale=scale, causal=True, block_sizes=sizes, interpret=interpret
    )


def _splash(query, key, value, segment_ids, *, block: int, scale: float, interpret: bool) -> jax.Array:
    """Splash works on [heads, length, head_dim] per row: transposed in, mapped over rows, transposed out."""
    length, heads = query.shape[1], query.shape[2]
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((length, length)) for _ in range(heads)])
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
        block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    per_row = lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s))  # noqa: E731
    to_heads = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    out = jax.vmap(per_row)(to_heads(query * scale), to_heads(key), to_heads(value), segment_ids)
    return to_heads(out)


_KERNELS = {"pallas_gpu": _pallas_gpu, "splash": _splash}
