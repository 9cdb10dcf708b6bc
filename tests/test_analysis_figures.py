"""What the figures draw: chance at each testset's majority class, shared ranges, a key to the marks."""

import numpy as np
import pytest
from fixtures_results import write_results_root, write_run

from analysis import figures, schema
from analysis.aggregate import all_run_pairs, combine_runs, majority_class_rates
from analysis.cli import main
from analysis.runs import find_runs
from analysis.sensitivity import SENSITIVE


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """The runs of one model and training set: 2 seeds x 2 shot counts."""
    results = tmp_path_factory.mktemp("results")
    write_results_root(
        results, models={"opt-125m": "facebook/opt-125m"}, train_sets=("mnli",), seeds=(0, 1), shots=(32, 64)
    )
    return find_runs(results)


def stored_majority_rates(run) -> dict[str, float]:
    """Each testset's majority-class share, counted straight from the npz's labels."""
    with np.load(run.path) as npz:
        return {
            name: np.bincount(npz[schema.label_key(name)]).max() / len(npz[schema.label_key(name)])
            for name in npz[schema.TESTSETS]
        }


def dashed(lines) -> list:
    return [line for line in lines if line.get_linestyle() == "--"]


def test_chance_lines_sit_at_each_testsets_majority_class_rate(group):
    expected = stored_majority_rates(group[0])
    assert any(rate != 0.5 for rate in expected.values())  # else 0.5 everywhere would pass
    chance = majority_class_rates(group)
    assert chance == {name: (rate,) for name, rate in expected.items()}
    curves = figures.accuracy_curves(group, chance=chance, title="t", note="n")
    panels = [ax for ax in curves.axes if ax.get_visible()]
    for ax, name in zip(panels, group[0].accuracy.columns):
        assert [set(line.get_ydata()) for line in dashed(ax.get_lines())] == [{expected[name]}], name
    assert "chance (majority class)" in [text.get_text() for text in curves.legends[0].get_texts()]
    scatter = figures.ood_vs_in_domain(group, chance=chance, residualiser="spline", probit=False, title="t", note="n")
    panels = [ax for ax in scatter.axes if ax.get_visible()]
    for ax, name in zip(panels, group[0].ood_testsets):
        horizontal, vertical = dashed(ax.get_lines())
        assert set(horizontal.get_ydata()) == {expected[name]}, name
        assert set(vertical.get_xdata()) == {expected["mnli"]}, name


def test_runs_that_evaluated_different_examples_get_a_chance_line_each(tmp_path):
    arguments = dict(
        steps=np.arange(6),
        testsets=["mnli", "hans", "rte"],
        accuracy=np.full((6, 3), 0.6),
        in_domain="mnli",
        model="opt-125m",
        shots=32,
    )
    paths = [write_run(tmp_path / f"run{seed}", seed=seed, **arguments) for seed in (0, 1)]
    with np.load(paths[1]) as npz:
        arrays = dict(npz)
    arrays[schema.label_key("hans")] = np.array([0, 0, 0, 1])
    np.savez(paths[1], **arrays)
    with np.load(paths[0]) as npz:
        first = np.bincount(npz[schema.label_key("hans")]).max() / len(npz[schema.label_key("hans")])
    assert majority_class_rates(find_runs(tmp_path))["hans"] == tuple(sorted({first, 0.75}))


def test_a_run_without_stored_labels_is_a_clear_error(tmp_path, capsys):
    path = write_run(
        tmp_path / "results" / "run",
        steps=np.arange(6),
        testsets=["mnli", "hans", "rte"],
        accuracy=np.random.default_rng(0).uniform(size=(6, 3)),
        in_domain="mnli",
        model="opt-125m",
        seed=0,
        shots=32,
    )
    with np.load(path) as npz:
        arrays = {key: npz[key] for key in npz.files if key != schema.label_key("rte")}
    np.savez(path, **arrays)
    assert main([str(tmp_path / "results"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}: not a run's metrics (schema in analysis/schema.py): missing keys ['label/rte']\n"
    )
    assert not (tmp_path / "out").exists()


def test_panels_share_their_ranges(group):
    chance = majority_class_rates(group)
    fitted = figures.accuracy_curves(group, chance=chance, title="t", note="n")
    panels = [ax for ax in fitted.axes if ax.get_visible()]
    assert len({ax.get_ylim() for ax in panels}) == 1
    low, high = panels[0].get_ylim()
    accuracies = np.concatenate([run.accuracy.to_numpy().ravel() for run in group])
    assert low <= accuracies.min() and accuracies.max() <= high  # one range fits every panel
    given = figures.accuracy_curves(group, chance=chance, title="t", note="n", ylim=(0.3, 1.0))
    assert {ax.get_ylim() for ax in given.axes if ax.get_visible()} == {(0.3, 1.0)}
    scatter = figures.ood_vs_in_domain(group, chance=chance, residualiser="spline", probit=False, title="t", note="n")
    panels = [ax for ax in scatter.axes if ax.get_visible()]
    assert len({ax.get_xlim() for ax in panels}) == 1 and len({ax.get_ylim() for ax in panels}) == 1


@pytest.mark.parametrize(
    "padjust, title", [("holm", "marks: Holm-adjusted p-values"), ("none", "marks: unadjusted p-values")]
)
def test_heatmaps_explain_their_marks(group, padjust, title):
    pairs = combine_runs(all_run_pairs(group)).assign(**{SENSITIVE: False})
    testsets = group[0].ood_testsets
    single = figures.correlation_heatmap(pairs, testsets, padjust=padjust, title="t", note="n")
    side_by_side = figures.comparison_heatmaps(
        [("opt-125m", pairs, testsets)], {"opt-125m": group[0].model_info}, padjust=padjust, title="t", note="n"
    )
    for fig in (single, side_by_side):
        (legend,) = fig.legends
        assert legend.get_title().get_text() == title
        assert [text.get_text() for text in legend.get_texts()] == ["* p < 0.05", "** p < 0.01", "*** p < 0.001"]
