"""The sweep generator: the study's grid as jobs, the commands it prints, resuming exactly the unfinished runs,
any glob over configs/."""

import json
import shlex

import numpy as np
import pytest
from absl import flags

from analysis import schema
from launch import sweep
from oodjax import config_cli
from oodjax.engine.preemption import PREEMPTED_EXIT_CODE

STUDY = ["--configs", "configs/*_mnli.py", "configs/*_snli.py"]


def run_sweep(capsys, *args):
    assert sweep.main(list(args)) == 0
    return capsys.readouterr().out.strip().splitlines()


def test_dry_run_of_the_whole_study_is_144_runs_in_16_jobs(capsys, tmp_path):
    lines = run_sweep(capsys, *STUDY, "--backend", "slurm", "--dry_run", "--output_dir", str(tmp_path))
    assert lines[-1] == "144 runs in 16 jobs"
    commands = [shlex.split(line) for line in lines[:-1] if not line.startswith("#")]
    assert len(commands) == 16 and all(command[0] == "sbatch" for command in commands)
    commands = [command[:4] + command[6:] for command in commands]  # less --comment and --export, tested apart
    configs = sorted(command[5] for command in commands)
    models = ("olmo13", "olmo32", "olmo7", "opt13", "opt2.7", "opt30", "opt6.7", "smol3")
    assert configs == sorted(f"configs/{m}_{t}.py" for m in models for t in ("mnli", "snli"))
    opt30 = next(command for command in commands if command[5] == "configs/opt30_mnli.py")
    assert opt30[:4] == [
        "sbatch",
        "--job-name=oodjax-opt30_mnli",
        "--nodes=1",
        f"--output={tmp_path}/opt30_mnli/slurm-%j.out",
    ]
    assert opt30[4].endswith("launch/slurm.sbatch")
    assert opt30[6:] == [
        "--config.runs.seeds=(0,42,99,)",
        "--config.runs.shots=(32,64,128,)",
        f"--config.output_dir={tmp_path}/opt30_mnli",
    ]
    assert not list(tmp_path.iterdir())  # a dry run creates nothing


def test_per_run_dry_run_is_one_job_per_run(capsys, tmp_path):
    lines = run_sweep(capsys, *STUDY, "--backend", "tpu", "--per_run", "--dry_run", "--output_dir", str(tmp_path))
    assert lines[-1] == "144 runs in 144 jobs"
    first = shlex.split(lines[0])
    assert first[0] == "bash" and first[1].endswith("launch/tpu_pod.sh")
    assert first[2:] == [
        "configs/olmo13_mnli.py",
        "--config.runs.seeds=(0,)",
        "--config.runs.shots=(32,)",
        f"--config.output_dir={tmp_path}/olmo13_mnli_seed0_shots32",
    ]


def test_local_command_line_sets_exactly_the_jobs_runs(capsys, tmp_path):
    lines = run_sweep(
        capsys,
        "--configs",
        "configs/smol3_snli.py",
        "--seeds",
        "7,8",
        "--shots",
        "16",
        "--backend",
        "local",
        "--dry_run",
        "--output_dir",
        str(tmp_path),
    )
    assert lines[-1] == "2 runs in 1 jobs"
    command = shlex.split(lines[0])
    assert command[1:3] == ["-m", "oodjax.main"]
    # Parse the arguments exactly as oodjax.main does (oodjax.config_cli).
    flag_values = flags.FlagValues()
    config_cli.define_config_flag(flag_values)
    config = config_cli.parse_command_line(["main", *command[3:]], flag_values)
    assert config.model.path == "HuggingFaceTB/SmolLM3-3B-Base" and config.data.train_set == "snli"
    assert tuple(config.runs.seeds) == (7, 8) and tuple(config.runs.shots) == (16,)
    assert config.output_dir == f"{tmp_path}/smol3_snli"


def write_metrics(run_directory, steps):
    run_directory.mkdir(parents=True)
    np.savez(
        run_directory / schema.METRICS_FILENAME,
        **{
            schema.STEP: np.array(steps),
            schema.TESTSETS: np.array(["mnli"]),
            schema.ACCURACY: np.full((len(steps), 1), 0.5),
            schema.TRAIN_LOSS: np.ones(len(steps)),
            schema.IN_DOMAIN: np.array("mnli"),
            schema.CONFIG: np.array(json.dumps({})),
        },
    )


def finish_job(root, name, *, final_step=500, skip=()):
    """Writes metrics.npz for the runs of a default-mode job, ending at `final_step`."""
    job = next(
        job for job in sweep.plan_jobs([f"configs/{name}.py"], (0, 42, 99), (32, 64, 128), str(root), per_run=False)
    )
    for run in sweep.job_plan(job).runs.runs():
        if (run.seed, run.shots) not in skip:
            write_metrics(run.directory, list(range(0, final_step + 1, 25)))


