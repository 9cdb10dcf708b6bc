"""Reading runs' metrics.npz files under a results root, with clear errors for bad input.

`python -m analysis.runs RESULTS_DIR [--csv]` lists the runs at a glance: one
line per run with its model, training set, seed, shots, kind (trained, or
evaluated without training by `oodjax.evaluate`: the base model, an adapter,
in context), last step, whether it finished, its last in-domain and mean
OOD accuracy, and its in-domain reliability (`in_domain_reliability`). An
evaluation-only run is finished once written: its one evaluation, at step 0,
is all it has. A trained run whose in-domain accuracy is mostly measurement
noise (reliability below FLAT_MAX_RELIABILITY) is flat: named in a warning
and counted in the last line; so is a near-constant OOD series
(NEAR_CONSTANT_SHARE).

What is skipped and what is an error: a metrics.npz whose bytes cannot be read
as a complete npz (empty, truncated by a job killed while copying it,
corrupt) is skipped with a warning and its run counts as unfinished, since
that is what a crashed or interrupted job leaves behind. A readable file that
breaks the schema, or one run found twice with different contents, is an
error: those come from a bug or a mix-up that no analysis should paper over.
"""

import argparse
import dataclasses
import filecmp
import functools
import json
import math
import os
import pathlib
import sys
import warnings
import zipfile
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from analysis import schema
from analysis.measurement_error import MIN_RELIABILITY, reliability
from analysis.naming import ModelInfo, model_info

# Reading more files than this shows a progress bar (on stderr): a full sweep
# holds hundreds of runs on network storage, and a silent minute looks hung.
PROGRESS_MIN_FILES = 50

# A trained run whose in-domain reliability after step 0 (`in_domain_reliability`) is below
# FLAT_MAX_RELIABILITY is flat: more of its in-domain accuracy's variance is binomial measurement
# noise than movement, so it barely trained, and a partial correlation given it measures noise.
# 0.5 ("more noise than signal"): a run that never moves has a reliability of 0 in expectation, and
# its estimate over 20 evaluations stays below 0.5 unless the sample variance of pure noise doubles
# its expectation (chi^2_19 / 19 > 2: 0.5% of runs; 41 evaluations: under 0.01%); a plateau with
# true reliability 0.7 is named in about 10% of runs (docs/analysis.md). A run needs at least
# FLAT_MIN_EVALUATIONS evaluations after step 0 to be judged.
FLAT_MAX_RELIABILITY = MIN_RELIABILITY  # the same floor below which SIMEX corrects only in part
FLAT_MIN_EVALUATIONS = 3
# An OOD testset whose accuracy takes one value (its mode) at NEAR_CONSTANT_SHARE of a run's
# evaluations or more is near-constant: a model answering one class, or a saturated testset. Half
# the steps: its partial correlations then rest on the other half, and a binomial accuracy on the
# study's hundreds of examples repeats its value at a fraction of the steps at most.
NEAR_CONSTANT_SHARE = 0.5

ACCURACY_COLUMNS = ("run", "model", "train_set", "seed", "shots", "kind", "step", "testset", "accuracy")

# The overview's `kind` of a run: trained (no schema.RUN_EVALUATED), or what `oodjax.evaluate` evaluated.
TRAINED = "trained"
KIND_LABELS = {
    schema.EVALUATED_BASE: "evaluated (base model)",
    schema.EVALUATED_ADAPTER: "evaluated (adapter)",
    schema.EVALUATED_IN_CONTEXT: "evaluated (in context)",
}

# What reading a damaged npz raises: an empty file (EOFError), a truncated or
# corrupt zip (BadZipFile: no central directory, bad CRC), a compressed member
# that does not inflate (zlib.error), bytes that are no npz at all or an
# unreadable member header (ValueError), a file that cannot be opened (OSError).
_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


class ResultsError(ValueError):
    """A results root or a metrics.npz file that the analysis cannot use; says which and why."""


class UnreadableMetricsError(ResultsError):
    """A metrics.npz whose bytes cannot be read as a complete npz; its run is unfinished."""

    def __init__(self, path: pathlib.Path, error: Exception):
        self.path = path
        self.reason = f"not a readable npz file ({type(error).__name__}: {error})"
        super().__init__(f"{path}: {self.reason}")


