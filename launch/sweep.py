"""`python -m launch.sweep --configs 'configs/*_mnli.py' --backend slurm [--account A --partition P ...]`.

Turns configs x seeds x shot counts into jobs (docs/clusters.md). A job is
submitted only for runs that are unfinished (no final step in any
metrics.npz under the run's folder or the results root, so --per_run and
grouped sweeps resume each other) and free: not locked by a live process
(`oodjax.engine.run_lock`) nor in a job SLURM still lists, which the sweep
tags with its output directory (sbatch's --comment). A local or TPU job that
exits with `PREEMPTED_EXIT_CODE` stops the sweep, to be rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from ml_collections import config_dict

from launch.config_files import config_stem, experiment_config_paths, load_config
from oodjax import config_cli, config_read, usage_errors
from oodjax.engine import results, run_lock
from oodjax.engine.preemption import PREEMPTED_EXIT_CODE
from oodjax.engine.results import Run

BACKENDS = ("slurm", "tpu", "local")
LAUNCH_DIR = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class SweepJob:
    """One job of a sweep: a config's runs of these seeds and shots, in their own output directory."""

    name: str
    config_path: str
    seeds: tuple[int, ...]
    shots: tuple[int, ...]
    output_dir: str
    config_overrides: tuple[str, ...] = ()  # the sweep's --config.FIELD=VALUE, before the job's own

    @property
    def runs(self) -> int:
        return len(self.seeds) * len(self.shots)

    def overrides(self) -> list[str]:
        """Command-line settings that make the config train exactly this job's runs, in its own directory."""
        return [
            *self.config_overrides,
            f"--config.runs.seeds={_tuple_literal(self.seeds)}",
            f"--config.runs.shots={_tuple_literal(self.shots)}",
            f"--config.output_dir={self.output_dir}",
        ]


# The sbatch options the sweep passes through: its flag -> sbatch's (the same name, dashed).
SBATCH_OPTIONS = {
    flag: "--" + flag.replace("_", "-")
    for flag in ("partition", "time", "account", "qos", "gpus_per_node", "cpus_per_task")
}
# The time-limit warning's lead (SIGUSR1 to the batch shell, which checkpoints and requeues): a quarter of
# --time, at most launch/slurm.sbatch's own 10 minutes, at least SLURM's resolution of a minute.
TIME_LIMIT_WARNING_LEAD = 600
MINIMUM_LEAD = 60
QUEUED_TAG = "oodjax:"  # sbatch --comment=oodjax:<output_dir> names the jobs the sweep submitted


def plan_jobs(
    config_paths: Sequence[str],
    seeds: Sequence[int] | None = None,
    shots: Sequence[int] | None = None,
    output_dir: str | None = None,
    *,
    per_run: bool,
    config_overrides: Sequence[str] = (),
) -> list[SweepJob]:
    """The sweep's jobs, named after their config file (and run, with --per_run); None takes the config's own.

    An ``output_dir`` given is a root holding one directory per job.
    """
    jobs = []
    extra = tuple(config_overrides)
    for path in config_paths:
        stem = config_stem(path)
        config = _load(path, extra)
        config_seeds = tuple(seeds) if seeds is not None else tuple(config.runs.seeds)
        config_shots = tuple(shots) if shots is not None else tuple(config.runs.shots)
        grids = (
            [(f"{stem}_seed{seed}_shots{shot}", (seed,), (shot,)) for seed in config_seeds for shot in config_shots]
            if per_run
            else [(stem, config_seeds, config_shots)]
        )
        for name, job_seeds, job_shots in grids:
            directory = config.output_dir if output_dir is None else str(pathlib.Path(output_dir) / name)
            jobs.append(SweepJob(name, path, job_seeds, job_shots, directory, extra))
    return jobs


def _load(path: str, config_overrides: Sequence[str]) -> config_dict.ConfigDict:
    """The config file with the sweep's overrides applied (a bad one is a usage error, one line)."""
    config = load_config(path)
    config_cli.apply_overrides(config, config_overrides)
    return config


def job_plan(job: SweepJob) -> config_read.Job:
    """The job as its process will read it (``oodjax.config_read.read``)."""
    config = _load(job.config_path, job.config_overrides)
    config.runs.seeds = job.seeds
    config.runs.shots = job.shots
    config.output_dir = job.output_dir
    return config_read.read(config)


