"""Test-wide set-up: offline hubs, eight host CPU devices, exact matmuls.

The environment must be set before JAX is first imported, which is why this
happens at module import time rather than in a fixture.
"""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OODJAX_DATA_DIR", str(SHARED_DATA / "hf"))
# A persistent compilation cache: tests (and the subprocesses they start) compile
# many identical tiny programs, and CPU compilation dominates the suite's time.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

if not (SHARED_DATA / "hf").is_dir():
    raise RuntimeError(f"tests need the shared data at {SHARED_DATA} (see README)")


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    return SHARED_DATA


@pytest.fixture(scope="session")
def hf_data_dir() -> pathlib.Path:
    return SHARED_DATA / "hf"


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir() -> pathlib.Path:
    return SHARED_DATA / "tokenizers" / "gpt2"
