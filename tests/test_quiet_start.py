"""Without PyTorch (a runtime environment), no entry point prints transformers' "PyTorch was not found" notice,
and transformers' other warnings still show."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTICE = "PyTorch was not found. Models won't be available"
# torch made unimportable, as where it is not installed; then transformers warns of something else.
PROGRAM = """
import importlib, sys
sys.modules["torch"] = None
for name in sys.argv[1:]:
    importlib.import_module(name)
import transformers
transformers.utils.logging.get_logger("transformers").warning("another transformers warning")
"""


def stderr_after_importing(*modules):
    completed = subprocess.run(
        [sys.executable, "-c", PROGRAM, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(pathlib.Path.home()), "JAX_PLATFORMS": "cpu"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stderr


def test_transformers_alone_prints_the_notice():
    """The condition the others guard against (so they would see the notice if it came back)."""
    assert NOTICE in stderr_after_importing()


@pytest.mark.parametrize(
    "entry_point",
    ["oodjax.main", "oodjax.evaluate", "launch.sweep", "launch.estimate", "launch.preflight", "launch.fetch"],
)
def test_no_entry_point_prints_it_and_other_warnings_show(entry_point):
    stderr = stderr_after_importing(entry_point)
    assert NOTICE not in stderr
    assert "another transformers warning" in stderr
