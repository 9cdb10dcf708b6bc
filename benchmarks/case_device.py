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
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import flops, harness, settings
from benchmarks.oodjax_contenders import EVAL_SET, TrainingEngine, contender_job, train_geometry, training_engine
from benchmarks.settings import DeviceMode
from benchmarks.workload import mode_workload, run_orders
from launch.devices import DEVICES, Device
from oodjax import models
from oodjax.data import DEFAULT_MAX_LENGTH
from oodjax.engine import sharding, steps
from oodjax.engine.evaluation import EvalPool, evaluate

# The launch tools' device by a substring of jax's device_kind (H200 is H100's chip with more memory).
DEVICE_BY_KIND = {"H100": DEVICES["h100"], "H200": DEVICES["h100"], "A100": DEVICES["a100"]}


def device_of(device_kind: str) -> Device | None:
    """The device of jax's ``device_kind`` (its nominal bf16 peak for the MFU), or None where unknown."""
    return next((device for kind, device in DEVICE_BY_KIND.items() if kind in device_kind), None)


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
    children = [[phase for phase in ordered if phase != "pytorch"], [phase for phase in ordered if phase == "pytorch"]]
    measured: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for child in filter(None, children):
        for message in _messages(mode, child):
            phase = message.get("started") or message["phase"]
            at = ordered.index(phase)
            if "started" in message:
                clock = time.perf_counter()
                left = _left(ordered[at:], earlier or {})
                print(f"[benchmarks] {phase}: started, {PHASE_WORK[phase]}; {left}", file=sys.stderr, flush=True)
                continue
            seconds[phase] = time.perf_counter() - clock
            measured[phase] = message["result"]
            results = {**assemble(mode, measured), "phase_seconds": dict(seconds)}
            save(results)
            left = _left(ordered[at + 1 :], earlier or {})
            print(f"[benchmarks] {phase}: done in {seconds[phase]:.0f} s, results written; {left}", file=sys.stderr)
    return results


def _left(phases: list[str], earlier: dict[str, float]) -> str:
    """What is left for the progress lines, with the time an earlier run of the mode took for it."""
    if not phases:
        return "nothing left"
    if all(phase in earlier for phase in phases):
        return f"about {sum(earlier[phase] for phase in phases):.0f} s left ({', '.join(phases)})"
    return f"left: {', '.join(phases)} (no earlier run of this mode to estimate their time from)"


