"""Reading runs' metrics.npz files under a results root, with clear errors for bad input.

`python -m analysis.runs RESULTS_DIR [--csv]` lists the runs at a glance: one
line per run with its model, training set, seed, shots, last step, whether
it finished, and its last in-domain and mean OOD accuracy.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from analysis import schema
from analysis.naming import ModelInfo, model_info

# Reading more files than this shows a progress bar (on stderr): a full sweep
# holds hundreds of runs on network storage, and a silent minute looks hung.
PROGRESS_MIN_FILES = 50

ACCURACY_COLUMNS = ("run", "model", "train_set", "seed", "shots", "step", "testset", "accuracy")


class ResultsError(ValueError):
    """A results root or a metrics.npz file that the analysis cannot use; says which and why."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's accuracies over its evaluation steps, and what identifies it."""

    path: pathlib.Path
    model: str
    train_set: str
    seed: int
    shots: int
    steps: np.ndarray
    accuracy: pd.DataFrame  # index: step; one column per testset
    in_domain: str
    config: dict[str, Any]  # the run's config as the engine stored it (JSON)
    model_info: ModelInfo  # family and size, read from `config`

    @property
    def name(self) -> str:
        return self.path.parent.name

    @property
    def ood_testsets(self) -> list[str]:
        """Testsets other than the in-domain one and the training set itself."""
        return [
            t for t in self.accuracy.columns if t not in (self.in_domain, schema.TRAIN_TESTSET)
        ]

    @property
    def planned_steps(self) -> int | None:
        """The config's train.steps, None when the config does not say."""
        steps = (self.config.get("train") or {}).get("steps")
        return None if steps is None else int(steps)

    @property
    def finished(self) -> bool:
        """Whether the last evaluation is at the planned last step."""
        return self.planned_steps is not None and int(self.steps[-1]) >= self.planned_steps


def find_runs(root: str | pathlib.Path) -> list[Run]:
    """Every run under `root` (searched recursively), sorted by model family, size, model,
    training set, shots and seed. Runs that share a model name must share its family and size."""
    root = pathlib.Path(root)
    if not root.is_dir():
        raise ResultsError(f"results root {root} is not a directory")
    paths = sorted(root.rglob(schema.METRICS_FILENAME))
    if not paths:
        raise ResultsError(f"no {schema.METRICS_FILENAME} under {root}: is it a results root?")
    progress = tqdm(paths, desc="reading runs", unit="run", file=sys.stderr,
                    disable=len(paths) <= PROGRESS_MIN_FILES)
    runs = [load_run(path) for path in progress]
    _check_one_model_per_name(runs)
    return sorted(runs, key=model_order_key)


def model_order_key(run: Run) -> tuple:
    """Family, then size numerically (unknown sizes last), then the rest of the run's identity."""
    size = run.model_info.size_billions
    return (run.model_info.family, math.inf if math.isnan(size) else size, run.model,
            run.train_set, run.shots, run.seed, run.name)


def accuracy_table(runs: Sequence[Run]) -> pd.DataFrame:
    """Every accuracy of every run in long form, one row per (run, step, testset):
    the columns of ACCURACY_COLUMNS, for plotting or modelling outside this package."""
    frames = []
    for run in runs:
        long = run.accuracy.melt(var_name="testset", value_name="accuracy", ignore_index=False)
        frames.append(
            long.reset_index().assign(
                run=run.name, model=run.model, train_set=run.train_set, seed=run.seed,
                shots=run.shots,
            )
        )
    return pd.concat(frames, ignore_index=True)[list(ACCURACY_COLUMNS)]


