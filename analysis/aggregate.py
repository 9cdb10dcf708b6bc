"""From runs to results: each run's pairwise partial correlations, then their combination.

Runs of one model and training set (seeds x shot counts) are replicates, so
their correlations are averaged on the Fisher z scale, each r capped at
|r| <= MAX_ABS_R first: r = tanh(mean z). Runs of one seed are correlated
(they share their LoRA initialisation and dropout keys): the mean's variance
is seeds.clustered_variance of the runs' z with the within-seed correlation
rho pooled over every pair, model and training set (seed_corr, seeds.py),
on its degrees of freedom z_dof (m - 1 when rho is 0 or every seed has one
run); a 95% t interval tanh(mean z +- t_{0.975, z_dof} z_se) and p from the
t test of mean z = 0 on it. The mean z and its standard error are kept (z,
z_se): the model's estimate and the root of its within-model variance in
the meta-analysis across models (meta.py). Runs agree in sign when their r have
the same sign; n_positive and n_negative count them. Adjusted p-values treat
the pairs of one (model, training set) as one family.
"""

import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import scipy.stats

from analysis import schema
from analysis.measurement_error import binomial_variance, simex
from analysis.naming import ModelInfo
from analysis.padjust import adjust_pvalues
from analysis.runs import ResultsError, RunRecord, read_metrics
from analysis.seeds import anova_tables, clustered_variance, seed_correlation
from analysis.stats import CONFIDENCE, PAIR_COLUMNS, pairwise_partial_corr

RUN_ID_COLUMNS = ("model", "train_set", "seed", "shots", "run")
GROUP_COLUMNS = ("model", "train_set")
GROUP_STAT_COLUMNS = (
    "n_runs",
    "r",
    "z",
    "z_se",
    "z_dof",
    "seed_corr",
    "ci_low",
    "ci_high",
    "p",
    "p_adj",
    "n_positive",
    "n_negative",
    "reason",
)
SIGNIFICANCE = 0.05
# The reason of a combined pair that no run defines starts with this, then the runs' reasons.
UNDEFINED_IN_EVERY_RUN = "undefined in every run: "

# A run's r enters a mean capped at |r| <= MAX_ABS_R, |z| <= atanh(0.999) = 3.80: a
# degenerate run (r = +-1, z infinite; a few residual degrees of freedom make it
# easy) then moves a mean of m runs' z by at most (3.80 + |z| of the run it
# replaces) / m, where an uncapped z of 14.2 moved a 9-run mean by 1.6. Chosen over
# leaving out runs with fewer than two residual degrees of freedom: the cap also
# bounds an r of +-1 that has more (two identical accuracy columns), and every
# run stays in the count m.
MAX_ABS_R = 0.999


def run_pairs(run: RunRecord, **options) -> pd.DataFrame:
    """The run's pairwise partial correlations of OOD testsets given in-domain accuracy.

    `options` are those of `pairwise_partial_corr` (method, residualiser,
    padjust, probit, differences); each run's pairs form one family. Its
    evaluation steps are a series, so p and the interval rest on the
    effective sample size of autocorrelated rows (stats module docstring).
    """
    try:
        table = pairwise_partial_corr(run.accuracy, run.ood_testsets, run.in_domain, **options, autocorrelation=True)
    except ValueError as error:  # accuracies the options cannot take, e.g. outside [0, 1]
        raise ResultsError(f"{run.path}: {error}") from error
    identity = {
        "model": run.model,
        "train_set": run.train_set,
        "seed": run.seed,
        "shots": run.shots,
        "run": run.name,
    }
    return table.assign(**identity)[list(RUN_ID_COLUMNS) + list(PAIR_COLUMNS)]


def all_run_pairs(runs: list[RunRecord], **options) -> pd.DataFrame:
    """`run_pairs` of every run, one table."""
    return pd.concat([run_pairs(run, **options) for run in runs], ignore_index=True)


