"""Loading experiment configs from their files, the way `--config path.py` does, for tools that plan runs."""

from __future__ import annotations

import glob
import pathlib
import types

from ml_collections import config_dict

from oodjax.config_cli import config_module


def load_config(path: str | pathlib.Path) -> config_dict.ConfigDict:
    """The ConfigDict returned by `get_config()` of the file at `path`.

    File names such as `opt2.7_mnli.py` are not importable module names, so
    the file is loaded by path; its own imports (`from configs import base`)
    resolve from the repository root, as they do for `python -m oodjax.main`.
    """
    module = _load_module(path)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"config file {path} has no get_config()")
    return module.get_config()


def expand_config_paths(patterns: list[str]) -> list[str]:
    """Config files matching shell-style patterns, sorted, each once; a pattern matching nothing is an error."""
    paths: list[str] = []
    for pattern in patterns:
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
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    return config_module(path)
