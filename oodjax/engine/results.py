"""A run's identity and its results: metrics.npz in the schema of analysis/schema.py.

A run is one (seed, shots) fine-tuning job of a model on a training set.
Its name is ``run_name``'s ``<model>_<train_set>_seed<seed>_shots<shots>``,
its directory ``<output_dir>/<name>/`` (checkpoints under ``checkpoints/``,
adapters under ``adapter/``), and its identity is also stored inside its
results, in the config JSON's run section (``schema.RUN_SECTION``: model,
seed, shots), which is what the analysis (``analysis.runs.RunRecord``) and
the sweep read: a renamed or moved directory is still the same run.

The file is rewritten after every evaluation through a temporary file and
`os.replace`, so a reader (or a crash, or a full disk) only ever sees a
complete file that holds every evaluation finished so far. It is created
with the process umask like any other file (readable by the group under the
usual 022), not with the owner-only mode of `tempfile`'s files.
`read_progress` is how the loop and the sweep tell a finished run from an
unfinished one.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import re
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging
from ml_collections import config_dict

from analysis import schema
from oodjax.storage import write_npz_atomic

# Accuracy and margins are computed from float32 margins; only the stored
# per-example margins are rounded to float16 (they are many and small).
MARGIN_DTYPE = np.float16


@dataclasses.dataclass(frozen=True)
class Run:
    """One (seed, shots) fine-tuning job of the config."""

    seed: int
    shots: int
    name: str
    directory: pathlib.Path


def plan_runs(config: config_dict.ConfigDict) -> list[Run]:
    """The config's runs: every (seed, shots) pair, seeds outermost."""
    model = model_name(config)
    runs = []
    for seed, shots in itertools.product(config.runs.seeds, config.runs.shots):
        name = run_name(model, config.data.train_set, seed, shots)
        runs.append(Run(seed=seed, shots=shots, name=name, directory=pathlib.Path(config.output_dir) / name))
    return runs


def model_name(config: config_dict.ConfigDict) -> str:
    """model.name, else the checkpoint's last path component, else "<model_type>-random"."""
    if config.model.name:
        return config.model.name
    if config.model.path:
        return pathlib.Path(config.model.path.rstrip("/")).name
    return f"{config.model.hf_config.model_type}-random"


def run_name(model: str, train_set: str, seed: int, shots: int) -> str:
    """`<model>_<train_set>_seed<seed>_shots<shots>`, with path separators in the model name replaced."""
    return f"{path_safe(model)}_{train_set}_seed{seed}_shots{shots}"


def path_safe(name: str) -> str:
    """``name`` as one path component: runs of characters other than letters, digits, ``._-`` become ``-``
    (a hub id's ``/`` included)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def accuracy(margins: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of examples whose larger answer logit is the gold one (a tie counts as " No"); NaN when any
    margin is NaN or infinite: a model whose outputs are not finite has no accuracy (a NaN margin compared
    as " No" would pass for a plausible one), and the analysis reads NaN as missing."""
    margins = np.asarray(margins)
    if not np.isfinite(margins).all():
        return float("nan")
    return float(np.mean((margins > 0) == (np.asarray(labels) == 0)))


class RunResults:
    """One run's evaluations so far, and the metrics.npz that holds them."""

    def __init__(
        self,
        run_dir: str | pathlib.Path,
        *,
        labels: Mapping[str, np.ndarray],
        in_domain: str,
        config: Mapping[str, Any],
    ):
        """`labels` maps each evaluated testset (in column order) to its gold labels."""
        if in_domain not in labels:
            raise ValueError(f"in-domain testset {in_domain!r} is not among the evaluated {list(labels)}")
        self.path = pathlib.Path(run_dir) / schema.METRICS_FILENAME
        self.testsets = tuple(labels)
        self.labels = {name: np.asarray(value, dtype=np.int32) for name, value in labels.items()}
        self.in_domain = in_domain
        self.config_json = json.dumps(config, sort_keys=True)
        self.steps: list[int] = []
        self.accuracy: list[np.ndarray] = []
        self.train_loss: list[float] = []
        self.margins: dict[str, list[np.ndarray]] = {name: [] for name in self.testsets}

    def add(self, step: int, margins: Mapping[str, np.ndarray], train_loss: float) -> dict[str, float]:
        """Records the evaluation at `step` and returns its accuracy per testset; a testset with a margin that is
        not finite gets accuracy NaN, said in a warning naming the run, the step and the testset.

        Every evaluation (training's, `oodjax.evaluate`'s, the in-context
        baseline's) computes its accuracies here."""
        if self.steps and step <= self.steps[-1]:
            raise ValueError(f"evaluation at step {step} after one at step {self.steps[-1]}")
        if set(margins) != set(self.testsets):
            raise ValueError(f"margins for {sorted(margins)}, expected {sorted(self.testsets)}")
        accuracies = {}
        for name in self.testsets:
            values = np.asarray(margins[name], dtype=np.float32)
            if values.shape != self.labels[name].shape:
                raise ValueError(
                    f"{name}: {values.shape[0]} margins for {self.labels[name].shape[0]} labelled examples"
                )
            accuracies[name] = accuracy(values, self.labels[name])
            if np.isnan(accuracies[name]):
                logging.warning(
                    "%s, step %d, %s: %d of %d margins are NaN or infinite; its accuracy is recorded as NaN",
                    self.path.parent.name, step, name, np.count_nonzero(~np.isfinite(values)), values.size,
                )  # fmt: skip
            self.margins[name].append(values.astype(MARGIN_DTYPE))
        self.steps.append(int(step))
        self.accuracy.append(np.array([accuracies[name] for name in self.testsets]))
        self.train_loss.append(float(train_loss))
        return accuracies

    def arrays(self) -> dict[str, np.ndarray]:
        """The metrics.npz content: every key of the schema."""
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
        return arrays

    def write(self) -> None:
        write_npz_atomic(self.path, self.arrays())

    def resume(self, up_to_step: int, expected_steps: Sequence[int]) -> None:
        """Reloads the evaluations up to a checkpoint's step from the metrics.npz on disk.

        Evaluations after `up_to_step` are dropped: the resumed run redoes them.
        `expected_steps` are the evaluation steps that must be there.
        """
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


class UnreadableResultsError(ValueError):
    """A metrics.npz exists but cannot be read (truncated, not an npz, a key missing)."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a run's metrics.npz says of it: the steps evaluated and the config it was trained with."""

    steps: tuple[int, ...]
    config: dict[str, Any]

    def finished(self, final_step: int) -> bool:
        """Whether the evaluation at the run's last step is recorded, the mark of a finished run."""
        return final_step in self.steps


def read_progress(run_dir: str | pathlib.Path) -> Progress | None:
    """The steps and config recorded in `<run_dir>/metrics.npz`; None when there is no such file.

    A file that exists but cannot be read raises `UnreadableResultsError`
    naming it (the loop stops on it; the sweep warns and counts the run
    unfinished).
    """
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
