"""The JAX stack this process runs on, against the pins of requirements*.txt.

GPU images carry their own JAX, whose kernels and compiled programs differ
from the pinned stack's, so every job warns where its versions differ from
the pins, and results.json and the benchmarks record them. An installed
package has only its own requirements (the runtime pins, no CUDA ones).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
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
# How many leading components of a version are compared (the pins carry the wheel's build too).
_COMPARED_PARTS = {"cuda": 2, "cudnn": 3}
_PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;#]+)")


def pins(lines: list[str] | None = None) -> dict[str, str]:
    """PINNED's names and their pins, from ``lines`` (default: the checkout's files, else the package's)."""
    if lines is None:
        files = [ROOT / name for name in REQUIREMENTS if (ROOT / name).is_file()]
        if files:
            lines = [line for file in files for line in file.read_text().splitlines()]
        else:
            lines = importlib.metadata.requires("oodjax") or []
    pinned = {match[1].lower(): match[2] for line in lines if (match := _PIN.match(line.strip()))}
    return {name: pinned[distribution] for name, distribution in PINNED.items() if distribution in pinned}


def running() -> dict[str, str | None]:
    """PINNED's names and the versions this process runs; CUDA's are the pip wheels of JAX's CUDA plugin (None:
    no CUDA plugin, or CUDA from the system)."""
    import flax
    import jax
    from jaxlib.version import __version__ as jaxlib_version

    found: dict[str, str | None] = {"jax": jax.__version__, "jaxlib": jaxlib_version, "flax": flax.__version__}
    found["cuda"] = found["cudnn"] = None
    for major in ("13", "12"):
        if importlib.util.find_spec(f"jax_cuda{major}_plugin") is None:
            continue
        for name, distribution in (("cuda", f"nvidia-cuda-runtime-cu{major}"), ("cudnn", f"nvidia-cudnn-cu{major}")):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                found[name] = importlib.metadata.version(distribution)
        break
    return found


def differences(found: dict[str, str | None], pinned: dict[str, str]) -> list[str]:
    differ = []
    for name, version in found.items():
        pin, parts = pinned.get(name), _COMPARED_PARTS.get(name)
        if version is not None and pin is not None and version.split(".")[:parts] != pin.split(".")[:parts]:
            differ.append(f"{name} {version} (pinned {pin})")
    return differ


def against_pins() -> dict[str, object]:
    """What results.json records beside its versions."""
    found, pinned = running(), pins()
    return {"cuda": found["cuda"], "cudnn": found["cudnn"], "pins": pinned, "differs": differences(found, pinned)}


def warn_if_unpinned() -> list[str]:
    differ = differences(running(), pins())
    if differ:
        logging.warning(
            "versions differ from the pins (requirements*.txt): %s; results.json records them", ", ".join(differ)
        )
    return differ
