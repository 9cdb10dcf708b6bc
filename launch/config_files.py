"""Loading experiment configs from their files, the way `--config path.py` does, for tools that plan runs.

A config argument is a path, a shell pattern, or a packaged `oodjax:NAME` /
`oodjax:PATTERN`; a packaged config keeps that form in the commands the
sweep writes, so each host resolves it in its own install.
"""

from __future__ import annotations

import glob
import pathlib
import types

from ml_collections import config_dict

from oodjax.config_cli import PACKAGED_PREFIX, config_file_path, config_module, packaged_configs_dir
from oodjax.usage_errors import ConfigError, MissingInputError


def load_config(path: str | pathlib.Path) -> config_dict.ConfigDict:
    """`get_config()` of the file at `path`, loaded by path: `opt2.7_mnli.py` is no module name."""
    module = _load_module(path)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"config file {path} has no get_config()")
    return module.get_config()


def config_stem(path: str | pathlib.Path) -> str:
    """What jobs and tables call a config: its file's stem, packaged or not."""
    text = str(path)
    if text.startswith(PACKAGED_PREFIX):
        return pathlib.PurePosixPath(text[len(PACKAGED_PREFIX) :].removesuffix(".py")).name
    return pathlib.Path(text).stem


def expand_config_paths(patterns: list[str]) -> list[str]:
    """Config files matching the patterns, sorted, each once; a pattern matching nothing is an error."""
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
            raise MissingInputError(f"no config file matches {pattern!r}")
        paths += [match for match in matches if match not in paths]
    return paths


def experiment_config_paths(patterns: list[str]) -> list[str]:
    """The experiment configs among the files matching ``patterns``, the others named in a `#` line.

    An experiment config names a model, so a glob over configs/ can be given
    as it is: helpers (no `get_config()`) and base.py (no model) are left out.
    """
    configs, skipped = [], []
    for path in expand_config_paths(patterns):
        module = _load_module(path)
        if not hasattr(module, "get_config"):
            skipped.append(f"{path} (no get_config())")
        elif _names_a_model(module.get_config()):
            configs.append(path)
        else:
            skipped.append(f"{path} (its config names no model)")
    if skipped:
        print(f"# not experiment configs, skipped: {', '.join(skipped)}")
    if not configs:
        raise ConfigError(f"no experiment config among {list(patterns)}")
    return configs


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
        raise MissingInputError(f"config file {path} does not exist ({error})") from None
    return config_module(file)
