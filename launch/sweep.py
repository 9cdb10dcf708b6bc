"""`python -m launch.sweep --configs 'configs/*_mnli.py' --seeds 0,42,99 --shots 32,64,128 --backend slurm`.

Turns configs x seeds x shot counts into jobs. By default one job per config
trains all its (seed, shots) runs together on one copy of the frozen base;
--per_run makes one job per run instead. Every job writes under its own
directory `<output_dir>/<job name>/` (its runs' results and the checkpoints
they share), so rerunning the same sweep resumes it: a job whose runs all
have their final step in a metrics.npz under the results root is skipped,
and any other job is submitted again and continues from its latest
checkpoint. Runs of one job train in lockstep, so they finish together.

Backends: `slurm` submits launch/slurm.sbatch with sbatch, `tpu` runs
launch/tpu_pod.sh once per job (one after another on the pod), `local` runs
`python -m oodjax.main` here, one job after another. --dry_run prints the
commands instead. The last line is always a summary like `144 runs in 16 jobs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
from ml_collections import config_dict

from analysis import schema
from launch.config_files import expand_config_paths, load_config
from oodjax.engine.loop import plan_runs

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


def plan_jobs(
    config_paths: Sequence[str], seeds: Sequence[int], shots: Sequence[int], output_dir: str, *, per_run: bool
) -> list[Job]:
    """The sweep's jobs, in config order; a job is named after its config file (and its run, with --per_run)."""
    jobs = []
    for path in config_paths:
        stem = pathlib.Path(path).stem
        if per_run:
            for seed in seeds:
                for shot in shots:
                    name = f"{stem}_seed{seed}_shots{shot}"
                    jobs.append(Job(name, path, (seed,), (shot,), str(pathlib.Path(output_dir) / name)))
        else:
            jobs.append(Job(stem, path, tuple(seeds), tuple(shots), str(pathlib.Path(output_dir) / stem)))
    return jobs


def job_config(job: Job) -> config_dict.ConfigDict:
    """The config the job's process will see: its file with the job's overrides applied."""
    config = load_config(job.config_path)
    config.runs.seeds = job.seeds
    config.runs.shots = job.shots
    config.output_dir = job.output_dir
    return config


def finished_runs(job: Job, output_dir: str) -> int:
    """How many of the job's runs have their final step recorded in a metrics.npz under `output_dir`.

    A run counts as finished in any job directory under the results root, so
    a sweep resumed with or without --per_run skips the same runs.
    """
    config = job_config(job)
    final_step = config.train.steps
    done = 0
    for run in plan_runs(config):
        for path in pathlib.Path(output_dir).glob(f"*/{run.name}/{schema.METRICS_FILENAME}"):
            with np.load(path) as metrics:
                if final_step in metrics[schema.STEP]:
                    done += 1
                    break
    return done


def command(job: Job, backend: str, *, nodes: int) -> list[str]:
    """The command that starts the job on the backend."""
    if backend == "local":
        return [sys.executable, "-m", "oodjax.main", f"--config={job.config_path}", *job.overrides()]
    if backend == "slurm":
        return [
            "sbatch", f"--job-name=oodjax-{job.name}", f"--nodes={nodes}",
            f"--output={job.output_dir}/slurm-%j.out",
            str(LAUNCH_DIR / "slurm.sbatch"), job.config_path, *job.overrides(),
        ]
    if backend == "tpu":
        return ["bash", str(LAUNCH_DIR / "tpu_pod.sh"), job.config_path, *job.overrides()]
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", required=True, help="config files or shell patterns")
    parser.add_argument("--seeds", type=_int_list, default=(0, 42, 99), help="comma-separated (default 0,42,99)")
    parser.add_argument("--shots", type=_int_list, default=(32, 64, 128), help="comma-separated (default 32,64,128)")
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--output_dir", default="results", help="results root, on storage every host reaches")
    parser.add_argument("--per_run", action="store_true", help="one job per run instead of one per config")
    parser.add_argument("--nodes", type=int, default=1, help="SLURM nodes per job (default 1)")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes must be at least 1, got {args.nodes}")

    jobs = plan_jobs(expand_config_paths(args.configs), args.seeds, args.shots, args.output_dir, per_run=args.per_run)
    pending, skipped_runs = [], 0
    for job in jobs:
        done = finished_runs(job, args.output_dir)
        if done == job.runs:
            skipped_runs += done
            print(f"# skip {job.name}: its {done} runs are finished")
            continue
        if done:
            print(f"# {job.name}: {done} of {job.runs} runs finished; the job runs again and resumes")
        pending.append(job)

    for job in pending:
        cmd = command(job, args.backend, nodes=args.nodes)
        print(shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        pathlib.Path(job.output_dir).mkdir(parents=True, exist_ok=True)
        completed = subprocess.run(cmd)
        if completed.returncode != 0:
            print(f"job {job.name} failed with exit code {completed.returncode}", file=sys.stderr)
            return completed.returncode

    summary = f"{sum(job.runs for job in pending)} runs in {len(pending)} jobs"
    if skipped_runs:
        summary += f" ({skipped_runs} finished runs skipped)"
    print(summary)
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"repeated value in {text!r}")
    return values


def _tuple_literal(values: Sequence[int]) -> str:
    """A Python tuple literal without spaces, as ml_collections parses `--config.x=(1,2,)`."""
    return "(" + ",".join(str(value) for value in values) + ",)"


if __name__ == "__main__":
    sys.exit(main())
