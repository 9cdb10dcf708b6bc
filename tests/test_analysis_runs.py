"""`python -m analysis.runs`: the runs under a results root at a glance, evaluation-only runs told apart; progress
on big roots."""

import io
import json
import pathlib
import shutil
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pandas as pd
import pytest
from fixtures_results import IN_DOMAIN_EXAMPLES, cut_short, write_results_root, write_run

from analysis import figures, runs, schema
from analysis.aggregate import majority_class_rates

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = np.arange(0, 101, 25)


@pytest.fixture
def results(tmp_path):
    """Two finished runs and one stopped at step 50 of 100."""
    root = tmp_path / "results"
    write_results_root(
        root, models={"opt-125m": "facebook/opt-125m"}, train_sets=("mnli",), seeds=(0, 42), shots=(32,), steps=STEPS
    )
    accuracy = np.full((3, 4), 0.6)
    accuracy[:, 0] = [0.5, 0.7, 0.8]  # in-domain
    accuracy[:, 1:3] = [[0.6, 0.58], [0.62, 0.6], [0.65, 0.55]]  # moving: no near-constant OOD series
    accuracy[:, 3] = [0.5, 0.52, np.nan]  # not evaluated at the last step: left out of the mean
    write_run(
        root / "stopped",
        steps=STEPS[:3],
        testsets=["mnli", "hans", "rte", "paws"],
        accuracy=accuracy,
        in_domain="mnli",
        model="opt-125m",
        seed=99,
        shots=32,
        config={"model": {"path": "facebook/opt-125m"}, "train": {"steps": 100}},
    )
    return root