def run_finished(run: Run, final_step: int, output_dir: str | None) -> bool:
    """Whether a metrics.npz records the run's final step, in its folder or in any job directory under
    ``output_dir``, so a sweep resumed with or without --per_run finds the same runs finished."""
    candidates = {run.directory}
    if output_dir is not None:
        candidates.update(pathlib.Path(output_dir).glob(f"*/{run.name}"))
    for run_dir in sorted(candidates):
        try:
            progress = results.read_progress(run_dir)
        except results.UnreadableResultsError as error:
            print(f"warning: {error}; counting {run.name} as unfinished", file=sys.stderr)
            continue
        if progress is not None and progress.finished(final_step):
            return True
    return False


def unfinished_jobs(job: SweepJob, output_dir: str | None) -> list[SweepJob]:
    """Jobs for `job`'s unfinished runs: one per seeds x shots grid they form."""
    plan = job_plan(job)
    shots_by_seed: dict[int, list[int]] = {}
    unfinished = {
        run for group in plan.groups for run in group.runs if not run_finished(run, group.total_steps, output_dir)
    }
    for run in plan.runs.runs():
        if run in unfinished:
            shots_by_seed.setdefault(run.seed, []).append(run.shots)
    seeds_by_shots: dict[tuple[int, ...], list[int]] = {}
    for seed, shots in shots_by_seed.items():
        seeds_by_shots.setdefault(tuple(shots), []).append(seed)
    grids = list(seeds_by_shots.items())
    return [
        dataclasses.replace(
            job, name=job.name if len(grids) == 1 else f"{job.name}-{index}", seeds=tuple(seeds), shots=shots
        )
        for index, (shots, seeds) in enumerate(grids, start=1)
    ]


def busy_runs(job: SweepJob, queued: set[str]) -> str | None:
    """Why the job must not be submitted now (SLURM lists it in ``queued``, or a run is locked), or None."""
    if _tag(job) in queued:
        return f"a job in {job.output_dir} is queued or running"
    for run in job_plan(job).runs.runs():
        holder = run_lock.live_holder(run.directory)
        if holder is not None:
            return f"{run.name} is locked by {holder.describe(time.time())}"
    return None


def queued_jobs() -> set[str]:
    """The tags (sbatch --comment) of this user's jobs that SLURM lists: pending, running, requeued."""
    listed = subprocess.run(["squeue", "--me", "--noheader", "--format=%k"], capture_output=True, text=True)
    if listed.returncode != 0:
        raise usage_errors.UsageError(f"squeue failed, so queued jobs cannot be told apart: {listed.stderr.strip()}")
    return {line.strip() for line in listed.stdout.splitlines() if line.strip().startswith(QUEUED_TAG)}


def _tag(job: SweepJob) -> str:
    return QUEUED_TAG + str(pathlib.Path(job.output_dir).resolve())


