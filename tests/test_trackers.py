"""Trackers: the train step's gradient norm is each run's, before clipping; W&B (offline) and TensorBoard
receive, per run and at the same steps, what events.jsonl records, read back from the files they write."""

import json
import pathlib
import struct
from collections.abc import Iterator

import jax
import numpy as np
import optax
import pytest
from tensorboardX.proto import event_pb2
from test_steps import LORA, NO, OPT, YES, as_step, geometry, make_batches
from wandb.proto import wandb_internal_pb2

from oodjax.config_checks import check_config
from oodjax.engine import loop, steps
from oodjax.engine.events import TENSORBOARD_DIR
from oodjax.models import from_config
from tests.engine_configs import tiny_config


def test_step_metrics_are_the_loss_and_each_runs_gradient_norm_before_clipping():
    """With SGD at rate 1 the update is minus the gradient, so its norm is the gradient norm; clipping the
    update to 1e-4 must leave the reported norm as it was."""
    seeds = (0, 42)
    batch = as_step(make_batches(1, len(seeds))[0])
    reported, update_norms = {}, {}
    for clip in (0.0, 1e-4):
        optimizer = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(1.0)) if clip else optax.sgd(1.0)
        graphdef, base, runs = steps.attach_runs(from_config(OPT, seed=0), seeds, LORA, optimizer)
        before = jax.tree.map(np.asarray, runs.lora)  # runs is donated to the step
        step = steps.make_train_step(graphdef, optimizer, YES, NO, geometry(len(seeds)))
        runs, reported[clip] = step(base, runs, batch)
        update_norms[clip] = [
            float(optax.global_norm(jax.tree.map(lambda a, b: a[r] - b[r], before, runs.lora))) for r in range(2)
        ]
    np.testing.assert_allclose(reported[0.0]["grad_norm"], update_norms[0.0], rtol=1e-5)
    assert update_norms[0.0][0] != pytest.approx(update_norms[0.0][1])  # each run its own norm
    np.testing.assert_allclose(update_norms[1e-4], 1e-4, rtol=1e-3)
    np.testing.assert_allclose(reported[1e-4]["grad_norm"], reported[0.0]["grad_norm"], rtol=1e-6)


def wandb_records(path: pathlib.Path) -> Iterator[wandb_internal_pb2.Record]:
    """The records of an offline run's .wandb file: a 7-byte ":W&B" header, then LevelDB's log format
    (32 KiB blocks of chunks with a 7-byte header: crc32, length, type FULL=1/FIRST/MIDDLE/LAST=4), each
    record a protobuf. wandb (0.31) has no Python reader of its own any more."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, chunks = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunks += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def tensorboard_scalars(directory: pathlib.Path) -> dict[int, dict[str, float]]:
    """step -> {tag: value} of the TFRecord event files in ``directory`` (8-byte length, 4-byte crc, an Event
    protobuf, 4-byte crc), parsed with tensorboardX's own Event message."""
    return tensorboard_scalars_for(sorted(directory.glob("events.out.tfevents.*")))


def tensorboard_scalars_for(paths: list[pathlib.Path]) -> dict[int, dict[str, float]]:
    scalars: dict[int, dict[str, float]] = {}
    for path in paths:
        data, position = path.read_bytes(), 0
        while position < len(data):
            (length,) = struct.unpack("<Q", data[position : position + 8])
            event = event_pb2.Event.FromString(data[position + 12 : position + 12 + length])
            position += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(event.step, {})[value.tag] = value.simple_value
    return scalars


