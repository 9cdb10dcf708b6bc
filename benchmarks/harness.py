"""Timing contenders side by side: each in a process of its own, taking turns; ratios of the fastest repetitions.

Each contender runs in a fresh process (``benchmarks.worker``), so no two
share a thread pool, an allocator or a compilation cache. The processes take
turns, and a call starts only once every process of the case has been idle
for ``SETTLE_WINDOW_S``: PyTorch's OpenMP workers and XLA's pool spin for a
moment after a call, which would slow the next contender. Rounds rotate the
order (A B C, B C A, ...), so a slow spell of the machine falls on each in
turn; compilations and the CPU time the rest of the machine used are
recorded per call.

A ratio is of each contender's fastest repetition: the shared machines have
slow spells no program here causes, and a spell only ever adds time, so the
fastest turn is the speed on a quiet machine (why Python's timeit reports
the minimum). Medians and each round's ratio are kept beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks import machine
from oodjax.engine.console import CompileClock

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETTLE_WINDOW_S = 0.05  # a case's processes count as idle once none used a CPU tick in this long
SETTLE_LIMIT_S = 5.0  # past this, the call goes ahead and its other_cpu_s records what still ran


@dataclasses.dataclass(frozen=True)
class Timing:
    """One contender's measurements; ``seconds`` are the timed repetitions only."""

    seconds: tuple[float, ...]
    first_call_s: float
    compile_s: float
    compile_during_timing_s: float
    other_cpu_s: tuple[float, ...] = ()  # per repetition: CPU seconds the rest of the machine used meanwhile

    @property
    def min_s(self) -> float:
        return min(self.seconds)

    def summary(
        self, work: float, *, flops: Sequence[float] | None = None, peak_flops: float | None = None
    ) -> dict[str, Any]:
        """Times, the rate of ``work`` per second (median and range over repetitions) and, given each
        repetition's model ``flops``, the model FLOP/s and its fraction of ``peak_flops``."""
        times = time_fields(self.seconds)
        out = {
            **times,
            "work_per_repeat": work,
            "rate_median": work / times["median_s"],
            "rate_min": work / times["max_s"],
            "rate_max": work / times["min_s"],
            "first_call_s": self.first_call_s,
            "compile_s": self.compile_s,
            "compile_during_timing_s": self.compile_during_timing_s,
        }
        if self.other_cpu_s:
            out["other_cpu_s"] = list(self.other_cpu_s)
        if flops is not None:
            if len(flops) != len(self.seconds):
                raise ValueError(f"{len(flops)} FLOP counts for {len(self.seconds)} repetitions")
            rates = [f / s for f, s in zip(flops, self.seconds)]
            out["model_gflops_median"] = statistics.median(rates) / 1e9
            if peak_flops:
                out["peak_fraction"] = statistics.median(rates) / peak_flops
                out["peak_fraction_min"] = min(rates) / peak_flops
                out["peak_fraction_max"] = max(rates) / peak_flops
        return out


def time_fields(seconds: Sequence[float]) -> dict[str, Any]:
    """The fields every contender's results open with: its repetitions' seconds, their median and range."""
    return {
        "repeats": len(seconds),
        "seconds": list(seconds),
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
    }


def run_command(command: list[str], *, what: str, env: Mapping[str, str] | None = None) -> str:
    """The standard output of ``command``, run in the repository root; a failure is a RuntimeError quoting the
    end of its standard error, ``what`` naming it."""
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """What ``fn()`` returned, its wall seconds and the seconds JAX compiled during it (the engine's own
    ``console.CompileClock``); ``fn`` must return only once its work is done."""
    with CompileClock() as compiling:
        start = time.perf_counter()
        returned = fn()
        seconds = time.perf_counter() - start
    return returned, seconds, compiling.seconds


def json_channel() -> Callable[[dict[str, Any]], None]:
    """A sender of one-line JSON messages on this process's stdout, which from now on sends anything else
    printed to stderr: a library's print must not break the messages (``benchmarks.worker``, a device phase)."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def send(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    return send


def alternating(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, contender) in timing order: each repeat starts one contender later than the last."""
    order = []
    for repeat in range(repeats):
        shift = repeat % len(names)
        order += [(repeat, name) for name in names[shift:] + names[:shift]]
    return order


