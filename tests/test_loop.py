"""The run loop: a non-finite loss stops it naming the step; nothing compiles after the first evaluation; a stop
signal and a damaged checkpoint change no result."""

import json
import logging
import os
import signal
import stat

import jax
import numpy as np
import pytest

from analysis import schema
from oodjax.config_checks import check_config
from oodjax.config_read import read
from oodjax.engine import checkpoints, loop, preemption, resumption
from tests.engine_configs import checkpoint_config, tiny_config


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
    for hook, method in ((loop.Evaluation, "evaluate"), (loop.Checkpoints, "save")):
        original = getattr(hook, method)

        def counting(self, step, *args, original=original, method=method, **kwargs):
            before = len(compilations)
            original(self, step, *args, **kwargs)
            marks.append((method, step, before, len(compilations)))

        monkeypatch.setattr(hook, method, counting)
    loop.train(check_config(config))
    evaluations = [(step, before, after) for what, step, before, after in marks if what == "evaluate"]
    assert [step for step, _, _ in evaluations] == [0, 2, 4, 6]
    assert evaluations[0][2] > evaluations[0][1]  # the first evaluation compiles (the listener works)
    assert evaluations[1][1] > evaluations[0][2]  # so does the first train step
    assert all(before == after for _, before, after in evaluations[1:])  # later evaluations never
    # The first checkpoint may compile (orbax slices replicated arrays once per
    # shape and device); after it, neither steps nor evaluations nor later
    # checkpoints compile anything.
    first_checkpoint = next(mark for mark in marks if mark[0] == "save")
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
        loop.train(check_config(config))
    for run in read(config).runs.runs():
        assert checkpoints.checkpoint_steps(run.directory) == [2]  # no checkpoint at step 4
        with np.load(run.directory / schema.METRICS_FILENAME) as npz:
            assert npz[schema.STEP].tolist() == [0, 2]
        events = [json.loads(line) for line in (run.directory / "events.jsonl").read_text().splitlines()]
        assert max(e["step"] for e in events) == 2
    # Resuming those runs under another config would mix two experiments: refused, naming the field.
    config.train.learning_rate = 5e-4
    with pytest.raises(ValueError, match=r"started with another config .*train.learning_rate 0.001 -> 0.0005"):
        loop.train(check_config(config))


