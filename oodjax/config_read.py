"""A config read once into a ``Job``: the typed pieces the engine and the launch tools take.

Each piece of the ``Job`` is defined, and checks its own fields, in the
module that uses it; derived values are worked out here, once. Past here
nothing reads a ConfigDict; ``record``, the config as JSON, is what results
and checkpoints store and what a resumed run is compared by.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, TypeVar

from absl import logging
from ml_collections import config_dict

from oodjax import config_cli, config_fields
from oodjax.config_fields import EvaluateSettings, list_item_types, value_at
from oodjax.engine.cadence import CadenceSettings, ExportSettings, RunGroup, RunLength
from oodjax.engine.events import TrackerSettings, WandbSettings
from oodjax.engine.geometry import BatchSettings
from oodjax.engine.optimizer import OptimizerSettings
from oodjax.engine.results import RunPlan
from oodjax.engine.run_data import DataSettings
from oodjax.engine.sharding import MeshShape
from oodjax.models.loading import ModelSettings
from oodjax.models.lora import LoRAConfig
from oodjax.settings import Declared, declared
from oodjax.usage_errors import ConfigError

_Piece = TypeVar("_Piece")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job(EvaluateSettings):
    """One config, resolved: what ``oodjax.main``, ``oodjax.evaluate`` and the launch tools run."""

    model: ModelSettings
    lora: LoRAConfig
    data: DataSettings
    batches: BatchSettings
    optimizer: OptimizerSettings
    runs: RunPlan
    mesh: MeshShape
    cadence: CadenceSettings
    export: ExportSettings
    trackers: TrackerSettings
    record: Mapping[str, Any]  # the config as JSON: what results and checkpoints store
    description: str  # the config as a job logs it at start (``config_cli.describe_config``)
    groups: tuple[RunGroup, ...]  # the runs by length, shortest first: what trains together
    # every declared setting by its path: what a resumed run is compared by
    settings: Mapping[str, Declared] = dataclasses.field(default_factory=config_fields.settings, repr=False)

    def log_config(self) -> None:
        """Logs the config the job runs, once its runs are locked: a job refused for a bad config or a locked
        run says so in its one line, with nothing before it."""
        logging.info("config (command-line overrides applied):\n%s", self.description)


def piece(cls: type[_Piece], config: config_dict.ConfigDict, **given: Any) -> _Piece:
    """``cls`` built from the settings it declares, read from ``config``; ``given`` sets its other fields. A
    piece's own ValueError (LoRAConfig's) is a ConfigError naming its section."""
    values = {
        setting.name: setting.piece_value(_plain(value_at(config, setting.path)))
        for setting in declared(cls)
        if setting.name not in given
    }
    try:
        return cls(**values, **given)
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"{declared(cls)[0].path.split('.')[0]}: {error}") from error


def _plain(value: Any) -> Any:
    return value.to_dict() if isinstance(value, config_dict.ConfigDict) else value


def read(config: config_dict.ConfigDict) -> Job:
    """``config`` read into a ``Job`` without the checks that look at files, hubs and logins: what the
    estimator and the preflight use for configs of machines they are not on."""
    _check_fields(config)
    model = piece(ModelSettings, config)
    data = piece(DataSettings, config)
    runs = piece(RunPlan, config, model=model.name, train_set=data.train_set)
    batches = piece(BatchSettings, config, max_length=data.max_length)
    optimizer, cadence = piece(OptimizerSettings, config), piece(CadenceSettings, config)
    wandb = piece(WandbSettings, config, group=config.wandb.group or f"{model.name}_{data.train_set}")
    return Job(
        **dataclasses.asdict(piece(EvaluateSettings, config)),
        model=model,
        lora=piece(LoRAConfig, config),
        data=data,
        batches=batches,
        optimizer=optimizer,
        runs=runs,
        mesh=piece(MeshShape, config),
        cadence=cadence,
        export=piece(ExportSettings, config),
        trackers=piece(TrackerSettings, config, wandb=wandb if wandb.enabled else None),
        record=json.loads(config.to_json()),
        description=config_cli.describe_config(config),
        groups=_run_groups(piece(RunLength, config), runs, batches, optimizer, cadence),
    )


def _run_groups(
    length: RunLength, plan: RunPlan, batches: BatchSettings, optimizer: OptimizerSettings, cadence: CadenceSettings
) -> tuple[RunGroup, ...]:
    """The runs by length, each group's optimizer and cadence built for it. Runs of one length train together,
    each length apart, so each run trains exactly as in a job of its length alone. Each group's pieces are
    checked, errors naming the fields (and the runs, with train.epochs)."""
    by_length = collections.defaultdict(list)
    for run in plan.runs():
        by_length[length.total_steps(run.shots, batches.batch_size)].append(run)
    groups = []
    for total_steps, runs in sorted(by_length.items()):
        try:
            groups.append(RunGroup(total_steps, tuple(runs), optimizer.build(total_steps), cadence.build(total_steps)))
            if length.epochs:
                _check_fixed_lengths(groups[-1], optimizer, cadence)
        except ConfigError as error:
            if not length.epochs:
                raise
            shots = ", ".join(map(str, sorted({run.shots for run in runs})))
            raise ConfigError(
                f"{error} (runs of {shots} shots train ceil(train.epochs x shots / train.batch_size) = "
                f"{total_steps} steps)"
            ) from None
    return tuple(groups)


# With train.epochs, a fixed warm-up or evaluation interval that fits one run length can swamp or starve
# another: the most of a run a fixed warm-up may take, and the fewest evaluations (step 0's among them) a fixed
# eval.every may leave it.
MAX_FIXED_WARMUP_SHARE = 0.25
MIN_FIXED_EVALUATIONS = 10


def _check_fixed_lengths(group: RunGroup, optimizer: OptimizerSettings, cadence: CadenceSettings) -> None:
    """A fixed train.warmup_steps or eval.every, set for one length, refused on a run of another it does not fit
    (with train.epochs): the ratio and eval.points follow each run's own length instead."""
    steps = group.total_steps
    assert group.optimizer is not None  # a group read from a config trains
    warmup = group.optimizer.warmup_steps
    if optimizer.warmup_steps and warmup > MAX_FIXED_WARMUP_SHARE * steps:
        raise ConfigError(
            f"train.warmup_steps={warmup} would take {warmup / steps:.0%} of a run of {steps} steps, more than "
            f"{MAX_FIXED_WARMUP_SHARE:.0%}: set train.warmup_steps=0 for train.warmup_ratio, a share of each run's "
            "own steps"
        )
    evaluations = len(group.cadence.evaluated_steps())
    if cadence.eval_every and evaluations < MIN_FIXED_EVALUATIONS:
        raise ConfigError(
            f"eval.every={cadence.eval_every} would leave a run of {steps} steps {evaluations} evaluations, step 0's "
            f"among them, fewer than {MIN_FIXED_EVALUATIONS}: set eval.every=0 for eval.points, evaluations spread "
            "over each run's own steps"
        )


def _check_fields(config: config_dict.ConfigDict) -> None:
    """What ``read`` checks before it builds the pieces, which check their own values: list items' types (a
    config file's runs.seeds=("0",) is not seed 0), and an empty output_dir (a path reads it as ".")."""
    for field, item_type in list_item_types().items():
        value = value_at(config, field)
        if not isinstance(value, (tuple, list)) or not all(
            isinstance(item, item_type) and not isinstance(item, bool) for item in value
        ):
            raise ConfigError(f"{field} must be a list of {item_type.__name__}, got {value!r}")
    if not config.output_dir:
        raise ConfigError("output_dir is empty")