class Worker:
    """One contender in a process of its own, making one call per request; a failure quotes its log's end."""

    def __init__(self, module: str, name: str, kwargs: Mapping[str, Any], log: pathlib.Path):
        self.name, self.log = name, log
        command = [sys.executable, "-m", "benchmarks.worker", module, name, json.dumps(kwargs)]
        with log.open("w") as stderr:
            self.process = subprocess.Popen(
                command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
            )
        assert self.process.stdin is not None and self.process.stdout is not None  # both piped
        self.stdin, self.stdout = self.process.stdin, self.process.stdout

    def receive(self) -> dict[str, Any]:
        """The process's next answer: what it built (first), then one call's measurements."""
        line = self.stdout.readline()
        if not line:
            code = self.process.wait()
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"contender {self.name} exited ({code}); the end of {self.log}:\n{tail}")
        return json.loads(line)

    def call(self) -> dict[str, Any]:
        try:
            self.stdin.write("call\n")
            self.stdin.flush()
        except BrokenPipeError:
            pass  # the process has exited: receive says how
        return self.receive()

    def close(self) -> None:
        """Ends the process (it stops when its stdin closes; killed if it has not within a minute)."""
        self.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.stdout.close()


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What ``compare`` measured: each contender's timing, what each of its calls returned (warm-up calls
    first) and its process (pid, setup seconds, PyTorch threads, and what the contender reported of itself)."""

    timings: dict[str, Timing]
    returned: dict[str, list[Any]]
    processes: dict[str, dict[str, Any]]


def compare(
    module: str,
    names: Sequence[str],
    kwargs: Mapping[str, Any],
    *,
    repeats: int,
    warmup: int,
    logs: pathlib.Path,
) -> Comparison:
    """Time the contenders ``names`` of ``benchmarks.<module>`` (its ``contender(name, **kwargs)``), each in
    a process of its own: ``warmup`` untimed calls each, then ``repeats`` rounds (``alternating``)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if not names:
        raise ValueError("compare needs at least one contender")
    logs.mkdir(parents=True, exist_ok=True)
    workers: dict[str, Worker] = {}
    try:
        for name in names:
            workers[name] = Worker(module, name, kwargs, logs / f"{module}-{name}.log")
        processes = {name: worker.receive() for name, worker in workers.items()}
        warm = {name: [_turn(workers, name) for _ in range(warmup)] for name in names}
        timed: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for _, name in alternating(list(names), repeats):
            timed[name].append(_turn(workers, name))
    finally:
        for worker in workers.values():
            worker.close()
    timings = {
        name: Timing(
            seconds=tuple(answer["seconds"] for answer in timed[name]),
            first_call_s=warm[name][0]["seconds"] if warm[name] else float("nan"),
            compile_s=sum((answer["compile_s"] for answer in warm[name]), 0.0),
            compile_during_timing_s=sum((answer["compile_s"] for answer in timed[name]), 0.0),
            other_cpu_s=tuple(answer["other_cpu_s"] for answer in timed[name]),
        )
        for name in names
    }
    returned = {name: [answer["returned"] for answer in warm[name] + timed[name]] for name in names}
    return Comparison(timings, returned, processes)


def _turn(workers: Mapping[str, Worker], name: str) -> dict[str, Any]:
    """One call of ``name``'s contender once all ``workers`` are idle, with ``other_cpu_s``: the CPU seconds
    the machine spent on anything else meanwhile (to the kernel's 10 ms ticks)."""
    settle([worker.process.pid for worker in workers.values()])
    pid = workers[name].process.pid
    busy, own = machine.busy_cpu_seconds(), machine.process_cpu_seconds(pid)
    answer = workers[name].call()
    other = machine.busy_cpu_seconds() - busy - (machine.process_cpu_seconds(pid) - own)
    return {**answer, "other_cpu_s": max(other, 0.0)}  # the two counters' ticks can differ by one


def settle(pids: Sequence[int]) -> None:
    """Wait until the processes ``pids`` together use no CPU tick in ``SETTLE_WINDOW_S``, at most
    ``SETTLE_LIMIT_S``: threads still spinning after a call, or a process still starting, end first."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    used = sum(machine.process_cpu_seconds(pid) for pid in pids)
    while time.monotonic() < deadline:
        time.sleep(SETTLE_WINDOW_S)
        now = sum(machine.process_cpu_seconds(pid) for pid in pids)
        if now == used:
            return
        used = now


def ratios(results: Mapping[str, Mapping[str, Any]], ours: str, *, of: str = "min_s") -> dict[str, float]:
    """``ours``'s rate over each other contender's (above 1: ours is faster), from the time ``of`` each: its
    fastest repetition (``min_s``, the headline: see the module's docstring) or its median (``median_s``)."""

    def rate(contender: Mapping[str, Any]) -> float:
        return contender["work_per_repeat"] / contender[of]

    return {f"{ours}/{name}": rate(results[ours]) / rate(r) for name, r in results.items() if name != ours}


def ratios_per_round(results: Mapping[str, Mapping[str, Any]], ours: str) -> dict[str, list[float]]:
    """``ours``'s rate over each other contender's in each round (repetition r of every contender, taken one
    right after another): the spread of ``ratios``. Rates are ``work_per_repeat`` / seconds."""

    def rates(contender: Mapping[str, Any]) -> list[float]:
        return [contender["work_per_repeat"] / s for s in contender["seconds"]]

    return {
        f"{ours}/{name}": [a / b for a, b in zip(rates(results[ours]), rates(r), strict=True)]
        for name, r in results.items()
        if name != ours
    }


def ratio_fields(results: Mapping[str, Mapping[str, Any]], ours: str) -> dict[str, Any]:
    """A case's ratio fields, as the report reads them: ``ratios`` (of the fastest repetitions, the
    headline), ``ratios_of_medians`` and ``ratios_per_round`` beside it."""
    return {
        "ratios": ratios(results, ours),
        "ratios_of_medians": ratios(results, ours, of="median_s"),
        "ratios_per_round": ratios_per_round(results, ours),
    }
