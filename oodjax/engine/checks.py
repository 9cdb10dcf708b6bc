"""Checks of a config that must fail fast: before data is tokenised or anything is compiled.

A sweep job that dies after twenty minutes of loading on a misspelt path
wastes a cluster slot; these checks look only at the config and the file
system (and the local Hugging Face cache for hub ids when offline).
"""

from __future__ import annotations

import os
import pathlib
import re

import huggingface_hub
from ml_collections import config_dict

from configs.base import LIST_ITEM_TYPES
from oodjax.data import testset_spec
from oodjax.engine.events import WANDB_MODES, installed
from oodjax.models.checkpoint import read_json

DTYPES = ("float32", "bfloat16", "float16")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_config(config: config_dict.ConfigDict) -> None:
    """Raises a ValueError or FileNotFoundError naming the first wrong field."""
    _check_lists(config)
    _check_model(config.model)
    _check_source("tokenizer", config.tokenizer or config.model.path, "tokenizer_config.json")
    _check_data(config.data)
    _check_runs_and_training(config)
    _check_trackers(config)
    _check_export(config.export)


def _check_lists(config: config_dict.ConfigDict) -> None:
    """List fields hold items of their declared type: a config file's runs.seeds=("0",) is not seed 0."""
    for field, item_type in LIST_ITEM_TYPES.items():
        section, _, key = field.rpartition(".")
        value = config[section][key]
        if not isinstance(value, (tuple, list)) or not all(
            isinstance(item, item_type) and not isinstance(item, bool) for item in value
        ):
            raise ValueError(f"{field} must be a list of {item_type.__name__}, got {value!r}")


def _check_trackers(config: config_dict.ConfigDict) -> None:
    if config.wandb.enabled and not installed("wandb"):
        raise ValueError("wandb.enabled is True but wandb is not installed (pip install wandb)")
    if config.wandb.mode and config.wandb.mode not in WANDB_MODES:
        raise ValueError(
            f"wandb.mode must be empty (wandb's default) or one of {WANDB_MODES}, got {config.wandb.mode!r}"
        )
    if config.tensorboard.enabled and not installed("tensorboardX"):
        raise ValueError("tensorboard.enabled is True but tensorboardX is not installed (pip install tensorboardX)")


def _check_model(model: config_dict.ConfigDict) -> None:
    has_path, has_hf_config = bool(model.path), bool(model.hf_config.to_dict())
    if has_path == has_hf_config:
        raise ValueError(
            "set exactly one of model.path (a checkpoint) and model.hf_config (a random model); "
            f"got path={model.path!r} and {'a' if has_hf_config else 'no'} hf_config"
        )
    if has_hf_config and "model_type" not in model.hf_config:
        raise ValueError("model.hf_config needs a model_type (e.g. 'opt')")
    if has_path:
        _check_source("model.path", model.path, "config.json")
    for field in ("dtype", "compute_dtype"):
        value = model[field]
        if value and value not in DTYPES:
            raise ValueError(f"model.{field} must be one of {DTYPES}, got {value!r}")


def _check_source(field: str, source: str, marker_file: str) -> None:
    """A local directory holding `marker_file` (a JSON file, read), or a hub id (cached locally when offline)."""
    if not source:
        raise ValueError(f"{field} is empty: name a local directory or a hub id")
    path = pathlib.Path(source).expanduser()
    if path.is_dir():
        if not (path / marker_file).is_file():
            raise FileNotFoundError(f"{field}: directory {path} has no {marker_file}")
        try:
            read_json(path / marker_file)
        except ValueError as error:
            raise ValueError(f"{field}: {error}") from None
        return
    if not _HUB_ID.fullmatch(source):
        raise FileNotFoundError(f"{field}: {source!r} does not exist (and is not a hub id)")
    if _hub_offline() and not isinstance(huggingface_hub.try_to_load_from_cache(source, marker_file), str):
        raise FileNotFoundError(
            f"{field}: {source!r} is not a local directory, and with HF_HUB_OFFLINE set the hub id "
            "is not in the local cache either"
        )


def _hub_offline() -> bool:
    """huggingface_hub reads HF_HUB_OFFLINE once, at import; the variable may have been set since."""
    return huggingface_hub.constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE") == "1"


def _check_export(export: config_dict.ConfigDict) -> None:
    """A push to the hub that cannot happen is refused now, not after the runs have trained."""
    if (export.every_checkpoint or export.hub_repo) and not export.peft:
        raise ValueError("export.every_checkpoint and export.hub_repo need export.peft=True")
    if not export.hub_repo:
        return
    if not _HUB_ID.fullmatch(export.hub_repo):
        raise ValueError(f"export.hub_repo {export.hub_repo!r} is not a hub repo id (user/name)")
    if _hub_offline():
        raise ValueError(
            f"export.hub_repo={export.hub_repo!r} pushes adapters to the Hugging Face hub, but HF_HUB_OFFLINE is "
            "set; unset it, or leave export.hub_repo empty and upload <run_dir>/adapter/ later"
        )


def _check_data(data: config_dict.ConfigDict) -> None:
    if data.data_dir and not pathlib.Path(data.data_dir).expanduser().is_dir():
        raise FileNotFoundError(f"data.data_dir {data.data_dir!r} is not a directory")
    if not data.testsets:
        raise ValueError("data.testsets is empty: name the testsets to evaluate (at least data.train_set)")
    for name in (*data.testsets, data.train_set):
        testset_spec(name)  # unknown names: an error listing the known ones
    if len(set(data.testsets)) != len(data.testsets):
        raise ValueError(f"data.testsets lists a testset twice: {list(data.testsets)}")
    if data.train_set not in data.testsets:
        raise ValueError(
            f"data.train_set {data.train_set!r} must also be in data.testsets: it is the in-domain testset"
        )
    if data.eval_cap < 0:
        raise ValueError(f"data.eval_cap must be >= 0 (0 = no cap), got {data.eval_cap}")
    if data.neutral not in ("drop", "not_entailment"):
        raise ValueError(f"data.neutral must be 'drop' or 'not_entailment', got {data.neutral!r}")


def _check_runs_and_training(config: config_dict.ConfigDict) -> None:
    runs, train = config.runs, config.train
    for field in ("seeds", "shots"):
        values = list(runs[field])
        if not values or len(set(values)) != len(values):
            raise ValueError(f"runs.{field} must be a non-empty list without repeats, got {values}")
    if min(runs.shots) < 1:
        raise ValueError(f"runs.shots must be positive, got {list(runs.shots)}")
    # The batch sizes are checked where the batch geometry is worked out (oodjax.engine.geometry).
    positive = {
        "train.steps": train.steps,
        "eval.every": config.eval.every,
        "checkpoint_every": config.checkpoint_every,
        "log_every": config.log_every,
    }
    for field, value in positive.items():
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    if not 0 <= train.warmup_steps <= train.steps:
        raise ValueError(f"train.warmup_steps must be in [0, train.steps={train.steps}], got {train.warmup_steps}")
    if not config.output_dir:
        raise ValueError("output_dir is empty")
