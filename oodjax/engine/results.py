"""A run's identity and its results: metrics.npz in the schema of analysis/schema.py, and results.json beside it.

A run's identity is also stored inside its results (the config's
``schema.RUN_SECTION``), so a renamed or moved directory is still the same
run. Both files are rewritten after every evaluation by ``write_atomic``, so
a reader or a crash only ever sees a complete file. Timings go to
results.json alone, so a resumed run's metrics.npz stays equal to an
uninterrupted one's; a resumed run carries over those of the evaluations it
keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import itertools
import json
import math
import pathlib
import platform
import re
import subprocess
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from analysis import schema
from oodjax import versions as oodjax_versions
from oodjax.settings import setting
from oodjax.storage import write_atomic, write_npz_atomic
from oodjax.usage_errors import ConfigError, DamagedInputError

# Only the stored per-example margins are float16 (they are many); accuracy comes from float32 ones.
MARGIN_DTYPE = np.float16

ADAPTER_DIR = "adapter"  # <run_dir>/adapter/: the run's adapters in PEFT format (export.peft)

# The distributions whose versions results.json records (the engine's stack; None for one not installed).
RECORDED_DISTRIBUTIONS = (
    "oodjax jax jaxlib flax optax orbax-checkpoint numpy transformers tokenizers datasets grain"
).split()


# runs.key_source: keys from the seed alone (the study), or from (seed, shots, training set).
KEY_SOURCES = ("seed", "seed_shots_train_set")


@dataclasses.dataclass(frozen=True)
class Run:
    """One (seed, shots) fine-tuning job of the config."""

    seed: int
    shots: int
    name: str
    directory: pathlib.Path


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Which runs a job is (its runs section, the model's name, the training set) and where they go."""

    model: str  # the model's name in run names (``oodjax.models.ModelSettings.name``)
    train_set: str  # data.train_set
    # A run's seed draws its few-shot set, its data order, its adapter
    # initialisation and its dropout.
    seeds: tuple[int, ...] = setting((0, 42, 99), path="runs.seeds", resumable=True)
    # Sizes of the few-shot training sets (label-balanced draws from the pool).
    shots: tuple[int, ...] = setting((32, 64, 128), path="runs.shots", resumable=True)
    # Root of the results: one sub-directory per run, <output_dir>/<run name>/,
    # holding its metrics.npz, events.jsonl and its own checkpoints/.
    output_dir: pathlib.Path = setting(pathlib.Path("results"), path="output_dir", resumable=True)
    # What a run's LoRA initialisation and dropout keys come from: "seed", the
    # study's way (a seed's runs of every shot count and training set start
    # alike, so their results are correlated), or "seed_shots_train_set"
    # (each run its own keys; a departure from the study, for new sweeps).
    key_source: str = setting("seed", path="runs.key_source")
    # A job locks each of its runs (<run_dir>/run.lock) while it trains or
    # evaluates them. A run locked by another live job stops this one before
    # it writes anything, naming the run and that job; True leaves such runs
    # out (with a warning) and goes on with the others.
    skip_locked: bool = setting(False, path="runs.skip_locked", resumable=True)

    def __post_init__(self) -> None:
        if self.key_source not in KEY_SOURCES:
            raise ConfigError(f"runs.key_source must be one of {KEY_SOURCES}, got {self.key_source!r}")
        for field in ("seeds", "shots"):
            values = list(getattr(self, field))
            if not values or len(set(values)) != len(values):
                raise ConfigError(f"runs.{field} must be a non-empty list without repeats, got {values}")
        if min(self.shots) < 1:
            raise ConfigError(f"runs.shots must be positive, got {list(self.shots)}")

    def key_seed(self, run: Run) -> int:
        """The integer a run's LoRA initialisation and dropout keys are drawn from (nnx.Rngs): its seed
        (key_source "seed", as the study did), or a 31-bit digest of its seed, shots and training set."""
        if self.key_source == "seed":
            return run.seed
        return zlib.crc32(f"{run.seed}/{run.shots}/{self.train_set}".encode()) & 0x7FFFFFFF

    def runs(self) -> list[Run]:
        """Every (seed, shots) pair, seeds outermost."""
        pairs = list(itertools.product(self.seeds, self.shots))
        names = [run_name(self.model, self.train_set, seed, shots) for seed, shots in pairs]
        return [Run(seed, shots, name, self.output_dir / name) for (seed, shots), name in zip(pairs, names)]


