"""Errors a user fixes, reported as one line with exit status 2; anything else is a bug and keeps its traceback.

A 30-line traceback hides the one line that matters, so ``reported`` prints
a ``UsageError`` as ``<program>: error: <message>`` with argparse's status
2, and Ctrl-C as one line with status 130 (128 + SIGINT); training handles
Ctrl-C itself first (``oodjax.engine.preemption``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

EXIT_STATUS = 2
INTERRUPTED_EXIT_STATUS = 130
FETCH_COMMAND = "oodjax-fetch"


class UsageError(Exception):
    """A mistake or a missing input the user fixes; the message says what is wrong, where, and what to do."""


class ConfigError(UsageError, ValueError):
    """A config field whose value cannot be used; the message names the field and the allowed values."""


class MissingInputError(UsageError, FileNotFoundError):
    """A file or folder the job reads does not exist."""


class DamagedInputError(UsageError, ValueError):
    """A file the job reads exists but cannot be used as it is; the message names the file and what is wrong."""


class NotFetchedError(MissingInputError):
    """An input that must come from the unreachable hub and is not here: ``python -m launch.fetch`` brings it."""


@contextlib.contextmanager
def reported(program: str, *, config_spec: str | None = None) -> Iterator[None]:
    """Runs the body, a ``UsageError`` or Ctrl-C as one line; ``config_spec`` completes the fetch command."""
    try:
        yield
    except UsageError as error:
        message = " ".join(str(error).split("\n"))  # one line, whatever a library's message held
        if isinstance(error, NotFetchedError):  # what to run, on a machine that reaches the hub, to bring it
            fetch = f"python -m launch.fetch {config_spec or 'CONFIG'}"
            message += f"; on a machine online (a cluster's login node) run `{fetch}`, then retry"
        print(f"{program}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STATUS)
    except KeyboardInterrupt:
        print(f"{program}: interrupted", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT_STATUS)
