"""Partial correlations against pingouin and closed forms; undefined rows; bad input."""

import numpy as np
import pandas as pd
import pingouin
import pytest
import scipy.stats
from fixtures_results import BERTS_IN_DOMAIN, berts_of_a_feather

from analysis import pairwise_partial_corr, partial_corr
from analysis.aggregate import combine_runs, mean_on_z_scale
from analysis.padjust import adjust_pvalues
from analysis.stats import PROBIT_CLIP

TOLERANCE = 1e-8
# pingouin rounds the CI95 it returns (to 2 decimals), so intervals are matched
# to TOLERANCE against pingouin.compute_esci, the function pingouin builds its
# CI95 with, unrounded, and to the rounding against the CI95 itself.
PINGOUIN_CI_ROUNDING = 0.005 + 1e-12


def random_frame(seed: int = 0, rows: int = 40, nan_fraction: float = 0.1) -> pd.DataFrame:
    """Correlated columns a..e with NaNs scattered in every column."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(5, 5))
    values = rng.normal(size=(rows, 5)) @ mixing
    values[rng.random(values.shape) < nan_fraction] = np.nan
    return pd.DataFrame(values, columns=list("abcde"))


def pingouin_interval(r: float, n: int, k: int) -> np.ndarray:
    return pingouin.compute_esci(stat=r, nx=n - k, ny=n - k, eftype="r", decimals=15)


@pytest.mark.parametrize("method", ["pearson", "spearman"])
@pytest.mark.parametrize("covar", [["d"], ["d", "e"]])
def test_partial_corr_matches_pingouin(method, covar):
    df = random_frame()
    ours = partial_corr(df["a"], df["b"], df[covar].to_numpy(), method=method)
    theirs = pingouin.partial_corr(data=df, x="a", y="b", covar=covar, method=method)
    assert ours.n == theirs["n"].iloc[0] < len(df)  # NaN rows were dropped
    assert ours.r == pytest.approx(theirs["r"].iloc[0], abs=TOLERANCE)
    assert ours.p == pytest.approx(theirs["p_val"].iloc[0], abs=TOLERANCE)
    interval = pingouin_interval(theirs["r"].iloc[0], ours.n, len(covar))
    np.testing.assert_allclose([ours.ci_low, ours.ci_high], interval, atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose([ours.ci_low, ours.ci_high], theirs["CI95"].iloc[0], atol=PINGOUIN_CI_ROUNDING, rtol=0)
    assert ours.dof == ours.n - len(covar) - 2
    assert ours.reason == ""


@pytest.mark.parametrize("method", ["pearson", "spearman"])
@pytest.mark.parametrize("padjust", ["holm", "fdr_bh"])
def test_pairwise_partial_corr_matches_pingouin(method, padjust):
    df = random_frame(seed=1, rows=50)
    ours = pairwise_partial_corr(df, ["a", "b", "c"], ["d", "e"], method=method, padjust=padjust)
    theirs = pingouin.pairwise_corr(df, columns=["a", "b", "c"], covar=["d", "e"], method=method, padjust=padjust)
    assert list(ours.columns[:8]) == ["x", "y", "n", "r", "ci_low", "ci_high", "p", "p_adj"]
    assert list(zip(ours["x"], ours["y"])) == list(zip(theirs["X"], theirs["Y"]))
    np.testing.assert_array_equal(ours["n"], theirs["n"])
    assert len(set(ours["n"])) > 1  # NaNs were dropped per pair, not listwise
    for column, reference in [("r", "r"), ("p", "p_unc"), ("p_adj", "p_corr")]:
        np.testing.assert_allclose(ours[column], theirs[reference], atol=TOLERANCE, rtol=0)
    for row, their_ci in zip(ours.itertuples(), theirs["CI95"]):
        interval = pingouin_interval(row.r, row.n, 2)
        np.testing.assert_allclose([row.ci_low, row.ci_high], interval, atol=TOLERANCE, rtol=0)
        np.testing.assert_allclose([row.ci_low, row.ci_high], their_ci, atol=PINGOUIN_CI_ROUNDING, rtol=0)


def test_spearman_ranks_the_covariates_too():
    """x and y are monotone but non-linear in z: ranks remove z, values leave its curvature."""
    rng = np.random.default_rng(2)
    z = rng.uniform(0, 3, 200)
    noise = rng.normal(scale=0.05, size=(200, 2))
    x, y = np.exp(2 * z + noise[:, 0]), np.exp(2 * z + noise[:, 1])
    assert abs(partial_corr(x, y, z, method="spearman").r) < 0.2
    assert partial_corr(x, y, z, method="pearson").r > 0.5


def test_first_differences_equal_the_correlation_of_differenced_series():
    df = random_frame(seed=3, rows=30, nan_fraction=0.0)
    df.loc[5, "a"] = np.nan  # a missing step removes the two differences that touch it
    ours = partial_corr(df["a"], df["b"], df["d"], differences=True)
    differenced = df[["a", "b", "d"]].diff().iloc[1:]
    theirs = pingouin.partial_corr(data=differenced, x="a", y="b", covar="d")
    assert ours.n == theirs["n"].iloc[0] == 27
    assert ours.r == pytest.approx(theirs["r"].iloc[0], abs=TOLERANCE)
    assert ours.p == pytest.approx(theirs["p_val"].iloc[0], abs=TOLERANCE)


def test_probit_transforms_accuracies_with_clipping():
    rng = np.random.default_rng(4)
    accuracy = pd.DataFrame(rng.uniform(0.05, 0.95, (30, 3)), columns=["a", "b", "d"])
    accuracy.loc[0, "a"], accuracy.loc[1, "b"] = 1.0, 0.0
    ours = partial_corr(accuracy["a"], accuracy["b"], accuracy["d"], probit=True)
    clipped = accuracy.clip(PROBIT_CLIP, 1 - PROBIT_CLIP)
    theirs = pingouin.partial_corr(data=clipped.apply(scipy.stats.norm.ppf), x="a", y="b", covar="d")
    assert ours.r == pytest.approx(theirs["r"].iloc[0], abs=TOLERANCE)
    with pytest.raises(ValueError, match=r"probit needs accuracies in \[0, 1\]; column 'x'"):
        partial_corr(accuracy["a"] * 2, accuracy["b"], accuracy["d"], probit=True)


def test_undefined_rows_are_nan_with_a_reason():
    rng = np.random.default_rng(5)
    df = pd.DataFrame(rng.normal(size=(12, 4)), columns=["a", "b", "flat", "cov"])
    df["flat"] = 0.5
    df["sparse"] = np.nan
    df.loc[:3, "sparse"] = rng.normal(size=4)  # 4 points < k + 4 = 5
    table = pairwise_partial_corr(df, ["a", "b", "flat", "sparse"], "cov").set_index(["x", "y"])
    assert table.loc[("a", "b"), "reason"] == ""
    assert np.isfinite(table.loc[("a", "b"), ["r", "p", "p_adj", "ci_low"]].astype(float)).all()
    assert table.loc[("a", "flat"), "reason"] == "constant column: 'flat'"
    assert table.loc[("a", "sparse"), "reason"] == "too few points: n=4, needs at least k + 4 = 5"
    assert table.loc[("a", "sparse"), "n"] == 4
    undefined = table[table["reason"] != ""]
    assert len(undefined) == 5
    assert undefined[["r", "ci_low", "ci_high", "p", "p_adj"]].isna().all().all()


def test_variable_explained_by_the_covariate_is_undefined():
    z = np.linspace(0, 1, 20)
    result = partial_corr(3 * z + 1, np.sin(7 * z), z)
    assert np.isnan(result.r) and result.reason == "'x' is fully explained by the covariates"


def test_identical_variables_have_r_one_and_p_zero():
    rng = np.random.default_rng(6)
    x, z = rng.normal(size=(2, 30))
    result = partial_corr(x, x, z)
    assert result.r == pytest.approx(1.0, abs=1e-12) and result.p == 0.0
    assert result.ci_low == pytest.approx(1.0, abs=1e-12)


def test_padjust_leaves_missing_pvalues_out_of_the_family():
    p = np.array([0.01, np.nan, 0.04, 0.03])
    # Closed forms over the three finite p-values (m = 3):
    # holm: sorted 0.01, 0.03, 0.04 -> 3(0.01), max(., 2(0.03)), max(., 1(0.04))
    np.testing.assert_allclose(adjust_pvalues(p, "holm"), [0.03, np.nan, 0.06, 0.06])
    np.testing.assert_allclose(adjust_pvalues(p, "bonferroni"), [0.03, np.nan, 0.12, 0.09])
    # BH: p_(i) m / i = 0.03, 0.045, 0.04, then the running minimum from the top.
    np.testing.assert_allclose(adjust_pvalues(p, "fdr_bh"), [0.03, np.nan, 0.04, 0.04])
    np.testing.assert_allclose(adjust_pvalues(p, "none"), p)
    np.testing.assert_allclose(adjust_pvalues(np.array([0.6, 0.9]), "bonferroni"), [1.0, 1.0])


def test_padjust_in_pairwise_ignores_undefined_pairs():
    df = random_frame(seed=7, rows=40, nan_fraction=0.0)
    with_constant = df.assign(flat=1.0)
    table = pairwise_partial_corr(with_constant, ["a", "b", "c", "flat"], "d")
    defined = table[table["reason"] == ""]
    assert len(defined) == 3 and table["p_adj"].isna().sum() == 3
    expected = pairwise_partial_corr(df, ["a", "b", "c"], "d")
    np.testing.assert_allclose(defined["p_adj"], expected["p_adj"], rtol=1e-12)
    np.testing.assert_allclose(defined["p_adj"], pingouin.multicomp(defined["p"].to_numpy(), method="holm")[1])


def test_berts_of_a_feather_table_goes_through_unchanged(shared_data):
    """Real data as read: a text column, empty trailing rows, two HANS subcases at 100%.

    Only the file's four summary rows (min, max, mean, sd) are removed: they
    are not runs.
    """
    df = berts_of_a_feather(shared_data)
    ours = pairwise_partial_corr(df, None, BERTS_IN_DOMAIN)
    heuristics = [c for c in df.columns if c not in ("Run", BERTS_IN_DOMAIN)]
    assert len(ours) == len(heuristics) * (len(heuristics) - 1) // 2
    assert (ours["n"] == 100).all()
    constant = ours[ours["reason"] != ""]
    assert set(constant["reason"]) == {
        "constant column: 'ce_conjunction'",
        "constant column: 'ce_adverb'",
        "constant column: 'ce_conjunction', 'ce_adverb'",
    }
    assert constant[["r", "p", "p_adj"]].isna().all().all()
    # pingouin on the eight summary columns and the two constant ones (it drops those).
    columns = heuristics[:7] + ["ce_conjunction", "ce_adverb"]
    ours = pairwise_partial_corr(df, columns, BERTS_IN_DOMAIN)
    theirs = pingouin.pairwise_corr(df, columns=columns, covar=BERTS_IN_DOMAIN, padjust="holm")
    merged = ours.merge(theirs, left_on=["x", "y"], right_on=["X", "Y"])
    assert len(merged) == len(theirs) == 21 and ours["p_adj"].notna().sum() == 21
    np.testing.assert_allclose(merged["r_x"], merged["r_y"], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(merged["p"], merged["p_unc"], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(merged["p_adj"], merged["p_corr"], atol=TOLERANCE, rtol=0)
    subset = ["Lexical (nonent)", "Subseq (nonent)", "Constituent (nonent)"]
    spline = pairwise_partial_corr(df, subset, BERTS_IN_DOMAIN, residualiser="spline")
    assert spline["r"].notna().all() and (spline["dof"] <= spline["n"] - 3).all()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda df: pairwise_partial_corr(df, ["a", "zz"], "d"), r"not in the DataFrame: \['zz'\]"),
        (lambda df: pairwise_partial_corr(df.assign(s="x"), ["a", "s"], "d"), r"not numeric: \['s'\]"),
        (lambda df: pairwise_partial_corr(df, ["a", "b"], "d", method="kendall"), "method must be one of"),
        (lambda df: pairwise_partial_corr(df, ["a", "b"], "d", padjust="sidak"), "padjust must be one of"),
        (lambda df: pairwise_partial_corr(df, ["a", "b"], "d", residualiser="loess"), "residualiser must be one of"),
        (lambda df: pairwise_partial_corr(df, ["a", "b"], ["d", "e"], residualiser="spline"), "exactly one covariate"),
        (lambda df: pairwise_partial_corr(df, ["a", "d"], "d"), "at least two columns besides the covariates"),
        (
            lambda df: pairwise_partial_corr(df.replace(df.iloc[0, 0], np.inf), ["a", "b"], "d"),
            r"infinite values in \['a'\]",
        ),
        (lambda df: partial_corr(df["a"], df["b"][:-1], df["d"]), "same length"),
        (lambda df: pairwise_partial_corr(df.to_numpy(), ["a", "b"], "d"), "must be a pandas DataFrame"),
    ],
)
def test_bad_input_gets_a_clear_error(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(random_frame(seed=8, nan_fraction=0.0))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_degenerate_run_moves_its_cells_mean_z_by_a_bounded_amount(sign):
    """One run of nine at r = +-1 (z infinite) enters the cell's mean as atanh(0.999) = ln(1999) / 2: the mean z moves
    by that over 9 from where the same run at r = 0 leaves it (uncapped, 14.2 / 9 = 1.6)."""
    z = np.array([0.1, -0.2, 0.3, 0.05, 0.4, -0.1, 0.2, 0.15])

    def cell_mean_z(degenerate_r: float) -> float:
        pairs = pd.DataFrame(
            {"model": "m", "train_set": "t", "seed": range(9), "shots": 32, "x": "a", "y": "b"}
            | {"r": [*np.tanh(z), degenerate_r], "reason": ""}
        )
        return float(combine_runs(pairs)["z"].iloc[0])

    assert cell_mean_z(0.0) == pytest.approx(z.sum() / 9, abs=1e-12)
    moved = cell_mean_z(sign) - cell_mean_z(0.0)
    assert moved == pytest.approx(sign * np.log(1999.0) / 2 / 9, abs=1e-12)  # 0.42
    assert mean_on_z_scale(np.array([*np.tanh(z), sign])) == pytest.approx(np.tanh(cell_mean_z(sign)), abs=1e-12)