@pytest.fixture
def umask_022():
    """The usual umask, whatever the test runner's: files 0644, folders 0755."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _results(run_dir):
    with np.load(run_dir / schema.METRICS_FILENAME, allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def test_stop_signals_and_damaged_checkpoints_change_no_result(
    tmp_path, gpt2_tokenizer_dir, hf_data_dir, monkeypatch, caplog, umask_022
):
    """SIGUSR1 during step 4 (an evaluation and checkpoint step) stops the job after it, every run checkpointed
    and that evaluation left to do. Then both runs' step-4 checkpoints are damaged for real (run 0's JSON
    record, run 1's arrays cut in half): the rerun names them, falls back to step 2, and is stopped at step 4
    again; the last rerun resumes at step 4 and evaluates it first. Both runs end with exactly the results of
    an uninterrupted job, and everything written is readable by the group."""
    configs = {
        name: tiny_config(tmp_path / name, gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
        for name in ("uninterrupted", "stopped")
    }
    for config in configs.values():
        config.train.steps = 6
        config.runs.shots = (16,)  # two batches an epoch: a resumed data order shows
    loop.train(check_config(configs["uninterrupted"]))
    runs = read(configs["stopped"]).runs.runs()
    step_4 = [checkpoints.checkpoint_dir(run.directory) / "4" for run in runs]

    make_train_step = loop.steps.make_train_step

    def signalling_make_train_step(*args, **kwargs):
        train_step = make_train_step(*args, **kwargs)

        def step_then_signal_at_4(base_state, runs, batch):
            runs, metrics = train_step(base_state, runs, batch)
            if int(runs.step) == 4:
                os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, to this process
            return runs, metrics

        return step_then_signal_at_4

    monkeypatch.setattr(loop.steps, "make_train_step", signalling_make_train_step)
    handler_before = signal.getsignal(signal.SIGUSR1)
    for attempt in ("first", "after the fallback"):
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(preemption.Preempted) as stopped:
            loop.train(check_config(configs["stopped"]))
        assert stopped.value.step == 4 and signal.getsignal(signal.SIGUSR1) is handler_before, attempt
        assert "stopping after step 4 on SIGUSR1" in caplog.text, attempt
        assert "its evaluation left for the resumed run" in caplog.text, attempt
        for run in runs:
            assert checkpoints.checkpoint_steps(run.directory) == [4, 2], attempt
            assert _results(run.directory)[schema.STEP].tolist() == [0, 2], attempt
        if attempt == "first":
            _cut_in_half([step_4[0] / "loop" / "metadata"])
            _cut_in_half(path for path in (step_4[1] / "runs").rglob("*") if path.is_file())
        else:
            for run, damaged in zip(runs, step_4):
                assert f"checkpoint {damaged} fails to restore" in caplog.text
                assert f"{run.directory}: resuming from the checkpoint at step 2" in caplog.text
                assert [path.name.startswith("4.damaged-") for path in damaged.parent.iterdir()].count(True) == 1
            assert "JSONDecodeError" in caplog.text
    monkeypatch.undo()

    caplog.clear()
    with caplog.at_level(logging.INFO):
        loop.train(check_config(configs["stopped"]))
    assert "training 2 runs from step 4" in caplog.text and "fails to restore" not in caplog.text
    for reference, run in zip(read(configs["uninterrupted"]).runs.runs(), runs):
        expected, got = _results(reference.directory), _results(run.directory)
        assert expected.keys() == got.keys() and got[schema.STEP].tolist() == [0, 2, 4, 6]
        for key in expected.keys() - {schema.CONFIG}:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{run.name}: {key}")
        # events.jsonl: every step once, as the uninterrupted run logged it (but for the clocks)
        assert _events(run.directory) == _events(reference.directory), run.name
    for path in (tmp_path / "stopped").rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o755 if path.is_dir() else 0o644), path


def _events(run_dir):
    """events.jsonl's records in order, without what the clocks measure."""
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    clocks = ("time", "train/examples_per_s")
    return [{key: value for key, value in json.loads(line).items() if key not in clocks} for line in lines]


def _cut_in_half(paths):
    for path in paths:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _changes(stored_record, config):
    """What resuming a run stored with ``stored_record`` under ``config`` would name as changed."""
    job = read(config)
    start = resumption.RunStart(job.runs.runs()[0], job.groups[0], finished=False, stored_config=stored_record)
    return resumption.changes(start, job.record, job.settings)


def test_a_field_a_later_version_added_is_no_change_at_its_default():
    """Runs stored before a field existed resume when it is at its default; a non-default value is a change."""
    config = checkpoint_config()
    stored = json.loads(json.dumps(read(config).record))
    del stored["data"]["answers"], stored["model"]["attention"]  # as a version without them stored it
    assert _changes(stored, config) == []
    config.data.answers = (" True", " False")
    assert _changes(stored, config) == ["data.answers [' Yes', ' No'] -> [' True', ' False']"]


def test_runs_stored_with_fixed_warmup_and_eval_steps_resume_under_the_ratio_and_points_they_come_to():
    """Before warm-up and evaluations followed each run's length, the defaults were 50 warm-up steps and an
    evaluation every 25 steps: at 500 steps that is warmup_ratio 0.1 and 20 eval.points, the same run."""
    config = checkpoint_config()
    config.train.steps, config.train.warmup_steps, config.train.warmup_ratio = 500, 0, 0.1
    config.eval.every, config.eval.points = 0, 20
    stored = json.loads(json.dumps(read(config).record))
    stored["train"].update(warmup_steps=50, warmup_ratio=0.0)  # as the earlier defaults stored it
    stored["eval"].update(every=25, points=0)
    assert _changes(stored, config) == []
    config.train.warmup_ratio, config.eval.points = 0.2, 10  # a real change, named as it resolves
    assert _changes(stored, config) == [
        "run.warmup_steps 50 -> 100",
        f"run.evaluated_steps {list(range(0, 501, 25))} -> {list(range(0, 501, 50))}",
    ]


