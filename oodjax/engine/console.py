"""What a run prints while it trains: progress bars on a terminal, plain lines in a log file.

A researcher watching a terminal gets a training bar whose rate and ETA count
training only (compilations, evaluations and checkpoints are paused out of
it) and an evaluation bar; log lines print above the bars, never through
them. Where stderr is not a terminal (a SLURM log, a pipe) no bar is drawn,
since redrawn bars fill files with carriage returns; the loop's log lines,
which carry the step, the ETA and each evaluation's duration, are the
progress there.

Every log line is short: the time, the level and the message
(``use_short_log_lines``; a library's lines also name the library). Values
kept per run are labelled by run (``by_run``): inline for a few runs, a
table of seeds by shot counts for more.
"""

from __future__ import annotations

import contextlib
import logging as python_logging
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import jax
from absl import logging
from tqdm import tqdm
from tqdm.contrib import DummyTqdmFile

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
    """`12:04:31 INFO message`, rather than after absl's `I1126 12:04:31.123456 140213 loop.py:312] `; a line
    of a library (orbax, jax) names it: `12:04:31 WARNING jax._src.xla_bridge: message`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s", datefmt=_TIME_FORMAT)
        self._library = python_logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt=_TIME_FORMAT
        )

    def format(self, record: python_logging.LogRecord) -> str:
        return super().format(record) if record.name == "absl" else self._library.format(record)


def use_short_log_lines() -> None:
    """Makes absl's handler, which every log line of the process goes through, print short lines (``_ShortLines``).

    Called by ``oodjax.config_cli.run``, so every entry point prints alike.
    """
    logging.get_absl_handler().setFormatter(_ShortLines())


class SeededRun(Protocol):
    """What ``by_run`` labels a value with: a run's seed and shot count (``oodjax.engine.results.Run``'s)."""

    seed: int
    shots: int


def by_run(label: str, runs: Sequence[SeededRun], values: Sequence[str]) -> str:
    """``label`` and each run's value, labelled by the run's seed and shots: ``loss: seed0_shots32 0.6931,
    seed42_shots32 0.7012`` for up to ``INLINE_RUNS`` runs; for more, ``label:`` then a table on lines of its own
    (a row per seed, a column per shot count, blank where there is no such run), so nine runs take four short
    lines rather than one of nine numbers that only their order identifies."""
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


def bar(*, total: int, initial: int = 0, desc: str, unit: str, enabled: bool = True, leave: bool = True) -> tqdm:
    """A tqdm bar on stderr, drawn only where stderr is a terminal (``disable=None``) and ``enabled``."""
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        leave=leave,
        dynamic_ncols=True,
        disable=None if enabled else True,
        file=sys.stderr,
    )


@contextlib.contextmanager
def logs_above_bars() -> Iterator[None]:
    """Routes absl's log lines through ``tqdm.write`` while bars are live, so each line prints above them.

    (tqdm's ``logging_redirect_tqdm`` handles only plain StreamHandlers; absl's
    handler wraps one, whose stream is swapped here.)
    """
    handler = logging.get_absl_handler().python_handler
    original = handler.stream
    handler.setStream(DummyTqdmFile(original))
    try:
        yield
    finally:
        handler.setStream(original)


class CompileClock:
    """Seconds JAX spent compiling (tracing, lowering, XLA) while the ``with`` block ran; persistent-cache hits
    cost none. Measured from JAX's own monitoring events, so it is the compilation, not the first run."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def _listen(self, event: str, duration: float, **kwargs: object) -> None:
        if event in _COMPILE_EVENTS:
            self.seconds += duration

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
    """``seconds`` as H:MM:SS (tqdm's own format, so log lines and bars read alike)."""
    return tqdm.format_interval(seconds)
