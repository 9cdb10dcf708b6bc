"""Case 5, the machine's own peak: a square float32 matmul in JAX and in PyTorch, the best of both.

The peak is the best single repetition of the faster library, so the
fractions of it the other cases report are, if anything, understated. Each
library multiplies in a process of its own, taking turns
(``benchmarks.harness.compare``).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.settings import Mode

CONTENDERS = ("jax", "pytorch")
REPEATS = 30  # each a few tens of milliseconds: enough for the best of them to be the machine's


def contender(name: str, *, size: int) -> tuple[Callable[[], None], dict[str, Any]]:
    """One library's ``size`` x ``size`` float32 matmul, built in the contender's own process."""
    a, b = np.random.default_rng(0).standard_normal((2, size, size), dtype=np.float32)
    if name == "jax":
        import jax
        import jax.numpy as jnp

        ja, jb = jnp.asarray(a), jnp.asarray(b)
        matmul = jax.jit(jnp.matmul)

        def call() -> None:
            matmul(ja, jb).block_until_ready()

    elif name == "pytorch":
        import torch

        ta, tb = torch.from_numpy(a), torch.from_numpy(b)

        def call() -> None:
            torch.mm(ta, tb)

    else:
        raise ValueError(f"no matmul contender {name!r}; the contenders are {CONTENDERS}")
    return call, {}


def run(mode: Mode, workdir: pathlib.Path) -> dict[str, Any]:
    n = mode.matmul_size
    flops = 2.0 * n**3
    timings = harness.compare("case_matmul", CONTENDERS, {"size": n}, repeats=REPEATS, warmup=2, logs=workdir).timings
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
