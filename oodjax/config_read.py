"""A config read once into a ``Job``: the typed pieces the engine and the launch tools take.

Each piece of the ``Job`` is defined, and checks its own fields, in the
module that uses it; derived values are worked out here, once. Past here
nothing reads a ConfigDict; ``record``, the config as JSON, is what results
and checkpoints store and what a resumed run is compared by.
"""

from __future__ import annotations

import collections
import dataclasses
import fractions
import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any, TypeVar

from absl import logging
from ml_collections import config_dict

from analysis import schema
from oodjax import config_cli
from oodjax.config_fields import LIST_ITEM_TYPES
from oodjax.data.testsets import TestsetSpec, testset_table
from oodjax.engine.cadence import CadenceSettings, ExportSettings, RunGroup
from oodjax.engine.events import TrackerSettings, WandbSettings
from oodjax.engine.geometry import BatchSettings
from oodjax.engine.optimizer import OptimizerSettings
from oodjax.engine.results import RunPlan, model_name
from oodjax.engine.run_data import DataSettings
from oodjax.engine.sharding import MeshShape
from oodjax.models.loading import ModelSettings
from oodjax.models.lora import LoRAConfig
from oodjax.usage_errors import ConfigError, MissingInputError

_Piece = TypeVar("_Piece")


@dataclasses.dataclass(frozen=True)
class Job:
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
    adapters: tuple[pathlib.Path, ...]  # PEFT adapter folders oodjax.evaluate evaluates (model.adapters)
    in_context: bool  # oodjax.evaluate: the in-context baseline (eval.in_context)
    record: Mapping[str, Any]  # the config as JSON: what results and checkpoints store
    description: str  # the config as a job logs it at start (``config_cli.describe_config``)
    groups: tuple[RunGroup, ...]  # the runs by length, shortest first: what trains together

    def __post_init__(self) -> None:
        if self.in_context and self.adapters:
            raise ConfigError(
                "eval.in_context=True evaluates the base model in context, so model.adapters must be empty; "
                "evaluate the adapters in a call of their own"
            )

    def log_config(self) -> None:
        """Logs the config the job runs, once its runs are locked: a job refused for a bad config or a locked
        run says so in its one line, with nothing before it."""
        logging.info("config (command-line overrides applied):\n%s", self.description)


def _lora(lora: config_dict.ConfigDict) -> LoRAConfig:
    try:
        return LoRAConfig.from_config(lora)
    except ValueError as error:
        raise ConfigError(f"lora: {error}") from error


def _piece(cls: type[_Piece], section: config_dict.ConfigDict, **given: Any) -> _Piece:
    """``cls`` built from the fields of a config section named as its own, lists as tuples, an empty value as
    None where the field's default is None (model.path "" is no checkpoint); ``given`` sets the others."""
    values = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]  # every piece is a dataclass
        if field.name in section and field.name not in given:
            value = section[field.name]
            value = tuple(value) if isinstance(value, (list, tuple)) else value
            values[field.name] = None if field.default is None and not value else value
    return cls(**values, **given)


def read(config: config_dict.ConfigDict) -> Job:
    """``config`` read into a ``Job`` without the checks that look at files, hubs and logins: what the
    estimator and the preflight use for configs of machines they are not on."""
    _check_fields(config)
    model, data, train = config.model, config.data, config.train
    name = model_name(model.name, model.path, model.hf_config.get("model_type", ""))
    wandb = config.wandb
    if train.epochs < 0:
        raise ConfigError(f"train.epochs must be >= 0 (0: train.steps), got {train.epochs}")
    runs = _piece(
        RunPlan, config.runs, model=name, train_set=data.train_set, output_dir=pathlib.Path(config.output_dir)
    )
    optimizer = _piece(OptimizerSettings, train)
    eval_points = 0 if config.eval.every else config.eval.points  # a fixed eval.every wins
    cadence = _piece(CadenceSettings, config, eval_every=config.eval.every, eval_points=eval_points)
    return Job(
        model=_piece(
            ModelSettings,
            model,
            name=name,
            tokenizer=config.tokenizer or model.path,
            hf_config=model.hf_config.to_dict(),
        ),
        lora=_lora(config.lora),
        data=_piece(DataSettings, data, table=declared_testsets(data)),
        batches=_piece(
            BatchSettings,
            train,
            max_length=data.max_length,
            eval_batch_size=config.eval.batch_size,
            buckets=tuple(data.buckets) or None,
            eval_row_lengths=tuple(config.eval.row_lengths) or None,
        ),
        optimizer=optimizer,
        runs=runs,
        mesh=MeshShape(config.mesh.data, config.mesh.fsdp, config.mesh.tensor),
        cadence=cadence,
        export=_piece(ExportSettings, config.export),
        trackers=TrackerSettings(
            wandb=_piece(WandbSettings, wandb, group=wandb.group or f"{name}_{data.train_set}")
            if wandb.enabled
            else None,
            tensorboard=config.tensorboard.enabled,
        ),
        adapters=tuple(pathlib.Path(path).expanduser() for path in model.adapters),
        in_context=config.eval.in_context,
        record=json.loads(config.to_json()),
        description=config_cli.describe_config(config),
        groups=_run_groups(config, runs, optimizer, cadence),
    )


