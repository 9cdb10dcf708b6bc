"""What `python -m analysis` writes: the CSVs, the LaTeX tables and the figures of a selection of runs.

Every result is computed under both residualisers: the chosen one
(--residualiser) is reported, and what changes under the other is marked
and counted (analysis/sensitivity.py), since the choice can decide a
headline. The per-model results are combined across models by a
random-effects meta-analysis (analysis/meta.py), the study's answer to
whether a pair's partial correlation holds across models; it is repeated
with each run's in-domain accuracy's measurement error corrected
(analysis/measurement_error.py), and the findings that do not survive are
named.
"""

import argparse
import pathlib
import sys
from typing import NamedTuple

import numpy as np
import pandas as pd
from tqdm import tqdm

from analysis import figures, forest, tables
from analysis.aggregate import (
    GROUP_COLUMNS,
    MAX_ABS_R,
    RUN_ID_COLUMNS,
    all_run_pairs,
    combine_runs,
    corrected_run_pairs,
    majority_class_rates,
    run_means,
    summarise_by_model,
)
from analysis.measurement_error import not_surviving
from analysis.meta import ALL_TRAIN_SETS, ESTIMATOR_NAMES, meta_analyse, trend_summary
from analysis.naming import ModelInfo, display_name, slug, unique_stems
from analysis.residualise import RESIDUALISERS
from analysis.runs import FLAT_MAX_RELIABILITY, ResultsError, RunRecord, accuracy_table
from analysis.sensitivity import SENSITIVE, by_shot_count, compare_residualisers, shot_counts, summarise_changes

CSV_NAME = "partial_correlations.csv"
META_CSV_NAME = "meta_analysis.csv"
SENSITIVITY_CSV_NAME = "residualiser_sensitivity.csv"
SHOT_COUNTS_CSV_NAME = "shot_counts.csv"
TABLE_DIR = "tables"
FIGURE_DIR = "figures"
# accuracies.csv and accuracies.parquet: every accuracy of every run, long form.
ACCURACIES_NAME = "accuracies"
# More (model, training set) groups than this show a progress bar while their
# figures are drawn (a few seconds each).
PROGRESS_MIN_GROUPS = 8
# One row per pair, for every run (level "run") and every model and training
# set combining its runs (level "group"); columns not used at a level are empty.
# n_eff: the effective sample size of a run's autocorrelated steps its p rests on; in_domain_reliability:
# the run's (RunRecord.in_domain_reliability).
CSV_COLUMNS = (
    *"level residualiser model train_set seed shots run x y n n_eff n_runs r ci_low ci_high p p_adj dof".split(),
    "in_domain_reliability",
    *"n_positive n_negative z z_se".split(),
    SENSITIVE,
    "reason",
)
# One row per pair and scope of the meta-analysis (level "pooled") and per member of it
# (level "model"), under the chosen residualiser and tau^2 estimator, with the in-domain accuracy's
# measurement error ignored and corrected (in_domain_noise: IN_DOMAIN_NOISE).
IN_DOMAIN_NOISE = ("ignored", "corrected")
META_CSV_COLUMNS = (
    *"level residualiser estimator in_domain_noise scope model train_set x y k n_runs r ci_low ci_high p".split(),
    *"p_adj pi_low pi_high tau2 i2 q welch_p welch_p_adj q_p n_agree trend trend_new_model primary".split(),
    *"n_left_out z z_se z_dof paired_corr seed_corr weight".split(),
    SENSITIVE,
    "reason",
)
# How the meta-analysis over every training set pools a model's training sets (analysis/meta.py).
PAIRED_NOTE = (
    ", averaged over its training sets (its variance from the averages of runs paired by seed and "
    "shot count where the training sets share them)"
)
GROUP_KEYS = [*GROUP_COLUMNS, "x", "y"]
POOLED_KEYS = ["scope", "x", "y"]


class Selection(NamedTuple):
    """The runs of a results root as the analysis takes them."""

    analysed: list[RunRecord]  # trained runs whose correlations are computed
    unfinished: list[RunRecord]  # trained runs short of their last step: left out, or in `analysed` when asked
    evaluated: list[RunRecord]  # evaluation-only runs: in the accuracies, not in the correlations