def _messages(mode: DeviceMode, phases: list[str]) -> Iterator[dict[str, Any]]:
    """Runs ``python -m benchmarks.case_device MODE PHASES`` and yields its messages (``child_main``) as they
    come; its stderr is this process's."""
    command = [sys.executable, "-m", "benchmarks.case_device", json.dumps(dataclasses.asdict(mode)), *phases]
    with subprocess.Popen(command, cwd=harness.ROOT, stdout=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None  # piped
        yield from map(json.loads, process.stdout)
    if process.returncode:
        raise SystemExit(f"--device gpu: the process of the phases {phases} exited with status {process.returncode}")


def child_main(argv: list[str]) -> None:
    """A child of ``run``: the phases ``argv[1:]`` of the mode ``argv[0]`` (JSON), one JSON line on stdout as
    each starts and as each ends (with its result); what the libraries print goes to stderr."""
    fields = json.loads(argv[0])
    mode = DeviceMode(**{**fields, "changes": tuple(tuple(change) for change in fields["changes"])})
    phases = argv[1:]
    send = harness.json_channel()
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


def inputs(mode: DeviceMode) -> tuple[Any, list[int], list[list[np.ndarray]], dict[str, int]]:
    """The workload, the runs' seeds, each step's batches and the answer tokens, the same in every process."""
    workload = mode_workload(mode)
    seeds = list(range(mode.runs))
    batches = run_orders(len(workload.train_set), seeds, (mode.repeats + 1) * mode.steps, settings.TRAIN_BATCH)
    return workload, seeds, batches, dict(yes_id=workload.yes_id, no_id=workload.no_id)


def oodjax_phase(
    mode: DeviceMode, workload: Any, seeds: list[int], batches: list[list[np.ndarray]], answers: dict[str, int]
) -> tuple[dict[str, Any], TrainingEngine, EvalPool]:
    """oodjax's runs in one process, timed: the result ``assemble`` reads (timings, peak device memory, the
    device, the train step's layout), and the trained engine and its pool for the agreement."""
    tokenized, device = workload.train_set, jax.devices()[0]
    job = contender_job(
        mode.model, seeds=seeds, shots=mode.train_shots, total_steps=len(batches), dtype="bfloat16", remat=mode.remat
    )
    geometry = train_geometry(tokenized, batches, grad_accum=mode.grad_accum, row_length=DEFAULT_MAX_LENGTH)
    engine = training_engine(job, (answers["yes_id"], answers["no_id"]), geometry)
    pool = engine.eval_pool(workload.eval_set, batch_tokens=mode.eval_batch_rows * settings.MAX_LENGTH)
    timing = _timings(
        lambda step: engine.train(tokenized, batches[step]),
        lambda: engine.margins(pool),
        mode,
        warm=lambda: engine.compile_train(tokenized, batches[0]),
    )
    result = {
        "timing": {phase: dataclasses.asdict(t) for phase, t in timing.items()},
        "peak_bytes": (device.memory_stats() or {}).get("peak_bytes_in_use"),  # before the agreement's float32 copy
        "device": {"kind": device.device_kind, "platform": device.platform},
        "geometry": {"grad_accum": geometry.grad_accum, "rows": geometry.rows, "seq_len": geometry.seq_len},
    }
    return result, engine, pool


def assemble(mode: DeviceMode, measured: dict[str, Any]) -> dict[str, Any]:
    """The cases (training, evaluation) of the phases ``measured`` so far: each side's timings, their ratios
    once both are there, the agreement once it is."""
    workload, seeds, batches, _ = inputs(mode)
    ours, theirs = measured.get("oodjax"), measured.get("pytorch")
    device = ours["device"] if ours else {"kind": "not measured", "platform": "not measured"}
    known = device_of(device["kind"])
    peak = known.peak_flops if known else None
    model, rank, runs, train_lengths = mode.model, settings.LORA["rank"], len(seeds), workload.train_set.lengths
    train_flops = [
        sum(
            flops.train_flops(model, train_lengths[np.concatenate(batches[(r + 1) * mode.steps + s])], lora_rank=rank)
            for s in range(mode.steps)
        )
        for r in range(mode.repeats)
    ]
    eval_lengths = workload.eval_set.lengths
    eval_flops = runs * flops.eval_flops(model, eval_lengths, lora_rank=rank)
    shape = (
        f"{model['num_hidden_layers']} layers, hidden {model['hidden_size']}, vocabulary {model['vocab_size']}, bf16"
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
    layout = ours["geometry"] if ours else None
    train_what = (
        f"{mode.steps} steps of batch {settings.TRAIN_BATCH} per run and repetition; oodjax: one train step for "
        f"all runs, {_layout(layout) if layout else 'not run'}, remat {mode.remat}; "
        "PyTorch: each run's tuned loop (dynamic padding, head at the answer position)"
    )
    eval_what = (
        f"{len(workload.eval_set)} real testset prompts scored by every run; oodjax: one pool packed into rows, all "
        "runs at once; PyTorch: each run's tuned loop (length-sorted batches, two head columns)"
    )
    mfu = f"of peak = MFU against {peak / 1e12:.0f} TFLOP/s bf16" if peak else "no MFU (device peak unknown)"
    cases = []
    for phase, title, work, phase_flops, what, lengths in (
        ("train", "Training", mode.steps * runs * settings.TRAIN_BATCH, train_flops, train_what, train_lengths),
        ("eval", "Evaluation", runs * len(workload.eval_set), [eval_flops] * mode.repeats, eval_what, eval_lengths),
    ):
        results = {name: t[phase].summary(work, flops=phase_flops, peak_flops=peak) for name, t in timings.items()}
        cases.append(
            {
                "case": f"device-{phase}",
                "title": f"{title} of {runs} runs on {device['kind']}",
                "unit": "examples/s",
                "description": (
                    f"{runs} runs, SmolLM3-3B's shape ({shape}; random weights), {device_line}; {what}. Prompts: "
                    f"mean {lengths.mean():.0f} GPT-2 tokens, max {int(lengths.max())}. Model FLOPs count real "
                    f"tokens only; {mfu}. Compile time is oodjax's warm-up (train step and evaluation)."
                ),
                "contenders": results,
                "memory": memory,
                **(_ratios(results) if len(results) == 2 else {}),
                **({"agreement": measured["agreement"]} if phase == "eval" and "agreement" in measured else {}),
            }
        )
    return {
        "cases": cases,
        "phases_done": list(measured),
        **({"torch_threads": theirs["torch_threads"]} if theirs else {}),
    }


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    return {
        "ratios": harness.ratios(results, "oodjax"),
        "ratios_of_medians": harness.ratios(results, "oodjax", of="median_s"),
    }


def _layout(geometry: dict[str, int]) -> str:
    return f"{geometry['grad_accum']} micro-batch(es) of {geometry['rows']} packed rows of {geometry['seq_len']} tokens"


def _timing(fields: dict[str, Any]) -> harness.Timing:
    """A ``harness.Timing`` from its JSON fields."""
    return harness.Timing(**{key: tuple(v) if isinstance(v, list) else v for key, v in fields.items()})


def _agreement(
    mode: DeviceMode, engine: TrainingEngine, workload: Any, seeds: list[int], answers: dict[str, int], pool: EvalPool
) -> dict[str, float]:
    """The largest margin difference of the engine's attention, XLA's in bf16, and the fused path on the first
    run alone (as a one-run job or ``oodjax.evaluate`` of one adapter runs it), each against XLA's in float32:
    two bf16 paths can differ by the sum of their rounding."""
    place = lambda batch: sharding.shard_batch(batch, engine.mesh, batch_axis=1)  # noqa: E731

    def margins(dtype: str, attention: str, run_seeds: list[int], base: Any, lora: Any, run_pool: EvalPool) -> list:
        graphdef, _, _ = steps.abstract_attach_runs(
            lambda: models.abstract_model(mode.model, dtype=dtype, remat=mode.remat, attention=attention),
            run_seeds,
            engine.job.lora,
            steps.make_optimizer(settings.LEARNING_RATE, 1, 1, 0.0, None),
        )
        eval_step = steps.make_eval_step(graphdef, answers["yes_id"], answers["no_id"], mesh=engine.mesh)
        return [m[EVAL_SET] for m in evaluate(eval_step, base, lora, run_pool, place=place)]

    def largest_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))

    fused = [m[EVAL_SET] for m in engine.margins(pool)]
    xla = margins("bfloat16", "xla", seeds, engine.base_state, engine.runs.lora, pool)
    as_float32 = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )
    float32 = margins("float32", "xla", seeds, as_float32(engine.base_state), as_float32(engine.runs.lora), pool)
    one_pool = engine.eval_pool(workload.eval_set, batch_tokens=mode.eval_batch_rows * settings.MAX_LENGTH, runs=1)
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
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None  # CUDA calls return before their work is done
    base = torch_contenders.build_model(mode.model, seed=0, dtype=torch.bfloat16, device=device)
    rows = np.arange(len(workload.eval_set))
    per_run = []
    for run, seed in enumerate(seeds):
        model = torch_contenders.attach_lora(base, seed=seed)
        trainer = torch_contenders.Trainer(model, tuned=True, total_steps=len(batches), **answers)
        per_run.append(
            _timings(
                lambda step: trainer.step(workload.train_set, batches[step][run]),
                lambda: torch_contenders.margins_tuned(
                    model, workload.eval_set, rows, batch_size=mode.eval_batch_rows, **answers
                ),
                mode,
                sync=sync,
            )
        )
        base = model.unload()  # the base model without this run's adapter, for the next run
    timing = {
        phase: harness.Timing(
            tuple(np.sum([t[phase].seconds for t in per_run], axis=0).tolist()),
            sum(t[phase].first_call_s for t in per_run),
            0.0,
            0.0,
        )
        for phase in ("train", "eval")
    }
    return {
        "timing": {phase: dataclasses.asdict(t) for phase, t in timing.items()},
        "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "device": device,
        "torch_threads": torch.get_num_threads(),
    }


