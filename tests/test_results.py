"""metrics.npz: exactly the schema of analysis/schema.py, rewritten atomically, with the umask's mode, read back
to tell finished runs; the event log."""

import json
import os
import stat

import numpy as np
import pytest

from analysis import schema
from oodjax.engine import results
from oodjax.engine.events import EventLog

LABELS = {"mnli": np.array([0, 1, 1, 0]), "hans": np.array([1, 0, 1]), "train": np.array([0, 1])}
CONFIG = {"run": {"model": "opt-tiny", "seed": 0, "shots": 2}, "train": {"steps": 10}}


def _two_evaluations(run_dir):
    run = results.RunResults(run_dir, labels=LABELS, in_domain="mnli", config=CONFIG)
    run.add(0, {"mnli": [1.0, 1.0, 1.0, 1.0], "hans": [-2.0, -1.0, 0.0], "train": [0.5, -0.5]}, float("nan"))
    run.add(5, {"mnli": [3.0, -1.0, -0.25, -1e-3], "hans": [-2.0, 1.0, 0.1], "train": [-0.5, 0.5]}, 0.625)
    return run


def test_metrics_npz_has_exactly_the_schema(tmp_path):
    run = _two_evaluations(tmp_path / "run")
    run.write()
    with np.load(tmp_path / "run" / schema.METRICS_FILENAME, allow_pickle=False) as npz:
        expected = set(schema.REQUIRED_KEYS)
        expected |= {schema.margin_key(t) for t in LABELS} | {schema.label_key(t) for t in LABELS}
        assert set(npz.files) == expected
        assert npz[schema.STEP].tolist() == [0, 5]
        assert npz[schema.TESTSETS].tolist() == ["mnli", "hans", "train"]
        assert npz[schema.TESTSETS].dtype.kind == "U"
        assert npz[schema.IN_DOMAIN].item() == "mnli"
        assert json.loads(npz[schema.CONFIG].item()) == CONFIG
        # Accuracy by hand: " Yes" iff margin > 0, label 0 = entailment.
        np.testing.assert_array_equal(
            npz[schema.ACCURACY], [[2 / 4, 2 / 3, 2 / 2], [3 / 4, 2 / 3, 0 / 2]]
        )
        loss = npz[schema.TRAIN_LOSS]
        assert np.isnan(loss[0]) and loss[1] == 0.625
        margin = npz[schema.margin_key("hans")]
        assert margin.dtype == np.float16 and margin.shape == (2, 3)
        np.testing.assert_array_equal(margin[1], np.float16([-2.0, 1.0, 0.1]))
        np.testing.assert_array_equal(npz[schema.label_key("mnli")], LABELS["mnli"])


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
    assert [p.name for p in tmp_path.iterdir()] == [schema.METRICS_FILENAME]  # no temp file left
    monkeypatch.undo()
    run.write()
    with np.load(tmp_path / schema.METRICS_FILENAME) as npz:
        assert npz[schema.STEP].tolist() == [0, 5, 10]


def test_resume_keeps_evaluations_up_to_the_checkpoint(tmp_path):
    _two_evaluations(tmp_path).write()
    run = results.RunResults(tmp_path, labels=LABELS, in_domain="mnli", config=CONFIG)
    run.resume(4, expected_steps=[0])
    assert run.steps == [0]
    run.add(5, {"mnli": [1.0] * 4, "hans": [1.0] * 3, "train": [1.0] * 2}, 0.5)
    run.write()
    with np.load(tmp_path / schema.METRICS_FILENAME) as npz:
        assert npz[schema.STEP].tolist() == [0, 5]
        np.testing.assert_array_equal(npz[schema.margin_key("mnli")][0], [1.0] * 4)
        np.testing.assert_array_equal(npz[schema.margin_key("mnli")][1], [1.0] * 4)
    with pytest.raises(ValueError, match=r"steps \[0, 5\].*expected \[0, 3\]"):
        run.resume(7, expected_steps=[0, 3])


def test_bad_results_input_is_named(tmp_path):
    with pytest.raises(ValueError, match="in-domain testset 'snli' is not among"):
        results.RunResults(tmp_path, labels=LABELS, in_domain="snli", config=CONFIG)
    run = results.RunResults(tmp_path, labels=LABELS, in_domain="mnli", config=CONFIG)
    with pytest.raises(ValueError, match="hans: 2 margins for 3 labelled examples"):
        run.add(0, {"mnli": [1.0] * 4, "hans": [1.0] * 2, "train": [1.0] * 2}, 0.0)
    with pytest.raises(FileNotFoundError, match="metrics.npz is missing"):
        run.resume(3, expected_steps=[0])


def test_run_name_is_a_safe_directory_name():
    assert results.run_name("facebook/opt-2.7b", "mnli", 42, 64) == "facebook-opt-2.7b_mnli_seed42_shots64"


def test_event_log_appends_json_lines(tmp_path):
    log = EventLog(tmp_path, run_name="r", config=CONFIG)
    log.log(1, {"train/loss": 0.5})
    log.close()
    log = EventLog(tmp_path, run_name="r", config=CONFIG)  # a resumed run appends
    log.log(2, {"accuracy/hans": 0.25})
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e.get("train/loss"), e.get("accuracy/hans")) for e in lines] == [
        (1, 0.5, None),
        (2, None, 0.25),
    ]


def test_metrics_npz_follows_the_umask(tmp_path):
    """Readable by the group under the usual umask, as any file the job writes; not tempfile's 0600."""
    previous = os.umask(0o022)
    try:
        _two_evaluations(tmp_path / "a").write()
        os.umask(0o027)
        _two_evaluations(tmp_path / "b").write()
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a" / schema.METRICS_FILENAME).stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b" / schema.METRICS_FILENAME).stat().st_mode) == 0o640


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