def select_runs(runs: list[RunRecord], *, include_unfinished: bool) -> Selection:
    """Split `runs` by kind and by `RunRecord.finished` (the definition `python -m analysis.runs` uses)."""
    trained = [run for run in runs if run.evaluated is None]
    unfinished = [run for run in trained if not run.finished]
    analysed = trained if include_unfinished else [run for run in trained if run.finished]
    return Selection(analysed, unfinished, [run for run in runs if run.evaluated is not None])


def assumptions(runs: list[RunRecord]) -> str:
    """What the results rest on beyond the data, in words (no LaTeX specials): the paragraph that
    closes the command's output and opens tables/tables.tex."""
    seeds, shots = len({run.seed for run in runs}), len({run.shots for run in runs})
    return (
        "Run-level p-values are approximate: a run's test uses Bartlett's effective sample size, the "
        "smaller of its AR(1) form and its sum over the first n/5 lags of the residuals' autocorrelations. "
        "The runs of a model and training set (here "
        f"{seeds} seed(s) x {shots} shot count(s)) are averaged on the Fisher z scale, runs of one seed "
        "correlated (they start alike): the mean's variance allows for the within-seed correlation, pooled "
        "over pairs and models (seed_corr in meta_analysis.csv); shot_counts.csv tests the shot effect per "
        "pair. Over every training set, a model's training sets are averaged; where their runs are "
        "paired by seed and shot count, the variance comes from the paired averages, otherwise from the "
        "training sets' variances as independent. Welch's test of equal models takes its p from a "
        "parametric bootstrap, adjusted across the pairs of a scope; Cochran's Q is descriptive. The primary "
        "scope is every training set together, over the pairs every training set defines. "
        f"{_reliability_sentence(runs)}"
    )


def _reliability_sentence(runs: list[RunRecord]) -> str:
    """The in-domain covariate's reliability over `runs`, and what it means for the results, in words."""
    known = sorted(run.in_domain_reliability for run in runs if not np.isnan(run.in_domain_reliability))
    spread = f"from {known[0]:.2f} to {known[-1]:.2f}, median {np.median(known):.2f}" if known else "not known"
    return (
        "In-domain accuracy is measured with binomial noise: its reliability after step 0 (1 - mean p(1 - p)/N "
        f"over its variance) is {spread} over the runs; it is a lower bound where a fixed example set's "
        "predictions barely change between evaluations (the binomial variance then overstates the noise). "
        "Its noise biases each partial covariance by the product of the two OOD slopes on in-domain accuracy "
        "times (1 - reliability), so the meta-analysis is repeated with it corrected (SIMEX, its extrapolant's "
        "pole set by each run's reliability) and the findings that do not survive are named."
    )


class Written(NamedTuple):
    """What `write_analysis` wrote and found."""

    paths: list[pathlib.Path]
    testable: bool  # whether any pair of any model and training set could be tested across runs
    capped: list[str]  # warning lines: runs whose r was capped at |r| = MAX_ABS_R
    not_surviving: list[str]  # closing lines: findings that do not survive the in-domain noise's correction


