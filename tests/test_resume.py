"""Runs resume one by one: after SIGKILL, after SIGTERM, after Ctrl-C, with a seed added, removed, or a config changed.

One job's life, each stage checked against jobs never interrupted: `python -m oodjax.main` is killed with
SIGKILL once its runs have a checkpoint; rerun with one more seed (taking over the locks the killed job left),
it is sent SIGTERM part-way and exits with the preempted status once every run it trains is checkpointed;
finished in process, every run ends with exactly the results of an uninterrupted job. Then a job with a run
fewer skips and changes nothing, and a job with a changed learning rate and a new seed is refused naming the
field, leaving no folder. Another job's life: one Ctrl-C stops it as SIGTERM does, a second Ctrl-C ends its
resumed job at once, and the next start resumes from the last complete checkpoint to the uninterrupted results.

The helpers that start and watch `python -m oodjax.main` serve tests/test_run_lock.py too.
"""

import json
import logging
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from analysis import schema
from configs import demo
from oodjax.config_checks import check_config
from oodjax.config_read import read
from oodjax.engine import checkpoints, loop, preemption, run_lock

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 20


def demo_overrides(output_dir, cache_dir, seeds):
    """The demo, shrunk (to the shapes of the other engine tests): STEPS steps, evaluations and checkpoints
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


def demo_config(overrides):
    """The config `start_main(overrides, ...)` trains, for training in process."""
    config = demo.get_config()
    for field, value in overrides.items():
        section, _, key = field.rpartition(".")
        (config[section] if section else config)[key] = value
    return config


def start_main(overrides, log):
    """`python -m oodjax.main` on the shrunk demo with `overrides`, its log (stderr) to `log`."""
    args = [
        f"--config.{field}={value!r}" if isinstance(value, tuple) else f"--config.{field}={value}"
        for field, value in overrides.items()
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "oodjax.main", "--config", "configs/demo.py", *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


def wait_until(condition, process, log_path, what):
    """Polls `condition` until it holds; fails, with the end of the log, if `process` exits first."""
    deadline = time.monotonic() + 300
    while not condition():
        assert process.poll() is None, f"exited ({process.returncode}) before {what}:\n" + log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"not {what} within 5 minutes"
        time.sleep(0.02)


def checkpoint_steps_of(config):
    """Each run's checkpoint steps."""
    return [set(checkpoints.checkpoint_steps(run.directory)) for run in read(config).runs.runs()]


def _metrics(run_dir):
    with np.load(run_dir / schema.METRICS_FILENAME, allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def assert_same_results(reference, run):
    """`run`'s metrics.npz holds every evaluation, equal to `reference`'s but for where it was written."""
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
    uninterrupted = demo_config(demo_overrides(tmp_path / "a", cache, (0, 42)))
    alone = demo_config(demo_overrides(tmp_path / "a7", cache, (7,)))  # the added seed, trained alone
    loop.train(check_config(uninterrupted))
    loop.train(check_config(alone))

    # SIGKILL once both runs have a checkpoint at one step.
    job = demo_overrides(tmp_path / "b", cache, (0, 42))
    log_path = tmp_path / "kill.log"
    with log_path.open("w") as log:
        process = start_main(job, log)
        wait_until(lambda: set.intersection(*checkpoint_steps_of(demo_config(job))), process, log_path, "a checkpoint")
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    killed_at = [_metrics(run.directory)[schema.STEP][-1] for run in read(demo_config(job)).runs.runs()]
    assert max(killed_at) < STEPS, killed_at  # it really was stopped mid-run

    # Seed 7 added: seeds 0 and 42 resume, 7 starts. SIGTERM once runs 0 and 42 are past their checkpoint.
    job = demo_overrides(tmp_path / "b", cache, (0, 42, 7))
    resumed_from = max(checkpoint_steps_of(demo_config(job))[0])
    log_path = tmp_path / "term.log"
    with log_path.open("w") as log:
        process = start_main(job, log)
        wait_until(
            lambda: max(checkpoint_steps_of(demo_config(job))[0], default=0) > resumed_from,
            process,
            log_path,
            "a checkpoint after the resumed one",
        )
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=300)
    text = log_path.read_text()
    assert process.returncode == preemption.PREEMPTED_EXIT_CODE, text[-3000:]
    assert "resumes from its checkpoint at step" in text and "seed7_shots32 starts at step 0" in text
    stopped = re.search(r"stopping after step (\d+) on SIGTERM: the checkpoints of (\d+) runs", text)
    assert stopped, text[-3000:]
    step, trained = int(stopped[1]), int(stopped[2])
    assert step < STEPS or trained == 1  # stopped part-way through seeds 0 and 42, or through seed 7
    stopped_runs = [steps for steps in checkpoint_steps_of(demo_config(job)) if steps]
    assert any(step in steps for steps in stopped_runs)  # the stop wrote its checkpoint

    final = demo_config(job)
    loop.train(check_config(final))
    references = [*read(uninterrupted).runs.runs(), *read(alone).runs.runs()]
    for reference, run in zip(references, read(final).runs.runs(), strict=True):
        assert_same_results(reference, run)

    # A job with a run fewer: nothing to train, nothing rewritten.
    written = _metrics_bytes(tmp_path / "b")
    loop.train(check_config(demo_config(demo_overrides(tmp_path / "b", cache, (0,)))))
    assert _metrics_bytes(tmp_path / "b") == written

    # Another learning rate, and a new seed: refused, naming the field, and the new run's folder never made.
    changed = demo_config(demo_overrides(tmp_path / "b", cache, (0, 42, 7, 99)))
    changed.train.learning_rate = 5e-4
    with pytest.raises(ValueError, match=r"train.learning_rate 0.001 -> 0.0005"):
        loop.train(check_config(changed))
    assert not any("seed99" in path.name for path in (tmp_path / "b").iterdir())
    assert _metrics_bytes(tmp_path / "b") == written


