"""metrics.npz: exactly the schema of analysis/schema.py, rewritten atomically, with the umask's mode, read back
to tell finished runs; results.json beside it; the event log."""

import json
import os
import platform
import stat

import flax
import jax
import numpy as np
import pytest

from analysis import schema
from oodjax.engine import results
from oodjax.engine.events import EventLog

LABELS = {"mnli": np.array([0, 1, 1, 0]), "hans": np.array([1, 0, 1]), "train": np.array([0, 1])}
DATASET_INDEX = {"mnli": np.array([3, 10, 11, 40]), "hans": np.array([0, 7, 2]), "train": np.array([95, 12])}
CONFIG = {"run": {"model": "opt-tiny", "seed": 0, "shots": 2}, "train": {"steps": 10}}


def _run_results(run_dir):
    return results.RunResults(run_dir, labels=LABELS, dataset_index=DATASET_INDEX, in_domain="mnli", config=CONFIG)


def _two_evaluations(run_dir):
    run = _run_results(run_dir)
    run.add(
        0,
        {"mnli": [1.0, 1.0, 1.0, 1.0], "hans": [-2.0, -1.0, 0.0], "train": [0.5, -0.5]},
        float("nan"),
        train_clock=0.0,
        evaluation_seconds=1.5,
    )
    run.add(
        5,
        {"mnli": [3.0, -1.0, -0.25, -1e-3], "hans": [-2.0, 1.0, 0.1], "train": [-0.5, 0.5]},
        0.625,
        train_clock=4.0,
        evaluation_seconds=0.5,
    )
    return run


def _results_json(run_dir):
    return json.loads((run_dir / schema.RESULTS_FILENAME).read_text())


def test_metrics_npz_has_exactly_the_schema(tmp_path):
    run = _two_evaluations(tmp_path / "run")
    run.write()
    with np.load(tmp_path / "run" / schema.METRICS_FILENAME, allow_pickle=False) as npz:
        expected = set(schema.REQUIRED_KEYS)
        expected |= {schema.margin_key(t) for t in LABELS} | {schema.label_key(t) for t in LABELS}
        expected |= {schema.index_key(t) for t in LABELS}
        assert set(npz.files) == expected
        assert npz[schema.STEP].tolist() == [0, 5]
        assert npz[schema.TESTSETS].tolist() == ["mnli", "hans", "train"]
        assert npz[schema.TESTSETS].dtype.kind == "U"
        assert npz[schema.IN_DOMAIN].item() == "mnli"
        assert json.loads(npz[schema.CONFIG].item()) == CONFIG
        # Accuracy by hand: " Yes" iff margin > 0, label 0 = entailment.
        np.testing.assert_array_equal(npz[schema.ACCURACY], [[2 / 4, 2 / 3, 2 / 2], [3 / 4, 2 / 3, 0 / 2]])
        loss = npz[schema.TRAIN_LOSS]
        assert np.isnan(loss[0]) and loss[1] == 0.625
        margin = npz[schema.margin_key("hans")]
        assert margin.dtype == np.float16 and margin.shape == (2, 3)
        np.testing.assert_array_equal(margin[1], np.float16([-2.0, 1.0, 0.1]))
        np.testing.assert_array_equal(npz[schema.label_key("mnli")], LABELS["mnli"])
        for name, index in DATASET_INDEX.items():
            assert npz[schema.index_key(name)].dtype == np.int64
            np.testing.assert_array_equal(npz[schema.index_key(name)], index)


