"""Fused (flash) attention with segment ids, and the one place that chooses the attention implementation.

``model.attention`` names it:

- ``xla``: ``jax.nn.dot_product_attention`` with an explicit mask
  (``layers.attention``). Runs everywhere and is the exact reference, but
  materialises the [B, N, T, T] scores in float32.
- ``cudnn``: cuDNN's fused flash attention (``jax.nn.dot_product_attention(...,
  implementation="cudnn")``) on NVIDIA GPUs: grouped-query heads natively
  (K/V not repeated), causal, and the prompts of a row as a [B, 1, T, T]
  boolean mask (cuDNN adds it as a bias). bf16/fp16 only, head sizes a
  multiple of 8 up to 256 on Hopper (128 before), as JAX 0.10.2 checks them
  (``cudnn_unsupported``); where it does not apply, ``auto`` takes XLA's path.
- ``pallas_gpu``: the Pallas (Triton) flash-attention kernel of
  ``jax.experimental.pallas.ops.gpu.attention``, which takes segment ids.
  Selectable by name only: JAX 0.10.2 skips its backward test on every sm80+
  GPU ("Precision issues after CUDA 12.8.1 upgrade") and JAX 0.11 deprecates
  the Triton backend, so its use is logged as a warning.
- ``splash``: TPU splash attention (``jax.experimental.pallas.ops.tpu``) with
  a causal mask and segment ids, grouped-query heads natively (splash's MHA
  kernel takes fewer K/V heads than query heads and groups the queries).
- ``auto`` (the default): cuDNN on GPU (where it applies), splash on TPU,
  XLA where there is none (CPU), said once in the log.

The kernels see a row as segments: a token attends to the earlier tokens
of its own segment (its prompt). Padding is segment 0 and attends to other
padding, which is harmless: no real token attends to it and its outputs are
never read (and no query row is fully masked, so nothing is NaN). On CPU a
Pallas kernel named explicitly runs in Pallas' interpret mode, which is how
the tests check its parity with XLA; it is slow, and meant for nothing else.
cuDNN cannot run on CPU: the tests lower it for CUDA instead.

Under a mesh each kernel runs per device through ``jax.shard_map``, split as
the logical-axis rules split the query heads (rows over data x fsdp, heads
over tensor; K/V heads likewise where the tensor axis divides them, else
repeated to the query heads), since the compiler cannot partition a Pallas
call itself.

Each kernel is a ``custom_vjp`` whose forward pass keeps residuals (its
output, its softmax statistics) that the remat policies cannot see by name;
``_keeping_residuals`` names them ``ATTENTION_OUTPUT``, so a policy that saves
that name (``save_dots``) saves them and the backward pass does not run the
fused forward again.

``target_platform`` makes the choice for a platform other than the one the
process runs on: lowering for ``cuda`` or ``tpu`` on a CPU host
(``tests/test_lowering_accelerators.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from absl import logging
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from oodjax.models.partitioning import KV_HEADS, QUERY_HEADS, TOKENS, logical_to_spec

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas_gpu", "splash")
KERNEL_OF_PLATFORM = {"gpu": "cudnn", "cuda": "cudnn", "tpu": "splash"}
KERNELS = ("cudnn", "pallas_gpu", "splash")

# The name of the attention output (and of a fused kernel's residuals) for the remat policies.
ATTENTION_OUTPUT = "attention_output"

# Each Pallas kernel tiles the sequence in blocks of one of these sizes, the largest that divides the sequence
# padded to a multiple of the smallest (a bucket of 160 tokens runs in blocks of 64 on GPU, one of 640 in
# blocks of 128 on TPU): a block must divide the sequence. cuDNN takes any even length (JAX's check for a
# bias in training), so its "block" is 2.
_BLOCKS = {"pallas_gpu": (128, 64), "splash": (512, 256, 128), "cudnn": (2,)}

# What JAX makes of a boolean mask for cuDNN (get_large_negative_number: cuDNN mishandles the difference of
# two larger negative numbers).
_CUDNN_NEGATIVE = {jnp.dtype(jnp.bfloat16): -(2.0**41), jnp.dtype(jnp.float16): -(2.0**15)}

_target: str | None = None


@contextlib.contextmanager
def target_platform(platform: str) -> Iterator[None]:
    """Within it, ``auto`` and the kernels' interpret mode follow ``platform`` (``cuda``/``gpu``, ``tpu``,
    ``cpu``), not JAX's default backend: for lowering with ``lowering_platforms=(platform,)`` elsewhere. The
    choice is made as a function is traced, so a jitted function traced for another platform must be traced
    anew (``jax.clear_caches()``)."""
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
    """Why cuDNN's fused attention does not take these shapes here (None when it does): JAX's own checks, run by
    tracing its forward pass for training with the segments' bias (cuDNN present, bf16/fp16, head size a
    multiple of 8 up to 256 on Hopper and later, 128 before; an even length)."""
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN takes bf16/fp16, not {query.dtype}"
    query, key = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (query, key))
    bias = jax.ShapeDtypeStruct((query.shape[0], 1, query.shape[1], key.shape[1]), query.dtype)
    attend = functools.partial(_cudnn, block=2, scale=1.0, interpret=False)
    try:
        jax.eval_shape(lambda q, k, b: jax.vjp(lambda q: attend(q, k, k, b), q)[0], query, key, bias)
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


def _mask_input(kernel: str, segment_ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """What ``kernel`` takes for the segments: the segment ids [B, T] (Pallas), or for cuDNN the additive bias
    [B, 1, T, T] (0 within a segment, cuDNN's large negative number across) that JAX would make of a boolean
    mask, made here so that it is an argument of the kernel, recomputed, not kept, by the backward pass."""
    if kernel != "cudnn":
        return segment_ids
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    exact = dtype not in (jnp.bfloat16, jnp.float16)  # float32: only where XLA stands in for cuDNN (tests)
    negative = jnp.finfo(dtype).min if exact else _CUDNN_NEGATIVE[jnp.dtype(dtype)]
    return jnp.where(same, jnp.zeros((), dtype), negative)


def _repeat_heads(x: jax.Array, heads: int) -> jax.Array:
    groups = heads // x.shape[2]
    return jnp.repeat(x, groups, axis=2) if groups > 1 else x


def _keeping_residuals(run):
    """``run(query, key, value, segment_ids)`` whose backward pass is its own, with the residuals its forward
    pass computes (besides its arguments) named ``ATTENTION_OUTPUT``, the output among them.

    A fused kernel is a ``custom_vjp``; its residuals (output, softmax statistics) are unnamed values inside
    it, so a remat policy saving names could not keep them, and the backward pass would run the fused forward
    again to get them (naming the output alone does not help: the kernel's backward reads its own copy). The
    arguments are left unnamed: the policy recomputes them from what it keeps (the projections).
    """

    @jax.custom_vjp
    def call(query, key, value, segment_ids):
        return run(query, key, value, segment_ids)

    def forward(query, key, value, segment_ids):
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

    def backward(vjp, cotangent):
        return (*vjp(cotangent), None)

    call.defvjp(forward, backward)
    return call


def _cudnn(query, key, value, bias, *, block: int, scale: float, interpret: bool) -> jax.Array:
    """cuDNN's fused attention: grouped-query heads as they are, the segments as a bias [B, 1, T, T]
    (``_mask_input``; padding attends to padding, so no row is fully masked)."""
    del block, interpret
    return jax.nn.dot_product_attention(
        query, key, value, bias=bias, scale=scale, is_causal=True, implementation="cudnn"
    )


def _pallas_gpu(query, key, value, segment_ids, *, block: int, scale: float, interpret: bool) -> jax.Array:
    sizes = gpu_attention.BlockSizes(
        block_q=block, block_k=block, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
    )
    return gpu_attention.mha(
        query, key, value, segment_ids, sm_scale=scale, causal=True, block_sizes=sizes, interpret=interpret
    )


def _splash(query, key, value, segment_ids, *, block: int, scale: float, interpret: bool) -> jax.Array:
    """Splash works on [heads, length, head_dim] per row, mapped over the rows of [B, heads, T, D], the query
    already scaled (``flash_attention``). Its MHA kernel takes K/V with fewer heads than the query's and
    groups the query heads over them."""
    del scale
    heads, length = query.shape[1], query.shape[2]
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((length, length)) for _ in range(heads)])
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    per_row = lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s))  # noqa: E731
    return jax.vmap(per_row)(query, key, value, segment_ids)


_KERNELS = {"cudnn": _cudnn, "pallas_gpu": _pallas_gpu, "splash": _splash}
