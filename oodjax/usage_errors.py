"""Errors a user fixes, reported as one line with exit status 2; anything else is a bug and keeps its traceback.

A wrong config value, a path that does not exist, or a model, tokenizer or
testset split that is not on this machine while the hub is out of reach:
each is the user's to fix, and a 30-line traceback around the one line that
matters hides it. The entry points run their work inside ``reported``, which
prints such an error as ``<program>: error: <message>`` and exits with
status 2 (the status argparse and absl use for a bad command line). What is
not a ``UsageError`` propagates untouched, except Ctrl-C: the user's own
stop, which ends the program with one line and status 130 (128 + SIGINT, a
shell's status for it). Training handles Ctrl-C itself first, checkpointing
its runs (``oodjax.engine.preemption``); this covers the rest (loading, an
evaluation, a download).
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
    """A file the job reads exists but cannot be used as it is (truncated, corrupt, or not what reads it
    expects); the message names the file and what is wrong."""


class NotFetchedError(MissingInputError):
    """A model, tokenizer or testset split that must come from the Hugging Face hub, which is not reachable (or
    HF_HUB_OFFLINE is set), and is not on this machine: ``python -m launch.fetch`` brings it, on a machine online."""


def fetch_hint(config_spec: str | None) -> str:
    """What to run, on a machine that reaches the hub, to bring what a config needs."""
    target = config_spec or "CONFIG"
    return f"on a machine online (a cluster's login node) run `python -m launch.fetch {target}`, then retry"


@contextlib.contextmanager
def reported(program: str, *, config_spec: str | None = None) -> Iterator[None]:
    """Runs the body; a ``UsageError`` becomes one line on stderr and exit status 2, Ctrl-C (KeyboardInterrupt)
    one line and exit status 130.

    ``config_spec`` (the ``--config`` argument) completes the fetch command a
    ``NotFetchedError`` suggests.
    """
    try:
        yield
    except UsageError as error:
        message = " ".join(str(error).split("\n"))  # one line, whatever a library's message held
        if isinstance(error, NotFetchedError):
            message = f"{message}; {fetch_hint(config_spec)}"
        print(f"{program}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STATUS)
    except KeyboardInterrupt:
        print(f"{program}: interrupted", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT_STATUS)
