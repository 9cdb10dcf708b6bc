"""`python -m analysis` end to end on synthetic results roots in the engine's schema."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import matplotlib.image
import matplotlib.text
import numpy as np
import pandas as pd
import pingouin
import pytest
import scipy.stats
from fixtures_results import (
    MODELS,
    SHIPPED_CONFIGS,
    cut_short,
    write_results_root,
    write_run,
    write_shipped_results_root,
)

from analysis import figures, pairwise_partial_corr, schema, tables
from analysis.aggregate import all_run_pairs, combine_runs, within_seed_tables
from analysis.cli import main
from analysis.meta import ALL_TRAIN_SETS, bootstrap_heterogeneity, random_effects
from analysis.outputs import CSV_NAME, META_CSV_NAME, SENSITIVITY_CSV_NAME, SHOT_COUNTS_CSV_NAME
from analysis.runs import find_runs
from analysis.seeds import clustered_variance, seed_correlation
from analysis.sensitivity import SENSITIVE

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN_SETS = ("mnli", "snli")
SEEDS = (0, 42, 99)
SHOTS = (32, 64)
GROUPS = [(m, t) for m in MODELS for t in TRAIN_SETS]
# Scopes of the meta-analysis across models, as file names have them.
SCOPES = (*TRAIN_SETS, "all-training-sets")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """One run of the CLI as a user would start it, on 2 models x 2 training sets x 6 runs."""
    results = tmp_path_factory.mktemp("results")
    write_results_root(results, models=MODELS, train_sets=TRAIN_SETS, seeds=SEEDS, shots=SHOTS)
    out = tmp_path_factory.mktemp("analysis")
    completed = subprocess.run(
        [sys.executable, "-m", "analysis", str(results), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    return results, out, completed.stdout


def read_accuracy(path: pathlib.Path) -> tuple[pd.DataFrame, str]:
    """A run's accuracies read straight from its npz, independently of analysis.runs."""
    with np.load(path) as npz:
        frame = pd.DataFrame(npz[schema.ACCURACY], columns=list(npz[schema.TESTSETS]))
        return frame, str(npz[schema.IN_DOMAIN])


def test_cli_writes_tables_figures_and_csv_and_lists_them(analysed):
    _, out, stdout = analysed
    listed, closing = stdout.split("\nAssumptions: ")
    written = {pathlib.Path(line.strip()) for line in listed.splitlines()[1:]}
    closing = " ".join(closing.split())
    assert closing.startswith("Run-level p-values are approximate: a run's test uses Bartlett's effective sample size")
    for said in ("(here 3 seed(s) x 2 shot count(s)) are averaged", "runs of one seed", "paired averages", "Welch's"):
        assert said in closing
    # Issue 54: the in-domain reliability, and the findings the correction for its noise leaves standing.
    assert "its reliability after step 0 (1 - mean p(1 - p)/N over its variance) is from 0." in closing
    assert "lower bound where a fixed example set's predictions barely change" in closing
    assert "survive" in closing.split("are named.")[-1]
    assert stdout.startswith(f"analysed {len(GROUPS) * len(SEEDS) * len(SHOTS)} runs")
    figures = {p for p in written if p.parent.name == "figures"}
    tables = {p for p in written if p.parent.name == "tables"}
    # Per group: heatmap, curves, OOD vs in-domain; per training set the models side by
    # side; one figure against model size; forest plots per scope of the meta-analysis; each
    # as pdf + png.
    assert len(figures) == (len(GROUPS) * 3 + len(TRAIN_SETS) + 1 + len(SCOPES)) * 2
    assert {p.name for p in figures if p.name.startswith("forest_")} == {
        f"forest_{scope}.{extension}" for scope in SCOPES for extension in ("pdf", "png")
    }
    assert {p.name for p in tables} == {
        *(f"matrix_{m}_{t}.tex" for m, t in GROUPS),
        "summary.tex",
        "summary_by_shots.tex",
        "tables.tex",
        *(f"meta_analysis_{scope}.tex" for scope in SCOPES),
        "residualiser_sensitivity.tex",
    }
    assert {
        out / CSV_NAME,
        out / "accuracies.csv",
        out / "accuracies.parquet",
        out / META_CSV_NAME,
        out / SENSITIVITY_CSV_NAME,
        out / SHOT_COUNTS_CSV_NAME,
    } <= written
    assert all(path.is_file() for path in written)