def _run_groups(
    config: config_dict.ConfigDict, plan: RunPlan, optimizer: OptimizerSettings, cadence: CadenceSettings
) -> tuple[RunGroup, ...]:
    """The runs by length, each group's optimizer and cadence built for it: train.steps, or with train.epochs
    ceil(epochs x shots / batch_size) (epochs read as the decimal it was written as, so 0.1 x 30 / 3 is 1 step,
    not 2). Runs of one length train together, each length apart, so each run trains exactly as in a job of its
    length alone. Each group's pieces are checked, errors naming the fields (and the runs, with train.epochs)."""
    train, by_length = config.train, collections.defaultdict(list)
    for run in plan.runs():
        epochs = fractions.Fraction(str(train.epochs)) * run.shots / train.batch_size
        by_length[math.ceil(epochs) if train.epochs else train.steps].append(run)
    groups = []
    for total_steps, runs in sorted(by_length.items()):
        try:
            groups.append(RunGroup(total_steps, tuple(runs), optimizer.build(total_steps), cadence.build(total_steps)))
            if train.epochs:
                _check_fixed_lengths(groups[-1], config)
        except ConfigError as error:
            if not train.epochs:
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


def _check_fixed_lengths(group: RunGroup, config: config_dict.ConfigDict) -> None:
    """A fixed train.warmup_steps or eval.every, set for one length, refused on a run of another it does not fit
    (with train.epochs): the ratio and eval.points follow each run's own length instead."""
    steps = group.total_steps
    assert group.optimizer is not None  # a group read from a config trains
    warmup = group.optimizer.warmup_steps
    if config.train.warmup_steps and warmup > MAX_FIXED_WARMUP_SHARE * steps:
        raise ConfigError(
            f"train.warmup_steps={warmup} would take {warmup / steps:.0%} of a run of {steps} steps, more than "
            f"{MAX_FIXED_WARMUP_SHARE:.0%}: set train.warmup_steps=0 for train.warmup_ratio, a share of each run's "
            "own steps"
        )
    evaluations = len(group.cadence.evaluated_steps())
    if config.eval.every and evaluations < MIN_FIXED_EVALUATIONS:
        raise ConfigError(
            f"eval.every={config.eval.every} would leave a run of {steps} steps {evaluations} evaluations, step 0's "
            f"among them, fewer than {MIN_FIXED_EVALUATIONS}: set eval.every=0 for eval.points, evaluations spread "
            "over each run's own steps"
        )


def _check_fields(config: config_dict.ConfigDict) -> None:
    """What ``read`` checks before it builds the pieces, which check their own values: list items' types (a
    config file's runs.seeds=("0",) is not seed 0), and an empty output_dir (a path reads it as ".")."""
    for field, item_type in LIST_ITEM_TYPES.items():
        section, _, key = field.rpartition(".")
        value = config[section][key]
        if not isinstance(value, (tuple, list)) or not all(
            isinstance(item, item_type) and not isinstance(item, bool) for item in value
        ):
            raise ConfigError(f"{field} must be a list of {item_type.__name__}, got {value!r}")
    if not config.output_dir:
        raise ConfigError("output_dir is empty")


def declared_testsets(data: config_dict.ConfigDict) -> dict[str, TestsetSpec]:
    """The built-in and declared testsets of a data section (``testset_table``); a bad declaration is a
    ``ConfigError`` naming it and its field, a missing file a ``MissingInputError``."""
    if not isinstance(data.extra_testsets, config_dict.ConfigDict):
        raise ConfigError(f"data.extra_testsets must be a dict of testset declarations, got {data.extra_testsets!r}")
    if data.extra_testsets_file and not pathlib.Path(data.extra_testsets_file).expanduser().is_file():
        raise MissingInputError(f"data.extra_testsets_file {data.extra_testsets_file!r} is not a file")
    try:
        table = testset_table(data.extra_testsets.to_dict(), data.extra_testsets_file or None)
    except ValueError as error:  # the message names the declaration and its field
        raise ConfigError(str(error)) from error
    if schema.TRAIN_TESTSET in table:
        raise ConfigError(
            f"{table[schema.TRAIN_TESTSET].origin}: {schema.TRAIN_TESTSET!r} is the results' name for each run's "
            "own training set; name the testset otherwise"
        )
    return table