def _timings(
    train: Callable[[int], Any],
    score: Callable[[], Any],
    mode: DeviceMode,
    *,
    sync: Callable[[], None] = lambda: None,
    warm: Callable[[], None] = lambda: None,
) -> dict[str, harness.Timing]:
    """Both phases timed: a first call (``warm``, step 0 and one evaluation: what compiles), then per repetition
    ``mode.steps`` training steps (repetition r takes steps (r + 1) x steps on) and one evaluation, each ended
    by ``sync`` (oodjax's steps return their loss and its evaluation its margins to the host: a timed phase ends
    when its work has). JAX's compile seconds during the repetitions are the two phases' together."""

    def first() -> None:
        warm()
        train(0)
        score()
        sync()

    def steps(r: int) -> None:
        for s in range(mode.steps):
            train((r + 1) * mode.steps + s)
        sync()

    def evaluation() -> None:
        score()
        sync()

    _, first_s, compile_s = harness.timed(first)
    repetitions = [(harness.timed(lambda: steps(r)), harness.timed(evaluation)) for r in range(mode.repeats)]
    late_s = sum(t[2] for repetition in repetitions for t in repetition)
    return {
        phase: harness.Timing(tuple(repetition[i][1] for repetition in repetitions), first_s, compile_s, late_s)
        for i, phase in enumerate(("train", "eval"))
    }


if __name__ == "__main__":
    child_main(sys.argv[1:])
