"""One run, one writer: a job locks each of its runs while it trains or evaluates them (docs/engine.md).

Two jobs on one run corrupt it (one deletes the other's checkpoint in
progress), so ``locked_runs`` is taken before a job reads where its runs
stand and held until it exits. The lock is ``<run_dir>/run.lock``: JSON
naming its holder and a heartbeat that a daemon thread rewrites, since a
checkpoint load, a compile or an evaluation may each outlast the stale
threshold with no step in between. A lock is stale when its holder is an
earlier run of the same (requeued) SLURM job, a gone process of this host,
or its heartbeat is older than ``STALE_AFTER_SECONDS``.

``flock`` and ``fcntl`` are unreliable on NFS and Lustre, so the lock is the
file's existence, made with the NFS-safe recipe: write a uniquely named
record, link it to ``run.lock`` (one job wins) and trust the record's link
count, not the call's result (an NFS retransmit can report a link that
succeeded as failed). Taking over a stale lock is serialised by a second
such lock, ``run.lock.break``, so two jobs that judge it stale cannot both
win. In a multi-process job process 0 alone holds the locks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pathlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from oodjax.engine.distributed import is_primary
from oodjax.engine.results import Run
from oodjax.usage_errors import UsageError

LOCK_FILENAME = "run.lock"  # <run_dir>/run.lock while a job trains or evaluates the run
_BREAK_SUFFIX = ".break"  # run.lock.break: held while a stale run.lock is taken over
HEARTBEAT_SECONDS = 60.0  # how often the holder rewrites its heartbeat
STALE_AFTER_SECONDS = 600.0  # a heartbeat this old (ten missed) marks a lock whose holder is gone
# A run.lock.break this old was left by a job that died while taking a lock over (it takes milliseconds).
_BREAK_STALE_AFTER_SECONDS = 60.0
_ATTEMPTS = 20  # reads of a lock that keeps changing hands before giving up
# Errors of os.link on filesystems without hard links.
_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)


class RunLockedError(UsageError):
    """A run of the job is locked by another live job; nothing was written."""


class RunLockContendedError(RuntimeError):
    """A run's lock changed hands ``_ATTEMPTS`` times while this job tried to take it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds a lock, as its file says (the defaults: unknown); ``token`` tells one taking of a lock from any
    other."""

    host: str | None = None
    pid: int | None = None
    slurm_job: str | None = None  # SLURM_JOB_ID, with the array task if any ("123 (array 120_3)")
    slurm_restart: int = 0  # SLURM_RESTART_COUNT: how often SLURM requeued the job
    taken: float  # unix time
    heartbeat: float  # unix time of the last refresh
    token: str = ""  # "" for a file that is not a lock record

    def describe(self, now: float) -> str:
        if not self.token:
            return f"an unreadable lock file written {_ago(now - self.heartbeat)}"
        job = f", SLURM job {self.slurm_job}" if self.slurm_job else ""
        return f"process {self.pid} on {self.host}{job}, heartbeat {_ago(now - self.heartbeat)}"

    def stale_reason(self, now: float, here: Holder) -> str | None:
        """Why the lock's holder is gone, seen from ``here`` (this process); None while it may be alive."""
        if self.slurm_job and self.slurm_job == here.slurm_job and self.slurm_restart < here.slurm_restart:
            return "an earlier run of this SLURM job, requeued since"
        if self.host == here.host and self.pid is not None and not _process_alive(self.pid):
            return "its process is gone"
        if now - self.heartbeat > STALE_AFTER_SECONDS:
            return f"no heartbeat for {_duration(now - self.heartbeat)}"
        return None


def this_process() -> Holder:
    """A new record of this process as a lock holder, with a fresh token."""
    now = time.time()
    job = os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{job} (array {os.environ.get('SLURM_ARRAY_JOB_ID', '?')}_{os.environ['SLURM_ARRAY_TASK_ID']})"
    return Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        slurm_job=job or None,
        slurm_restart=int(os.environ.get("SLURM_RESTART_COUNT") or 0),
        taken=now,
        heartbeat=now,
        token=secrets.token_hex(16),
    )


class RunLock:
    """This process's lock on one run folder: refreshed by the heartbeat, released once."""

    def __init__(self, path: pathlib.Path, holder: Holder, created: pathlib.Path | None):
        self.path, self.holder = path, holder
        self._created = created  # the topmost folder that taking the lock created, None if none

    def refresh(self) -> bool:
        """Rewrites the heartbeat; False when the lock is no longer this process's (taken over as stale)."""
        if not _holds(self.path, self.holder):
            return False
        self.holder = dataclasses.replace(self.holder, heartbeat=time.time())
        os.replace(_write_record(self.path, self.holder), self.path)
        return True

    def release(self) -> None:
        """Deletes the lock if it is still this process's, then the folders taking it created, if still empty."""
        if _holds(self.path, self.holder):
            self.path.unlink(missing_ok=True)
        else:
            logging.warning("%s: not released, it is no longer this job's lock (taken over as stale)", self.path)
        _remove_created(self.path.parent, self._created)