def test_tables_compile_with_pdflatex(analysed, tmp_path):
    pdflatex = shutil.which("pdflatex")
    assert pdflatex, "pdflatex is missing: apt-get install texlive-latex-recommended"
    _, out, _ = analysed
    compiled = subprocess.run(
        [pdflatex, "-interaction=nonstopmode", "-halt-on-error", f"-output-directory={tmp_path}", "tables.tex"],
        cwd=out / "tables",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert compiled.returncode == 0, compiled.stdout[-3000:]
    assert "Overfull \\hbox" not in compiled.stdout  # no table wider than the page
    assert (tmp_path / "tables.pdf").read_bytes().startswith(b"%PDF")
    matrix = (out / "tables" / "matrix_opt-125m_mnli.tex").read_text()
    assert r"\toprule" in matrix and r"\bottomrule" in matrix
    assert "ANLI R3" in matrix and "SciTail" in matrix and "anli" not in matrix  # display names
    assert "training set" not in matrix.split(r"\midrule")[1]  # training-set accuracy is not OOD
    meta = (out / "tables" / "meta_analysis_all-training-sets.tex").read_text()
    assert (
        "REML $\\tau^2$" in meta
        and "2 models, each its runs' mean" in meta
        and "averaged over its training sets" in meta
    )
    header, body = meta.split(r"\midrule")[0].splitlines()[-1], meta.split(r"\midrule")[1]
    assert header.startswith(r"Pair & $k$ & \multicolumn{2}{c}{$r$} & 95\% CI & 95\% PI & Trend & $\tau^2$")
    assert header.endswith(r"& Agree & \multicolumn{2}{c}{$r$ (linear)} \\")
    assert "SNLI--SciTail" not in body  # a pair one training set alone defines: not in the primary scope
    assert body.count(r"\\") == 15  # the pairs without mnli or snli
    # Issue 48: the adjusted Welch p is the heterogeneity test; issue 54: Q without a p, trends from intervals;
    # the summary says where claims of differences between models rest; the document opens with the assumptions.
    assert r"$I^2$ & $p^{\mathrm{adj}}_{\mathrm{Welch}}$ & $Q$ & Agree" in header
    assert "never one that is not significant" in meta
    assert "not on these counts" in (out / "tables" / "summary.tex").read_text()
    document = (out / "tables" / "tables.tex").read_text()
    assert r"\paragraph{Assumptions.} Run-level p-values are approximate" in document
    assert "Primary scope (all training sets, 15 pairs, adjusted together)" in document
    assert document.index("Assumptions") < document.index(r"\input{")


def test_the_summary_by_shot_count_is_each_shot_counts_runs_averaged(analysed):
    """tables/summary_by_shots.tex: per model and training set, the mean over pairs of each pair's mean
    Fisher z over the runs of one shot count, computed here from the run rows of the CSV."""
    _, out, _ = analysed
    runs = pd.read_csv(out / CSV_NAME, keep_default_na=False, na_values=[""]).query("level == 'run'")
    runs = runs.assign(pair=[tuple(sorted(xy)) for xy in zip(runs["x"], runs["y"])], z=np.arctanh(runs["r"]))
    pair_z = runs.groupby(["model", "train_set", "shots", "pair"])["z"].mean()
    expected = np.tanh(pair_z.groupby(level=[0, 1, 2]).mean())
    table = (out / "tables" / "summary_by_shots.tex").read_text()
    header, body = table.split(r"\midrule")[0].splitlines()[-1], table.split(r"\midrule")[1]
    assert header == r"Family & Size & Train & All & 32 shots & 64 shots & Shot effect \\"
    shot_tests = pd.read_csv(out / SHOT_COUNTS_CSV_NAME).drop_duplicates(["model", "train_set", "x", "y"])
    for line in body.split(r"\bottomrule")[0].strip().splitlines():
        if line == r"\addlinespace":
            continue
        family, size, train, _, *per_shots = line.removesuffix(r" \\").split(" & ")
        model = {("OPT", "125M"): "opt-125m", ("SmolLM2", "135M"): "SmolLM2-135M"}[family, size]
        for shots, cell in zip(SHOTS, per_shots):
            assert cell == f"${expected[model, train.lower(), shots]:.2f}$"
        found = shot_tests[(shot_tests["model"] == model) & (shot_tests["train_set"] == train.lower())]["shot_p_adj"]
        assert per_shots[-1] == f"{(found < 0.05).sum()}/21"


def marked_cells(latex: str) -> list[tuple[str, str]]:
    """The (number, marks) cells of each body row's r@{}l column pairs; an en dash spanning
    both is left out."""
    spec = re.search(r"\\begin\{tabular\}\{(.*)\}", latex).group(1)
    columns = re.findall(r"r@\{\}l|[lrc]", spec)
    body = latex.split(r"\midrule")[1].split(r"\bottomrule")[0]
    found = []
    for line in body.strip().splitlines():
        cells = line.removesuffix(r" \\").split(" & ")
        for column in columns:
            cell = cells.pop(0)
            if column == "r@{}l" and not cell.startswith(r"\multicolumn{2}"):
                found.append((cell, cells.pop(0)))
        assert not cells, line
    return found


def test_marks_sit_beside_the_numbers_so_that_decimal_points_align(analysed):
    """An r right-aligned in one column and its marks left-aligned in the next: stars and
    daggers never push a number out of line."""
    _, out, _ = analysed
    for name in ("matrix_opt-125m_mnli.tex", "meta_analysis_all-training-sets.tex"):
        cells = marked_cells((out / "tables" / name).read_text())
        numbers = [number for number, _ in cells if number]  # the matrix's upper triangle is empty
        assert len(numbers) == (21 if name.startswith("matrix") else 2 * 15), name
        assert all(re.fullmatch(r"\$-?\d\.\d\d\$", number) for number in numbers), name
        marks = [mark for _, mark in cells if mark]
        assert marks and all(re.fullmatch(r"\$\^\{\**(\\dagger)?\}\$", mark) for mark in marks)


def test_names_without_a_display_name_are_escaped():
    pairs = pd.DataFrame(
        [("hans", "my_set", 0.5, 0.01, "", False, 2)], columns=["x", "y", "r", "p_adj", "reason", SENSITIVE, "n_runs"]
    )
    latex = tables.matrix_table(pairs, ["hans", "my_set"], caption="c", label="l", other_residualiser="linear")
    assert r"my\_set &" in latex and "HANS" in latex


def test_figures_open(analysed):
    _, out, _ = analysed
    for png in sorted((out / "figures").glob("*.png")):
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 300, png
        assert image[..., :3].std() > 0.05, f"{png} is blank"
        assert png.with_suffix(".pdf").read_bytes().startswith(b"%PDF-")


def test_csv_holds_each_run_and_the_combination_of_runs(analysed):
    results, out, _ = analysed
    table = pd.read_csv(out / CSV_NAME, keep_default_na=False, na_values=[""])
    runs = table[table["level"] == "run"]
    groups = table[table["level"] == "group"]
    assert len(runs) == len(GROUPS) * len(SEEDS) * len(SHOTS) * 21  # 7 OOD testsets
    assert len(groups) == len(GROUPS) * 21
    assert not ({"train"} & set(table["x"]) | {"train"} & set(table["y"]))

    assert set(table["residualiser"]) == {"spline"}  # the default

    # Run level: the pairwise partial correlations of that run's steps, tested as a series.
    run = runs[runs["run"] == "SmolLM2-135M_snli_seed42_shots64"]
    accuracy, in_domain = read_accuracy(results / run["run"].iloc[0] / schema.METRICS_FILENAME)
    assert in_domain == "snli"
    ood = [t for t in accuracy.columns if t not in ("snli", "train")]
    expected = pairwise_partial_corr(accuracy, ood, "snli", residualiser="spline", autocorrelation=True)
    np.testing.assert_allclose(run["r"], expected["r"], atol=1e-12, rtol=0)
    np.testing.assert_allclose(run["n_eff"], expected["n_eff"], atol=1e-12, rtol=0)
    assert (run["n_eff"] <= run["n"]).all() and (run["n_eff"] < run["n"]).any()
    np.testing.assert_allclose(run["p_adj"], expected["p_adj"], atol=1e-12, rtol=0)

    # Group level: Fisher-z mean, its variance over runs clustered by seed (the within-seed correlation pooled
    # over every group and pair), t interval and t test on its degrees of freedom, holm over pairs.
    rho = seed_correlation(within_seed_tables(runs))
    for (model, train_set), group in groups.groupby(["model", "train_set"]):
        members = runs[(runs["model"] == model) & (runs["train_set"] == train_set)]
        for pair in group.itertuples():
            chosen = members[(members["x"] == pair.x) & (members["y"] == pair.y)]
            r = chosen["r"].to_numpy()
            assert r.size == len(SEEDS) * len(SHOTS) == pair.n_runs
            z = np.arctanh(r)
            variance, dof = clustered_variance(z, chosen["seed"].to_numpy(), rho)
            t = scipy.stats.t(dof, loc=z.mean(), scale=np.sqrt(variance))
            assert pair.r == pytest.approx(np.tanh(z.mean()), abs=1e-12)
            assert pair.z == pytest.approx(z.mean(), abs=1e-12)
            assert pair.z_se == pytest.approx(np.sqrt(variance), abs=1e-12)
            assert (pair.ci_low, pair.ci_high) == pytest.approx(tuple(np.tanh(t.interval(0.95))), abs=1e-12)
            assert pair.p == pytest.approx(2 * min(t.cdf(0.0), t.sf(0.0)), abs=1e-12)
            assert (pair.n_positive, pair.n_negative) == ((r > 0).sum(), (r < 0).sum())
        np.testing.assert_allclose(
            group["p_adj"],
            pingouin.multicomp(group["p"].to_numpy(), method="holm")[1],
            atol=1e-12,
        )


def test_meta_analysis_combines_the_models_of_the_csv(analysed):
    """Each pooled row of meta_analysis.csv is the random-effects combination of the model
    rows of partial_correlations.csv (their z and z_se), per training set and, over both (the pairs both
    define), each model's runs paired by seed and shots (the same in both training sets) averaged, its
    variance that of a mean of the m paired averages clustered by seed; Welch's p and I^2 from the
    bootstrap of the members' z, z_se and z_dof; Q descriptive (no adjusted p)."""
    _, out, _ = analysed
    table = pd.read_csv(out / CSV_NAME, keep_default_na=False, na_values=[""])
    groups, runs = table[table["level"] == "group"], table[table["level"] == "run"]
    assert runs["r"].notna().all()  # every run pairs with its twin
    meta = pd.read_csv(out / META_CSV_NAME, keep_default_na=False, na_values=[""])
    assert set(meta["estimator"]) == {"reml"} and set(meta["residualiser"]) == {"spline"}
    # Issue 54: the same rows with the in-domain noise corrected, each pooled row its members' combination.
    corrected = meta[meta["in_domain_noise"] == "corrected"]
    assert meta["in_domain_noise"].value_counts().to_dict() == {"ignored": len(corrected), "corrected": len(corrected)}
    for (scope, x, y), members in corrected[corrected["level"] == "model"].groupby(["scope", "x", "y"]):
        if scope != ALL_TRAIN_SETS:
            row = corrected[(corrected["level"] == "pooled") & (corrected["scope"] == scope)]
            row = row[(row["x"] == x) & (row["y"] == y)].iloc[0]
            expected = random_effects(members["z"].to_numpy(), members["z_se"].to_numpy() ** 2)
            assert row["r"] == pytest.approx(np.tanh(expected.mu), abs=1e-9)
    meta = meta[meta["in_domain_noise"] == "ignored"]
    pooled, members = meta[meta["level"] == "pooled"], meta[meta["level"] == "model"]
    assert list(dict.fromkeys(pooled["scope"])) == [*TRAIN_SETS, ALL_TRAIN_SETS]
    assert len(pooled) == 2 * 21 + 15  # over both: the 15 pairs without mnli or snli
    assert pooled["primary"].tolist() == (pooled["scope"] == ALL_TRAIN_SETS).tolist()
    for row in pooled.itertuples():
        scoped = groups if row.scope == ALL_TRAIN_SETS else groups[groups["train_set"] == row.scope]
        pair = scoped[
            ((scoped["x"] == row.x) & (scoped["y"] == row.y)) | ((scoped["x"] == row.y) & (scoped["y"] == row.x))
        ]
        if row.scope == ALL_TRAIN_SETS:
            twins = runs[((runs["x"] == row.x) & (runs["y"] == row.y)) | ((runs["x"] == row.y) & (runs["y"] == row.x))]
            averages = twins.assign(z=np.arctanh(twins["r"])).groupby(["model", "seed", "shots"], sort=False)["z"]
            assert (averages.size() == 2).all()  # both training sets
            per_model = averages.mean().reset_index().groupby("model", sort=False)
            scoped_members = members[(members["scope"] == ALL_TRAIN_SETS) & (members["x"] == row.x)]
            scoped_members = scoped_members[scoped_members["y"] == row.y].set_index("model")
            variances = [
                clustered_variance(model_runs["z"].to_numpy(), model_runs["seed"].to_numpy(), corr)[0]
                for (model, model_runs), corr in zip(per_model, scoped_members["seed_corr"])
            ]
            assert scoped_members["seed_corr"].nunique() == 1  # pooled over models and pairs
            expected = random_effects(per_model["z"].mean().to_numpy(), np.array(variances))
        else:
            expected = random_effects(pair["z"].to_numpy(), pair["z_se"].to_numpy() ** 2)
        assert row.k == len(MODELS) == 2
        assert (row.r, row.ci_low, row.ci_high) == pytest.approx(
            tuple(np.tanh([expected.mu, expected.ci_low, expected.ci_high])), abs=1e-9
        )
        assert (row.tau2, row.q, row.q_p) == pytest.approx((expected.tau2, expected.q, expected.q_p), abs=1e-9)
        in_pair = members[(members["scope"] == row.scope) & (members["x"] == row.x) & (members["y"] == row.y)]
        welch_p, expected_q = bootstrap_heterogeneity(in_pair["z"], in_pair["z_se"] ** 2, in_pair["z_dof"])
        assert (row.welch_p, row.i2) == pytest.approx((welch_p, max(0.0, 1.0 - expected_q / row.q)), abs=1e-9)
        if row.k >= 3:
            assert (row.pi_low, row.pi_high) == pytest.approx(
                tuple(np.tanh([expected.pi_low, expected.pi_high])), abs=1e-9
            )
        else:
            assert np.isnan(row.pi_low) and "no prediction interval" in row.reason
        weights = members[(members["scope"] == row.scope) & (members["x"] == row.x) & (members["y"] == row.y)]["weight"]
        np.testing.assert_allclose(weights, expected.weights, atol=1e-9)
    paired = members.loc[members["scope"] == ALL_TRAIN_SETS, "paired_corr"]
    assert len(paired) == 2 * 15 and paired.between(-1, 1).all()
    assert members.loc[members["scope"] != ALL_TRAIN_SETS, "paired_corr"].isna().all()
    for _, family in pooled.groupby("scope"):
        assert "q_p_adj" not in family
        for column in ("welch_p",):
            expected = pingouin.multicomp(family[column].to_numpy(), method="holm")[1]
            np.testing.assert_allclose(family[f"{column}_adj"], expected, atol=1e-12)


def test_results_that_change_with_the_residualiser_are_marked(analysed):
    """residualiser_sensitivity.csv holds both residualisers' group results; the pairs it
    flags are the pairs daggered in the matrix tables and flagged in partial_correlations.csv."""
    results, out, _ = analysed
    runs = find_runs(results)
    linear = combine_runs(all_run_pairs(runs, residualiser="linear"))
    changes = pd.read_csv(out / SENSITIVITY_CSV_NAME, keep_default_na=False, na_values=[""])
    groups = changes[changes["level"] == "group"]
    table = pd.read_csv(out / CSV_NAME, keep_default_na=False, na_values=[""])
    spline = table[table["level"] == "group"]
    np.testing.assert_allclose(groups["r_linear"], linear["r"], atol=1e-12)
    np.testing.assert_allclose(groups["p_adj_linear"], linear["p_adj"], atol=1e-12)
    np.testing.assert_allclose(groups["r_spline"], spline["r"], atol=1e-12)
    expected = (np.sign(groups["r_linear"]) != np.sign(groups["r_spline"])) | (
        (groups["p_adj_linear"] < 0.05) != (groups["p_adj_spline"] < 0.05)
    )
    assert groups[SENSITIVE].tolist() == expected.tolist() == spline[SENSITIVE].tolist()
    assert expected.any() and not expected.all()
    for (model, train_set), flagged in groups.groupby(["model", "train_set"]):
        matrix = (out / "tables" / f"matrix_{model}_{train_set}.tex").read_text()
        assert matrix.count(r"\dagger") == flagged[SENSITIVE].sum() + 1  # and the note
    assert set(changes.loc[changes["level"] == "pooled", "scope"]) == {*TRAIN_SETS, ALL_TRAIN_SETS}


def test_options_reach_every_run(tmp_path, capsys):
    results = tmp_path / "results"
    write_results_root(
        results,
        models={"opt-350m": "facebook/opt-350m"},
        train_sets=("mnli",),
        seeds=(0, 42),
        shots=(32,),
        steps=np.arange(0, 501, 25),
    )
    options = [
        "--residualiser",
        "linear",
        "--method",
        "spearman",
        "--padjust",
        "fdr_bh",
        "--probit",
        "--differences",
        "--tau2-estimator",
        "dl",
    ]
    assert main([str(results), "--out", str(tmp_path / "out"), *options]) == 0
    assert "wrote" in capsys.readouterr().out
    table = pd.read_csv(tmp_path / "out" / CSV_NAME, keep_default_na=False, na_values=[""])
    run = table[(table["level"] == "run") & (table["seed"] == 42)]
    accuracy, _ = read_accuracy(results / run["run"].iloc[0] / schema.METRICS_FILENAME)
    ood = [t for t in accuracy.columns if t not in ("mnli", "train")]
    expected = pairwise_partial_corr(
        accuracy,
        ood,
        "mnli",
        residualiser="linear",
        method="spearman",
        padjust="fdr_bh",
        probit=True,
        differences=True,
        autocorrelation=True,
    )
    assert (run["n"] == 20).all()  # 21 steps, 20 differences
    np.testing.assert_allclose(run["n_eff"], expected["n_eff"], atol=1e-12, rtol=0)
    np.testing.assert_allclose(run["r"], expected["r"], atol=1e-12, rtol=0)
    np.testing.assert_allclose(run["dof"], expected["dof"], atol=1e-12, rtol=0)
    np.testing.assert_allclose(run["p_adj"], expected["p_adj"], atol=1e-12, rtol=0)
    caption = (tmp_path / "out" / "tables" / "matrix_opt-350m_mnli.tex").read_text()
    assert "Spearman correlation, linear residualiser, probit-transformed" in caption
    # What its daggers compare with, named where there are some; the meta-analysis table's column always names it.
    assert ("spline residualiser" in caption) == (r"\dagger" in caption)
    meta = pd.read_csv(tmp_path / "out" / META_CSV_NAME)
    assert set(meta["estimator"]) == {"dl"} and set(meta["residualiser"]) == {"linear"}
    meta_table = (tmp_path / "out" / "tables" / "meta_analysis_mnli.tex").read_text()
    assert "DerSimonian-Laird $\\tau^2$" in meta_table and "$r$ (spline)" in meta_table
    assert "from 2 runs of 21 evaluation steps: each cell the mean of 2 runs, on the Fisher $z$ scale" in caption
    assert "(Benjamini-Hochberg)" in caption


def test_runs_too_short_for_correlations_give_reasons_not_numbers(tmp_path, capsys):
    """Three evaluation steps (like the demo's) are fewer than k + 4 = 5 points."""
    results = tmp_path / "results"
    write_results_root(
        results,
        models={"opt-tiny": "opt-tiny"},
        train_sets=("mnli",),
        seeds=(0, 42),
        shots=(32,),
        steps=np.arange(0, 51, 25),
    )
    assert main([str(results), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    table = pd.read_csv(tmp_path / "out" / CSV_NAME, keep_default_na=False, na_values=[""])
    assert table["r"].isna().all() and table["p_adj"].isna().all()
    runs, groups = table[table["level"] == "run"], table[table["level"] == "group"]
    assert set(runs["reason"]) == {"too few points: n=3, needs at least k + 4 = 5"}
    assert set(groups["reason"]) == {"undefined in every run: too few points: n=3, needs at least k + 4 = 5"}
    assert (groups["n_runs"] == 0).all()
    matrix = (tmp_path / "out" / "tables" / "matrix_opt-tiny_mnli.tex").read_text()
    body, note = matrix.split(r"\midrule")[1].split(r"\bottomrule")
    assert body.count("--") == 21
    assert "-- undefined in every run: too few points: n=3, needs at least k + 4 = 5." in note
    assert (tmp_path / "out" / "figures" / "heatmap_opt-tiny_mnli.png").is_file()


def good_run(directory: pathlib.Path, **changes) -> pathlib.Path:
    """A run of 6 steps and 3 testsets, its accuracies drawn with its seed (runs that differ, so that a pair
    can be tested across them)."""
    arguments = dict(
        steps=np.arange(6),
        testsets=["mnli", "hans", "rte"],
        accuracy=np.random.default_rng(changes.get("seed", 0)).uniform(size=(6, 3)),
        in_domain="mnli",
        model="opt-125m",
        seed=0,
        shots=32,
    )
    return write_run(directory, **(arguments | changes))


def replace_npz_key(path: pathlib.Path, key: str, value) -> None:
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays[key] = value
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "make_root, message",
    [
        (lambda root: root.mkdir(), r"no metrics\.npz under .*: is it a results root\?"),
        (lambda root: None, "is not a directory"),
        (
            lambda root: np.savez(good_run(root / "run"), weights=np.zeros(3)),
            r"not a run's metrics .*: missing keys \['step', 'testsets', 'accuracy'",
        ),
        (
            lambda root: (
                (root / "run").mkdir(parents=True)
                or (root / "run" / "metrics.npz").write_text("step,accuracy\n0,0.5\n")
            ),
            r"no readable metrics\.npz under .*: all 1 skipped, first .*metrics\.npz: not a "
            "readable npz file",
        ),
        (
            lambda root: good_run(root / "run", in_domain="snli"),
            r"the in-domain testset 'snli' is not among its testsets \['mnli', 'hans', 'rte'\]",
        ),
        (
            lambda root: replace_npz_key(good_run(root / "run"), schema.CONFIG, np.asarray(json.dumps({"model": {}}))),
            r"its config must be JSON with an object 'run' holding 'model', 'seed' and 'shots'",
        ),
        (
            lambda root: replace_npz_key(good_run(root / "run"), schema.ACCURACY, np.zeros((6, 2))),
            r"accuracy has shape \(6, 2\), expected \[steps, testsets\] = \[6, 3\]",
        ),
        (
            lambda root: good_run(root / "run", testsets=["mnli", "hans", "train"]),
            r"OOD testsets \['hans'\]: pairs of OOD testsets need at least two",
        ),
    ],
    ids=[
        "empty",
        "missing",
        "other-schema",
        "not-npz",
        "no-in-domain",
        "no-run-identity",
        "bad-shape",
        "one-ood-testset",
    ],
)
def test_bad_results_roots_get_a_clear_error(tmp_path, capsys, make_root, message):
    root = tmp_path / "results"
    make_root(root)
    assert main([str(root), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("error: ")
    assert re.search(message, error), error
    assert not (tmp_path / "out").exists()


def test_accuracies_an_option_cannot_take_are_an_error_naming_the_run(tmp_path, capsys):
    accuracy = np.random.default_rng(0).uniform(0.5, 0.9, size=(6, 3))
    accuracy[2, 1] = 1.5  # not an accuracy: probit is undefined
    path = good_run(tmp_path / "results" / "run", accuracy=accuracy)
    assert main([str(tmp_path / "results"), "--out", str(tmp_path / "out"), "--probit"]) == 2
    assert capsys.readouterr().err == (f"error: {path}: probit needs accuracies in [0, 1]; column 'hans' has [1.5]\n")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.rglob(".analysis-*"))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The CLI on runs of all 16 shipped configs (names with dots, family and size only in
    the config), 2 runs each."""
    results = tmp_path_factory.mktemp("shipped")
    write_shipped_results_root(results, seeds=(0,), shots=(32, 64), steps=np.arange(0, 151, 25))
    out = tmp_path_factory.mktemp("shipped_analysis")
    return results, out, analyse_and_measure(results, out)


def analyse_and_measure(results: pathlib.Path, out: pathlib.Path) -> dict[str, tuple[float, float]]:
    """Run the CLI; for each figure, as it was saved, `overflow_and_smallest_font`."""
    layouts, save = {}, figures.save

    def save_and_measure(fig, stem):
        paths = save(fig, stem)
        layouts[stem.name] = overflow_and_smallest_font(fig)
        return paths

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(figures, "save", save_and_measure)
        assert main([str(results), "--out", str(out)]) == 0
    return layouts


def overflow_and_smallest_font(fig) -> tuple[float, float]:
    """How far (inches) what a saved figure draws reaches past its edges, where the file cuts
    it off, and the smallest size (points) of the texts it shows."""
    box = fig.get_tightbbox()
    width, height = fig.get_size_inches()
    overflow = max(-box.x0, -box.y0, box.x1 - width, box.y1 - height, 0.0)
    shown = [
        text
        for text in fig.findobj(matplotlib.text.Text)
        if text.get_visible() and text.get_text().strip() and (text.axes is None or text.axes.get_visible())
    ]
    return overflow, min(text.get_fontsize() for text in shown)


def test_no_figure_is_cut_off_and_every_text_is_readable(shipped, tmp_path):
    """Every figure of the 8 shipped models (the biggest grids), and of one model with two OOD
    testsets and a long note (the smallest: a heatmap of one cell), measured as it was saved."""
    _, _, layouts = shipped
    assert len(layouts) == 16 * 3 + 2 + 1 + 3
    for seed in (0, 1, 2):  # three runs whose combined r changes sign with the residualiser: daggers, and their note
        accuracy = np.random.default_rng(68 + seed).uniform(size=(6, 3))
        good_run(tmp_path / "results" / f"run{seed}", seed=seed, accuracy=accuracy)
    smallest_layouts = analyse_and_measure(tmp_path / "results", tmp_path / "out")
    assert (
        r"\dagger$ sign or significance differs"
        in (tmp_path / "out" / "tables" / "matrix_opt-125m_mnli.tex").read_text()
    )
    for name, (overflow, smallest) in (layouts | smallest_layouts).items():
        assert overflow < 0.01, f"{name}: drawn {overflow:.2f} in past its edge"
        assert smallest >= 6, f"{name}: a {smallest} pt text"


def test_every_shipped_model_and_training_set_gets_its_own_files(shipped):
    _, out, _ = shipped
    stems = [path.stem for path in SHIPPED_CONFIGS]  # "opt2.7_mnli", ...
    figures = {path.name for path in (out / "figures").iterdir()}
    for kind in ("heatmap", "curves", "ood_vs_in_domain"):
        for extension in ("pdf", "png"):
            assert {f"{kind}_{stem}.{extension}" for stem in stems} <= figures
    # + side by side per training set, by size, forest plots for mnli, snli and both
    assert len(figures) == (len(stems) * 3 + 2 + 1 + 3) * 2
    tables = {path.name for path in (out / "tables").iterdir()}
    assert {f"matrix_{stem}.tex" for stem in stems} <= tables


def test_summary_orders_families_and_sizes_read_from_the_configs(shipped):
    _, out, _ = shipped
    caption, body = (out / "tables" / "summary.tex").read_text().split(r"\midrule")[:2]
    assert "Pearson correlation, spline residualiser; 32 runs of 7 evaluation steps" in caption
    rows = [line.split(" & ")[:3] for line in body.splitlines() if " & " in line]
    order = [
        ("OLMo 2", "7B"),
        ("OLMo 2", "13B"),
        ("OLMo 2", "32B"),
        ("OPT", "2.7B"),
        ("OPT", "6.7B"),
        ("OPT", "13B"),
        ("OPT", "30B"),
        ("SmolLM3", "3B"),
    ]
    assert rows == [[family, size, train] for family, size in order for train in ("MNLI", "SNLI")]


def test_accuracies_are_written_in_long_form_as_csv_and_parquet(shipped):
    results, out, _ = shipped
    table = pd.read_csv(out / "accuracies.csv")
    assert list(table.columns) == ["run", "model", "train_set", "seed", "shots", "kind", "step", "testset", "accuracy"]
    assert set(table["kind"]) == {"trained"}
    pd.testing.assert_frame_equal(pd.read_parquet(out / "accuracies.parquet"), table, check_dtype=False)
    run = table[table["run"] == "opt2.7_snli_seed0_shots64"]
    assert set(run[["model", "train_set", "seed", "shots"]].itertuples(index=False)) == {("opt2.7", "snli", 0, 64)}
    accuracy, _ = read_accuracy(results / "opt2.7_snli_seed0_shots64" / schema.METRICS_FILENAME)
    expected = accuracy.set_index(np.arange(0, 151, 25)).stack()
    got = run.set_index(["step", "testset"])["accuracy"]
    np.testing.assert_allclose(got.loc[expected.index], expected, rtol=1e-6)
    assert len(table) == len(SHIPPED_CONFIGS) * 2 * 7 * len(accuracy.columns)


def test_hub_ids_as_model_names_get_safe_file_names(tmp_path, capsys):
    results = tmp_path / "results"
    write_results_root(
        results, models={"facebook/opt-125m": "facebook/opt-125m"}, train_sets=("mnli",), seeds=(0, 42), shots=(32,)
    )
    assert main([str(results), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert (tmp_path / "out" / "figures" / "heatmap_facebook-opt-125m_mnli.pdf").is_file()
    assert (tmp_path / "out" / "tables" / "matrix_facebook-opt-125m_mnli.tex").is_file()


@pytest.mark.parametrize(
    "names, message",
    [
        (
            ("facebook/opt-125m", "facebook-opt-125m"),
            r"\('facebook-opt-125m', 'mnli'\) and \('facebook/opt-125m', 'mnli'\) -> "
            r"'facebook-opt-125m_mnli'",
        ),
        (("OPT-125m", "opt-125m"), r"\('OPT-125m', 'mnli'\) and \('opt-125m', 'mnli'\)"),
    ],
    ids=["slash-vs-dash", "case"],
)
def test_names_whose_files_would_collide_are_an_error(tmp_path, capsys, names, message):
    results = tmp_path / "results"
    for index, name in enumerate(names):
        good_run(
            results / f"run{index}", model=name, config={"model": {"path": "facebook/opt-125m"}, "train": {"steps": 5}}
        )
    assert main([str(results), "--out", str(tmp_path / "out")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_one_model_name_for_two_models_is_an_error(tmp_path, capsys):
    results = tmp_path / "results"
    good_run(results / "a", model="opt", config={"model": {"path": "facebook/opt-125m"}})
    good_run(results / "b", model="opt", seed=1, config={"model": {"path": "facebook/opt-1.3b"}})
    assert main([str(results), "--out", str(tmp_path / "out")]) == 2
    assert "model name 'opt' stands for two models" in capsys.readouterr().err


@pytest.mark.parametrize("empty", ["rte", "mnli"], ids=["ood", "in-domain"])
def test_a_column_without_any_accuracy_gives_reasons_and_every_file(tmp_path, capsys, empty):
    """A testset never evaluated (all NaN): NaN rows that say so, a table note, all figures."""
    results = tmp_path / "results"
    testsets = ["mnli", "hans", "rte", "paws"]
    accuracy = np.random.default_rng(0).uniform(0.4, 0.9, size=(8, 4))
    accuracy[:, testsets.index(empty)] = np.nan
    for seed in (0, 1):
        good_run(results / f"run{seed}", steps=np.arange(8), testsets=testsets, accuracy=accuracy, seed=seed)
    assert main([str(results), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    table = pd.read_csv(tmp_path / "out" / CSV_NAME, keep_default_na=False, na_values=[""])
    involved = table[(table["x"] == empty) | (table["y"] == empty) | (empty == "mnli")]
    assert len(involved) == (6 if empty == "mnli" else 4) * 3 // 2  # 2 runs and 1 group
    reason = f"no value in '{empty}': all NaN"
    assert involved["r"].isna().all()
    assert set(involved.loc[involved["level"] == "run", "reason"]) == {reason}
    assert set(involved.loc[involved["level"] == "group", "reason"]) == {f"undefined in every run: {reason}"}
    assert table.drop(involved.index)["r"].notna().all()
    matrix = (tmp_path / "out" / "tables" / "matrix_opt-125m_mnli.tex").read_text()
    # Both runs have the same accuracies: where r is defined (no OOD testset missing), it has no test.
    untested = r" $\circ$ fewer than two runs" if empty != "mnli" else "}"
    assert rf"\footnotesize -- undefined in every run: {reason}.{untested}" in matrix
    summary = (tmp_path / "out" / "tables" / "summary.tex").read_text()
    assert ("no pair of testsets has a partial correlation in any run" in summary) == (empty == "mnli")
    compiled = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", f"-output-directory={tmp_path}", "tables.tex"],
        cwd=tmp_path / "out" / "tables",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert compiled.returncode == 0, compiled.stdout[-3000:]
    for kind in ("heatmap", "curves", "ood_vs_in_domain"):
        assert (tmp_path / "out" / "figures" / f"{kind}_opt-125m_mnli.png").is_file()


def test_the_matrix_note_gives_each_reason_once_and_pairs_never_evaluated():
    empty = "undefined in every run: no value in 'paws': all NaN"
    pairs = pd.DataFrame(
        [
            ("hans", "rte", 0.5, 0.01, "", False, 2),
            ("hans", "paws", np.nan, np.nan, empty, False, 0),
            ("rte", "paws", np.nan, np.nan, empty, False, 0),
        ],
        columns=["x", "y", "r", "p_adj", "reason", SENSITIVE, "n_runs"],
    )  # no run has anli_r3 beside the others
    latex = tables.matrix_table(
        pairs, ["hans", "rte", "paws", "anli_r3"], caption="c", label="l", other_residualiser="linear"
    )
    assert latex.split(r"\midrule")[1].split(r"\bottomrule")[0].count("--") == 5
    assert (
        r"\par\smallskip{\footnotesize -- undefined in every run: no value in 'paws': all "
        "NaN; no run evaluated both testsets.}"
    ) in latex
    assert r"\footnotesize" not in tables.matrix_table(
        pairs[:1], ["hans", "rte"], caption="c", label="l", other_residualiser="linear"
    )
    sensitive = tables.matrix_table(
        pairs[:1].assign(**{SENSITIVE: True}), ["hans", "rte"], caption="c", label="l", other_residualiser="linear"
    )
    assert r"$0.50$ & $^{*\dagger}$" in sensitive
    assert (
        r"{\footnotesize $\dagger$ sign or significance differs under the linear "
        r"residualiser (or $r$ is defined under one only).}"
    ) in sensitive


def two_runs(results: pathlib.Path) -> list[pathlib.Path]:
    """Two runs of one model and training set, enough steps for partial correlations."""
    return [good_run(results / f"job{seed}" / f"run{seed}", seed=seed) for seed in (0, 1)]


def test_flat_runs_near_constant_series_and_capped_r_are_named_and_counted(tmp_path, capsys):
    """Issues 48 and 54: a run whose in-domain accuracy moves less than its binomial noise on the fixtures' 1,000
    examples (reliability after step 0 below 0.5) is named in a warning, counted in the closing lines and in the
    summary's caption, and still analysed; so are a run with a near-constant OOD series (5 of 9 evaluations at
    one value) and one whose r was capped at |r| = 0.999 (two identical OOD series: r = 1), named in its reason
    in partial_correlations.csv too."""
    results = tmp_path / "results"
    two_runs(results)
    accuracy = np.random.default_rng(2).uniform(size=(6, 3))
    accuracy[:, 0] = 0.6 + 0.003 * np.arange(6)  # spans 0.015
    flat = good_run(results / "job2" / "run2", seed=2, accuracy=accuracy)
    stuck_series = [0.5, 0.56, 0.56, 0.56, 0.56, 0.56, 0.62, 0.7, 0.65]
    stuck = good_run(
        results / "job3" / "run3",
        seed=3,
        steps=np.arange(9),
        accuracy=np.column_stack([np.linspace(0.5, 0.9, 9), stuck_series, stuck_series]),
    )
    assert main([str(results), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"warning: {flat}: flat, in-domain reliability 0.00 over 5 evaluations after step 0 (below 0.5: more "
        "binomial noise on 1000 examples than movement); a partial correlation given it measures noise",
        f"warning: {stuck}: near-constant OOD accuracy, 'hans' at 0.560 in 5 of 9 evaluations; 'rte' at 0.560 in 5 "
        "of 9 evaluations; its partial correlations rest on the other evaluations",
        f"warning: {stuck}: r capped at |r| = 0.999 where runs are averaged: hans-rte r=+1.0000 (a degenerate run: "
        "too few residual degrees of freedom, or two identical series)",
    ]
    assert captured.out.startswith(
        f"analysed 4 runs under {results} (1 flat (in-domain accuracy barely moves), 1 with a near-constant OOD "
        "series, 1 with an r capped at |r| = 0.999, see "
    )
    summary = (tmp_path / "out" / "tables" / "summary.tex").read_text()
    assert (
        "1 of 4 runs are flat (in-domain reliability after step 0 below 0.5: more binomial noise than movement): run2."
        in summary
    )
    table = pd.read_csv(tmp_path / "out" / CSV_NAME, keep_default_na=False)
    assert table.loc[table["run"] == "run3", "reason"].tolist() == ["r capped at |r| = 0.999 where runs are averaged"]


def test_unreadable_files_and_identical_copies_are_named_and_skipped(tmp_path, capsys):
    """The rest is analysed; --out, new and nested here, gets the umask's permissions."""
    results, out = tmp_path / "results", tmp_path / "new" / "paper"
    original = two_runs(results)[0]
    killed = cut_short(good_run(results / "job2" / "run2", seed=2))
    shutil.copytree(original.parent, results / "copied" / "run0")
    assert main([str(results), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"warning: {killed}: not a readable npz file (BadZipFile: File is not a zip file); "
        "skipped, its run counts as unfinished",
        f"warning: {original}: a byte-identical copy of {results / 'copied' / 'run0' / 'metrics.npz'}; counted once",
    ]
    assert captured.out.startswith(f"analysed 2 runs under {results} (2 metrics.npz skipped, see the warnings); wrote ")
    table = pd.read_csv(out / CSV_NAME)
    assert set(table["run"].dropna()) == {"run0", "run1"}
    assert table.loc[table["level"] == "group", "n_runs"].eq(2).all()
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_one_run_found_twice_with_different_contents_is_an_error(tmp_path, capsys):
    results = tmp_path / "results"
    original = two_runs(results)[0]
    copy = good_run(
        results / "rerun" / "run0", steps=np.arange(7), accuracy=np.random.default_rng(1).uniform(size=(7, 3))
    )
    assert main([str(results), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error == (
        f"error: run (model 'opt-125m', train set 'mnli', seed 0, 32 shots) found 2 times with "
        f"different contents: {original} (last step 5 of 5), {copy} (last step 6 of 6); keep "
        "one and move the others out of the results root\n"
    )
    assert not (tmp_path / "out").exists()


def snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()
    }


def test_a_failing_analysis_leaves_out_as_it_was(tmp_path, capsys, monkeypatch):
    """Figures fail after the CSVs and tables are written: no trace of this run in --out."""
    results, out = tmp_path / "results", tmp_path / "paper"
    two_runs(results)
    assert main([str(results), "--out", str(out)]) == 0
    (out / "main.tex").write_text("the researcher's own file")
    before = snapshot(out)
    good_run(results / "job2" / "run2", seed=2)  # this analysis would change every file

    def fail_midway(*args, **kwargs):
        staged = list(tmp_path.rglob(".analysis-*.partial/out/tables/matrix_opt-125m_mnli.tex"))
        assert len(staged) == 1, "the failure should come after files were written"
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(figures, "ood_vs_in_domain", fail_midway)
    for target in (out, tmp_path / "new" / "paper"):
        with pytest.raises(RuntimeError, match="drawing failed"):
            main([str(results), "--out", str(target)])
    assert snapshot(out) == before
    assert not (tmp_path / "new").exists()
    assert not list(tmp_path.rglob(".analysis-*"))

    monkeypatch.undo()
    capsys.readouterr()
    assert main([str(results), "--out", str(out)]) == 0
    after = snapshot(out)
    assert after["main.tex"] == before["main.tex"]
    assert set(after) == set(before)
    assert set(pd.read_csv(out / CSV_NAME)["run"].dropna()) == {"run0", "run1", "run2"}
    assert not list(tmp_path.rglob(".analysis-*"))


def test_a_directory_where_an_output_file_goes_is_an_error_before_any_file_moves(tmp_path, capsys):
    results, out = tmp_path / "results", tmp_path / "paper"
    two_runs(results)
    assert main([str(results), "--out", str(out)]) == 0
    blocked = out / "figures" / "curves_opt-125m_mnli.png"
    blocked.unlink()
    blocked.mkdir()
    before = snapshot(out)
    good_run(results / "job2" / "run2", seed=2)
    capsys.readouterr()
    assert main([str(results), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: --out {out}: directories stand where files go: ['{blocked}']\n")
    assert snapshot(out) == before
    assert not list(tmp_path.rglob(".analysis-*"))


@pytest.mark.parametrize(
    "make_out, message",
    [
        (lambda tmp: tmp / "paper.pdf", "--out {tmp}/paper.pdf is a file, not a directory"),
        (
            lambda tmp: tmp / "paper.pdf" / "analysis",
            "--out {tmp}/paper.pdf/analysis: {tmp}/paper.pdf is a file, not a directory",
        ),
        (lambda tmp: (tmp / "paper.pdf").parent, "--out {tmp}: {tmp}/tables is a file, where the tables go"),
    ],
    ids=["out", "parent", "tables"],
)
def test_out_where_a_file_is_is_an_error_before_any_work(tmp_path, capsys, make_out, message):
    """Checked first: the results root does not even exist, and no file changes."""
    (tmp_path / "paper.pdf").write_text("a paper")
    (tmp_path / "tables").write_text("a file named tables")
    before = snapshot(tmp_path)
    assert main([str(tmp_path / "no-results"), "--out", str(make_out(tmp_path))]) == 2
    assert capsys.readouterr().err == f"error: {message.format(tmp=tmp_path)}\n"
    assert snapshot(tmp_path) == before


def test_unfinished_runs_are_named_and_left_out_unless_asked_for(tmp_path, capsys):
    """Issue 41: `python -m analysis.runs`' definition of finished (here: last step 5 of 10)."""
    results = tmp_path / "results"
    two_runs(results)
    stopped = good_run(
        results / "job2" / "run2", seed=2, config={"model": {"path": "opt-125m"}, "train": {"steps": 10}}
    )
    assert main([str(results), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"warning: {stopped}: unfinished, last step 5 of 10; left out (--include-unfinished)"
    ]
    assert captured.out.startswith(f"analysed 2 runs under {results} (1 unfinished left out, see the warnings); ")
    table = pd.read_csv(tmp_path / "out" / CSV_NAME)
    assert set(table["run"].dropna()) == {"run0", "run1"}
    assert set(pd.read_csv(tmp_path / "out" / "accuracies.csv")["run"]) == {"run0", "run1"}
    summary = (tmp_path / "out" / "tables" / "summary.tex").read_text()
    assert "left out, unfinished: run2 (last step 5 of 10)." in summary

    assert main([str(results), "--out", str(tmp_path / "all"), "--include-unfinished"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"warning: {stopped}: unfinished, last step 5 of 10; analysed (--include-unfinished)"
    ]
    assert captured.out.startswith(f"analysed 3 runs under {results}; ")
    assert set(pd.read_csv(tmp_path / "all" / CSV_NAME)["run"].dropna()) == {"run0", "run1", "run2"}
    assert "including, unfinished: run2" in (tmp_path / "all" / "tables" / "summary.tex").read_text()


def test_a_root_of_unfinished_runs_only_is_one_line(tmp_path, capsys):
    results = tmp_path / "results"
    for seed in (0, 1):
        good_run(results / f"run{seed}", seed=seed, config={"model": {"path": "opt-125m"}, "train": {"steps": 50}})
    assert main([str(results), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.splitlines()
    assert error[-1] == (
        f"error: no finished trained run under {results} to correlate across steps: "
        "2 unfinished (--include-unfinished analyses them)"
    )
    assert not (tmp_path / "out").exists()


def test_an_adapter_evaluated_beside_its_trained_runs_is_analysed_with_them(tmp_path, capsys):
    """Issue 44: its accuracies go into accuracies.csv (kind named); one evaluation has no correlation across
    steps, so the trained runs alone make the correlations."""
    results = tmp_path / "results"
    trained = two_runs(results)[0]
    adapter = good_run(results / "eval" / "run0", steps=np.array([0]), accuracy=np.full((1, 3), 0.7))
    replace_npz_key(
        adapter,
        schema.CONFIG,
        np.asarray(
            json.dumps(
                {
                    "model": {"path": "opt-125m"},
                    "run": {"model": "opt-125m", "seed": 0, "shots": 32, "evaluated": "adapter"},
                }
            )
        ),
    )
    assert main([str(results), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith(f"analysed 2 runs under {results} (1 evaluation-only in the accuracies only); ")
    accuracies = pd.read_csv(tmp_path / "out" / "accuracies.csv")
    assert accuracies.groupby("kind")["step"].count().to_dict() == {"evaluated (adapter)": 3, "trained": 36}
    table = pd.read_csv(tmp_path / "out" / CSV_NAME)
    assert set(table["run"].dropna()) == {"run0", "run1"} and trained.parent.name == "run0"
    assert table.loc[table["level"] == "group", "n_runs"].tolist() == [2]


def test_every_cell_says_how_many_runs_it_rests_on_and_whether_it_is_tested(tmp_path, capsys):
    """Issue 41: one of two runs never evaluated PAWS, so PAWS's pairs rest on one run (no test) and the other
    on two; the caption no longer says "mean over 2 runs" of every cell. 12 steps: with 6 the spline's
    residuals have 2 degrees of freedom, so every r is +-1 and two runs of one sign cannot be tested."""
    results = tmp_path / "results"
    testsets, steps = ["mnli", "hans", "rte", "paws"], np.arange(12)
    good_run(results / "run0", steps=steps, testsets=testsets, accuracy=np.random.default_rng(0).uniform(size=(12, 4)))
    accuracy = np.random.default_rng(1).uniform(size=(12, 4))
    accuracy[:, 3] = np.nan
    good_run(results / "run1", seed=1, steps=steps, testsets=testsets, accuracy=accuracy)
    assert main([str(results), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err == ""
    groups = pd.read_csv(tmp_path / "out" / CSV_NAME).query("level == 'group'").set_index(["x", "y"])
    assert groups["n_runs"].to_dict() == {("hans", "rte"): 2, ("hans", "paws"): 1, ("rte", "paws"): 1}
    matrix = (tmp_path / "out" / "tables" / "matrix_opt-125m_mnli.tex").read_text()
    assert "each cell the mean of 1 to 2 runs, its count in parentheses where fewer than 2" in matrix
    body = matrix.split(r"\midrule")[1].split(r"\bottomrule")[0]
    assert body.count(r"$^{\circ}$\,(1)") == 2 and body.count(r"\,(") == 2
    assert r"$\circ$ fewer than two runs with an $r$ (or the same $r$ in each): no test across runs." in matrix
    runs = find_runs(results)
    pairs = combine_runs(all_run_pairs(runs, residualiser="spline")).assign(**{SENSITIVE: False})
    heatmap = figures.correlation_heatmap(pairs, ["hans", "rte", "paws"], padjust="holm", title="t", note="n")
    texts = [text.get_text() for text in heatmap.findobj(matplotlib.text.Text)]
    assert sum(text.endswith("\u00b0(1)") for text in texts) == 2
    assert any("each cell the mean of 1 to 2 runs" in text for text in texts)
    assert any("\u00b0 no test across runs" in text for text in texts)


def test_a_root_where_nothing_can_be_tested_says_so_in_one_line(tmp_path, capsys):
    results = tmp_path / "results"
    good_run(results / "run0")
    assert main([str(results), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "warning: nothing can be tested across runs: no pair of any model and training set has two runs with "
        "different r; tables and figures show r without significance"
    ]
    matrix = (tmp_path / "out" / "tables" / "matrix_opt-125m_mnli.tex").read_text()
    assert "each cell the mean of 1 run, on the Fisher" in matrix and r"$^{\circ}$" in matrix
