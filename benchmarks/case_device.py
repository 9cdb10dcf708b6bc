"""`python -m benchmarks --device gpu`: the study's 9 runs at SmolLM3-3B's shape, bf16, on one accelerator.

oodjax trains and evaluates the 9 runs in one process, as the run loop does;
PyTorch runs them as the study did, one after another, peft's LoRA attached
and removed per run, with the tuned loops. A repetition is what the study
does between two evaluations: ``DeviceMode.steps`` training steps and one
evaluation. The models are random (the CPU cases check that both sides
compute the same thing): throughput depends on shapes, not values. With
--smoke the same code runs tiny on any backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import flops, harness, oodjax_contenders, settings
from benchmarks.oodjax_contenders import Engine, build_engine, lora_config, train_geometry
from benchmarks.settings import DeviceMode
from benchmarks.workload import mode_workload, run_orders
from launch.devices import DEVICES
from oodjax import models
from oodjax.data import DEFAULT_MAX_LENGTH
from oodjax.engine import sharding, steps
from oodjax.engine.console import CompileClock
from oodjax.engine.evaluation import EvalPool, evaluate

# Nominal dense bf16 peak FLOP/s by a substring of jax's device_kind (H200 is H100's chip with more memory).
PEAK_BY_KIND = {
    "H100": DEVICES["h100"].peak_flops,
    "H200": DEVICES["h100"].peak_flops,
    "A100": DEVICES["a100"].peak_flops,
}


def device_peak_flops(device_kind: str) -> float | None:
    """The nominal bf16 peak of a device of jax's ``device_kind``, or None where unknown (then no MFU)."""
    return next((peak for kind, peak in PEAK_BY_KIND.items() if kind in device_kind), None)


PHASES = ("oodjax", "agreement", "pytorch")  # in the order they run
# What each phase is, for the progress lines.
PHASE_WORK = {
    "oodjax": "oodjax's runs trained and evaluated, timed",
    "agreement": "the fused attention's margins against XLA's and float32's",
    "pytorch": "PyTorch's runs one after another, timed, in a process of its own",
}


