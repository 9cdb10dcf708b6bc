"""The launchers against a real SLURM: the one-node cluster `.ci/slurm.sh` starts on this machine.

A job tinier than the demo (one run, 400 steps, two testsets of 16) goes through the sweep in every way a
cluster stops one: plain, a time limit shorter than the warning's usual lead, the time-limit warning itself
(`scancel --signal=USR1 --batch`, what `--signal=B:USR1@LEAD` sends), `scontrol requeue`,
`scancel --signal=TERM --full` and a plain `scancel`. The scenarios run at once, each in its own results
root, and each must end with the metrics.npz of the uninterrupted job, byte for byte in every array, the
run lock released. Without a cluster (no `sinfo`) these tests skip, except under CI (`CI` set), where
they fail.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np
import pytest

from analysis import schema
from oodjax.engine import run_lock
from oodjax.engine.preemption import PREEMPTED_EXIT_CODE

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = "opt-tiny-random_mnli_seed0_shots32"
TINY = [
    "--configs",
    "configs/demo.py",
    "--seeds",
    "0",
    "--config.train.steps=400",
    "--config.train.warmup_steps=1",
    "--config.eval.every=100",
    "--config.checkpoint_every=20",
    "--config.data.eval_cap=16",
    "--config.data.testsets=mnli,hans",
]


# Each job's processes drive one CPU device (not conftest's 8, which the sweep would pass on): cheaper to
# compile on a CI machine of two cores, and nothing here depends on the count.
ONE_DEVICE = "--xla_force_host_platform_device_count=1"


def _cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    answer = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return answer.returncode == 0 and bool(re.search(r"^(idle|mixed|allocated)", answer.stdout, re.M))


@pytest.fixture(scope="module")
def cluster():
    if not _cluster_up():
        message = "no SLURM cluster answers (sinfo): start one with .ci/slurm.sh"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set: these tests must run)")
        pytest.skip(message)


def sweep(root: pathlib.Path, *extra: str, job: Sequence[str] = TINY, **env_changes: str) -> subprocess.Popen:
    """The sweep of the tiny job into ``root``, started; ``finish`` waits for its lines."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", XLA_FLAGS=ONE_DEVICE)
    env.update(env_changes)
    env.pop("OODJAX_VENV", None)
    command = [sys.executable, "-m", "launch.sweep", *job, "--backend", "slurm", "--output_dir", str(root), *extra]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> list[str]:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    return output.splitlines()


def submitted(lines: list[str]) -> str:
    (job,) = [re.fullmatch(r"Submitted batch job (\d+)", line)[1] for line in lines if line.startswith("Submitted")]
    return job