def runs_overview(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per run: identity, last step, whether it finished, and its accuracies at the
    last step (in-domain, and the mean over OOD testsets with an accuracy there)."""
    rows = []
    for run in runs:
        last = run.accuracy.iloc[-1]
        rows.append({
            "run": run.name,
            "model": run.model,
            "train_set": run.train_set,
            "seed": run.seed,
            "shots": run.shots,
            "last_step": int(run.steps[-1]),
            "planned_steps": run.planned_steps,
            "finished": run.finished,
            "in_domain_accuracy": last[run.in_domain],
            "mean_ood_accuracy": last[run.ood_testsets].mean(),
        })
    return pd.DataFrame(rows).astype({"planned_steps": "Int64"})


def main(argv: list[str] | None = None) -> int:
    """`python -m analysis.runs RESULTS_DIR [--csv]` (also the `oodjax-runs` command)."""
    parser = argparse.ArgumentParser(
        prog="python -m analysis.runs",
        description="List the runs under a results root: identity, progress, last accuracies.",
    )
    parser.add_argument("results_dir", type=pathlib.Path,
                        help="results root: <run>/metrics.npz files, searched recursively")
    parser.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    args = parser.parse_args(argv)
    try:
        overview = runs_overview(find_runs(args.results_dir))
    except ResultsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.csv:
        overview.to_csv(sys.stdout, index=False)
    else:
        print(overview.to_string(index=False, float_format="{:.3f}".format))
        finished = int(overview["finished"].sum())
        print(f"{len(overview)} runs, {finished} finished, {len(overview) - finished} not")
    return 0


def load_run(path: str | pathlib.Path) -> Run:
    """Read and validate one metrics.npz against analysis/schema.py."""
    path = pathlib.Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files if key in schema.REQUIRED_KEYS}
            keys = set(npz.files)
    except (OSError, ValueError) as error:
        raise ResultsError(f"{path}: not a readable npz file ({error})") from error
    missing = [key for key in schema.REQUIRED_KEYS if key not in keys]
    if missing:
        raise ResultsError(
            f"{path}: not a run's metrics (schema in analysis/schema.py): missing keys {missing}"
        )
    steps = arrays[schema.STEP]
    testsets = [str(t) for t in arrays[schema.TESTSETS]]
    accuracy = arrays[schema.ACCURACY]
    if steps.ndim != 1 or accuracy.shape != (len(steps), len(testsets)):
        raise ResultsError(
            f"{path}: accuracy has shape {accuracy.shape}, expected "
            f"[steps, testsets] = [{len(steps)}, {len(testsets)}]"
        )
    if len(steps) > 1 and np.any(np.diff(steps) <= 0):
        raise ResultsError(f"{path}: steps are not increasing: {steps.tolist()}")
    in_domain = str(arrays[schema.IN_DOMAIN])
    if in_domain not in testsets:
        raise ResultsError(
            f"{path}: the in-domain testset {in_domain!r} is not among its testsets "
            f"{testsets}; partial correlations need in-domain accuracy"
        )
    run_ood = [t for t in testsets if t not in (in_domain, schema.TRAIN_TESTSET)]
    if len(run_ood) < 2:
        raise ResultsError(
            f"{path}: OOD testsets {run_ood}: pairs of OOD testsets need at least two"
        )
    config, identity = _run_identity(path, str(arrays[schema.CONFIG]))
    return Run(
        path=path,
        model=identity[schema.RUN_MODEL],
        train_set=in_domain,
        seed=identity[schema.RUN_SEED],
        shots=identity[schema.RUN_SHOTS],
        steps=steps,
        accuracy=pd.DataFrame(accuracy, index=pd.Index(steps, name="step"), columns=testsets),
        in_domain=in_domain,
        config=config,
        model_info=model_info(config),
    )


def _run_identity(path: pathlib.Path, config_json: str) -> tuple[dict[str, Any], dict]:
    """The parsed config and its run section (model name, seed, shots), checked."""
    try:
        config = json.loads(config_json)
        section = config[schema.RUN_SECTION]
        identity = {
            schema.RUN_MODEL: str(section[schema.RUN_MODEL]),
            schema.RUN_SEED: int(section[schema.RUN_SEED]),
            schema.RUN_SHOTS: int(section[schema.RUN_SHOTS]),
        }
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ResultsError(
            f"{path}: its config must be JSON with an object {schema.RUN_SECTION!r} holding "
            f"{schema.RUN_MODEL!r}, {schema.RUN_SEED!r} and {schema.RUN_SHOTS!r} "
            f"({type(error).__name__}: {error})"
        ) from error
    if not identity[schema.RUN_MODEL]:
        raise ResultsError(f"{path}: config {schema.RUN_SECTION}.{schema.RUN_MODEL} is empty")
    return config, identity


def _check_one_model_per_name(runs: list[Run]) -> None:
    """Runs are grouped by model name: one name for two models would mix them silently."""
    seen: dict[str, Run] = {}
    for run in runs:
        first = seen.setdefault(run.model, run)
        identity = (run.model_info.family, run.model_info.size_label)  # NaN != NaN
        if (first.model_info.family, first.model_info.size_label) != identity:
            raise ResultsError(
                f"model name {run.model!r} stands for two models: {first.model_info} in "
                f"{first.path} and {run.model_info} in {run.path}; give them distinct "
                "config.model.name values"
            )


if __name__ == "__main__":
    sys.exit(main())
