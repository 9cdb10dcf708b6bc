"""Each run's own checkpoints, so that runs resume one by one whatever else a job trains.

`<run_dir>/checkpoints/<step>/` holds one run at one step: its slice of the
run-stacked ``TrainState`` (adapters, optimizer state, dropout key data, the
step counter; orbax item ``runs``), and a JSON record of the loop's state
for it (item ``loop``: its partial loss sum, its data-iterator state, the
config it was started with, whether the evaluation of that step is still
to do). The frozen base is never saved: it is reloaded from its source. A
job that gains runs (seeds, shot counts) resumes its old ones and starts
the new ones; one that loses runs leaves theirs alone.

The data-iterator state is grain's count of training steps handed out
(``{"next_index": k}``). Every process draws the same global stream and
keeps its own rows of each step (``oodjax.data.train_steps``' ``rows``), so
the state is the same in all of them and the primary's copy serves every one.

Integrity: orbax writes a step into a temporary directory and renames it
once every item, arrays and JSON alike, is complete, so an interrupted
write is never listed as a checkpoint (its leftovers are removed when a
later job starts saving). A checkpoint damaged after the fact (a truncated
file) fails to restore: ``restore_newest`` names it, warns, and takes the
next older one. A full disk raises ``NoSpaceError`` naming the checkpoint
being written, the older ones intact, once the writes still in flight end
(``_run_sync_via_new_loop``), so nothing else is printed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import pathlib
import shutil
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec
from orbax.checkpoint._src import asyncio_utils

from oodjax.engine.steps import TrainState
from oodjax.storage import reporting_full_disk, silence_library_full_disk_reports

CHECKPOINT_DIR = "checkpoints"  # <run_dir>/checkpoints/<step>/
DAMAGED_SUFFIX = ".damaged"  # a step that failed to restore, set aside as <step>.damaged-<time>
_ARRAYS, _LOOP = "runs", "loop"  # the items of a step
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # how orbax names a step being written (a folder it renames when done)


def _run_sync_via_new_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """orbax's ``asyncio_utils._run_sync_via_new_loop`` (which runs each save's and restore's writes and reads),
    but a failure waits for the loop's other tasks before the loop is closed.

    orbax gathers its TensorStore writes; a gather raises the first failure
    (on a full disk, ENOSPC) while the others are in flight, and orbax's own
    version closes the loop at once: each write ending later calls back into
    the closed loop, and TensorStore reports that through ``sys.unraisablehook``
    as a bare "RuntimeError: Event loop is closed" traceback, dozens per failed
    save. The others' errors are dropped; the first is raised.
    """
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(coro)
        except Exception:
            if in_flight := asyncio.all_tasks(loop):
                loop.run_until_complete(asyncio.gather(*in_flight, return_exceptions=True))
            raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()


# Replaced only on the orbax it was read against (requirements.txt's pin): elsewhere a full disk may print
# those tracebacks again, and nothing else changes.
if importlib.metadata.version("orbax-checkpoint") == "0.12.8":
    asyncio_utils._run_sync_via_new_loop = _run_sync_via_new_loop  # read by orbax's run_sync at each call


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
    """Where a run's checkpoints are: ``<run_dir>/checkpoints``, as an absolute path (orbax wants one)."""
    return pathlib.Path(run_dir).resolve() / CHECKPOINT_DIR


def checkpoint_steps(run_dir: str | pathlib.Path) -> list[int]:
    """The steps the run has a complete checkpoint of, newest first; [] without any (nothing is created)."""
    return _complete_steps(checkpoint_dir(run_dir))


def _complete_steps(directory: pathlib.Path) -> list[int]:
    if not directory.is_dir():
        return []
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))
    try:
        return sorted(manager.all_steps(), reverse=True)
    finally:
        manager.close()


def restore_newest(run_dir: str | pathlib.Path, target: TrainState | None, *, warn: bool = True) -> Restored | None:
    """The run's newest checkpoint that restores whole; None when it has none.

    ``target`` (``run_target``) gives the shapes, dtypes and shardings of
    the run's slice; None reads the loop state alone (cheap: the config
    check before anything is loaded). A checkpoint that fails is named in a
    warning (unless ``warn`` is False) and the next older one is tried; when
    all fail, ``CheckpointsUnusableError`` names each with its error.
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
    """Renames a damaged step to ``<step>.damaged-<unix time>``: kept for inspection, no longer a checkpoint,
    and out of the way of the step's new checkpoint when the run gets there again."""
    source = checkpoint_dir(run_dir) / str(step)
    destination = source.with_name(f"{step}{DAMAGED_SUFFIX}-{int(time.time())}")
    source.rename(destination)
    return destination


