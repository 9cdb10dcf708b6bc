"""Case 5, the machine's own peak: a square float32 matmul in JAX and in PyTorch, the best of both.

The peak is the best single repetition of the faster library, so the
fractions of it the other cases report are, if anything, understated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks import harness
from benchmarks.settings import Mode


def run(mode: Mode) -> dict[str, Any]:
    n = mode.matmul_size
    a, b = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    matmul = jax.jit(jnp.matmul)
    contenders = {
        "jax": lambda: matmul(ja, jb).block_until_ready(),
        "pytorch": lambda: torch.mm(ta, tb),
    }
    flops = 2.0 * n**3
    timings = harness.compare(contenders, repeats=max(mode.repeats, 10), warmup=2)
    best = max(timings, key=lambda name: flops / timings[name].min_s)
    peak = flops / timings[best].min_s
    return {
        "case": "peak",
        "title": f"Matmul peak ({n}x{n} float32)",
        "unit": "GFLOP/s",
        "description": f"C = A @ B with A, B {n}x{n} float32; FLOP/s = 2 n^3 / time.",
        "contenders": {
            name: {**t.summary(flops / 1e9), "best_gflops": flops / t.min_s / 1e9} for name, t in timings.items()
        },
        "peak_gflops": peak / 1e9,
        "peak_source": best,
    }
