"""Live metrics of one run: a JSON-lines event log, and Weights & Biases and TensorBoard when enabled.

metrics.npz is the result; this is what one watches while a sweep runs.
Lines are flushed as they come, so a crash keeps all of them; a resumed run
first drops the lines of the steps it redoes, so events.jsonl holds each
step once, as the results do. W&B and TensorBoard cannot take records back,
so the redone steps, which resumption makes bit-identical, go only to the
log, and a resumed run goes on in the same W&B run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import secrets
import time
from collections.abc import Mapping
from typing import Any, Literal

from oodjax.settings import setting
from oodjax.storage import write_atomic
from oodjax.usage_errors import ConfigError

EVENTS_FILE = "events.jsonl"
TENSORBOARD_DIR = "tensorboard"  # <run_dir>/tensorboard/: the run's TensorBoard event files
WANDB_MODES: tuple[Literal["online", "offline", "disabled"], ...] = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """Where a run goes in Weights & Biases: each run is its own W&B run, named as the run, streaming the mean
    training loss and gradient norm (global, before clipping) since the last line, the learning rate,
    examples/s, and every accuracy, beside each run's events.jsonl and at the same steps."""

    enabled: bool = setting(False, path="wandb.enabled", resumable=True)  # also stream metrics to Weights & Biases
    project: str = setting("oodjax", path="wandb.project", resumable=True)  # W&B project the runs are logged to
    # W&B team or user; empty = your default entity
    entity: str | None = setting(None, path="wandb.entity", resumable=True)
    # Each run is its own W&B run named as the run; the group gathers a
    # config's runs (empty = "<model>_<train_set>").
    group: str | None = setting(None, path="wandb.group", resumable=True)
    tags: tuple[str, ...] = setting((), path="wandb.tags", resumable=True)  # W&B tags of every run (strings)
    # "online", "offline" (sync later with `wandb sync`) or "disabled";
    # empty = wandb's default (the WANDB_MODE variable, else online).
    mode: str | None = setting(None, path="wandb.mode", resumable=True)

    def __post_init__(self) -> None:
        if self.mode and self.mode not in WANDB_MODES:
            raise ConfigError(f"wandb.mode must be empty (wandb's default) or one of {WANDB_MODES}, got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class TrackerSettings:
    """Where a job's metrics stream besides each run's events.jsonl: W&B (None: not) and TensorBoard."""

    wandb: WandbSettings | None = None
    # Also write TensorBoard event files to <run_dir>/tensorboard/
    # (`tensorboard --logdir <output_dir>` shows every run; the viewer is the
    # `tensorboard` extra, `pip install ".[tensorboard]"`).
    tensorboard: bool = setting(False, path="tensorboard.enabled", resumable=True)


class EventLog:
    """Appends `{"step", "time", <metric>: value, ...}` lines to `<run_dir>/events.jsonl` (and the trackers)."""

    def __init__(
        self,
        run_dir: str | pathlib.Path,
        *,
        run_name: str,
        config: Mapping[str, Any],
        kept_through: int,
        wandb: WandbSettings | None = None,
        tensorboard: bool = False,
    ):
        """Lines of steps after `kept_through` (the step the run resumes from; -1 for a fresh run) are dropped:
        the run redoes them. W&B and TensorBoard are imported only when enabled (both are optional)."""
        run_dir = pathlib.Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / EVENTS_FILE
        self._tracked = _drop_after(self.path, kept_through)  # what the trackers have of the steps to redo
        self._file = self.path.open("a", encoding="utf-8")
        self._wandb_run = None
        self._tensorboard = None
        if wandb is not None:
            import wandb as wandb_lib

            where = {key: value for key, value in dataclasses.asdict(wandb).items() if key != "enabled"}
            self._wandb_run = wandb_lib.init(
                **where | {"tags": list(wandb.tags) or None},
                name=run_name,
                config=dict(config),
                dir=str(run_dir),
                id=_wandb_id(run_dir),
                resume="allow",
                reinit="create_new",  # several runs live in one process
            )
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(logdir=str(run_dir / TENSORBOARD_DIR))

    def wandb_destination(self) -> str | None:
        """Where this log's W&B run goes, in a line for the job's log (the banner W&B would print, in short);
        None without W&B."""
        run = self._wandb_run
        if run is None:
            return None
        if run.disabled:
            return "W&B: disabled (wandb.mode or WANDB_MODE), nothing recorded"
        if run.offline:
            return "W&B: offline, in each <run_dir>/wandb/; `wandb sync <run_dir>/wandb/offline-run-*` uploads a run"
        return f"W&B: {run.project_url}, group {run.group}"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Records metrics such as {"train/loss": 0.7} or {"accuracy/hans": 0.5} at `step`."""
        values = {key: float(value) for key, value in metrics.items()}
        self._file.write(json.dumps({"step": int(step), "time": time.time(), **values}) + "\n")
        self._file.flush()
        values = {key: value for key, value in values.items() if key not in self._tracked.get(step, ())}
        if not values:
            return
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=int(step))
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, global_step=int(step))
            self._tensorboard.flush()  # as events.jsonl: what was logged survives a crash

    def close(self) -> None:
        self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _drop_after(path: pathlib.Path, step: int) -> dict[int, set[str]]:
    """Rewrites the event log at `path` (atomically) without its lines of steps after `step`, and without a
    line a crash cut short; returns the metrics of each step it dropped, which the trackers already have."""
    dropped: dict[int, set[str]] = {}
    if not path.is_file():
        return dropped
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if line.endswith("\n") and record["step"] <= step:
            kept.append(line)
        elif line.endswith("\n"):  # a line cut short never reached the trackers
            dropped.setdefault(record["step"], set()).update(set(record) - {"step", "time"})
    text = "".join(kept).encode()
    write_atomic(path, lambda file: file.write(text), intact=f"{path} is as it was")
    return dropped


def _wandb_id(run_dir: pathlib.Path) -> str:
    """The run's W&B id, made at its first start and kept in its folder, so that a resumed run goes on in it."""
    path = run_dir / "wandb" / "oodjax-run-id"
    if not path.is_file():
        run_id = secrets.token_hex(4)
        write_atomic(path, lambda file: file.write(run_id.encode()), intact=f"{path} is as it was")
    return path.read_text(encoding="utf-8").strip()


def setup_wandb(mode: str) -> str:
    """Sets W&B up for this process, in ``mode`` (empty: wandb's own), its informational lines off; returns the
    mode its runs will have. Only a process's first setup decides what W&B prints, so the config checks call it."""
    import wandb

    # ``mode``: empty, or one of WANDB_MODES (as WandbSettings checks it)
    settings = wandb.Settings(show_info=False, mode=mode) if mode in WANDB_MODES else wandb.Settings(show_info=False)
    return wandb.setup(settings).settings.mode


def installed(module: str) -> bool:
    """Whether `module` (an optional tracker: wandb, tensorboardX) can be imported, checked without importing it."""
    return importlib.util.find_spec(module) is not None