def run_target(runs: TrainState) -> TrainState:
    """One run's slice of ``runs`` as shapes, dtypes and shardings (the run axis dropped): what a run's
    checkpoint restores into, on the current mesh whatever mesh wrote it."""

    def unstacked(leaf: jax.Array) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=_without_run_axis(leaf.sharding))

    return runs.replace(
        lora=jax.tree.map(unstacked, runs.lora),
        opt_state=jax.tree.map(unstacked, runs.opt_state),
        rng=unstacked(runs.rng),
        step=jax.ShapeDtypeStruct(runs.step.shape, runs.step.dtype, sharding=runs.step.sharding),
    )


def split_runs(runs: TrainState) -> list[TrainState]:
    """Each run's slice of ``runs`` (its leaves without the run axis; the shared step as it is).

    One jitted program (compiled once per run count), which every process
    runs alike on a multi-process mesh.
    """
    return _split_runs(runs)


def stack_runs(slices: Sequence[TrainState], like: TrainState) -> TrainState:
    """The run-stacked state of ``slices`` (one per run, all at one step: the first's is kept), with
    ``like``'s shardings."""
    shardings = jax.tree.map(lambda leaf: leaf.sharding, like)
    return jax.jit(_stack_runs, out_shardings=shardings)(tuple(slices))


@jax.jit
def _split_runs(runs: TrainState) -> list[TrainState]:
    return [
        runs.replace(
            lora=jax.tree.map(lambda leaf: leaf[r], runs.lora),
            opt_state=jax.tree.map(lambda leaf: leaf[r], runs.opt_state),
            rng=runs.rng[r],
        )
        for r in range(runs.num_runs)
    ]


def _stack_runs(slices: tuple[TrainState, ...]) -> TrainState:
    def stacked(*leaves: jax.Array) -> jax.Array:
        return jnp.stack(leaves)

    first = slices[0]
    return first.replace(
        lora=jax.tree.map(stacked, *(piece.lora for piece in slices)),
        opt_state=jax.tree.map(stacked, *(piece.opt_state for piece in slices)),
        rng=jnp.stack([piece.rng for piece in slices]),
    )


def _without_run_axis(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return sharding  # one device: nothing to drop


def _first_line(error: BaseException) -> str:
    """An error's message cut to its first line (TensorStore's run to dozens)."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "no message"


def _remove_interrupted_saves(directory: pathlib.Path) -> None:
    """Deletes what interrupted saves left (orbax's ``<step>.orbax-checkpoint-tmp*`` folders, never read as
    checkpoints), before a job saves again. Here rather than through orbax's ``cleanup_tmp_directories``,
    which deletes in a background thread that nothing waits for. Process 0 deletes; no save is in flight yet."""
    if jax.process_index() != 0 or not directory.is_dir():
        return
    for leftover in directory.glob(f"*{_TMP_SUFFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


class RunCheckpointer:
    """Writes one run's checkpoints under ``<run_dir>/checkpoints``, keeping the newest ``max_to_keep``
    (``config.checkpoint_keep``; at least 1), older ones deleted as new ones are complete.

    ``name`` (the run's) keeps the barriers of several runs' managers,
    saving side by side in a multi-process job, apart.
    """

    def __init__(self, run_dir: str | pathlib.Path, *, name: str, max_to_keep: int = 2):
        if max_to_keep < 1:  # orbax reads None as "keep all" and 0 as nothing sensible
            raise ValueError(f"max_to_keep must be at least 1, got {max_to_keep}")
        self.directory = checkpoint_dir(run_dir)
        silence_library_full_disk_reports()  # a full disk is the NoSpaceError's one line, not orbax's hundreds
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
        """Saves the run's slice ``state`` and ``loop_state`` (JSON data) at ``step``.

        The arrays are written asynchronously once copied to host, so
        training continues; the step becomes visible only when complete. A
        save also reports the failure of the previous one.
        """
        with reporting_full_disk(self.directory, self._intact):
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{_ARRAYS: ocp.args.StandardSave(state), _LOOP: ocp.args.JsonSave(dict(loop_state))}
                ),
                force=True,
            )

    def wait(self) -> None:
        """Blocks until every started save is complete on disk (raising what failed)."""
        with reporting_full_disk(self.directory, self._intact):
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, then releases the manager (whose own wait reports a full disk again)."""
        try:
            self.wait()
        finally:
            with reporting_full_disk(self.directory, self._intact):
                self._manager.close()

    def _intact(self) -> str:
        """What a failed save left, read from the disk after the failure."""
        steps = sorted(_complete_steps(self.directory))
        return f"the checkpoints at steps {steps} are intact" if steps else "there is no earlier checkpoint"
