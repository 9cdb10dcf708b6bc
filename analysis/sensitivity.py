"""Does the residualiser, or the shot count, decide a result? Every result under both residualisers,
and the summary per shot count.

The linear residualiser leaves in both residuals whatever curvature two OOD
accuracies share as functions of in-domain accuracy, which inflates r where
in-domain accuracy saturates; the spline removes it at the cost of degrees
of freedom (docs/analysis.md, "Which residualiser"). Because that choice can
decide a headline, the analysis computes every result under both, reports
the chosen one, and marks the results that change under the other: r
changes sign, the result is significant (adjusted p < SIGNIFICANCE) under
one residualiser only, or it is defined under one only.

The runs of a model and training set (seeds x shot counts) are combined over
shot counts; `by_shot_count` shows the mean r per shot count, so that a reader
sees whether the shot count moves it, and `shot_counts` gives every pair's r
per shot count with its interval across seeds beside a test of the shot
effect within the model: the F test of shots in the seeds x shots analysis
of variance of run z (seeds.anova_tables; seeds a block, so same-seed runs
being alike does not count as a shot effect), adjusted across the pairs of
a model and training set. A mean over pairs (the per-shot table) lets a shot
effect that flips some pairs cancel; this does not.
"""

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import scipy.stats

from analysis.aggregate import GROUP_COLUMNS, SIGNIFICANCE, fisher_z, in_first_seen_order, mean_on_z_scale
from analysis.padjust import adjust_pvalues
from analysis.seeds import anova_tables
from analysis.stats import CONFIDENCE

SHOT_COUNT_COLUMNS = (
    *GROUP_COLUMNS,
    *"x y shots n_runs r ci_low ci_high shot_f shot_dof_error shot_p shot_p_adj".split(),
)

CHANGES = ("sign_changes", "significance_changes", "definition_changes")
# True where any of CHANGES holds: the mark (a dagger) in tables and figures.
SENSITIVE = "residualiser_sensitive"


def compare_residualisers(results: Mapping[str, pd.DataFrame], keys: Sequence[str]) -> pd.DataFrame:
    """One row per result: `keys`, then r_<name> and p_adj_<name> for both residualisers,
    then CHANGES and SENSITIVE.

    `results` maps each of the two residualisers' names to its table, which
    has the columns `keys`, r and p_adj and the same rows as the other's.
    """
    (first, first_table), (second, second_table) = results.items()
    columns = [*keys, "r", "p_adj"]
    merged = first_table[columns].merge(
        second_table[columns],
        on=list(keys),
        how="left",
        validate="one_to_one",
        suffixes=(f"_{first}", f"_{second}"),
    )
    r_first, r_second = merged[f"r_{first}"], merged[f"r_{second}"]
    both = r_first.notna() & r_second.notna()
    significant_first = merged[f"p_adj_{first}"] < SIGNIFICANCE  # NaN compares False
    significant_second = merged[f"p_adj_{second}"] < SIGNIFICANCE
    merged["sign_changes"] = both & (np.sign(r_first) != np.sign(r_second))
    merged["significance_changes"] = both & (significant_first != significant_second)
    merged["definition_changes"] = r_first.notna() != r_second.notna()
    merged[SENSITIVE] = merged[list(CHANGES)].any(axis=1)
    return merged


def summarise_changes(comparison: pd.DataFrame, by: Sequence[str], residualisers: Sequence[str]) -> pd.DataFrame:
    """Per value of `by`: pairs defined under both residualisers, each one's mean r over
    them (Fisher z scale) and significant positive / negative pairs, and how many pairs
    each kind of change touches. Rows keep the order of first appearance."""
    rows = []
    for values, group in comparison.groupby(list(by), sort=False):
        both = group[[f"r_{name}" for name in residualisers]].notna().all(axis=1)
        row = dict(zip(by, values)) | {"n_pairs": int(both.sum())}
        for name in residualisers:
            r = group[f"r_{name}"]
            significant = group[f"p_adj_{name}"] < SIGNIFICANCE
            row[f"mean_r_{name}"] = mean_on_z_scale(r[both].to_numpy())
            row[f"n_sig_positive_{name}"] = int((significant & (r > 0)).sum())
            row[f"n_sig_negative_{name}"] = int((significant & (r < 0)).sum())
        rows.append(row | {change: int(group[change].sum()) for change in CHANGES})
    return pd.DataFrame(rows)


def by_shot_count(per_run: pd.DataFrame) -> pd.DataFrame:
    """Per model, training set and shot count (first-seen order, shot counts increasing): its runs,
    the pairs it defines, and mean_r, the mean over pairs of each pair's r over those runs (both
    means on the Fisher z scale, as summarise_by_model takes them over every run)."""
    keys = [*GROUP_COLUMNS, "shots"]
    defined = in_first_seen_order(per_run.dropna(subset=["r"]))
    pair_r = defined.groupby([*keys, "x", "y"], sort=False)["r"].agg(lambda r: mean_on_z_scale(r.to_numpy()))
    per_shots = pair_r.groupby(level=keys, sort=False).agg(
        n_pairs="size", mean_r=lambda r: mean_on_z_scale(r.to_numpy())
    )
    runs = per_run.groupby(keys, sort=False)["run"].nunique().rename("n_runs")
    table = runs.to_frame().join(per_shots).reset_index()
    table["n_pairs"] = table["n_pairs"].fillna(0).astype(int)
    order = {key: i for i, key in enumerate(dict.fromkeys(zip(per_run["model"], per_run["train_set"])))}
    rank = [order[key] for key in zip(table["model"], table["train_set"])]
    return table.assign(rank=rank).sort_values(["rank", "shots"], kind="stable").drop(columns="rank")


def shot_counts(per_run: pd.DataFrame, padjust: str = "holm") -> pd.DataFrame:
    """Per model, training set, pair and shot count (SHOT_COUNT_COLUMNS): the runs, r = tanh of their
    mean z with its 95% t interval across seeds (NaN with fewer than two), and the pair's test of the
    shot effect (module docstring; NaN where the runs fill no complete seeds x shots table), its p
    adjusted (`padjust`) across the pairs of the model and training set."""
    keys = [*GROUP_COLUMNS, "x", "y"]
    defined = in_first_seen_order(per_run.dropna(subset=["r"]))
    defined = defined.assign(z=fisher_z(defined["r"].to_numpy(dtype=float)))
    cells = defined.groupby([*keys, "shots"], sort=False)["z"].agg(["size", "mean", "std"]).reset_index()
    half_width = scipy.stats.t.ppf(0.5 + CONFIDENCE / 2, cells["size"] - 1) * cells["std"] / np.sqrt(cells["size"])
    cells = cells.assign(
        n_runs=cells["size"],
        r=np.tanh(cells["mean"]),
        ci_low=np.tanh(cells["mean"] - half_width),
        ci_high=np.tanh(cells["mean"] + half_width),
    )
    tables = anova_tables(defined, keys)
    error_dof = (tables["n_seeds"] - 1) * (tables["n_shots"] - 1)
    ratio = (tables["ss_shots"] / (tables["n_shots"] - 1)) / (tables["ss_error"] / error_dof)
    tests = tables[keys].assign(
        shot_f=ratio, shot_dof_error=error_dof, shot_p=scipy.stats.f.sf(ratio, tables["n_shots"] - 1, error_dof)
    )
    tests["shot_p_adj"] = tests.groupby(list(GROUP_COLUMNS), sort=False)["shot_p"].transform(
        lambda p: adjust_pvalues(p.to_numpy(), padjust)
    )
    return cells.merge(tests, on=keys, how="left")[list(SHOT_COUNT_COLUMNS)]
