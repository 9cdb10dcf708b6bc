"""Read tensors, or slices of them, from a Hugging Face checkpoint folder without loading it whole.

Two formats: safetensors and PyTorch's pickled ``pytorch_model*.bin`` (OPT's
repositories hold no safetensors; ``torch_pickle`` unpickles them safely).
Rows are read with plain file reads, not memory-mapped: every touched mapped
page stays resident until the file is closed, so a mapped float32 checkpoint
would cost its full size on top of the converted parameters (safetensors'
``pread`` backend reads a whole tensor for any slice, once per fsdp device
block).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import pathlib
import re
import zipfile
from collections.abc import Callable, Iterable
from typing import Any

import ml_dtypes
import numpy as np

from oodjax.models.torch_pickle import PickledTensor, state_dict, unpickle
from oodjax.usage_errors import DamagedInputError, MissingInputError

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"

Index = tuple[slice, ...]

# safetensors' dtype codes -> numpy's: HF weights are F32, F16 or BF16 (numpy's bfloat16 is ml_dtypes');
# the integer and bool codes are buffers some checkpoints also store.
_DTYPES: dict[str, np.dtype] = {"BF16": np.dtype(ml_dtypes.bfloat16), "BOOL": np.dtype(np.bool_)} | {
    f"{code}{bits}": np.dtype(f"{kind}{bits}")
    for code, kind, sizes in (
        ("F", "float", (16, 32, 64)),
        ("I", "int", (8, 16, 32, 64)),
        ("U", "uint", (8, 16, 32, 64)),
    )
    for bits in sizes
}


def read_json(path: pathlib.Path) -> Any:
    """A checkpoint folder's JSON file, or an error naming it (json's own name no file)."""
    try:
        return json.loads(path.read_bytes())
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise DamagedInputError(f"{path} is not valid JSON (truncated or corrupt?): {error}") from None


def weight_map(directory: pathlib.Path, index_file: str) -> dict[str, str]:
    """Tensor name -> shard file, from a shard index, checking every shard it names is in ``directory``."""
    index = read_json(directory / index_file)
    shards = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(shards, dict):
        raise DamagedInputError(f'{directory / index_file} has no "weight_map" object (tensor name -> shard file)')
    missing = sorted(shard for shard in set(shards.values()) if not (directory / shard).is_file())
    if missing:
        raise MissingInputError(f"{directory / index_file} lists the shards {missing}, which are not in {directory}")
    return shards


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where one tensor lies in its file: ``offset`` is the byte its first row starts at."""

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


class TensorFile:
    """A file holding each of its tensors whole, row-major, from a known byte: reads of just a slice's rows."""

    def __init__(self, path: pathlib.Path, stack: contextlib.ExitStack):
        self.path = path
        self._file = stack.enter_context(path.open("rb", buffering=0))
        self.size = os.fstat(self._file.fileno()).st_size
        self.tensors: dict[str, _Stored] = {}

    def _read_into(self, buffer: bytearray | memoryview, offset: int, what: str) -> None:
        """Fill ``buffer`` from byte ``offset``; a single read may stop short, so read until it is full."""
        self._file.seek(offset)
        view, done = memoryview(buffer), 0
        while done < len(view):
            count = self._file.readinto(view[done:])
            if not count:
                raise DamagedInputError(f"{self.path} ends inside {what}: the file is truncated")
            done += count

    def _check_end(self, what: str, end: int) -> None:
        """``what`` ends at byte ``end``: within the file, or the file is truncated."""
        if end > self.size:
            raise DamagedInputError(
                f"{what} ends at byte {end}, but the file has {self.size} bytes: the file is truncated"
            )

    def read(self, name: str, index: Index) -> np.ndarray:
        """``tensor[index]``, reading from disk only the rows between the first and last ones ``index`` selects."""
        stored = self.tensors[name]
        rows = range(*index[0].indices(stored.shape[0]))
        first, last = sorted((rows[0], rows[-1])) if rows else (0, -1)
        block = np.empty((last + 1 - first, *stored.shape[1:]), stored.dtype)
        row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
        self._read_into(block.reshape(-1).view(np.uint8).data, stored.offset + first * row_bytes, f"tensor {name!r}")
        # The rows are read in file order; a negative step starts from the last of them.
        return block[(slice(None, None, rows.step), *index[1:])]


class SafetensorsFile(TensorFile):
    """One safetensors file: its header, checked against the file's size when opened."""

    def __init__(self, path: pathlib.Path, stack: contextlib.ExitStack):
        super().__init__(path, stack)
        length = bytearray(8)
        self._read_into(length, 0, "its header length")
        data_start = 8 + int.from_bytes(length, "little")
        if data_start > self.size:
            raise DamagedInputError(
                f"{path} is truncated or not a safetensors file: its header would end at byte {data_start}, "
                f"the file has {self.size} bytes"
            )
        header_bytes = bytearray(data_start - 8)
        self._read_into(header_bytes, 8, "its header")
        try:
            header = json.loads(header_bytes)
        except ValueError as error:  # UnicodeDecodeError and JSONDecodeError
            raise DamagedInputError(f"{path} has a corrupt safetensors header: {error}") from error
        if not isinstance(header, dict):
            raise DamagedInputError(f"{path} has a corrupt safetensors header: not a JSON object")
        header.pop("__metadata__", None)
        self.tensors = {name: self._stored(name, entry, data_start) for name, entry in header.items()}

    def _stored(self, name: str, entry: Any, data_start: int) -> _Stored:
        """One header entry, checked so that reading it can only return the tensor's own bytes."""
        try:
            code, shape = entry["dtype"], tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise DamagedInputError(
                f"{name!r} in {self.path} has a corrupt safetensors header entry: {entry!r}"
            ) from error
        if code not in _DTYPES:
            raise DamagedInputError(
                f"{name!r} in {self.path} is stored as {code!r}; readable dtypes: {sorted(_DTYPES)}"
            )
        dtype = _DTYPES[code]
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise DamagedInputError(
                f"{name!r} in {self.path} has a corrupt safetensors header entry: {code} {list(shape)} "
                f"cannot occupy bytes {begin}..{end}"
            )
        self._check_end(f"{name!r} in {self.path}", data_start + end)
        return _Stored(dtype, shape, data_start + begin)


# torch.save's legacy (non-zip) format: these three pickles, the state dict's, the list of storage keys, then
# each storage as an 8-byte little-endian element count and its bytes (torch/serialization.py, _legacy_save).
_LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL_VERSION = 1001
_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_LOCAL_HEADER = 30  # bytes before a member's name and extra field


class PickleFile(TensorFile):
    """One ``torch.save``d state dict, zip format or legacy; only row-major contiguous tensors, as
    ``model.state_dict()`` saves them."""

    def __init__(self, path: pathlib.Path, stack: contextlib.ExitStack):
        super().__init__(path, stack)
        magic = bytearray(min(4, self.size))
        self._read_into(magic, 0, "its first bytes")
        state, data_offsets = self._read_zip() if magic == _ZIP_MAGIC else self._read_legacy()
        self.tensors = {
            name: self._stored(name, tensor, data_offsets[tensor.storage.key]) for name, tensor in state.items()
        }

    def _stored(self, name: str, tensor: PickledTensor, data_offset: int) -> _Stored:
        """One tensor's place in the file, checked so that reading it can only return its own bytes."""
        contiguous = tuple(math.prod(tensor.shape[d + 1 :]) for d in range(len(tensor.shape)))
        layout = zip(tensor.shape, tensor.stride, contiguous)
        if any(size > 1 and stride != row_major for size, stride, row_major in layout):
            raise DamagedInputError(
                f"{name!r} in {self.path} has strides {tensor.stride}, not the row-major {contiguous} of its shape "
                f"{tensor.shape}: only contiguous tensors are read"
            )
        storage = tensor.storage
        if tensor.offset < 0 or tensor.offset + math.prod(tensor.shape) > storage.numel:
            raise DamagedInputError(
                f"{name!r} in {self.path} ({math.prod(tensor.shape)} elements from element {tensor.offset}) does not "
                f"fit its storage {storage.key!r} of {storage.numel} elements"
            )
        return _Stored(storage.dtype, tensor.shape, data_offset + tensor.offset * storage.dtype.itemsize)

    @staticmethod
    def _users(state: dict[str, PickledTensor], key: str) -> str:
        """For messages: the tensors stored in storage ``key``."""
        names = [name for name, tensor in state.items() if tensor.storage.key == key]
        return f"tensor {names[0]!r}" if len(names) == 1 else f"tensors {names}"

    def _read_zip(self) -> tuple[dict[str, PickledTensor], dict[str, int]]:
        """The state dict, and the byte each of its storages' data starts at."""
        try:
            with zipfile.ZipFile(self.path) as archive:
                members = {info.filename: info for info in archive.infolist()}
                pickles = [name for name in members if re.fullmatch(r"[^/]+/data\.pkl", name)]
                if len(pickles) != 1:
                    raise DamagedInputError(
                        f"{self.path} is a zip file, but not one torch.save wrote: no <name>/data.pkl"
                    )
                prefix = pickles[0].removesuffix("data.pkl")
                if f"{prefix}byteorder" in members and archive.read(f"{prefix}byteorder") != b"little":
                    raise DamagedInputError(
                        f"{self.path} was saved big-endian; only little-endian checkpoints are read"
                    )
                state, storages = unpickle(io.BytesIO(archive.read(pickles[0])), self.path, "data.pkl")
        except zipfile.BadZipFile as error:
            raise DamagedInputError(f"{self.path} is truncated or not a PyTorch checkpoint: {error}") from error
        state = state_dict(state, self.path)
        data_offsets = {}
        for key, storage in storages.items():
            member, users = members.get(f"{prefix}data/{key}"), self._users(state, key)
            if member is None:
                raise DamagedInputError(f"{self.path} has no data/{key} member for the storage of {users}")
            if member.compress_type != zipfile.ZIP_STORED or member.flag_bits & 0x1:
                raise DamagedInputError(
                    f"{self.path} stores {member.filename} ({users}) compressed or encrypted; torch.save stores "
                    "storages uncompressed, and only those are read"
                )
            if member.file_size != storage.numel * storage.dtype.itemsize:
                raise DamagedInputError(
                    f"{self.path}: {member.filename} ({users}) holds {member.file_size} bytes, its storage "
                    f"{storage.numel} elements of {storage.dtype}"
                )
            header = bytearray(_ZIP_LOCAL_HEADER)
            self._read_into(header, member.header_offset, f"the zip header of {member.filename} ({users})")
            if header[:4] != _ZIP_MAGIC:
                raise DamagedInputError(f"{self.path} has a corrupt zip header for {member.filename} ({users})")
            start = member.header_offset + _ZIP_LOCAL_HEADER + int.from_bytes(header[26:28], "little")
            start += int.from_bytes(header[28:30], "little")
            self._check_end(f"{self.path}: the storage of {users}", start + member.file_size)
            data_offsets[key] = start
        return state, data_offsets

    def _read_legacy(self) -> tuple[dict[str, PickledTensor], dict[str, int]]:
        """As ``_read_zip``, for the legacy format: the storages follow the pickles, one after another."""
        with self.path.open("rb") as stream:
            magic, _ = unpickle(stream, self.path, "magic number")
            if magic != _LEGACY_MAGIC_NUMBER:
                raise DamagedInputError(
                    f"{self.path} is neither a zip nor a legacy PyTorch checkpoint (no magic number)"
                )
            version, _ = unpickle(stream, self.path, "protocol version")
            system, _ = unpickle(stream, self.path, "system info")
            if version != _LEGACY_PROTOCOL_VERSION or not isinstance(system, dict):
                raise DamagedInputError(
                    f"{self.path} is a legacy PyTorch checkpoint of protocol {version!r}; 1001 is read"
                )
            if system.get("little_endian") is not True:
                raise DamagedInputError(f"{self.path} was saved big-endian; only little-endian checkpoints are read")
            state, storages = unpickle(stream, self.path, "state dict")
            keys, _ = unpickle(stream, self.path, "list of storage keys")
            position = stream.tell()
        state = state_dict(state, self.path)
        if not (isinstance(keys, list) and sorted(keys) == sorted(storages)):
            raise DamagedInputError(
                f"{self.path} lists the storages {keys!r}, but its state dict uses {sorted(storages)}"
            )
        data_offsets = {}
        for key in keys:
            storage, users, count = storages[key], self._users(state, key), bytearray(8)
            self._read_into(count, position, f"the element count of the storage of {users}")
            if int.from_bytes(count, "little") != storage.numel:
                raise DamagedInputError(
                    f"{self.path}: the storage of {users} holds {int.from_bytes(count, 'little')} elements, "
                    f"its persistent id says {storage.numel}"
                )
            data_offsets[key], position = position + 8, position + 8 + storage.numel * storage.dtype.itemsize
            self._check_end(f"{self.path}: the storage of {users}", position)
        return state, data_offsets


# ----------------------------------------------------------------------------- which files, in which order


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """One way a repository publishes its weights: an index and the shards it names, or one file."""

    index: str
    single: str
    shard: re.Pattern[str]  # the shards' names, as transformers' save_pretrained writes them
    open_file: Callable[[pathlib.Path, contextlib.ExitStack], TensorFile]


# The formats the loader reads, in its order of preference: the one home of that order, which both
# files_to_download (what to fetch) and open_checkpoint (what to open) follow.
WEIGHT_FORMATS = (
    WeightFormat(SAFETENSORS_INDEX, SAFETENSORS, re.compile(r"model-\d+-of-\d+\.safetensors"), SafetensorsFile),
    WeightFormat(PICKLE_INDEX, PICKLE, re.compile(r"pytorch_model-\d+-of-\d+\.bin"), PickleFile),
)


def _readable_formats() -> str:
    """What ``WEIGHT_FORMATS`` reads, in words, for messages."""
    return ", ".join(f"{fmt.index} and the shards it names, {fmt.single}" for fmt in WEIGHT_FORMATS)


def files_to_download(filenames: Iterable[str]) -> list[str]:
    """From a repository's file listing, config.json and the first of ``WEIGHT_FORMATS`` it publishes.

    Shards are picked by name, the index not being downloaded yet; loading checks them against it.
    """
    names = set(filenames)
    if CONFIG not in names:
        raise MissingInputError(f"the files {sorted(names)} include no {CONFIG}")
    for fmt in WEIGHT_FORMATS:
        if fmt.index in names:
            return [CONFIG, fmt.index, *sorted(name for name in names if fmt.shard.fullmatch(name))]
        if fmt.single in names:
            return [CONFIG, fmt.single]
    raise MissingInputError(f"the files {sorted(names)} hold no weights the loader reads: {_readable_formats()}")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The tensors of one weight format: the shards of its index, or its single file."""

    weight_map: dict[str, str]  # tensor name -> the file holding it
    files: dict[str, TensorFile]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.weight_map[name]].tensors[name].shape

    def read(self, name: str, index: Index) -> np.ndarray:
        return self.files[self.weight_map[name]].read(name, index)


def open_checkpoint(directory: pathlib.Path, *, stack: contextlib.ExitStack) -> Checkpoint:
    """The checkpoint in ``directory``, in the first of ``WEIGHT_FORMATS`` it holds; reads no tensor's bytes."""
    for fmt in WEIGHT_FORMATS:
        if (directory / fmt.index).is_file():
            shards = weight_map(directory, fmt.index)
            files = {shard: fmt.open_file(directory / shard, stack) for shard in sorted(set(shards.values()))}
            for name, shard in shards.items():
                if name not in files[shard].tensors:
                    raise DamagedInputError(f"{directory / fmt.index} puts {name!r} in {shard}, which does not hold it")
            return Checkpoint(shards, files)
        if (directory / fmt.single).is_file():
            single = fmt.open_file(directory / fmt.single, stack)
            return Checkpoint(dict.fromkeys(single.tensors, fmt.single), {fmt.single: single})
    raise MissingInputError(f"{directory} has no weights: expected {_readable_formats()}")