def job_state(job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", shown))


def run_dir(root: pathlib.Path) -> pathlib.Path:
    return root / "demo" / RUN


def checkpointed(root: pathlib.Path) -> bool:
    folder = run_dir(root) / "checkpoints"
    return folder.is_dir() and any(path.name.isdigit() for path in folder.iterdir())


def wait(condition, what: str, timeout: float = 420) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def ended(job: str) -> bool:
    """Whether the job ended for good; a requeued job's two minutes of BeginTime are skipped."""
    state = job_state(job)
    if state.get("JobState") == "PENDING" and state.get("Reason") == "BeginTime":
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
    return state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def metrics(root: pathlib.Path) -> dict[str, np.ndarray]:
    with np.load(run_dir(root) / schema.METRICS_FILENAME) as stored:
        return {key: stored[key] for key in stored.files}


def assert_same_results(reference: pathlib.Path, root: pathlib.Path, steps: Sequence[int] = (0, 100, 200, 300, 400)):
    a, b = metrics(reference), metrics(root)
    assert a.keys() == b.keys()
    assert b[schema.STEP].tolist() == list(steps)
    for key in a.keys() - {schema.CONFIG}:
        np.testing.assert_array_equal(b[key], a[key], err_msg=f"{root.name}: {key}")
    config_a, config_b = (json.loads(x[schema.CONFIG].item()) for x in (a, b))
    assert config_a.pop("output_dir") != config_b.pop("output_dir")
    assert config_a == config_b
    assert not (run_dir(root) / run_lock.LOCK_FILENAME).exists()


def log(root: pathlib.Path) -> str:
    return "".join(path.read_text() for path in sorted((root / "demo").glob("slurm-*.out")))


# scenario -> (sweep options, the command that interrupts the job once it has a checkpoint, or None)
SCENARIOS = {
    "plain": ((), None),
    "short_time_limit": (("--time", "4"), None),
    "time_limit_warning": ((), ["scancel", "--signal=USR1", "--batch"]),
    "scontrol_requeue": ((), ["scontrol", "requeue"]),
    "scancel_term_full": ((), ["scancel", "--signal=TERM", "--full"]),
    "scancel": ((), ["scancel"]),
}


def test_every_way_slurm_stops_a_job_ends_in_the_uninterrupted_results(cluster, tmp_path):
    roots = {name: tmp_path / name for name in SCENARIOS}
    started = {name: sweep(roots[name], *options) for name, (options, _) in SCENARIOS.items()}
    jobs = {name: submitted(finish(process)) for name, process in started.items()}

    # The sweep again, while the jobs are queued or running: nothing submitted twice.
    again = finish(sweep(roots["plain"]))
    assert f"# skip demo: a job in {roots['plain']}/demo is queued or running" in again
    assert again[-1] == "0 runs in 0 jobs (1 runs queued, running or locked left alone)"

    # Each interruption once the job has a checkpoint, so that it stops part-way with something to resume.
    waiting = {name: command for name, (_, command) in SCENARIOS.items() if command}
    waiting_for = list(waiting)
    deadline = time.monotonic() + 420
    while waiting:
        for name, command in list(waiting.items()):
            if checkpointed(roots[name]):
                subprocess.run([*command, jobs[name]], check=True)
                del waiting[name]
            else:
                assert not ended(jobs[name]), f"{name} ended before it had a checkpoint:\n{log(roots[name])}"
        assert time.monotonic() < deadline, f"timed out waiting for the first checkpoints of {sorted(waiting)}"
        time.sleep(0.5)
    wait(lambda: all([ended(job) for job in jobs.values()]), "the jobs to end")  # each polled: requeued ones go on
    for name in waiting_for:  # stopped part-way, before the last step
        stopped = re.search(r"stopping after step (\d+) on SIG", log(roots[name]))
        assert stopped and int(stopped[1]) < 400, f"{name}:\n{log(roots[name])}"

    states = {name: job_state(job) for name, job in jobs.items()}
    for name in ("plain", "short_time_limit", "time_limit_warning", "scontrol_requeue"):
        assert states[name]["JobState"] == "COMPLETED", f"{name}: {states[name]}\n{log(roots[name])}"
    assert states["time_limit_warning"]["Restarts"] == "1"
    assert "requeueing job" in log(roots["time_limit_warning"])
    assert states["scontrol_requeue"]["Restarts"] == "1"
    assert "requeueing job" not in log(roots["scontrol_requeue"])  # SLURM requeued it, not the script

    # Stopped for good, checkpointed, the lock released: not requeued, and the next sweep resumes them.
    assert states["scancel_term_full"]["JobState"] == "FAILED"
    assert states["scancel_term_full"]["ExitCode"] == f"{PREEMPTED_EXIT_CODE}:0"
    assert states["scancel"]["JobState"] == "CANCELLED"
    for name in ("scancel_term_full", "scancel"):
        text = log(roots[name])
        assert re.search(r"stopping after step \d+ on SIGTERM", text), text[-3000:]
        assert "requeueing job" not in text
        assert not (run_dir(roots[name]) / run_lock.LOCK_FILENAME).exists()
        jobs[name] = submitted(finish(sweep(roots[name])))
    wait(lambda: all([ended(jobs[name]) for name in ("scancel_term_full", "scancel")]), "the resumed jobs to end")
    for name in ("scancel_term_full", "scancel"):
        assert job_state(jobs[name])["JobState"] == "COMPLETED", log(roots[name])
        assert re.search(r"resumes from its checkpoint at step \d+", log(roots[name]))

    for name, root in roots.items():
        if name != "plain":
            assert_same_results(roots["plain"], root)
