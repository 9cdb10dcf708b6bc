"""The JAX stack this process runs on, against the pins of requirements*.txt.

GPU images carry their own JAX (0.11.2 with CUDA 13 where the pins say
0.10.2 with CUDA 12), whose kernels and compiled programs differ from the
pinned stack's. So every job says
in one warning where its versions differ from the pins, and results.json
and the benchmarks record them with the differences. The pins are read
from the checkout's requirements.txt and requirements-gpu.txt; an installed
package has only its own requirements (the runtime pins, no CUDA ones).
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

from absl import logging

ROOT = pathlib.Path(__file__).resolve().parents[1]
REQUIREMENTS = ("requirements.txt", "requirements-gpu.txt")
# Each compared name and the distribution that pins it.
PINNED = {
    "jax": "jax",
    "jaxlib": "jaxlib",
    "flax": "flax",
    "cuda": "nvidia-cuda-runtime-cu12",
    "cudnn": "nvidia-cudnn-cu12",
}
# How many leading components of a pin the running library reports: CUDA's runtime says major.minor, cuDNN
# major.minor.patch; the pins carry the wheel's build number too.
_COMPARED_PARTS = {"cuda": 2, "cudnn": 3}
_PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;#]+)")


def pins(lines: list[str] | None = None) -> dict[str, str]:
    """PINNED's names and their pinned versions, from ``lines`` of requirements (default: the checkout's
    files, else this installed package's own requirements)."""
    if lines is None:
        files = [ROOT / name for name in REQUIREMENTS if (ROOT / name).is_file()]
        if files:
            lines = [line for file in files for line in file.read_text().splitlines()]
        else:
            lines = importlib.metadata.requires("oodjax") or []
    pinned = {}
    for line in lines:
        if match := _PIN.match(line.strip()):
            pinned[match.group(1).lower()] = match.group(2)
    return {name: pinned[distribution] for name, distribution in PINNED.items() if distribution in pinned}


def running() -> dict[str, str | None]:
    """PINNED's names and the versions this process runs: JAX, jaxlib and flax as installed; the CUDA runtime
    and cuDNN that JAX loaded (None without a CUDA jaxlib)."""
    import flax
    import jax
    import jaxlib
    from jax._src.lib import cuda_versions  # private, and the only place JAX says which libraries it loaded

    found: dict[str, str | None] = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__}
    found["cuda"] = found["cudnn"] = None
    if cuda_versions is not None:
        try:
            cuda, cudnn = cuda_versions.cuda_runtime_get_version(), cuda_versions.cudnn_get_version()
        except RuntimeError:  # a CUDA jaxlib on a machine without a GPU driver
            return found
        found["cuda"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        found["cudnn"] = f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}"
    return found


def differences(found: dict[str, str | None], pinned: dict[str, str]) -> list[str]:
    """``name version (pinned version)`` for each library found whose version is not its pin's."""
    differ = []
    for name, version in found.items():
        pin = pinned.get(name)
        if version is None or pin is None:
            continue
        parts = _COMPARED_PARTS.get(name)
        if version.split(".")[:parts] != pin.split(".")[:parts]:
            differ.append(f"{name} {version} (pinned {pin})")
    return differ


def against_pins() -> dict[str, object]:
    """What results.json records beside its versions: the CUDA runtime and cuDNN JAX loaded, the pins and
    where the running stack differs from them."""
    found, pinned = running(), pins()
    return {"cuda": found["cuda"], "cudnn": found["cudnn"], "pins": pinned, "differs": differences(found, pinned)}


def warn_if_unpinned() -> list[str]:
    """Logs one warning when the running stack differs from the pins; returns the differences."""
    differ = differences(running(), pins())
    if differ:
        logging.warning(
            "versions differ from the pins (requirements*.txt): %s; results.json records them", ", ".join(differ)
        )
    return differ
