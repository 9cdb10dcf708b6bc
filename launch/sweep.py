"""`python -m launch.sweep --configs 'configs/*_mnli.py' --backend slurm [--account A --partition P ...]`.

Turns configs x seeds x shot counts into jobs. Each config trains its own
`runs.seeds` x `runs.shots` into its own `output_dir`, as `python -m
oodjax.main --config FILE` would; `--seeds`, `--shots` and `--output_dir`
override them for every config (`--output_dir ROOT` puts each job in a
directory of its own, `ROOT/<config or job name>/`). By default one job per
config trains all its (seed, shots) runs together on one copy of the frozen
base; --per_run makes one job per run instead. Each run has its own folder
holding its results and its own checkpoints, so rerunning the same sweep
resumes it run by run: a run with its final step in its metrics.npz (in its
folder, or with --output_dir in any job directory under ROOT) is finished,
and a job is submitted for exactly the unfinished runs (those of a config
that do not form one seeds x shots grid go in several jobs, one grid each),
which continue from their checkpoints. A metrics.npz that cannot be read is
named in a warning and its run counted unfinished.

--configs takes any glob, and packaged configs as `oodjax:NAME` or
`oodjax:PATTERN` (`oodjax:*_mnli`: the configs installed with the package,
`oodjax.config_cli.PACKAGED_PREFIX`); files that are not experiment configs
(the package's own modules, base.py's defaults) are listed as skipped
(`launch.config_files.experiment_configs`).

SLURM options go on sbatch's command line, before the script: --partition,
--time, --account, --qos, and --sbatch_arg=OPTION (repeatable) for any other
(`--sbatch_arg=--gres=gpu:8`, `--sbatch_arg=--mem=0`); the other backends
refuse them.

Backends: `slurm` submits launch/slurm.sbatch with sbatch, `tpu` runs
launch/tpu_pod.sh once per job (one after another on the pod), `local` runs
`python -m oodjax.main` here, one job after another; a local or TPU job
that exits with the preempted status (`oodjax.engine.preemption.PREEMPTED_EXIT_CODE`:
its runs checkpointed on SIGTERM/SIGUSR1) stops the sweep, to be rerun.
--dry_run prints the commands instead. The last line is always a summary
like `144 runs in 16 jobs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex
import subprocess
import sys
from collections.abc import Sequence

import oodjax.job
from launch.config_files import config_stem, experiment_config_paths, load_config
from oodjax import usage_errors
from oodjax.engine import results
from oodjax.engine.preemption import PREEMPTED_EXIT_CODE
from oodjax.engine.results import Run

BACKENDS = ("slurm", "tpu", "local")
LAUNCH_DIR = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    config_path: str
    seeds: tuple[int, ...]
    shots: tuple[int, ...]
    output_dir: str

    @property
    def runs(self) -> int:
        return len(self.seeds) * len(self.shots)

    def overrides(self) -> list[str]:
        """Command-line settings that make the config train exactly this job's runs, in its own directory."""
        return [
            f"--config.runs.seeds={_tuple_literal(self.seeds)}",
            f"--config.runs.shots={_tuple_literal(self.shots)}",
            f"--config.output_dir={self.output_dir}",
        ]


# The sbatch options the sweep passes through: its flag -> sbatch's.
SBATCH_OPTIONS = {"partition": "--partition", "time": "--time", "account": "--account", "qos": "--qos"}


def plan_jobs(
    config_paths: Sequence[str],
    seeds: Sequence[int] | None = None,
    shots: Sequence[int] | None = None,
    output_dir: str | None = None,
    *,
    per_run: bool,
) -> list[Job]:
    """The sweep's jobs, in config order; a job is named after its config file (and its run, with --per_run).

    ``seeds``, ``shots`` and ``output_dir`` None take each config's own
    (`runs.seeds`, `runs.shots`, its `output_dir` itself); an ``output_dir``
    given is a root holding one directory per job.
    """
    jobs = []
    for path in config_paths:
        stem = config_stem(path)
        config = None if seeds is not None and shots is not None and output_dir is not None else load_config(path)
        config_seeds = tuple(seeds) if seeds is not None else tuple(config.runs.seeds)
        config_shots = tuple(shots) if shots is not None else tuple(config.runs.shots)
        own_dir = config.output_dir if output_dir is None else None
        if per_run:
            for seed in config_seeds:
                for shot in config_shots:
                    name = f"{stem}_seed{seed}_shots{shot}"
                    jobs.append(Job(name, path, (seed,), (shot,), own_dir or str(pathlib.Path(output_dir) / name)))
        else:
            jobs.append(Job(stem, path, config_seeds, config_shots, own_dir or str(pathlib.Path(output_dir) / stem)))
    return jobs


def job_plan(job: Job) -> oodjax.job.Job:
    """The job as its process will resolve it: its config file with the job's overrides applied, read
    (``oodjax.job.read``) for its runs and their final step."""
    config = load_config(job.config_path)
    config.runs.seeds = job.seeds
    config.runs.shots = job.shots
    config.output_dir = job.output_dir
    return oodjax.job.read(config)


def run_finished(run: Run, final_step: int, output_dir: str | None) -> bool:
    """Whether the run has its final step recorded in a metrics.npz: in its own folder, or in any job
    directory under the results root `output_dir` (--output_dir; None: none).

    Any job directory, so a sweep resumed with or without --per_run finds
    the same runs finished. A metrics.npz that cannot be read is named in a
    warning and does not count.
    """
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


