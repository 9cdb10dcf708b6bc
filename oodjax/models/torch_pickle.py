"""PyTorch's pickled state dicts, read without torch and without running anything from the file.

``pickle.load`` runs whatever callable a pickle names, so our unpickler maps
the few names a state dict uses to stand-ins that record where each tensor
lies, and refuses any other name before anything is called.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pathlib
import pickle
from typing import Any

import ml_dtypes
import numpy as np

from oodjax.usage_errors import DamagedInputError

# torch's typed storage classes, as torch.save names them for a state dict of tensors of these dtypes
# (torch 2.13 names the same ones; uint16 and float8 tensors it saves another way, which is refused).
_STORAGE_DTYPES: dict[str, np.dtype] = {
    f"{kind}Storage": np.dtype(dtype)
    for kind, dtype in {
        "Double": np.float64,
        "Float": np.float32,
        "Half": np.float16,
        "BFloat16": ml_dtypes.bfloat16,
        "Long": np.int64,
        "Int": np.int32,
        "Short": np.int16,
        "Char": np.int8,
        "Byte": np.uint8,
        "Bool": np.bool_,
    }.items()
}


class UnsafePickleError(DamagedInputError):
    """A pickle that asks for something a PyTorch state dict does not contain; nothing it names was called."""


class _StandIn:
    """What the unpickler gives instead of torch's objects, holding only what the reader recorded. A pickle
    may not set their state (BUILD calls ``__setstate__``): the globals' stand-ins are shared by every load in
    the process, and the others are checked as built."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise UnsafePickleError(
            f"sets the state of a {type(self).__name__.lstrip('_')}, which a PyTorch state dict does not do; "
            "refusing to unpickle it"
        )


@dataclasses.dataclass(frozen=True)
class _StorageClass(_StandIn):
    """What the unpickler gives for ``torch.HalfStorage`` and its kin: the dtype, nothing callable."""

    name: str
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class Storage(_StandIn):
    """One storage a persistent id names: its key (the zip member or legacy record holding its bytes)."""

    key: str
    dtype: np.dtype
    numel: int


@dataclasses.dataclass(frozen=True)
class PickledTensor(_StandIn):
    """Where ``torch._utils._rebuild_tensor(_v2)`` would have put a tensor: its storage and layout in it."""

    storage: Storage
    offset: int  # in elements of the storage's dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _is_int_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and all(type(n) is int and n >= 0 for n in value)


class _RebuildTensor(_StandIn):
    """The stand-in for ``torch._utils._rebuild_tensor`` and ``_rebuild_tensor_v2``: the tensor's layout."""

    __slots__ = ()

    def __call__(
        self, storage: Any, storage_offset: Any, size: Any, stride: Any, *autograd_state: Any
    ) -> PickledTensor:
        if not (isinstance(storage, Storage) and type(storage_offset) is int and _is_int_tuple(size)):
            raise DamagedInputError(f"a tensor is rebuilt from {storage!r}, offset {storage_offset!r}, shape {size!r}")
        if not (_is_int_tuple(stride) and len(stride) == len(size)):
            raise DamagedInputError(f"a tensor of shape {size} is rebuilt with strides {stride!r}")
        return PickledTensor(storage, storage_offset, size, stride)


# The globals torch.save writes for a dict of tensors (zip and legacy format; the hub's "pickle imports"), each
# mapped to its stand-in.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor"): _RebuildTensor(),
    ("torch._utils", "_rebuild_tensor_v2"): _RebuildTensor(),
    **{("torch", name): _StorageClass(name, dtype) for name, dtype in _STORAGE_DTYPES.items()},
}


class _StateDictUnpickler(pickle.Unpickler):
    """Unpickles a state dict into stand-ins; any global outside ``_ALLOWED_GLOBALS`` is refused by name.

    ``find_class`` is the only way a pickle reaches a callable (GLOBAL,
    STACK_GLOBAL, INST and the extension registry all go through it), so
    refusing there refuses before anything is called; the stand-ins refuse
    BUILD, which could change an object the pickle did not create.
    """

    def __init__(self, stream: io.BufferedIOBase):
        super().__init__(stream)
        self.storages: dict[str, Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise UnsafePickleError(
                f"names the global '{module}.{name}', which a PyTorch state dict does not contain; refusing to "
                "unpickle it"
            )
        return _ALLOWED_GLOBALS[module, name]

    def persistent_load(self, pid: Any) -> Storage:
        """torch's ``('storage', class, key, location, numel)``; the legacy format adds a view, or None."""
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
            raise DamagedInputError(f"the persistent id {pid!r} is not a PyTorch storage's")
        _, storage_class, key, _location, numel, *view = pid
        if not (isinstance(storage_class, _StorageClass) and isinstance(key, str) and type(numel) is int):
            raise DamagedInputError(f"the persistent id {pid!r} is not a PyTorch storage's")
        if view not in ([], [None]):
            raise DamagedInputError(f"storage {key!r} is saved as a view of another storage, which is not read")
        storage = self.storages.setdefault(key, Storage(key, storage_class.dtype, numel))
        if storage != Storage(key, storage_class.dtype, numel):
            raise DamagedInputError(f"storage {key!r} is named both as {storage} and by {pid!r}")
        return storage


def unpickle(stream: io.BufferedIOBase, path: pathlib.Path, what: str) -> tuple[Any, dict[str, Storage]]:
    """One pickle from ``stream`` and the storages it names; a corrupt or truncated one is an error naming ``path``."""
    unpickler = _StateDictUnpickler(stream)
    try:
        return unpickler.load(), unpickler.storages
    except UnsafePickleError as error:
        raise UnsafePickleError(f"{path} {error}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as error:
        raise DamagedInputError(
            f"{path} is truncated or not a PyTorch state dict: unpickling its {what} failed "
            f"({type(error).__name__}: {error})"
        ) from error


def state_dict(state: Any, path: pathlib.Path) -> dict[str, PickledTensor]:
    """The unpickled object, checked to be what ``torch.save(model.state_dict())`` writes: names -> tensors."""
    if not isinstance(state, dict):
        raise DamagedInputError(f"{path} holds a {type(state).__name__}, not a state dict (tensor name -> tensor)")
    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, PickledTensor):
            raise DamagedInputError(f"{path} holds {name!r} as a {type(tensor).__name__}: not a state dict of tensors")
    return state
