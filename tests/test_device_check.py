"""`python -m benchmarks.device_check --smoke` runs every check end to end on the CPU and prints one table.

The GPU run is the same code at the study's sizes; here each check must pass at tiny ones: the versions as
pinned, the demo's results written for one run and for two, the benchmark's oodjax phase timed at the layout
the estimate chose, the Pallas kernel's parity with XLA's attention, and the preflight's compiled memory."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import device_check, settings
from tests.test_benchmarks_smoke import ROOT

CHECKS = [
    "versions",
    "demo, bf16, 1 run",
    "demo, bf16, 2 runs",
    "MFU at smol3's layout",
    "attention pallas_gpu",
    "preflight memory",
]


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("device-check") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "OODJAX_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.device_check", "--smoke", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done


def test_every_check_runs_and_passes_in_one_table(checked):
    rows, done = checked
    assert [row["check"] for row in rows["rows"]] == CHECKS
    assert all(row["ok"] for row in rows["rows"]), rows
    assert done.stdout.startswith(f"device check on {rows['device']}\n| check | result | ok | s |")
    for name in CHECKS:
        assert f"| {name} | " in done.stdout
        assert f"[device_check] {name}: started" in done.stderr and f"[device_check] {name}: done in" in done.stderr


def test_each_check_reports_what_it_measured(checked):
    rows, _ = checked
    result = {row["check"]: row["result"] for row in rows["rows"]}
    assert result["versions"] == "jax 0.10.2, jaxlib 0.10.2, flax 0.12.8; as pinned"
    assert "attention xla, results of 1/1 runs written" in result["demo, bf16, 1 run"]
    assert "attention xla, results of 2/2 runs written" in result["demo, bf16, 2 runs"]
    assert result["MFU at smol3's layout"].startswith("remat none, 1 micro-batch(es) (estimate ")  # fits at once
    assert "train " in result["MFU at smol3's layout"] and "eval " in result["MFU at smol3's layout"]
    error = float(result["attention pallas_gpu"].split("largest relative error ")[1].split()[0])
    assert 0 < error <= device_check.TOLERANCE
    assert result["preflight memory"].startswith("demo: train step ")


def test_layouts_are_those_the_estimate_fits_fewest_micro_batches_then_least_recomputation(monkeypatch):
    """SmolLM3-3B's 9 runs on one device: the estimate puts remat none with one micro-batch at 49.6 GiB, save_dots
    at 22.1, full at 9.0, and none with two micro-batches at 29.6; with 44 GiB usable, 30.8 after the headroom,
    the first is skipped (as it must be on an H100, where it needed 66 GiB)."""
    from launch import devices

    monkeypatch.setattr(devices, "usable_memory", lambda device: (44 * 2**30, "given"))
    found = device_check.layouts(settings.DEVICE_MODES["gpu"], "NVIDIA H100 80GB HBM3")
    first = [next(found) for _ in range(4)]
    assert [(mode.remat, mode.grad_accum) for mode, _ in first] == [
        ("save_dots", 1),
        ("full", 1),
        ("none", 2),
        ("save_dots", 2),
    ]
    assert first[0][1] == "estimate 22.1 of 30.8 GiB, 0.7 of the 44.0 JAX may use on the H100 SXM"
    assert all(mode.runs == 9 and mode.steps == 24 for mode, _ in first)
    unpatched = device_check.layouts(settings.DEVICE_MODES["gpu"], "NVIDIA H100 80GB HBM3")
    monkeypatch.undo()
    assert (lambda mode: (mode.remat, mode.grad_accum))(next(unpatched)[0]) == ("save_dots", 1)


def test_without_a_gpu_the_full_check_is_refused_in_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.device_check"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m benchmarks.device_check: error: needs JAX's GPU backend, found cpu (--smoke runs tiny)"
    ]
