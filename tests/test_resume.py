"""Runs resume one by one: after SIGKILL, after SIGTERM, with a seed added, removed, or a config changed.

One job's life, each stage checked against jobs never interrupted: `python -m oodjax.main` is killed with
SIGKILL once its runs have a checkpoint; rerun with one more seed, it is sent SIGTERM part-way and exits
with the preempted status once every run it trains is checkpointed; finished in process, every run ends
with exactly the results of an uninterrupted job. Then a job with a run fewer skips and changes nothing,
and a job with a changed learning rate and a new seed is refused naming the field, leaving no folder.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from analysis import schema
from configs import demo
from oodjax.engine import checkpoints, loop, preemption, results

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 20


def _overrides(output_dir, cache_dir, seeds):
    """The demo, shrunk (to the shapes of the other engine tests): 30 steps, evaluations and checkpoints
    every 5 steps, 32 shots for each of `seeds`."""
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
        "runs.seeds": tuple(seeds),
    }


def _demo_config(overrides):
    config = demo.get_config()
    for field, value in overrides.items():
        section, _, key = field.rpartition(".")
        (config[section] if section else config)[key] = value
    return config


def _start_main(overrides, log):
    args = [f"--config.{field}={value!r}" if isinstance(value, tuple) else f"--config.{field}={value}"
            for field, value in overrides.items()]
    return subprocess.Popen(
        [sys.executable, "-m", "oodjax.main", "--config", "configs/demo.py", *args],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
    )


def _wait_until(condition, process, log_path, what):
    deadline = time.monotonic() + 300
    while not condition():
        assert process.poll() is None, f"exited ({process.returncode}) before {what}:\n" + log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"not {what} within 5 minutes"
        time.sleep(0.02)


def _steps(config):
    """Each run's checkpoint steps."""
    return [set(checkpoints.checkpoint_steps(run.directory)) for run in results.plan_runs(config)]


def _metrics(run_dir):
    with np.load(run_dir / schema.METRICS_FILENAME, allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def _assert_same_results(reference, run):
    a, b = _metrics(reference.directory), _metrics(run.directory)
    assert a.keys() == b.keys()
    assert b[schema.STEP].tolist() == list(range(0, STEPS + 1, 5))
    for key in a.keys() - {schema.CONFIG}:
        np.testing.assert_array_equal(b[key], a[key], err_msg=f"{run.name}: {key}")
    config_a, config_b = json.loads(a[schema.CONFIG].item()), json.loads(b[schema.CONFIG].item())
    for config in (config_a, config_b):  # where each job wrote, and which runs it trained
        config.pop("output_dir"), config.pop("runs")
    assert config_a == config_b


def _metrics_bytes(root):
    return {path: path.read_bytes() for path in root.rglob(schema.METRICS_FILENAME)}


def test_sigkill_sigterm_and_changed_runs_give_the_uninterrupted_results(tmp_path):
    cache = tmp_path / "cache"
    uninterrupted = _demo_config(_overrides(tmp_path / "a", cache, (0, 42)))
    alone = _demo_config(_overrides(tmp_path / "a7", cache, (7,)))  # the added seed, trained alone
    loop.train(uninterrupted)
    loop.train(alone)

    # SIGKILL once both runs have a checkpoint at one step.
    job = _overrides(tmp_path / "b", cache, (0, 42))
    log_path = tmp_path / "kill.log"
    with log_path.open("w") as log:
        process = _start_main(job, log)
        _wait_until(lambda: set.intersection(*_steps(_demo_config(job))), process, log_path, "a checkpoint")
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    killed_at = [_metrics(run.directory)[schema.STEP][-1] for run in results.plan_runs(_demo_config(job))]
    assert max(killed_at) < STEPS, killed_at  # it really was stopped mid-run

    # Seed 7 added: seeds 0 and 42 resume, 7 starts. SIGTERM once runs 0 and 42 are past their checkpoint.
    job = _overrides(tmp_path / "b", cache, (0, 42, 7))
    resumed_from = max(_steps(_demo_config(job))[0])
    log_path = tmp_path / "term.log"
    with log_path.open("w") as log:
        process = _start_main(job, log)
        _wait_until(lambda: max(_steps(_demo_config(job))[0], default=0) > resumed_from, process, log_path,
                    "a checkpoint after the resumed one")
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=300)
    text = log_path.read_text()
    assert process.returncode == preemption.PREEMPTED_EXIT_CODE, text[-3000:]
    assert "resumes from its checkpoint at step" in text and "seed7_shots32: starts at step 0" in text
    stopped = re.search(r"stopping after step (\d+) on SIGTERM: the checkpoints of (\d+) runs", text)
    assert stopped, text[-3000:]
    step, trained = int(stopped[1]), int(stopped[2])
    assert step < STEPS or trained == 1  # stopped part-way through seeds 0 and 42, or through seed 7
    stopped_runs = [steps for steps in _steps(_demo_config(job)) if steps]
    assert any(step in steps for steps in stopped_runs)  # the stop wrote its checkpoint

    final = _demo_config(job)
    loop.train(final)
    references = [*results.plan_runs(uninterrupted), *results.plan_runs(alone)]
    for reference, run in zip(references, results.plan_runs(final), strict=True):
        _assert_same_results(reference, run)

    # A job with a run fewer: nothing to train, nothing rewritten.
    written = _metrics_bytes(tmp_path / "b")
    loop.train(_demo_config(_overrides(tmp_path / "b", cache, (0,))))
    assert _metrics_bytes(tmp_path / "b") == written

    # Another learning rate, and a new seed: refused, naming the field, and the new run's folder never made.
    changed = _demo_config(_overrides(tmp_path / "b", cache, (0, 42, 7, 99)))
    changed.train.learning_rate = 5e-4
    with pytest.raises(ValueError, match=r"train.learning_rate 0.001 -> 0.0005"):
        loop.train(changed)
    assert not any("seed99" in path.name for path in (tmp_path / "b").iterdir())
    assert _metrics_bytes(tmp_path / "b") == written
