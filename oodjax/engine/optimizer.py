"""A job's optimizer: AdamW after clipping, on the learning-rate schedule transformers gives, built for a run
length (``OptimizerSettings.build``), so one job's runs of different lengths each get their own schedule."""

from __future__ import annotations

import dataclasses
import functools
import math

import optax

from oodjax.settings import setting
from oodjax.usage_errors import ConfigError

SCHEDULES = ("linear", "cosine", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """A job's optimizer, built for a run length (``build``): its schedule spans the runs it trains."""

    learning_rate: float = setting(1e-4, path="train.learning_rate")  # peak, after warm-up
    # A fixed linear warm-up from 0 to the peak, in steps, then
    # train.schedule; 0 = train.warmup_ratio (both 0: no warm-up). With
    # train.epochs, one that would take more than a quarter of a run is
    # refused: a ratio follows each run's own length.
    warmup_steps: int = setting(0, path="train.warmup_steps", resumable=True)
    # The warm-up as a share of each run's own steps, rounded up
    # (transformers' warmup_ratio), unless train.warmup_steps is set: 0.1 is
    # DL2024's (docs/protocol.md), 50 steps of 500.
    warmup_ratio: float = setting(0.1, path="train.warmup_ratio", resumable=True)
    # The learning rate after warm-up, to train.steps (optax's schedules, as
    # transformers' get_*_schedule_with_warmup): "linear" decays linearly to
    # 0 (the study's), "cosine" follows a half cosine to 0, "constant" stays
    # at the peak. A run resumes only with the schedule it started with.
    schedule: str = setting("linear", path="train.schedule")
    weight_decay: float = setting(0.0, path="train.weight_decay")  # AdamW decoupled weight decay
    max_grad_norm: float = setting(1.0, path="train.max_grad_norm")  # global-norm clipping; 0 = off

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:  # a negative one climbs the loss (and zero trains nothing)
            raise ConfigError(f"train.learning_rate must be positive, got {self.learning_rate}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"train.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not 0 <= self.warmup_ratio <= 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1] (0: no warm-up), got {self.warmup_ratio}")

    def build(self, total_steps: int) -> Optimizer:
        """The optimizer of runs of ``total_steps`` steps."""
        return Optimizer(self, total_steps, warmup_steps(total_steps, self.warmup_steps, self.warmup_ratio))


def warmup_steps(total_steps: int, fixed: int, ratio: float) -> int:
    """The warm-up of a run of ``total_steps``: a fixed one wins, else ``ratio`` of the steps rounded up, as
    transformers' ``TrainingArguments.get_warmup_steps`` has it."""
    return fixed if fixed else math.ceil(ratio * total_steps)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """``OptimizerSettings`` built for runs of ``total_steps``; ``learning_rate_schedule`` is also read on the
    host for the log."""

    settings: OptimizerSettings
    total_steps: int
    warmup_steps: int

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ConfigError(f"train.steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ConfigError(
                f"train.warmup_steps must be in [0, train.steps={self.total_steps}], got {self.warmup_steps}"
            )

    @functools.cached_property
    def learning_rate_schedule(self) -> optax.Schedule:
        """The learning rate per optimizer step, as transformers' get_*_schedule_with_warmup give it (so the
        first update uses rate 0 when there is warm-up)."""
        peak, warmup, schedule = self.settings.learning_rate, self.warmup_steps, self.settings.schedule
        decay_steps = max(self.total_steps - warmup, 1)
        if schedule == "linear":
            decay = optax.linear_schedule(peak, 0.0, decay_steps)
        elif schedule == "cosine":
            decay = optax.cosine_decay_schedule(peak, decay_steps)
        else:
            decay = optax.constant_schedule(peak)
        if not warmup:
            return decay
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])

    @functools.cached_property
    def transformation(self) -> optax.GradientTransformation:
        """torch's AdamW defaults after global-norm clipping (none when ``max_grad_norm`` is 0)."""
        settings = self.settings
        adamw = optax.adamw(self.learning_rate_schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=settings.weight_decay)
        if not settings.max_grad_norm:
            return adamw
        return optax.chain(optax.clip_by_global_norm(settings.max_grad_norm), adamw)


def make_optimizer(
    learning_rate: float,
    total_steps: int,
    warmup_steps: int,
    weight_decay: float,
    max_grad_norm: float,
    schedule: str = "linear",
) -> optax.GradientTransformation:
    """``Optimizer.transformation`` of these settings."""
    settings = OptimizerSettings(learning_rate, warmup_steps, 0.0, schedule, weight_decay, max_grad_norm)
    return settings.build(total_steps).transformation
