"""A full disk, named: the one error a job stops with when a write finds no space, and nothing lost.

Results (``oodjax.engine.results``) and checkpoints
(``oodjax.engine.checkpoints``) are written so that a failed write leaves
the previous file or checkpoint whole. When the failure is a full disk,
what reaches the user should say so, and where, in one line, rather than
a library's traceback (TensorStore reports ENOSPC as a ValueError whose
message holds the system's text, orbax re-raises it from a background
thread): ``reporting_full_disk`` turns any error caused by ENOSPC into a
``NoSpaceError`` naming the path being written and what is still intact.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
from collections.abc import Callable, Iterator

_NO_SPACE_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"


class NoSpaceError(OSError):
    """The device filled up while writing a results file or a checkpoint; what was written before is intact."""


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
        raise NoSpaceError(
            errno.ENOSPC, f"{_NO_SPACE_TEXT} while writing {path}; {intact()}. Free space and rerun to resume"
        ) from error
