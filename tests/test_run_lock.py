"""One run, one writer: a second job on running runs stops before touching them, naming the first; stale locks
are taken over; of jobs taking one lock at once, exactly one wins.

The two-job test is the issue's: job A (`python -m oodjax.main`, the shrunk demo) is held still with SIGSTOP
once it trains, and job B, the same command, must exit with status 2 and one line naming the run and A,
having changed nothing on disk; A then finishes with the results of a job run alone. The other tests lock
folders in process: locks of another host (fresh or silent), of a process gone, of an earlier run of this
SLURM job; threads racing for one lock; the heartbeat; and the runs a job leaves out with runs.skip_locked.
"""

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from oodjax import evaluate
from oodjax.config_checks import check_config
from oodjax.config_read import read
from oodjax.engine import loop, results, run_lock
from oodjax.usage_errors import EXIT_STATUS
from tests.engine_configs import tiny_config
from tests.test_resume import assert_same_results, demo_config, demo_overrides, start_main, wait_until


def _tree(root):
    """Every path under ``root`` (itself included) with its size and modification time: what a job changed."""
    return {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in [root, *root.rglob("*")]}


def test_a_second_job_on_running_runs_stops_at_once_and_the_first_finishes_as_alone(tmp_path):
    cache = tmp_path / "cache"
    alone = demo_config(demo_overrides(tmp_path / "alone", cache, (0,)))
    loop.train(check_config(alone))
    job = demo_overrides(tmp_path / "out", cache, (0,))
    (run,) = read(demo_config(job)).runs.runs()

    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    with a_log.open("w") as log:
        a = start_main(job, log)
        try:
            wait_until(lambda: "train step: first call" in a_log.read_text(), a, a_log, "training")
            os.kill(a.pid, signal.SIGSTOP)  # A holds still, its heartbeat too: whatever changes now is B's doing
            before = _tree(tmp_path / "out")
            with b_log.open("w") as log_b:
                b = start_main(job, log_b)
                b.wait(timeout=300)
            assert _tree(tmp_path / "out") == before  # nothing written, created or deleted
        finally:
            os.kill(a.pid, signal.SIGCONT)
        a.wait(timeout=300)

    lines = [line for line in b_log.read_text().strip().splitlines() if "evaluated fewer than" not in line]
    assert b.returncode == EXIT_STATUS and len(lines) == 1, b_log.read_text()[-3000:]  # beside a 20-step job's warning
    assert lines[0].startswith(f"python -m oodjax.main: error: run {run.name} (")
    assert (
        f"is locked by another job that trains or evaluates it: process {a.pid} on {socket.gethostname()}" in (lines[0])
    )
    assert a.returncode == 0, a_log.read_text()[-3000:]
    assert not (run.directory / run_lock.LOCK_FILENAME).exists()
    assert_same_results(read(alone).runs.runs()[0], run)


def _lock_file(run_dir, **fields):
    """Writes a lock record as another job would, fresh and of another host unless ``fields`` say otherwise."""
    now = time.time()
    record = dict(
        host="node-elsewhere", pid=4321, slurm_job="987654", slurm_restart=0, taken=now, heartbeat=now, token="0" * 32
    )
    record.update(fields)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / run_lock.LOCK_FILENAME).write_text(json.dumps(record))
    return record


