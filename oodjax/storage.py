"""Writes that lose nothing: one atomic npz writer, and a full disk named in one line.

A failed write leaves the previous file or checkpoint whole. A full disk
reaches the user as one ``NoSpaceError`` naming the path and what is intact,
not a library's traceback: TensorStore reports ENOSPC as a ValueError
holding the system's text, and orbax re-raises it from a background thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import secrets
from collections.abc import Callable, Iterator, Mapping
from typing import BinaryIO

import numpy as np

_NO_SPACE_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"


class NoSpaceError(OSError):
    """The device filled up while writing ``path``; what was written before is intact."""

    def __init__(self, path: str | pathlib.Path, intact: str):
        super().__init__(
            errno.ENOSPC, f"{_NO_SPACE_TEXT} while writing {path}; {intact}. Free space and rerun to resume"
        )
        self.path = pathlib.Path(path)


def _not_a_library_full_disk_report(record: logging.LogRecord) -> bool:
    """Drops orbax's and asyncio's reports of a full disk, hundreds of lines around the one ``NoSpaceError``."""
    library = record.name == "asyncio" or "/orbax/" in record.pathname
    error = record.exc_info[1] if record.exc_info else None
    about_full_disk = (error is not None and is_no_space(error)) or _NO_SPACE_TEXT in record.getMessage()
    return not (library and about_full_disk)


def silence_library_full_disk_reports() -> None:
    for name in ("absl", "asyncio"):  # orbax logs through absl's logger
        logging.getLogger(name).addFilter(_not_a_library_full_disk_report)  # one already there is not added twice


def is_no_space(error: BaseException) -> bool:
    """Whether ``error`` or its cause is ENOSPC; the text too, which is all TensorStore and orbax keep."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if (isinstance(current, OSError) and current.errno == errno.ENOSPC) or _NO_SPACE_TEXT in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


@contextlib.contextmanager
def reporting_full_disk(path: str | pathlib.Path, intact: Callable[[], str]) -> Iterator[None]:
    """Re-raises an error caused by a full device as a ``NoSpaceError``; ``intact()`` is read after it."""
    try:
        yield
    except NoSpaceError:
        raise
    except Exception as error:
        if not is_no_space(error):
            raise
        raise NoSpaceError(path, intact()) from error


def write_atomic(path: str | pathlib.Path, write: Callable[[BinaryIO], object], *, intact: str) -> None:
    """Writes `path` through `write(file)` so that it is always either what it was (or absent) or complete.

    Not `tempfile`: its 0600 mode would survive the rename; this one is 0666 less the umask, as `open`'s.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    with reporting_full_disk(path, lambda: intact):
        descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(descriptor, "wb") as file:
                write(file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def write_npz_atomic(path: str | pathlib.Path, arrays: Mapping[str, np.ndarray]) -> None:
    path = pathlib.Path(path)
    write_atomic(path, lambda f: np.savez(f, allow_pickle=True, **arrays), intact=f"the previous {path.name} is intact")