def corrected_run_pairs(run: RunRecord, **options) -> pd.DataFrame:
    """`run_pairs` with each r corrected for the in-domain accuracy's binomial measurement error on the
    run's `in_domain_examples` (`measurement_error.simex` on the Fisher z scale with the run's
    `in_domain_reliability`, left as it is where that is unknown: fewer than 3 evaluations after step 0;
    its draws seeded by the run's identity, so that reruns agree). A run-level test of a SIMEX estimate would
    need its own variance: p and the interval are left out, and only r goes on to `combine_runs`."""
    naive = run_pairs(run, **options)
    in_domain = run.accuracy[run.in_domain].to_numpy(dtype=float)

    def z_given(covariate: np.ndarray) -> np.ndarray:
        remeasured = run.accuracy.assign(**{run.in_domain: covariate})
        return fisher_z(pairwise_partial_corr(remeasured, run.ood_testsets, run.in_domain, **options)["r"].to_numpy())

    identity = f"{run.model}/{run.train_set}/{run.seed}/{run.shots}/{run.kind}".encode()
    z = simex(
        z_given,
        in_domain,
        binomial_variance(in_domain, run.in_domain_examples),
        1.0 if np.isnan(run.in_domain_reliability) else run.in_domain_reliability,
        np.random.default_rng(zlib.crc32(identity)),
    )
    lost = np.isnan(z) & naive["r"].notna().to_numpy()
    return naive.assign(
        r=np.tanh(z),
        ci_low=np.nan,
        ci_high=np.nan,
        p=np.nan,
        p_adj=np.nan,
        reason=naive["reason"].where(~lost, "no SIMEX estimate: undefined under the added in-domain noise"),
    )


def combine_runs(pairs: pd.DataFrame, padjust: str = "holm") -> pd.DataFrame:
    """One row per (model, training set, pair) combining its runs' r (see module docstring)."""
    rho = seed_correlation(within_seed_tables(pairs))
    rows = []
    for (model, train_set), group in pairs.groupby(list(GROUP_COLUMNS), sort=False):
        group = in_first_seen_order(group)
        family = []
        for (x, y), runs in group.groupby(["x", "y"], sort=False):
            family.append(
                {"model": model, "train_set": train_set, "x": x, "y": y, "seed_corr": rho}
                | _combine(runs["r"].to_numpy(), runs["seed"].to_numpy(), runs["reason"], rho)
            )
        family = pd.DataFrame(family)
        family["p_adj"] = adjust_pvalues(family["p"].to_numpy(), padjust)
        rows.append(family)
    combined = pd.concat(rows, ignore_index=True)
    return combined[list(GROUP_COLUMNS) + ["x", "y"] + list(GROUP_STAT_COLUMNS)]


def within_seed_tables(pairs: pd.DataFrame) -> pd.DataFrame:
    """seeds.anova_tables of the runs' z per model, training set and pair (either order of x and y)."""
    ordered = in_first_seen_order(pairs)
    return anova_tables(ordered.assign(z=fisher_z(ordered["r"].to_numpy(dtype=float))), [*GROUP_COLUMNS, "x", "y"])


def summarise_by_model(groups: pd.DataFrame, models: Mapping[str, ModelInfo]) -> pd.DataFrame:
    """Per model family, size and training set: the mean over pairs of the combined r.

    `models` gives each model name's family and size (from its runs'
    configs). The mean over pairs is again taken on the Fisher z scale; mean
    |r| shows the strength when signs cancel; n_sig_positive /
    n_sig_negative count pairs whose adjusted p is below SIGNIFICANCE. Rows
    are ordered by family, then size (numerically, unknown last).
    """
    rows = []
    for (model, train_set), group in groups.groupby(list(GROUP_COLUMNS), sort=False):
        r = group["r"].to_numpy()
        defined = ~np.isnan(r)
        significant = group["p_adj"].to_numpy() < SIGNIFICANCE
        rows.append(
            {
                "family": models[model].family,
                "size": models[model].size_label,
                "size_billions": models[model].size_billions,
                "model": model,
                "train_set": train_set,
                "n_pairs": int(defined.sum()),
                "n_runs": int(group["n_runs"].max()),
                "mean_r": mean_on_z_scale(r[defined]),
                "mean_abs_r": float(np.abs(r[defined]).mean()) if defined.any() else np.nan,
                "n_sig_positive": int((significant & (r > 0)).sum()),
                "n_sig_negative": int((significant & (r < 0)).sum()),
            }
        )
    summary = pd.DataFrame(rows)
    return summary.sort_values(["family", "size_billions", "model", "train_set"]).reset_index(drop=True)


def run_means(pairs: pd.DataFrame) -> pd.DataFrame:
    """Each run's mean r over its pairs (Fisher z scale), beside its model and training set:
    the spread of these across a group's runs is how far one run's answer can be trusted."""
    rows = [
        {"model": model, "train_set": train_set, "run": run, "mean_r": mean_on_z_scale(group["r"].dropna().to_numpy())}
        for (model, train_set, run), group in pairs.groupby([*GROUP_COLUMNS, "run"], sort=False)
    ]
    return pd.DataFrame(rows, columns=[*GROUP_COLUMNS, "run", "mean_r"])