def write_analysis(selection: Selection, args: argparse.Namespace, directory: pathlib.Path) -> Written:
    """Compute everything, write it under `directory`, and return what was written and found (`Written`).

    File names are checked for collisions before anything is written, so a
    clash is an error, never one model's figure overwriting another's.
    """
    runs = selection.analysed
    groups = _groups(runs)
    try:
        stems = unique_stems(groups)
    except ValueError as error:
        raise ResultsError(f"{error}; give the models distinct config.model.name values") from error
    models = {run.model: run.model_info for run in runs}
    options = {
        "method": args.method,
        "residualiser": args.residualiser,
        "padjust": args.padjust,
        "probit": args.probit,
        "differences": args.differences,
    }
    other = _other_residualiser(args.residualiser)
    results = {
        name: _analyse(runs, options | {"residualiser": name}, models, args.tau2_estimator) for name in RESIDUALISERS
    }
    per_run, per_group, pooled, members = results[args.residualiser]
    group_changes = compare_residualisers({name: result.per_group for name, result in results.items()}, GROUP_KEYS)
    pooled_changes = compare_residualisers({name: result.pooled for name, result in results.items()}, POOLED_KEYS)
    per_group = per_group.merge(group_changes[[*GROUP_KEYS, SENSITIVE]], on=GROUP_KEYS, how="left")
    per_run = per_run.merge(_reliabilities(runs), on=list(RUN_ID_COLUMNS), how="left")
    per_run["reason"] = per_run["reason"].mask(
        per_run["r"].abs() > MAX_ABS_R, f"r capped at |r| = {MAX_ABS_R} where runs are averaged"
    )
    corrected = _analyse(runs, options, models, args.tau2_estimator, corrected=True)
    lost = not_surviving(pooled, corrected.pooled)
    pooled = pooled.merge(
        pooled_changes.drop(columns=[f"r_{args.residualiser}", f"p_adj_{args.residualiser}"]),
        on=POOLED_KEYS,
        how="left",
    )
    table_dir, figure_dir = directory / TABLE_DIR, directory / FIGURE_DIR
    table_dir.mkdir()
    figure_dir.mkdir()

    written = _write_csvs(
        directory,
        runs + selection.evaluated,
        per_run,
        per_group,
        {"ignored": (pooled, members), "corrected": (corrected.pooled, corrected.members)},
        group_changes,
        pooled_changes,
        args,
    )
    description = _describe(options)
    padjust = tables.latex_escape(display_name(args.padjust))
    table_files = []
    progress = tqdm(
        groups.items(), desc="writing groups", unit="group", file=sys.stderr, disable=len(groups) <= PROGRESS_MIN_GROUPS
    )
    for (model, train_set), group_runs in progress:
        name = stems[model, train_set]
        pairs = _group_pairs(per_group, model, train_set)
        testsets = _ood_testsets(group_runs)
        described_model = f"{model} ({models[model].description})"
        shown_train_set = display_name(train_set)
        caption = (
            f"Partial correlations of OOD accuracies given {tables.latex_escape(shown_train_set)} "
            f"accuracy, {tables.latex_escape(described_model)} trained on "
            f"{tables.latex_escape(shown_train_set)}, from {_extent(group_runs)}: "
            f"{tables.runs_per_cell(pairs)[0]}, on the Fisher $z$ scale; {description}. "
            f"{tables.SIGNIFICANCE_NOTE} ({padjust}), t test across runs."
        )
        table_files.append(table_dir / f"matrix_{name}.tex")
        table_files[-1].write_text(
            tables.matrix_table(pairs, testsets, caption=caption, label=f"tab:pcorr-{name}", other_residualiser=other)
        )
        title = f"{described_model}, trained on {shown_train_set}"
        note = f"{description}; {_extent(group_runs)}"
        written += _write_figures(group_runs, pairs, testsets, figure_dir, name, title, note, args, other)

    summary = summarise_by_model(per_group, models)
    for train_set in dict.fromkeys(run.train_set for run in runs):
        note = f"{description}; {_extent([r for r in runs if r.train_set == train_set])}"
        side_by_side = [
            (model, _group_pairs(per_group, model, train_set), _ood_testsets(group_runs))
            for (model, group_train_set), group_runs in groups.items()
            if group_train_set == train_set
        ]
        figure = figures.comparison_heatmaps(
            side_by_side,
            models,
            padjust=args.padjust,
            title=f"Partial correlations, trained on {display_name(train_set)}",
            note=note,
        )
        written += figures.save(figure, figure_dir / f"comparison_heatmaps_{slug(train_set)}")
    by_size = figures.correlation_by_size(
        summary,
        run_means(per_run),
        title="Mean partial correlation by model size",
        note=f"{description}; {_extent(runs)}",
    )
    if by_size is not None:
        written += figures.save(by_size, figure_dir / "correlation_by_size")

    table_files.append(table_dir / "summary.tex")
    table_files[-1].write_text(
        tables.summary_table(
            summary,
            caption=(
                "Mean partial correlation over OOD testset pairs (Fisher $z$ scale) by model "
                f"family, size and training set; {description}; {_extent(runs)}"
                f"{tables.latex_escape(_unfinished_note(selection, args.include_unfinished))}. "
                f"Sig.\\ $+/-$: pairs with positive / negative $r$ and adjusted $p<0.05$ "
                f"({padjust}). {tables.COUNTS_ARE_NOT_COMPARISONS}{_flat_note(runs)}"
            ),
            label="tab:pcorr-summary",
        )
    )
    table_files.append(table_dir / "summary_by_shots.tex")
    table_files[-1].write_text(
        tables.shots_table(
            summary,
            by_shot_count(per_run),
            shot_counts(per_run, args.padjust),
            caption=(
                "Mean partial correlation over OOD testset pairs (Fisher $z$ scale) over every run (All, as in "
                f"Table~\\ref{{tab:pcorr-summary}}) and per shot count, each pair's $r$ the mean over that shot "
                f"count's runs, which shows whether the shot count moves the mean; Shot effect: pairs whose "
                f"within-model test of the shot count (seeds x shots analysis of variance, {padjust} over pairs) "
                f"has adjusted $p<0.05$, of those tested, since an effect that flips between pairs cancels in "
                f"the mean (each pair in shot\\_counts.csv); {description}; {_extent(runs)}."
            ),
            label="tab:pcorr-summary-shots",
        )
    )
    meta_tables, meta_figures = _write_meta_analysis(
        pooled, members, lost, models, runs, args, description, table_dir, figure_dir
    )
    table_files += meta_tables
    written += meta_figures
    table_files.append(table_dir / "residualiser_sensitivity.tex")
    table_files[-1].write_text(
        _sensitivity_table(
            group_changes, pooled_changes, models, runs, args, _describe(options | {"residualiser": None})
        )
    )
    document = table_dir / "tables.tex"
    document.write_text(
        tables.standalone_document(
            [p.name for p in table_files], tables.latex_escape(" ".join([assumptions(runs), trend_summary(pooled)]))
        )
    )
    return Written(
        written + table_files + [document],
        bool(per_group["p"].notna().any()),
        _capped_warnings(runs, per_run),
        [f"{scope}: {_findings(found)}" for scope, found in lost.groupby("scope", sort=False)],
    )