def unfinished_jobs(job: Job, output_dir: str | None) -> list[Job]:
    """Jobs that train exactly `job`'s unfinished runs, in its directory: one when they form a seeds x shots
    grid (all of them, say, or one seed's), else one per group of seeds that lack the same shot counts."""
    plan = job_plan(job)
    shots_by_seed: dict[int, list[int]] = {}
    for run in plan.runs.runs():
        if not run_finished(run, plan.total_steps(run.shots), output_dir):
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


def command(job: Job, backend: str, *, nodes: int, sbatch_options: Sequence[str] = ()) -> list[str]:
    """The command that starts the job on the backend; ``sbatch_options`` go to sbatch, before the script."""
    if backend == "local":
        return [sys.executable, "-m", "oodjax.main", f"--config={job.config_path}", *job.overrides()]
    if backend == "slurm":
        return [
            "sbatch",
            f"--job-name=oodjax-{job.name}",
            f"--nodes={nodes}",
            f"--output={job.output_dir}/slurm-%j.out",
            *sbatch_options,
            str(LAUNCH_DIR / "slurm.sbatch"),
            job.config_path,
            *job.overrides(),
        ]
    if backend == "tpu":
        return ["bash", str(LAUNCH_DIR / "tpu_pod.sh"), job.config_path, *job.overrides()]
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.sweep", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        required=True,
        help="config files or shell patterns; oodjax:NAME or oodjax:PATTERN for packaged configs",
    )
    parser.add_argument(
        "--seeds", type=_int_list, default=None, help="comma-separated; default: each config's runs.seeds"
    )
    parser.add_argument(
        "--shots", type=_int_list, default=None, help="comma-separated; default: each config's runs.shots"
    )
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument(
        "--output_dir",
        default=None,
        help="results root holding one directory per job, on storage every host reaches; "
        "default: each config's output_dir",
    )
    parser.add_argument("--per_run", action="store_true", help="one job per run instead of one per config")
    parser.add_argument("--nodes", type=int, default=1, help="SLURM nodes per job (default 1)")
    scheduler = parser.add_argument_group("SLURM options, passed to sbatch before the script (--backend slurm)")
    for flag, option in SBATCH_OPTIONS.items():
        scheduler.add_argument(f"--{flag}", default=None, help=f"sbatch {option}")
    scheduler.add_argument(
        "--sbatch_arg",
        action="append",
        default=[],
        metavar="OPTION",
        help="any other sbatch option, written with = (--sbatch_arg=--gres=gpu:8); repeatable",
    )
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes must be at least 1, got {args.nodes}")
    try:
        sbatch_options = _sbatch_options(args)
    except ValueError as error:
        parser.error(str(error))

    try:
        configs = experiment_config_paths(args.configs)
    except ValueError as error:
        parser.error(str(error))
    jobs = plan_jobs(configs, args.seeds, args.shots, args.output_dir, per_run=args.per_run)
    pending, skipped_runs = [], 0
    for job in jobs:
        with usage_errors.reported(parser.prog, config_spec=job.config_path):  # a config that cannot be read
            remaining = unfinished_jobs(job, args.output_dir)
        done = job.runs - sum(part.runs for part in remaining)
        skipped_runs += done
        if not remaining:
            print(f"# skip {job.name}: its {done} runs are finished")
            continue
        if done:
            grids = "; ".join(f"seeds {_list(part.seeds)} x shots {_list(part.shots)}" for part in remaining)
            unfinished = job.runs - done
            print(f"# {job.name}: {done} of {job.runs} runs finished; submitting the {unfinished} unfinished ({grids})")
        pending += remaining

    for job in pending:
        cmd = command(job, args.backend, nodes=args.nodes, sbatch_options=sbatch_options)
        print(shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        pathlib.Path(job.output_dir).mkdir(parents=True, exist_ok=True)
        completed = subprocess.run(cmd)
        if completed.returncode == PREEMPTED_EXIT_CODE:
            print(
                f"job {job.name} was stopped by a signal with its runs checkpointed; rerun the sweep to resume",
                file=sys.stderr,
            )
            return completed.returncode
        if completed.returncode != 0:
            print(f"job {job.name} failed with exit code {completed.returncode}", file=sys.stderr)
            return completed.returncode

    summary = f"{sum(job.runs for job in pending)} runs in {len(pending)} jobs"
    if skipped_runs:
        summary += f" ({skipped_runs} finished runs skipped)"
    print(summary)
    return 0


def _sbatch_options(args: argparse.Namespace) -> list[str]:
    """The scheduler flags given, as sbatch options, in the order of ``SBATCH_OPTIONS`` then --sbatch_arg's;
    a ValueError (one line) for an empty value, an --sbatch_arg that is not an option, or a backend other
    than SLURM."""
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
    return [f"{SBATCH_OPTIONS[flag]}={getattr(args, flag)}" for flag in given] + list(args.sbatch_arg)


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
    """A Python tuple literal without spaces (`(1,2,)`, one item `(1,)`), one of the list forms
    ``oodjax.config_cli`` reads `--config.runs.seeds=` in, and one word in the commands the sweep prints."""
    return "(" + ",".join(str(value) for value in values) + ",)"


if __name__ == "__main__":
    sys.exit(main())
