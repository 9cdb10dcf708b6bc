"""Case 3, the grid: seeds x shot counts, each run trained N steps and evaluated at step 0 and N, end to end.

N keeps the study's steps per evaluation; the evaluations are far smaller
than the study's, so training, compiling and starting weigh more here than
in a job (docs/performance.md). Contenders, each timed from process start to
the last result written: oodjax with every run in one process, oodjax with
one process per run (sharing a fresh compilation cache, as docs/engine.md
advises for sweeps), and PyTorch's tuned loops one run after another
(benchmarks.torch_grid). The original study's padded approach is no grid
contender: its 9 runs alone would take most of the benchmark's time, and the
training and evaluation cases measure its cost per step.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time
from typing import Any

from benchmarks import grid_config, harness, machine, torch_grid
from benchmarks.settings import Mode

CONFIG_FILE = "benchmarks/grid_config.py"


def grid_runs(mode: Mode) -> list[tuple[int, int]]:
    """The grid's runs, (seed, shots), seeds outermost."""
    return [(seed, shots) for seed in mode.grid_seeds for shots in mode.grid_shots]


def _oodjax(spec: str, output: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "oodjax.main", f"--config={CONFIG_FILE}:{spec}", f"--config.output_dir={output}"]


def commands(mode: Mode, output: pathlib.Path) -> dict[str, list[list[str]]]:
    """The command lines of each contender (several for the one-process-per-run contender)."""
    per_run = output / "oodjax-process-per-run"
    pytorch = [sys.executable, "-m", "benchmarks.torch_grid", mode.name, "tuned"]
    return {
        "oodjax-one-process": [_oodjax(mode.name, output / "oodjax-one-process")],
        "oodjax-process-per-run": [
            _oodjax(f"{mode.name},{seed},{shots}", per_run / f"seed{seed}_shots{shots}")
            for seed, shots in grid_runs(mode)
        ],
        "pytorch-tuned-sequential": [[*pytorch, str(output / "pytorch-tuned-sequential")]],
    }


def runs_written(directory: pathlib.Path, runs: list[tuple[int, int]]) -> int:
    """How many of ``runs`` have a metrics.npz under ``directory``, in a directory named ..._seed<S>_shots<N>."""
    return sum(any(directory.glob(f"**/*_seed{seed}_shots{shots}/metrics.npz")) for seed, shots in runs)


def run(mode: Mode, workdir: pathlib.Path) -> dict[str, Any]:
    torch_grid.grid_data(grid_config.get_config(mode.name))  # fills the tokenisation cache
    runs = grid_runs(mode)
    measured: dict[str, list[tuple[float, float, int]]] = {}  # per repetition: seconds, other CPU s, runs written
    for repeat, name in harness.alternating(list(commands(mode, workdir)), mode.grid_repeats):
        output = workdir / f"repeat{repeat}"
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(output / name / "jax-compilation-cache"))
        busy, children = machine.busy_cpu_seconds(), machine.children_cpu_seconds()
        start = time.perf_counter()
        for command in commands(mode, output)[name]:
            harness.run_command(command, what=" ".join(command), env=env)
        seconds = time.perf_counter() - start
        used_elsewhere = machine.busy_cpu_seconds() - busy - (machine.children_cpu_seconds() - children)
        # the counters' ticks can differ by one
        measured.setdefault(name, []).append((seconds, max(used_elsewhere, 0.0), runs_written(output / name, runs)))
    results = {}
    for name, repetitions in measured.items():
        times, other_cpu, completed = (list(column) for column in zip(*repetitions))
        if any(n != len(runs) for n in completed):
            raise RuntimeError(f"{name} wrote results for {completed} runs per repetition, not {len(runs)}")
        results[name] = {
            **harness.time_fields(times),
            "work_per_repeat": len(runs),
            "rate_median": len(runs) / statistics.median(times),
            "other_cpu_s": other_cpu,
            "runs_completed": completed,
        }
    model = mode.grid_model
    return {
        "case": "grid",
        "title": f"{len(mode.grid_seeds)}x{len(mode.grid_shots)} run grid, end to end",
        "unit": "s",
        "description": (
            f"seeds {list(mode.grid_seeds)} x shots {list(mode.grid_shots)}, {mode.grid_steps} steps of batch 16 "
            f"each, evaluated at step 0 and {mode.grid_steps} on the eight testsets ({mode.grid_eval_cap} examples "
            f"each) and the training sets; model: SmolLM2 widths, {model['num_hidden_layers']} layers, hidden "
            f"{model['hidden_size']}, vocabulary {model['vocab_size']}; wall time from process start to the last "
            "result written. pytorch-tuned-sequential runs the tuned PyTorch loops (dynamic padding, head at the "
            "answer position) in one process with the model built once (the study started a job per run); each "
            "oodjax contender starts from an empty JAX compilation cache of its own, which later processes reuse."
        ),
        "contenders": results,
        **harness.ratio_fields(results, "oodjax-one-process"),
    }
