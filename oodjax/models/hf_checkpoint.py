"""Read tensors, or slices of them, from a Hugging Face checkpoint folder without loading it whole.

Safetensors files are read with plain file reads of just the rows a slice
covers, not memory-mapped: every mapped page that was touched stays resident,
counted against the process, until the file is closed at the end of the load,
so a mapped float32 checkpoint costs its full size on top of the converted
parameters (safetensors' own ``pread`` backend avoids that but reads a whole
tensor for any slice of it, which an fsdp-sharded load asks for once per
device block). Pickled ``.bin`` weights can run arbitrary code when unpickled and
are read only when the caller opts in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
from typing import Any, Protocol

import ml_dtypes
import numpy as np

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"

Index = tuple[slice, ...]

# safetensors' dtype codes -> numpy's: HF weights are F32, F16 or BF16 (numpy's bfloat16 is ml_dtypes');
# the integer and bool codes are buffers some checkpoints also store.
_DTYPES: dict[str, np.dtype] = {
    code: np.dtype(dtype)
    for code, dtype in {
        "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
        "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
        "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    }.items()
}


class Checkpoint(Protocol):
    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def file(self, name: str) -> str: ...
    def read(self, name: str, index: Index) -> np.ndarray: ...


def read_json(path: pathlib.Path) -> Any:
    """A checkpoint or tokenizer folder's JSON file (config.json, an index), or an error naming it.

    json's own errors ("Expecting value: line 1 column 1") name no file.
    """
    try:
        return json.loads(path.read_bytes())
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON (truncated or corrupt?): {error}") from None


def _weight_map(directory: pathlib.Path, index_file: str) -> dict[str, str]:
    """Tensor name -> shard file, checking every shard the index names is there."""
    index = read_json(directory / index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{directory / index_file} has no \"weight_map\" object (tensor name -> shard file)")
    for shard in sorted(set(weight_map.values())):
        if not (directory / shard).is_file():
            raise FileNotFoundError(f"{directory / index_file} lists the shard {shard!r}, which is not in {directory}")
    return weight_map


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where one tensor lies in its file: ``offset`` is the byte its first row starts at."""

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


class SafetensorsFile:
    """One safetensors file: its header, checked against the file's size when opened, and row reads.

    The format is an 8-byte little-endian header length, a JSON header giving
    each tensor's dtype, shape and byte range in the data that follows, then
    the data, each tensor in row-major order.
    """

    def __init__(self, path: pathlib.Path, stack: contextlib.ExitStack):
        self.path = path
        self._file = stack.enter_context(path.open("rb", buffering=0))
        size = os.fstat(self._file.fileno()).st_size
        length = bytearray(8)
        self._read_into(length, 0, "its header length")
        data_start = 8 + int.from_bytes(length, "little")
        if data_start > size:
            raise ValueError(
                f"{path} is truncated or not a safetensors file: its header would end at byte {data_start}, "
                f"the file has {size} bytes"
            )
        header_bytes = bytearray(data_start - 8)
        self._read_into(header_bytes, 8, "its header")
        try:
            header = json.loads(header_bytes)
        except ValueError as error:  # UnicodeDecodeError and JSONDecodeError
            raise ValueError(f"{path} has a corrupt safetensors header: {error}") from error
        if not isinstance(header, dict):
            raise ValueError(f"{path} has a corrupt safetensors header: not a JSON object")
        header.pop("__metadata__", None)
        self.tensors = {name: self._stored(name, entry, data_start, size) for name, entry in header.items()}

    def _stored(self, name: str, entry: Any, data_start: int, size: int) -> _Stored:
        """One header entry, checked so that reading it can only return the tensor's own bytes."""
        try:
            code, shape = entry["dtype"], tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{name!r} in {self.path} has a corrupt safetensors header entry: {entry!r}") from error
        if code not in _DTYPES:
            raise ValueError(f"{name!r} in {self.path} is stored as {code!r}; readable dtypes: {sorted(_DTYPES)}")
        dtype = _DTYPES[code]
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{name!r} in {self.path} has a corrupt safetensors header entry: {code} {list(shape)} "
                f"cannot occupy bytes {begin}..{end}"
            )
        if data_start + end > size:
            raise ValueError(
                f"{name!r} in {self.path} ends at byte {data_start + end}, but the file has {size} bytes: "
                "the file is truncated"
            )
        return _Stored(dtype, shape, data_start + begin)

    def _read_into(self, buffer: bytearray | np.ndarray, offset: int, what: str) -> None:
        """Fill ``buffer`` from byte ``offset``; a single read may stop short, so read until it is full."""
        self._file.seek(offset)
        view, done = memoryview(buffer), 0
        while done < len(view):
            count = self._file.readinto(view[done:])
            if not count:
                raise ValueError(f"{self.path} ends inside {what}: the file is truncated")
            done += count

    def read(self, name: str, index: Index) -> np.ndarray:
        """``tensor[index]``, reading from disk only the rows between the first and last ones ``index`` selects."""
        stored = self.tensors[name]
        rows = range(*index[0].indices(stored.shape[0]))
        first, last = sorted((rows[0], rows[-1])) if rows else (0, -1)
        block = np.empty((last + 1 - first, *stored.shape[1:]), stored.dtype)
        row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
        self._read_into(block.reshape(-1).view(np.uint8), stored.offset + first * row_bytes, f"tensor {name!r}")
        # The rows are read in file order; a negative step starts from the last of them.
        return block[(slice(None, None, rows.step), *index[1:])]


class SafetensorsCheckpoint:
    """``model.safetensors`` or the shards of ``model.safetensors.index.json``."""

    def __init__(self, weight_map: dict[str, str], files: dict[str, SafetensorsFile]):
        self._weight_map, self._files = weight_map, files

    def names(self) -> set[str]:
        return set(self._weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._weight_map[name]].tensors[name].shape

    def file(self, name: str) -> str:
        return self._weight_map[name]

    def read(self, name: str, index: Index) -> np.ndarray:
        return self._files[self._weight_map[name]].read(name, index)


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
        weight_map = _weight_map(directory, SAFETENSORS_INDEX)
        shards = {shard: SafetensorsFile(directory / shard, stack) for shard in sorted(set(weight_map.values()))}
        for name, shard in weight_map.items():
            if name not in shards[shard].tensors:
                raise ValueError(f"{directory / SAFETENSORS_INDEX} puts {name!r} in {shard}, which does not hold it")
        return SafetensorsCheckpoint(weight_map, shards)
    if (directory / SAFETENSORS).is_file():
        single = SafetensorsFile(directory / SAFETENSORS, stack)
        return SafetensorsCheckpoint(dict.fromkeys(single.tensors, SAFETENSORS), {SAFETENSORS: single})
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
