"""The accelerators the launch tools cost a job on, and the share of a device's memory JAX may use.

One table for the estimate, the preflight and the benchmarks: peak FLOP/s, memory, interconnect and network
figures, each from its vendor's published data (sources beside the table).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Mapping

import jax

from oodjax.usage_errors import ConfigError

GB = 1e9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device, from the vendor's data sheet
    memory_gb: float
    platform: str  # JAX's name for its backend: what decides how the compiled step stores bf16
    # Bytes a second one device sends (and as many it receives) to the others of its node or slice, all its links
    # together: half the bidirectional figure published. A ring collective's traffic per device divided by this is
    # its time at best (launch.preflight's communication estimate).
    interconnect_bytes_per_s: float
    interconnect: str  # the links' name, for the reader
    # Devices of one node, and what one device sends a second over the network between nodes (its NIC's rate):
    # where a job spread over nodes communicates (launch.preflight). None for TPUs: ICI joins a slice's hosts.
    node_devices: int | None = None
    network_bytes_per_s: float | None = None
    network: str = ""

    @property
    def memory_bytes(self) -> float:
        """A TPU's HBM as published is binary (the TPU compiler refuses a v5e program over 15.75 GiB, a v6e
        one over 31.25 GiB: 16 and 32 GiB less its reserve); a GPU's is counted as before, in 10^9 bytes."""
        return self.memory_gb * (GIB if self.platform == "tpu" else GB)


# Interconnect figures, bidirectional per device as published, halved above:
#   A100 SXM: NVLink 3, 600 GB/s (12 links of 50 GB/s; e.g. AWS's p4d instance table, "NVLink gen 3 (600 GB/s)").
#   H100 SXM: NVLink 4, 900 GB/s (18 links of 50 GB/s; MLCommons' H100/H200 SXM system descriptions,
#     "18x 4th Gen NVLink, 900GB/s"; Scaleway's H100 SXM notes, "900 GB/s of bidirectional bandwidth").
#   TPU v5e: ICI 400 GB/s per chip, v5p: 1200 GB/s per chip, v6e: 800 GB/s per chip ("Bidirectional inter-chip
#     interconnect (ICI) bandwidth (per chip)", https://docs.cloud.google.com/tpu/docs/v5e, /v5p and /v6e, whose
#     tables give v6e's 918 TFLOP/s bf16 and 32 GB of HBM too); v5e's "All-reduce bandwidth per Pod" of
#     51.2 TB/s over its 256 chips is the same 200 GB/s one way.
#   TPU v4: no per-chip figure is published (https://docs.cloud.google.com/tpu/docs/v4); its "All-reduce bandwidth
#     per Pod", 1.1 PB/s over 4096 chips, is 268 GB/s a chip, taken as its one-way figure as v5e's is.
# On a TPU torus a collective over one mesh axis uses only that axis's links, so there the figure is an upper bound.
# Networks between GPU nodes, as NVIDIA's reference nodes have them, one NIC per GPU (a site's may be slower):
#   DGX A100: 8 GPUs, "8x Single-Port Mellanox ConnectX-6 VPI 200Gb/s HDR InfiniBand": 25 GB/s a GPU each way.
#   DGX H100: 8 GPUs, "8x single-port NVIDIA ConnectX-7 VPI, 400 Gb/s InfiniBand/Ethernet": 50 GB/s a GPU each way.
DEVICES: Mapping[str, Device] = {
    "a100": Device("A100 80GB", 312e12, 80, "gpu", 300e9, "NVLink 3", 8, 25e9, "InfiniBand HDR"),
    "h100": Device("H100 SXM", 989e12, 80, "gpu", 450e9, "NVLink 4", 8, 50e9, "InfiniBand NDR"),
    "v4": Device("TPU v4 chip", 275e12, 32, "tpu", 268e9, "ICI"),
    "v5e": Device("TPU v5e chip", 197e12, 16, "tpu", 200e9, "ICI"),
    "v5p": Device("TPU v5p chip", 459e12, 95, "tpu", 600e9, "ICI"),
    "v6e": Device("TPU v6e chip", 918e12, 32, "tpu", 400e9, "ICI"),
}

# The share of a GPU's memory JAX's allocator takes: JAX reads XLA_CLIENT_MEM_FRACTION (or its deprecated name
# XLA_PYTHON_CLIENT_MEM_FRACTION; both set is an error at start-up), 0.75 when neither is set.
# launch/slurm.sbatch exports MEMORY_FRACTION_DEFAULT unless one is set (tests/test_launch_scripts.py holds the
# two equal), and a job's memory must fit that share, not the whole device. TPUs take no fraction (the variables
# configure JAX's GPU client only).
MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
MEMORY_FRACTION_DEFAULT = 0.9


def memory_fraction(environ: Mapping[str, str] | None = None) -> tuple[float, str]:
    """(fraction of a GPU's memory JAX may use, where it comes from: ``VARIABLE=value``), read from the
    environment as JAX reads it, else the default launch/slurm.sbatch exports."""
    environ = os.environ if environ is None else environ
    given = {name: environ[name] for name in MEMORY_FRACTION_VARIABLES if environ.get(name)}
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)} are both set; JAX refuses to start: unset the deprecated "
            f"{MEMORY_FRACTION_VARIABLES[1]}"
        )
    if not given:
        default = f"{MEMORY_FRACTION_VARIABLES[0]}={MEMORY_FRACTION_DEFAULT}, launch/slurm.sbatch's default"
        return MEMORY_FRACTION_DEFAULT, default
    ((name, value),) = given.items()
    try:
        fraction = float(value)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:
        raise ConfigError(f"{name}={value}: must be a fraction in (0, 1]")
    return fraction, f"{name}={value}"


def usable_memory(device: Device, environ: Mapping[str, str] | None = None) -> tuple[float, str]:
    """(bytes of one ``device`` a job's arrays may take, why): a GPU's memory times ``memory_fraction``, a TPU's
    whole memory."""
    if device.platform != "gpu":
        return device.memory_bytes, "TPU: the whole memory"
    fraction, source = memory_fraction(environ)
    return device.memory_bytes * fraction, source


def fit_text(total_bytes: float, device: Device, usable: float, source: str) -> str:
    """Whether ``total_bytes`` per device fit ``usable`` bytes of ``device`` (``usable_memory``'s, said by
    ``source``), e.g. "fits in 72 GB of the H100 SXM's 80 GB (XLA_CLIENT_MEM_FRACTION=0.9, launch/slurm.sbatch's
    default)"."""
    verdict = "fits in" if total_bytes <= usable else "DOES NOT FIT in"
    if device.platform != "gpu":
        return f"{verdict} the {usable / GIB:.0f} GiB of a {device.name}"
    return f"{verdict} {_gb(usable)} GB of the {device.name}'s {_gb(device.memory_bytes)} GB ({source})"


def _gb(size: float) -> str:
    return f"{size / GB:.1f}".removesuffix(".0")


def host_devices(count: int) -> None:
    """Gives JAX's CPU backend ``count`` devices (the meshes of devices this machine lacks). Only before JAX
    starts; a program that has started it (the tests, with eight devices) keeps the devices it has."""
    with contextlib.suppress(RuntimeError):  # JAX's backends have started
        jax.config.update("jax_num_cpu_devices", count)
