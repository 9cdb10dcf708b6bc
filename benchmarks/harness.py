"""Timing contenders side by side: warm-up, alternating timed repetitions, median and range.

Contenders of one case are timed in turns (A B C, B C A, C A B, ...), so a
slow spell of a shared machine hits them alike rather than whichever ran
during it. The first warm-up call is kept apart: it holds JAX's tracing and
XLA compilation (counted exactly through jax.monitoring) and PyTorch's first
allocations. A compilation during the timed repetitions is recorded too, so
a step that recompiles per batch cannot hide in the medians.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class CompileClock:
    """Seconds JAX has spent tracing, lowering and compiling in this process so far."""

    _seconds = 0.0
    _registered = False

    @classmethod
    def seconds(cls) -> float:
        if not cls._registered:
            jax.monitoring.register_event_duration_secs_listener(cls._record)
            cls._registered = True
        return cls._seconds

    @classmethod
    def _record(cls, event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            cls._seconds += duration


@dataclasses.dataclass(frozen=True)
class Timing:
    """One contender's measurements; ``seconds`` are the timed repetitions only."""

    seconds: tuple[float, ...]
    first_call_s: float
    compile_s: float
    compile_during_timing_s: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min_s(self) -> float:
        return min(self.seconds)

    @property
    def max_s(self) -> float:
        return max(self.seconds)

    def summary(
        self, work: float, *, flops: Sequence[float] | None = None, peak_flops: float | None = None
    ) -> dict[str, Any]:
        """Times, the rate of ``work`` per second (median and range over repetitions) and, given each
        repetition's model ``flops``, the model FLOP/s and its fraction of ``peak_flops``."""
        out = {
            "repeats": len(self.seconds),
            "seconds": list(self.seconds),
            "median_s": self.median_s,
            "min_s": self.min_s,
            "max_s": self.max_s,
            "work_per_repeat": work,
            "rate_median": work / self.median_s,
            "rate_min": work / self.max_s,
            "rate_max": work / self.min_s,
            "first_call_s": self.first_call_s,
            "compile_s": self.compile_s,
            "compile_during_timing_s": self.compile_during_timing_s,
        }
        if flops is not None:
            if len(flops) != len(self.seconds):
                raise ValueError(f"{len(flops)} FLOP counts for {len(self.seconds)} repetitions")
            rates = [f / s for f, s in zip(flops, self.seconds)]
            out["model_gflops_median"] = statistics.median(rates) / 1e9
            if peak_flops:
                out["peak_fraction"] = statistics.median(rates) / peak_flops
        return out


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, compile seconds) of one call; ``fn`` must return only once its work is done."""
    compiled = CompileClock.seconds()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, CompileClock.seconds() - compiled


def alternating(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, contender) in timing order: each repeat starts one contender later than the last."""
    order = []
    for repeat in range(repeats):
        shift = repeat % len(names)
        order += [(repeat, name) for name in names[shift:] + names[:shift]]
    return order


def compare(contenders: Mapping[str, Callable[[], Any]], *, repeats: int, warmup: int) -> dict[str, Timing]:
    """Time each contender ``repeats`` times after ``warmup`` untimed calls, alternating their order."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if not contenders:
        raise ValueError("compare needs at least one contender")
    names = list(contenders)
    first_call, compile_s = {}, {}
    for name in names:
        first_call[name], compile_s[name] = _timed(contenders[name]) if warmup else (float("nan"), 0.0)
        for _ in range(warmup - 1):
            _, extra = _timed(contenders[name])
            compile_s[name] += extra
    seconds: dict[str, list[float]] = {name: [] for name in names}
    late_compile = dict.fromkeys(names, 0.0)
    for _, name in alternating(names, repeats):
        wall, compiled = _timed(contenders[name])
        seconds[name].append(wall)
        late_compile[name] += compiled
    return {
        name: Timing(tuple(seconds[name]), first_call[name], compile_s[name], late_compile[name]) for name in names
    }


def ratios(results: Mapping[str, Mapping[str, Any]], ours: str) -> dict[str, float]:
    """``ours``'s median rate over each other contender's (above 1: ours is faster)."""
    rate = results[ours]["rate_median"]
    return {f"{ours}/{name}": rate / r["rate_median"] for name, r in results.items() if name != ours}
