"""A disk cache of numpy arrays keyed by content hashes, so a sweep tokenises each testset once.

Entries are npz files written atomically (``oodjax.storage.write_npz_atomic``),
so concurrent runs sharing a cache never read a torn file: two writers of one
key write identical bytes and the last rename wins.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import zipfile
from collections.abc import Callable, Iterable

import numpy as np
from absl import logging

from oodjax.storage import write_npz_atomic

CACHE_DIR_ENV = "OODJAX_CACHE_DIR"


def default_cache_dir() -> pathlib.Path:
    """$OODJAX_CACHE_DIR, else ~/.cache/oodjax."""
    return pathlib.Path(os.environ.get(CACHE_DIR_ENV) or pathlib.Path.home() / ".cache" / "oodjax")


def content_key(parts: Iterable[str | bytes]) -> str:
    """A sha256 over the parts, each length-prefixed so that no two part lists collide."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def cached_arrays(path: pathlib.Path, compute: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays stored at `path`, computing and storing them first when absent.

    An entry that cannot be read (truncated or corrupted on disk, since
    writes are atomic) is computed and stored again, with a warning naming it.
    """
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as stored:
                return {name: stored[name] for name in stored.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            logging.warning(
                "cache entry %s is unreadable (%s: %s); computing it again", path, type(error).__name__, error
            )
    arrays = compute()
    write_npz_atomic(path, arrays)
    return arrays
