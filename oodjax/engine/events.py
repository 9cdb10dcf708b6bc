"""Live metrics of one run: a JSON-lines event log, and Weights & Biases when enabled.

metrics.npz is the result; this is what one watches while a sweep runs
(`tail -f <run_dir>/events.jsonl`, or the W&B dashboard the original study
used). Lines are appended and flushed as they come, so a crash keeps all of
them; after a resume, steps between the last checkpoint and the crash appear
twice, the later line being the one the results hold.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import time
from collections.abc import Mapping
from typing import Any

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends `{"step", "time", <metric>: value, ...}` lines to `<run_dir>/events.jsonl`."""

    def __init__(
        self,
        run_dir: str | pathlib.Path,
        *,
        run_name: str,
        config: Mapping[str, Any],
        wandb_project: str | None = None,
    ):
        """`wandb_project` set = also log to that W&B project (wandb imported only then)."""
        run_dir = pathlib.Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / EVENTS_FILE
        self._file = self.path.open("a", encoding="utf-8")
        self._wandb_run = None
        if wandb_project is not None:
            import wandb  # optional dependency: only needed when enabled

            self._wandb_run = wandb.init(
                project=wandb_project,
                name=run_name,
                config=dict(config),
                dir=str(run_dir),
                reinit="create_new",  # several runs live in one process
            )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Records metrics such as {"train/loss": 0.7} or {"accuracy/hans": 0.5} at `step`."""
        record = {"step": int(step), "time": time.time()}
        record.update({key: float(value) for key, value in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(dict(metrics), step=int(step))

    def close(self) -> None:
        self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()


def wandb_available() -> bool:
    """Whether wandb can be imported, checked without importing it."""
    return importlib.util.find_spec("wandb") is not None
