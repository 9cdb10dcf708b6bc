"""Loading experiment configs from their files, the way `--config path.py` does, for tools that plan runs."""

from __future__ import annotations

import glob
import importlib.util
import pathlib

from ml_collections import config_dict


def load_config(path: str | pathlib.Path) -> config_dict.ConfigDict:
    """The ConfigDict returned by `get_config()` of the file at `path`.

    File names such as `opt2.7_mnli.py` are not importable module names, so
    the file is loaded by path; its own imports (`from configs import base`)
    resolve from the repository root, as they do for `python -m oodjax.main`.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_oodjax_config_{path.stem.replace('.', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
