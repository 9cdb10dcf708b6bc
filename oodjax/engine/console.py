"""What a run prints while it trains: progress bars on a terminal, plain lines in a log file.

A researcher watching a terminal gets a training bar whose rate and ETA count
training only (compilations, evaluations and checkpoints are paused out of
it) and an evaluation bar; log lines print above the bars, never through
them. Where stderr is not a terminal (a SLURM log, a pipe) no bar is drawn,
since redrawn bars fill files with carriage returns; the loop's log lines,
which carry the step, the ETA and each evaluation's duration, are the
progress there.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

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


def bar(*, total: int, initial: int = 0, desc: str, unit: str, enabled: bool = True, leave: bool = True) -> tqdm:
    """A tqdm bar on stderr, drawn only where stderr is a terminal (``disable=None``) and ``enabled``."""
    return tqdm(
        total=total, initial=initial, desc=desc, unit=unit, leave=leave, dynamic_ncols=True,
        disable=None if enabled else True, file=sys.stderr,
    )  # fmt: skip


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
