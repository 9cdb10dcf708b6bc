"""`python -m benchmarks.attention_parity [--kernels cudnn,pallas_gpu]`: each fused attention path against XLA's.

At the study's head shapes, on packed bf16 rows: the kernel's output and
gradients against XLA's attention of the same inputs in float32. The tests
check these paths on a CPU; this is the check a GPU or TPU session runs.
Exit status 1 when an error relative to the reference's largest value
exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from oodjax.models import flash_attention
from oodjax.models.flash_attention import attention

SHAPES = {"opt (32 x 80)": (32, 32, 80), "smollm3 (16 x 128, 4 kv)": (16, 4, 128)}


def packed_segments(rows: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of prompts of 20-80 tokens numbered from 1, then padding (0)."""
    segments = np.zeros((rows, length), np.int32)
    for row in segments:
        start, prompt = 0, 1
        while (size := int(rng.integers(20, 81))) <= length - start - 8:
            row[start : start + size], start, prompt = prompt, start + size, prompt + 1
    return segments


def errors(
    kernel: str, heads: int, kv_heads: int, head_dim: int, *, batch: int = 4, length: int = 384
) -> tuple[float, float]:
    """(output error, gradient error), each the largest absolute error over the largest reference value, on
    ``batch`` rows of ``length`` tokens."""
    rng = np.random.default_rng(0)
    shapes = [(batch, length, n, head_dim) for n in (heads, kv_heads, kv_heads)]
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for shape in shapes)
    segments = jnp.asarray(packed_segments(batch, length, rng))
    weights = jnp.cos(jnp.arange(head_dim, dtype=jnp.float32))
    scale = head_dim**-0.5

    def fused(q, k, v, s):
        return flash_attention.flash_attention(q, k, v, s, scale=scale, kernel=kernel).astype(jnp.float32)

    def reference(q, k, v, s):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        return attention(q, k, v, s, scale=scale, implementation="xla")

    def loss(fn, q, k, v, s):
        return jnp.sum(jnp.where((s != 0)[..., None, None], fn(q, k, v, s), 0.0) * weights)

    real = np.asarray(segments != 0)
    out, ref = np.asarray(jax.jit(fused)(q, k, v, segments)), np.asarray(jax.jit(reference)(q, k, v, segments))
    output_error = np.abs(out - ref)[real].max() / np.abs(ref[real]).max()
    grad = jax.jit(jax.grad(lambda q, k, v: loss(fused, q, k, v, segments), argnums=(0, 1, 2)))
    grad_ref = jax.jit(jax.grad(lambda q, k, v: loss(reference, q, k, v, segments), argnums=(0, 1, 2)))
    gradient_error = max(
        float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max() / np.abs(np.asarray(b)).max())
        for a, b in zip(grad(q, k, v), grad_ref(q, k, v))
    )
    return float(output_error), gradient_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_parity", description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default="cudnn,pallas_gpu", help="comma-separated: cudnn, pallas_gpu, splash")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest relative error allowed (bf16)")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    failed = False
    for kernel in args.kernels.split(","):
        for name, shape in SHAPES.items():
            try:
                out, grad = errors(kernel, *shape)
            except Exception as error:  # a kernel that cannot run here: said, and counted as a failure
                print(f"{kernel:10s} {name:26s} FAILED: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                failed = True
                continue
            bad = max(out, grad) > args.tolerance
            failed |= bad
            print(f"{kernel:10s} {name:26s} output {out:.2e} gradients {grad:.2e}{'  OVER TOLERANCE' if bad else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
