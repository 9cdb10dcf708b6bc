"""What the figures were measured on: processor, cores, memory, library versions, thread settings.

Thread settings are part of the comparison: PyTorch is pinned to one
intra-op thread per usable core, and XLA's CPU client uses one per core by
default; both are recorded with the results rather than assumed.
"""

from __future__ import annotations

import os
import pathlib
import platform
import re
from importlib import metadata
from typing import Any

LIBRARIES = ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "peft", "numpy")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), which is what both libraries should use."""
    return len(os.sched_getaffinity(0))


def cpu_model(cpuinfo: str | None = None) -> str:
    """The processor's name from /proc/cpuinfo ("model name"), or the platform's answer elsewhere."""
    if cpuinfo is None:
        path = pathlib.Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, flags=re.MULTILINE)
    return match.group(1).strip() if match else (platform.processor() or "unknown")


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The vector extensions that decide matmul speed (AVX2, AVX-512, AMX), as /proc/cpuinfo lists them."""
    if cpuinfo is None:
        path = pathlib.Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    match = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, flags=re.MULTILINE)
    flags = match.group(1).split() if match else []
    return sorted(f for f in set(flags) if f.startswith(("avx", "amx", "fma")))


def total_memory_gib(meminfo: str | None = None) -> float:
    if meminfo is None:
        meminfo = pathlib.Path("/proc/meminfo").read_text()
    match = re.search(r"^MemTotal:\s*(\d+)\s*kB", meminfo, flags=re.MULTILINE)
    if not match:
        raise ValueError("/proc/meminfo has no MemTotal line")
    return int(match.group(1)) / 2**20


def describe(torch_threads: int) -> dict[str, Any]:
    """The machine and the software settings the run used."""
    import jax

    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": round(total_memory_gib(), 1),
        "python": platform.python_version(),
        "libraries": {name: metadata.version(name) for name in LIBRARIES},
        "jax_devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_threads": "XLA CPU client default: one intra-op thread per core",
        "torch_threads": torch_threads,
        "load_average_1m_at_start": os.getloadavg()[0],
    }