def _dead_pid():
    """The id of a process of this host that has exited."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.parametrize(
    "fields, reason",
    [
        (dict(host=socket.gethostname(), pid="dead"), "its process is gone"),
        (dict(heartbeat="11 min ago"), "no heartbeat for 11 min"),
        (dict(slurm_job="555", slurm_restart=0), "an earlier run of this SLURM job, requeued since"),
    ],
    ids=["process-gone", "old-heartbeat", "requeued"],
)
def test_a_stale_lock_is_taken_over_naming_its_holder(tmp_path, monkeypatch, caplog, fields, reason):
    monkeypatch.setenv("SLURM_JOB_ID", "555")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    if fields.get("pid") == "dead":
        fields = dict(fields, pid=_dead_pid())
    if fields.get("heartbeat") == "11 min ago":
        fields = dict(fields, heartbeat=time.time() - 11 * 60)
    old = _lock_file(tmp_path / "run", **fields)
    with caplog.at_level(logging.WARNING):
        lock = run_lock.try_lock(tmp_path / "run")
    assert isinstance(lock, run_lock.RunLock)
    assert f"taking over the stale lock of process {old['pid']} on {old['host']}" in caplog.text
    assert f"({reason})" in caplog.text
    assert json.loads((tmp_path / "run" / run_lock.LOCK_FILENAME).read_text())["token"] == lock.holder.token
    lock.release()
    assert not (tmp_path / "run" / run_lock.LOCK_FILENAME).exists()


@pytest.mark.parametrize(
    "fields",
    [dict(), dict(host=socket.gethostname(), pid=os.getpid()), dict(slurm_job="555", slurm_restart=1)],
    ids=["other-host", "live-process", "same-slurm-run"],  # the last: two job steps of one allocation
)
def test_a_live_lock_is_not_taken(tmp_path, monkeypatch, fields):
    monkeypatch.setenv("SLURM_JOB_ID", "555")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _lock_file(tmp_path / "run", **fields)
    before = _tree(tmp_path)
    holder = run_lock.try_lock(tmp_path / "run")
    assert isinstance(holder, run_lock.Holder) and holder.pid == fields.get("pid", 4321)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_of_jobs_taking_one_lock_at_once_exactly_one_wins(tmp_path, monkeypatch, links, stale):
    """Eight threads at a time, 20 times over, on a free folder or one with a stale lock; also where hard links
    are not supported (O_EXCL instead)."""
    if not links:

        def no_links(source, target):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(run_lock.os, "link", no_links)
    for attempt in range(20):
        folder = tmp_path / str(attempt) / "run"
        if stale:
            _lock_file(folder, heartbeat=time.time() - 3600)
        start = threading.Barrier(8)
        taken = []

        def take():
            start.wait()
            taken.append(run_lock.try_lock(folder))

        threads = [threading.Thread(target=take) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [lock for lock in taken if isinstance(lock, run_lock.RunLock)]
        assert len(winners) == 1, (attempt, taken)
        on_disk = json.loads((folder / run_lock.LOCK_FILENAME).read_text())
        assert on_disk["token"] == winners[0].holder.token
        # The losers saw the winner's record; with O_EXCL, perhaps the file before its record was written.
        seen = {holder.token for holder in taken if holder not in winners}
        assert seen == {winners[0].holder.token} if links else seen <= {winners[0].holder.token, ""}
        assert sorted(path.name for path in folder.iterdir()) == [run_lock.LOCK_FILENAME]  # no record left


def test_the_heartbeat_refreshes_the_locks_and_the_locks_go_with_the_job(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_SECONDS", 0.05)
    runs = [results.Run(seed, 8, f"run{seed}", tmp_path / "out" / f"run{seed}") for seed in (0, 1)]
    with run_lock.locked_runs(runs, skip_locked=False) as held:
        assert held == runs
        first = [json.loads((run.directory / run_lock.LOCK_FILENAME).read_text()) for run in runs]
        time.sleep(0.5)
        later = [json.loads((run.directory / run_lock.LOCK_FILENAME).read_text()) for run in runs]
    assert all(b["heartbeat"] > a["heartbeat"] and b["token"] == a["token"] for a, b in zip(first, later))
    assert not (tmp_path / "out").exists()  # the locks were all the job wrote: the folders they made go with them


def test_a_lock_taken_over_while_held_is_left_to_its_new_holder(tmp_path, caplog):
    lock = run_lock.try_lock(tmp_path / "run")
    other = _lock_file(tmp_path / "run")  # as if this job had been silent for ten minutes
    assert not lock.refresh()
    with caplog.at_level(logging.WARNING):
        lock.release()
    assert "not released, it is no longer this job's lock" in caplog.text
    assert json.loads((tmp_path / "run" / run_lock.LOCK_FILENAME).read_text()) == other


def test_a_job_stops_on_a_locked_run_writing_nothing_or_leaves_it_out_with_skip_locked(
    tmp_path, gpt2_tokenizer_dir, hf_data_dir, caplog
):
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    free, locked = read(config).runs.runs()
    _lock_file(locked.directory)
    before = _tree(tmp_path / "out")
    with pytest.raises(
        run_lock.RunLockedError,
        match=rf"^run {locked.name} \(.*\) is locked by another job that "
        r"trains or evaluates it: process 4321 on node-elsewhere, SLURM job 987654, heartbeat \d+ s "
        r"ago; wait for that job to end .* or set runs.skip_locked=True",
    ):
        loop.train(check_config(config))
    assert _tree(tmp_path / "out") == before  # the free run's folder, made for its lock, is gone again

    evaluation = config.copy_and_resolve_references()
    evaluation.eval.in_context = True
    icl_run = evaluate.plan_evaluation(read(evaluation))[1]
    _lock_file(icl_run.directory)
    with pytest.raises(run_lock.RunLockedError, match=rf"^run {icl_run.name} "):
        evaluate.evaluate_job(check_config(evaluation, evaluation=True))

    config.runs.skip_locked = True
    with caplog.at_level(logging.WARNING):
        assert loop.train(check_config(config)) == [free]
    assert f"left out (runs.skip_locked): run {locked.name}" in caplog.text
    assert sorted(path.name for path in locked.directory.iterdir()) == [run_lock.LOCK_FILENAME]
    assert (free.directory / "metrics.npz").is_file()
    assert not (free.directory / run_lock.LOCK_FILENAME).exists()


def test_the_other_processes_of_a_job_lock_nothing_and_follow_process_0(tmp_path, monkeypatch):
    """A process other than 0 takes no lock and stops (or leaves out) the runs that process 0 found locked."""
    runs = [results.Run(seed, 8, f"run{seed}", tmp_path / f"run{seed}") for seed in (0, 1)]
    monkeypatch.setattr(run_lock, "is_primary", lambda: False)
    monkeypatch.setattr(run_lock, "_agreed", lambda held: np.array([True, False]))  # process 0's answer
    with pytest.raises(
        run_lock.RunLockedError,
        match=r"^run run1 \(.*\) is locked by another job that trains or "
        "evaluates it: a holder that process 0 names",
    ):
        with run_lock.locked_runs(runs, skip_locked=False):
            pass
    with run_lock.locked_runs(runs, skip_locked=True) as held:
        assert held == runs[:1]
    assert list(tmp_path.iterdir()) == []