def try_lock(run_dir: str | pathlib.Path) -> RunLock | Holder:
    """Locks ``run_dir`` (creating it) for this process, taking a stale lock over; else the live holder."""
    path = pathlib.Path(run_dir).absolute() / LOCK_FILENAME
    created = _make_folders(path.parent)
    try:
        for _ in range(_ATTEMPTS):
            held = _read(path)
            here = this_process()
            if held is None:
                if _create(path, here):
                    return RunLock(path, here, created)
                continue  # another job took it first: read it
            reason = held.stale_reason(time.time(), here)
            if reason is None:
                _remove_created(path.parent, created)
                return held
            if _break(path, held):
                logging.warning("%s: taking over the stale lock of %s (%s)", path, held.describe(time.time()), reason)
            else:
                time.sleep((10 + secrets.randbelow(40)) / 1000)  # another job is taking it over: milliseconds
    except BaseException:
        _remove_created(path.parent, created)
        raise
    _remove_created(path.parent, created)
    raise RunLockContendedError(f"{path}: the lock changed hands {_ATTEMPTS} times while this job tried to take it")


def live_holder(run_dir: str | pathlib.Path) -> Holder | None:
    """The holder of the run folder's lock if it is live (not stale); reads only."""
    holder = _read(pathlib.Path(run_dir).absolute() / LOCK_FILENAME)
    return holder if holder is not None and holder.stale_reason(time.time(), this_process()) is None else None


RunT = TypeVar("RunT", bound=Run)  # a job's runs, or those ``oodjax.evaluate`` plans


@contextlib.contextmanager
def locked_runs(runs: Sequence[RunT], *, skip_locked: bool) -> Iterator[list[RunT]]:
    """Holds the lock of every run while the body runs; yields the runs held, in order.

    A run locked by a live job raises ``RunLockedError``, or with ``skip_locked`` is left out. While the body
    runs, a daemon thread refreshes the locks' heartbeats (``_beat``).
    """
    locks: list[RunLock] = []
    holders: dict[int, Holder] = {}
    stop = threading.Event()
    heartbeat = threading.Thread(target=_beat, args=(locks, stop), name="oodjax-run-locks", daemon=True)
    try:
        if is_primary():
            # Read first: a job that will stop on a locked run writes nothing, not even the other runs' locks.
            for index, run in enumerate(runs):
                holder = live_holder(run.directory)
                if holder is not None:
                    holders[index] = holder
            for index, run in enumerate(runs):
                if index in holders or (holders and not skip_locked):
                    continue
                taken = try_lock(run.directory)
                if isinstance(taken, RunLock):
                    locks.append(taken)
                else:
                    holders[index] = taken
        held = _agreed(np.array([index not in holders for index in range(len(runs))], dtype=bool))
        locked = [run for run, run_held in zip(runs, held) if not run_held]
        if locked:
            message = _locked_message(locked, [holders.get(index) for index in np.flatnonzero(~held).tolist()])
            if not skip_locked:
                raise RunLockedError(
                    f"{message}; wait for that job to end (a lock whose heartbeat stops for "
                    f"{_duration(STALE_AFTER_SECONDS)} is taken over), or set runs.skip_locked=True to go on "
                    "without the locked runs"
                )
            logging.warning("left out (runs.skip_locked): %s", message)
        if locks:
            heartbeat.start()
        yield [run for run, run_held in zip(runs, held) if run_held]
    finally:
        stop.set()
        if heartbeat.is_alive():
            heartbeat.join()
        for lock in reversed(locks):  # the last taken first: a folder made for the first may hold the others'
            lock.release()


def _beat(held: Sequence[RunLock], stop: threading.Event) -> None:
    """Refreshes the heartbeat of each of ``held`` every ``HEARTBEAT_SECONDS`` until ``stop``; a lock taken
    over as stale is dropped."""
    locks = list(held)
    while not stop.wait(HEARTBEAT_SECONDS):
        for lock in list(locks):
            try:
                if lock.refresh():
                    continue
            except OSError as error:  # a network filesystem's hiccup: the next beat retries
                logging.warning(
                    "%s: heartbeat not written (%s); retrying in %.0f s", lock.path, error, HEARTBEAT_SECONDS
                )
                continue
            holder = _read(lock.path)
            logging.error(
                "%s: this job's lock was taken over as stale by %s; another job may now write this run",
                lock.path,
                holder.describe(time.time()) if holder else "nobody (it was deleted)",
            )
            locks.remove(lock)