class Results(NamedTuple):
    """Everything computed under one residualiser."""

    per_run: pd.DataFrame  # each run's pairs
    per_group: pd.DataFrame  # their combination per model and training set
    pooled: pd.DataFrame  # the meta-analysis across models, per pair and scope
    members: pd.DataFrame  # the models in it


def _analyse(
    runs: list[RunRecord], options: dict, models: dict[str, ModelInfo], estimator: str, *, corrected: bool = False
) -> Results:
    """The analysis under `options`; `corrected`: each run's r corrected for its in-domain accuracy's
    measurement error (`aggregate.corrected_run_pairs`)."""
    if corrected:
        per_run = pd.concat([corrected_run_pairs(run, **options) for run in runs], ignore_index=True)
    else:
        per_run = all_run_pairs(runs, **options)
    per_group = combine_runs(per_run, padjust=options["padjust"])
    pooled, members = meta_analyse(per_group, models, per_run, estimator=estimator, padjust=options["padjust"])
    return Results(per_run, per_group, pooled, members)


def _write_meta_analysis(
    pooled: pd.DataFrame,
    members: pd.DataFrame,
    lost: pd.DataFrame,
    models: dict[str, ModelInfo],
    runs: list[RunRecord],
    args: argparse.Namespace,
    description: str,
    table_dir: pathlib.Path,
    figure_dir: pathlib.Path,
) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """Per scope (each training set, then all of them): the meta-analysis table and its
    forest plots. Returns the tables and the figures written."""
    other = _other_residualiser(args.residualiser)
    estimator = ESTIMATOR_NAMES[args.tau2_estimator]
    padjust = tables.latex_escape(display_name(args.padjust))
    table_files, figure_files = [], []
    for scope, scoped in pooled.groupby("scope", sort=False):
        scope_members = members[members["scope"] == scope]
        keys = list(dict.fromkeys(zip(scope_members["model"], scope_members["train_set"])))
        everything = scope == ALL_TRAIN_SETS
        scope_runs = [run for run in runs if everything or run.train_set == scope]
        where = "over every training set" if everything else f"trained on {display_name(scope)}"
        name = slug(scope)
        caption = (
            f"Random-effects meta-analysis across models of each OOD pair's partial "
            f"correlation, {tables.latex_escape(where)}: {len(keys)} models, each its runs' mean Fisher $z$ "
            f"with the variance of a mean over its $m$ runs, runs of one seed correlated"
            f"{PAIRED_NOTE if everything else ''}; pooled $r$ with {estimator} $\\tau^2$ "
            f"(Fisher $z$ scale) and HKSJ 95\\% CI; PI: 95\\% prediction interval for a new "
            f"model; Welch's bootstrap $p$ for equal models adjusted over the pairs ({padjust}); "
            f"$I^2$ from $Q$ against its bootstrap expectation under equal models; "
            f"Agree: models whose $r$ has the pooled sign; {description}; "
            f"{_extent(scope_runs)}. {tables.SIGNIFICANCE_NOTE} ({padjust} over pairs). "
            f"{tables.latex_escape(_survival_note(lost[lost['scope'] == scope]))}"
        )
        table_files.append(table_dir / f"meta_analysis_{name}.tex")
        table_files[-1].write_text(
            tables.meta_analysis_table(scoped, other_residualiser=other, caption=caption, label=f"tab:meta-{name}")
        )
        labels = {(model, train_set): models[model].description for model, train_set in keys}
        figure = forest.forest_plots(
            scoped,
            scope_members,
            labels,
            title=f"Partial correlations across models, {where}",
            note=f"{description}, {estimator} tau\u00b2; {_extent(scope_runs)}" + _dagger_note(scoped, other),
        )
        figure_files += figures.save(figure, figure_dir / f"forest_{name}")
    return table_files, figure_files


