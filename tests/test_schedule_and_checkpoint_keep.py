"""`train.schedule` (the learning rate after warm-up) and `checkpoint_keep` (checkpoints kept per run): their
defaults and --help text, the config checks, what a resumption may change, and that training follows them."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from oodjax import config_cli, config_fields
from oodjax.config_checks import check_config
from oodjax.config_read import read
from oodjax.engine import checkpoints, loop, resumption
from oodjax.engine.optimizer import SCHEDULES, OptimizerSettings
from oodjax.usage_errors import ConfigError
from tests.engine_configs import checkpoint_config, tiny_config


def test_defaults_are_the_previous_behaviour_and_are_described_in_help():
    config = base.get_config()
    assert config.train.schedule == "linear" and config.checkpoint_keep == 2
    descriptions = config_fields.field_descriptions()
    assert "cosine" in descriptions["train.schedule"] and "constant" in descriptions["train.schedule"]
    assert "kept per run" in descriptions["checkpoint_keep"]
    help_text = config_cli.config_fields_help()
    assert "train.schedule = 'linear'" in help_text and "checkpoint_keep = 2" in help_text


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_optimizer_follows_train_schedule(schedule):
    """With a constant gradient Adam's update is the learning rate itself: read the schedule off the updates."""
    config = checkpoint_config()
    config.train.steps, config.train.warmup_steps, config.train.learning_rate = 10, 2, 1e-2
    config.train.schedule = schedule
    optimizer = read(config).groups[0].optimizer.transformation
    params = {"w": jnp.zeros(())}
    state = optimizer.init(params)
    rates = []
    for _ in range(10):
        updates, state = optimizer.update({"w": jnp.ones(())}, state, params)
        rates.append(-float(updates["w"]))
    expected = [
        float(OptimizerSettings(1e-2, 2, schedule=schedule).build(10).learning_rate_schedule(i)) for i in range(10)
    ]
    np.testing.assert_allclose(rates, expected, rtol=1e-4, atol=1e-9)
    after_warmup = rates[2:]
    if schedule == "constant":
        np.testing.assert_allclose(after_warmup, 1e-2, rtol=1e-4)
    else:
        assert after_warmup == sorted(after_warmup, reverse=True) and after_warmup[-1] < 0.5e-2


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("train.schedule", "step", "train.schedule must be one of linear, cosine, constant, got 'step'"),
        ("checkpoint_keep", 0, "checkpoint_keep must be >= 1"),
    ],
)
def test_the_config_checks_refuse_an_unknown_schedule_and_keeping_no_checkpoint(field, value, message):
    config = checkpoint_config()
    section, _, key = field.rpartition(".")
    (config[section] if section else config)[key] = value
    with pytest.raises(ConfigError, match=message):
        read(config)
    read(checkpoint_config())  # the defaults pass


def test_a_resumed_run_may_keep_more_checkpoints_but_not_change_its_schedule(tmp_path):
    def one_run(**changes):
        config = checkpoint_config()
        config.model.name, config.output_dir, config.runs.seeds, config.runs.shots = "m", str(tmp_path), (0,), (8,)
        for field, value in changes.items():
            section, _, key = field.rpartition("__")
            (config[section] if section else config)[key] = value
        return config

    stored = read(one_run())
    (run,) = stored.runs.runs()
    stored_record = {**stored.record, "run": stored.groups[0].plan()}
    start = resumption.RunStart(run, stored.groups[0], finished=False, stored_config=stored_record)
    kept, rescheduled = read(one_run(checkpoint_keep=5)), read(one_run(train__schedule="cosine"))
    resumption.refuse_changed_config(kept.record, kept.settings, tmp_path, [start])  # no error
    with pytest.raises(ValueError, match="train.schedule 'linear' -> 'cosine'"):
        resumption.refuse_changed_config(rescheduled.record, rescheduled.settings, tmp_path, [start])

    # A run stored before the field existed resumes at its default, and only there.
    older = {**start.stored_config, "train": {k: v for k, v in start.stored_config["train"].items() if k != "schedule"}}
    older_start = resumption.RunStart(run, stored.groups[0], finished=False, stored_config=older)
    resumption.refuse_changed_config(kept.record, kept.settings, tmp_path, [older_start])
    with pytest.raises(ValueError, match="train.schedule 'linear' -> 'cosine'"):
        resumption.refuse_changed_config(rescheduled.record, rescheduled.settings, tmp_path, [older_start])


def test_a_checkpointer_keeps_the_newest_max_to_keep(tmp_path):
    checkpointer = checkpoints.RunCheckpointer(tmp_path / "run", name="run", max_to_keep=3)
    for step in range(1, 6):
        checkpointer.save(step, {"a": jnp.full(8, float(step))}, {"step": step})
    checkpointer.close()
    assert checkpoints.checkpoint_steps(tmp_path / "run") == [5, 4, 3]
    with pytest.raises(ValueError, match="at least 1"):
        checkpoints.RunCheckpointer(tmp_path / "other", name="other", max_to_keep=0)


def test_training_keeps_checkpoint_keep_checkpoints_and_logs_its_schedule(tmp_path, gpt2_tokenizer_dir, hf_data_dir):
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.runs.seeds = (0,)
    config.checkpoint_every, config.checkpoint_keep = 1, 3
    config.train.schedule = "constant"
    loop.train(check_config(config))
    (run,) = read(config).runs.runs()
    assert checkpoints.checkpoint_steps(run.directory) == [4, 3, 2]
    events = [json.loads(line) for line in (run.directory / "events.jsonl").read_text().splitlines()]
    rates = {event["step"]: event["train/learning_rate"] for event in events if "train/learning_rate" in event}
    assert rates[1] == 0.0 and all(rates[step] == pytest.approx(1e-3) for step in (2, 3, 4))  # warm-up of 1 step
