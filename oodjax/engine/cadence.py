"""The run loop's settings (when it evaluates, checkpoints, logs, exports), which the job reads, not the loop,
and the run groups the job's runs train in, each with the cadence and optimizer of its length."""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import TYPE_CHECKING, Any

from analysis import schema
from oodjax.data.testsets import HUB_ID
from oodjax.settings import setting
from oodjax.usage_errors import ConfigError

if TYPE_CHECKING:
    from oodjax.engine.optimizer import Optimizer
    from oodjax.engine.results import Run


@dataclasses.dataclass(frozen=True)
class CadenceSettings:
    """When a job's runs are evaluated, checkpointed and logged, as the config says it; ``build`` gives the
    ``Cadence`` of a run length."""

    # Fixed steps between evaluations (step 0 and the last step always);
    # 0 = eval.points. With train.epochs, one that would leave a run fewer
    # than 10 evaluations, step 0's among them, is refused.
    eval_every: int = setting(0, path="eval.every", resumable=True)
    # Evaluations after step 0 per run, unless eval.every is set, spread
    # evenly over the run's own steps (floor(k x steps / points), k =
    # 1..points: the last is its final step; every step of a shorter run), so
    # runs of every length (train.epochs) get as many: every 25 steps of 500.
    eval_points: int = setting(20, path="eval.points", resumable=True)
    checkpoint_every: int = setting(100, path="checkpoint_every")  # steps between checkpoints (and at the end)
    # Checkpoints kept per run (<run_dir>/checkpoints/), the newest; older ones
    # are deleted as new ones are written. At least 1; 2 keeps one to fall
    # back on should the newest be damaged. May change when a run resumes.
    checkpoint_keep: int = setting(2, path="checkpoint_keep", resumable=True)
    # steps between loss lines in the log, the event log and the trackers
    log_every: int = setting(10, path="log_every", resumable=True)

    def __post_init__(self) -> None:
        # train.steps >= 1 is the optimizer's check (optimizer.Optimizer), the piece whose schedule spans it.
        for field, value in {"checkpoint_every": self.checkpoint_every, "log_every": self.log_every}.items():
            if value < 1:
                raise ConfigError(f"{field} must be >= 1, got {value}")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"checkpoint_keep must be >= 1 (checkpoints kept per run), got {self.checkpoint_keep}")
        if self.eval_points < 0:
            raise ConfigError(f"eval.points must be >= 0 (0: eval.every), got {self.eval_points}")
        if self.eval_every < 0:
            raise ConfigError(f"eval.every must be >= 0 (0: eval.points), got {self.eval_every}")
        if not self.eval_points and not self.eval_every:
            raise ConfigError(
                "eval.points and eval.every are both 0: set eval.points (evaluations spread over each run) "
                "or eval.every (steps between evaluations)"
            )

    def build(self, total_steps: int) -> Cadence:
        """The cadence of runs of ``total_steps`` steps."""
        return Cadence(total_steps=total_steps, **dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cadence(CadenceSettings):
    """The cadence of runs of one length: the one home of the rules of when they are evaluated, checkpointed
    and logged, which the estimator counts evaluations by too."""

    total_steps: int  # optimizer steps per run

    def evaluation_due(self, step: int) -> bool:
        """With eval.points P over T steps: step 0 and the steps floor(k T / P), k = 1..P, the last being T
        (every step when P >= T). A zero-step run (``oodjax.evaluate``): step 0 alone."""
        if step in (0, self.total_steps):
            return True
        if not self.eval_every:
            k = -(-step * self.eval_points // self.total_steps)  # the one k whose floor(k T / P) may be step
            return k * self.total_steps // self.eval_points == step
        return step % self.eval_every == 0

    def evaluated_steps(self) -> list[int]:
        """Every step a run is evaluated at, step 0 included."""
        return [step for step in range(self.total_steps + 1) if self.evaluation_due(step)]

    def checkpoint_due(self, step: int) -> bool:
        return step % self.checkpoint_every == 0 or step == self.total_steps

    def syncs(self, step: int) -> bool:
        """Whether the loop waits for the step's losses: at a log step, and before evaluating or checkpointing
        (export's steps are checkpoint steps)."""
        return step % self.log_every == 0 or self.evaluation_due(step) or self.checkpoint_due(step)


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    """Whether a job writes its runs' adapters in PEFT format (adapter_config.json and adapter_model.safetensors,
    for `peft.PeftModel.from_pretrained`), when, and where it pushes them."""

    # Write each run's adapters to <run_dir>/adapter/ when training ends.
    peft: bool = setting(False, path="export.peft", resumable=True)
    # Also rewrite them at every checkpoint (checkpoint_every steps).
    every_checkpoint: bool = setting(False, path="export.every_checkpoint", resumable=True)
    # A Hugging Face hub repo id ("user/name"): each export is also pushed
    # there, one folder per run (named as the run); needs the hub (not
    # HF_HUB_OFFLINE) and a token with write access. Empty = no push.
    hub_repo: str | None = setting(None, path="export.hub_repo", resumable=True)

    def __post_init__(self) -> None:
        if (self.every_checkpoint or self.hub_repo) and not self.peft:
            raise ConfigError("export.every_checkpoint and export.hub_repo need export.peft=True")
        if self.hub_repo and not HUB_ID.fullmatch(self.hub_repo):
            raise ConfigError(f"export.hub_repo {self.hub_repo!r} is not a hub repo id (user/name)")


@dataclasses.dataclass(frozen=True)
class RunLength:
    """How many optimizer steps each run trains: a fixed number, or passes over its own few-shot set."""

    steps: int = setting(500, path="train.steps", resumable=True)  # optimizer steps per run (unless train.epochs)
    # Passes over each run's few-shot set: a run trains ceil(epochs x shots /
    # batch_size) steps, so runs of more shots train longer (runs of one length
    # train together, each length after the other, on one loaded model).
    # 0 = every run trains train.steps.
    epochs: float = setting(0.0, path="train.epochs", resumable=True)

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ConfigError(f"train.epochs must be >= 0 (0: train.steps), got {self.epochs}")

    def total_steps(self, shots: int, batch_size: int) -> int:
        """train.steps, or ceil(epochs x shots / batch_size), epochs read as the decimal it was written as (so
        0.1 x 30 / 3 is 1 step, not 2)."""
        if not self.epochs:
            return self.steps
        return math.ceil(fractions.Fraction(str(self.epochs)) * shots / batch_size)


@dataclasses.dataclass(frozen=True)
class RunGroup:
    """The runs of one length, which train together (each length apart, so each run trains as in a job of its
    length alone), and what their length fixes: the optimizer's schedule and warm-up, the cadence's
    evaluations and checkpoints, and the batch layout replayed over their steps (``set_up``). A zero-step
    run (``oodjax.evaluate``) is evaluated once, at step 0, and has no optimizer."""

    total_steps: int  # optimizer steps of each run
    runs: tuple[Run, ...]
    optimizer: Optimizer | None  # built for total_steps (``OptimizerSettings.build``); None: zero steps
    cadence: Cadence  # built for total_steps (``CadenceSettings.build``)

    def plan(self) -> dict[str, Any]:
        """What the runs' length resolves to: stored in each run's section, and what a resumed run is compared
        by, whichever settings (train.epochs or .steps, a warm-up ratio or steps, eval.points or .every) gave it."""
        warmup = self.optimizer.warmup_steps if self.optimizer is not None else 0
        return dict(zip(schema.RUN_PLAN, (self.total_steps, warmup, self.cadence.evaluated_steps())))
