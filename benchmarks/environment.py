"""Process settings that must be fixed before JAX or PyTorch is imported.

One JAX CPU device (a forced device count would split the same cores), hubs
offline, and a tokenisation cache of the run's own, so no earlier run's
cache flatters a contender. On CPU every process gets the same thread
settings whatever the caller's shell holds, and the OpenMP runtimes' own
waiting policy, as PyTorch's users get it; the harness waits out the spin.
"""

from __future__ import annotations

import os
import pathlib
import sys

from benchmarks import machine

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# launch.estimate's (importing it would import JAX): the share of a GPU's memory the launchers give JAX, which
# the estimate fits layouts against (benchmarks.device_check), where the caller's environment sets none.
MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
MEMORY_FRACTION = "0.9"


def configure(cache_dir: pathlib.Path, *, accelerator: bool = False) -> None:
    """Set this process's (and its children's) environment, before jax or torch is imported; with
    ``accelerator``, JAX takes its default backend instead of the CPU."""
    if "jax" in sys.modules:
        raise RuntimeError("benchmarks.environment.configure must run before jax is imported")
    flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(flag for flag in flags if not flag.startswith(_DEVICE_COUNT_FLAG))
    if accelerator:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        if not any(os.environ.get(name) for name in MEMORY_FRACTION_VARIABLES):
            os.environ[MEMORY_FRACTION_VARIABLES[0]] = MEMORY_FRACTION
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
        threads = str(machine.usable_cores())
        os.environ.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        for name in machine.OPENMP_WAITING:
            os.environ.pop(name, None)
    os.environ.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OODJAX_CACHE_DIR=str(cache_dir)
    )
