"""The meta-analysis across models against statsmodels, metafor's published numbers, closed
forms and simulations with known heterogeneity; the residualiser comparison."""

import itertools
import math

import numpy as np
import pandas as pd
import pingouin
import pytest
import scipy.optimize
import scipy.stats
from fixtures_results import BERTS_IN_DOMAIN, berts_of_a_feather
from statsmodels.stats.meta_analysis import combine_effects
from statsmodels.stats.oneway import anova_oneway

from analysis import partial_corr
from analysis.aggregate import combine_runs
from analysis.meta import (
    ALL_TRAIN_SETS,
    DERSIMONIAN_LAIRD,
    MIN_SOLID_PAIRS,
    PAULE_MANDEL,
    REML,
    bootstrap_heterogeneity,
    meta_analyse,
    per_model,
    random_effects,
    trend,
    trend_summary,
    welch_test,
)
from analysis.naming import ModelInfo
from analysis.sensitivity import SENSITIVE, compare_residualisers, summarise_changes

# statsmodels' Paule-Mandel stops iterating at a tolerance (see the test); DL is closed form.
TOLERANCE = 1e-7
HEURISTICS = [
    "Lexical (entailed)",
    "Subseq (entailed)",
    "Constituent (entailed)",
    "Lexical (nonent)",
    "Subseq (nonent)",
    "Constituent (nonent)",
]
# The 100 runs as "models": five of 20 (as equal as the study's), and five of unequal size,
# where REML, Paule-Mandel and DerSimonian-Laird give different tau^2.
SPLITS = {"equal": [20] * 5, "unequal": [8, 14, 20, 26, 32]}
# BCG vaccine trials (Colditz et al. 1994; metafor's dat.bcg): vaccinated TB cases and
# non-cases, then control TB cases and non-cases.
BCG = np.array(
    [
        [4, 119, 11, 128],
        [6, 300, 29, 274],
        [3, 228, 11, 209],
        [62, 13536, 248, 12619],
        [33, 5036, 47, 5761],
        [180, 1361, 372, 1079],
        [8, 2537, 10, 619],
        [505, 87886, 499, 87892],
        [29, 7470, 45, 7232],
        [17, 1699, 65, 1600],
        [186, 50448, 141, 27197],
        [5, 2493, 3, 2338],
        [27, 16886, 29, 17825],
    ],
    dtype=float,
)


