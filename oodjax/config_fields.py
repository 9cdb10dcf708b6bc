"""The config's fields, derived from the settings the pieces declare (``oodjax.settings``): the one registry.

Config files start from `get_config()` (through `configs.base`) and change fields;
the returned ConfigDict is locked, so a misspelt key (in a config file or on
the command line as `--config.train.stepz=10`) is an error, not a silently
ignored setting. A setting's type, default, path, help and resume rule live on
its piece's field; a new piece is registered in ``PIECES``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import pathlib
import re
import tokenize
from typing import Any

from ml_collections import config_dict

from oodjax.data import TESTSETS
from oodjax.engine.cadence import CadenceSettings, ExportSettings, RunLength
from oodjax.engine.events import TrackerSettings, WandbSettings
from oodjax.engine.geometry import BatchSettings
from oodjax.engine.optimizer import OptimizerSettings
from oodjax.engine.results import RunPlan
from oodjax.engine.run_data import DataSettings
from oodjax.engine.sharding import MeshShape
from oodjax.models.loading import ModelSettings
from oodjax.models.lora import LoRAConfig
from oodjax.settings import Declared, declared, setting
from oodjax.usage_errors import ConfigError

EIGHT_TESTSETS = tuple(TESTSETS)  # the study's eight, in the order of the testsets table


@dataclasses.dataclass(frozen=True)
class EvaluateSettings:
    """What `python -m oodjax.evaluate` evaluates instead of trained runs: the piece of the settings only it
    reads."""

    # PEFT LoRA adapter folders to evaluate, one run each, with
    # `python -m oodjax.evaluate` (export.peft writes <run_dir>/adapter/).
    adapters: tuple[pathlib.Path, ...] = setting((), path="model.adapters")
    # `python -m oodjax.evaluate` only: evaluate each (seed, shots) run in
    # context instead, every test prompt preceded by the run's few-shot set
    # (answers filled in) as demonstrations, nothing trained; runs are named
    # and grouped as model "<model>-icl".
    in_context: bool = setting(False, path="eval.in_context")

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", tuple(pathlib.Path(path).expanduser() for path in self.adapters))
        if self.in_context and self.adapters:
            raise ConfigError(
                "eval.in_context=True evaluates the base model in context, so model.adapters must be empty; "
                "evaluate the adapters in a call of their own"
            )


# Every piece whose fields are settings, in the order the help lists a section's fields.
PIECES = (
    *(ModelSettings, LoRAConfig, DataSettings, RunPlan, RunLength, CadenceSettings, BatchSettings),
    *(OptimizerSettings, EvaluateSettings, MeshShape, ExportSettings, WandbSettings, TrackerSettings),
)


# The order the help and a job's log show the config's sections and top-level fields in (one no piece names
# here comes last); within a section, its fields in their pieces' order.
LAYOUT = "model tokenizer lora data runs train eval mesh output_dir checkpoint_every checkpoint_keep log_every".split()
LAYOUT += ["wandb", "tensorboard", "export"]
# What a section is, where its fields do not say it.
SECTION_MEANINGS = {
    "runs": "Every (seed, shots) pair is one run; all of them train together on one copy of the frozen base.",
    "mesh": "Device mesh axis sizes; -1 = all remaining devices. The batch is split over data x fsdp; parameters "
    "over fsdp and tensor by the logical rules.",
    "wandb": "Live metrics, beside each run's events.jsonl and at the same steps: the mean training loss and "
    "gradient norm (global, before clipping) since the last line, the learning rate, examples/s, and every accuracy.",
    "export": "The trained adapters in PEFT format (adapter_config.json and adapter_model.safetensors), for "
    "`peft.PeftModel.from_pretrained`.",
}
# List fields whose comma-separated items the command line keeps exactly as
# written, spaces included (`--config.data.answers=" yes"," no"`): an answer's
# leading space makes it another token.
VERBATIM_LIST_ITEMS = ("data.answers",)


@functools.cache
def settings() -> dict[str, Declared]:
    """Config path -> its declaration, in ``LAYOUT``'s order."""
    found = {setting.path: setting for piece in PIECES for setting in declared(piece)}
    place = {name: n for n, name in enumerate(LAYOUT)}  # a top-level field LAYOUT does not name: last
    return dict(sorted(found.items(), key=lambda item: place.get(item[0].split(".")[0], len(place))))


def list_item_types() -> dict[str, type]:
    """The item type of each list field, from its annotation: the command line reads `--config.runs.seeds=0,42`
    as integers by it (oodjax.config_cli), and ``oodjax.config_read.read`` holds config files to it."""
    return {path: kind for path, setting in settings().items() if (kind := setting.item_type) is not None}


def sections() -> list[str]:
    """The config's sections (model, train, ...), in order, unlike `model.hf_config`, a value that is a dict."""
    return list(dict.fromkeys(path.split(".")[0] for path in settings() if "." in path))


def get_config() -> config_dict.ConfigDict:
    config = config_dict.ConfigDict()
    for path, declaration in settings().items():
        section, _, key = path.rpartition(".")
        if section and section not in config:
            config[section] = config_dict.ConfigDict()
        value = declaration.config_default
        (config[section] if section else config)[key] = (
            config_dict.ConfigDict(value) if isinstance(value, dict) else value
        )
    config.lock()
    return config


@functools.cache
def field_descriptions() -> dict[str, str]:
    """Field path -> its meaning: a section's from ``SECTION_MEANINGS``, a setting's from the comment lines right
    above its declaration, then any after it on its line. Read from the source, so a meaning is written once,
    beside its default."""
    descriptions: dict[str, str] = {}
    for path, declaration in settings().items():
        if "." in path:
            descriptions.setdefault(path.split(".")[0], SECTION_MEANINGS.get(path.split(".")[0], ""))
        descriptions[path] = _comment(declaration)
    return descriptions


def _comment(setting: Declared) -> str:
    source = inspect.getsource(setting.piece)
    lines = source.splitlines()
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    declaration = re.compile(rf"\s*{setting.name}: .*= setting\(")
    number = next(n for n, line in enumerate(lines, start=1) if declaration.match(line))
    first = number
    while first - 1 in comments and lines[first - 2].lstrip().startswith("#"):  # a comment line above
        first -= 1
    inline = [comments[number]] if number in comments else []
    return " ".join([comments[n] for n in range(first, number)] + inline)


def value_at(config: Any, path: str) -> Any:
    """The value at a dotted ``path`` of a ConfigDict or a config's JSON."""
    return functools.reduce(lambda node, key: node[key], path.split("."), config)
