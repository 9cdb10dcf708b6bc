"""The launch scripts: syntax, shellcheck, and what they run, with sbatch's srun and gcloud replaced by recorders.

shellcheck is a system package (`apt-get install -y shellcheck`); without it
this file fails rather than skips.
"""

import os
import pathlib
import shutil
import stat
import subprocess

import pytest

from launch.estimate import MEMORY_FRACTION_DEFAULT
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


def test_slurm_script_runs_main_once_per_task_with_the_stated_layout(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_command(
        bin_dir,
        "srun",
        'printf "%s\\n" "$@" > "$RECORD"; echo "$OODJAX_PROCESSES_PER" >> "$RECORD"\n'
        'echo "$JAX_COMPILATION_CACHE_DIR" >> "$RECORD"\n',
    )
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RECORD=str(tmp_path / "srun.txt"),
        OODJAX_REPO=str(ROOT),
        OODJAX_VENV="/opt/venv",
        SLURM_JOB_ID="7",
    )
    env.pop("OODJAX_PROCESSES_PER", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    result = subprocess.run(
        ["bash", str(SCRIPTS[0]), "configs/opt30_mnli.py", "--config.runs.seeds=(0,42,)"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "srun.txt").read_text().splitlines() == [
        "--kill-on-bad-exit=0",
        "--wait=120",
        "/opt/venv/bin/python",
        "-m",
        "oodjax.main",
        "--config=configs/opt30_mnli.py",
        "--config.runs.seeds=(0,42,)",
        "per_node",
        f"{ROOT}/.cache/jax",
    ]


@pytest.mark.parametrize(
    "srun_body, requeued",
    [
        (f"exit {PREEMPTED_EXIT_CODE}\n", True),  # the tasks checkpointed on the time-limit warning (SIGUSR1)
        ("exit 1\n", False),  # a failure is not retried
        (f"kill -TERM $PPID; exit {PREEMPTED_EXIT_CODE}\n", False),  # scancel or preemption: SIGTERM to all
    ],
    ids=["time_limit_warning", "failure", "sigterm"],
)
def test_slurm_script_requeues_a_job_stopped_at_the_time_limit_warning_only(tmp_path, srun_body, requeued):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_command(bin_dir, "srun", srun_body)
    fake_command(bin_dir, "scontrol", 'printf "%s\\n" "$@" > "$RECORD"\n')
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RECORD=str(tmp_path / "scontrol.txt"),
        OODJAX_REPO=str(ROOT),
        OODJAX_VENV="/opt/venv",
        SLURM_JOB_ID="7",
    )
    result = subprocess.run(["bash", str(SCRIPTS[0]), "configs/opt30_mnli.py"], env=env, capture_output=True, text=True)
    assert result.returncode == (1 if srun_body.startswith("exit 1") else PREEMPTED_EXIT_CODE), result.stderr
    recorded = (tmp_path / "scontrol.txt").read_text().splitlines() if requeued else None
    assert (tmp_path / "scontrol.txt").exists() == requeued and recorded in (None, ["requeue", "7"])
    directives = [line for line in SCRIPTS[0].read_text().splitlines() if line.startswith("#SBATCH")]
    assert {"#SBATCH --signal=USR1@600", "#SBATCH --requeue", "#SBATCH --open-mode=append"} <= set(directives)


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


FRACTION_NAMES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


@pytest.mark.parametrize(
    "given, expected",
    [
        ({}, ["cuda", str(MEMORY_FRACTION_DEFAULT), "unset"]),  # the launcher's defaults, the estimate's fraction
        ({"JAX_PLATFORMS": "cuda,cpu", "XLA_CLIENT_MEM_FRACTION": "0.8"}, ["cuda,cpu", "0.8", "unset"]),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.7"}, ["cuda", "unset", "0.7"]),  # JAX refuses both names at once
    ],
    ids=["defaults", "exported", "deprecated_name"],
)
def test_slurm_script_exports_the_platform_and_memory_fraction(tmp_path, given, expected):
    """JAX_PLATFORMS=cuda makes a node whose GPUs JAX cannot use an error, not a CPU run; the memory fraction
    is the one launch.estimate and launch.preflight test fits against; what the user exported wins."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_command(
        bin_dir,
        "srun",
        'printf "%s\\n" "$JAX_PLATFORMS" "${XLA_CLIENT_MEM_FRACTION-unset}" '
        '"${XLA_PYTHON_CLIENT_MEM_FRACTION-unset}" > "$RECORD"\n',
    )
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", *FRACTION_NAMES)}
    env.update(
        given,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RECORD=str(tmp_path / "srun.txt"),
        OODJAX_REPO=str(ROOT),
        OODJAX_VENV="/opt/venv",
        SLURM_JOB_ID="7",
    )
    result = subprocess.run(["bash", str(SCRIPTS[0]), "configs/demo.py"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "srun.txt").read_text().splitlines() == expected


@pytest.mark.parametrize("given, expected", [(None, "tpu"), ("tpu,cpu", "tpu,cpu")], ids=["default", "exported"])
def test_tpu_script_makes_the_workers_use_the_tpu(tmp_path, given, expected):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_command(bin_dir, "gcloud", 'printf "%s\\n" "$@" > "$RECORD"\n')
    fake_command(bin_dir, "curl", "echo 0\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake_command(venv / "bin", "python", 'echo "$JAX_PLATFORMS"\n')
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