def run(
    mode: DeviceMode,
    phases: list[str],
    *,
    save: Callable[[dict[str, Any]], None],
    earlier: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The ``phases`` asked for, oodjax's and PyTorch's each in a process of its own, so that neither holds
    the other's device memory; ``save`` gets what is measured so far after each phase."""
    platform = jax.devices()[0].platform
    if mode.needs_gpu and platform != "gpu":
        raise SystemExit(f"--device gpu needs JAX's GPU backend; found {platform} (--smoke runs tiny on any backend)")
    if mode.needs_gpu and "pytorch" in phases:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device gpu needs a CUDA PyTorch for its pytorch phase (--phases oodjax runs without)")
    ordered = [phase for phase in PHASES if phase in phases]
    progress = _Progress(ordered, earlier or {})
    measured: dict[str, Any] = {}
    jax_phases = [phase for phase in ordered if phase != "pytorch"]
    children = ([["oodjax", *jax_phases]] if jax_phases else []) + ([["pytorch"]] if "pytorch" in ordered else [])
    for child in children:
        for phase, result in _child(mode, child, progress):
            measured[phase] = result
            results = {**assemble(mode, measured), "phase_seconds": dict(progress.seconds)}
            save(results)
            progress.done(phase)
    return results


class _Progress:
    """The progress lines: a phase started, what it is and what is left; a phase done, its seconds."""

    def __init__(self, phases: list[str], earlier: dict[str, float]):
        self.phases, self.earlier = phases, earlier
        self.seconds: dict[str, float] = {}
        self.clock = time.perf_counter()

    def left(self, phases: list[str]) -> str:
        if not phases:
            return "nothing left"
        if all(phase in self.earlier for phase in phases):
            return f"about {sum(self.earlier[phase] for phase in phases):.0f} s left ({', '.join(phases)})"
        return f"left: {', '.join(phases)} (no earlier run of this mode to estimate their time from)"

    def start(self, phase: str) -> None:
        self.clock = time.perf_counter()
        ahead = self.phases[self.phases.index(phase) :]
        print(f"[benchmarks] {phase}: started, {PHASE_WORK[phase]}; {self.left(ahead)}", file=sys.stderr, flush=True)

    def finish(self, phase: str) -> None:
        self.seconds[phase] = time.perf_counter() - self.clock

    def done(self, phase: str) -> None:
        after = self.phases[self.phases.index(phase) + 1 :]
        print(
            f"[benchmarks] {phase}: done in {self.seconds[phase]:.0f} s, results written; {self.left(after)}",
            file=sys.stderr,
            flush=True,
        )


def _child(mode: DeviceMode, phases: list[str], progress: _Progress) -> Iterator[tuple[str, Any]]:
    """Runs ``python -m benchmarks.case_device MODE PHASES`` and yields each phase's result as it ends; its
    stderr is this process's."""
    command = [sys.executable, "-m", "benchmarks.case_device", json.dumps(dataclasses.asdict(mode)), *phases]
    with subprocess.Popen(command, cwd=harness.ROOT, stdout=subprocess.PIPE, text=True) as process:
        for line in process.stdout:
            message = json.loads(line)
            if "started" in message:
                progress.start(message["started"])
            else:
                progress.finish(message["phase"])
                yield message["phase"], message["result"]
    if process.returncode:
        raise SystemExit(f"--device gpu: the process of the phases {phases} exited with status {process.returncode}")


def child_main(argv: list[str]) -> None:
    """A child of ``run``: the phases ``argv[1:]`` of the mode ``argv[0]`` (JSON), one JSON line on stdout as
    each starts and as each ends (with its result); what the libraries print goes to stderr."""
    fields = json.loads(argv[0])
    mode = DeviceMode(**{**fields, "changes": tuple(tuple(change) for change in fields["changes"])})
    phases = argv[1:]
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a library's print must not break the messages

    def send(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    workload, seeds, batches, answers = inputs(mode)
    if phases == ["pytorch"]:
        send({"started": "pytorch"})
        send({"phase": "pytorch", "result": _pytorch_sequential(mode, workload, seeds, batches, answers)})
        return
    send({"started": "oodjax"})
    result, engine, pool = oodjax_phase(mode, workload, seeds, batches, answers)
    send({"phase": "oodjax", "result": result})
    if "agreement" in phases:
        send({"started": "agreement"})
        send({"phase": "agreement", "result": _agreement(mode, engine, workload, seeds, answers, pool)})


def oodjax_phase(
    mode: DeviceMode, workload: Any, seeds: list[int], batches: list[list[np.ndarray]], answers: dict[str, int]
) -> tuple[dict[str, Any], Engine, EvalPool]:
    """oodjax's runs timed (``_oodjax``): the result ``assemble`` reads (timings, peak device memory, the
    device, the train step's layout), and the trained engine and its pool for the agreement."""
    device = jax.devices()[0]
    timing, engine, pool, geometry = _oodjax(mode, workload, seeds, batches, answers)
    result = {
        "timing": timing,
        # before the agreement's float32 copy
        "peak_bytes": (device.memory_stats() or {}).get("peak_bytes_in_use"),
        "device": {"kind": device.device_kind, "platform": device.platform},
        "geometry": {"grad_accum": geometry.grad_accum, "rows": geometry.rows, "seq_len": geometry.seq_len},
    }
    return result, engine, pool


def inputs(mode: DeviceMode) -> tuple[Any, list[int], list[list[np.ndarray]], dict[str, int]]:
    """The workload, the runs' seeds, each step's batches and the answer tokens, the same in every process."""
    workload = mode_workload(mode)
    seeds = list(range(mode.runs))
    batches = run_orders(len(workload.train_set), seeds, (mode.repeats + 1) * mode.steps, settings.TRAIN_BATCH)
    return workload, seeds, batches, dict(yes_id=workload.yes_id, no_id=workload.no_id)


def assemble(mode: DeviceMode, measured: dict[str, Any]) -> dict[str, Any]:
    """The cases (training, evaluation) of the phases ``measured`` so far: each side's timings, their ratios
    once both are there, the agreement once it is."""
    workload, seeds, batches, _ = inputs(mode)
    ours, theirs = measured.get("oodjax"), measured.get("pytorch")
    device = ours["device"] if ours else {"kind": "not measured", "platform": "not measured"}
    peak = device_peak_flops(device["kind"])
    train_lengths = [workload.train_set.lengths[np.concatenate(step)] for step in batches]
    train_flops = [
        sum(
            flops.train_flops(mode.model, train_lengths[(r + 1) * mode.steps + s], lora_rank=settings.LORA["rank"])
            for s in range(mode.steps)
        )
        for r in range(mode.repeats)
    ]
    eval_flops = len(seeds) * flops.eval_flops(mode.model, workload.eval_set.lengths, lora_rank=settings.LORA["rank"])
    shape = (
        f"{mode.model['num_hidden_layers']} layers, hidden {mode.model['hidden_size']}, "
        f"vocabulary {mode.model['vocab_size']}, bf16"
    )
    memory = {
        "oodjax_peak_bytes": ours["peak_bytes"] if ours else None,
        "pytorch_peak_bytes": theirs["peak_bytes"] if theirs else None,
    }
    device_line = f"{device['kind']} ({device['platform']}); PyTorch on {theirs['device'] if theirs else 'not run'}"
    timings = {
        name: {phase: _timing(t) for phase, t in side["timing"].items()}
        for name, side in (("oodjax", ours), ("pytorch-tuned-sequential", theirs))
        if side
    }
    cases = []
    for phase, phase_name, work, phase_flops in (
        ("train", "Training", mode.steps * len(seeds) * settings.TRAIN_BATCH, train_flops),
        ("eval", "Evaluation", len(seeds) * len(workload.eval_set), [eval_flops] * mode.repeats),
    ):
        results = {
            name: timing[phase].summary(work, flops=phase_flops, peak_flops=peak) for name, timing in timings.items()
        }
        both = len(results) == 2
        cases.append(
            {
                "case": f"device-{phase}",
                "title": f"{phase_name} of {len(seeds)} runs on {device['kind']}",
                "unit": "examples/s",
                "description": _describe(phase, mode, shape, device_line, ours, workload, len(seeds), peak),
                "contenders": results,
                "memory": memory,
                **({"ratios": harness.ratios(results, "oodjax")} if both else {}),
                **({"ratios_of_medians": harness.ratios(results, "oodjax", of="median_s")} if both else {}),
                **({"agreement": measured["agreement"]} if phase == "eval" and "agreement" in measured else {}),
            }
        )
    return {
        "cases": cases,
        "phases_done": list(measured),
        **({"torch_threads": theirs["torch_threads"]} if theirs else {}),
    }


def _timing(fields: dict[str, Any]) -> harness.Timing:
    """A ``harness.Timing`` from its JSON fields."""
    return harness.Timing(**{key: tuple(v) if isinstance(v, list) else v for key, v in fields.items()})


def _oodjax(
    mode: DeviceMode, workload: Any, seeds: list[int], batches: list[list[np.ndarray]], answers: dict[str, int]
) -> tuple[dict[str, dict[str, Any]], Engine, EvalPool, Any]:
    """oodjax's 9 runs in one process: per repetition, ``mode.steps`` train steps and one evaluation."""
    engine = build_engine(
        lambda mesh: models.from_config(mode.model, dtype="bfloat16", seed=0, remat=mode.remat),
        seeds=seeds,
        total_steps=len(batches),
        **answers,
    )
    tokenized = workload.train_set
    geometry = train_geometry(tokenized, batches, grad_accum=mode.grad_accum, row_length=DEFAULT_MAX_LENGTH)
    pool = engine.eval_pool(workload.eval_set, batch_tokens=_eval_batch_tokens(mode))

    def train(step: int) -> None:
        engine.train(geometry, tokenized, batches[step])

    def score() -> None:
        engine.margins(pool)

    timing = _phases(train, score, mode, warm=lambda: engine.compile_train(geometry, tokenized, batches[0]))
    return timing, engine, pool, geometry


def _eval_batch_tokens(mode: DeviceMode) -> int:
    return mode.eval_batch_rows * settings.MAX_LENGTH


def _agreement(
    mode: DeviceMode, engine: Engine, workload: Any, seeds: list[int], answers: dict[str, int], pool: EvalPool
) -> dict[str, float]:
    """The largest margin difference of the engine's attention, XLA's in bf16, and the fused path on the first
    run alone (as a one-run job or ``oodjax.evaluate`` of one adapter runs it), each against XLA's in float32:
    two bf16 paths can differ by the sum of their rounding."""
    place = lambda batch: sharding.shard_batch(batch, engine.mesh, batch_axis=1)  # noqa: E731

    def margins(dtype: str, attention: str, run_seeds: list[int], base: Any, lora: Any, run_pool: EvalPool) -> list:
        graphdef, _, _ = steps.abstract_attach_runs(
            lambda: models.abstract_model(mode.model, dtype=dtype, remat=mode.remat, attention=attention),
            run_seeds,
            lora_config(),
            steps.make_optimizer(settings.LEARNING_RATE, 1, 1, 0.0, None),
        )
        eval_step = steps.make_eval_step(graphdef, answers["yes_id"], answers["no_id"], mesh=engine.mesh)
        return [m[oodjax_contenders.EVAL_SET] for m in evaluate(eval_step, base, lora, run_pool, place=place)]

    def largest_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))

    fused = [m[oodjax_contenders.EVAL_SET] for m in engine.margins(pool)]
    xla = margins("bfloat16", "xla", seeds, engine.base_state, engine.runs.lora, pool)
    as_float32 = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )
    float32 = margins("float32", "xla", seeds, as_float32(engine.base_state), as_float32(engine.runs.lora), pool)
    one_pool = engine.eval_pool(workload.eval_set, batch_tokens=_eval_batch_tokens(mode), runs=1)
    first_run = jax.tree.map(lambda x: x[:1], engine.runs.lora)
    one_run = margins("bfloat16", "auto", seeds[:1], engine.base_state, first_run, one_pool)
    return {
        "fused_vs_xla_max_abs_margin_diff": largest_difference(fused, xla),
        "fused_vs_float32_max_abs_margin_diff": largest_difference(fused, float32),
        "xla_vs_float32_max_abs_margin_diff": largest_difference(xla, float32),
        "one_run_vs_float32_max_abs_margin_diff": largest_difference(one_run, float32[:1]),
        "max_abs_margin": max(float(np.abs(m).max()) for m in float32),
        # how far the adapters move margins (float32, run 0 against the others): the one-run check scores the
        # right adapter where this is well above its rounding
        "between_runs_max_abs_margin_diff": largest_difference(float32[:1] * (len(float32) - 1), float32[1:]),
    }


