"""Each run's own checkpoints, so that runs resume one by one whatever else a job trains.

`<run_dir>/checkpoints/<step>/` holds one run's slice of the run-stacked
``TrainState`` (orbax item ``runs``) and the loop's JSON state for it (item
``loop``); the frozen base is never saved. The data-iterator state is the
same in every process (each draws the whole global stream and keeps its own
rows), so the primary's copy serves every one.

orbax renames a step into place only once complete, so an interrupted write
is never listed; a checkpoint damaged later fails to restore and
``restore_newest`` takes the next older one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import pathlib
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from oodjax.engine.steps import TrainState, select_run
from oodjax.storage import reporting_full_disk, silence_library_full_disk_reports

CHECKPOINT_DIR = "checkpoints"  # <run_dir>/checkpoints/<step>/
DAMAGED_SUFFIX = ".damaged"  # a step that failed to restore, set aside as <step>.damaged-<time>
_ARRAYS, _LOOP = "runs", "loop"  # the items of a step
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # how orbax names a step being written (a folder it renames when done)


def _drop_closed_loop_callbacks(report: Any, previous: Callable[[Any], None]) -> None:
    """Drops TensorStore's calls into an event loop orbax closed, ``sys.unraisablehook``'s other reports passed on.

    A failed save (a full disk) raises the first failed write of orbax's
    gather and orbax closes that save's event loop; each write still in flight
    then calls back into the closed loop from TensorStore's thread, which
    Python reports as a bare "Event loop is closed" traceback, dozens per save.
    Only such a report is dropped: that error, raised by ``call_soon_threadsafe``
    called from native code (no Python frame of a caller).
    """
    frame = report.exc_traceback
    if not (
        report.exc_type is RuntimeError
        and str(report.exc_value) == "Event loop is closed"
        and frame is not None
        and frame.tb_frame.f_code is asyncio.BaseEventLoop.call_soon_threadsafe.__code__
    ):
        previous(report)


def drop_closed_loop_callbacks() -> None:
    """Installs ``_drop_closed_loop_callbacks`` once in front of the process's ``sys.unraisablehook``."""
    if getattr(sys.unraisablehook, "func", None) is not _drop_closed_loop_callbacks:
        sys.unraisablehook = functools.partial(_drop_closed_loop_callbacks, previous=sys.unraisablehook)


class CheckpointsUnusableError(RuntimeError):
    """Every checkpoint of a run fails to restore."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """A run's newest checkpoint that restored, and the newer ones that did not."""

    step: int
    loop_state: dict[str, Any]
    state: TrainState | None  # the run's slice (no run axis); None when only the loop state was read
    damaged: tuple[int, ...] = ()  # newer steps that failed to restore, newest first


def checkpoint_dir(run_dir: str | pathlib.Path) -> pathlib.Path:
    """``<run_dir>/checkpoints``, absolute (orbax wants one)."""
    return pathlib.Path(run_dir).resolve() / CHECKPOINT_DIR


def checkpoint_steps(run_dir: str | pathlib.Path) -> list[int]:
    """The steps the run has a complete checkpoint of, newest first; [] without any (nothing is created)."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))
    try:
        return sorted(manager.all_steps(), reverse=True)
    finally:
        manager.close()


def restore_newest(run_dir: str | pathlib.Path, target: TrainState | None, *, warn: bool = True) -> Restored | None:
    """The run's newest checkpoint that restores whole, older ones tried in turn; None when it has none.

    ``target`` (``run_target``) None reads the loop state alone, cheaply.
    """
    steps = checkpoint_steps(run_dir)
    if not steps:
        return None
    directory = checkpoint_dir(run_dir)
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))
    failures: list[str] = []
    try:
        for position, step in enumerate(steps):
            items = {_LOOP: ocp.args.JsonRestore()}
            if target is not None:
                items[_ARRAYS] = ocp.args.StandardRestore(target)
            try:
                restored = manager.restore(step, args=ocp.args.Composite(**items))
            except Exception as error:  # any failure to read a step: it is damaged, an older one may not be
                reason = f"{type(error).__name__}: {_first_line(error)}"
                failures.append(f"{directory / str(step)} ({reason})")
                if warn:
                    older = f"trying step {steps[position + 1]}" if position + 1 < len(steps) else "no older one"
                    logging.warning("checkpoint %s fails to restore (%s); %s", directory / str(step), reason, older)
                continue
            if failures and warn:
                logging.warning("%s: resuming from the checkpoint at step %d", run_dir, step)
            return Restored(
                step=step,
                loop_state=dict(restored[_LOOP]),
                state=restored[_ARRAYS] if target is not None else None,
                damaged=tuple(steps[:position]),
            )
    finally:
        manager.close()
    raise CheckpointsUnusableError(
        f"every checkpoint of {run_dir} fails to restore: {'; '.join(failures)}. Move {directory} away to start "
        "the run over"
    )


def set_aside(run_dir: str | pathlib.Path, step: int) -> pathlib.Path:
    """Renames a damaged step to ``<step>.damaged-<unix time>``: kept for inspection, out of the new one's way."""
    source = checkpoint_dir(run_dir) / str(step)
    return source.rename(source.with_name(f"{step}{DAMAGED_SUFFIX}-{int(time.time())}"))


