"""Where each run of a job stands before it trains, and whether it may go on.

Runs are the unit of resumption: each is finished (skipped), part-way
(resumed from its newest intact checkpoint) or new. A stored run whose
config differs from the job's beyond ``RESUMABLE_CHANGES`` and the runs
section is refused before anything is created.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from absl import logging
from jax.experimental import multihost_utils

from analysis import schema
from oodjax import config_fields
from oodjax.engine import checkpoints, results
from oodjax.engine.cadence import RunGroup
from oodjax.engine.distributed import is_primary
from oodjax.engine.optimizer import warmup_steps
from oodjax.engine.results import Run
from oodjax.usage_errors import ConfigError

# Config fields a resumed run may change: they do not affect its results. The runs section may change
# too: it says which runs a job trains, not what one is.
RESUMABLE_CHANGES = ("output_dir", "log_every", "wandb", "tensorboard", "export", "checkpoint_keep")
JOB_SECTIONS = ("runs", schema.RUN_SECTION)


@dataclasses.dataclass
class RunStart:
    """Where one run stands before a job trains it."""

    run: Run
    group: RunGroup  # the job's runs of its length
    finished: bool  # its metrics.npz holds the evaluation at its last step
    stored_config: dict[str, Any] | None  # comparable config it was trained with (None: new)
    checkpoint: checkpoints.Restored | None = None  # the one it resumes from (None: it starts at 0)

    @property
    def step(self) -> int:
        return self.checkpoint.step if self.checkpoint is not None else 0

    @property
    def evaluation_pending(self) -> bool:
        """Whether it was stopped at a step whose evaluation is still to do."""
        return self.checkpoint is not None and bool(self.checkpoint.loop_state.get("evaluation_pending"))

    def describe(self) -> str:
        if self.finished:
            return f"finished (step {self.group.total_steps}), skipped"
        if self.checkpoint is not None:
            return f"resumes from its checkpoint at step {self.step}"
        return "starts at step 0"


def read_start(group: RunGroup, run: Run) -> RunStart:
    """Reads what the folder of ``run``, one of ``group``'s, holds; writes nothing."""
    try:
        progress = results.read_progress(run.directory)
    except results.UnreadableResultsError as error:
        raise results.UnreadableResultsError(
            f"{error}; {run.name} cannot be resumed or skipped without it: move it (or {run.directory}) away to "
            "start the run over"
        ) from error
    if progress is not None and progress.finished(group.total_steps):
        return RunStart(run, group, finished=True, stored_config=comparable_stored(progress.config))
    newest = checkpoints.restore_newest(run.directory, None, warn=False)  # its config; the arrays come later
    stored = comparable_stored(newest.loop_state["config"]) if newest is not None else None  # as this version compares
    return RunStart(run, group, finished=False, stored_config=stored, checkpoint=newest)


def refuse_changed_config(record: Mapping[str, Any], output_dir: pathlib.Path, starts: Sequence[RunStart]) -> None:
    """A ConfigError naming every stored run whose config differs from ``record`` in a field that matters."""
    current = comparable_stored(record)
    defaults = comparable_stored(json.loads(config_fields.get_config().to_json()))
    differing: dict[str, list[str]] = collections.defaultdict(list)
    for start in starts:
        if start.stored_config is not None and (fields := differing_fields(start.stored_config, current, defaults)):
            differing["; ".join(fields)].append(start.run.name)
    if differing:
        details = " | ".join(f"{', '.join(names)}: {fields}" for fields, names in differing.items())
        raise ConfigError(
            f"{output_dir} holds runs started with another config (stored -> now: {details}); resume with "
            "the same config or use a new output_dir"
        )


def differing_fields(
    stored: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any], prefix: str = ""
) -> list[str]:
    """``"section.field stored -> now"`` for every leaf field that differs between two config dicts.

    A field the stored config lacks is no difference at its default: it means what the version without it did.
    """
    fields = []
    for key in sorted({*stored, *current}):
        old, new = stored.get(key), current.get(key)
        if key not in stored and key in defaults and new == defaults[key]:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            fields += differing_fields(old, new, defaults.get(key) or {}, f"{prefix}{key}.")
        elif old != new:
            fields.append(f"{prefix}{key} {old!r} -> {new!r}")
    return fields


def warn_of_shared_checkpoints(output_dir: pathlib.Path) -> None:
    """Checkpoints of the earlier layout (one for all runs, under output_dir) are not read: say so."""
    shared = output_dir / checkpoints.CHECKPOINT_DIR
    if shared.is_dir():
        logging.warning(
            "%s holds checkpoints of all runs together, as earlier versions wrote them; they are not read (each run "
            "now has its own, <run_dir>/%s): runs without one start at step 0",
            shared,
            checkpoints.CHECKPOINT_DIR,
        )


def set_aside_damaged(starts: Sequence[RunStart]) -> None:
    """Renames the checkpoints that failed to restore, out of the way of the run's new ones at those steps."""
    for start in starts:
        for step in start.checkpoint.damaged if start.checkpoint is not None else ():
            if is_primary():
                aside = checkpoints.set_aside(start.run.directory, step)
                logging.warning("%s: set aside the damaged checkpoint as %s", start.run.name, aside)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("oodjax: damaged checkpoints set aside")


def comparable_stored(config_data: Mapping[str, Any]) -> dict[str, Any]:
    """A stored config without what a resumption may change, its warm-up and evaluations as they resolve."""
    comparable = {key: value for key, value in config_data.items() if key not in (*RESUMABLE_CHANGES, *JOB_SECTIONS)}
    if isinstance(comparable.get("train"), dict) and isinstance(comparable.get("eval"), dict):
        comparable["train"], comparable["eval"] = _resolved_schedule(comparable["train"], comparable["eval"])
    return comparable


def _resolved_schedule(train: dict[str, Any], evaluation: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The train and eval sections with a ratio or point count written as the fixed steps it comes to where
    every run has train.steps (no train.epochs), and a setting a fixed one overrides cleared: so a run stored
    with warmup_steps 50 and eval.every 25 of 500 steps is the same run as one of warmup_ratio 0.1 and 20
    eval.points, as config_read resolves them."""
    train, evaluation = dict(train), dict(evaluation)
    steps, per_run_length = train.get("steps") or 0, bool(train.get("epochs"))
    if train.get("warmup_steps"):
        train["warmup_ratio"] = 0.0
    elif train.get("warmup_ratio") and not per_run_length:
        train["warmup_steps"], train["warmup_ratio"] = warmup_steps(steps, 0, train["warmup_ratio"]), 0.0
    points = evaluation.get("points") or 0
    if evaluation.get("every"):
        evaluation["points"] = 0
    elif points and not per_run_length and steps % points == 0:  # floor(k T / P) is every T / P steps
        evaluation["every"], evaluation["points"] = steps // points, 0
    return train, evaluation
