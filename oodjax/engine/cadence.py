"""The run loop's settings (when it evaluates, checkpoints, logs, exports), which the job reads, not the loop,
and the run groups the job's runs train in, each with the cadence and optimizer of its length."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from oodjax.data.testsets import HUB_ID
from oodjax.usage_errors import ConfigError

if TYPE_CHECKING:
    from oodjax.engine.optimizer import Optimizer
    from oodjax.engine.results import Run


@dataclasses.dataclass(frozen=True)
class CadenceSettings:
    """When a job's runs are evaluated, checkpointed and logged, as the config says it; ``build`` gives the
    ``Cadence`` of a run length."""

    eval_every: int = 25  # step 0, every eval_every steps and the last step are evaluated
    eval_points: int = 0  # if > 0 instead: step 0 and this many steps spread over total_steps (all of fewer)
    checkpoint_every: int = 100  # and the last step
    checkpoint_keep: int = 2  # the newest checkpoints kept per run
    log_every: int = 10

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
        if self.eval_points:
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
    """Whether a job writes its runs' adapters in PEFT format (<run_dir>/adapter/), when, and where it pushes
    them."""

    peft: bool = False  # when training ends
    every_checkpoint: bool = False  # also at every checkpoint
    hub_repo: str | None = None  # a hub repo the exports are pushed to, a folder per run

    def __post_init__(self) -> None:
        if (self.every_checkpoint or self.hub_repo) and not self.peft:
            raise ConfigError("export.every_checkpoint and export.hub_repo need export.peft=True")
        if self.hub_repo and not HUB_ID.fullmatch(self.hub_repo):
            raise ConfigError(f"export.hub_repo {self.hub_repo!r} is not a hub repo id (user/name)")


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
