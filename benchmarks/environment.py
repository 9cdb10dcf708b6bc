"""Process settings that must be fixed before JAX or PyTorch is imported.

One JAX CPU device: a forced device count (the test suite's
--xla_force_host_platform_device_count) would split the same two cores
into several devices. Hubs are offline, and tokenisation is cached in the
run's own directory so that no earlier run's cache flatters a contender.
"""

from __future__ import annotations

import os
import pathlib
import sys

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def without_device_count(xla_flags: str) -> str:
    """XLA_FLAGS minus any forced host device count."""
    return " ".join(flag for flag in xla_flags.split() if not flag.startswith(_DEVICE_COUNT_FLAG))


def configure(cache_dir: pathlib.Path, *, accelerator: bool = False) -> None:
    """Set this process's (and its children's) environment; call before importing jax or torch. With
    ``accelerator``, JAX takes its default backend and allocates GPU memory as it needs it (PyTorch shares
    the device), instead of the CPU."""
    if "jax" in sys.modules:
        raise RuntimeError("benchmarks.environment.configure must run before jax is imported")
    os.environ["XLA_FLAGS"] = without_device_count(os.environ.get("XLA_FLAGS", ""))
    if accelerator:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["OODJAX_CACHE_DIR"] = str(cache_dir)