def test_results_json_holds_final_and_best_accuracies_timings_and_versions(tmp_path):
    run = _two_evaluations(tmp_path / "opt-tiny_mnli_seed0_shots2")
    # A third evaluation: hans has a NaN margin (accuracy NaN, null in JSON), mnli its best so far.
    run.add(
        10,
        {"mnli": [1.0, -1.0, -1.0, 1.0], "hans": [np.nan, 1.0, -1.0], "train": [1.0, -1.0]},
        0.5,
        train_clock=9.5,
        evaluation_seconds=0.25,
    )
    run.write()
    stored = _results_json(run.path.parent)
    assert stored[schema.RESULTS_RUN] == {
        "name": "opt-tiny_mnli_seed0_shots2",
        "model": "opt-tiny",
        "seed": 0,
        "shots": 2,
    }
    assert stored[schema.RESULTS_IN_DOMAIN] == "mnli" and stored[schema.RESULTS_STEPS] == [0, 5, 10]
    assert stored[schema.RESULTS_CONFIG] == CONFIG
    # By hand, from the margins (" Yes" iff margin > 0): mnli 2/4, 3/4, 4/4; hans 2/3, 2/3, NaN; train 1, 0, 1.
    assert stored[schema.RESULTS_PER_TESTSET] == {
        "mnli": {"examples": 4, "final": {"step": 10, "accuracy": 1.0}, "best": {"step": 10, "accuracy": 1.0}},
        "hans": {"examples": 3, "final": {"step": 10, "accuracy": None}, "best": {"step": 0, "accuracy": 2 / 3}},
        "train": {"examples": 2, "final": {"step": 10, "accuracy": 1.0}, "best": {"step": 0, "accuracy": 1.0}},
    }
    assert stored[schema.RESULTS_TIMINGS] == {
        "train_seconds": 9.5,
        "evaluation_seconds": 2.25,
        "evaluations": [
            {"step": 0, "train_seconds": 0.0, "evaluation_seconds": 1.5},
            {"step": 5, "train_seconds": 4.0, "evaluation_seconds": 0.5},
            {"step": 10, "train_seconds": 5.5, "evaluation_seconds": 0.25},
        ],
    }
    versions = stored[schema.RESULTS_VERSIONS]
    assert (versions["python"], versions["jax"], versions["flax"]) == (
        platform.python_version(),
        jax.__version__,
        flax.__version__,
    )
    assert stored[schema.RESULTS_DEVICES] == {
        "platform": "cpu",
        "kind": "cpu",
        "count": jax.device_count(),
        "processes": 1,
    }
    # Not measured (oodjax.evaluate trains nothing): null, and so is a total over it.
    unmeasured = _run_results(tmp_path / "evaluated")
    unmeasured.add(0, {"mnli": [1.0] * 4, "hans": [1.0] * 3, "train": [1.0] * 2}, float("nan"), evaluation_seconds=3.0)
    unmeasured.write()
    assert _results_json(tmp_path / "evaluated")[schema.RESULTS_TIMINGS] == {
        "train_seconds": None,
        "evaluation_seconds": 3.0,
        "evaluations": [{"step": 0, "train_seconds": None, "evaluation_seconds": 3.0}],
    }