def _agreed(held: np.ndarray) -> np.ndarray:
    """Process 0's ``held`` in every process (a broadcast of a few bytes in a multi-process job)."""
    if jax.process_count() == 1:
        return held
    return np.asarray(multihost_utils.broadcast_one_to_all(held.astype(np.int32))).astype(bool)


def _locked_message(runs: Sequence[Run], holders: Sequence[Holder | None]) -> str:
    """The locked runs grouped by holder, in one line (process 0 knows the holders; the others say so)."""
    now = time.time()
    groups: dict[str, list[str]] = {}
    for run, holder in zip(runs, holders, strict=True):
        who = holder.describe(now) if holder is not None else "a holder that process 0 names"
        groups.setdefault(who, []).append(f"{run.name} ({run.directory / LOCK_FILENAME})")
    return "; ".join(
        f"{'run' if len(names) == 1 else 'runs'} {', '.join(names)} {'is' if len(names) == 1 else 'are'} locked "
        f"by another job that trains or evaluates {'it' if len(names) == 1 else 'them'}: {who}"
        for who, names in groups.items()
    )


def _read(path: pathlib.Path) -> Holder | None:
    """The lock's holder, None when there is none; a file that is not a record holds it since its mtime."""
    try:
        text = path.read_text(encoding="utf-8")
        modified = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
        return Holder(**{field.name: record[field.name] for field in dataclasses.fields(Holder)})
    except (ValueError, TypeError, KeyError):
        return Holder(taken=modified, heartbeat=modified)


def _holds(path: pathlib.Path, holder: Holder) -> bool:
    """Whether the lock file ``path`` is ``holder``'s record (the same taking of the lock: its token)."""
    current = _read(path)
    return current is not None and current.token == holder.token


def _write_record(path: pathlib.Path, holder: Holder) -> pathlib.Path:
    """Writes ``holder`` to a new file of its own beside ``path``; returns it."""
    record = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    _write_new(record, holder)
    return record


def _write_new(path: pathlib.Path, holder: Holder) -> None:
    """Creates ``path`` holding ``holder``, on disk; FileExistsError where it exists."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        json.dump(dataclasses.asdict(holder), file)
        file.flush()
        os.fsync(file.fileno())


def _create(path: pathlib.Path, holder: Holder) -> bool:
    """Creates the lock ``path`` holding ``holder`` if there is none; whether this call made it."""
    record = _write_record(path, holder)
    try:
        try:
            os.link(record, path)
        except FileExistsError:
            pass  # someone holds it, or an NFS retransmit of a link that succeeded: the link count says
        except OSError as error:
            if error.errno not in _NO_HARD_LINKS:
                raise
            return _create_exclusive(path, holder)
        if os.stat(record).st_nlink != 2:
            return False
    finally:
        record.unlink(missing_ok=True)
    return _holds(path, holder)


def _create_exclusive(path: pathlib.Path, holder: Holder) -> bool:
    """``_create`` without hard links (some FUSE filesystems); a reader may see the file empty for a moment,
    which counts as a live holder until it is old."""
    try:
        _write_new(path, holder)
    except FileExistsError:
        return False
    return _holds(path, holder)


def _break(path: pathlib.Path, stale: Holder) -> bool:
    """Deletes the stale lock ``path`` if it still holds ``stale``, under ``run.lock.break``; whether it did."""
    breaker = path.with_name(path.name + _BREAK_SUFFIX)
    if not _create(breaker, this_process()):
        left = _read(breaker)  # a job that died while breaking leaves it: it is stale after a minute
        if left is not None and time.time() - left.heartbeat > _BREAK_STALE_AFTER_SECONDS:
            breaker.unlink(missing_ok=True)
        return False
    try:
        if _read(path) != stale:
            return False  # it changed hands since it was judged stale
        path.unlink(missing_ok=True)
        return True
    finally:
        breaker.unlink(missing_ok=True)


def _make_folders(folder: pathlib.Path) -> pathlib.Path | None:
    """Creates ``folder`` and its missing parents; the topmost one created (None when it existed)."""
    missing = None
    probe = folder
    while not probe.exists() and probe != probe.parent:
        missing, probe = probe, probe.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_created(folder: pathlib.Path, created: pathlib.Path | None) -> None:
    """Removes the folders ``_make_folders`` created, from ``folder`` up to ``created``, while empty."""
    while created is not None:
        try:
            folder.rmdir()
        except OSError:  # not empty: a job wrote there
            return
        if folder == created:
            return
        folder = folder.parent


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ago(seconds: float) -> str:
    return f"{_duration(max(seconds, 0.0))} ago"


def _duration(seconds: float) -> str:
    """12 s, 7 min, 3.5 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