def test_lists_each_run_with_its_progress_and_last_accuracies(results):
    completed = subprocess.run(
        [sys.executable, "-m", "analysis.runs", str(results), "--csv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    table = pd.read_csv(io.StringIO(completed.stdout)).set_index("run")
    assert list(table.columns) == [
        "model",
        "train_set",
        "seed",
        "shots",
        "kind",
        "last_step",
        "planned_steps",
        "finished",
        "in_domain_accuracy",
        "mean_ood_accuracy",
        "in_domain_reliability",
        "problem",
    ]
    assert table["finished"].to_dict() == {
        "opt-125m_mnli_seed0_shots32": True,
        "opt-125m_mnli_seed42_shots32": True,
        "stopped": False,
    }
    assert set(table["kind"]) == {"trained"}
    stopped = table.loc["stopped"]
    assert (stopped["seed"], stopped["last_step"], stopped["planned_steps"]) == (99, 50, 100)
    assert stopped["in_domain_accuracy"] == pytest.approx(0.8)
    assert stopped["mean_ood_accuracy"] == pytest.approx(0.6)
    finished = runs.load_run(results / "opt-125m_mnli_seed42_shots32" / "metrics.npz")
    last = finished.accuracy.iloc[-1]
    assert table.loc[finished.name, "mean_ood_accuracy"] == pytest.approx(last[finished.ood_testsets].mean())
    # Issue 54: 1 - mean binomial variance on the stored in-domain labels' count / sample variance, after step 0.
    in_domain = finished.accuracy["mnli"].to_numpy()[1:]
    examples = np.load(finished.path)[schema.label_key("mnli")].size
    expected = 1.0 - np.mean(in_domain * (1.0 - in_domain) / examples) / np.var(in_domain, ddof=1)
    assert table.loc[finished.name, "in_domain_reliability"] == pytest.approx(expected, rel=1e-5)
    assert np.isnan(stopped["in_domain_reliability"])  # 2 evaluations after step 0: not judged


def test_the_plain_table_is_aligned_and_counts_unfinished_runs(results, capsys):
    assert runs.main([str(results)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "run",
        "model",
        "train_set",
        "seed",
        "shots",
        "kind",
        "last_step",
        "planned_steps",
        "finished",
        "in_domain_accuracy",
        "mean_ood_accuracy",
        "in_domain_reliability",
        "problem",
    ]
    assert len({len(line) for line in lines[:-1]}) == 1  # one width: aligned columns
    assert lines[-1] == "3 runs, 2 finished, 1 not"


def test_a_missing_root_is_a_clear_error(tmp_path, capsys):
    assert runs.main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: results root")


def test_reading_many_runs_shows_progress(results, capsys, monkeypatch):
    runs.find_runs(results)
    assert "reading runs" not in capsys.readouterr().err
    monkeypatch.setattr(runs, "PROGRESS_MIN_FILES", 2)
    runs.find_runs(results)
    assert "reading runs: 100%" in capsys.readouterr().err


def test_accuracy_curves_have_a_panel_per_testset_under_the_title(results):
    """(Their chance lines and shared ranges: tests/test_analysis_figures.py.)"""
    group = runs.find_runs(results)
    fig = figures.accuracy_curves(group, chance=majority_class_rates(group), title="opt", note="3 runs")
    assert fig.get_suptitle() == "opt\n3 runs"
    assert len([ax for ax in fig.axes if ax.get_visible()]) == len(group[0].accuracy.columns)


def good_metrics(directory: pathlib.Path, **changes) -> pathlib.Path:
    arguments = dict(
        steps=STEPS,
        testsets=["mnli", "hans", "rte"],
        accuracy=np.full((5, 3), 0.6),
        in_domain="mnli",
        model="opt-125m",
        seed=7,
        shots=32,
    )
    return write_run(directory, **(arguments | changes))


def overwrite_step_data(path: pathlib.Path, start: float, stop: float) -> None:
    """Set the bytes of the stored step array (which every reader reads) from `start` to
    `stop` (fractions of its stored length) to 0xFF."""
    with zipfile.ZipFile(path) as archive:
        member = archive.getinfo(f"{schema.STEP}.npy")
    data = bytearray(path.read_bytes())
    # A local header is 30 bytes, then the name and an extra field whose lengths it holds.
    header = member.header_offset
    name_length, extra_length = struct.unpack("<HH", data[header + 26 : header + 30])
    offset = header + 30 + name_length + extra_length
    first, last = (offset + int(member.compress_size * fraction) for fraction in (start, stop))
    data[first:last] = b"\xff" * (last - first)
    path.write_bytes(bytes(data))


def compress_then_corrupt(path: pathlib.Path) -> None:
    """0xFF opens a deflate block of the reserved type 3: the data cannot be inflated."""
    with np.load(path) as npz:
        arrays = dict(npz)
    np.savez_compressed(path, **arrays)
    overwrite_step_data(path, 0.0, 1.0)


@pytest.mark.parametrize(
    "damage, message",
    [
        (cut_short, r"BadZipFile: File is not a zip file"),
        (lambda path: path.write_bytes(b""), r"EOFError: No data left in file"),
        (lambda path: overwrite_step_data(path, 0.9, 0.95), r"BadZipFile: Bad CRC-32 for file 'step.npy'"),
        (compress_then_corrupt, r"error: Error -3 while decompressing data: invalid block type"),
        (lambda path: path.write_text("step,accuracy\n0,0.5\n"), r"ValueError: .*pickled"),
    ],
    ids=["truncated", "empty", "corrupt", "compressed-corrupt", "text"],
)
def test_an_unreadable_file_is_named_and_told_apart_from_a_schema_error(tmp_path, damage, message):
    path = good_metrics(tmp_path / "run")
    damage(path)
    with pytest.raises(runs.UnreadableMetricsError, match=message) as raised:
        runs.read_metrics(path)
    assert str(raised.value).startswith(f"{path}: not a readable npz file (")


def test_a_readable_file_of_another_schema_is_an_error_not_a_skip(tmp_path):
    path = tmp_path / "metrics.npz"
    np.savez(path, step=np.arange(3), weights=np.zeros(3))
    assert set(runs.read_metrics(path, keys=("step",))) == {"step"}
    with pytest.raises(runs.ResultsError, match=r"missing keys \['testsets', 'accuracy'") as raised:
        runs.read_metrics(path)
    assert not isinstance(raised.value, runs.UnreadableMetricsError)
    with path.open("wb") as file:  # np.save to a name would append .npy
        np.save(file, np.arange(3))
    with pytest.raises(runs.ResultsError, match=rf"{path}: one npy array, not an npz") as raised:
        runs.read_metrics(path)
    assert not isinstance(raised.value, runs.UnreadableMetricsError)
    with zipfile.ZipFile(path, "w") as archive:  # intact, but its step is no npy array
        archive.writestr("step.npy", "0,25,50")
    with pytest.raises(runs.ResultsError, match=rf"{path}: its 'step' is not an npy") as raised:
        runs.read_metrics(path, keys=("step",))
    assert not isinstance(raised.value, runs.UnreadableMetricsError)


def test_a_truncated_file_is_listed_as_an_unfinished_unreadable_run(results, capsys):
    killed = cut_short(good_metrics(results / "killed"))
    assert runs.main([str(results), "--csv"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        f"warning: {killed}: not a readable npz file (BadZipFile: File is "
        "not a zip file); skipped, its run counts as unfinished\n"
    )
    table = pd.read_csv(io.StringIO(captured.out), keep_default_na=False).set_index("run")
    assert table.loc["killed", "finished"] == False  # noqa: E712 (a numpy bool)
    assert table.loc["killed", "problem"] == "unreadable"
    assert table.loc["killed", ["model", "seed", "last_step"]].tolist() == ["", "", ""]
    assert (table.drop(index="killed")["problem"] == "").all()

    assert runs.main([str(results)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "4 runs, 2 finished, 2 not (1 unreadable)"
    assert len({len(line) for line in lines[:-1]}) == 1
    assert [line.split() for line in lines if line.lstrip().startswith("killed")] == [
        ["killed", *["-"] * 7, "False", "-", "-", "-", "unreadable"]
    ]


def test_find_runs_warns_about_an_unreadable_file_and_reads_the_rest(results):
    killed = cut_short(good_metrics(results / "killed"))
    with pytest.warns(runs.ResultsWarning, match=f"{killed}: not a readable npz file"):
        found = runs.find_runs(results)
    assert sorted(run.name for run in found) == [
        "opt-125m_mnli_seed0_shots32",
        "opt-125m_mnli_seed42_shots32",
        "stopped",
    ]


def test_a_root_of_unreadable_files_only_is_an_error(tmp_path):
    killed = cut_short(good_metrics(tmp_path / "results" / "killed"))
    with pytest.warns(runs.ResultsWarning):
        with pytest.raises(
            runs.ResultsError,
            match=rf"no readable metrics\.npz under "
            rf"{tmp_path / 'results'}: all 1 skipped, first {killed}: not a ",
        ):
            runs.find_runs(tmp_path / "results")


def test_a_byte_identical_copy_in_another_folder_counts_once(results):
    shutil.copytree(results / "stopped", results / "backup" / "stopped")
    original = results / "stopped" / "metrics.npz"
    copy = results / "backup" / "stopped" / "metrics.npz"
    found, skipped = runs.scan_runs(results)
    assert len(found) == 3
    assert [run.path for run in found if run.name == "stopped"] == [copy]  # the first path found
    assert skipped == [runs.SkippedFile(original, f"a byte-identical copy of {copy}; counted once", unreadable=False)]


def test_one_run_found_twice_with_different_contents_is_an_error_naming_both(results):
    # The same run (opt-125m, mnli, seed 99, 32 shots) trained further in another job's folder.
    accuracy = np.full((5, 4), 0.7)
    write_run(
        results / "per_run_job" / "stopped",
        steps=STEPS,
        testsets=["mnli", "hans", "rte", "paws"],
        accuracy=accuracy,
        in_domain="mnli",
        model="opt-125m",
        seed=99,
        shots=32,
        config={"model": {"path": "facebook/opt-125m"}, "train": {"steps": 100}},
    )
    message = (
        r"run \(model 'opt-125m', train set 'mnli', seed 99, 32 shots\) found 2 times with "
        rf"different contents: {results / 'per_run_job' / 'stopped' / 'metrics.npz'} \(last "
        rf"step 100 of 100\), {results / 'stopped' / 'metrics.npz'} \(last step 50 of 100\); "
        "keep one"
    )
    with pytest.raises(runs.ResultsError, match=message):
        runs.scan_runs(results)
    assert runs.main([str(results)]) == 2


def with_run_section(path: pathlib.Path, **fields) -> pathlib.Path:
    """Adds `fields` to the run section of a metrics.npz's config, as `oodjax.evaluate` writes it."""
    with np.load(path) as npz:
        arrays = dict(npz)
    config = json.loads(arrays[schema.CONFIG].item())
    config[schema.RUN_SECTION].update(fields)
    arrays[schema.CONFIG] = np.asarray(json.dumps(config))
    np.savez(path, **arrays)
    return path


def test_evaluation_only_runs_are_listed_as_such_not_as_unfinished(results, capsys):
    """Marked in their run section, or (written before the marker) told by their config: one evaluation, at
    step 0, of the in-context baseline, adapters or the base model alone (0 shots)."""
    opt = {"path": "facebook/opt-125m"}
    one_step = dict(
        steps=np.array([0]), testsets=["mnli", "hans", "rte"], accuracy=np.full((1, 3), 0.6), in_domain="mnli"
    )
    base = write_run(
        results / "opt-125m_mnli_base",
        **one_step,
        model="opt-125m",
        seed=0,
        shots=0,
        config={"model": opt, "train": {"steps": 100}},
    )
    with_run_section(base, **{schema.RUN_EVALUATED: schema.EVALUATED_BASE})
    write_run(
        results / "old_adapter",
        **one_step,
        model="opt-125m",
        seed=1,
        shots=32,
        config={"model": opt | {"adapters": ["a/adapter"]}, "train": {"steps": 100}},
    )
    write_run(
        results / "old_in_context",
        **one_step,
        model="opt-125m-icl",
        seed=0,
        shots=32,
        config={"model": opt, "eval": {"in_context": True}, "train": {"steps": 100}},
    )
    write_run(
        results / "old_base",
        **one_step,
        model="opt-350m",
        seed=0,
        shots=0,
        config={"model": {"path": "facebook/opt-350m"}, "train": {"steps": 100}},
    )
    # A trained run that has only its step-0 evaluation so far is an unfinished trained run, and so is one past
    # step 0 whose config names adapters (training ignores model.adapters).
    write_run(
        results / "just_started",
        **one_step,
        model="opt-125m",
        seed=5,
        shots=32,
        config={"model": opt, "train": {"steps": 100}},
    )
    write_run(
        results / "adapters_ignored",
        steps=STEPS[:2],
        testsets=["mnli", "hans", "rte"],
        accuracy=np.full((2, 3), 0.6),
        in_domain="mnli",
        model="opt-125m",
        seed=6,
        shots=32,
        config={"model": opt | {"adapters": ["a/adapter"]}, "train": {"steps": 100}},
    )
    assert runs.main([str(results), "--csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False).set_index("run")
    evaluated = ["opt-125m_mnli_base", "old_adapter", "old_in_context", "old_base"]
    assert table.loc[evaluated, "kind"].tolist() == [
        "evaluated (base model)",
        "evaluated (adapter)",
        "evaluated (in context)",
        "evaluated (base model)",
    ]
    assert table.loc[evaluated, "finished"].tolist() == [True] * 4
    assert table.loc[evaluated, "planned_steps"].tolist() == [""] * 4  # nothing was to train
    for trained in ("just_started", "adapters_ignored"):
        assert table.loc[trained, ["kind", "finished", "planned_steps"]].tolist() == ["trained", False, "100"]
    assert runs.main([str(results)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "9 runs, 6 finished (4 evaluation-only), 3 not"
    assert len({len(line) for line in lines[:-1]}) == 1

    with_run_section(base, **{schema.RUN_EVALUATED: "trained twice"})
    with pytest.raises(runs.ResultsError, match=r"run\.evaluated is 'trained twice', not one of \['base', "):
        runs.load_run(base)


def test_an_adapter_evaluated_beside_its_trained_run_is_a_run_of_its_own(results, capsys):
    """Issue 44: `oodjax.evaluate` of a run's adapter keeps that run's model, seed and shots, in a job folder
    of its own under the same root; both are listed, neither refused as a copy of the other."""
    trained = results / "opt-125m_mnli_seed0_shots32" / schema.METRICS_FILENAME
    adapter = write_run(
        results / "opt-125m-eval" / "opt-125m_mnli_seed0_shots32",
        steps=np.array([0]),
        testsets=["mnli", "hans", "rte"],
        accuracy=np.full((1, 3), 0.7),
        in_domain="mnli",
        model="opt-125m",
        seed=0,
        shots=32,
        config={"model": {"path": "facebook/opt-125m", "adapters": [str(trained.parent / "adapter")]}},
    )
    with_run_section(adapter, **{schema.RUN_EVALUATED: schema.EVALUATED_ADAPTER})
    found, skipped = runs.scan_runs(results)
    assert skipped == []
    assert [(run.path, run.kind) for run in found if run.seed == 0] == [
        (trained, "trained"),
        (adapter, "evaluated (adapter)"),
    ]
    assert runs.main([str(results)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "4 runs, 3 finished (1 evaluation-only), 1 not"
    # Two evaluations of the same adapter that differ are still one run twice: an error naming the kind.
    write_run(
        results / "again" / "opt-125m_mnli_seed0_shots32",
        steps=np.array([0]),
        testsets=["mnli", "hans", "rte"],
        accuracy=np.full((1, 3), 0.6),
        in_domain="mnli",
        model="opt-125m",
        seed=0,
        shots=32,
    )
    with_run_section(results / "again" / "opt-125m_mnli_seed0_shots32" / schema.METRICS_FILENAME, evaluated="adapter")
    with pytest.raises(runs.ResultsError, match=r"seed 0, 32 shots, evaluated \(adapter\)\) found 2 times"):
        runs.scan_runs(results)


@pytest.mark.parametrize(
    ("train_steps", "run_steps", "finished"),
    [(50, None, True), (100, None, False), (100, 50, True), (50, 100, False), (25, None, False)],
)
def test_finished_is_the_last_step_the_run_itself_planned(tmp_path, train_steps, run_steps, finished):
    """A run's own total (config run.steps, when runs of a job train for different lengths), else train.steps;
    a last step past it is no finish either (the run was planned otherwise)."""
    path = good_metrics(
        tmp_path / "run", steps=STEPS[:3], accuracy=np.full((3, 3), 0.6), config={"train": {"steps": train_steps}}
    )
    if run_steps is not None:
        with_run_section(path, steps=run_steps)
    run = runs.load_run(path)
    assert (run.finished, run.planned_steps) == (finished, run_steps or train_steps)
    overview = runs.runs_overview([run])
    assert overview["finished"].tolist() == [finished]


def _binomial_runs(root: pathlib.Path, name: str, true_in_domain: np.ndarray, seed: int) -> list[runs.RunRecord]:
    """One run per row of `true_in_domain` ([runs, evaluations], steps 0, 25, ...), its in-domain accuracy
    measured on the fixtures' IN_DOMAIN_EXAMPLES (binomial), two moving OOD testsets beside it."""
    rng = np.random.default_rng(seed)
    found = []
    for index, true in enumerate(true_in_domain):
        steps = 25 * np.arange(true.size)
        measured = rng.binomial(IN_DOMAIN_EXAMPLES, true) / IN_DOMAIN_EXAMPLES
        accuracy = np.column_stack([measured, rng.uniform(0.4, 0.6, (true.size, 2))])
        path = write_run(
            root / f"{name}{index}",
            steps=steps,
            testsets=["mnli", "hans", "rte"],
            accuracy=accuracy,
            in_domain="mnli",
            model="opt-125m",
            seed=index,
            shots=32,
            config={"model": {"path": "facebook/opt-125m"}, "train": {"steps": int(steps[-1])}},
        )
        found.append(runs.load_run(path))
    return found


def test_runs_that_never_learn_are_named_by_their_in_domain_reliability(tmp_path):
    """Issue 54: a run whose in-domain accuracy never moves (binomial noise on 1,000 examples about a constant
    0.8: a range of about 0.045 over 21 evaluations, which the range rule of issue 48 let through in most runs),
    at 21 and 41 evaluations, and one that jumps at its first evaluation and then stays flat, are named in at
    least 90% of runs (the reliability's estimate stays below 0.5 unless 19 or 39 degrees of freedom of pure
    noise double their expected variance: under 1% of runs); a run that learns never is, and a plateau whose
    true sd 0.02 makes a reliability of 0.71 is named in at most 25% (about 10% expected; 60 runs)."""
    count = 60
    never_21 = _binomial_runs(tmp_path, "never21_", np.full((count, 21), 0.8), seed=1)
    never_41 = _binomial_runs(tmp_path, "never41_", np.full((count, 41), 0.8), seed=2)
    jumps = _binomial_runs(tmp_path, "jump", np.column_stack([np.full(count, 0.5), np.full((count, 20), 0.8)]), 3)
    curve = 0.5 + 0.35 * (1.0 - np.exp(-np.arange(21) / 5.0))
    learns = _binomial_runs(tmp_path, "learns", np.tile(curve, (count, 1)), seed=4)
    plateau = np.column_stack([np.full(count, 0.5), 0.8 + 0.02 * np.random.default_rng(5).normal(size=(count, 20))])
    signal = _binomial_runs(tmp_path, "plateau", plateau, seed=6)

    def named(found: list[runs.RunRecord]) -> float:
        return float(np.mean([bool(run.flat) for run in found]))

    assert min(named(never_21), named(never_41), named(jumps)) >= 0.9
    assert named(learns) == 0.0
    assert named(signal) <= 0.25


def test_flat_runs_are_named_and_counted_in_one_warning_each(results, capsys):
    """The warning line of a flat run (`RunRecord.flat`) and the count in the last line; a run with fewer than
    runs.FLAT_MIN_EVALUATIONS evaluations after step 0 (`stopped`, 2) is not judged."""
    flat = results / "flat"
    _write_mnli_run(
        flat, np.column_stack([[0.5, 0.80, 0.81, 0.80, 0.81], [0.5, 0.55, 0.6, 0.58, 0.62], np.linspace(0.3, 0.5, 5)])
    )
    assert runs.main([str(results)]) == 0
    captured = capsys.readouterr()
    # 1 - mean(p (1 - p) / 1000) / var([0.80, 0.81, 0.80, 0.81], ddof=1) < 0, clipped to 0.
    assert [line for line in captured.err.splitlines() if "flat" in line] == [
        f"warning: {flat / schema.METRICS_FILENAME}: flat, in-domain reliability 0.00 over 4 evaluations after "
        "step 0 (below 0.5: more binomial noise on 1000 examples than movement); a partial correlation given it "
        "measures noise"
    ]
    assert captured.out.splitlines()[-1] == (
        "4 runs, 3 finished, 1 not; 1 flat (in-domain accuracy barely moves, see the warnings)"
    )


def test_near_constant_ood_series_are_named(results, capsys):
    """Issue 54: an OOD testset whose accuracy sits at one value at half the evaluations or more (a model
    answering one class) is named in a warning; one whose values all differ is not."""
    stuck = results / "stuck"
    _write_mnli_run(
        stuck, np.column_stack([[0.5, 0.6, 0.7, 0.8, 0.85], [0.5, 0.56, 0.56, 0.56, 0.6], [0.5, 0.52, 0.53, 0.6, 0.7]])
    )
    assert runs.main([str(results)]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "near-constant" in line] == [
        f"warning: {stuck / schema.METRICS_FILENAME}: near-constant OOD accuracy, 'hans' at 0.560 in 3 of 5 "
        "evaluations; its partial correlations rest on the other evaluations"
    ]


def test_a_run_without_its_in_domain_labels_is_a_clear_error(tmp_path, capsys):
    """Its reliability needs N, the stored in-domain labels' count: one line and exit status 2, no traceback."""
    path = good_metrics(tmp_path / "run")
    with np.load(path) as npz:
        arrays = {key: npz[key] for key in npz.files if key != schema.label_key("mnli")}
    np.savez(path, **arrays)
    assert runs.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}: not a run's metrics (schema in analysis/schema.py): missing keys ['label/mnli']\n"
    )


def _write_mnli_run(directory: pathlib.Path, accuracy: np.ndarray) -> None:
    """One finished opt-125m run on MNLI with the OOD testsets hans and rte, `accuracy` [STEPS, 3]."""
    write_run(
        directory,
        steps=STEPS,
        testsets=["mnli", "hans", "rte"],
        accuracy=accuracy,
        in_domain="mnli",
        model="opt-125m",
        seed=10,
        shots=32,
        config={"model": {"path": "facebook/opt-125m"}, "train": {"steps": 100}},
    )
