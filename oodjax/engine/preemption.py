"""Stopping at a step boundary on SIGTERM or SIGUSR1, what SLURM and TPU pods send ahead of a time limit or a
preemption, on SIGHUP (the SSH session that started a TPU worker dropped) and on Ctrl-C (SIGINT): every process
finishes the current step (in a multi-process job, the steps up to the next one whose results the loop waits for
anyway), all agree on it (``StopSignals.agreed``), the loop checkpoints every run it is training and raises
``Preempted``, which ``oodjax.main`` turns into exit status ``PREEMPTED_EXIT_CODE`` (launch/slurm.sbatch requeues
itself on it) once it trained a step, else ``128 + signal`` as a process the signal ended: requeueing a job that
trained nothing would loop.

The scheduler's signals may come while Python is still importing (seconds): ``hold_stop_signals``, called by
``oodjax.main`` before its heavy imports, notes them from then on, and the loop's ``StopSignals`` acts on a signal
noted before it was entered.

Why not JAX's own preemption sync (``multihost_utils.reached_preemption_sync_point``): it hears SIGTERM alone,
through a C handler that ``jax.distributed.initialize`` installs (XLA's SigtermNotifier) and that the Python
handlers here replace, while SLURM warns of a time limit with SIGUSR1 (launch/slurm.sbatch) and a user stops with
Ctrl-C; and it offers Python no way to post a notice of another signal.

A second Ctrl-C ends the process at once, killed by SIGINT (the first restores the system's default action):
for someone who will not wait for the checkpoint. Nothing is lost that a crash would not lose: results and
checkpoints are written atomically, so the next start resumes each run from its last complete checkpoint
(and takes over the run locks left behind, ``oodjax.engine.run_lock``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from typing import Any

from absl import logging

# EX_TEMPFAIL of sysexits.h, "temporary failure, try again": the exit status of a job stopped by a stop
# signal once it trained a step and checkpointed its runs. launch/slurm.sbatch requeues itself on it.
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)
# Held from the start of `python -m oodjax.main`: the scheduler's and the session's, not Ctrl-C, which outside
# training ends the process at once (oodjax.usage_errors).
HELD_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class _Noted:
    """The process's stop signals: shared by ``hold_stop_signals`` and the ``StopSignals`` entered later."""

    received: str | None = None  # the name of the first signal received, until a StopSignals exits
    steps_trained = 0  # steps trained since the StopSignals was entered


_NOTED = _Noted()


class Preempted(Exception):
    """A stop signal stopped training after ``step``; the runs then training are checkpointed at it."""

    def __init__(self, step: int, runs: Sequence[str], signal_name: str):
        self.step = step
        self.runs = tuple(runs)
        self.signal_name = signal_name
        self.trained = _NOTED.steps_trained > 0  # whether this process trained a step before it stopped
        self.exit_code = PREEMPTED_EXIT_CODE if self.trained else 128 + _signal_number(signal_name)
        super().__init__(
            f"stopped by {signal_name} after step {step}: {len(self.runs)} runs checkpointed at step {step} "
            f"({', '.join(self.runs)}); rerun the same command to resume"
        )


class StopSignals:
    """While entered, SIGTERM, SIGUSR1 and a first SIGINT are noted rather than fatal, for the loop to stop at a
    step boundary; a second SIGINT kills the process (see the module).

    Python runs signal handlers in the main thread only, so elsewhere (a
    thread calling ``train``) the signals keep their handlers.
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    @property
    def received(self) -> str | None:
        """The name of the first stop signal received (before this was entered too, once held), or None."""
        return _NOTED.received

    def __enter__(self) -> StopSignals:
        _NOTED.steps_trained = 0
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, _receive) for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        _NOTED.received = None  # acted on: a later job in this process starts afresh

    def step_trained(self) -> None:
        """The loop trained a step: a stop from now on exits with ``PREEMPTED_EXIT_CODE``."""
        _NOTED.steps_trained += 1

    def agreed(self, *, synced: bool = True) -> bool:
        """Whether to stop now. In one process: whether it received a stop signal. In a multi-process job: whether
        any process did, asked (each process's flag all-gathered, a few bytes) only where ``synced``, a step whose
        results the loop waits for anyway (a log line, an evaluation, a checkpoint; before training): the
        all-gather waits for the devices to finish the step, so elsewhere it would stop the host from
        dispatching ahead. Every process passes the same ``synced`` at the same step, so all stop at the same
        one, the first such step after the signal."""
        import jax  # here, not at the top: oodjax.main holds the signals before it imports JAX
        import numpy as np
        from jax.experimental import multihost_utils

        requested = self.received is not None
        if jax.process_count() == 1:
            return requested
        return synced and bool(np.any(multihost_utils.process_allgather(np.asarray(requested))))


def hold_stop_signals() -> None:
    """Notes SIGTERM, SIGUSR1 and SIGHUP from now on (in the main thread), for the loop to act on once it
    trains: a scheduler's warning while Python imports or loads would otherwise end the process."""
    if threading.current_thread() is threading.main_thread():
        for number in HELD_SIGNALS:
            signal.signal(number, _receive)


def _receive(number: int, frame: object) -> None:
    interrupt = number == signal.SIGINT
    if interrupt:  # the system's action, not Python's KeyboardInterrupt: it acts even inside a device call
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _NOTED.received is None:
        _NOTED.received = signal.Signals(number).name
        logging.warning(
            "received %s: finishing the current step, then checkpointing the runs and exiting (status %d once a "
            "step is trained)%s",
            _NOTED.received,
            PREEMPTED_EXIT_CODE,
            "; Ctrl-C again exits at once, each run to resume from its last complete checkpoint" if interrupt else "",
        )
    elif interrupt:
        logging.warning("received SIGINT after %s: Ctrl-C again exits at once", _NOTED.received)


def _signal_number(name: str) -> int:
    """The number of a signal named as ``Preempted`` names it; SIGTERM's for a signal to another process."""
    return signal.Signals[name].value if name in signal.Signals.__members__ else signal.SIGTERM.value
