"""What a run prints while it trains: progress bars on a terminal, plain lines in a log file.

The training bar's rate and ETA count training only (compilations,
evaluations and checkpoints are paused out of it); log lines print above
the bars. Where stderr is not a terminal no bar is drawn, since redrawn bars
fill files with carriage returns: the log lines carry the progress there.
"""

from __future__ import annotations

import contextlib
import logging as python_logging
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from absl import logging
from tqdm import tqdm
from tqdm.contrib import DummyTqdmFile

from oodjax.engine.results import Run

# jax.monitoring events whose durations add up to a compilation: tracing, lowering, XLA.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_TIME_FORMAT = "%H:%M:%S"
# Up to this many runs, per-run values print inline on the log line; more make a seeds x shots table.
INLINE_RUNS = 4


class _ShortLines(python_logging.Formatter):
    """`12:04:31 INFO message`, not absl's long prefix; a library's line names the library."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(source)s%(message)s", datefmt=_TIME_FORMAT)

    def format(self, record: python_logging.LogRecord) -> str:
        record.source = "" if record.name == "absl" else f"{record.name}: "
        return super().format(record)


def use_short_log_lines() -> None:
    """Makes absl's handler, which every log line of the process goes through, print short lines."""
    logging.get_absl_handler().setFormatter(_ShortLines())


def by_run(label: str, runs: Sequence[Run], values: Sequence[str]) -> str:
    """Each run's value labelled by seed and shots: inline up to ``INLINE_RUNS`` runs, else a seeds x shots
    table, so nine runs take four short lines rather than nine numbers only their order identifies."""
    cells = {(run.seed, run.shots): value for run, value in zip(runs, values, strict=True)}
    if len(cells) <= INLINE_RUNS:
        return f"{label}: " + ", ".join(f"seed{seed}_shots{shots} {value}" for (seed, shots), value in cells.items())
    seeds = list(dict.fromkeys(seed for seed, _ in cells))
    shots = list(dict.fromkeys(shot for _, shot in cells))
    rows = [["", *(f"shots{shot}" for shot in shots)]]
    rows += [[f"seed{seed}", *(cells.get((seed, shot), "") for shot in shots)] for seed in seeds]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([f"{label}:", *lines])


def bar(*, enabled: bool = True, **options: Any) -> tqdm:
    """A tqdm bar (``options``: total, initial, desc, unit, leave...) on stderr, drawn only where stderr is a
    terminal (``disable=None``) and ``enabled``."""
    return tqdm(**options, dynamic_ncols=True, disable=None if enabled else True, file=sys.stderr)


@contextlib.contextmanager
def logs_above_bars() -> Iterator[None]:
    """Routes absl's log lines through ``tqdm.write`` while bars are live, so each line prints above them.

    Not tqdm's ``logging_redirect_tqdm``: it handles only plain StreamHandlers, and absl's wraps one.
    """
    handler = logging.get_absl_handler().python_handler
    original = handler.stream
    handler.setStream(DummyTqdmFile(original))
    try:
        yield
    finally:
        handler.setStream(original)


class CompileClock:
    """Seconds JAX spent compiling while the ``with`` block ran, from its monitoring events."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def _listen(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event in _COMPILE_EVENTS:
            self.seconds += duration_secs

    def __enter__(self) -> CompileClock:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc_info: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


@contextlib.contextmanager
def first_call(what: str) -> Iterator[None]:
    """Says that ``what``'s compilation starts, then how long the call took and how much of it compiling was."""
    logging.info("compiling the %s (its first call) ...", what)
    start = time.perf_counter()
    with CompileClock() as clock:
        yield
    logging.info("%s: first call %.1f s, of which compiling %.1f s", what, time.perf_counter() - start, clock.seconds)


def duration(seconds: float) -> str:
    """H:MM:SS, tqdm's format, so log lines and bars read alike."""
    return tqdm.format_interval(seconds)
