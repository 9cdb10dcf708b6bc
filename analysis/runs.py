"""Reading runs' metrics.npz files under a results root, with clear errors for bad input."""

import dataclasses
import json
import pathlib

import numpy as np
import pandas as pd

from analysis import schema


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

    @property
    def name(self) -> str:
        return self.path.parent.name

    @property
    def ood_testsets(self) -> list[str]:
        """Testsets other than the in-domain one and the training set itself."""
        return [
            t for t in self.accuracy.columns if t not in (self.in_domain, schema.TRAIN_TESTSET)
        ]


def find_runs(root: str | pathlib.Path) -> list[Run]:
    """Every run under `root` (searched recursively), sorted by model, training set, shots, seed."""
    root = pathlib.Path(root)
    if not root.is_dir():
        raise ResultsError(f"results root {root} is not a directory")
    paths = sorted(root.rglob(schema.METRICS_FILENAME))
    if not paths:
        raise ResultsError(f"no {schema.METRICS_FILENAME} under {root}: is it a results root?")
    runs = [load_run(path) for path in paths]
    return sorted(runs, key=lambda r: (r.model, r.train_set, r.shots, r.seed, r.name))


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
    identity = _run_identity(path, str(arrays[schema.CONFIG]))
    return Run(
        path=path,
        model=identity[schema.RUN_MODEL],
        train_set=in_domain,
        seed=identity[schema.RUN_SEED],
        shots=identity[schema.RUN_SHOTS],
        steps=steps,
        accuracy=pd.DataFrame(accuracy, index=pd.Index(steps, name="step"), columns=testsets),
        in_domain=in_domain,
    )


def _run_identity(path: pathlib.Path, config_json: str) -> dict:
    try:
        section = json.loads(config_json)[schema.RUN_SECTION]
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
    return identity