class ResultsWarning(UserWarning):
    """A metrics.npz that `find_runs` left out (see SkippedFile)."""


@dataclasses.dataclass(frozen=True)
class SkippedFile:
    """A metrics.npz left out of the runs, and why: `unreadable` (its run counts as
    unfinished), or else a byte-identical copy of a run already counted."""

    path: pathlib.Path
    reason: str
    unreadable: bool

    @property
    def message(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One run's accuracies over its evaluation steps, and what identifies it, as its metrics.npz records them
    (``oodjax.engine.results`` writes them)."""

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
    evaluated: str | None  # one of schema.EVALUATED_KINDS for a run `oodjax.evaluate` wrote; None: trained

    @property
    def name(self) -> str:
        return self.path.parent.name

    @property
    def ood_testsets(self) -> list[str]:
        """Testsets other than the in-domain one and the training set itself."""
        return [t for t in self.accuracy.columns if t not in (self.in_domain, schema.TRAIN_TESTSET)]

    @property
    def kind(self) -> str:
        """`trained`, or how `oodjax.evaluate` evaluated it (KIND_LABELS)."""
        return TRAINED if self.evaluated is None else KIND_LABELS[self.evaluated]

    @property
    def planned_steps(self) -> int | None:
        """The step a trained run ends at (`schema.planned_steps`); None for an evaluation-only run."""
        return schema.planned_steps(self.config, self.evaluated)

    @property
    def finished(self) -> bool:
        """`schema.finished`: the one definition both commands use."""
        return schema.finished(self.steps, self.config, self.evaluated)

    @functools.cached_property
    def in_domain_examples(self) -> int:
        """N, the in-domain testset's examples, from its stored labels (`label/<in-domain>`)."""
        key = schema.label_key(self.in_domain)
        return int(read_metrics(self.path, [key])[key].size)

    @functools.cached_property
    def in_domain_reliability(self) -> float:
        """`measurement_error.reliability` of its in-domain accuracy after step 0; NaN for fewer than
        FLAT_MIN_EVALUATIONS evaluations there."""
        accuracy = self.accuracy[self.in_domain].to_numpy(dtype=float)[self.steps > 0]
        accuracy = accuracy[np.isfinite(accuracy)]
        if accuracy.size < FLAT_MIN_EVALUATIONS:
            return np.nan
        return reliability(accuracy, self.in_domain_examples)

    @property
    def flat(self) -> str:
        """Why its in-domain accuracy is mostly noise (`in_domain_reliability` below FLAT_MAX_RELIABILITY), in
        words; empty when it moves, and for a run of fewer than FLAT_MIN_EVALUATIONS evaluations after step 0
        (evaluation-only by design, or just started), which cannot be judged."""
        if not self.in_domain_reliability < FLAT_MAX_RELIABILITY:
            return ""
        evaluations = int((self.steps > 0).sum())
        return (
            f"in-domain reliability {self.in_domain_reliability:.2f} over {evaluations} evaluations after step 0 "
            f"(below {FLAT_MAX_RELIABILITY}: more binomial noise on {self.in_domain_examples} examples than movement)"
        )

    @property
    def near_constant(self) -> str:
        """The OOD testsets whose accuracy sits at its mode at NEAR_CONSTANT_SHARE of the evaluations or more,
        in words; empty when none does or the run has fewer than FLAT_MIN_EVALUATIONS evaluations."""
        if len(self.steps) < FLAT_MIN_EVALUATIONS:
            return ""
        found = []
        for testset in self.ood_testsets:
            accuracy = self.accuracy[testset].dropna()
            if accuracy.empty:
                continue
            counts = accuracy.value_counts()
            if counts.iloc[0] > 1 and counts.iloc[0] >= NEAR_CONSTANT_SHARE * len(accuracy):  # a value repeats
                found.append(f"{testset!r} at {counts.index[0]:.3f} in {counts.iloc[0]} of {len(accuracy)} evaluations")
        return "; ".join(found)

    @property
    def progress(self) -> str:
        """How far it got, in words: `last step 30 of 50`, or its kind for an evaluation-only run."""
        if self.evaluated is not None:
            return self.kind
        planned = "?" if self.planned_steps is None else self.planned_steps
        return f"last step {int(self.steps[-1])} of {planned}"


def find_runs(root: str | pathlib.Path) -> list[RunRecord]:
    """`scan_runs` for use from Python: each skipped file is a ResultsWarning, and a root
    without any readable run is an error."""
    runs, skipped = scan_runs(root)
    for skip in skipped:
        warnings.warn(skip.message, ResultsWarning, stacklevel=2)
    if not runs:
        raise ResultsError(no_readable_runs_message(root, skipped))
    return runs


def scan_runs(root: str | pathlib.Path) -> tuple[list[RunRecord], list[SkippedFile]]:
    """Every run under `root` (searched recursively), sorted by model family, size, model,
    training set, shots and seed, and the files left out.

    Unreadable files are left out (see the module docstring). A run found
    more than once (same model, training set, seed, shots and kind) is counted once
    when the copies are byte-identical, the others left out; copies that
    differ are an error naming them all. Runs that share a model name must
    share its family and size.
    """
    root = pathlib.Path(root)
    if not root.is_dir():
        raise ResultsError(f"results root {root} is not a directory")
    paths = sorted(root.rglob(schema.METRICS_FILENAME))
    if not paths:
        raise ResultsError(f"no {schema.METRICS_FILENAME} under {root}: is it a results root?")
    progress = tqdm(paths, desc="reading runs", unit="run", file=sys.stderr, disable=len(paths) <= PROGRESS_MIN_FILES)
    runs, skipped = [], []
    for path in progress:
        try:
            runs.append(load_run(path))
        except UnreadableMetricsError as error:
            skipped.append(SkippedFile(path, f"{error.reason}; skipped, its run counts as unfinished", unreadable=True))
    runs, copies = _count_copies_once(runs)
    _check_one_model_per_name(runs)
    return sorted(runs, key=model_order_key), skipped + copies


def no_readable_runs_message(root: str | pathlib.Path, skipped: Sequence[SkippedFile]) -> str:
    """The error when every metrics.npz under `root` was skipped (there is at least one)."""
    return f"no readable {schema.METRICS_FILENAME} under {root}: all {len(skipped)} skipped, first {skipped[0].message}"


def read_metrics(path: str | os.PathLike, keys: Sequence[str] = schema.REQUIRED_KEYS) -> dict[str, np.ndarray]:
    """The arrays `keys` of one metrics.npz, each read whole (and so CRC-checked).

    Raises UnreadableMetricsError when the file cannot be read as an npz
    (the run is unfinished: a job or a copy was cut short), and ResultsError
    when it can but is no npz of arrays holding `keys` (a file of another kind).
    """
    path = pathlib.Path(path)
    try:
        loaded = np.load(path, allow_pickle=False)
        is_npz = isinstance(loaded, np.lib.npyio.NpzFile)
        if is_npz:
            with loaded as npz:
                present = set(npz.files)
                arrays = {key: npz[key] for key in keys if key in present}
    except _READ_ERRORS as error:
        raise UnreadableMetricsError(path, error) from error
    if not is_npz:
        raise ResultsError(f"{path}: one npy array, not an npz archive of a run's metrics")
    missing = [key for key in keys if key not in present]
    if missing:
        raise ResultsError(f"{path}: not a run's metrics (schema in analysis/schema.py): missing keys {missing}")
    # numpy hands back the raw bytes of a member that is not an npy file.
    for key, value in arrays.items():
        if not isinstance(value, np.ndarray):
            raise ResultsError(f"{path}: its {key!r} is not an npy array")
    return arrays


def model_order_key(run: RunRecord) -> tuple:
    """Family, then size numerically (unknown sizes last), then the rest of the run's identity."""
    size = run.model_info.size_billions
    return (
        run.model_info.family,
        math.inf if math.isnan(size) else size,
        run.model,
        run.train_set,
        run.shots,
        run.seed,
        run.evaluated is not None,
        run.name,
    )


def accuracy_table(runs: Sequence[RunRecord]) -> pd.DataFrame:
    """Every accuracy of every run in long form, one row per (run, step, testset):
    the columns of ACCURACY_COLUMNS, for plotting or modelling outside this package."""
    frames = []
    for run in runs:
        long = run.accuracy.melt(var_name="testset", value_name="accuracy", ignore_index=False)
        frames.append(
            long.reset_index().assign(
                run=run.name,
                model=run.model,
                train_set=run.train_set,
                seed=run.seed,
                shots=run.shots,
                kind=run.kind,
            )
        )
    return pd.concat(frames, ignore_index=True)[list(ACCURACY_COLUMNS)]


OVERVIEW_COLUMNS = (
    "run",
    "model",
    "train_set",
    "seed",
    "shots",
    "kind",
    "last_step",
    "planned_steps",
    "finished",
    "in_domain_accuracy",
    "mean_ood_accuracy",
    "in_domain_reliability",
    "problem",
)


def flat_warning(run: RunRecord) -> str:
    """The warning line of a flat run (`RunRecord.flat`), as both commands print it."""
    return f"warning: {run.path}: flat, {run.flat}; a partial correlation given it measures noise"


def near_constant_warning(run: RunRecord) -> str:
    """The warning line of a run with a near-constant OOD series (`RunRecord.near_constant`)."""
    return (
        f"warning: {run.path}: near-constant OOD accuracy, {run.near_constant}; "
        "its partial correlations rest on the other evaluations"
    )


def runs_overview(runs: Sequence[RunRecord], unreadable: Sequence[SkippedFile] = ()) -> pd.DataFrame:
    """One row per run: identity, kind (`RunRecord.kind`), last step, whether it finished, and its accuracies at the
    last step (in-domain, and the mean over OOD testsets with an accuracy there); then one
    unfinished row per unreadable file, named by its directory, its `problem` saying why."""
    rows = []
    for run in runs:
        last = run.accuracy.iloc[-1]
        rows.append(
            {
                "run": run.name,
                "model": run.model,
                "train_set": run.train_set,
                "seed": run.seed,
                "shots": run.shots,
                "kind": run.kind,
                "last_step": int(run.steps[-1]),
                "planned_steps": run.planned_steps,
                "finished": run.finished,
                "in_domain_accuracy": last[run.in_domain],
                "mean_ood_accuracy": last[run.ood_testsets].mean(),
                "in_domain_reliability": run.in_domain_reliability,
                "problem": "",
            }
        )
    for skip in unreadable:
        rows.append({"run": skip.path.parent.name, "finished": False, "problem": "unreadable"})
    counts = ["seed", "shots", "last_step", "planned_steps"]
    return pd.DataFrame(rows, columns=list(OVERVIEW_COLUMNS)).astype(
        {column: "Int64" for column in counts} | {"finished": bool}
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m analysis.runs RESULTS_DIR [--csv]` (also the `oodjax-runs` command)."""
    parser = argparse.ArgumentParser(
        prog="python -m analysis.runs",
        description="List the runs under a results root: identity, progress, last accuracies.",
    )
    parser.add_argument(
        "results_dir", type=pathlib.Path, help="results root: <run>/metrics.npz files, searched recursively"
    )
    parser.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    args = parser.parse_args(argv)
    try:
        runs, skipped = scan_runs(args.results_dir)
        flat = [run for run in runs if run.flat]  # reads each run's in-domain labels: a ResultsError without them
        overview = runs_overview(runs, [skip for skip in skipped if skip.unreadable])
    except ResultsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for skip in skipped:
        print(f"warning: {skip.message}", file=sys.stderr)
    for run in flat:
        print(flat_warning(run), file=sys.stderr)
    for run in runs:
        if run.near_constant:
            print(near_constant_warning(run), file=sys.stderr)
    if args.csv:
        overview.to_csv(sys.stdout, index=False)
    else:
        counts = list(overview.select_dtypes("Int64").columns)  # na_rep skips their <NA>
        shown = overview.astype({column: "string" for column in counts}).fillna({column: "-" for column in counts})
        print(shown.to_string(index=False, float_format="{:.3f}".format, na_rep="-"))
        finished = int(overview["finished"].sum())
        evaluated = int(overview["kind"].isin(list(KIND_LABELS.values())).sum())
        unreadable = int((overview["problem"] == "unreadable").sum())
        print(
            f"{len(overview)} runs, {finished} finished"
            + (f" ({evaluated} evaluation-only)" if evaluated else "")
            + f", {len(overview) - finished} not"
            + (f" ({unreadable} unreadable)" if unreadable else "")
            + (f"; {len(flat)} flat (in-domain accuracy barely moves, see the warnings)" if flat else "")
        )
    return 0


def load_run(path: str | pathlib.Path) -> RunRecord:
    """Read and validate one metrics.npz against analysis/schema.py (errors as `read_metrics`)."""
    path = pathlib.Path(path)
    arrays = read_metrics(path)
    steps = arrays[schema.STEP]
    testsets = [str(t) for t in arrays[schema.TESTSETS]]
    accuracy = arrays[schema.ACCURACY]
    if steps.ndim != 1 or accuracy.shape != (len(steps), len(testsets)):
        raise ResultsError(
            f"{path}: accuracy has shape {accuracy.shape}, expected [steps, testsets] = [{len(steps)}, {len(testsets)}]"
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
        raise ResultsError(f"{path}: OOD testsets {run_ood}: pairs of OOD testsets need at least two")
    config, identity = _run_identity(path, str(arrays[schema.CONFIG]), steps)
    return RunRecord(
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
        evaluated=identity[schema.RUN_EVALUATED],
    )


def _run_identity(path: pathlib.Path, config_json: str, steps: np.ndarray) -> tuple[dict[str, Any], dict]:
    """The parsed config and its run section (model name, seed, shots, and what `oodjax.evaluate`
    evaluated: `_evaluated`), checked."""
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
    identity[schema.RUN_EVALUATED] = _evaluated(config, section, identity[schema.RUN_SHOTS], steps)
    if identity[schema.RUN_EVALUATED] not in (None, *schema.EVALUATED_KINDS):
        raise ResultsError(
            f"{path}: config {schema.RUN_SECTION}.{schema.RUN_EVALUATED} is "
            f"{identity[schema.RUN_EVALUATED]!r}, not one of {list(schema.EVALUATED_KINDS)}"
        )
    return config, identity


def _evaluated(config: dict[str, Any], section: dict[str, Any], shots: int, steps: np.ndarray) -> str | None:
    """The run section's `evaluated` marker; for a file `oodjax.evaluate` wrote before the marker
    existed (one evaluation, at step 0), what its config says: the in-context baseline
    (eval.in_context), adapters (model.adapters, which training ignores), or the base model alone
    (0 shots, which training refuses). None: trained."""
    if schema.RUN_EVALUATED in section:
        return section[schema.RUN_EVALUATED]
    if steps.tolist() != [0]:
        return None
    if (config.get("eval") or {}).get("in_context"):
        return schema.EVALUATED_IN_CONTEXT
    if (config.get("model") or {}).get("adapters"):
        return schema.EVALUATED_ADAPTER
    if shots == 0:
        return schema.EVALUATED_BASE
    return None


def _count_copies_once(runs: list[RunRecord]) -> tuple[list[RunRecord], list[SkippedFile]]:
    """One run per identity (model, training set, seed, shots, and what was evaluated: an adapter
    evaluated beside the trained run it came from shares the rest): byte-identical copies (a
    results root copied into itself) count once, the first in path order kept; copies that
    differ are an error, since which one the paper should rest on is the researcher's call."""
    by_identity: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        by_identity.setdefault((run.model, run.train_set, run.seed, run.shots, run.kind), []).append(run)
    kept, copies = [], []
    for (model, train_set, seed, shots, kind), found in by_identity.items():
        first, *others = found
        if any(not filecmp.cmp(first.path, other.path, shallow=False) for other in others):
            places = ", ".join(f"{run.path} ({run.progress})" for run in found)
            raise ResultsError(
                f"run (model {model!r}, train set {train_set!r}, seed {seed}, {shots} shots"
                f"{'' if kind == TRAINED else ', ' + kind}) "
                f"found {len(found)} times with different contents: {places}; keep one and "
                "move the others out of the results root"
            )
        kept.append(first)
        copies += [
            SkippedFile(other.path, f"a byte-identical copy of {first.path}; counted once", unreadable=False)
            for other in others
        ]
    return kept, copies


def _check_one_model_per_name(runs: list[RunRecord]) -> None:
    """Runs are grouped by model name: one name for two models would mix them silently."""
    seen: dict[str, RunRecord] = {}
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