def test_a_failed_rewrite_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    run = _two_evaluations(tmp_path)
    run.write()
    before = (tmp_path / schema.METRICS_FILENAME).read_bytes()
    run.add(10, {"mnli": [1.0] * 4, "hans": [1.0] * 3, "train": [1.0] * 2}, 0.5)

    def crash_midway(file, **arrays):
        file.write(b"PK\x03\x04 half an archive")
        raise OSError("disk full")

    monkeypatch.setattr(results.np, "savez", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        run.write()
    assert (tmp_path / schema.METRICS_FILENAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [schema.METRICS_FILENAME, schema.RESULTS_FILENAME]  # no temp
    monkeypatch.undo()
    run.write()
    with np.load(tmp_path / schema.METRICS_FILENAME) as npz:
        assert npz[schema.STEP].tolist() == [0, 5, 10]


def test_resume_keeps_evaluations_up_to_the_checkpoint(tmp_path):
    _two_evaluations(tmp_path).write()
    run = _run_results(tmp_path)
    run.resume(4, expected_steps=[0])
    assert run.steps == [0]
    run.add(
        5, {"mnli": [1.0] * 4, "hans": [1.0] * 3, "train": [1.0] * 2}, 0.5, train_clock=2.0, evaluation_seconds=0.75
    )
    run.write()
    with np.load(tmp_path / schema.METRICS_FILENAME) as npz:
        assert npz[schema.STEP].tolist() == [0, 5]
        np.testing.assert_array_equal(npz[schema.margin_key("mnli")][0], [1.0] * 4)
        np.testing.assert_array_equal(npz[schema.margin_key("mnli")][1], [1.0] * 4)
        np.testing.assert_array_equal(npz[schema.index_key("train")], DATASET_INDEX["train"])
    # results.json follows: step 0's timings kept from the file resumed, step 5's this process's.
    stored = _results_json(tmp_path)
    assert stored[schema.RESULTS_STEPS] == [0, 5]
    assert stored[schema.RESULTS_TIMINGS]["evaluations"] == [
        {"step": 0, "train_seconds": 0.0, "evaluation_seconds": 1.5},
        {"step": 5, "train_seconds": 2.0, "evaluation_seconds": 0.75},
    ]
    assert stored[schema.RESULTS_PER_TESTSET]["mnli"]["final"] == {"step": 5, "accuracy": 0.5}
    with pytest.raises(ValueError, match=r"steps \[0, 5\].*expected \[0, 3\]"):
        run.resume(7, expected_steps=[0, 3])
    moved = dict(DATASET_INDEX, hans=DATASET_INDEX["hans"][::-1])
    other = results.RunResults(tmp_path, labels=LABELS, dataset_index=moved, in_domain="mnli", config=CONFIG)
    with pytest.raises(ValueError, match="the dataset indices of hans differ from this run's"):
        other.resume(5, expected_steps=[0, 5])


def test_a_run_begun_before_dataset_indices_and_results_json_resumes(tmp_path):
    """Its metrics.npz has no index/<t> and no results.json is beside it: it resumes, timings it never had are
    null, and the rewritten files have both."""
    run = _two_evaluations(tmp_path)
    old = {key: value for key, value in run.arrays().items() if not key.startswith(schema.INDEX_PREFIX)}
    np.savez(tmp_path / schema.METRICS_FILENAME, **old)
    resumed = _run_results(tmp_path)
    resumed.resume(5, expected_steps=[0, 5])
    resumed.add(
        10, {"mnli": [1.0] * 4, "hans": [1.0] * 3, "train": [1.0] * 2}, 0.5, train_clock=3.0, evaluation_seconds=0.5
    )
    resumed.write()
    with np.load(tmp_path / schema.METRICS_FILENAME) as npz:
        np.testing.assert_array_equal(npz[schema.index_key("mnli")], DATASET_INDEX["mnli"])
    timings = _results_json(tmp_path)[schema.RESULTS_TIMINGS]
    assert [e["train_seconds"] for e in timings["evaluations"]] == [None, None, 3.0]
    assert timings["train_seconds"] is None and timings["evaluation_seconds"] is None


def test_bad_results_input_is_named(tmp_path):
    with pytest.raises(ValueError, match="in-domain testset 'snli' is not among"):
        results.RunResults(tmp_path, labels=LABELS, dataset_index=DATASET_INDEX, in_domain="snli", config=CONFIG)
    with pytest.raises(ValueError, match=r"dataset indices of \['hans', 'mnli'\], labels of \['hans', 'mnli', 'tr"):
        results.RunResults(
            tmp_path, labels=LABELS, dataset_index={"mnli": [0] * 4, "hans": [0] * 3}, in_domain="mnli", config=CONFIG
        )
    with pytest.raises(ValueError, match="train: 3 dataset indices for 2 labelled examples"):
        results.RunResults(
            tmp_path, labels=LABELS, dataset_index=dict(DATASET_INDEX, train=[1, 2, 3]), in_domain="mnli", config=CONFIG
        )
    run = _run_results(tmp_path)
    with pytest.raises(ValueError, match="hans: 2 margins for 3 labelled examples"):
        run.add(0, {"mnli": [1.0] * 4, "hans": [1.0] * 2, "train": [1.0] * 2}, 0.0)
    with pytest.raises(FileNotFoundError, match="metrics.npz is missing"):
        run.resume(3, expected_steps=[0])


def test_run_name_is_a_safe_directory_name():
    assert results.run_name("facebook/opt-2.7b", "mnli", 42, 64) == "facebook-opt-2.7b_mnli_seed42_shots64"


def test_event_log_appends_json_lines_and_a_resumed_run_drops_the_steps_it_redoes(tmp_path):
    def logged():
        lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        return [(e["step"], e.get("train/loss"), e.get("accuracy/hans")) for e in lines]

    log = EventLog(tmp_path, run_name="r", config=CONFIG, kept_through=-1)
    for step in (1, 2, 3):
        log.log(step, {"train/loss": step / 10})
    log.close()
    with (tmp_path / "events.jsonl").open("a") as file:
        file.write('{"step": 4, "train/lo')  # a line a crash cut short
    log = EventLog(tmp_path, run_name="r", config=CONFIG, kept_through=2)  # resumed from step 2: appends
    log.log(2, {"accuracy/hans": 0.25})
    log.log(3, {"train/loss": 0.35})
    log.close()
    assert logged() == [(1, 0.1, None), (2, 0.2, None), (2, None, 0.25), (3, 0.35, None)]
    EventLog(tmp_path, run_name="r", config=CONFIG, kept_through=-1).close()  # started over: nothing kept
    assert logged() == []


def test_metrics_npz_follows_the_umask(tmp_path):
    """Readable by the group under the usual umask, as any file the job writes; not tempfile's 0600."""
    previous = os.umask(0o022)
    try:
        _two_evaluations(tmp_path / "a").write()
        os.umask(0o027)
        _two_evaluations(tmp_path / "b").write()
    finally:
        os.umask(previous)
    for name in (schema.METRICS_FILENAME, schema.RESULTS_FILENAME):
        assert stat.S_IMODE((tmp_path / "a" / name).stat().st_mode) == 0o644
        assert stat.S_IMODE((tmp_path / "b" / name).stat().st_mode) == 0o640


def test_progress_tells_finished_runs_and_names_an_unreadable_file(tmp_path):
    assert results.read_progress(tmp_path) is None  # no metrics.npz: a new run
    _two_evaluations(tmp_path).write()
    progress = results.read_progress(tmp_path)
    assert progress.steps == (0, 5) and progress.config == CONFIG
    assert progress.finished(5) and not progress.finished(10)
    path = tmp_path / schema.METRICS_FILENAME
    path.write_bytes(path.read_bytes()[:200])  # truncated
    with pytest.raises(results.UnreadableResultsError, match=rf"{path} is unreadable \(BadZipFile: "):
        results.read_progress(tmp_path)