def command(job: SweepJob, backend: str, *, nodes: int, sbatch_options: Sequence[str] = ()) -> list[str]:
    """The command that starts the job on the backend."""
    if backend == "local":
        return [sys.executable, "-m", "oodjax.main", f"--config={job.config_path}", *job.overrides()]
    if backend == "slurm":
        exported = [f"OODJAX_LAUNCH_DIR={LAUNCH_DIR}"]
        if not os.environ.get("OODJAX_VENV"):
            exported.append(f"OODJAX_PYTHON={sys.executable}")
        return [
            "sbatch",
            f"--job-name=oodjax-{job.name}",
            f"--nodes={nodes}",
            f"--output={job.output_dir}/slurm-%j.out",
            f"--comment={_tag(job)}",
            "--export=" + ",".join(["ALL", *exported]),
            *sbatch_options,
            str(LAUNCH_DIR / "slurm.sbatch"),
            job.config_path,
            *job.overrides(),
        ]
    if backend == "tpu":
        return ["bash", str(LAUNCH_DIR / "tpu_pod.sh"), job.config_path, *job.overrides()]
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def effective_sbatch_options(cmd: Sequence[str]) -> list[str]:
    """The options an sbatch line gives its job: the command's options override the script's
    `#SBATCH` lines, as sbatch's do."""
    script = next(index for index, word in enumerate(cmd) if word.endswith(".sbatch"))
    lines = pathlib.Path(cmd[script]).read_text().splitlines()
    in_script = [line.removeprefix("#SBATCH ").strip() for line in lines if line.startswith("#SBATCH ")]
    # One option a name, the command's after the script's replacing them.
    return list({option.split("=")[0]: option for option in [*in_script, *cmd[1:script]]}.values())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.sweep", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        required=True,
        help="config files or shell patterns; oodjax:NAME or oodjax:PATTERN for packaged configs",
    )
    parser.add_argument("--seeds", type=_int_list, help="comma-separated; default: each config's runs.seeds")
    parser.add_argument("--shots", type=_int_list, help="comma-separated; default: each config's runs.shots")
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument(
        "--output_dir",
        help="results root holding one directory per job, on storage every host reaches; "
        "default: each config's output_dir",
    )
    parser.add_argument("--per_run", action="store_true", help="one job per run instead of one per config")
    parser.add_argument("--nodes", type=int, default=1, help="SLURM nodes per job (default 1)")
    scheduler = parser.add_argument_group("SLURM options, passed to sbatch before the script (--backend slurm)")
    for flag, option in SBATCH_OPTIONS.items():
        scheduler.add_argument(f"--{flag}", help=f"sbatch {option}")
    scheduler.add_argument(
        "--sbatch_arg",
        action="append",
        default=[],
        metavar="OPTION",
        help="any other sbatch option, written with = (--sbatch_arg=--gres=gpu:8); repeatable",
    )
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    parser.epilog = "--config.FIELD=VALUE (repeatable) is passed to every job, as to python -m oodjax.main."
    args, config_overrides = parser.parse_known_args(argv)
    for override in config_overrides:
        if not re.fullmatch(r"--?(no)?config\..+", override, re.DOTALL):
            parser.error(f"unrecognized arguments: {override} (config fields are set as --config.FIELD=VALUE)")
    if args.nodes < 1:
        parser.error(f"--nodes must be at least 1, got {args.nodes}")
    try:
        sbatch_options = _sbatch_options(args)
    except ValueError as error:
        parser.error(str(error))
    with usage_errors.reported(parser.prog):  # no config matches, one cannot be read or refuses an override, squeue
        configs = experiment_config_paths(args.configs)
        jobs = plan_jobs(
            configs, args.seeds, args.shots, args.output_dir, per_run=args.per_run, config_overrides=config_overrides
        )
        queued = queued_jobs() if args.backend == "slurm" and shutil.which("squeue") else set()
    pending, skipped_runs, busy = [], 0, 0
    for job in jobs:
        with usage_errors.reported(parser.prog, config_spec=job.config_path):  # a config that cannot be read
            unfinished = unfinished_jobs(job, args.output_dir)
            reasons = [busy_runs(part, queued) for part in unfinished]
        done = job.runs - sum(part.runs for part in unfinished)
        skipped_runs += done
        if not unfinished:
            print(f"# skip {job.name}: its {done} runs are finished")
            continue
        for part, reason in zip(unfinished, reasons):
            if reason is not None:
                print(f"# skip {part.name}: {reason}")
                busy += part.runs
        remaining = [part for part, reason in zip(unfinished, reasons) if reason is None]
        if done and remaining:
            grids = "; ".join(f"seeds {_list(part.seeds)} x shots {_list(part.shots)}" for part in remaining)
            left = job.runs - done
            print(f"# {job.name}: {done} of {job.runs} runs finished; submitting the {left} unfinished ({grids})")
        pending += remaining

    if pending and args.backend == "slurm" and args.nodes > 1:
        print(multi_node_stop_note(args.nodes, sbatch_options))
    for job in pending:
        cmd = command(job, args.backend, nodes=args.nodes, sbatch_options=sbatch_options)
        if args.backend == "slurm":
            print(f"# sbatch {shlex.join(effective_sbatch_options(cmd))}")
        print(shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        pathlib.Path(job.output_dir).mkdir(parents=True, exist_ok=True)
        status = subprocess.run(cmd).returncode
        if status:
            checkpointed = "was stopped by a signal with its runs checkpointed; rerun the sweep to resume"
            why = checkpointed if status == PREEMPTED_EXIT_CODE else f"failed with exit code {status}"
            print(f"job {job.name} {why}", file=sys.stderr)
            return status

    summary = f"{sum(job.runs for job in pending)} runs in {len(pending)} jobs"
    if skipped_runs:
        summary += f" ({skipped_runs} finished runs skipped)"
    if busy:
        summary += f" ({busy} runs queued, running or locked left alone)"
    print(summary)
    return 0


def _sbatch_options(args: argparse.Namespace) -> list[str]:
    """The scheduler flags as sbatch options; a ValueError (one line) for one that cannot be passed."""
    given = [flag for flag in SBATCH_OPTIONS if getattr(args, flag) is not None]
    for flag in given:
        if not getattr(args, flag).strip():
            raise ValueError(f"--{flag} needs a value")
    for extra in args.sbatch_arg:
        if not extra.startswith("-") or not extra.strip("-"):
            raise ValueError(f"--sbatch_arg={extra}: not an sbatch option (write it whole: --sbatch_arg=--mem=0)")
    if (given or args.sbatch_arg) and args.backend != "slurm":
        names = [f"--{flag}" for flag in given] + (["--sbatch_arg"] if args.sbatch_arg else [])
        raise ValueError(
            f"{', '.join(names)}: SLURM options, passed to sbatch; --backend {args.backend} has no scheduler to "
            "take them (leave them out, or use --backend slurm)"
        )
    options = [f"{SBATCH_OPTIONS[flag]}={getattr(args, flag)}" for flag in given]
    if args.time is not None:
        seconds = time_limit_seconds(args.time)
        if seconds < 4 * MINIMUM_LEAD:
            raise ValueError(
                f"--time={args.time}: under 4 minutes, too short for the time-limit warning (a quarter of the "
                f"limit, at least SLURM's {MINIMUM_LEAD} s) to leave a step trained and checkpointed before it"
            )
        options.append(f"--signal=B:USR1@{min(TIME_LIMIT_WARNING_LEAD, seconds // 4)}")
    return options + list(args.sbatch_arg)


def multi_node_stop_note(nodes: int, sbatch_options: Sequence[str]) -> str:
    """The line a multi-node sweep prints first: with more than one task, srun answers a SIGTERM of its own with
    SIGKILL to the tasks, so the signal forms that reach srun stop the job without a checkpoint."""
    killing = [
        option
        for option in sbatch_options
        if (match := re.fullmatch(r"--signal=((?:[BR]+:)?)(?:SIG)?(TERM|15)(@\d+)?", option)) and "B" not in match[1]
    ]
    given = f"{', '.join(killing)} and " if killing else ""
    return (
        f"# {nodes} nodes: srun answers SIGTERM with SIGKILL, so {given}`scancel --signal=TERM --full JOB` stop "
        "these jobs without a checkpoint; `scancel --signal=TERM --batch JOB` (or USR1, which requeues) and "
        "--signal=B:USR1@SECONDS checkpoint"
    )


def time_limit_seconds(text: str) -> int:
    """sbatch's --time in seconds: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS; a ValueError else."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if match is None:
        raise ValueError(f"--time={text}: not a SLURM time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)")
    first = int(match.group(2))  # the one number always there
    days, second, third = (int(group) if group else None for group in match.group(1, 3, 4))
    if days is not None:  # D-HH[:MM[:SS]]
        return ((days * 24 + first) * 60 + (second or 0)) * 60 + (third or 0)
    if third is not None:  # HH:MM:SS (a third number follows a second)
        return (first * 60 + (second or 0)) * 60 + third
    if second is not None:  # MM:SS
        return first * 60 + second
    return first * 60  # minutes


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"repeated value in {text!r}")
    return values


def _list(values: Sequence[int]) -> str:
    return ",".join(str(value) for value in values)


def _tuple_literal(values: Sequence[int]) -> str:
    """`(1,2,)`: a tuple ``oodjax.config_cli`` reads, one word in the printed commands."""
    return "(" + ",".join(str(value) for value in values) + ",)"


if __name__ == "__main__":
    sys.exit(main())