def test_ctrl_c_checkpoints_and_exits_75_and_a_second_ctrl_c_exits_at_once(tmp_path, caplog):
    """One Ctrl-C (SIGINT) part-way: every run checkpointed at the step it stopped after, exit status 75, the run
    unlocked. The resumed job gets Ctrl-C twice while it loads: the second kills it at once, before any step or
    checkpoint, its lock left behind. The next start takes that lock over, resumes from the last complete
    checkpoint and ends with the results of a job never interrupted."""
    cache = tmp_path / "cache"
    uninterrupted = demo_config(demo_overrides(tmp_path / "a", cache, (0,)))
    loop.train(check_config(uninterrupted))
    job = demo_overrides(tmp_path / "b", cache, (0,))
    (run,) = read(demo_config(job)).runs.runs()
    lock = run.directory / run_lock.LOCK_FILENAME

    log_path = tmp_path / "once.log"
    with log_path.open("w") as log:
        process = start_main(job, log)
        wait_until(lambda: checkpoint_steps_of(demo_config(job))[0], process, log_path, "a checkpoint")
        os.kill(process.pid, signal.SIGINT)
        process.wait(timeout=300)
    text = log_path.read_text()
    assert process.returncode == preemption.PREEMPTED_EXIT_CODE, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    stopped = re.search(r"stopping after step (\d+) on SIGINT: the checkpoints of 1 runs", text)
    assert stopped, text[-3000:]
    step = int(stopped[1])
    assert step < STEPS and max(checkpoint_steps_of(demo_config(job))[0]) == step
    assert not lock.exists()

    log_path = tmp_path / "twice.log"
    with log_path.open("w") as log:
        process = start_main(job, log)
        wait_until(
            lambda: f"training 1 runs from step {step}" in log_path.read_text(),
            process,
            log_path,
            "loading the resumed run",
        )
        os.kill(process.pid, signal.SIGINT)
        wait_until(lambda: "received SIGINT" in log_path.read_text(), process, log_path, "the first Ctrl-C noted")
        os.kill(process.pid, signal.SIGINT)
        process.wait(timeout=10)  # at once: no step, no checkpoint, no evaluation waited for
    text = log_path.read_text()
    assert process.returncode == -signal.SIGINT, text[-3000:]
    assert "stopping after step" not in text
    assert json.loads(lock.read_text())["pid"] == process.pid  # left behind, as by any process killed

    with caplog.at_level(logging.INFO):
        loop.train(check_config(demo_config(job)))
    assert f"taking over the stale lock of process {process.pid} on {socket.gethostname()}" in caplog.text
    assert "(its process is gone)" in caplog.text
    assert f"resumes from its checkpoint at step {step}" in caplog.text
    assert not lock.exists()
    (reference,) = read(uninterrupted).runs.runs()
    assert_same_results(reference, run)
