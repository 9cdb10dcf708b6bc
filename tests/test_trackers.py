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

from oodjax.engine import loop, steps
from oodjax.engine.events import TENSORBOARD_DIR
from oodjax.job import resolve
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
    scalars: dict[int, dict[str, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
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
    runs = loop.train(resolve(config))
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