def _pytorch_sequential(
    mode: DeviceMode, workload: Any, seeds: list[int], batches: list[list[np.ndarray]], answers: dict[str, int]
) -> dict[str, Any]:
    """The runs one after another, as the study ran them, each repetition's times summed over the runs."""
    import torch

    from benchmarks import torch_contenders  # PyTorch, transformers and peft: in this phase's process only

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def sync() -> None:  # CUDA calls return before their work is done
        if device == "cuda":
            torch.cuda.synchronize()

    base = torch_contenders.build_model(mode.model, seed=0, dtype=torch.bfloat16, device=device)
    rows = np.arange(len(workload.eval_set))
    train_s, eval_s, first_s = np.zeros(mode.repeats), np.zeros(mode.repeats), 0.0
    for run, seed in enumerate(seeds):
        model = torch_contenders.attach_lora(base, seed=seed)
        trainer = torch_contenders.Trainer(model, tuned=True, total_steps=len(batches), **answers)

        def train(step: int) -> None:
            trainer.step(workload.train_set, batches[step][run])

        def score() -> None:
            torch_contenders.margins_tuned(model, workload.eval_set, rows, batch_size=mode.eval_batch_rows, **answers)

        start = time.perf_counter()
        train(0)
        score()
        sync()
        first_s += time.perf_counter() - start
        run_train_s, run_eval_s = _repetitions(train, score, mode, sync)
        train_s, eval_s = train_s + run_train_s, eval_s + run_eval_s
        base = model.unload()  # the base model without this run's adapter, for the next run
    return {
        "timing": _timing_fields(train_s, eval_s, first_s),
        "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "device": device,
        "torch_threads": torch.get_num_threads(),
    }