def run_name(model: str, train_set: str, seed: int, shots: int) -> str:
    return f"{path_safe(model)}_{train_set}_seed{seed}_shots{shots}"


def path_safe(name: str) -> str:
    """``name`` as one path component (a hub id's ``/`` included)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def accuracy(margins: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of examples whose larger answer logit is the gold one (a tie counts as " No").

    NaN when any margin is not finite: a NaN margin compared as " No" would pass for a plausible accuracy.
    """
    margins = np.asarray(margins)
    if not np.isfinite(margins).all():
        return float("nan")
    return float(np.mean((margins > 0) == (np.asarray(labels) == 0)))


class RunResults:
    """One run's evaluations so far, and the metrics.npz that holds them (results.json: ``_summary``)."""

    def __init__(
        self,
        run_dir: str | pathlib.Path,
        *,
        labels: Mapping[str, np.ndarray],
        dataset_index: Mapping[str, np.ndarray],
        in_domain: str,
        config: Mapping[str, Any],
    ):
        """`labels` and `dataset_index` (``oodjax.engine.run_data.IndexedSet``) per testset, in column order."""
        if in_domain not in labels:
            raise ValueError(f"in-domain testset {in_domain!r} is not among the evaluated {list(labels)}")
        if set(dataset_index) != set(labels):
            raise ValueError(f"dataset indices of {sorted(dataset_index)}, labels of {sorted(labels)}")
        self.path = pathlib.Path(run_dir) / schema.METRICS_FILENAME
        self.results_path = self.path.with_name(schema.RESULTS_FILENAME)
        self.testsets = tuple(labels)
        self.labels = {name: np.asarray(value, dtype=np.int32) for name, value in labels.items()}
        self.dataset_index = {name: np.asarray(dataset_index[name], dtype=np.int64) for name in self.testsets}
        for name in self.testsets:
            self._check_count(name, self.dataset_index[name], "dataset indices")
        self.in_domain = in_domain
        self.config_json = json.dumps(config, sort_keys=True)
        self.steps: list[int] = []
        self.accuracy: list[np.ndarray] = []
        self.train_loss: list[float] = []
        self.margins: dict[str, list[np.ndarray]] = {name: [] for name in self.testsets}
        # Per evaluation, results.json's (train, evaluation) seconds (NaN: not measured); the training clock's
        # reading at the last one.
        self.timings: list[tuple[float, float]] = []
        self.train_clock = 0.0

    def _check_count(self, name: str, values: np.ndarray, what: str) -> None:
        if values.shape != self.labels[name].shape:
            raise ValueError(f"{name}: {values.shape[0]} {what} for {self.labels[name].shape[0]} labelled examples")

    def add(
        self,
        step: int,
        margins: Mapping[str, np.ndarray],
        train_loss: float,
        *,
        train_clock: float = math.nan,
        evaluation_seconds: float = math.nan,
    ) -> dict[str, float]:
        """Records the evaluation at `step` (every kind of evaluation scores here); returns its accuracy per testset.

        `train_clock` is this process's seconds of training so far; NaN where not measured.
        """
        if self.steps and step <= self.steps[-1]:
            raise ValueError(f"evaluation at step {step} after one at step {self.steps[-1]}")
        if set(margins) != set(self.testsets):
            raise ValueError(f"margins for {sorted(margins)}, expected {sorted(self.testsets)}")
        accuracies = {}
        for name in self.testsets:
            values = np.asarray(margins[name], dtype=np.float32)
            self._check_count(name, values, "margins")
            accuracies[name] = accuracy(values, self.labels[name])
            if np.isnan(accuracies[name]):
                logging.warning(
                    "%s, step %d, %s: %d of %d margins are NaN or infinite; its accuracy is recorded as NaN",
                    self.path.parent.name,
                    step,
                    name,
                    np.count_nonzero(~np.isfinite(values)),
                    values.size,
                )
            self.margins[name].append(values.astype(MARGIN_DTYPE))
        self.steps.append(int(step))
        self.accuracy.append(np.array([accuracies[name] for name in self.testsets]))
        self.train_loss.append(float(train_loss))
        self.timings.append((float(train_clock) - self.train_clock, float(evaluation_seconds)))
        self.train_clock = float(train_clock)
        return accuracies

    def arrays(self) -> dict[str, np.ndarray]:
        arrays = {
            schema.STEP: np.array(self.steps, dtype=np.int64),
            schema.TESTSETS: np.array(self.testsets, dtype=np.str_),
            schema.ACCURACY: np.array(self.accuracy, dtype=np.float64).reshape(len(self.steps), len(self.testsets)),
            schema.TRAIN_LOSS: np.array(self.train_loss, dtype=np.float64),
            schema.IN_DOMAIN: np.array(self.in_domain, dtype=np.str_),
            schema.CONFIG: np.array(self.config_json, dtype=np.str_),
        }
        for name in self.testsets:
            n = len(self.labels[name])
            arrays[schema.margin_key(name)] = np.array(self.margins[name], dtype=MARGIN_DTYPE).reshape(-1, n)
            arrays[schema.label_key(name)] = self.labels[name]
            arrays[schema.index_key(name)] = self.dataset_index[name]
        return arrays

    def write(self) -> None:
        """Rewrites metrics.npz, then results.json, each atomically."""
        arrays = self.arrays()
        write_npz_atomic(self.path, arrays)
        text = json.dumps(_summary(self, arrays[schema.ACCURACY]), indent=2, allow_nan=False) + "\n"
        write_atomic(
            self.results_path,
            lambda file: file.write(text.encode()),
            intact=f"the previous {self.results_path.name} is intact (metrics.npz is written)",
        )

    def resume(self, up_to_step: int, expected_steps: Sequence[int]) -> None:
        """Reloads the evaluations up to a checkpoint's step (`expected_steps`); the resumed run redoes later ones."""
        if not self.path.is_file():
            raise FileNotFoundError(
                f"{self.path} is missing, but the checkpoint at step {up_to_step} needs the "
                f"evaluations up to it (steps {list(expected_steps)})"
            )
        with np.load(self.path, allow_pickle=False) as stored:
            stored_testsets = tuple(stored[schema.TESTSETS].tolist())
            if stored_testsets != self.testsets:
                raise ValueError(f"{self.path} holds testsets {stored_testsets}, this run evaluates {self.testsets}")
            for name in self.testsets:
                if not np.array_equal(stored[schema.label_key(name)], self.labels[name]):
                    raise ValueError(f"{self.path}: the labels of {name} differ from this run's")
                index = schema.index_key(name)  # absent from files written before it existed
                if index in stored.files and not np.array_equal(stored[index], self.dataset_index[name]):
                    raise ValueError(f"{self.path}: the dataset indices of {name} differ from this run's")
            keep = stored[schema.STEP] <= up_to_step
            steps = stored[schema.STEP][keep].tolist()
            if steps != list(expected_steps):
                raise ValueError(
                    f"{self.path} has evaluations at steps {steps} up to the checkpoint at step "
                    f"{up_to_step}; expected {list(expected_steps)}"
                )
            self.steps = steps
            self.accuracy = list(stored[schema.ACCURACY][keep])
            self.train_loss = stored[schema.TRAIN_LOSS][keep].tolist()
            self.margins = {name: list(stored[schema.margin_key(name)][keep]) for name in self.testsets}
        timings = _stored_timings(self.results_path)
        self.timings = [timings.get(step, (math.nan, math.nan)) for step in steps]


