"""`pip install .` gives the four packages and the console scripts, usable outside the repository.

The wheel is built from a copy of the sources (so the shared work tree gets
no build/ or egg-info) without build isolation, and installed without its
dependencies into a directory of its own: the project's environment already
holds them, so nothing is downloaded. Commands run from a directory outside
the repository, with only that install directory added to the path.
"""

import importlib.metadata
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("oodjax", "analysis", "launch", "configs")
BUILD_FILES = (
    "pyproject.toml",
    "README.md",
    "requirements.txt",
    "requirements-dev.txt",
    "requirements-tensorboard.txt",
)
COMMANDS = {
    "oodjax-train",
    "oodjax-analyse",
    "oodjax-runs",
    "oodjax-sweep",
    "oodjax-estimate",
    "oodjax-preflight",
    "oodjax-evaluate",
    "oodjax-fetch",
}
# Run inside the installed copy: every console script's function must exist and
# be callable without arguments, as the generated script calls it.
CHECK_ENTRY_POINTS = """
import importlib.metadata, inspect, json
points = importlib.metadata.distribution("oodjax").entry_points
problems = {}
for point in points.select(group="console_scripts"):
    try:
        required = [p.name for p in inspect.signature(point.load()).parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            problems[point.name] = f"{point.value} needs arguments {required}"
    except (ImportError, AttributeError) as error:
        problems[point.name] = f"{point.value}: {type(error).__name__}: {error}"
print(json.dumps({"names": sorted(p.name for p in points), "problems": problems}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[pathlib.Path, dict[str, str], pathlib.Path]:
    """(install directory, environment that finds it, a working directory outside the repo)."""
    work = tmp_path_factory.mktemp("install")
    source = work / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=ignore)
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", work / "wheels", source], check=True, timeout=120
    )
    (wheel,) = (work / "wheels").glob("oodjax-*.whl")
    site = work / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True, timeout=120)
    environment = os.environ | {"PYTHONPATH": str(site)}
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    return site, environment, elsewhere


def run(command: list, installed) -> subprocess.CompletedProcess:
    _, environment, elsewhere = installed
    completed = subprocess.run(command, cwd=elsewhere, env=environment, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def test_packages_import_from_the_install_not_the_repository(installed):
    site, _, _ = installed
    code = "import oodjax, analysis, launch, configs; print(*(m.__file__ for m in (oodjax, analysis, launch, configs)))"
    files = run([sys.executable, "-c", code], installed).stdout.split()
    assert [pathlib.Path(f).parent for f in files] == [site / p for p in PACKAGES]
    # What the code finds next to itself: the shipped configs (names with dots
    # included) and the launchers the sweep runs.
    assert (site / "configs" / "opt2.7_mnli.py").is_file()
    assert (site / "launch" / "slurm.sbatch").is_file()
    assert (site / "launch" / "tpu_pod.sh").is_file()
    assert (site / "launch" / "xla_flags.sh").is_file()


@pytest.mark.parametrize("command", ["oodjax-analyse", "oodjax-runs"])
def test_analysis_commands_run(installed, command):
    site, _, _ = installed
    assert "usage:" in run([site / "bin" / command, "--help"], installed).stdout


def test_every_console_script_names_a_function_callable_without_arguments(installed):
    found = json.loads(run([sys.executable, "-c", CHECK_ENTRY_POINTS], installed).stdout)
    assert set(found["names"]) == COMMANDS
    assert found["problems"] == {}


def test_dependencies_are_the_requirements_pins(installed):
    """Runtime dependencies are requirements.txt's pins; the `test` extra requirements-dev.txt's."""
    site, _, _ = installed
    (metadata,) = site.glob("oodjax-*.dist-info")
    requires = importlib.metadata.PathDistribution(metadata).requires

    def pins(name: str) -> list[str]:
        lines = (ROOT / name).read_text().splitlines()
        return [line.strip() for line in lines if line.strip() and not line.startswith("#")]

    assert [r for r in requires if "extra ==" not in r] == pins("requirements.txt")
    assert [r.split(";")[0].strip() for r in requires if 'extra == "test"' in r] == pins("requirements-dev.txt")
    # `pip install ".[tensorboard]"`: the viewer of the event files, pinned.
    tensorboard = [r.split(";")[0].strip() for r in requires if 'extra == "tensorboard"' in r]
    assert tensorboard == pins("requirements-tensorboard.txt") and tensorboard[0].startswith("tensorboard==")


def test_packaged_configs_are_named_from_outside_the_repository(installed):
    """`--config oodjax:NAME` and the sweep's `oodjax:PATTERN` find the installed configs/ (sub-folders too)."""
    site, _, elsewhere = installed
    assert not (elsewhere / "configs").exists()
    code = (
        "from oodjax import config_cli; from launch import config_files; "
        "print(config_cli.config_file_path('oodjax:opt30_mnli')); "
        "print(config_cli.load_config_file('oodjax:opt2.7_snli').model.path); "
        "print(config_files.load_config('oodjax:original/opt30_mnli').model.path)"
    )
    path, opt27, original = run([sys.executable, "-c", code], installed).stdout.split()
    assert pathlib.Path(path) == site / "configs" / "opt30_mnli.py"
    assert (opt27, original) == ("facebook/opt-2.7b", "facebook/opt-30b")
    lines = run(
        [
            site / "bin" / "oodjax-sweep",
            "--configs",
            "oodjax:*_mnli",
            "--backend",
            "slurm",
            "--dry_run",
            "--account",
            "proj",
        ],
        installed,
    ).stdout.splitlines()
    assert lines[-1] == "72 runs in 8 jobs"
    commands = [line for line in lines[:-1] if not line.startswith("#")]
    assert len(commands) == 8
    assert all(f"{site}/launch/slurm.sbatch oodjax:" in line and "--account=proj" in line for line in commands)
    # Each job gets the installed launchers and the sweep's Python: the installed script, run as sbatch
    # would from this directory outside any clone, finds its flags file and starts that Python.
    exported = f"--export=ALL,OODJAX_LAUNCH_DIR={site}/launch,OODJAX_PYTHON={sys.executable}"
    assert all(exported in shlex.split(line) for line in commands)
    recorder = elsewhere / "python"
    recorder.write_text('#!/bin/bash\nprintf "%s\\n" "$@" "$XLA_FLAGS" > "$0.args"\n')
    recorder.chmod(0o755)
    environment = {key: value for key, value in installed[1].items() if not key.startswith(("SLURM_", "OODJAX_"))}
    environment.update(OODJAX_LAUNCH_DIR=f"{site}/launch", OODJAX_PYTHON=str(recorder), JAX_PLATFORMS="cpu")
    subprocess.run(
        ["bash", site / "launch" / "slurm.sbatch", "oodjax:opt30_mnli"], cwd=elsewhere, env=environment, check=True
    )
    recorded = (elsewhere / "python.args").read_text().splitlines()
    assert recorded[:3] == ["-m", "oodjax.main", "--config=oodjax:opt30_mnli"]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in recorded[3]
