"""The multi-node path against a real SLURM: the two-node partition `ci2` that `.ci/slurm.sh --nodes 2` builds
from network namespaces on this machine (two slurmd's, hosts oodjax-n1 and oodjax-n2, each its own address).

The demo, tinier (one run, 60 steps, two testsets of 16), goes through the sweep with `--nodes 2`: one process
per node, found from SLURM's host list, joined by `jax.distributed` across the two addresses, one checkpoint
written by both. At once, each in its own results root: the job on one node of two CPU devices, the reference;
the job on two nodes of one device each, whose metrics equal it but for float32 reduction order (gloo sums
across the hosts in another order, as in tests/test_launch_multiprocess.py); the time-limit warning
(`scancel --signal=USR1 --batch`) and `scontrol requeue`, each requeued and resumed to the two-node job's
arrays, byte for byte; node 2's process killed mid-run, after which process 0 ends with one line naming the
host and step it lost, the job FAILED, no lock left, and the next sweep resumes from the last checkpoint to
the same arrays. Without the partition these tests skip, except under CI (`CI` set), where they fail.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import time

import pytest

from analysis import schema
from oodjax.engine import run_lock
from tests.test_launch_multiprocess import assert_equal_but_for_reduction_order
from tests.test_slurm import (
    assert_same_results,
    checkpointed,
    ended,
    finish,
    job_state,
    log,
    metrics,
    run_dir,
    submitted,
    sweep,
    wait,
)

PARTITION = "ci2"
STEPS = (0, 20, 40, 60)
TWO_NODE_JOB = [
    "--configs",
    "configs/demo.py",
    "--seeds",
    "0",
    "--config.train.steps=60",
    "--config.train.warmup_steps=1",
    "--config.eval.every=20",
    "--config.checkpoint_every=10",
    "--config.data.eval_cap=16",
    "--config.data.testsets=mnli,hans",
]
TWO_NODES = ("--partition", PARTITION, "--nodes", "2")


def _partition_up() -> bool:
    answer = subprocess.run(
        ["sinfo", "-h", "-p", PARTITION, "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30
    )
    return answer.returncode == 0 and len(re.findall(r" (idle|mixed|allocated|completing)", answer.stdout)) == 2


@pytest.fixture(scope="module")
def two_nodes():
    if not _partition_up():
        message = f"no two-node SLURM partition {PARTITION} answers (sinfo): start it with .ci/slurm.sh --nodes 2"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set: these tests must run)")
        pytest.skip(message)


def oodjax_process(job: str, task: int) -> int:
    """The pid of task ``task`` of the job: the `python -m oodjax.main` whose environment names them."""
    for proc in pathlib.Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            command = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={task}".encode()} <= environ and b"oodjax.main" in command:
            return int(proc.name)
    raise AssertionError(f"no oodjax.main of task {task} of job {job}")


def kill_task_1(job: str) -> None:
    os.kill(oodjax_process(job, 1), signal.SIGKILL)


# scenario -> (sweep options, the interruption once the job has a checkpoint, or None)
SCENARIOS = {
    "one_node": (("--partition", "ci"), None),
    "two_nodes": (TWO_NODES, None),
    "time_limit_warning": (TWO_NODES, lambda job: subprocess.run(["scancel", "--signal=USR1", "--batch", job])),
    "scontrol_requeue": (TWO_NODES, lambda job: subprocess.run(["scontrol", "requeue", job])),
    "node_lost": (TWO_NODES, kill_task_1),
}


def test_two_nodes_train_like_one_and_survive_requeues_and_a_lost_node(two_nodes, tmp_path):
    roots = {name: tmp_path / name for name in SCENARIOS}
    started = {  # one CPU device a node (test_slurm's default), two on the one node
        name: sweep(roots[name], *options, job=TWO_NODE_JOB, XLA_FLAGS="--xla_force_host_platform_device_count=2")
        if name == "one_node"
        else sweep(roots[name], *options, job=TWO_NODE_JOB)
        for name, (options, _) in SCENARIOS.items()
    }
    lines = {name: finish(process) for name, process in started.items()}
    jobs = {name: submitted(output) for name, output in lines.items()}
    # Before submitting a multi-node job, the sweep names the stop that cannot be survived and those that can.
    assert any(line.startswith("# 2 nodes: srun answers SIGTERM with SIGKILL") for line in lines["two_nodes"])
    assert not any(line.startswith("# 2 nodes") for line in lines["one_node"])

    waiting = {name: interrupt for name, (_, interrupt) in SCENARIOS.items() if interrupt}
    deadline = time.monotonic() + 420
    while waiting:
        for name, interrupt in list(waiting.items()):
            if checkpointed(roots[name]):
                interrupt(jobs[name])
                del waiting[name]
            else:
                assert not ended(jobs[name]), f"{name} ended before it had a checkpoint:\n{log(roots[name])}"
        assert time.monotonic() < deadline, f"timed out waiting for the first checkpoints of {sorted(waiting)}"
        time.sleep(0.5)
    # The lost node first: its job ends at once, and its resumption overlaps the requeued jobs.
    wait(lambda: ended(jobs["node_lost"]), "the job that lost a node to end")
    lost_state, text = job_state(jobs["node_lost"]), log(roots["node_lost"])
    assert lost_state["JobState"] == "FAILED", f"{lost_state}\n{text}"
    # One line from the survivor naming the host and step, no fatal-error dump, no lock left.
    lost = re.search(r"lost the process on oodjax-n2 \(10\.213\.0\.12\) at step (\d+)", text)
    assert lost and int(lost[1]) < STEPS[-1], text[-3000:]
    assert "Fatal Python error" not in text, text[-3000:]
    assert not (run_dir(roots["node_lost"]) / run_lock.LOCK_FILENAME).exists()
    jobs["node_lost"] = submitted(finish(sweep(roots["node_lost"], *TWO_NODES, job=TWO_NODE_JOB)))
    wait(lambda: all([ended(job) for job in jobs.values()]), "the jobs to end")

    states = {name: job_state(job) for name, job in jobs.items()}
    for name in ("one_node", "two_nodes", "time_limit_warning", "scontrol_requeue", "node_lost"):
        assert states[name]["JobState"] == "COMPLETED", f"{name}: {states[name]}\n{log(roots[name])}"
    for name in ("two_nodes", "time_limit_warning", "scontrol_requeue", "node_lost"):
        text = log(roots[name])
        assert "process 0 of 2 (layout from slurm)" in text and "process 1 of 2 (layout from slurm)" in text, text
    for name in ("time_limit_warning", "scontrol_requeue"):
        assert states[name]["Restarts"] == "1", f"{name}: {states[name]}"
        stopped = re.search(r"stopping after step (\d+) on SIG", log(roots[name]))
        assert stopped and int(stopped[1]) < STEPS[-1], f"{name}:\n{log(roots[name])}"
    assert "requeueing job" in log(roots["time_limit_warning"])

    assert re.search(r"resumes from its checkpoint at step \d+", log(roots["node_lost"]))

    for name in ("time_limit_warning", "scontrol_requeue", "node_lost"):
        assert_same_results(roots["two_nodes"], roots[name], STEPS)

    # Two nodes of one device each against one node of two: equal but for float32 reduction order.
    one, two = metrics(roots["one_node"]), metrics(roots["two_nodes"])
    assert one[schema.STEP].tolist() == two[schema.STEP].tolist() == list(STEPS)
    assert_equal_but_for_reduction_order(one, two)
