"""`python -m analysis.runs`: the runs under a results root at a glance; progress on big roots."""

import io
import pathlib
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from analysis import figures, runs
from fixtures_results import write_results_root, write_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = np.arange(0, 101, 25)


@pytest.fixture
def results(tmp_path):
    """Two finished runs and one stopped at step 50 of 100."""
    root = tmp_path / "results"
    write_results_root(root, models={"opt-125m": "facebook/opt-125m"}, train_sets=("mnli",),
                       seeds=(0, 42), shots=(32,), steps=STEPS)
    accuracy = np.full((3, 4), 0.6)
    accuracy[:, 0] = [0.5, 0.7, 0.8]  # in-domain
    accuracy[:, 3] = [0.5, 0.5, np.nan]  # not evaluated at the last step: left out of the mean
    write_run(root / "stopped", steps=STEPS[:3], testsets=["mnli", "hans", "rte", "paws"],
              accuracy=accuracy, in_domain="mnli", model="opt-125m", seed=99, shots=32,
              config={"model": {"path": "facebook/opt-125m"}, "train": {"steps": 100}})
    return root


def test_lists_each_run_with_its_progress_and_last_accuracies(results):
    completed = subprocess.run(
        [sys.executable, "-m", "analysis.runs", str(results), "--csv"], cwd=ROOT,
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    table = pd.read_csv(io.StringIO(completed.stdout)).set_index("run")
    assert list(table.columns) == ["model", "train_set", "seed", "shots", "last_step",
                                   "planned_steps", "finished", "in_domain_accuracy",
                                   "mean_ood_accuracy"]
    assert table["finished"].to_dict() == {
        "opt-125m_mnli_seed0_shots32": True, "opt-125m_mnli_seed42_shots32": True,
        "stopped": False,
    }
    stopped = table.loc["stopped"]
    assert (stopped["seed"], stopped["last_step"], stopped["planned_steps"]) == (99, 50, 100)
    assert stopped["in_domain_accuracy"] == pytest.approx(0.8)
    assert stopped["mean_ood_accuracy"] == pytest.approx(0.6)
    finished = runs.load_run(results / "opt-125m_mnli_seed42_shots32" / "metrics.npz")
    last = finished.accuracy.iloc[-1]
    assert table.loc[finished.name, "mean_ood_accuracy"] == pytest.approx(
        last[finished.ood_testsets].mean()
    )


def test_the_plain_table_is_aligned_and_counts_unfinished_runs(results, capsys):
    assert runs.main([str(results)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "model", "train_set", "seed", "shots", "last_step",
                                "planned_steps", "finished", "in_domain_accuracy",
                                "mean_ood_accuracy"]
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


def test_accuracy_curves_mark_chance_and_can_share_one_y_range(results):
    group = runs.find_runs(results)
    fig = figures.accuracy_curves(group, title="opt", note="3 runs", ylim=(0.3, 1.0))
    assert fig.get_suptitle() == "opt\n3 runs"
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == len(group[0].accuracy.columns)
    for ax in axes:
        assert ax.get_ylim() == (0.3, 1.0)
        chance = [line for line in ax.get_lines() if line.get_label() == "chance"]
        assert len(chance) == 1 and set(chance[0].get_ydata()) == {figures.CHANCE}
    fitted = figures.accuracy_curves(group, title="t", note="n")
    assert len({ax.get_ylim() for ax in fitted.axes if ax.get_visible()}) > 1
