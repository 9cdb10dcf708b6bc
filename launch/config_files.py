"""Loading experiment configs from their files, the way `--config path.py` does, for tools that plan runs.

A config argument is a path or shell pattern (`configs/*_mnli.py`), or a
packaged config as `oodjax:NAME` or `oodjax:PATTERN` (`oodjax:*_mnli`): the
files installed with the package, `configs/NAME.py`, as `--config
oodjax:NAME` names them (`oodjax.config_cli.PACKAGED_PREFIX`). The sweep,
the estimate, the fetch and the preflight all read them so; a packaged
config keeps its `oodjax:NAME` form in the commands the sweep writes, so
each host resolves it in its own install.
"""

from __future__ import annotations

import glob
import pathlib
import types

from ml_collections import config_dict

from oodjax.config_cli import PACKAGED_PREFIX, config_file_path, config_module, packaged_configs_dir


def load_config(path: str | pathlib.Path) -> config_dict.ConfigDict:
    """The ConfigDict returned by `get_config()` of the file at `path` (or the packaged `oodjax:NAME`).

    File names such as `opt2.7_mnli.py` are not importable module names, so
    the file is loaded by path; its own imports (`from configs import base`)
    resolve from the repository root, as they do for `python -m oodjax.main`.
    """
    module = _load_module(path)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"config file {path} has no get_config()")
    return module.get_config()


def config_stem(path: str | pathlib.Path) -> str:
    """What jobs and tables call a config: its file's stem (`opt2.7_mnli` for configs/opt2.7_mnli.py and
    for oodjax:opt2.7_mnli)."""
    text = str(path)
    if text.startswith(PACKAGED_PREFIX):
        return pathlib.PurePosixPath(text[len(PACKAGED_PREFIX) :].removesuffix(".py")).name
    return pathlib.Path(text).stem


def expand_config_paths(patterns: list[str]) -> list[str]:
    """Config files matching shell-style patterns, sorted, each once; a pattern matching nothing is an error.

    `oodjax:PATTERN` matches the packaged configs (`PATTERN.py` in the
    installed configs/), each given back as `oodjax:NAME`.
    """
    paths: list[str] = []
    for pattern in patterns:
        if pattern.startswith(PACKAGED_PREFIX):
            name_pattern = pattern[len(PACKAGED_PREFIX) :].removesuffix(".py")
            root = packaged_configs_dir()
            found = glob.glob(f"{glob.escape(str(root))}/{name_pattern}.py")
            names = (pathlib.Path(match).relative_to(root).with_suffix("").as_posix() for match in found)
            matches = sorted(f"{PACKAGED_PREFIX}{name}" for name in names)
        else:
            matches = sorted(glob.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"no config file matches {pattern!r}")
        paths += [match for match in matches if match not in paths]
    return paths


def experiment_config_paths(patterns: list[str]) -> list[str]:
    """The experiment configs among the files matching ``patterns`` (``expand_config_paths``,
    ``experiment_configs``), the others named on stdout as a `#` comment; none is an error naming the
    patterns. How the sweep and the estimate read their config arguments alike."""
    configs, not_experiments = experiment_configs(expand_config_paths(patterns))
    if not_experiments:
        skipped = ", ".join(f"{path} ({why})" for path, why in not_experiments.items())
        print(f"# not experiment configs, skipped: {skipped}")
    if not configs:
        raise ValueError(f"no experiment config among {list(patterns)}")
    return configs


def experiment_configs(paths: list[str]) -> tuple[list[str], dict[str, str]]:
    """The ``paths`` that are experiment configs, and the others with why they are not.

    An experiment config is a file whose `get_config()` names a model to
    train (`model.path` or `model.hf_config`). So a glob over configs/ can
    be given as it is: the package's `__init__.py`, the tables and helpers
    the configs are built from (no `get_config()`), and `base.py`, whose
    defaults name no model, are left out, whatever they are called.
    """
    experiments, others = [], {}
    for path in paths:
        module = _load_module(path)
        if not hasattr(module, "get_config"):
            others[path] = "no get_config()"
        elif not _names_a_model(module.get_config()):
            others[path] = "its config names no model"
        else:
            experiments.append(path)
    return experiments, others


def _names_a_model(config: config_dict.ConfigDict) -> bool:
    model = config.get("model")
    if model is None:
        return False
    hf_config = model.get("hf_config")
    return bool(model.get("path")) or bool(hf_config is not None and hf_config.to_dict())


def _load_module(path: str | pathlib.Path) -> types.ModuleType:
    try:
        file = config_file_path(str(path))
    except FileNotFoundError as error:
        raise FileNotFoundError(f"config file {path} does not exist ({error})") from None
    return config_module(file)