def _summary(run: RunResults, accuracy: np.ndarray) -> dict[str, Any]:
    """The results.json content (layout in analysis/schema.py) of ``run``, its accuracy [evaluation, testset]
    given: JSON data, NaN as null."""
    config = json.loads(run.config_json)
    per_testset = {}
    for column, name in enumerate(run.testsets):
        values = accuracy[:, column]
        best = int(np.nanargmax(values)) if np.isfinite(values).any() else None  # the first of equal ones
        per_testset[name] = {
            schema.RESULTS_EXAMPLES: len(run.labels[name]),
            schema.RESULTS_FINAL: _at_step(run.steps, values, len(values) - 1),
            schema.RESULTS_BEST: _at_step(run.steps, values, best),
        }
    evaluations = [
        {
            schema.RESULTS_STEP: step,
            schema.RESULTS_TRAIN_SECONDS: _finite_or_none(train),
            schema.RESULTS_EVALUATION_SECONDS: _finite_or_none(evaluation),
        }
        for step, (train, evaluation) in zip(run.steps, run.timings, strict=True)
    ]
    return {
        schema.RESULTS_RUN: {schema.RESULTS_NAME: run.path.parent.name, **config[schema.RUN_SECTION]},
        schema.RESULTS_IN_DOMAIN: run.in_domain,
        schema.RESULTS_STEPS: list(run.steps),
        schema.RESULTS_PER_TESTSET: per_testset,
        schema.RESULTS_TIMINGS: {
            # Null when any evaluation's is not measured: a sum of part of them would pass for the whole.
            schema.RESULTS_TRAIN_SECONDS: _finite_or_none(math.fsum(train for train, _ in run.timings)),
            schema.RESULTS_EVALUATION_SECONDS: _finite_or_none(math.fsum(evaluation for _, evaluation in run.timings)),
            schema.RESULTS_EVALUATIONS: evaluations,
        },
        schema.RESULTS_VERSIONS: versions(),
        schema.RESULTS_DEVICES: devices(),
        schema.RESULTS_CONFIG: config,
    }


