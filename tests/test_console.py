"""The console: short plain lines in a log file, the config printed once, compilations announced and timed,
evaluation and compilation kept out of the training rate, values labelled by run, a closing summary, and no
backend, `datasets` or W&B noise."""

import json
import logging as python_logging
import os
import pathlib
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import jax
import numpy as np

from oodjax.config_checks import check_config
from oodjax.engine import console, loop
from tests.engine_configs import SHRUNK_DEMO_ARGS, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_run_logged_to_a_file_prints_plain_informative_lines(tmp_path):
    """stderr is a pipe, as in a SLURM log. JAX picks its backends itself (so it would try the TPU one) and
    datasets reads every split afresh (so it would draw its bars): neither may show. W&B records offline, which
    needs no login (there is none here), and prints neither banner nor footer."""
    out = tmp_path / "demo"
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "WANDB_API_KEY")}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets-cache")
    env["NETRC"] = str(tmp_path / "no-netrc")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[variable] = str(tmp_path / "wandb-home")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "oodjax.main",
            *SHRUNK_DEMO_ARGS,
            f"--config.output_dir={out}",
            f"--config.data.cache_dir={tmp_path / 'cache'}",
            "--config.wandb.enabled",
            "--config.wandb.mode=offline",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=600,
    )
    log = result.stderr.decode()  # bytes: text mode would turn the "\r" of a redrawn bar into "\n"
    assert result.returncode == 0, log[-3000:]
    assert "\r" not in log  # no redrawn bars
    for line in log.splitlines():  # time, level, message (or a message's further lines, indented)
        assert re.match(r"\d\d:\d\d:\d\d (INFO|WARNING|ERROR) \S", line) or line.startswith("  "), line
    assert log.count("config (command-line overrides applied):\n") == 1
    assert (
        "\n  train: steps=4  epochs=0.0  batch_size=8  grad_accum=1  pack=True  learning_rate=0.001  warmup_steps=1"
        in log
    )
    assert f"2 runs in {out}: seed0_shots32 starts at step 0, seed42_shots32 starts at step 0" in log
    for what in ("evaluation step", "train step"):
        assert f"compiling the {what} (its first call) ..." in log
        assert re.search(rf"{what}: first call \d+\.\d s, of which compiling \d+\.\d s", log), what
    assert re.search(
        r"INFO step 4/4: lr [\d.e-]+, [\d.]+ examples/s, training ETA [\d:]+; loss \(grad norm\): "
        r"seed0_shots32 \d+\.\d{4} \([\d.e-]+\), seed42_shots32 \d+\.\d{4} \([\d.e-]+\)\n",
        log,
    )
    assert re.search(r"evaluated step 2 \(\d+ batches\) in \d+\.\d s", log)
    assert re.search(
        r"final accuracy at step 4, in-domain mnli / mean OOD \(hans, rte\): "
        r"seed0_shots32 0\.\d{3} / 0\.\d{3}, seed42_shots32 0\.\d{3} / 0\.\d{3}\n",
        log,
    )
    assert f"done: 2 runs; results in {out}" in log
    assert log.count("W&B: offline, in each <run_dir>/wandb/") == 1
    assert not re.search("^wandb: ", log, re.MULTILINE)  # W&B's own lines: its banner and footer per run
    assert len(list(out.glob("*/wandb/offline-run-*"))) == 2
    assert not re.search(r"\btpu\b", log.lower())  # as a word: "output_dir" holds it
    assert "Generating" not in log and "examples/s]" not in log  # datasets' bars


def test_values_by_run_are_labelled_inline_for_a_few_runs_and_tabled_for_more():
    runs = [SimpleNamespace(seed=seed, shots=shots) for seed in (0, 42) for shots in (32, 128)]
    assert console.by_run("loss", runs, ["a", "b", "c", "d"]) == (
        "loss: seed0_shots32 a, seed0_shots128 b, seed42_shots32 c, seed42_shots128 d"
    )
    runs = [SimpleNamespace(seed=seed, shots=shots) for seed in (0, 42, 7) for shots in (32, 64)][:-1]  # no 7, 64
    values = ["0.6931 (1.23)", "0.5 (2.5)", "0.7 (0.1)", "0.25 (10.5)", "0.125 (3)"]
    assert console.by_run("loss (grad norm)", runs, values) == (
        "loss (grad norm):\n"
        "          shots32        shots64\n"
        "  seed0   0.6931 (1.23)  0.5 (2.5)\n"
        "  seed42  0.7 (0.1)      0.25 (10.5)\n"
        "  seed7   0.125 (3)"
    )


def test_log_lines_are_time_level_message_and_a_librarys_names_it():
    formatter = console._ShortLines()
    for name, expected in (("absl", "WARNING disk nearly full"), ("orbax", "WARNING orbax: disk nearly full")):
        record = python_logging.LogRecord(name, python_logging.WARNING, "x.py", 1, "disk %s full", ("nearly",), None)
        assert formatter.format(record) == f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {expected}"


def test_training_rate_leaves_out_evaluation_and_compilation(tmp_path, gpt2_tokenizer_dir, hf_data_dir, monkeypatch):
    """Each evaluation is made to take 4 s more; examples/s (from which the ETA comes) must not see it. A tiny
    step takes well under the 2.5 s the bound allows, even on a loaded machine."""
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.train.steps = 6
    config.checkpoint_every = 5  # evaluations at 2 and 4 are not also checkpoints
    original = loop.Evaluation.evaluate
    monkeypatch.setattr(loop.Evaluation, "evaluate", lambda *args: (original(*args), time.sleep(4.0)))
    runs = loop.train(check_config(config))
    events = [json.loads(line) for line in (runs[0].directory / "events.jsonl").read_text().splitlines()]
    rates = {event["step"]: event["train/examples_per_s"] for event in events if "train/examples_per_s" in event}
    assert sorted(rates) == [2, 3, 4, 5, 6]  # step 1 compiles: no rate
    examples_per_step = len(runs) * config.train.batch_size
    assert min(rates.values()) > examples_per_step / 2.5  # a window with the sleep in it would be slower


def test_compile_clock_counts_compilations_inside_it_only():
    def fresh(x):  # a function never compiled before in this process
        return jax.numpy.sin(x) * 3.0 + 0.25

    with console.CompileClock() as clock:
        jax.jit(fresh)(np.ones(5, np.float32)).block_until_ready()
    assert clock.seconds > 0
    counted = clock.seconds
    jax.jit(lambda x: x - 7.0)(np.ones(3, np.float32)).block_until_ready()
    assert clock.seconds == counted
