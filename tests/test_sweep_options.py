"""The sweep's options: a config's own seeds, shots and output folder unless --seeds, --shots or --output_dir
override them; SLURM options passed to sbatch before the script (and refused by the other backends);
packaged configs named as oodjax:NAME or oodjax:PATTERN."""

import json
import os
import shlex
import sys
import textwrap

import numpy as np
import pytest

from analysis import schema
from launch import sweep
from oodjax.engine import run_lock

OPT30 = "configs/opt30_mnli.py"


def own_config(tmp_path, seeds=(5, 6), shots=(8,)):
    """A config file of its own: the demo with its own seeds, shots and output_dir (under tmp_path)."""
    path = tmp_path / "own.py"
    path.write_text(
        textwrap.dedent(f"""
        from configs import demo

        def get_config():
            config = demo.get_config()
            config.runs.seeds = {tuple(seeds)!r}
            config.runs.shots = {tuple(shots)!r}
            config.output_dir = {str(tmp_path / "own_results")!r}
            return config
    """)
    )
    return str(path)


def dry_run(capsys, *args):
    assert sweep.main([*args, "--dry_run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return [shlex.split(line) for line in lines if not line.startswith("#")][:-1], lines


def overrides(command):
    return [argument for argument in command if argument.startswith("--config.")]


def test_without_seeds_shots_or_output_dir_each_config_trains_its_own(capsys, tmp_path):
    config = own_config(tmp_path)
    commands, lines = dry_run(capsys, "--configs", config, "--backend", "local")
    assert lines[-1] == "2 runs in 1 jobs"
    (command,) = commands
    assert overrides(command) == [
        "--config.runs.seeds=(5,6,)",
        "--config.runs.shots=(8,)",
        f"--config.output_dir={tmp_path / 'own_results'}",
    ]


def test_seeds_shots_and_output_dir_override_the_configs(capsys, tmp_path):
    config = own_config(tmp_path)
    commands, lines = dry_run(
        capsys,
        "--configs",
        config,
        "--backend",
        "local",
        "--seeds",
        "1,2,3",
        "--shots",
        "16",
        "--output_dir",
        str(tmp_path / "root"),
    )
    assert lines[-1] == "3 runs in 1 jobs"
    assert overrides(commands[0]) == [
        "--config.runs.seeds=(1,2,3,)",
        "--config.runs.shots=(16,)",
        f"--config.output_dir={tmp_path / 'root' / 'own'}",
    ]
    # One of the three alone: the other two stay the config's.
    commands, _ = dry_run(capsys, "--configs", config, "--backend", "local", "--shots", "16,32")
    assert overrides(commands[0]) == [
        "--config.runs.seeds=(5,6,)",
        "--config.runs.shots=(16,32,)",
        f"--config.output_dir={tmp_path / 'own_results'}",
    ]


def test_per_run_jobs_of_a_config_share_its_output_dir(capsys, tmp_path):
    config = own_config(tmp_path)
    commands, lines = dry_run(capsys, "--configs", config, "--backend", "slurm", "--per_run")
    assert lines[-1] == "2 runs in 2 jobs"
    assert [command[1] for command in commands] == [
        "--job-name=oodjax-own_seed5_shots8",
        "--job-name=oodjax-own_seed6_shots8",
    ]
    assert {overrides(command)[-1] for command in commands} == {f"--config.output_dir={tmp_path / 'own_results'}"}


def test_a_run_finished_in_the_configs_own_output_dir_is_skipped(capsys, tmp_path):
    config = own_config(tmp_path)
    (job,) = sweep.plan_jobs([config], per_run=False)
    finished = next(run for run in sweep.job_plan(job).runs.runs() if run.seed == 5)
    finished.directory.mkdir(parents=True)
    np.savez(
        finished.directory / schema.METRICS_FILENAME,
        **{
            schema.STEP: np.array([0, sweep.job_plan(job).groups[0].total_steps]),
            schema.TESTSETS: np.array(["mnli"]),
            schema.ACCURACY: np.full((2, 1), 0.5),
            schema.TRAIN_LOSS: np.ones(2),
            schema.IN_DOMAIN: np.array("mnli"),
            schema.CONFIG: np.array(json.dumps({})),
        },
    )
    commands, lines = dry_run(capsys, "--configs", config, "--backend", "local")
    assert lines[-1] == "1 runs in 1 jobs (1 finished runs skipped)"
    assert overrides(commands[0])[:2] == ["--config.runs.seeds=(6,)", "--config.runs.shots=(8,)"]


def test_slurm_options_go_to_sbatch_before_the_script(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("OODJAX_VENV", raising=False)
    commands, _ = dry_run(
        capsys,
        "--configs",
        OPT30,
        "--backend",
        "slurm",
        "--output_dir",
        str(tmp_path),
        "--account",
        "proj123",
        "--partition",
        "gpu",
        "--time",
        "2-00:00:00",
        "--qos",
        "high",
        "--sbatch_arg=--gres=gpu:8",
        "--sbatch_arg=--mem=0",
    )
    (command,) = commands
    script = next(i for i, argument in enumerate(command) if argument.endswith("launch/slurm.sbatch"))
    assert command[:script] == [
        "sbatch",
        "--job-name=oodjax-opt30_mnli",
        "--nodes=1",
        f"--output={tmp_path}/opt30_mnli/slurm-%j.out",
        f"--comment=oodjax:{tmp_path}/opt30_mnli",
        f"--export=ALL,OODJAX_LAUNCH_DIR={sweep.LAUNCH_DIR},OODJAX_PYTHON={sys.executable}",
        "--partition=gpu",
        "--time=2-00:00:00",
        "--account=proj123",
        "--qos=high",
        "--signal=B:USR1@600",  # the time-limit warning's lead: 10 minutes, as launch/slurm.sbatch's own
        "--gres=gpu:8",
        "--mem=0",
    ]
    assert command[script + 1] == OPT30


def test_without_slurm_options_sbatch_gets_none(capsys, tmp_path):
    commands, _ = dry_run(capsys, "--configs", OPT30, "--backend", "slurm", "--output_dir", str(tmp_path))
    assert commands[0][6].endswith("launch/slurm.sbatch")


@pytest.mark.parametrize("backend", ["tpu", "local"])
@pytest.mark.parametrize("option", [["--account", "a"], ["--partition=gpu"], ["--sbatch_arg=--mem=0"]])
def test_the_other_backends_refuse_slurm_options_in_one_line(capsys, backend, option):
    with pytest.raises(SystemExit) as exit_:
        sweep.main(["--configs", OPT30, "--backend", backend, "--dry_run", *option])
    assert exit_.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    flag = option[0].split("=")[0]
    assert message == (
        f"python -m launch.sweep: error: {flag}: SLURM options, passed to sbatch; --backend {backend} "
        "has no scheduler to take them (leave them out, or use --backend slurm)"
    )


@pytest.mark.parametrize(
    "argument, message",
    [
        ("--sbatch_arg=mem=0", "--sbatch_arg=mem=0: not an sbatch option"),
        ("--account=", "--account needs a value"),
    ],
)
def test_malformed_slurm_options_are_errors(capsys, argument, message):
    with pytest.raises(SystemExit):
        sweep.main(["--configs", OPT30, "--backend", "slurm", "--dry_run", argument])
    assert message in capsys.readouterr().err


def test_packaged_configs_by_name_and_pattern_keep_their_name_in_the_commands(capsys, tmp_path):
    commands, lines = dry_run(
        capsys, "--configs", "oodjax:opt30_*", "oodjax:opt13_mnli", "--backend", "slurm", "--output_dir", str(tmp_path)
    )
    assert lines[-1] == "27 runs in 3 jobs"
    assert [command[7] for command in commands] == ["oodjax:opt30_mnli", "oodjax:opt30_snli", "oodjax:opt13_mnli"]
    assert commands[0][1] == "--job-name=oodjax-opt30_mnli"
    assert overrides(commands[0])[-1] == f"--config.output_dir={tmp_path}/opt30_mnli"
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(["--configs", "oodjax:nothing_*", "--backend", "local", "--dry_run"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no config file matches 'oodjax:nothing_*'" in error


def test_config_overrides_go_to_every_job_and_the_plan_reads_them(capsys, tmp_path):
    """--config.FIELD=VALUE reaches each job before its own settings, and the sweep plans with it: a run whose
    metrics.npz holds step 3 is finished under --config.train.steps=3 (and not under the config's 50)."""
    config = own_config(tmp_path, seeds=(5,), shots=(8,))
    arguments = ["--configs", config, "--backend", "local", "--config.train.steps=3", "--config.train.warmup_steps=1"]
    commands, _ = dry_run(capsys, *arguments)
    assert overrides(commands[0]) == [
        "--config.train.steps=3",
        "--config.train.warmup_steps=1",
        "--config.runs.seeds=(5,)",
        "--config.runs.shots=(8,)",
        f"--config.output_dir={tmp_path / 'own_results'}",
    ]
    run_dir = tmp_path / "own_results" / "opt-tiny-random_mnli_seed5_shots8"
    run_dir.mkdir(parents=True)
    np.savez(
        run_dir / schema.METRICS_FILENAME, **{schema.STEP: np.array([0, 3]), schema.CONFIG: np.array(json.dumps({}))}
    )
    commands, lines = dry_run(capsys, *arguments)
    assert commands == [] and lines[-1] == "0 runs in 0 jobs (1 finished runs skipped)"
    commands, _ = dry_run(capsys, *arguments[:4])
    assert len(commands) == 1


def test_an_argument_that_is_neither_an_option_nor_a_config_field_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        sweep.main(["--configs", OPT30, "--backend", "local", "--dry_run", "--config_train.steps=3"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --config_train.steps=3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "time, seconds, lead",
    [("4", 240, 60), ("10:00", 600, 150), ("1:00:00", 3600, 600), ("1-00", 86400, 600), ("0-0:40:30", 2430, 600)],
)
def test_the_time_limit_warning_is_a_quarter_of_a_short_time_limit(capsys, tmp_path, time, seconds, lead):
    assert sweep.time_limit_seconds(time) == seconds
    commands, lines = dry_run(
        capsys, "--configs", OPT30, "--backend", "slurm", "--output_dir", str(tmp_path), "--time", time
    )
    assert f"--signal=B:USR1@{lead}" in commands[0]
    effective = next(line for line in lines if line.startswith("# sbatch ")).split()[2:]
    # the script's own #SBATCH lines, the command's winning: one warning, the command's
    assert [option for option in effective if option.startswith("--signal")] == [f"--signal=B:USR1@{lead}"]
    assert {"--ntasks-per-node=1", "--requeue", "--open-mode=append", f"--time={time}"} <= set(effective)
    assert not [option for option in effective if option.startswith(("--gpus", "--cpus", "--gres"))]


@pytest.mark.parametrize("time", ["3", "2:59", "1:00", "later"])
def test_a_time_limit_too_short_for_the_warning_or_unreadable_is_refused(capsys, time):
    with pytest.raises(SystemExit) as exit_:
        sweep.main(["--configs", OPT30, "--backend", "slurm", "--dry_run", "--time", time])
    assert exit_.value.code == 2
    assert f"--time={time}: " in capsys.readouterr().err


def test_the_jobs_get_the_sweeps_python_unless_a_venv_is_named(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OODJAX_VENV", "/shared/venv")
    commands, _ = dry_run(capsys, "--configs", OPT30, "--backend", "slurm", "--output_dir", str(tmp_path))
    assert f"--export=ALL,OODJAX_LAUNCH_DIR={sweep.LAUNCH_DIR}" in commands[0]


def test_runs_queued_running_or_locked_are_not_submitted_again(capsys, tmp_path, monkeypatch):
    """A job SLURM lists with the job's tag (its output directory) and a run locked by a live process each
    keep their job from being submitted; squeue's answer is read for this user only."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text(f'#!/bin/bash\n[[ "$*" == *--me* ]] || exit 1\necho "oodjax:{tmp_path}/opt30_mnli"\n')
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    configs = ["--configs", OPT30, "configs/opt13_mnli.py", "--backend", "slurm", "--output_dir", str(tmp_path)]
    commands, lines = dry_run(capsys, *configs)
    assert f"# skip opt30_mnli: a job in {tmp_path}/opt30_mnli is queued or running" in lines
    assert [command[1] for command in commands] == ["--job-name=oodjax-opt13_mnli"]
    assert lines[-1] == "9 runs in 1 jobs (9 runs queued, running or locked left alone)"

    run = sweep.job_plan(sweep.plan_jobs(["configs/opt13_mnli.py"], output_dir=str(tmp_path), per_run=False)[0])
    lock = run_lock.try_lock(next(iter(run.runs.runs())).directory)  # this process: alive
    try:
        commands, lines = dry_run(capsys, *configs)
    finally:
        lock.release()
    assert commands == [] and any(
        line.startswith("# skip opt13_mnli: opt13_mnli_seed0_shots32 is locked by process") for line in lines
    ), lines