def _stored_timings(path: pathlib.Path) -> dict[int, tuple[float, float]]:
    """(train, evaluation) seconds per step from the results.json at ``path`` being resumed; an unreadable one is
    only warned of: timings are not worth a stop."""
    try:
        stored = json.loads(path.read_text())
        return {
            int(evaluation[schema.RESULTS_STEP]): (
                _none_as_nan(evaluation[schema.RESULTS_TRAIN_SECONDS]),
                _none_as_nan(evaluation[schema.RESULTS_EVALUATION_SECONDS]),
            )
            for evaluation in stored[schema.RESULTS_TIMINGS][schema.RESULTS_EVALUATIONS]
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as error:
        logging.warning(
            "%s is unreadable (%s: %s); the timings of its evaluations are recorded as unknown",
            path,
            type(error).__name__,
            error,
        )
        return {}


def _at_step(steps: Sequence[int], values: np.ndarray, i: int | None) -> dict[str, Any]:
    return {
        schema.RESULTS_STEP: None if i is None else steps[i],
        schema.RESULTS_ACCURACY: None if i is None else _finite_or_none(values[i]),
    }


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN: a value not measured, or an accuracy NaN (margins not finite), is null."""
    return float(value) if math.isfinite(value) else None


def _none_as_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


@functools.cache
def versions() -> dict[str, Any]:
    """The versions results.json records (None: not installed), the checkout's commit, and ``against_pins``."""
    found: dict[str, Any] = {"python": platform.python_version(), **dict.fromkeys(RECORDED_DISTRIBUTIONS)}
    for distribution in RECORDED_DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[distribution] = importlib.metadata.version(distribution)
    found["oodjax_commit"] = _checkout_commit()
    return found | oodjax_versions.against_pins()


def _checkout_commit() -> str | None:
    source = pathlib.Path(__file__).resolve().parents[2]
    if not (source / ".git").exists():  # an installed package
        return None
    try:
        completed = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):  # no git, or a checkout it cannot read
        return None
    return completed.stdout.strip()


def devices() -> dict[str, Any]:
    """The JAX platform, device kind and counts of this process's job."""
    return {
        "platform": jax.default_backend(),
        "kind": jax.devices()[0].device_kind,
        "count": jax.device_count(),
        "processes": jax.process_count(),
    }


class UnreadableResultsError(DamagedInputError):
    """A metrics.npz exists but cannot be read (truncated, not an npz, a key missing)."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a run's metrics.npz says of it: the steps evaluated and the config it was trained with."""

    steps: tuple[int, ...]
    config: dict[str, Any]

    def finished(self, final_step: int) -> bool:
        return final_step in self.steps


def read_progress(run_dir: str | pathlib.Path) -> Progress | None:
    """The steps and config recorded in `<run_dir>/metrics.npz`; None when there is no such file."""
    path = pathlib.Path(run_dir) / schema.METRICS_FILENAME
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            steps = tuple(int(step) for step in stored[schema.STEP])
            config = json.loads(stored[schema.CONFIG].item())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise UnreadableResultsError(f"{path} is unreadable ({type(error).__name__}: {error})") from error
    return Progress(steps=steps, config=config)