def run_target(runs: TrainState) -> TrainState:
    """One run's slice of ``runs`` as abstract arrays on the current mesh, whatever mesh wrote the checkpoint."""

    def unstacked(leaf: jax.Array) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=_without_run_axis(leaf.sharding))

    step = jax.ShapeDtypeStruct(runs.step.shape, runs.step.dtype, sharding=runs.step.sharding)
    return jax.tree.map(unstacked, runs.replace(step=None)).replace(step=step)


@jax.jit
def split_runs(runs: TrainState) -> list[TrainState]:
    """Each run's slice of ``runs`` (the step is shared): one jitted program, which every process runs alike."""
    per_run = runs.replace(step=None)
    return [select_run(per_run, r).replace(step=runs.step) for r in range(runs.num_runs)]


def stack_runs(slices: Sequence[TrainState], like: TrainState) -> TrainState:
    """The run-stacked state of ``slices`` (all at one step), with ``like``'s shardings."""
    shardings = jax.tree.map(lambda leaf: leaf.sharding, like)
    return jax.jit(_stack_runs, out_shardings=shardings)(tuple(slices))


def _stack_runs(slices: tuple[TrainState, ...]) -> TrainState:
    per_run = (piece.replace(step=None) for piece in slices)
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_run).replace(step=slices[0].step)


def _without_run_axis(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return sharding  # one device: nothing to drop


def _first_line(error: BaseException) -> str:
    """An error's message cut to its first line (TensorStore's run to dozens)."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "no message"


def _remove_interrupted_saves(directory: pathlib.Path) -> None:
    """Deletes what interrupted saves left, here rather than by orbax's ``cleanup_tmp_directories``, whose
    background thread nothing waits for."""
    if jax.process_index() != 0 or not directory.is_dir():
        return
    for leftover in directory.glob(f"*{_TMP_SUFFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


class RunCheckpointer:
    """Writes one run's checkpoints, keeping the newest ``max_to_keep``.

    ``name`` keeps apart the barriers of runs saving side by side in a multi-process job.
    """

    def __init__(self, run_dir: str | pathlib.Path, *, name: str, max_to_keep: int = 2):
        if max_to_keep < 1:  # orbax reads None as "keep all" and 0 as nothing sensible
            raise ValueError(f"max_to_keep must be at least 1, got {max_to_keep}")
        self.run_dir, self.directory = run_dir, checkpoint_dir(run_dir)
        silence_library_full_disk_reports()  # a full disk is the NoSpaceError's one line, not orbax's hundreds
        drop_closed_loop_callbacks()
        _remove_interrupted_saves(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=name),
        )
        with reporting_full_disk(self.directory, lambda: "nothing was written"):
            self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState, loop_state: Mapping[str, Any]) -> None:
        """Saves asynchronously once copied to host; a save also reports the previous one's failure."""
        with reporting_full_disk(self.directory, self._intact):
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{_ARRAYS: ocp.args.StandardSave(state), _LOOP: ocp.args.JsonSave(dict(loop_state))}
                ),
                force=True,
            )

    def wait(self) -> None:
        with reporting_full_disk(self.directory, self._intact):
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            with reporting_full_disk(self.directory, self._intact):
                self._manager.close()

    def _intact(self) -> str:
        """What a failed save left, read from the disk after the failure."""
        steps = sorted(checkpoint_steps(self.run_dir))
        return f"the checkpoints at steps {steps} are intact" if steps else "there is no earlier checkpoint"
