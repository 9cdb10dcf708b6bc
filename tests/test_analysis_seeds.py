"""Same-seed runs (analysis/seeds.py) and the shot effect (sensitivity.shot_counts) on simulated studies whose
truth is known, and against closed forms and statsmodels."""

import itertools

import numpy as np
import pandas as pd
import pingouin
import pytest
import scipy.stats
import statsmodels.formula.api as smf
from statsmodels.stats.anova import anova_lm

from analysis import aggregate, meta
from analysis.aggregate import combine_runs
from analysis.meta import ALL_TRAIN_SETS, meta_analyse
from analysis.naming import ModelInfo
from analysis.seeds import anova_tables, clustered_variance, seed_correlation
from analysis.sensitivity import by_shot_count, shot_counts

SEEDS, SHOTS, TRAIN_SETS = (0, 42, 99), (32, 64, 128), ("mnli", "snli")
MODELS = {f"model{i}": ModelInfo("opt", float(i + 1)) for i in range(8)}


def seed_tables(tables: int, rho: float, seed: int = 0) -> pd.DataFrame:
    """`tables` 3 seeds x 3 shots tables of z, runs of one seed correlated at `rho`, each table its own
    scale (0.1 to 0.3) and shot effects (sd 0.1), as anova_tables' input."""
    rng = np.random.default_rng(seed)
    noise = np.sqrt(rho) * rng.standard_normal((tables, 3, 1)) + np.sqrt(1 - rho) * rng.standard_normal((tables, 3, 3))
    z = rng.uniform(0.1, 0.3, (tables, 1, 1)) * noise + 0.1 * rng.standard_normal((tables, 1, 3))
    table, seed_index, shots_index = (i.ravel() for i in np.indices(z.shape))
    return pd.DataFrame({"table": table, "seed": seed_index, "shots": shots_index, "z": z.ravel()})


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.6])
def test_the_within_seed_correlation_is_recovered_across_tables_of_different_scales(rho):
    """2,000 tables: the pooled estimate is within 0.05 of the truth (its sd there is about 0.015), whatever
    each table's scale and shot effects."""
    estimate = seed_correlation(anova_tables(seed_tables(2000, rho), ["table"]))
    assert estimate == pytest.approx(rho, abs=0.05)


def test_the_analysis_of_variance_matches_statsmodels():
    runs = seed_tables(3, 0.3)
    tables = anova_tables(runs, ["table"])
    for row in tables.itertuples():
        fitted = anova_lm(smf.ols("z ~ C(seed) + C(shots)", data=runs[runs["table"] == row.table]).fit(), typ=1)
        expected = fitted["sum_sq"].to_numpy()
        np.testing.assert_allclose([row.ss_seed, row.ss_shots, row.ss_error], expected, rtol=1e-10)


def test_clustered_variance_is_the_plain_one_without_correlation_and_unbiased_with_it():
    """rho = 0: s^2 / n on n - 1 degrees of freedom. rho = 0.3 over 3 seeds of 3 runs: the variance of the mean
    is sigma^2 (1 + 2 rho) / 9; 20,000 simulated groups' estimates average to it within 2% (their sd is
    about 0.6 of it, so the mean's is 0.4%), where s^2 / n averages sigma^2 (1 - rho / 4) / 9, 0.58 of it."""
    rng = np.random.default_rng(1)
    z, seeds = rng.standard_normal(9), np.repeat([0, 42, 99], 3)
    assert clustered_variance(z, seeds, 0.0) == pytest.approx((z.var(ddof=1) / 9, 8.0), rel=1e-12)
    rho, groups = 0.3, 20000
    draws = np.sqrt(rho) * rng.standard_normal((groups, 3, 1)) + np.sqrt(1 - rho) * rng.standard_normal((groups, 3, 3))
    estimates = np.array([clustered_variance(draw.ravel(), seeds, rho)[0] for draw in draws])
    truth = (1 + 2 * rho) / 9
    assert estimates.mean() == pytest.approx(truth, rel=0.02)
    plain = draws.reshape(groups, 9).var(axis=1, ddof=1).mean() / 9
    assert plain < 0.7 * truth


def clustered_study(pairs: int, seed_share: float, paired_share: float, seed: int) -> pd.DataFrame:
    """One homogeneous study's run-level pairs: 8 models x 2 training sets x 3 seeds x 3 shots, every true z 0.3,
    run z = 0.3 + sd (a + b + c) with sd from 0.1 to 0.3 across models; a is shared by a seed's runs of every
    shot count and training set (variance `seed_share`), b by its two training sets' runs of one shot count
    (`paired_share` - `seed_share`), c is the run's own."""
    rng = np.random.default_rng(seed)
    shape = (pairs, len(MODELS), 3, 3, 2)
    a = np.sqrt(seed_share) * rng.standard_normal((*shape[:3], 1, 1))
    b = np.sqrt(paired_share - seed_share) * rng.standard_normal((*shape[:4], 1))
    c = np.sqrt(1 - paired_share) * rng.standard_normal(shape)
    z = 0.3 + np.linspace(0.1, 0.3, len(MODELS))[None, :, None, None, None] * (a + b + c)
    pair, model, seed_at, shots_at, train_set = (i.ravel() for i in np.indices(shape))
    names = np.array(list(MODELS))[model]
    return pd.DataFrame(
        {
            "model": names,
            "train_set": np.array(TRAIN_SETS)[train_set],
            "seed": np.array(SEEDS)[seed_at],
            "shots": np.array(SHOTS)[shots_at],
            "run": [f"{m}_{t}_{s}_{k}" for m, t, s, k in zip(model, train_set, seed_at, shots_at)],
            "x": np.char.add("a", pair.astype(str)),
            "y": np.char.add("b", pair.astype(str)),
            "r": np.tanh(z.ravel()),
            "reason": "",
        }
    )


