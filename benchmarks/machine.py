"""What the figures were measured on: processor, cores, memory, library versions, thread settings.

Thread settings are part of the comparison: every process of a run gets
one OpenMP thread per usable core (``benchmarks.environment``; PyTorch's
intra-op pool), and XLA's CPU client uses one per core by default; both are
recorded with the results rather than assumed. The kernel's CPU counters
let the harness wait until a contender's process is idle and measure what
the rest of the machine used while one was timed.
"""

from __future__ import annotations

import os
import pathlib
import platform
import re
import resource
from importlib import metadata
from typing import Any

LIBRARIES = ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "peft", "numpy")


# The thread settings every process of a run gets (``benchmarks.environment``), recorded with the results.
OPENMP_WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # how idle OpenMP threads wait
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", *OPENMP_WAITING)
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")  # the unit of the kernel's CPU time counters (10 ms)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), which is what both libraries should use."""
    return len(os.sched_getaffinity(0))


def busy_cpu_seconds(stat: str | None = None) -> float:
    """CPU seconds all cores have spent not idle since boot, from /proc/stat's first line: every field but idle
    and iowait. Steal (time the hypervisor gave to other machines) counts: it is time lost to others as well."""
    if stat is None:
        stat = pathlib.Path("/proc/stat").read_text()
    fields = [int(v) for v in stat.splitlines()[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(fields) - fields[3] - fields[4]) * _TICK_S


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system, all threads) process ``pid`` has used so far, from /proc/PID/stat."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime and stime, fields 14 and 15 of proc(5)


def children_cpu_seconds() -> float:
    """CPU seconds used by this process's finished children (and theirs) that it has waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _proc_field(name: str, field: str) -> str:
    """The value on ``field``'s first line of /proc/``name`` (cpuinfo, meminfo), or "" where there is none."""
    path = pathlib.Path("/proc", name)
    match = re.search(rf"^{field}\s*:\s*(.+)$", path.read_text() if path.exists() else "", flags=re.MULTILINE)
    return match.group(1).strip() if match else ""


def describe(torch_threads: int) -> dict[str, Any]:
    """The machine and the software settings the run used."""
    import jax

    return {
        "cpu": _proc_field("cpuinfo", "model name") or platform.processor() or "unknown",
        # the vector extensions that decide matmul speed (AVX2, AVX-512, AMX)
        "cpu_flags": sorted(
            f for f in set(_proc_field("cpuinfo", "flags").split()) if f.startswith(("avx", "amx", "fma"))
        ),
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": round(int(_proc_field("meminfo", "MemTotal").removesuffix(" kB")) / 2**20, 1),
        "python": platform.python_version(),
        "libraries": {name: metadata.version(name) for name in LIBRARIES},
        "jax_devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_threads": "XLA CPU client default: one intra-op thread per core",
        "torch_threads": torch_threads,
        "thread_environment": {name: os.environ.get(name) for name in THREAD_VARIABLES},
        "load_average_1m_at_start": os.getloadavg()[0],
    }
