"""A run killed with SIGKILL and restarted ends with the same metrics.npz as an uninterrupted run."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np

from analysis import schema
from configs import demo
from oodjax.engine import loop
from oodjax.engine.checkpoints import CHECKPOINT_DIR

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 30


def _overrides(output_dir, cache_dir):
    """The demo, shrunk (to the shapes of the other engine tests): two runs, 30 steps, evaluations and
    checkpoints every 5 steps."""
    return {
        "output_dir": str(output_dir),
        "data.cache_dir": str(cache_dir),
        "data.testsets": ("mnli", "hans"),
        "data.eval_cap": 16,
        "data.max_length": 64,
        "data.buckets": (64,),
        "eval.batch_size": 8,
        "train.steps": STEPS,
        "train.warmup_steps": 2,
        "eval.every": 5,
        "checkpoint_every": 5,
    }


def _demo_config(overrides):
    config = demo.get_config()
    for field, value in overrides.items():
        section, _, key = field.rpartition(".")
        (config[section] if section else config)[key] = value
    return config


def _first_checkpoint_then_kill(overrides, out):
    """Runs `python -m oodjax.main` on the overrides and SIGKILLs it once a checkpoint is complete."""
    args = [f"--config.{field}={value!r}" if isinstance(value, tuple) else f"--config.{field}={value}"
            for field, value in overrides.items()]
    process = subprocess.Popen(
        [sys.executable, "-m", "oodjax.main", "--config", "configs/demo.py", *args],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    checkpoints = out / CHECKPOINT_DIR
    deadline = time.monotonic() + 300
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 5 minutes"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    process.stderr.close()
    assert process.returncode == -signal.SIGKILL


def _metrics(run_dir):
    with np.load(run_dir / schema.METRICS_FILENAME, allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def test_sigkill_then_rerun_gives_the_uninterrupted_results(tmp_path):
    cache = tmp_path / "cache"
    uninterrupted = _demo_config(_overrides(tmp_path / "a", cache))
    loop.train(uninterrupted)

    interrupted = _overrides(tmp_path / "b", cache)
    _first_checkpoint_then_kill(interrupted, tmp_path / "b")
    killed_at = {
        run.name: _metrics(run.directory)[schema.STEP].tolist() for run in loop.plan_runs(_demo_config(interrupted))
    }
    assert all(steps[-1] < STEPS for steps in killed_at.values()), killed_at  # it really was stopped mid-run
    loop.train(_demo_config(interrupted))  # resumes from the latest checkpoint

    for run_a, run_b in zip(loop.plan_runs(uninterrupted), loop.plan_runs(_demo_config(interrupted))):
        a, b = _metrics(run_a.directory), _metrics(run_b.directory)
        assert a.keys() == b.keys()
        assert a[schema.STEP].tolist() == list(range(0, STEPS + 1, 5))
        for key in a:
            if key != schema.CONFIG:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{run_a.name}: {key}")
        config_a, config_b = json.loads(a[schema.CONFIG].item()), json.loads(b[schema.CONFIG].item())
        assert config_a.pop("output_dir") != config_b.pop("output_dir")
        assert config_a == config_b
