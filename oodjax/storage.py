"""Writes that lose nothing: one atomic npz writer, and a full disk named in one line.

Results (``oodjax.engine.results``), the tokenisation cache
(``oodjax.data.cache``) and checkpoints (``oodjax.engine.checkpoints``) are
written so that a failed write leaves the previous file or checkpoint whole
(npz files through ``write_npz_atomic``). When the failure is a full disk,
what reaches the user should say so, and where, in one line, rather than
a library's traceback (TensorStore reports ENOSPC as a ValueError whose
message holds the system's text, orbax re-raises it from a background
thread): ``reporting_full_disk`` turns any error caused by ENOSPC into a
``NoSpaceError`` naming the path being written and what is still intact.
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
    """The device filled up while writing a results file or a checkpoint (``path``); what was written before
    is intact."""

    def __init__(self, path: str | pathlib.Path, intact: str):
        super().__init__(
            errno.ENOSPC, f"{_NO_SPACE_TEXT} while writing {path}; {intact}. Free space and rerun to resume"
        )
        self.path = pathlib.Path(path)


class _LibraryFullDiskReports(logging.Filter):
    """Drops what a library logs about a full disk: orbax's errors from each of its writing threads (with
    their tracebacks) and asyncio's "Task exception was never retrieved" for each of its tasks, hundreds of
    lines around the one ``NoSpaceError`` that says it all. Records of any other failure pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        library = record.name == "asyncio" or "/orbax/" in record.pathname
        error = record.exc_info[1] if record.exc_info else None
        about_full_disk = (error is not None and is_no_space(error)) or _NO_SPACE_TEXT in record.getMessage()
        return not (library and about_full_disk)


_LIBRARY_REPORTS = _LibraryFullDiskReports()


def silence_library_full_disk_reports() -> None:
    """Installs ``_LibraryFullDiskReports`` on the loggers orbax (absl's) and asyncio log to; once is enough."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_LIBRARY_REPORTS)  # a filter already there is not added twice


def is_no_space(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, is a full device (ENOSPC).

    Libraries that wrap the system error (TensorStore, orbax) keep only its
    text, so the message is checked too.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        if _NO_SPACE_TEXT in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


@contextlib.contextmanager
def reporting_full_disk(path: str | pathlib.Path, intact: Callable[[], str]) -> Iterator[None]:
    """Re-raises an error caused by a full device as a one-line ``NoSpaceError`` naming ``path``.

    ``intact()``, called after the failure, says what the failed write left
    as it was (e.g. "the previous metrics.npz is intact"). Any other error
    passes through unchanged.
    """
    try:
        yield
    except NoSpaceError:
        raise
    except Exception as error:
        if not is_no_space(error):
            raise
        raise NoSpaceError(path, intact()) from error


def write_atomic(path: str | pathlib.Path, write: Callable[[BinaryIO], None], *, intact: str) -> None:
    """Writes `path` through `write(file)` so that it is always either what it was (or absent) or complete.

    The temporary file is created with mode 0666 less the umask, as `open`
    would (`tempfile` would make it 0600, and the rename would keep that). A
    full disk raises `NoSpaceError` naming `path` and `intact`, what is left
    as it was.
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
    """Writes an npz so that `path` is always either the old file or the complete new one (`write_atomic`)."""
    path = pathlib.Path(path)
    write_atomic(path, lambda file: np.savez(file, **arrays), intact=f"the previous {path.name} is intact")