def same_seed_rates(studies: int) -> tuple[float, float, pd.Series]:
    """Over `studies` clustered studies (30% of the noise shared by a seed's runs, 90% by paired runs): the share
    of primary-scope pairs whose Welch p is below 0.05, the share of the models' 95% intervals (every scope)
    that cover 0.3, and the members' mean seed_corr per scope."""
    rejected, covered, correlations = [], [], []
    for study in range(studies):
        runs = clustered_study(21, 0.3, 0.9, seed=study)
        pooled, members = meta_analyse(combine_runs(runs), MODELS, runs)
        rejected += list(pooled.loc[pooled["primary"], "welch_p"] < 0.05)
        covered += list((np.arctanh(members["ci_low"]) <= 0.3) & (0.3 <= np.arctanh(members["ci_high"])))
        correlations.append(members.groupby("scope")["seed_corr"].mean())
    return float(np.mean(rejected)), float(np.mean(covered)), pd.concat(correlations, axis=1).mean(axis=1)


def test_same_seed_runs_keep_welch_and_the_models_intervals_at_their_level(monkeypatch):
    """Issue 54: a seed's runs share 30% of their noise across shot counts and training sets (paired runs 90%).
    With the within-seed correlation modelled, Welch rejects equal models for at most 10% of the primary
    scope's pairs (6 studies x 21 pairs; 4.9% over 40 studies) and the models' intervals cover 93-97%
    (95.5%); the correlation is recovered (0.3 per training set; 0.3 / 0.95 = 0.32 for the paired
    averages). Taken as 0 (runs exchangeable, as before), Welch rejects over 15% (19% in these 3 studies;
    29.8% over 40 with the F approximation) and the intervals cover under 92% (87%)."""
    rejected, covered, correlations = same_seed_rates(6)
    assert rejected <= 0.10 and 0.93 <= covered <= 0.97
    assert correlations[list(TRAIN_SETS)].to_numpy() == pytest.approx([0.3, 0.3], abs=0.06)
    assert correlations[ALL_TRAIN_SETS] == pytest.approx(0.3 / 0.95, abs=0.06)
    for module in (aggregate, meta):
        monkeypatch.setattr(module, "seed_correlation", lambda tables: 0.0)
    rejected, covered, _ = same_seed_rates(3)
    assert rejected > 0.15 and covered < 0.92


def test_shot_counts_give_each_pairs_r_per_shot_count_and_find_a_shot_effect_that_flips_between_pairs():
    """Per pair and shot count: tanh of the seeds' mean z with the t interval across seeds (scipy); per pair
    the F test of shots in the seeds x shots analysis of variance (statsmodels), Holm across the model's
    pairs (pingouin). A shot effect of +-0.4 in z that flips sign between pairs (half up, half down) cancels
    in the mean over pairs, and is found in every pair by the within-model test."""
    rng = np.random.default_rng(5)
    rows = []
    for pair, seed, (step, shots) in itertools.product(range(6), SEEDS, enumerate(SHOTS)):
        effect = 0.4 * (step - 1) * (1 if pair % 2 else -1)
        z = 0.3 + effect + 0.05 * rng.standard_normal()
        rows.append({"model": "m", "train_set": "mnli", "seed": seed, "shots": shots, "run": f"{seed}_{shots}"})
        rows[-1] |= {"x": f"a{pair}", "y": f"b{pair}", "r": np.tanh(z), "reason": ""}
    runs = pd.DataFrame(rows)
    table = shot_counts(runs)
    assert len(table) == 18 and (table["n_runs"] == 3).all()
    for (x, shots), cell in table.groupby(["x", "shots"]):
        z = np.arctanh(runs[(runs["x"] == x) & (runs["shots"] == shots)]["r"].to_numpy())
        low, high = scipy.stats.t.interval(0.95, 2, loc=z.mean(), scale=scipy.stats.sem(z))
        assert cell[["r", "ci_low", "ci_high"]].iloc[0].to_numpy() == pytest.approx(np.tanh([z.mean(), low, high]))
    tests = table.drop_duplicates("x")
    for row in tests.itertuples():
        chosen = runs[runs["x"] == row.x].assign(z=lambda frame: np.arctanh(frame["r"]))
        expected = anova_lm(smf.ols("z ~ C(seed) + C(shots)", data=chosen).fit(), typ=1).loc["C(shots)"]
        assert (row.shot_f, row.shot_p) == pytest.approx((expected["F"], expected["PR(>F)"]), rel=1e-9)
    np.testing.assert_allclose(tests["shot_p_adj"], pingouin.multicomp(tests["shot_p"].to_numpy(), method="holm")[1])
    assert (tests["shot_p_adj"] < 0.05).all()
    mean_over_pairs = by_shot_count(runs).set_index("shots")["mean_r"]
    assert np.ptp(np.arctanh(mean_over_pairs.to_numpy())) < 0.05
