"""Stopping at a step boundary on SIGTERM, SIGUSR1 (a scheduler's time limit or preemption), SIGHUP and Ctrl-C.

Every process finishes the current step, all agree on it
(``StopSignals.agreed``), the loop checkpoints its runs and raises
``Preempted``: exit status ``PREEMPTED_EXIT_CODE`` (launch/slurm.sbatch
requeues on it) once a step was trained, else ``128 + signal``, since
requeueing a job that trained nothing would loop. A second Ctrl-C ends the
process at once; results and checkpoints are atomic, so it loses no more
than a crash would.

Not JAX's preemption sync (``reached_preemption_sync_point``): it hears
SIGTERM alone, while SLURM warns with SIGUSR1 and a user stops with Ctrl-C.
"""

from __future__ import annotations

import atexit
import signal
import threading
from collections.abc import Sequence
from typing import Any

from absl import logging

# EX_TEMPFAIL of sysexits.h, "temporary failure, try again".
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)
# Held from the start of `python -m oodjax.main`: the scheduler's and the session's, not Ctrl-C, which outside
# training ends the process at once (oodjax.usage_errors).
HELD_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class Preempted(Exception):
    """A stop signal stopped training after ``step``; the runs then training are checkpointed at it."""

    def __init__(self, step: int, runs: Sequence[str], signal_name: str):
        self.step = step
        self.runs = tuple(runs)
        self.signal_name = signal_name
        self.trained = StopSignals.steps_trained > 0  # whether this process trained a step before it stopped
        number = getattr(signal.Signals, signal_name, signal.SIGTERM)  # SIGTERM's for another process's stop
        self.exit_code = PREEMPTED_EXIT_CODE if self.trained else 128 + number
        super().__init__(
            f"stopped by {signal_name} after step {step}: {len(self.runs)} runs checkpointed at step {step} "
            f"({', '.join(self.runs)}); rerun the same command to resume"
        )


class StopSignals:
    """While entered, the stop signals are noted rather than fatal (in the main thread: Python's rule).

    What was noted is the process's, in class attributes: ``hold_stop_signals`` notes before any is entered.
    """

    received: str | None = None  # the name of the first signal received, until a StopSignals exits
    steps_trained = 0  # steps trained since the StopSignals was entered
    step: int | None = None  # the step the loop last dispatched, for a line that names where it stopped

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        StopSignals.steps_trained = 0
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, _receive) for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        StopSignals.received = None  # acted on: a later job in this process starts afresh

    def step_trained(self, step: int | None = None) -> None:
        """The loop trained a step: a stop from now on exits with ``PREEMPTED_EXIT_CODE``."""
        StopSignals.steps_trained += 1
        StopSignals.step = step

    def agreed(self, *, synced: bool = True) -> bool:
        """Whether any process received a stop signal.

        Asked across processes only where ``synced``, a step whose results the
        loop waits for anyway: the all-gather waits for the devices, so
        elsewhere it would stop the host from dispatching ahead.
        """
        import jax  # here, not at the top: oodjax.main holds the signals before it imports JAX
        import numpy as np
        from jax.experimental import multihost_utils

        requested = self.received is not None
        if jax.process_count() == 1:
            return requested
        return synced and bool(np.any(multihost_utils.process_allgather(np.asarray(requested))))


def last_step() -> int | None:
    """The step the loop last dispatched, if any."""
    return StopSignals.step


def hold_stop_signals() -> None:
    """Notes the scheduler's signals from now on: one while Python imports or loads would otherwise end it.

    Ignored once Python exits: its shutdown gives every signal with a Python handler back its default,
    fatal action before JAX's backends are torn down (seconds), so a time-limit warning then would turn a
    finished job into one killed with status 128 + 10, which launch/slurm.sbatch reports as failed.
    """
    if threading.current_thread() is threading.main_thread():
        for number in HELD_SIGNALS:
            signal.signal(number, _receive)
        atexit.unregister(_ignore_held_signals)  # registered once, however often this is called
        atexit.register(_ignore_held_signals)


def _ignore_held_signals() -> None:
    for number in HELD_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


def _receive(number: int, frame: object) -> None:
    interrupt = number == signal.SIGINT
    if interrupt:  # the system's action, not Python's KeyboardInterrupt: it acts even inside a device call
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    if StopSignals.received is None:
        StopSignals.received = signal.Signals(number).name
        logging.warning(
            "received %s: finishing the current step, then checkpointing the runs and exiting (status %d once a "
            "step is trained)%s",
            StopSignals.received,
            PREEMPTED_EXIT_CODE,
            "; Ctrl-C again exits at once, each run to resume from its last complete checkpoint" if interrupt else "",
        )
    elif interrupt:
        logging.warning("received SIGINT after %s: Ctrl-C again exits at once", StopSignals.received)