def berts_groups(shared_data, split: str, x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
    """Fisher z of each group's partial correlation of x and y given MNLI accuracy, and its
    sampling variance 1 / (n - 4) (one covariate)."""
    runs = berts_of_a_feather(shared_data).dropna(subset=["Run"]).reset_index(drop=True)
    assert len(runs) == 100 == sum(SPLITS[split])
    bounds = np.cumsum([0, *SPLITS[split]])
    z, variances = [], []
    for start, stop in itertools.pairwise(bounds):
        group = runs.iloc[start:stop]
        result = partial_corr(group[x], group[y], group[BERTS_IN_DOMAIN])
        z.append(np.arctanh(result.r))
        variances.append(1.0 / (result.n - 4))
    return np.array(z), np.array(variances)


def berts_cases(shared_data):
    for split, (x, y) in itertools.product(SPLITS, itertools.combinations(HEURISTICS, 2)):
        yield (split, x, y), *berts_groups(shared_data, split, x, y)


# statsmodels takes square roots of the negative DL tau^2 it keeps.
@pytest.mark.filterwarnings("ignore:invalid value encountered in sqrt:RuntimeWarning")
@pytest.mark.parametrize("ours, theirs", [(DERSIMONIAN_LAIRD, "dl"), (PAULE_MANDEL, "iterated")])
def test_random_effects_match_statsmodels_on_berts_of_a_feather(shared_data, ours, theirs):
    """Five groups of BERT runs as models, every pair of HANS heuristics: tau^2, pooled z,
    its interval, Q and (DL) I^2 as statsmodels' combine_effects computes them.

    statsmodels leaves DL's tau^2 negative when Q < k - 1 (and weights with it), where the
    estimate is 0: there the random-effects model is the fixed-effect one. Its HKSJ interval
    has no floor; ours is the t interval on se^2 when the HKSJ scale is below 1. Its
    Paule-Mandel iteration returns 0 when a Newton step lands a rounding error past the root
    (ee = -4e-16 on ('unequal', 'Subseq (entailed)', 'Subseq (nonent)') with atol=1e-13), so
    it stops at atol=1e-7, which leaves its tau^2 within about 1e-8 of the root.
    """
    branches = set()
    for case, z, variances in berts_cases(shared_data):
        result = random_effects(z, variances, estimator=ours)
        reference = combine_effects(z, variances, method_re=theirs, use_t=True, atol=1e-7)
        fixed_ci, random_ci, fixed_hksj_ci, random_hksj_ci = reference.conf_int(use_t=True)
        heterogeneous = reference.tau2 > 0
        if heterogeneous:
            mean, ci, hksj_ci = reference.mean_effect_re, random_ci, random_hksj_ci
            hksj_scale = reference.scale_hksj_re
        else:
            mean, ci, hksj_ci = reference.mean_effect_fe, fixed_ci, fixed_hksj_ci
            hksj_scale = reference.scale_hksj_fe
        assert result.tau2 == pytest.approx(max(reference.tau2, 0.0), abs=TOLERANCE), case
        assert result.mu == pytest.approx(mean, abs=TOLERANCE), case
        assert result.q == pytest.approx(reference.q, abs=TOLERANCE), case
        assert result.q_p == pytest.approx(reference.test_homogeneity().pvalue, abs=TOLERANCE)
        expected_ci = hksj_ci if hksj_scale >= 1.0 else ci
        np.testing.assert_allclose(
            [result.ci_low, result.ci_high], expected_ci, atol=TOLERANCE, rtol=0, err_msg=str(case)
        )
        if ours == DERSIMONIAN_LAIRD:
            assert result.i2 == pytest.approx(max(reference.i2, 0.0), abs=TOLERANCE), case
        branches.add((heterogeneous, hksj_scale >= 1.0))
    assert branches >= {(True, True), (False, False)}  # both kinds of case were checked


def restricted_log_likelihood(effects: np.ndarray, variances: np.ndarray, tau2: float) -> float:
    """The REML log-likelihood of tau^2 up to a constant (Viechtbauer 2005):
    -1/2 (sum log(v + tau^2) + log sum w + sum w (y - mu_w)^2), w = 1 / (v + tau^2)."""
    w = 1.0 / (variances + tau2)
    mu = np.sum(w * effects) / w.sum()
    return -0.5 * (np.sum(np.log(variances + tau2)) + np.log(w.sum()) + np.sum(w * (effects - mu) ** 2))


def test_reml_maximises_the_restricted_likelihood(shared_data):
    """On the unequal groups, where it differs from DL and PM: REML's tau^2 is the maximum of
    the restricted likelihood found by brute force (a grid, then a bounded search)."""
    differs = 0
    for case, z, variances in berts_cases(shared_data):
        if case[0] != "unequal":
            continue
        grid = np.linspace(0.0, 1.0, 2001)
        likelihood = [restricted_log_likelihood(z, variances, tau2) for tau2 in grid]
        best = int(np.argmax(likelihood))
        search = scipy.optimize.minimize_scalar(
            lambda tau2: -restricted_log_likelihood(z, variances, tau2),
            bounds=(grid[max(best - 1, 0)], grid[best + 1]),
            method="bounded",
            options={"xatol": 1e-12},
        )
        brute = 0.0 if best == 0 and search.x < 1e-9 else search.x
        result = random_effects(z, variances, estimator=REML)
        assert result.tau2 == pytest.approx(brute, abs=1e-7), case
        differs += result.tau2 > 0 and not math.isclose(
            result.tau2, random_effects(z, variances, estimator=DERSIMONIAN_LAIRD).tau2
        )
    assert differs >= 3


def test_dat_bcg_matches_metafor():
    """Log risk ratios of the BCG trials: metafor's DerSimonian-Laird results (its tests compare
    them with Stata's metan) and the I^2 of its REML fit (easystats' performance tests)."""
    vaccinated, vaccinated_free, control, control_free = BCG.T
    log_rr = np.log(vaccinated / (vaccinated + vaccinated_free)) - np.log(control / (control + control_free))
    variances = 1 / vaccinated - 1 / (vaccinated + vaccinated_free) + 1 / control - 1 / (control + control_free)
    dl = random_effects(log_rr, variances, estimator=DERSIMONIAN_LAIRD)
    wald = dl.mu + np.array([-1, 1]) * scipy.stats.norm.ppf(0.975) * dl.se
    assert dl.mu == pytest.approx(-0.7141, abs=5e-5)
    np.testing.assert_allclose(wald, [-1.0644, -0.3638], atol=5e-5, rtol=0)
    assert dl.tau2 == pytest.approx(0.3088, abs=5e-5)
    assert 100 * dl.i2 == pytest.approx(92.1173, abs=5e-5)
    assert dl.q == pytest.approx(152.2330, abs=5e-5)
    reml = random_effects(log_rr, variances, estimator=REML)
    assert reml.i2 == pytest.approx(0.9222139, abs=1e-6)  # metafor stops REML at 1e-5


def test_prediction_interval_is_the_closed_form():
    """Higgins, Thompson and Spiegelhalter (2009): mu +- t_{k-2} sqrt(tau^2 + se^2), here with
    DL's tau^2 written out; none for two models."""
    y = np.array([0.10, 0.32, 0.55, 0.21, -0.05])
    v = np.array([0.010, 0.020, 0.015, 0.030, 0.012])
    w = 1 / v
    q = np.sum(w * (y - np.sum(w * y) / w.sum()) ** 2)
    tau2 = (q - 4) / (w.sum() - np.sum(w**2) / w.sum())
    assert tau2 > 0
    w_star = 1 / (v + tau2)
    mu = np.sum(w_star * y) / w_star.sum()
    half_width = scipy.stats.t.ppf(0.975, 3) * np.sqrt(tau2 + 1 / w_star.sum())
    result = random_effects(y, v, estimator=DERSIMONIAN_LAIRD)
    np.testing.assert_allclose([result.pi_low, result.pi_high], [mu - half_width, mu + half_width], atol=1e-12, rtol=0)
    two = random_effects(y[:2], v[:2])
    assert np.isnan(two.pi_low) and np.isnan(two.pi_high) and np.isfinite(two.ci_low)


def simulate(tau2: float, *, draws: int, known_variances: bool = False, seed: int = 0):
    """Meta-analyses of 8 models of 9 runs each, as the study has them: true model z ~
    N(0.3, tau2), run z ~ N(true z, sd^2) with sd from 0.1 to 0.3 across models. Returns per
    draw: tau^2 estimate, Cochran's and Welch's rejection at 5%, whether the CI covers 0.3
    and whether the PI covers a new model's true z, and the mean within-model variance."""
    rng = np.random.default_rng(seed)
    models, runs = 8, 9
    sd = np.linspace(0.1, 0.3, models)
    rows = []
    for _ in range(draws):
        true = 0.3 + np.sqrt(tau2) * rng.normal(size=models)
        z = true[:, None] + sd[:, None] * rng.normal(size=(models, runs))
        estimated = z.var(axis=1, ddof=1) / runs
        variances = sd**2 / runs if known_variances else estimated
        result = random_effects(z.mean(axis=1), variances)
        new_model = 0.3 + np.sqrt(tau2) * rng.normal()
        rows.append(
            (
                result.tau2,
                result.q_p < 0.05,
                welch_test(z.mean(axis=1), estimated, np.full(models, runs)) < 0.05,
                result.ci_low <= 0.3 <= result.ci_high,
                result.pi_low <= new_model <= result.pi_high,
                variances.mean(),
            )
        )
    return pd.DataFrame(rows, columns=["tau2", "cochran", "welch", "ci", "pi", "within"])


def test_heterogeneity_is_recovered_in_simulations():
    """tau^2 > 0: REML's mean estimate is tau^2 within Monte Carlo error, the HKSJ interval
    covers mu and the prediction interval a new model's true z about 95% of the time."""
    draws = simulate(0.02, draws=800)
    assert draws["tau2"].mean() == pytest.approx(0.02, abs=3 * draws["tau2"].sem())
    assert draws["ci"].mean() >= 0.93
    assert draws["pi"].mean() >= 0.90  # HTS under-covers a little with 8 models
    assert draws["welch"].mean() >= 0.85


def test_without_heterogeneity_welch_holds_its_size_and_cochran_does_not():
    """tau^2 = 0: the estimate stays small beside the within-model variance (it cannot be
    unbiased, being never negative); Welch's test rejects about 5% of the time, Cochran's
    chi^2 p about three times as often with variances estimated from 9 runs, and 5% with the
    true variances: the docstring's reason to report Welch's p."""
    draws = simulate(0.0, draws=1000)
    assert draws["tau2"].mean() < 0.3 * draws["within"].mean()
    assert draws["tau2"].median() < 0.1 * draws["within"].mean()
    assert 0.03 <= draws["welch"].mean() <= 0.08
    assert draws["cochran"].mean() >= 0.10
    assert 0.03 <= simulate(0.0, draws=1000, known_variances=True)["cochran"].mean() <= 0.08
    assert draws["ci"].mean() >= 0.93


def test_welch_test_matches_statsmodels():
    rng = np.random.default_rng(1)
    counts = np.array([9, 9, 6, 12, 9])
    samples = [rng.normal(0.1 * i, 0.1 + 0.05 * i, n) for i, n in enumerate(counts)]
    means = np.array([s.mean() for s in samples])
    variances = np.array([s.var(ddof=1) / s.size for s in samples])
    reference = anova_oneway(samples, use_var="unequal", welch_correction=True)
    assert welch_test(means, variances, counts) == pytest.approx(reference.pvalue, abs=1e-12)


MODELS = {
    "opt-big": ModelInfo("opt", 13.0),
    "opt-small": ModelInfo("opt", 2.7),
    "olmo": ModelInfo("olmo2", 7.0),
    "solo": ModelInfo("smollm3", 3.0),
}


def run_table(seed: int = 0) -> pd.DataFrame:
    """Run-level pairs as aggregate.all_run_pairs gives them: 4 models x 2 training sets,
    9 runs each (1 for "solo"), three testsets; "olmo" names every pair the other way round."""
    rng = np.random.default_rng(seed)
    rows = []
    for model, train_set in itertools.product(MODELS, ("mnli", "snli")):
        offset = rng.normal(0, 0.2)
        for run in range(1 if model == "solo" else 9):
            for x, y in (("hans", "rte"), ("hans", "paws"), ("rte", "paws")):
                if model == "olmo":
                    x, y = y, x
                r = np.tanh(0.3 + offset + rng.normal(0, 0.2))
                rows.append(
                    {
                        "model": model,
                        "train_set": train_set,
                        "seed": run,
                        "shots": 32,
                        "run": f"{model}_{train_set}_{run}",
                        "x": x,
                        "y": y,
                        "r": r,
                        "reason": "",
                    }
                )
    return pd.DataFrame(rows)


def test_meta_analysis_combines_each_models_runs_with_their_variance():
    """The path the CLI takes: run r -> per-model mean z and var(z)/m -> random effects, per
    training set and over both (each model's runs paired by seed: var / m of its paired
    averages); models in family and size order; a one-run model left out."""
    runs = run_table()
    pooled, members = meta_analyse(combine_runs(runs), MODELS, runs)
    assert list(dict.fromkeys(pooled["scope"])) == ["mnli", "snli", ALL_TRAIN_SETS]
    assert set(zip(pooled["x"], pooled["y"])) == {("hans", "rte"), ("hans", "paws"), ("rte", "paws")}
    mnli = members[(members["scope"] == "mnli") & (members["x"] == "hans") & (members["y"] == "paws")]
    assert list(mnli["model"]) == ["olmo", "opt-small", "opt-big", "solo"]
    assert mnli["weight"].isna().tolist() == [False, False, False, True]
    assert mnli["weight"].sum() == pytest.approx(1.0)
    for row in pooled.itertuples():
        chosen = runs[(runs["model"] != "solo") & ((runs["train_set"] == row.scope) | (row.scope == ALL_TRAIN_SETS))]
        chosen = chosen[[{x, y} == {row.x, row.y} for x, y in zip(chosen["x"], chosen["y"])]]
        z = chosen.assign(z=np.arctanh(chosen["r"])).groupby(["model", "train_set"])["z"]
        effects, variances = z.mean(), z.var(ddof=1) / z.count()
        if row.scope == ALL_TRAIN_SETS:  # one effect per model: the mean of its 9 paired (seed) averages
            averages = chosen.assign(z=np.arctanh(chosen["r"])).groupby(["model", "seed"])["z"].mean()
            effects = averages.groupby(level="model").mean()
            variances = averages.groupby(level="model").var(ddof=1) / 9
        members_order = ["olmo", "opt-small", "opt-big"]  # family, then size: the draws follow the members' order
        effects, variances = (
            (s.droplevel("train_set") if "train_set" in s.index.names else s).loc[members_order]
            for s in (effects, variances)
        )
        expected = random_effects(effects.to_numpy(), variances.to_numpy())
        welch_p, expected_q = bootstrap_heterogeneity(effects.to_numpy(), variances.to_numpy(), np.full(3, 8.0))
        assert row.welch_p == welch_p
        assert row.i2 == pytest.approx(max(0.0, 1.0 - expected_q / expected.q), abs=1e-12)
        assert row.k == expected.k == 3
        assert row.n_left_out == 1
        assert row.r == pytest.approx(np.tanh(expected.mu), abs=1e-12)
        assert (row.ci_low, row.ci_high, row.pi_low, row.pi_high) == pytest.approx(
            tuple(np.tanh([expected.ci_low, expected.ci_high, expected.pi_low, expected.pi_high])), abs=1e-12
        )
        assert (row.tau2, row.q) == pytest.approx((expected.tau2, expected.q), abs=1e-12)
        assert row.n_agree == np.sum(np.sign(effects) == np.sign(expected.mu))
    # Issue 41: over both training sets, k counts the 4 base models (3 pooled, "solo" left out), not 8 groups.
    everything = members[(members["scope"] == ALL_TRAIN_SETS) & (members["x"] == "hans") & (members["y"] == "paws")]
    assert list(zip(everything["model"], everything["train_set"])) == [(m, ALL_TRAIN_SETS) for m in mnli["model"]]
    assert everything["n_runs"].tolist() == [18, 18, 18, 2]
    for _, family in pooled.groupby("scope"):  # each scope one family per column (issue 48); Q descriptive
        assert "q_p_adj" not in family
        for column in ("p", "welch_p"):
            expected = pingouin.multicomp(family[column].to_numpy(), method="holm")[1]
            np.testing.assert_allclose(family[f"{column}_adj"], expected, atol=1e-12)
            assert (family[f"{column}_adj"] > family[column]).any()
    z = runs.assign(z=np.arctanh(runs["r"]))
    z = z[(z["model"] == "opt-big") & (z["x"] == "hans") & (z["y"] == "paws")].pivot(index="seed", columns="train_set")
    paired = everything.set_index("model")["paired_corr"]
    assert paired["opt-big"] == pytest.approx(np.corrcoef(z["z"]["mnli"], z["z"]["snli"])[0, 1], abs=1e-12)
    assert np.isnan(paired["solo"]) and members.loc[members["scope"] == "mnli", "paired_corr"].isna().all()


def paired_study(correlation: float, replicates: int, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Homogeneous studies as the study is designed: 8 models x 2 training sets x 9 runs (3 seeds x
    3 shot counts), every true z 0.3, run z = 0.3 + sd e with sd from 0.1 to 0.3 across models and
    e of the two training sets' runs with the same (seed, shots) correlated at `correlation`. Each
    replicate is one pair (a<i>, b<i>). Returns the run rows (all_run_pairs' columns) and their
    combination per model and training set (combine_runs' z, z_se, z_dof, n_runs), in closed form."""
    rng = np.random.default_rng(seed)
    models, keys = list(PAIRED_MODELS), list(itertools.product((0, 42, 99), (32, 64, 128)))
    sd = np.linspace(0.1, 0.3, len(models))[None, :, None, None]
    cov = [[1.0, correlation], [correlation, 1.0]]
    z = 0.3 + sd * rng.multivariate_normal([0.0, 0.0], cov, size=(replicates, len(models), len(keys)))
    replicate, model, key, train_set = (i.ravel() for i in np.indices(z.shape))
    seeds, shots = np.array(keys).T
    runs = pd.DataFrame(
        {
            "model": np.array(models)[model],
            "train_set": np.array(["mnli", "snli"])[train_set],
            "seed": seeds[key],
            "shots": shots[key],
            "x": np.char.add("a", replicate.astype(str)),
            "y": np.char.add("b", replicate.astype(str)),
            "r": np.tanh(z.ravel()),
        }
    )
    stats = runs.assign(z=z.ravel()).groupby(["model", "train_set", "x", "y"], sort=False)["z"]
    groups = pd.concat([stats.mean(), stats.std() / 3], axis=1, keys=["z", "z_se"]).reset_index()
    return runs, groups.assign(z_dof=8.0, n_runs=9, reason="")


PAIRED_MODELS = {f"model{i}": ModelInfo("opt", float(i + 1)) for i in range(8)}


def homogeneity_rates(members: pd.DataFrame, count_column: str = "z_dof") -> tuple[float, float]:
    """Over the replicates of `paired_study`: the share whose Welch test rejects equal models at
    5%, and the share of the models' 95% intervals that cover the true z 0.3."""
    rejected = [
        welch_test(pair["z"], pair["z_se"] ** 2, pair[count_column] + 1) < 0.05 for _, pair in members.groupby("x")
    ]
    covered = (np.arctanh(members["ci_low"]) <= 0.3) & (0.3 <= np.arctanh(members["ci_high"]))
    return float(np.mean(rejected)), float(covered.mean())


@pytest.mark.parametrize("correlation", [-0.3, 0.0, 0.7])
def test_paired_training_sets_keep_heterogeneity_tests_and_intervals_at_their_level(correlation):
    """Issue 48: runs of two training sets paired by (seed, shots) are correlated; pooled as pairs
    (var / m of the paired averages), 500 homogeneous studies reject equal models at most 8% of
    the time and the models' intervals cover 93-97%, and the correlation is recovered. Pooled as
    independent (sum v / 4, the old formula), they fail at 0.7."""
    runs, groups = paired_study(correlation, 500)
    members = per_model(groups, runs)
    rejected, covered = homogeneity_rates(members)
    assert rejected <= 0.08 and 0.93 <= covered <= 0.97
    assert members["paired_corr"].mean() == pytest.approx(correlation, abs=0.05)
    if correlation == 0.7:  # the old formula: sum v / 4 on Welch-Satterthwaite's degrees of freedom
        v = groups.assign(v=groups["z_se"] ** 2).groupby(["model", "x"], sort=False)["v"]
        old = pd.DataFrame({"z": groups.groupby(["model", "x"], sort=False)["z"].mean(), "z_se": np.sqrt(v.sum() / 4)})
        old["dof"] = (v.sum() ** 2 / v.apply(lambda v: (v**2 / 8).sum())).to_numpy()
        half_width = scipy.stats.t.ppf(0.975, old["dof"]) * old["z_se"]
        old = old.assign(ci_low=np.tanh(old["z"] - half_width), ci_high=np.tanh(old["z"] + half_width)).reset_index()
        old_rejected, old_covered = homogeneity_rates(old, "dof")
        assert old_rejected > 0.2 and old_covered < 0.9


def test_training_sets_without_common_runs_are_pooled_as_independent():
    """Seeds that differ between training sets pair nothing: the variance is sum v / T^2 with
    Welch-Satterthwaite's degrees of freedom, and no paired correlation."""
    runs = run_table()
    runs = runs.assign(seed=runs["seed"] + 100 * (runs["train_set"] == "snli"))
    groups = combine_runs(runs)
    _, members = meta_analyse(groups, MODELS, runs)
    everything = members[(members["scope"] == ALL_TRAIN_SETS) & (members["model"] != "solo")]
    for row in everything.itertuples():
        sets = groups[groups["model"] == row.model]
        sets = sets[[{x, y} == {row.x, row.y} for x, y in zip(sets["x"], sets["y"])]]
        assert row.z_se == pytest.approx(np.sqrt((sets["z_se"] ** 2).sum()) / 2, abs=1e-12)
        assert np.isnan(row.paired_corr)


def test_too_few_models_give_reasons_not_numbers():
    runs = run_table()
    two_models = runs[runs["model"].isin(["olmo", "opt-small", "solo"])]
    pooled, _ = meta_analyse(combine_runs(two_models), MODELS, two_models)
    mnli = pooled[pooled["scope"] == "mnli"]
    assert (mnli["k"] == 2).all() and mnli["r"].notna().all() and mnli["pi_low"].isna().all()
    assert set(mnli["reason"]) == {"two models: no prediction interval (needs three)"}
    one_model = runs[runs["model"].isin(["olmo", "solo"]) & (runs["train_set"] == "mnli")]
    pooled, members = meta_analyse(combine_runs(one_model), MODELS, one_model)
    assert list(pooled["scope"]) == ["mnli"] * 3  # one training set: no scope over all
    assert pooled[["r", "ci_low", "tau2", "p", "p_adj"]].isna().all().all()
    assert set(pooled["reason"]) == {"1 model(s) with a variance across runs: a meta-analysis needs two"}
    assert members.loc[members["model"] == "solo", "reason"].eq("one run: no interval across runs").all()


def test_residualiser_comparison_flags_sign_significance_and_definition():
    keys = ["model", "x", "y"]
    linear = pd.DataFrame(
        {
            "model": ["m"] * 5,
            "x": list("abcde"),
            "y": ["z"] * 5,
            "r": [0.5, 0.3, 0.4, np.nan, 0.2],
            "p_adj": [0.001, 0.2, 0.01, np.nan, 0.3],
        }
    )
    spline = linear.assign(r=[0.45, -0.1, 0.2, 0.3, 0.25], p_adj=[0.002, 0.6, 0.2, 0.04, 0.4])
    comparison = compare_residualisers({"linear": linear, "spline": spline}, keys)
    assert list(comparison["x"]) == list("abcde")
    assert comparison["sign_changes"].tolist() == [False, True, False, False, False]
    assert comparison["significance_changes"].tolist() == [False, False, True, False, False]
    assert comparison["definition_changes"].tolist() == [False, False, False, True, False]
    assert comparison[SENSITIVE].tolist() == [False, True, True, True, False]
    assert comparison["r_spline"].tolist() == spline["r"].tolist()
    summary = summarise_changes(comparison, ["model"], ["linear", "spline"]).iloc[0]
    assert summary["n_pairs"] == 4
    assert (summary["n_sig_positive_linear"], summary["n_sig_positive_spline"]) == (2, 2)
    assert summary["mean_r_linear"] == pytest.approx(np.tanh(np.arctanh([0.5, 0.3, 0.4, 0.2]).mean()))
    assert (summary["sign_changes"], summary["significance_changes"], summary["definition_changes"]) == (1, 1, 1)


def test_bootstrap_heterogeneity_is_cochrans_chi2_when_variances_are_known():
    """With variances on (nearly) infinite degrees of freedom, Welch's statistic is Q / (k - 1) and Q is
    chi^2 with k - 1 degrees of freedom under homogeneity: the bootstrap's p is chi^2's p and its mean Q is
    k - 1, within the Monte Carlo error of 999 draws (sd of a p near 0.3: 0.015; of the mean of Q: 0.12);
    the same inputs give the same p."""
    rng = np.random.default_rng(3)
    for _ in range(5):
        effects, variances = rng.normal(0.3, 0.1, 8), rng.uniform(0.005, 0.02, 8)
        p, expected_q = bootstrap_heterogeneity(effects, variances, np.full(8, 1e12))
        q = random_effects(effects, variances).q
        assert p == pytest.approx(scipy.stats.chi2.sf(q, 7), abs=0.05)
        assert expected_q == pytest.approx(7.0, abs=0.4)
        assert bootstrap_heterogeneity(effects, variances, np.full(8, 1e12)) == (p, expected_q)


def homogeneous_pairs(studies: int, pairs: int = 21, seed: int = 0):
    """`studies` x `pairs` homogeneous meta-analyses as `simulate` draws them (8 models x 9 runs, run z sd 0.1
    to 0.3 across models): each pair's effects, estimated variances and degrees of freedom."""
    rng = np.random.default_rng(seed)
    z = 0.3 + np.linspace(0.1, 0.3, 8)[:, None] * rng.standard_normal((studies, pairs, 8, 9))
    return z.mean(axis=-1), z.var(axis=-1, ddof=1) / 9, np.full(8, 8.0)


def test_bootstrap_welch_holds_holms_family_wise_error_over_21_homogeneous_pairs():
    """Issue 54: Welch's F approximation rejects about 1.8 times too often at Holm's first threshold
    0.05 / 21, a family-wise error of 8.7% over 21 homogeneous pairs (400 studies, this seed; 5.5% with
    another); the bootstrap's p keeps it at 4.0% (4.0%): at most 6% here, the F approximation above 7%."""
    effects, variances, dof = homogeneous_pairs(400)
    bootstrap, approximate = [], []
    for study_effects, study_variances in zip(effects, variances):
        bootstrap.append([bootstrap_heterogeneity(y, v, dof)[0] for y, v in zip(study_effects, study_variances)])
        approximate.append([welch_test(y, v, dof + 1) for y, v in zip(study_effects, study_variances)])
    family_wise = [
        np.mean([(pingouin.multicomp(np.array(p), method="holm")[1] < 0.05).any() for p in study])
        for study in (bootstrap, approximate)
    ]
    assert family_wise[0] <= 0.06 < 0.07 < family_wise[1]
    assert np.mean(np.array(bootstrap) < 0.05) == pytest.approx(0.05, abs=0.01)


def test_i2_against_q_s_bootstrap_expectation_holds_on_a_homogeneous_study_and_finds_disagreement():
    """Issue 54: with within-model variances from 9 runs taken as known, I^2 averaged 0.20 over homogeneous
    pairs and exceeded 0.5 for 16%; against Q's expectation under homogeneity with estimated variances
    (bootstrap), 0.12 and 8% (the true variances give REML's I^2 0.11 and 5%, DL's 0.12 and 5%: k = 8 models
    leave no estimator much lower). Models that disagree in sign (z +-0.3) show I^2 above 0.75 every time."""
    effects, variances, dof = homogeneous_pairs(20)
    old, new = [], []
    for y, v in zip(effects.reshape(-1, 8), variances.reshape(-1, 8)):
        result = random_effects(y, v)
        old.append(result.i2)
        new.append(max(0.0, 1.0 - bootstrap_heterogeneity(y, v, dof)[1] / result.q))
    assert np.mean(old) > 0.18 and np.mean(np.array(old) > 0.5) > 0.12
    assert np.mean(new) <= 0.14 and np.mean(np.array(new) > 0.5) <= 0.09
    signs = np.where(np.arange(8) < 4, 1.0, -1.0)
    disagreeing = effects.reshape(-1, 8)[:100] + 0.3 * signs - 0.3
    for y, v in zip(disagreeing, variances.reshape(-1, 8)[:100]):
        assert 1.0 - bootstrap_heterogeneity(y, v, dof)[1] / random_effects(y, v).q > 0.75


def test_the_primary_scope_is_every_training_set_over_the_pairs_each_defines():
    """Issue 54: over both training sets, a pair that one training set alone defines (its in-domain testset is
    the other's OOD one) would be a copy of that set's result: the scope over all holds the shared pairs only,
    is the one primary scope, and its p are adjusted over them alone."""
    runs = run_table()
    only = runs[runs["x"] == "hans"].assign(x="snli", y=lambda frame: frame["y"])
    only = only[only["train_set"] == "mnli"]
    runs = pd.concat([runs, only], ignore_index=True)
    pooled, _ = meta_analyse(combine_runs(runs), MODELS, runs)
    everything = pooled[pooled["scope"] == ALL_TRAIN_SETS]
    assert len(everything) == 3 and "snli" not in set(everything["x"]) | set(everything["y"])
    assert len(pooled[pooled["scope"] == "mnli"]) == 5
    assert pooled["primary"].tolist() == (pooled["scope"] == ALL_TRAIN_SETS).tolist()
    np.testing.assert_allclose(everything["p_adj"], pingouin.multicomp(everything["p"].to_numpy(), method="holm")[1])
    one_set = runs[runs["train_set"] == "mnli"]
    pooled, _ = meta_analyse(combine_runs(one_set), MODELS, one_set)
    assert pooled["primary"].all()


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (0.05, 0.4, "positive"),  # excludes 0
        (-0.5, -0.02, "negative"),
        (-0.08, 0.09, "none"),  # every |r| of 0.1 or more excluded
        (-0.08, 0.3, "undetermined"),  # not significant, yet an r of 0.3 is not excluded: no "no trend"
        (np.nan, np.nan, "undetermined"),
    ],
)
def test_a_trend_is_read_from_the_interval_never_from_a_p_above_a_threshold(low, high, expected):
    assert trend(low, high) == expected


def test_the_trend_summary_counts_the_primary_scopes_pairs_by_their_intervals():
    pooled = pd.DataFrame(
        {
            "scope": [ALL_TRAIN_SETS] * 3 + ["mnli"],
            "primary": [True, True, True, False],
            "trend": ["none", "undetermined", "positive", "negative"],
            "trend_new_model": ["undetermined", "undetermined", "positive", "negative"],
        }
    )
    summary = trend_summary(pooled)
    assert "3 pairs" in summary
    assert "1 positive, 0 negative, 1 none, 1 undetermined" in summary
    assert "1 positive, 0 negative, 0 none, 2 undetermined" in summary


def test_a_paired_variance_on_fewer_than_six_common_runs_says_so():
    """Four (seed, shots) common to both training sets pair the runs, but a variance from four paired runs
    rests on three degrees of freedom: the member's reason says so."""
    runs = run_table()
    runs = runs[(runs["seed"] < 4) | (runs["model"] == "solo")]
    _, members = meta_analyse(combine_runs(runs), MODELS, runs)
    everything = members[(members["scope"] == ALL_TRAIN_SETS) & (members["model"] != "solo")]
    assert set(everything["reason"]) == {f"variance from 4 paired runs (fewer than {MIN_SOLID_PAIRS})"}
    assert everything["z_se"].notna().all()
    full = run_table()
    _, members = meta_analyse(combine_runs(full), MODELS, full)
    assert members.loc[(members["scope"] == ALL_TRAIN_SETS) & (members["model"] != "solo"), "reason"].eq("").all()
