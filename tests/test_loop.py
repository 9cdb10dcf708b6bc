"""The run loop: a non-finite loss stops it naming the step; nothing compiles after the first evaluation."""

import json

import jax
import numpy as np
import pytest

from analysis import schema
from oodjax.engine import loop
from oodjax.engine.checkpoints import Checkpointer
from tests.engine_configs import tiny_config


@pytest.fixture
def config(tmp_path, gpt2_tokenizer_dir, hf_data_dir):
    return tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")


@pytest.fixture
def compilations():
    """Every executable built while the test runs: XLA compilations and persistent-cache loads."""
    events = []

    def on_duration(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    def on_event(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    yield events
    jax.monitoring.unregister_event_duration_listener(on_duration)
    jax.monitoring.unregister_event_listener(on_event)


def test_nothing_compiles_after_the_first_evaluation_step_and_checkpoint(config, compilations, monkeypatch):
    config.train.steps = 6
    config.checkpoint_every = 2
    marks = []  # (what, step, compilations before, compilations after)
    for method in ("_evaluate", "_checkpoint"):
        original = getattr(loop._Loop, method)

        def counting(self, step, original=original, method=method):
            before = len(compilations)
            original(self, step)
            marks.append((method, step, before, len(compilations)))

        monkeypatch.setattr(loop._Loop, method, counting)
    loop.train(config)
    evaluations = [(step, before, after) for what, step, before, after in marks if what == "_evaluate"]
    assert [step for step, _, _ in evaluations] == [0, 2, 4, 6]
    assert evaluations[0][2] > evaluations[0][1]  # the first evaluation compiles (the listener works)
    assert evaluations[1][1] > evaluations[0][2]  # so does the first train step
    assert all(before == after for _, before, after in evaluations[1:])  # later evaluations never
    # The first checkpoint may compile (orbax slices replicated arrays once per
    # shape and device); after it, neither steps nor evaluations nor later
    # checkpoints compile anything.
    first_checkpoint = next(mark for mark in marks if mark[0] == "_checkpoint")
    assert first_checkpoint[1] == 2
    assert len(compilations) == first_checkpoint[3]


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_state(config, monkeypatch):
    """Also: a rerun of the stopped runs with another config is refused."""
    config.train.steps = 6
    config.log_every = 5  # losses are checked in batches; the failing step must still be named
    make_train_step = loop.steps.make_train_step

    def poisoned_make_train_step(*args, **kwargs):
        train_step = make_train_step(*args, **kwargs)

        def step_with_nan_at_3(base_state, runs, batch):
            runs, metrics = train_step(base_state, runs, batch)
            loss = np.array(metrics["loss"])
            if int(runs.step) == 3:
                loss[1] = np.nan
            return runs, dict(metrics, loss=loss)

        return step_with_nan_at_3

    monkeypatch.setattr(loop.steps, "make_train_step", poisoned_make_train_step)
    message = r"non-finite training loss at step 3 \(opt-tiny_mnli_seed1_shots8=nan\)"
    with pytest.raises(loop.NonFiniteLossError, match=message):
        loop.train(config)
    out = config.output_dir
    assert Checkpointer(out).latest_step() == 2  # no checkpoint at step 4
    for run in loop.plan_runs(config):
        with np.load(run.directory / schema.METRICS_FILENAME) as npz:
            assert npz[schema.STEP].tolist() == [0, 2]
        events = [json.loads(line) for line in (run.directory / "events.jsonl").read_text().splitlines()]
        assert max(e["step"] for e in events) == 2
    # Resuming those runs under another config would mix two experiments: refused, naming the section.
    config.train.learning_rate = 5e-4
    with pytest.raises(ValueError, match=r"holds runs started with another config \(sections \['train'\] differ\)"):
        loop.train(config)
