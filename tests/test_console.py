"""The console: plain lines in a log file, compilations announced and timed, evaluation and compilation kept
out of the training rate, a closing summary, and no backend or `datasets` noise."""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import numpy as np

from oodjax.engine import console, loop
from tests.engine_configs import SHRUNK_DEMO_ARGS, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_run_logged_to_a_file_prints_plain_informative_lines(tmp_path):
    """stderr is a pipe, as in a SLURM log. JAX picks its backends itself (so it would try the TPU one) and
    datasets reads every split afresh (so it would draw its bars): neither may show."""
    out = tmp_path / "demo"
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets-cache")
    result = subprocess.run(
        [sys.executable, "-m", "oodjax.main", *SHRUNK_DEMO_ARGS, f"--config.output_dir={out}",
         f"--config.data.cache_dir={tmp_path / 'cache'}"],
        cwd=ROOT, env=env, capture_output=True, timeout=600,
    )  # fmt: skip
    log = result.stderr.decode()  # bytes: text mode would turn the "\r" of a redrawn bar into "\n"
    assert result.returncode == 0, log[-3000:]
    assert "\r" not in log  # no redrawn bars
    for what in ("evaluation step", "train step"):
        assert f"compiling the {what} (its first call) ..." in log
        assert re.search(rf"{what}: first call \d+\.\d s, of which compiling \d+\.\d s", log), what
    assert re.search(r"step 4/4: loss \[.*\], grad norm \[.*\], lr [\d.e-]+, [\d.]+ examples/s, training ETA", log)
    assert re.search(r"evaluated step 2 \(\d+ batches\) in \d+\.\d s", log)
    for seed in (0, 42):
        run = f"opt-tiny-random_mnli_seed{seed}_shots32"
        assert re.search(rf"{run} at step 4: in-domain mnli 0\.\d+, mean OOD 0\.\d+ \(hans, rte\)", log), run
    assert f"done: 2 runs; results in {out}" in log
    assert "tpu" not in log.lower()
    assert "Generating" not in log and "examples/s]" not in log  # datasets' bars


def test_training_rate_leaves_out_evaluation_and_compilation(tmp_path, gpt2_tokenizer_dir, hf_data_dir, monkeypatch):
    """Each evaluation is made to take a second more; examples/s (from which the ETA comes) must not see it."""
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.train.steps = 6
    config.checkpoint_every = 5  # evaluations at 2 and 4 are not also checkpoints
    original = loop._Loop._evaluate
    monkeypatch.setattr(loop._Loop, "_evaluate", lambda self, step: (original(self, step), time.sleep(1.0)))
    runs = loop.train(config)
    events = [json.loads(line) for line in (runs[0].directory / "events.jsonl").read_text().splitlines()]
    rates = {event["step"]: event["train/examples_per_s"] for event in events if "train/examples_per_s" in event}
    assert sorted(rates) == [2, 3, 4, 5, 6]  # step 1 compiles: no rate
    examples_per_step = len(runs) * config.train.batch_size
    assert min(rates.values()) > examples_per_step / 0.5  # a window with the sleep in it would be slower


def test_compile_clock_counts_compilations_inside_it_only():
    def fresh(x):  # a function never compiled before in this process
        return jax.numpy.sin(x) * 3.0 + 0.25

    with console.CompileClock() as clock:
        jax.jit(fresh)(np.ones(5, np.float32)).block_until_ready()
    assert clock.seconds > 0
    counted = clock.seconds
    jax.jit(lambda x: x - 7.0)(np.ones(3, np.float32)).block_until_ready()
    assert clock.seconds == counted
