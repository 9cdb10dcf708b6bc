"""The launch scripts: syntax, shellcheck, and what they run, with sbatch's srun and gcloud replaced by recorders.

shellcheck is a system package (`apt-get install -y shellcheck`); without it
this file fails rather than skips.
"""

import os
import pathlib
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from launch.devices import MEMORY_FRACTION_DEFAULT
from oodjax.engine.preemption import PREEMPTED_EXIT_CODE

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "launch" / "slurm.sbatch", ROOT / "launch" / "tpu_pod.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_bash_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_shellcheck_clean(script):
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed: apt-get install -y shellcheck"
    result = subprocess.run(  # -x from the root: follows the `source launch/xla_flags.sh` they share
        [shellcheck, "-x", "--shell=bash", str(script)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


def fake_command(directory: pathlib.Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def slurm_env(tmp_path: pathlib.Path, python_body: str, **variables: str) -> dict[str, str]:
    """The environment of a batch script whose Python is a recorder (`-c` probes for the CUDA build exit
    with $CUDA_PROBE), srun and scontrol record too; the job's own SLURM, JAX and CUDA variables cleared."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake_command(bin_dir, "srun", 'printf "%s\\n" srun "$@" "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK-}" > "$RECORD"\n')
    fake_command(bin_dir, "scontrol", 'printf "%s\\n" "$@" > "$RECORD.scontrol"\n')
    fake_command(bin_dir, "python", 'if [[ $1 == -c ]]; then exit "${CUDA_PROBE:-1}"; fi\n' + python_body)
    cleared = ("SLURM_", "JAX_", "XLA_", "CUDA_", "NCCL_", "OODJAX_", "SRUN_")
    env = {key: value for key, value in os.environ.items() if not key.startswith(cleared)}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RECORD=str(tmp_path / "record.txt"),
        OODJAX_REPO=str(ROOT),
        OODJAX_PYTHON=str(bin_dir / "python"),
        SLURM_JOB_ID="7",
    )
    env.update(variables)
    return env


def run_slurm_script(env: dict[str, str], *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS[0]), *arguments], env=env, capture_output=True, text=True)


def test_slurm_script_runs_one_task_directly_and_more_under_srun_with_their_cpus(tmp_path):
    """One task: Python is the batch shell's own child, so no srun answers a signal with SIGKILL. More: srun,
    told the CPUs each task has (Slurm 22.05 to 23.02 do not pass --cpus-per-task on to srun)."""
    record = 'printf "%s\\n" "$@" "$OODJAX_PROCESSES_PER" "$JAX_COMPILATION_CACHE_DIR" > "$RECORD"\n'
    arguments = ["configs/opt30_mnli.py", "--config.runs.seeds=(0,42,)"]
    result = run_slurm_script(slurm_env(tmp_path, record), *arguments)
    assert result.returncode == 0, result.stderr
    expected = ["-m", "oodjax.main", "--config=configs/opt30_mnli.py", "--config.runs.seeds=(0,42,)"]
    assert (tmp_path / "record.txt").read_text().splitlines() == [*expected, "per_node", f"{ROOT}/.cache/jax"]

    env = slurm_env(tmp_path, record, SLURM_NTASKS="2", SLURM_CPUS_PER_TASK="12", SLURM_JOB_NUM_NODES="2")
    result = run_slurm_script(env, *arguments)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "record.txt").read_text().splitlines() == [
        "srun",
        "--kill-on-bad-exit=0",
        "--wait=120",
        str(tmp_path / "bin" / "python"),
        *expected,
        "SRUN_CPUS_PER_TASK=12",
    ]


# The task's side, as a Python that installed its handlers: waits for a forwarded signal, then exits as
# oodjax.main does (75 once a step is trained, 128 + the signal before).
TASK = (
    "exec {python} -c 'import signal, sys, time\n"
    "got = []\n"
    "for number in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(number, lambda number, frame: got.append(number))\n"
    'open(sys.argv[1], "w").close()\n'
    "while not got: time.sleep(0.05)\n"
    'open(sys.argv[1], "w").write(signal.Signals(got[0]).name)\n'
    'sys.exit(int(sys.argv[2]) if sys.argv[2] else 128 + got[0])\' "$RECORD.task" "$EXIT"\n'
)


@pytest.mark.parametrize(
    "sent, exit_status, requeued",
    [
        ("USR1", str(PREEMPTED_EXIT_CODE), True),  # the time-limit warning (--signal=B:USR1), a step trained
        ("USR1", "", False),  # the warning before any step: requeued it would only loop
        ("TERM", str(PREEMPTED_EXIT_CODE), False),  # scancel --batch/--full, a CANCEL-mode preemption
        ("HUP", str(PREEMPTED_EXIT_CODE), False),
        ("USR1", "1", False),  # a failure is not retried
        ("USR1", "137", False),  # killed (out of memory, say) after the warning: not said to have trained no step
    ],
    ids=["warning", "warning_no_step", "sigterm", "sighup", "failure", "killed"],
)
def test_slurm_script_forwards_signals_and_requeues_after_the_time_limit_warning_only(
    tmp_path, sent, exit_status, requeued
):
    env = slurm_env(tmp_path, TASK.format(python=sys.executable), EXIT=exit_status)
    script = subprocess.Popen(["bash", str(SCRIPTS[0]), "configs/demo.py"], env=env, stderr=subprocess.PIPE, text=True)
    task = pathlib.Path(env["RECORD"] + ".task")
    deadline = time.monotonic() + 30
    while not task.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    script.send_signal(getattr(signal, f"SIG{sent}"))
    _, stderr = script.communicate(timeout=30)
    assert task.read_text() == f"SIG{sent}"  # the task got the shell's signal
    expected = int(exit_status) if exit_status else 128 + getattr(signal, f"SIG{sent}")
    assert script.returncode == expected, stderr
    scontrol = pathlib.Path(env["RECORD"] + ".scontrol")
    assert scontrol.exists() == requeued
    if requeued:
        assert scontrol.read_text().splitlines() == ["requeue", "7"]
    assert ("the time-limit warning came but the job trained no step" in stderr) == (not exit_status), stderr
    directives = [line for line in SCRIPTS[0].read_text().splitlines() if line.startswith("#SBATCH")]
    assert {"#SBATCH --signal=B:USR1@600", "#SBATCH --requeue", "#SBATCH --open-mode=append"} <= set(directives)
    assert not [line for line in directives if re.search(r"--(gpus|cpus|gres|time|mem)", line)]


def test_slurm_script_without_a_config_is_a_usage_error():
    result = subprocess.run(["bash", str(SCRIPTS[0])], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: sbatch launch/slurm.sbatch CONFIG" in result.stderr


def test_tpu_script_sends_one_command_that_every_worker_runs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # gcloud records its arguments; the command it would send is then run here, as worker 1 would.
    fake_command(bin_dir, "gcloud", 'printf "%s\\n" "$@" > "$RECORD"\n')
    fake_command(
        bin_dir,
        "curl",
        'case "${@: -1}" in\n'
        "  */agent-worker-number) echo 1 ;;\n"
        '  */worker-network-endpoints) echo "w0:u0:10.0.0.2,w1:u1:10.0.0.3" ;;\n'
        "  *) exit 22 ;;\nesac\n",
    )
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake_command(
        venv / "bin",
        "python",
        'echo "$TPU_WORKER_ID|$TPU_WORKER_HOSTNAMES|$OODJAX_PROCESSES_PER|$OODJAX_DATA_DIR|$PWD"\n'
        'echo "$JAX_COMPILATION_CACHE_DIR"\n'
        'echo "$LIBTPU_INIT_ARGS"\n'
        'printf "%s\\n" "$@"\n',
    )
    (tmp_path / "launch").mkdir()  # the worker's checkout (OODJAX_REPO) holds the flags file
    shutil.copy(ROOT / "launch" / "xla_flags.sh", tmp_path / "launch")
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RECORD=str(tmp_path / "gcloud.txt"),
        TPU_NAME="pod",
        TPU_ZONE="us-central2-b",
        OODJAX_REPO=str(tmp_path),
        OODJAX_VENV=str(venv),
        OODJAX_DATA_DIR="/data/with space",
    )
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    arguments = ["configs/olmo32_snli.py", "--config.runs.shots=(32,)", "--config.output_dir=gs://b/r s"]
    result = subprocess.run(["bash", str(SCRIPTS[1]), *arguments], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

    recorded = (tmp_path / "gcloud.txt").read_text()
    head, command = recorded.split("--command=", 1)
    assert head.splitlines() == ["compute", "tpus", "tpu-vm", "ssh", "pod", "--zone=us-central2-b", "--worker=all"]
    worker_env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TPU_", "OODJAX_", "JAX_COMPILATION_CACHE_DIR"))
    }
    worker_env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    worker = subprocess.run(["bash", "-c", command], env=worker_env, capture_output=True, text=True)
    assert worker.returncode == 0, worker.stderr
    lines = worker.stdout.splitlines()
    assert lines[0] == f"1|10.0.0.2,10.0.0.3|per_node|/data/with space|{tmp_path}"
    assert lines[1] == f"{tmp_path}/.cache/jax"
    assert "--xla_tpu_overlap_compute_collective_tc=true" in lines[2]  # launch/xla_flags.sh, sourced
    assert lines[3:] == ["-m", "oodjax.main", "--config=configs/olmo32_snli.py", *arguments[1:]]


def test_tpu_script_needs_the_pod_name(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TPU_NAME"}
    result = subprocess.run(["bash", str(SCRIPTS[1]), "configs/demo.py"], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "set TPU_NAME" in result.stderr


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"SLURM_GPUS_ON_NODE": "8"}, ["cuda", str(MEMORY_FRACTION_DEFAULT), "unset", "WARN"]),  # the estimate's
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, ["cuda", str(MEMORY_FRACTION_DEFAULT), "unset", "WARN"]),
        ({}, ["cpu", "unset", "unset", "unset"]),  # no GPU allocated: a CPU run, said so
        (
            {"SLURM_GPUS_ON_NODE": "8", "JAX_PLATFORMS": "cuda,cpu", "XLA_CLIENT_MEM_FRACTION": "0.8"},
            ["cuda,cpu", "0.8", "unset", "WARN"],
        ),
        ({"SLURM_GPUS_ON_NODE": "8", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.7"}, ["cuda", "unset", "0.7", "WARN"]),
        (
            {"SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NUM_NODES": "2", "NCCL_IB_HCA": "mlx5"},
            ["cuda", str(MEMORY_FRACTION_DEFAULT), "unset", "INFO"],
        ),
    ],
    ids=["gpus", "visible_devices", "cpu_node", "exported", "deprecated_name", "nodes"],
)
def test_slurm_script_takes_the_platform_from_the_allocation(tmp_path, given, expected):
    """JAX_PLATFORMS follows what SLURM allocated (cuda for GPUs, never a silent CPU fallback; cpu on a CPU
    node); on GPUs the memory fraction is the one launch.estimate tests fits against, and NCCL logs its
    network on more than one node; what the user exported wins."""
    body = (
        'printf "%s\\n" "$JAX_PLATFORMS" "${XLA_CLIENT_MEM_FRACTION-unset}" '
        '"${XLA_PYTHON_CLIENT_MEM_FRACTION-unset}" "${NCCL_DEBUG-unset}" > "$RECORD"\n'
    )
    result = run_slurm_script(slurm_env(tmp_path, body, CUDA_PROBE="0", **given), "configs/demo.py")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "record.txt").read_text().splitlines() == expected
    assert f"JAX_PLATFORMS={expected[0]}," in result.stdout
    if "NCCL_IB_HCA" in given:  # NCCL's settings, logged at start
        assert "oodjax: NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_IB_HCA=mlx5\n" in result.stdout


def test_slurm_script_on_gpus_without_a_cuda_jax_says_what_to_install(tmp_path):
    result = run_slurm_script(slurm_env(tmp_path, "exit 0\n", SLURM_GPUS_ON_NODE="4"), "configs/demo.py")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"oodjax: JAX_PLATFORMS=cuda on 4 GPU(s), but {tmp_path}/bin/python has no CUDA build of JAX: "
        "make install-gpu into OODJAX_VENV (or set JAX_PLATFORMS=cpu)"
    ]


def test_slurm_script_finds_the_flags_file_beside_the_sweeps_launchers(tmp_path):
    """From a `pip install .`: no launch/ in the submit directory; the sweep names its own (OODJAX_LAUNCH_DIR)."""
    env = slurm_env(tmp_path, 'echo "$XLA_FLAGS" > "$RECORD"\n', OODJAX_REPO=str(tmp_path))
    result = run_slurm_script(env, "configs/demo.py")
    assert result.returncode != 0 and "launch/xla_flags.sh" in result.stderr
    env["OODJAX_LAUNCH_DIR"] = str(ROOT / "launch")
    result = run_slurm_script(env, "configs/demo.py")
    assert result.returncode == 0, result.stderr
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in (tmp_path / "record.txt").read_text()


def fake_tpu_pod(tmp_path: pathlib.Path, python_body: str) -> tuple[pathlib.Path, dict[str, str]]:
    """launch/tpu_pod.sh's world in `tmp_path`: a gcloud that records its arguments in $RECORD, a curl, a venv
    whose python runs `python_body`, the flags file; returns the fakes' folder and the script's environment
    (JAX_PLATFORMS unset)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_command(bin_dir, "gcloud", 'printf "%s\\n" "$@" > "$RECORD"\n')
    fake_command(bin_dir, "curl", "echo 0\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake_command(venv / "bin", "python", python_body)
    (tmp_path / "launch").mkdir()
    shutil.copy(ROOT / "launch" / "xla_flags.sh", tmp_path / "launch")
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RECORD=str(tmp_path / "gcloud.txt"),
        TPU_NAME="pod",
        TPU_ZONE="us-central2-b",
        OODJAX_REPO=str(tmp_path),
        OODJAX_VENV=str(venv),
    )
    return bin_dir, env


@pytest.mark.parametrize("given, expected", [(None, "tpu"), ("tpu,cpu", "tpu,cpu")], ids=["default", "exported"])
def test_tpu_script_makes_the_workers_use_the_tpu(tmp_path, given, expected):
    bin_dir, env = fake_tpu_pod(tmp_path, 'echo "$JAX_PLATFORMS"\n')
    if given:
        env["JAX_PLATFORMS"] = given
    result = subprocess.run(["bash", str(SCRIPTS[1]), "configs/demo.py"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    command = (tmp_path / "gcloud.txt").read_text().split("--command=", 1)[1]
    worker_env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    worker_env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    worker = subprocess.run(["bash", "-c", command], env=worker_env, capture_output=True, text=True)
    assert worker.returncode == 0, worker.stderr
    assert worker.stdout.splitlines() == [expected]


def test_tpu_workers_outlive_the_ssh_session_that_started_them(tmp_path):
    """A dropped SSH session sends SIGHUP to its processes: the worker's Python, in a session of its own, goes
    on (and on its own SIGHUP would checkpoint, oodjax.engine.preemption)."""
    _, env = fake_tpu_pod(tmp_path, 'echo started; sleep 2; echo trained > "$RECORD.outlived"\n')
    assert subprocess.run(["bash", str(SCRIPTS[1]), "configs/demo.py"], env=env).returncode == 0
    command = (tmp_path / "gcloud.txt").read_text().split("--command=", 1)[1]
    session = subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.PIPE, start_new_session=True)
    assert session.stdout.readline() == b"started\n"  # the worker's log, followed by the session
    os.killpg(session.pid, signal.SIGHUP)  # the SSH session drops
    session.wait(timeout=10)
    assert session.returncode == -signal.SIGHUP
    deadline = time.monotonic() + 30
    while not (tmp_path / "gcloud.txt.outlived").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "gcloud.txt.outlived").read_text() == "trained\n"
    assert (tmp_path / ".cache" / "tpu_pod" / "worker-0.log").read_text() == "started\n"