def test_a_stored_plan_is_compared_as_stored():
    """A run's section holds the plan its length resolved to; a job whose plan differs is named by it."""
    config = checkpoint_config()
    job = read(config)
    stored = {**json.loads(json.dumps(job.record)), schema.RUN_SECTION: job.groups[0].plan()}
    assert _changes(stored, config) == []
    stored[schema.RUN_SECTION][schema.RUN_WARMUP_STEPS] += 1
    assert _changes(stored, config) == [
        f"run.warmup_steps {job.groups[0].optimizer.warmup_steps + 1} -> {job.groups[0].optimizer.warmup_steps}"
    ]


def test_runs_of_32_64_and_128_shots_trained_by_epochs_in_one_job_equal_each_trained_alone(
    tmp_path, gpt2_tokenizer_dir, hf_data_dir, caplog
):
    """train.epochs=1 at batch 16: 2, 4 and 8 steps, each run's warm-up a quarter of them and its 2 evaluations
    after step 0 spread over its own length. The job trains the three lengths one after another on one model;
    each run's metrics.npz equals that of a job of its shot count alone, and records its own length. Rerun, the
    job finds every run finished at its own last step."""

    def config(name, shots):
        config = tiny_config(tmp_path / name, gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
        config.runs.seeds, config.runs.shots = (0,), shots
        config.train.batch_size, config.train.epochs, config.train.warmup_ratio = 16, 1.0, 0.25
        config.eval.points, config.checkpoint_every = 2, 100
        config.train.warmup_steps = config.eval.every = 0  # tiny_config's fixed ones would win over both
        return config

    together = config("together", (32, 64, 128))
    loop.train(check_config(together))
    for run, steps, evaluated in zip(read(together).runs.runs(), (2, 4, 8), ([0, 1, 2], [0, 2, 4], [0, 4, 8])):
        alone = config(f"alone{run.shots}", (run.shots,))
        loop.train(check_config(alone))
        (reference,) = read(alone).runs.runs()
        expected, got = _results(reference.directory), _results(run.directory)
        assert got[schema.STEP].tolist() == evaluated, run.name
        assert expected.keys() == got.keys()
        for key in expected.keys() - {schema.CONFIG}:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{run.name}: {key}")
        assert json.loads(got[schema.CONFIG].item())[schema.RUN_SECTION][schema.RUN_STEPS] == steps
        summary = json.loads((run.directory / schema.RESULTS_FILENAME).read_text())
        assert summary[schema.RESULTS_RUN][schema.RUN_STEPS] == steps
        assert checkpoints.checkpoint_steps(run.directory) == [steps]
        # its schedule spans its own steps: warm-up over ceil(steps / 4), then linear decay to 0 at its last step
        warmup = -(-steps // 4)
        rates = [1e-3 * i / warmup if i < warmup else 1e-3 * (steps - i) / (steps - warmup) for i in range(steps)]
        logged = [event["train/learning_rate"] for event in _events(run.directory) if "train/learning_rate" in event]
        np.testing.assert_allclose(logged, rates, rtol=1e-6, err_msg=run.name)
    written = {path: path.read_bytes() for path in (tmp_path / "together").rglob(schema.METRICS_FILENAME)}
    with caplog.at_level(logging.INFO):
        loop.train(check_config(together))
    assert "finished (step 2), skipped" in caplog.text and "finished (step 8), skipped" in caplog.text
    assert {path: path.read_bytes() for path in written} == written
