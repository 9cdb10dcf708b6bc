"""Checkpoints of the runs trained together, so a killed job resumes where it was.

One orbax CheckpointManager per output directory holds, at a step: every
run's adapters, optimizer state, step counter and dropout RNG (one pytree
with a leading run axis), each run's grain iterator state (so the resumed
run sees exactly the batches it would have seen), and a small JSON record of
the loop's own state (partial loss sums, the config the runs were started
with). The frozen base is never saved: it is reloaded from its source.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


class Checkpointer:
    """Keeps the newest `max_to_keep` checkpoints under `<output_dir>/checkpoints`."""

    def __init__(self, output_dir: str | pathlib.Path, *, max_to_keep: int = 2):
        directory = pathlib.Path(output_dir).resolve() / CHECKPOINT_DIR
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(
        self,
        step: int,
        runs: Any,
        iterators: Sequence[grain.DatasetIterator],
        loop_state: Mapping[str, Any],
    ) -> None:
        """Saves the state at `step`.

        The array part is written asynchronously once copied to host, so
        training continues; a checkpoint becomes visible only when complete.
        """
        self._manager.save(
            step,
            args=ocp.args.Composite(
                runs=ocp.args.StandardSave(runs),
                loop=ocp.args.JsonSave(dict(loop_state)),
                **{
                    _iterator_item(i): grain.checkpoint.CheckpointSave(iterator)
                    for i, iterator in enumerate(iterators)
                },
            ),
            force=True,
        )

    def restore(
        self, step: int, runs_like: Any, iterators: Sequence[grain.DatasetIterator]
    ) -> tuple[Any, dict[str, Any]]:
        """Returns (runs, loop_state) at `step`; the iterators are rewound in place.

        `runs_like` gives the structure, shapes, dtypes and shardings to restore
        into (the freshly initialised runs).
        """
        abstract_runs = jax.tree.map(ocp.utils.to_shape_dtype_struct, runs_like)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                runs=ocp.args.StandardRestore(abstract_runs),
                loop=ocp.args.JsonRestore(),
                **{
                    _iterator_item(i): grain.checkpoint.CheckpointRestore(iterator)
                    for i, iterator in enumerate(iterators)
                },
            ),
        )
        return restored["runs"], dict(restored["loop"])

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, then releases the manager."""
        self.wait()
        self._manager.close()


def _iterator_item(run_index: int) -> str:
    return f"data_{run_index}"
