"""Read tensors, or slices of them, from a Hugging Face checkpoint folder without loading it whole.

Safetensors files are memory-mapped and sliced, so placing a parameter's shard
on a device reads only that shard. Pickled ``.bin`` weights can run arbitrary
code when unpickled and are read only when the caller opts in.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any, Protocol

import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy, which safetensors' numpy reader needs)
import numpy as np
from safetensors import safe_open

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"

Index = tuple[slice, ...]


class Checkpoint(Protocol):
    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def file(self, name: str) -> str: ...
    def read(self, name: str, index: Index) -> np.ndarray: ...


def _weight_map(directory: pathlib.Path, index_file: str) -> dict[str, str]:
    """Tensor name -> shard file, checking every shard the index names is there."""
    weight_map = json.loads((directory / index_file).read_text())["weight_map"]
    for shard in sorted(set(weight_map.values())):
        if not (directory / shard).is_file():
            raise FileNotFoundError(f"{directory / index_file} lists the shard {shard!r}, which is not in {directory}")
    return weight_map


class SafetensorsCheckpoint:
    """``model.safetensors`` or the shards of ``model.safetensors.index.json``."""

    def __init__(self, directory: pathlib.Path, weight_map: dict[str, str], stack: contextlib.ExitStack):
        self._directory, self._weight_map, self._stack = directory, weight_map, stack
        self._open: dict[str, Any] = {}

    def _handle(self, name: str) -> Any:
        shard = self._weight_map[name]
        if shard not in self._open:
            self._open[shard] = self._stack.enter_context(safe_open(self._directory / shard, framework="numpy"))
        return self._open[shard]

    def names(self) -> set[str]:
        return set(self._weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def file(self, name: str) -> str:
        return self._weight_map[name]

    def read(self, name: str, index: Index) -> np.ndarray:
        return self._handle(name).get_slice(name)[index]


class PickleCheckpoint:
    """``pytorch_model.bin`` or its shards, unpickled with torch (imported only here)."""

    def __init__(self, directory: pathlib.Path, shards: list[str]):
        import torch

        self._torch = torch
        self._tensors: dict[str, Any] = {}
        self._files: dict[str, str] = {}
        for shard in shards:
            tensors = torch.load(directory / shard, map_location="cpu", mmap=True, weights_only=True)
            self._tensors.update(tensors)
            self._files.update(dict.fromkeys(tensors, shard))

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def file(self, name: str) -> str:
        return self._files[name]

    def read(self, name: str, index: Index) -> np.ndarray:
        block = self._tensors[name][index]
        if block.dtype == self._torch.bfloat16:  # numpy has no bfloat16; the upcast is exact
            block = block.float()
        return block.numpy()


def open_checkpoint(directory: pathlib.Path, *, allow_pickle: bool, stack: contextlib.ExitStack) -> Checkpoint:
    """The checkpoint in ``directory``: sharded or single safetensors, else (if allowed) pickled weights."""
    if (directory / SAFETENSORS_INDEX).is_file():
        return SafetensorsCheckpoint(directory, _weight_map(directory, SAFETENSORS_INDEX), stack)
    if (directory / SAFETENSORS).is_file():
        with safe_open(directory / SAFETENSORS, framework="numpy") as handle:
            names = list(handle.keys())
        return SafetensorsCheckpoint(directory, dict.fromkeys(names, SAFETENSORS), stack)
    for pickled in (PICKLE_INDEX, PICKLE):
        if (directory / pickled).is_file():
            if not allow_pickle:
                raise ValueError(
                    f"{directory / pickled} holds pickled PyTorch weights, which can run arbitrary code when loaded; "
                    "pass allow_pickle=True if you trust its source, or convert it to safetensors"
                )
            shards = sorted(set(_weight_map(directory, PICKLE_INDEX).values())) if pickled == PICKLE_INDEX else [PICKLE]
            return PickleCheckpoint(directory, shards)
    raise FileNotFoundError(
        f"{directory} has no weights: expected {SAFETENSORS} or {SAFETENSORS_INDEX} "
        f"(or {PICKLE} / {PICKLE_INDEX} with allow_pickle=True)"
    )
