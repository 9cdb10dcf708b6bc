"""Cloud TPU slices by their `gcloud` accelerator type (`v5litepod-8`, `v5p-64`), as compile-only devices.

The preflight compiles for a slice on any machine with the TPU compiler: JAX's ``get_topology_desc`` builds
the slice's devices from libtpu without a TPU (as MaxText's train_compile.py and axlearn's
run_aot_compilation.py do). libtpu is the TPU VM's runtime (`make install-tpu`); elsewhere
`make install-tpu-compiler` unpacks the same pinned wheel into ``COMPILER_DIR``, outside the venv, so that
the CPU stack never finds it: JAX would probe for TPU chips and print libtpu's warnings at every start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import pathlib
import re
from collections.abc import Iterator

import jax

from oodjax.usage_errors import UsageError

COMPILER_DIR = pathlib.Path(__file__).resolve().parents[1] / ".tpu-compiler"
INSTALL = "make install-tpu-compiler (the pinned libtpu of requirements-tpu.txt, into .tpu-compiler/)"


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: ``device`` keys ``launch.devices.DEVICES``; ``topology`` is libtpu's name of its chip grid."""

    name: str
    device: str
    topology: str
    chips: int
    chip_config: str  # "megacore": a v4 or v5p chip's two TensorCores as one JAX device


# Per generation: gcloud's prefix, the DEVICES key, libtpu's name, TensorCores a chip (gcloud counts cores, so a
# v5p-8 is 4 chips), and the chip grids of the power-of-two slices (Cloud TPU's v4, v5e, v5p and v6e pages).
_GENERATIONS = {
    "v4": ("v4", "v4", 2),
    "v5p": ("v5p", "v5", 2),
    "v5litepod": ("v5e", "v5e", 1),
    "v6e": ("v6e", "v6e", 1),
}
_GRIDS_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16")
_GRIDS_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")


def slices() -> dict[str, Slice]:
    """Every slice the preflight knows, by gcloud name."""
    known = {}
    for prefix, (device, topology, cores) in _GENERATIONS.items():
        for grid in _GRIDS_3D if cores == 2 else _GRIDS_2D:
            chips = math.prod(int(size) for size in grid.split("x"))
            name = f"{prefix}-{chips * cores}"
            known[name] = Slice(name, device, f"{topology}:{grid}", chips, "megacore" if cores == 2 else "default")
    return known


# Why GPUs have no --topology: what JAX 0.10.2 lacks to compile the study's steps without a GPU.
GPU_REFUSAL = (
    "compiles for TPU slices only; JAX does not support compiling for a GPU without one (jax-ml/jax#23971, open): "
    "run the preflight on a GPU node, with --devices"
)


def find(name: str) -> Slice:
    """The slice called ``name``, or a usage error listing the names there are (a GPU's: why there is none)."""
    known = slices()
    if name.lower().startswith(("h100", "h200", "a100", "b200", "gpu")):
        raise UsageError(f"--topology {name!r}: {GPU_REFUSAL}")
    if name not in known:
        raise UsageError(f"--topology {name!r}: not a TPU slice this preflight knows; it knows {', '.join(known)}")
    return known[name]


def compiler_path() -> str:
    """libtpu's shared library: the installed package's (a TPU VM), else ``COMPILER_DIR``'s; a usage error saying
    what to install when there is neither."""
    if (spec := importlib.util.find_spec("libtpu")) is not None and spec.origin:
        return str(pathlib.Path(spec.origin).parent / "libtpu.so")
    unpacked = COMPILER_DIR / "libtpu" / "libtpu.so"
    if unpacked.is_file():
        return str(unpacked)
    raise UsageError(f"--topology needs the TPU compiler (libtpu), which is not installed: run {INSTALL}")


def compiler_version() -> str:
    """The version of the libtpu ``compiler_path`` loads, from its wheel's metadata beside it."""
    where = pathlib.Path(compiler_path()).parents[1]
    found = sorted(where.glob("libtpu-*.dist-info"))
    return re.sub(r"^libtpu-|\.dist-info$", "", found[0].name) if found else "of unknown version"


def devices(target: Slice) -> list[jax.Device]:
    """The slice's compile-only devices. libtpu probes for chips and host names as it loads; on a machine without
    a TPU those are skipped (``TPU_SKIP_MDS_QUERY``) and its start-up warnings silenced. It also locks
    /tmp/libtpu_lockfile, one process a TPU; compiling holds no chip, so any number may (``ALLOW_MULTIPLE_...``)."""
    from jax.experimental import topologies

    os.environ.setdefault("TPU_LIBRARY_PATH", compiler_path())
    with contextlib.suppress(RuntimeError):  # JAX's backends have started (the tests'): they stay as they are
        jax.config.update("jax_platforms", "cpu")  # this machine's backend: no TPU one tried beside the slice's
    # A program compiled for compile-only devices cannot be loaded back from JAX's persistent cache (no client to
    # load it into: a warning and a compile again), so none is written there from now on.
    jax.config.update("jax_enable_compilation_cache", False)
    loading = {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": target.name,
        "TPU_WORKER_HOSTNAMES": "localhost",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    # Only while libtpu loads: left set, a TPU pod's variables would make any process this one starts
    # (a job, a test's) take itself for a pod worker (oodjax.engine.distributed).
    with _quiet_stderr(), _environ(loading):
        return list(
            topologies.get_topology_desc(
                topology_name=target.topology,
                platform="tpu",
                chip_config_name=target.chip_config,
                chips_per_host_bounds=(2, 2, 1) if target.chips >= 4 else (1, 1, 1),
                num_slices=1,
            ).devices
        )


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in ``os.environ`` where unset, and those unset again on exit."""
    added = {name: value for name, value in values.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: libtpu's C++ logging writes there, not to Python's ``sys.stderr``."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