def _sensitivity_table(
    group_changes: pd.DataFrame,
    pooled_changes: pd.DataFrame,
    models: dict[str, ModelInfo],
    runs: list[RunRecord],
    args: argparse.Namespace,
    description: str,
) -> str:
    """The table of how many pairs change between the residualisers, per model and training
    set and per scope of the meta-analysis."""
    per_group = summarise_changes(group_changes, GROUP_COLUMNS, RESIDUALISERS)
    per_scope = summarise_changes(pooled_changes, ["scope"], RESIDUALISERS).rename(columns={"scope": "train_set"})
    blocks = [
        ([models[model].description for model in per_group["model"]], per_group),
        (["pooled over models"] * len(per_scope), per_scope),
    ]
    caption = (
        f"How much the residualiser decides the results: pairs defined under both "
        f"residualisers, their mean $r$ (Fisher $z$ scale), pairs with positive / negative $r$ "
        f"and adjusted $p<0.05$ ({tables.latex_escape(display_name(args.padjust))}), and the pairs whose "
        f"sign or significance changes, or that are defined under one residualiser only; "
        f"per model and training set, then for the meta-analysis across models. The other "
        f"tables report the {display_name(args.residualiser)} residualiser and mark these pairs with "
        f"${tables.SENSITIVE_MARK}$; {description}; {_extent(runs)}."
    )
    return tables.sensitivity_table(blocks, RESIDUALISERS, caption=caption, label="tab:residualiser-sensitivity")


def _write_accuracies(runs: list[RunRecord], out: pathlib.Path) -> list[pathlib.Path]:
    """Every accuracy in long form, as CSV and as Parquet (typed, fast to load)."""
    accuracies = accuracy_table(runs)
    paths = [out / f"{ACCURACIES_NAME}.csv", out / f"{ACCURACIES_NAME}.parquet"]
    accuracies.to_csv(paths[0], index=False)
    accuracies.to_parquet(paths[1], index=False)
    return paths


