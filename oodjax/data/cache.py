"""A disk cache of numpy arrays keyed by content hashes, so a sweep tokenises each testset once.

Entries are written atomically, so runs sharing a cache never read a torn
file: two writers of one key write identical bytes and the last rename wins.
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


def content_key(parts: Iterable[str | bytes]) -> str:
    """A sha256 over the parts, each length-prefixed so that no two part lists collide."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def cached_arrays(
    folder: str,
    key_parts: Iterable[str | bytes],
    compute: Callable[[], dict[str, np.ndarray]],
    *,
    cache_dir: str | os.PathLike[str] | None,
    use_cache: bool,
) -> dict[str, np.ndarray]:
    """`compute()`'s arrays, stored under `<cache_dir>/<folder>/<content key>.npz` and read from there once stored.

    `key_parts` must hold everything the arrays depend on. An entry that
    cannot be read (damaged on disk) is computed and stored again.
    """
    if not use_cache:
        return compute()
    root = pathlib.Path(cache_dir or os.environ.get(CACHE_DIR_ENV) or pathlib.Path.home() / ".cache" / "oodjax")
    path = root / folder / f"{content_key(key_parts)}.npz"
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
