"""What a scheduler's signals do to `python -m oodjax.main` without a scheduler: noted from the first
lines of the process (a warning while Python imports must not end it), SIGHUP a stop signal, and a stop
before any step trained exits 128 + the signal rather than 75, which launch/slurm.sbatch would requeue."""

import os
import signal
import subprocess
import sys
import time

from oodjax.engine import preemption

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sighup_is_a_stop_signal_noted_at_a_step_boundary():
    with preemption.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.1)
        assert stop.received == "SIGHUP" and stop.agreed()
        stopped = preemption.Preempted(0, ["run"], stop.received)
        stop.step_trained()
        trained = preemption.Preempted(1, ["run"], stop.received)
    assert stop.received is None  # acted on: the next job of this process starts afresh
    assert (stopped.trained, stopped.exit_code) == (False, 128 + signal.SIGHUP)
    assert (trained.trained, trained.exit_code) == (True, preemption.PREEMPTED_EXIT_CODE)


def test_a_warning_while_python_imports_stops_the_job_before_its_first_step(tmp_path):
    """SIGUSR1 while `python -m oodjax.main` imports (started with it ignored, as launch/slurm.sbatch starts
    it, so that none comes before Python's first lines): noted before the runs are even listed, acted on at
    the first step boundary: exit 128 + 10, not 75; the run checkpointed at step 0 and unlocked."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", JAX_PLATFORMS="cpu")
    arguments = [
        "--config=configs/demo.py",
        f"--config.output_dir={tmp_path / 'results'}",
        "--config.runs.seeds=0",
        "--config.data.eval_cap=16",
        "--config.data.testsets=mnli",
    ]
    ignoring = tmp_path / "ignoring"  # the wrapper ignores SIGUSR1 from here on, as Python starts
    wrapper = f'trap "" USR1 && touch {ignoring} && exec "$@"'
    command = ["bash", "-c", wrapper, "bash", sys.executable, "-m", "oodjax.main", *arguments]
    log_path = tmp_path / "log.txt"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        while process.poll() is None and not ignoring.exists():
            time.sleep(0.01)
        while process.poll() is None and "received SIGUSR1" not in log_path.read_text():
            process.send_signal(signal.SIGUSR1)
            time.sleep(0.3)
        process.wait(timeout=600)
    output = log_path.read_text()
    assert process.returncode == 128 + signal.SIGUSR1, output[-3000:]
    assert output.index("received SIGUSR1") < output.index("1 runs in"), output[-3000:]  # before JAX and the runs
    assert f"no step was trained before SIGUSR1: exit status {128 + signal.SIGUSR1}" in output
    (run_dir,) = (tmp_path / "results").iterdir()
    assert (run_dir / "checkpoints" / "0").is_dir()
    assert not (run_dir / "run.lock").exists()


def test_a_warning_while_python_shuts_down_does_not_end_a_finished_job(tmp_path):
    """SIGUSR1 after the work is done, while Python tears down what it holds (JAX's backends take seconds),
    after it has given every signal with a Python handler back its default, fatal action: the process still
    exits 0, where it used to die with 128 + 10 and launch/slurm.sbatch reported a finished job as failed."""
    script = tmp_path / "finished.py"
    script.write_text(
        "import os, signal\n"
        "from oodjax.engine import preemption\n"
        "preemption.hold_stop_signals()\n"
        "class Teardown:  # torn down with the module, as the backends are: after Python's signal handling ends\n"
        "    def __del__(self, kill=os.kill, pid=os.getpid()):\n"
        "        kill(pid, signal.SIGUSR1)\n"
        "teardown = Teardown()\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    finished = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr
