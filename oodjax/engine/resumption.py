"""Where each run of a job stands before it trains, and whether it may go on.

Runs are the unit of resumption: each is finished (skipped), part-way
(resumed from its newest intact checkpoint) or new. A stored run whose
resolved plan (steps, warm-up, evaluated steps) or a setting that is not
declared resumable differs from the job's is refused before anything is
created.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from absl import logging
from jax.experimental import multihost_utils

from analysis import schema
from oodjax.engine import checkpoints, results
from oodjax.engine.cadence import CadenceSettings, RunGroup, RunLength
from oodjax.engine.distributed import is_primary
from oodjax.engine.optimizer import warmup_steps
from oodjax.engine.results import Run
from oodjax.settings import Declared
from oodjax.usage_errors import ConfigError


@dataclasses.dataclass
class RunStart:
    """Where one run stands before a job trains it."""

    run: Run
    group: RunGroup  # the job's runs of its length
    finished: bool  # its metrics.npz holds the evaluation at its last step
    stored_config: Mapping[str, Any] | None  # the run's record it was trained with (None: new)
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
        return RunStart(run, group, finished=True, stored_config=progress.config)
    newest = checkpoints.restore_newest(run.directory, None, warn=False)  # its config; the arrays come later
    stored = newest.loop_state["config"] if newest is not None else None
    return RunStart(run, group, finished=False, stored_config=stored, checkpoint=newest)


def refuse_changed_config(
    record: Mapping[str, Any], settings: Mapping[str, Declared], output_dir: pathlib.Path, starts: Sequence[RunStart]
) -> None:
    """A ConfigError naming every stored run whose plan or non-resumable settings differ from the job's."""
    differing: dict[str, list[str]] = collections.defaultdict(list)
    for start in starts:
        if start.stored_config is not None and (fields := changes(start, record, settings)):
            differing["; ".join(fields)].append(start.run.name)
    if differing:
        details = " | ".join(f"{', '.join(names)}: {fields}" for fields, names in differing.items())
        raise ConfigError(
            f"{output_dir} holds runs started with another config (stored -> now: {details}); resume with "
            "the same config or use a new output_dir"
        )


def changes(start: RunStart, record: Mapping[str, Any], settings: Mapping[str, Declared]) -> list[str]:
    """``"field stored -> now"`` for the run's plan and each setting not declared resumable that differs between
    its stored record and the job's ``record``. A field the stored record lacks is at its default (it means
    what the version without it did); a section it lacks (a checkpoint's of an earlier version, which left the
    resumable ones out) is not compared."""
    assert start.stored_config is not None  # a stored run
    stored, now = _stored_plan(start.stored_config, start.run), start.group.plan()
    fields = [
        f"{schema.RUN_SECTION}.{key} {stored[key]!r} -> {now[key]!r}"
        for key in schema.RUN_PLAN
        if stored[key] != now[key]
    ]
    for path, setting in settings.items():
        section, _, key = path.rpartition(".")
        holder = start.stored_config.get(section) if section else start.stored_config
        if setting.resumable or not isinstance(holder, Mapping):
            continue
        old = holder.get(key, json.loads(json.dumps(setting.config_default)))
        if old != (new := functools.reduce(lambda node, name: node[name], path.split("."), record)):
            fields.append(f"{path} {old!r} -> {new!r}")
    return fields


def _stored_plan(stored: Mapping[str, Any], run: Run) -> dict[str, Any]:
    """The plan a stored run's section holds, or for a run written before runs stored it, the plan its train and
    eval sections resolve to, as the version that wrote it resolved them."""
    section = stored.get(schema.RUN_SECTION) or {}
    if all(key in section for key in schema.RUN_PLAN):
        return {key: section[key] for key in schema.RUN_PLAN}
    train, evaluation = stored["train"], stored["eval"]
    length = RunLength(train["steps"], train.get("epochs", 0.0))
    total = section.get(schema.RUN_STEPS) or length.total_steps(run.shots, train["batch_size"])
    cadence = CadenceSettings(eval_every=evaluation["every"], eval_points=evaluation.get("points", 0)).build(total)
    warmup = warmup_steps(total, train["warmup_steps"], train.get("warmup_ratio", 0.0))
    return dict(zip(schema.RUN_PLAN, (total, warmup, cadence.evaluated_steps())))


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
