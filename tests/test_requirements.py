"""The install sets agree: the GPU and TPU files pin the JAX of requirements.txt, the GPU set holds one CUDA major,
no runtime set holds PyTorch, and the Makefile's install targets install exactly these files.

Offline: what pip resolves these files to against the registry was checked with `pip install --dry-run`
(docs/install.md); here only the files themselves and `make -n` are read.
"""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNTIME_SETS = {stack: ("requirements.txt", f"requirements-{stack}.txt") for stack in ("gpu", "tpu")}
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)(?:\[(?P<extras>[^\]]*)\])?==(?P<version>\S+)$")


def pins(name: str) -> dict[str, tuple[str, str]]:
    """{package (normalised): (version, extras)} of a requirements file, following its `-r` includes."""
    found = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("--"):
            continue
        if line.startswith("-r "):
            found.update(pins(line[3:].strip()))
            continue
        match = _PIN.match(line)
        assert match, f"{name}: {line!r} is not pinned with =="
        found[re.sub(r"[-_.]+", "-", match["name"]).lower()] = (match["version"], match["extras"] or "")
    return found


def jax_version() -> str:
    return pins("requirements.txt")["jax"][0]


@pytest.mark.parametrize("stack, extra", [("gpu", "cuda12"), ("tpu", "tpu")])
def test_the_accelerator_sets_pin_the_jax_of_requirements_txt(stack, extra):
    runtime, accelerator = pins("requirements.txt"), pins(f"requirements-{stack}.txt")
    assert runtime["jaxlib"][0] == jax_version()
    assert accelerator["jax"] == (jax_version(), extra)
    # The plugin packages pip resolved, pinned: jax-cuda12-plugin and -pjrt of the same version; libtpu.
    plugins = {name: version for name, (version, _) in accelerator.items() if name.startswith("jax-")}
    assert set(plugins.values()) <= {jax_version()} and bool(plugins) == (stack == "gpu"), plugins
    assert ("libtpu" in accelerator) == (stack == "tpu")


def test_the_gpu_set_holds_one_cuda_major():
    gpu = pins("requirements-gpu.txt")
    nvidia = [name for name in gpu if name.startswith("nvidia-")]
    assert nvidia and all(name.endswith("-cu12") for name in nvidia), nvidia
    assert {"jax-cuda12-plugin", "jax-cuda12-pjrt"} <= set(gpu)
    assert not [name for name in gpu if "cuda13" in name or name.endswith("-cu13")]
    assert "libtpu" not in gpu and "nvidia-cudnn-cu12" in gpu and "nvidia-nccl-cu12" in gpu


@pytest.mark.parametrize("stack", sorted(RUNTIME_SETS))
def test_no_runtime_set_holds_pytorch(stack):
    for name in RUNTIME_SETS[stack]:
        assert not {"torch", "torchvision", "peft"} & set(pins(name)), name
    if stack == "tpu":
        assert not [name for name in pins("requirements-tpu.txt") if name.startswith(("nvidia-", "jax-cuda"))]


def _make(target: str, tmp_path: pathlib.Path) -> str:
    make = shutil.which("make")
    assert make, "make is not installed"
    result = subprocess.run(
        [make, "-n", target, f"VENV={tmp_path / 'venv'}", f"BENCH_VENV={tmp_path / 'bench'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_demo_installs_the_runtime_set_alone_and_the_tests_add_theirs(tmp_path):
    """`make demo` from a bare clone installs only what the demo runs; PyTorch and the rest come with `make test`."""
    for target, files in (("demo", "-r requirements.txt"), ("test", "-r requirements.txt -r requirements-dev.txt")):
        commands = _make(target, tmp_path)
        installs = [line for line in commands.splitlines() if " -m pip install " in line and " -r " in line]
        assert installs == [f"{tmp_path}/venv/bin/python -m pip install -q {files}"], commands


@pytest.mark.parametrize("stack", sorted(RUNTIME_SETS))
def test_make_installs_each_accelerator_set_alone_and_checks_it(stack, tmp_path):
    commands = _make(f"install-{stack}", tmp_path)
    installs = [line for line in commands.splitlines() if " -m pip install " in line and " -r " in line]
    assert installs == [
        f"{tmp_path}/venv/bin/python -m pip install -q -r requirements.txt -r requirements-{stack}.txt"
    ], commands
    assert "-m pip check" in commands and "n == 'torch'" in commands  # no torch, one CUDA major, after install
    assert ("n.endswith('-cu12')" in commands) == (stack == "gpu")


def test_the_gpu_benchmark_gets_a_venv_of_its_own_with_a_cuda12_torch(tmp_path):
    commands = _make("install-bench-gpu", tmp_path)
    assert f"{tmp_path}/venv" not in commands and f"{tmp_path}/bench/bin/python -m pip install" in commands
    torch = re.search(r'"torch==([^"+]+)\+(cu\d+)"', commands)
    assert torch, commands
    assert torch[1] == pins("requirements-dev.txt")["torch"][0]  # the tests' version, its CUDA build
    assert torch[2].startswith("cu12") and f"download.pytorch.org/whl/{torch[2]}" in commands
    assert pins("requirements-bench-gpu.txt")["jax"] == (jax_version(), "cuda12")  # the same CUDA major