def _write_csvs(
    directory: pathlib.Path,
    runs: list[RunRecord],
    per_run: pd.DataFrame,
    per_group: pd.DataFrame,
    meta: dict[str, tuple[pd.DataFrame, pd.DataFrame]],
    group_changes: pd.DataFrame,
    pooled_changes: pd.DataFrame,
    args: argparse.Namespace,
) -> list[pathlib.Path]:
    """The pairs of every run and group, every accuracy of ``runs``, the meta-analysis (``meta``: its pooled
    and model rows with the in-domain noise ignored and corrected), and what changes between the residualisers."""
    pooled, members = (
        pd.concat([frames[level].assign(in_domain_noise=noise) for noise, frames in meta.items()], ignore_index=True)
        for level in (0, 1)
    )
    return [
        _write_levels(
            directory / CSV_NAME,
            {"run": per_run, "group": per_group},
            CSV_COLUMNS,
            ("seed", "shots", "n", "n_runs", "n_positive", "n_negative"),
            residualiser=args.residualiser,
        ),
        *_write_accuracies(runs, directory),
        _write_levels(
            directory / META_CSV_NAME,
            {"pooled": pooled, "model": members},
            META_CSV_COLUMNS,
            ("k", "n_runs", "n_agree", "n_left_out"),
            residualiser=args.residualiser,
            estimator=args.tau2_estimator,
        ),
        _write_levels(directory / SENSITIVITY_CSV_NAME, {"group": group_changes, "pooled": pooled_changes}),
        _write_levels(
            directory / SHOT_COUNTS_CSV_NAME,
            {"shots": shot_counts(per_run, args.padjust)},
            counts=("shots", "n_runs"),
            residualiser=args.residualiser,
        ),
    ]


def _write_levels(
    path: pathlib.Path,
    levels: dict[str, pd.DataFrame],
    columns: tuple[str, ...] = (),
    counts: tuple[str, ...] = (),
    **same: str,
) -> pathlib.Path:
    """The frames stacked into one CSV, each row's ``level`` the key of its frame and the ``same`` columns
    constant; ``counts`` as nullable integers; ``columns`` in order (default: level, then the frames' own)."""
    tidy = pd.concat([frame.assign(level=level) for level, frame in levels.items()], ignore_index=True).assign(**same)
    tidy = tidy.astype({column: "Int64" for column in counts})
    tidy[list(columns) or ["level", *tidy.columns.drop("level")]].to_csv(path, index=False)
    return path


def _write_figures(
    group_runs: list[RunRecord],
    pairs: pd.DataFrame,
    testsets: list[str],
    directory: pathlib.Path,
    name: str,
    title: str,
    note: str,
    args: argparse.Namespace,
    other: str,
) -> list[pathlib.Path]:
    heatmap = figures.correlation_heatmap(
        pairs, testsets, padjust=args.padjust, title=title, note=note + _dagger_note(pairs, other)
    )
    chance = majority_class_rates(group_runs)
    curves = figures.accuracy_curves(group_runs, chance=chance, title=title, note=note, ylim=args.curves_ylim)
    scatter = figures.ood_vs_in_domain(
        group_runs,
        chance=chance,
        residualiser=args.residualiser,
        probit=args.probit,
        title=title,
        note=note,
    )
    return [
        *figures.save(heatmap, directory / f"heatmap_{name}"),
        *figures.save(curves, directory / f"curves_{name}"),
        *figures.save(scatter, directory / f"ood_vs_in_domain_{name}"),
    ]


def _group_pairs(per_group: pd.DataFrame, model: str, train_set: str) -> pd.DataFrame:
    return per_group[(per_group["model"] == model) & (per_group["train_set"] == train_set)]


def _ood_testsets(group_runs: list[RunRecord]) -> list[str]:
    return list(dict.fromkeys(t for run in group_runs for t in run.ood_testsets))


def _extent(runs: list[RunRecord]) -> str:
    """How many runs and evaluation steps a result rests on, for captions and figure notes."""
    steps = sorted({len(run.steps) for run in runs})
    counted = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]} to {steps[-1]}"
    return f"{len(runs)} runs of {counted} evaluation steps"