def _phases(
    train: Callable[[int], None], score: Callable[[], None], mode: DeviceMode, *, warm: Callable[[], None]
) -> dict[str, dict[str, Any]]:
    """oodjax's phases timed after a warm-up; each step returns its loss and each evaluation its margins to
    the host, so a timed phase ends when its work has."""
    with CompileClock() as warming:
        start = time.perf_counter()
        warm()
        train(0)
        score()
        first_s = time.perf_counter() - start
    with CompileClock() as timing:
        train_s, eval_s = _repetitions(train, score, mode, sync=lambda: None)
    return _timing_fields(train_s, eval_s, first_s, warming.seconds, timing.seconds)


def _timing_fields(
    train_s: np.ndarray, eval_s: np.ndarray, first_s: float, compile_s: float = 0.0, late_s: float = 0.0
) -> dict[str, dict[str, Any]]:
    """Both phases' ``harness.Timing`` as JSON fields (the processes send them; ``_timing`` reads them back)."""
    phases = {"train": train_s, "eval": eval_s}
    return {
        phase: dataclasses.asdict(harness.Timing(tuple(s.tolist()), first_s, compile_s, late_s))
        for phase, s in phases.items()
    }


def _repetitions(
    train: Callable[[int], None], score: Callable[[], None], mode: DeviceMode, sync: Callable[[], None]
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of each repetition's two phases: ``mode.steps`` training steps (repetition r takes steps
    (r + 1) x steps on: step 0 is the warm-up's) and one evaluation, each ended by ``sync``."""
    train_s, eval_s = np.zeros(mode.repeats), np.zeros(mode.repeats)
    for r in range(mode.repeats):
        start = time.perf_counter()
        for s in range(mode.steps):
            train((r + 1) * mode.steps + s)
        sync()
        train_s[r] = time.perf_counter() - start
        start = time.perf_counter()
        score()
        sync()
        eval_s[r] = time.perf_counter() - start
    return train_s, eval_s


def _describe(
    phase: str,
    mode: DeviceMode,
    shape: str,
    device_line: str,
    ours: dict[str, Any] | None,
    workload: Any,
    runs: int,
    peak: float | None,
) -> str:
    lengths = workload.train_set.lengths if phase == "train" else workload.eval_set.lengths
    what = (
        f"{mode.steps} steps of batch {settings.TRAIN_BATCH} per run and repetition; oodjax: one train step for "
        f"all runs, {_layout(ours['geometry']) if ours else 'not run'}, remat {mode.remat}; "
        "PyTorch: each run's tuned loop (dynamic padding, head at the answer position)"
        if phase == "train"
        else f"{len(lengths)} real testset prompts scored by every run; oodjax: one pool packed into rows, all runs "
        "at once; PyTorch: each run's tuned loop (length-sorted batches, two head columns)"
    )
    mfu = f"of peak = MFU against {peak / 1e12:.0f} TFLOP/s bf16" if peak else "no MFU (device peak unknown)"
    return (
        f"{runs} runs, SmolLM3-3B's shape ({shape}; random weights), {device_line}; {what}. Prompts: mean "
        f"{lengths.mean():.0f} GPT-2 tokens, max {int(lengths.max())}. Model FLOPs count "
        f"real tokens only; {mfu}. Compile time is oodjax's warm-up (train step and evaluation)."
    )


def _layout(geometry: dict[str, int]) -> str:
    return f"{geometry['grad_accum']} micro-batch(es) of {geometry['rows']} packed rows of {geometry['seq_len']} tokens"


if __name__ == "__main__":
    child_main(sys.argv[1:])