def majority_class_rates(runs: Sequence[RunRecord]) -> dict[str, tuple[float, ...]]:
    """Per testset, the accuracy of always answering its majority class, read from the labels each run stores
    (schema `label/<testset>`): the chance level an accuracy is to be read against, which is 0.5 only on a
    balanced testset (SciTail's test split is 60% one class, PAWS's 56%). Runs that evaluated different examples
    of a testset can disagree: every distinct rate is kept, in increasing order. A testset without examples has
    none. A run without stored labels is a ResultsError naming the missing keys (`read_metrics`)."""
    rates: dict[str, set[float]] = {}
    for run in runs:
        testsets = list(run.accuracy.columns)
        labels = read_metrics(run.path, [schema.label_key(testset) for testset in testsets])
        for testset in testsets:
            _, counts = np.unique(labels[schema.label_key(testset)], return_counts=True)
            found = rates.setdefault(testset, set())
            if counts.size:
                found.add(float(counts.max() / counts.sum()))
    return {testset: tuple(sorted(found)) for testset, found in rates.items()}


def lower_triangle(
    pairs: pd.DataFrame, testsets: list[str], columns: Sequence[str] = ("r", "p_adj")
) -> tuple[np.ndarray, ...]:
    """One matrix per column of one group's pairs (r and p_adj by default): row i is
    testsets[i + 1], column j is testsets[j], filled for j <= i (either order of x and y);
    NaN elsewhere and where missing. Boolean columns become 0 and 1."""
    size = len(testsets) - 1
    matrices = tuple(np.full((size, size), np.nan) for _ in columns)
    position = {name: i for i, name in enumerate(testsets)}
    for x, y, *values in pairs[["x", "y", *columns]].itertuples(index=False):
        i, j = sorted((position[x], position[y]), reverse=True)
        for matrix, value in zip(matrices, values):
            matrix[i - 1, j] = value
    return matrices


def in_first_seen_order(pairs: pd.DataFrame) -> pd.DataFrame:
    """`pairs` with each pair's x and y in the order the table first lists the testsets
    (x before y, first row first), so that (a, b) and (b, a) are one pair; r is symmetric."""
    names = pd.unique(pairs[["x", "y"]].to_numpy().ravel())
    order = {name: i for i, name in enumerate(names)}
    x_first = pairs["x"].map(order) < pairs["y"].map(order)
    return pairs.assign(x=pairs["x"].where(x_first, pairs["y"]), y=pairs["y"].where(x_first, pairs["x"]))


def fisher_z(r: np.ndarray) -> np.ndarray:
    """The Fisher z of runs' correlations, each capped at MAX_ABS_R: how every mean over runs takes them."""
    return np.arctanh(np.clip(r, -MAX_ABS_R, MAX_ABS_R))


def mean_on_z_scale(r: np.ndarray) -> float:
    """tanh of the mean Fisher z of correlations capped at MAX_ABS_R, NaN for none: their average."""
    if r.size == 0:
        return np.nan
    return float(np.tanh(fisher_z(r).mean()))


def _combine(r: np.ndarray, seeds: np.ndarray, reasons: pd.Series, rho: float) -> dict:
    """The combination of one pair's r over runs of `seeds`, runs of one seed correlated at `rho`;
    `reasons` are the runs' reasons for NaN r, repeated in the pair's reason when no run has an r."""
    undefined = reasons[np.isnan(r)].value_counts()
    seeds = seeds[~np.isnan(r)]
    r = r[~np.isnan(r)]
    m = r.size
    result = {
        "n_runs": m,
        "r": np.nan,
        "z": np.nan,
        "z_se": np.nan,
        "z_dof": np.nan,
        "ci_low": np.nan,
        "ci_high": np.nan,
        "p": np.nan,
        "n_positive": int((r > 0).sum()),
        "n_negative": int((r < 0).sum()),
        "reason": "",
    }
    if m == 0:
        return result | {"reason": UNDEFINED_IN_EVERY_RUN + "; ".join(undefined.index)}
    z = fisher_z(r)
    result["z"] = mean = float(z.mean())
    result["r"] = float(np.tanh(mean))
    if m < 2:
        return result | {"reason": "one run: no interval across runs"}
    variance, dof = clustered_variance(z, seeds, rho)
    result["z_se"] = se = float(np.sqrt(variance))
    result["z_dof"] = dof
    if se == 0:
        return result | {"reason": "identical r in every run: no interval across runs"}
    half_width = scipy.stats.t.ppf(0.5 + CONFIDENCE / 2, dof) * se
    result["ci_low"] = float(np.tanh(mean - half_width))
    result["ci_high"] = float(np.tanh(mean + half_width))
    result["p"] = float(2.0 * scipy.stats.t.sf(abs(mean) / se, dof))
    return result