def test_resume_submits_exactly_the_unfinished_runs(capsys, tmp_path):
    finish_job(tmp_path, "opt30_mnli")  # all 9 runs finished
    finish_job(tmp_path, "olmo7_snli", skip={(42, 64)})  # 8 finished: only the ninth is submitted
    finish_job(tmp_path, "smol3_mnli", final_step=250)  # stopped half way: not finished
    finish_job(tmp_path, "opt13_snli", skip={(0, 32), (42, 64)})  # two runs left that are no grid: two jobs
    lines = run_sweep(capsys, *STUDY, "--backend", "local", "--dry_run", "--output_dir", str(tmp_path))
    assert lines[-1] == "120 runs in 16 jobs (24 finished runs skipped)"
    assert "# skip opt30_mnli: its 9 runs are finished" in lines
    assert "# olmo7_snli: 8 of 9 runs finished; submitting the 1 unfinished (seeds 42 x shots 64)" in lines
    assert (
        "# opt13_snli: 7 of 9 runs finished; submitting the 2 unfinished (seeds 0 x shots 32; seeds 42 x shots 64)"
        in lines
    )
    commands = [shlex.split(line) for line in lines if not line.startswith("#")][:-1]
    assert not any("configs/opt30_mnli.py" in command for command in commands)
    runs_of = {}
    for command in commands:
        runs_of.setdefault(command[3], []).append(command[4:])
    assert runs_of["--config=configs/olmo7_snli.py"] == [
        ["--config.runs.seeds=(42,)", "--config.runs.shots=(64,)", f"--config.output_dir={tmp_path}/olmo7_snli"]
    ]
    assert runs_of["--config=configs/opt13_snli.py"] == [
        ["--config.runs.seeds=(0,)", "--config.runs.shots=(32,)", f"--config.output_dir={tmp_path}/opt13_snli"],
        ["--config.runs.seeds=(42,)", "--config.runs.shots=(64,)", f"--config.output_dir={tmp_path}/opt13_snli"],
    ]
    assert runs_of["--config=configs/smol3_mnli.py"][0][:2] == [
        "--config.runs.seeds=(0,42,99,)",
        "--config.runs.shots=(32,64,128,)",
    ]

    # Per-run mode finds the same finished runs in the per-config job directories.
    lines = run_sweep(capsys, *STUDY, "--backend", "local", "--per_run", "--dry_run", "--output_dir", str(tmp_path))
    assert lines[-1] == "120 runs in 120 jobs (24 finished runs skipped)"
    assert "# skip olmo7_snli_seed0_shots32: its 1 runs are finished" in lines
    assert not any("olmo7_snli_seed42_shots64" in line for line in lines if line.startswith("# skip"))


def test_an_unreadable_metrics_file_is_named_and_its_run_counted_unfinished(capsys, tmp_path):
    finish_job(tmp_path, "opt13_snli")
    job = sweep.plan_jobs(["configs/opt13_snli.py"], (0, 42, 99), (32, 64, 128), str(tmp_path), per_run=False)[0]
    run = sweep.job_plan(job).runs.runs()[4]  # seed 42, 64 shots
    damaged = run.directory / schema.METRICS_FILENAME
    damaged.write_bytes(damaged.read_bytes()[:100])  # truncated
    assert (
        sweep.main(
            ["--configs", "configs/opt13_snli.py", "--backend", "slurm", "--dry_run", "--output_dir", str(tmp_path)]
        )
        == 0
    )
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines[-1] == "1 runs in 1 jobs (8 finished runs skipped)"
    assert "submitting the 1 unfinished (seeds 42 x shots 64)" in lines[0]
    assert f"warning: {damaged} is unreadable" in captured.err
    assert f"counting {run.name} as unfinished" in captured.err


def test_any_glob_over_configs_takes_the_experiment_configs_only(capsys, tmp_path):
    lines = run_sweep(
        capsys, "--configs", "configs/*.py", "--backend", "local", "--dry_run", "--output_dir", str(tmp_path)
    )
    assert lines[0] == (
        "# not experiment configs, skipped: configs/__init__.py (no get_config()), configs/base.py (its config "
        "names no model), configs/laptop_common.py (no get_config()), configs/models.py (no get_config())"
    )
    # The 16 of the study and 3 laptop configs (9 runs each), and the demo's own 2 runs (seeds 0,42 x shots 32).
    assert lines[-1] == "173 runs in 20 jobs"


def test_a_preempted_job_stops_the_sweep_for_a_rerun(capsys, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(
        sweep.subprocess,
        "run",
        lambda command: ran.append(command) or sweep.subprocess.CompletedProcess(command, PREEMPTED_EXIT_CODE),
    )
    status = sweep.main(
        [
            "--configs",
            "configs/opt13_snli.py",
            "configs/opt30_snli.py",
            "--backend",
            "local",
            "--output_dir",
            str(tmp_path),
        ]
    )
    assert status == PREEMPTED_EXIT_CODE and len(ran) == 1  # the second job is not started
    message = "job opt13_snli was stopped by a signal with its runs checkpointed; rerun the sweep to resume"
    assert message in capsys.readouterr().err


def test_everything_finished_runs_nothing(capsys, tmp_path):
    finish_job(tmp_path, "opt13_snli")
    lines = run_sweep(capsys, "--configs", "configs/opt13_snli.py", "--backend", "slurm", "--output_dir", str(tmp_path))
    assert lines[-1] == "0 runs in 0 jobs (9 finished runs skipped)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--configs", "configs/nothing_*.py", "--backend", "local"], "no config file matches"),
        (["--configs", "configs/opt13_snli.py", "--backend", "gcp"], "invalid choice"),
        (["--configs", "configs/opt13_snli.py", "--backend", "local", "--seeds", "0,x"], "comma-separated integers"),
        (["--configs", "configs/opt13_snli.py", "--backend", "local", "--shots", "32,32"], "repeated value"),
    ],
)
def test_bad_arguments_are_errors(capsys, args, message):
    with pytest.raises((SystemExit, FileNotFoundError)) as error:
        sweep.main(args)
    assert message in str(error.value) + capsys.readouterr().err