def _unfinished_note(selection: Selection, included: bool) -> str:
    """The unfinished runs by name, for the summary table's caption; empty when there are none."""
    if not selection.unfinished:
        return ""
    names = ", ".join(f"{run.name} ({run.progress})" for run in selection.unfinished)
    return f"; {'including' if included else 'left out'}, unfinished: {names}"


def _flat_note(runs: list[RunRecord]) -> str:
    """How many runs are flat (`RunRecord.flat`), for the summary table's caption; empty when none is."""
    flat = [run for run in runs if run.flat]
    if not flat:
        return ""
    names = tables.latex_escape(", ".join(run.name for run in flat))
    return (
        f" {len(flat)} of {len(runs)} runs are flat (in-domain reliability after step 0 below "
        f"{FLAT_MAX_RELIABILITY}: more binomial noise than movement): {names}."
    )


def _reliabilities(runs: list[RunRecord]) -> pd.DataFrame:
    """Each run's identity (RUN_ID_COLUMNS) and `in_domain_reliability`."""
    return pd.DataFrame(
        [(run.model, run.train_set, run.seed, run.shots, run.name, run.in_domain_reliability) for run in runs],
        columns=[*RUN_ID_COLUMNS, "in_domain_reliability"],
    )


def _capped_warnings(runs: list[RunRecord], per_run: pd.DataFrame) -> list[str]:
    """One warning line per run with a pair whose |r| exceeds MAX_ABS_R, capped where runs are averaged."""
    lines = []
    for run in runs:
        rows = per_run[(per_run["run"] == run.name) & (per_run["model"] == run.model)]
        capped = rows[rows["r"].abs() > MAX_ABS_R]
        if not capped.empty:
            pairs = ", ".join(f"{x}-{y} r={r:+.4f}" for x, y, r in capped[["x", "y", "r"]].itertuples(index=False))
            lines.append(
                f"warning: {run.path}: r capped at |r| = {MAX_ABS_R} where runs are averaged: {pairs} "
                "(a degenerate run: too few residual degrees of freedom, or two identical series)"
            )
    return lines


def _findings(found: pd.DataFrame) -> str:
    """The findings of `measurement_error.not_surviving` in one scope, in words."""
    return "; ".join(
        f"{what} of {', '.join(f'{x}-{y}' for x, y in rows[['x', 'y']].itertuples(index=False))}"
        for what, rows in found.groupby("finding", sort=False)
    )


def _survival_note(lost: pd.DataFrame) -> str:
    """The meta-analysis table's note on the in-domain noise's correction, for one scope."""
    if lost.empty:
        return (
            "Every heterogeneity (Welch) and pooled finding survives the correction for in-domain accuracy's "
            "measurement error (SIMEX, meta_analysis.csv in_domain_noise=corrected)."
        )
    return (
        "Not surviving the correction for in-domain accuracy's measurement error (SIMEX, meta_analysis.csv "
        f"in_domain_noise=corrected): {_findings(lost)}."
    )


def _groups(runs: list[RunRecord]) -> dict[tuple[str, str], list[RunRecord]]:
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for run in runs:
        groups.setdefault((run.model, run.train_set), []).append(run)
    return groups


def _other_residualiser(residualiser: str) -> str:
    return next(name for name in RESIDUALISERS if name != residualiser)


def _dagger_note(results: pd.DataFrame, other: str) -> str:
    """What a figure's daggers mean, when it has any."""
    if not results[SENSITIVE].any():
        return ""
    return f"; {figures.DAGGER} changes sign or significance with the {display_name(other)} residualiser"


def _describe(options: dict) -> str:
    """The options in words (display names); a residualiser of None is left out."""
    parts = [f"{display_name(options['method'])} correlation"]
    if options["residualiser"] is not None:
        parts.append(f"{display_name(options['residualiser'])} residualiser")
    if options["probit"]:
        parts.append("probit-transformed accuracies")
    if options["differences"]:
        parts.append("first differences between steps")
    return ", ".join(parts)