def assert_same_events(got: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> None:
    """The same steps and metrics, values equal to float32 rounding (TensorBoard stores float32)."""

    def flat(events: dict[int, dict[str, float]]) -> dict[tuple[int, str], float]:
        return {(step, key): value for step, metrics in events.items() for key, value in metrics.items()}

    assert flat(got) == pytest.approx(flat(expected), rel=1e-6, abs=1e-12)


def test_wandb_and_tensorboard_get_every_event_of_every_run(tmp_path, gpt2_tokenizer_dir, hf_data_dir, monkeypatch):
    for variable in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.wandb.enabled = True
    config.wandb.mode = "offline"
    config.wandb.entity = "a-team"
    config.wandb.tags = ("laptop", "tiny")
    config.tensorboard.enabled = True
    runs = loop.train(check_config(config))
    # lr 1e-3, one warm-up step, then linear decay to 0 at step 4; step s's update uses the (s-1)-th rate
    expected_lr = {1: 0.0, 2: 1e-3, 3: 1e-3 * 2 / 3, 4: 1e-3 / 3}
    grad_norms = []
    for run in runs:
        events: dict[int, dict[str, float]] = {}
        for line in (run.directory / "events.jsonl").read_text().splitlines():
            record = json.loads(line)
            step = record.pop("step")
            record.pop("time")
            events.setdefault(step, {}).update(record)
        assert sorted(events) == [0, 1, 2, 3, 4]
        for step, lr in expected_lr.items():
            assert events[step]["train/learning_rate"] == pytest.approx(lr, rel=1e-6, abs=1e-12)
            assert events[step]["train/grad_norm"] > 0
        # examples/s counts training alone: none for step 1, whose time is its compilation
        assert "train/examples_per_s" not in events[1]
        assert all(events[step]["train/examples_per_s"] > 0 for step in (2, 3, 4))
        assert {"accuracy/mnli", "accuracy/hans", "accuracy/train"} <= set(events[2])
        grad_norms.append([events[step]["train/grad_norm"] for step in expected_lr])

        assert_same_events(tensorboard_scalars(run.directory / TENSORBOARD_DIR), events)  # float32 there

        (wandb_file,) = (run.directory / "wandb").glob("offline-run-*/run-*.wandb")
        records = list(wandb_records(wandb_file))
        (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert run_record.display_name == run.name and run_record.project == "oodjax"
        assert run_record.entity == "a-team" and list(run_record.tags) == ["laptop", "tiny"]
        assert run_record.run_group == "opt-tiny_mnli"  # model and training set
        wandb_config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
        assert wandb_config["run"] == {
            "model": "opt-tiny",
            "seed": run.seed,
            "shots": 8,
            "steps": 4,
            "warmup_steps": 1,  # the plan its length resolves to
            "evaluated_steps": [0, 2, 4],
            "train_set": "mnli",
        }
        assert wandb_config["train"]["steps"] == 4
        history = {}
        for record in records:
            if record.WhichOneof("record_type") == "history":
                items = {
                    "/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item
                }
                history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        assert_same_events(history, events)
    assert grad_norms[0] != grad_norms[1]  # each run its own


def test_a_resumed_run_gives_the_trackers_each_step_once(tmp_path, gpt2_tokenizer_dir, hf_data_dir, monkeypatch):
    """A job that crashes after step 3 was logged (its checkpoint at 2) redoes step 3 when rerun: events.jsonl
    holds it once, and W&B (one run across both starts) and TensorBoard receive it once, with the same values."""
    for variable in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.wandb.enabled = True
    config.wandb.mode = "offline"
    config.tensorboard.enabled = True
    make_train_step = loop.steps.make_train_step

    def crashing_make_train_step(*args, **kwargs):
        train_step = make_train_step(*args, **kwargs)

        def crash_at_4(base_state, runs, batch):
            if int(runs.step) == 3:
                raise RuntimeError("crash in step 4")
            return train_step(base_state, runs, batch)

        return crash_at_4

    monkeypatch.setattr(loop.steps, "make_train_step", crashing_make_train_step)
    with pytest.raises(RuntimeError, match="crash in step 4"):
        loop.train(check_config(config))
    monkeypatch.undo()
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    runs = loop.train(check_config(config))
    for run in runs:
        events: dict[int, dict[str, float]] = {}
        for line in (run.directory / "events.jsonl").read_text().splitlines():
            record = json.loads(line)
            step = record.pop("step")
            record.pop("time")
            assert not set(record) & set(events.get(step, {})), (step, record)  # each metric once
            events.setdefault(step, {}).update(record)
        assert sorted(events) == [0, 1, 2, 3, 4]

        scalars: list[tuple[int, str]] = []
        for path in (run.directory / TENSORBOARD_DIR).glob("events.out.tfevents.*"):
            scalars += [(step, tag) for step, tags in tensorboard_scalars_for([path]).items() for tag in tags]
        assert len(scalars) == len(set(scalars))  # no step's metric twice
        # the same values, but the clock's: the redone step 3 is the first timed after compiling, untimed
        assert_same_events(without_clock(tensorboard_scalars(run.directory / TENSORBOARD_DIR)), without_clock(events))

        wandb_files = sorted((run.directory / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(wandb_files) == 2  # one per start
        run_ids, history, logged = set(), {}, []
        for wandb_file in wandb_files:
            for record in wandb_records(wandb_file):
                if record.WhichOneof("record_type") == "run":
                    run_ids.add(record.run.run_id)
                if record.WhichOneof("record_type") == "history":
                    items = {
                        "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                        for item in record.history.item
                    }
                    items = {k: v for k, v in items.items() if not k.startswith("_")}
                    logged += [(record.history.step.num, key) for key in items]
                    history.setdefault(record.history.step.num, {}).update(items)
        assert len(run_ids) == 1  # the resumed start went on in the same W&B run
        assert sorted(logged) == sorted(set(logged))  # no step's metric twice
        assert_same_events(without_clock(history), without_clock(events))


def without_clock(events: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {step: {k: v for k, v in metrics.items() if k != "train/examples_per_s"} for step, metrics in events.items()}
