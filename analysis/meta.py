"""Do results generalise across models? A random-effects meta-analysis of each pair's r.

The study asks whether a pair of OOD testsets co-varies the same way in
every model. Each model (per training set) contributes one estimate per
pair, the mean Fisher z of its m runs (aggregate.combine_runs), with the
within-model variance v of that mean estimated from the runs, runs of one
seed correlated (seeds.py). The textbook variance of a single correlation, 1 / (n - k - 3),
would not do: a model's runs differ in seed and shot count, and successive
evaluation steps of one run are autocorrelated, so only the spread of the
runs says how far a model's mean could move. A model with one run, or whose
runs all have the same r, has no such variance and is left out (its row
says why).

Over all training sets together (scope ALL_TRAIN_SETS), a model trained on
several is still one model: its estimate is the mean of its training sets'
estimates, so k counts base models, not (model, training set) groups. Its
variance depends on the design. Runs of two training sets with the same
(seed, shots) share their LoRA initialisation, dropout keys and data order,
so their z are correlated. With every run paired, the variance is that of
the mean of the m paired averages (mean over training sets per (seed,
shots)), clustered by seed with the within-seed correlation of the paired
averages pooled over models and pairs (seed_corr), as seeds.clustered_variance
takes it. Where the training sets hold at least MIN_PAIRED_RUNS such pairs
but not every run is paired, the variance is
(sum v_t + sum_{s != t} rho_st sqrt(v_s v_t) n_st / sqrt(n_s n_t)) / T^2,
rho_st the correlation of the two sets' z over their n_st common (seed,
shots), n_s their runs, on the fewest common runs less one degrees of
freedom. A paired variance from fewer than MIN_SOLID_PAIRS paired runs says
so in the member's reason. Unpaired designs keep sum v_t / T^2 with Welch-Satterthwaite's
degrees of freedom. Treating paired runs as independent would understate
the variance when rho > 0 and make models look heterogeneous
(tests/test_analysis_meta.py simulates it).

Models are then combined on the Fisher z scale, y_i ~ N(mu, v_i + tau^2):
- tau^2, the variance of the models' true z: restricted maximum likelihood
  (REML, the default), Paule-Mandel (PM) or DerSimonian-Laird (DL). With 8
  models DL's one-step moment estimate is biased low where heterogeneity is
  large (Veroniki et al. 2016); REML is what Cochrane's Statistical Methods
  Group recommends in its place, with the HKSJ interval below.
- mu = sum w_i y_i / sum w_i with w_i = 1 / (v_i + tau^2); standard error
  se = 1 / sqrt(sum w_i).
- Its 95% interval and p: Hartung-Knapp-Sidik-Jonkman, t with k - 1 degrees
  of freedom on the variance max(1, q) se^2, q = sum w_i (y_i - mu)^2 / (k - 1).
  The normal interval is too narrow with few models because it ignores that
  tau^2 is estimated; the floor at 1 (Roever, Knapp and Friede 2015) keeps
  HKSJ from being narrower than the t interval on se^2 when the models
  happen to agree more than their variances imply.
- Cochran's Q = sum (y_i - mu_FE)^2 / v_i about the fixed-effect mean, with p
  from chi^2 with k - 1 degrees of freedom: descriptive only. That p assumes
  known v_i; with v_i estimated from 9 runs it rejects homogeneity about three
  times too often (tests/test_analysis_meta.py).
- Welch's (1951) test of equal means with variances estimated on d_i degrees
  of freedom (welch_p), its p from a parametric bootstrap
  (bootstrap_heterogeneity): Welch's F approximation rejects 1.8 times too
  often at Holm's first threshold over 21 pairs.
- I^2 = max(0, (Q - E*[Q]) / Q), E*[Q] Q's mean over the same bootstrap's
  homogeneous draws: Higgins and Thompson's (2002) (Q - (k - 1)) / Q with the
  expectation of Q under homogeneity as the variances are estimated in place of
  k - 1; with variances taken as known it averaged 0.20 on homogeneous studies.
  random_effects' own i2 is the textbook tau^2 / (tau^2 + s^2) with s^2 the
  typical within-model variance (as metafor reports it; with DL it equals
  (Q - (k - 1)) / Q).
- Prediction interval for the true z of a new model (Higgins, Thompson and
  Spiegelhalter 2009): mu +- t_{0.975, k-2} sqrt(tau^2 + se^2); needs k >= 3.
- Agreement: how many models have an r of the pooled r's sign.

p_adj and welch_p_adj adjust p and welch_p across the pairs of one scope,
each column its own family: a heterogeneity test repeated over 21 pairs
finds "differences" by chance unless adjusted. The scope over every
training set holds the pairs every training set defines (a pair one set
alone defines would be a copy of its result there) and is the primary one
(primary_scope). Whether a pair shows a trend is read from its pooled and
prediction intervals (trend), never from a p above a threshold.

Everything is reported back on the correlation scale, r = tanh(z).
"""

import dataclasses
import itertools
from collections.abc import Mapping

import numpy as np
import pandas as pd
import scipy.optimize
import scipy.stats

from analysis.aggregate import GROUP_COLUMNS, fisher_z, in_first_seen_order
from analysis.naming import ModelInfo
from analysis.padjust import adjust_pvalues
from analysis.seeds import SEED, anova_tables, clustered_variance, seed_correlation
from analysis.stats import CONFIDENCE

REML = "reml"
PAULE_MANDEL = "pm"
DERSIMONIAN_LAIRD = "dl"
TAU2_ESTIMATORS = (REML, PAULE_MANDEL, DERSIMONIAN_LAIRD)
ESTIMATOR_NAMES = {REML: "REML", PAULE_MANDEL: "Paule-Mandel", DERSIMONIAN_LAIRD: "DerSimonian-Laird"}

# The scope of a meta-analysis over the models of every training set together.
ALL_TRAIN_SETS = "all training sets"
# The parametric bootstrap of the heterogeneity statistics: draws per pair, and the seed their draws start from.
BOOTSTRAP_DRAWS = 999
BOOTSTRAP_SEED = 20240601
# The |r| below which a pooled or predicted correlation is no trend: an interval within
# (-TREND_MARGIN, TREND_MARGIN) excludes a trend, one beyond 0 shows one (`trend`).
TREND_MARGIN = 0.1
TRENDS = ("positive", "negative", "none", "undetermined")
# Fewer common (seed, shots) than this between two training sets of a model estimate no
# correlation between them: their runs are pooled as unpaired.
MIN_PAIRED_RUNS = 3
# What identifies a run within a model and training set: runs of two training sets that
# share it are paired.
PAIRING_COLUMNS = ("seed", "shots")
# A paired variance resting on fewer common (seed, shots) than this says so in the member's reason.
MIN_SOLID_PAIRS = 6

POOLED_COLUMNS = (
    "scope",
    "x",
    "y",
    "k",
    "r",
    "ci_low",
    "ci_high",
    "p",
    "p_adj",
    "pi_low",
    "pi_high",
    "tau2",
    "i2",
    "q",
    "welch_p",
    "welch_p_adj",
    "q_p",
    "n_agree",
    "trend",
    "trend_new_model",
    "primary",
    "n_left_out",
    "reason",
)
MEMBER_COLUMNS = (
    "scope",
    "model",
    "train_set",
    "x",
    "y",
    "n_runs",
    "r",
    "ci_low",
    "ci_high",
    "z",
    "z_se",
    "z_dof",
    "paired_corr",
    "seed_corr",
    "weight",
    "reason",
)


@dataclasses.dataclass(frozen=True)
class RandomEffects:
    """A random-effects meta-analysis on the scale of its inputs (here Fisher z).

    `se` is the model-based standard error 1 / sqrt(sum w); the interval
    [ci_low, ci_high] and `p` use the HKSJ variance (module docstring);
    `weights` are the relative weights w_i / sum w, in input order.
    """

    k: int
    mu: float
    se: float
    ci_low: float
    ci_high: float
    p: float
    tau2: float
    i2: float
    q: float
    q_p: float
    pi_low: float
    pi_high: float
    weights: np.ndarray


def random_effects(effects: np.ndarray, variances: np.ndarray, *, estimator: str = REML) -> RandomEffects:
    """Combine k >= 2 effects with known within-study variances (> 0) under random effects."""
    if estimator not in TAU2_ESTIMATORS:
        raise ValueError(f"estimator must be one of {TAU2_ESTIMATORS}, got {estimator!r}")
    y, v = np.asarray(effects, dtype=float), np.asarray(variances, dtype=float)
    k = y.size
    if k < 2 or v.shape != y.shape:
        raise ValueError(f"need at least two effects, each with a variance; got {y.shape}, {v.shape}")
    if not (np.isfinite(y).all() and np.isfinite(v).all() and (v > 0).all()):
        raise ValueError("effects must be finite and variances finite and positive")

    fixed = 1.0 / v
    q = _weighted_squares(y, fixed)
    tau2 = _TAU2[estimator](y, v)
    w = 1.0 / (v + tau2)
    mu = float(w @ y / w.sum())
    se = float(np.sqrt(1.0 / w.sum()))
    hksj_scale = _weighted_squares(y, w) / (k - 1)
    hksj_se = se * np.sqrt(max(1.0, hksj_scale))
    t_ci = scipy.stats.t.ppf(0.5 + CONFIDENCE / 2, k - 1)
    typical_variance = (k - 1) * fixed.sum() / (fixed.sum() ** 2 - (fixed**2).sum())
    if k >= 3:
        half_width = scipy.stats.t.ppf(0.5 + CONFIDENCE / 2, k - 2) * np.sqrt(tau2 + se**2)
        pi_low, pi_high = mu - half_width, mu + half_width
    else:
        pi_low = pi_high = np.nan
    return RandomEffects(
        k=k,
        mu=mu,
        se=se,
        ci_low=mu - t_ci * hksj_se,
        ci_high=mu + t_ci * hksj_se,
        p=float(2.0 * scipy.stats.t.sf(abs(mu) / hksj_se, k - 1)),
        tau2=tau2,
        i2=tau2 / (tau2 + typical_variance),
        q=q,
        q_p=float(scipy.stats.chi2.sf(q, k - 1)),
        pi_low=float(pi_low),
        pi_high=float(pi_high),
        weights=w / w.sum(),
    )


def welch_test(effects: np.ndarray, variances: np.ndarray, counts: np.ndarray) -> float:
    """p of Welch's test that k means are equal, each mean's variance estimated from its
    `counts` observations: F = (Q / (k - 1)) / (1 + 2 (k - 2) L / (k^2 - 1)) with
    L = sum (1 - w_i / sum w)^2 / (m_i - 1), on k - 1 and (k^2 - 1) / (3 L) degrees of
    freedom, Q weighted by w_i = 1 / v_i about the weighted mean."""
    y, v = np.asarray(effects, dtype=float), np.asarray(variances, dtype=float)
    k = y.size
    statistic, uncertainty = _welch_statistic(y, v, np.asarray(counts, dtype=float) - 1.0)
    return float(scipy.stats.f.sf(statistic, k - 1, (k**2 - 1) / (3.0 * uncertainty)))


def bootstrap_heterogeneity(
    effects: np.ndarray, variances: np.ndarray, dof: np.ndarray, *, draws: int = BOOTSTRAP_DRAWS
) -> tuple[float, float]:
    """Welch's p by a parametric bootstrap, and Q's expectation under homogeneity, for effects whose
    variances are estimated on `dof` degrees of freedom each.

    Each draw makes the models equal (every effect the fixed-effect mean, plus normal noise of its
    variance) and re-estimates each variance as v chi^2_dof / dof: p is the share of draws, the
    observed counted in, whose Welch statistic reaches the observed one (Welch's F approximation
    rejects about 1.8 times too often at Holm's first threshold 0.05 / 21). Seeded by
    BOOTSTRAP_SEED and the inputs (to 9 decimals of z and log v), so the same inputs give the same p every time while
    pairs and studies draw afresh (one set of draws for every pair would share its Monte Carlo
    error in the tail Holm reads, 0.05 / 21); vectorised over draws.
    """
    y, v, d = (np.ascontiguousarray(a, dtype=float) for a in (effects, variances, dof))
    digest = np.round(np.concatenate([y, np.log(v)]), 9)  # its last bits, which the order of a sum moves, left out
    rng = np.random.default_rng([BOOTSTRAP_SEED, *np.frombuffer(digest.tobytes(), dtype=np.uint32)])
    w = 1.0 / v
    centre = w @ y / w.sum()
    drawn_y = centre + np.sqrt(v) * rng.standard_normal((draws, y.size))
    drawn_v = v * rng.chisquare(d, size=(draws, y.size)) / d
    observed, _ = _welch_statistic(y, v, d)
    statistics, _ = _welch_statistic(drawn_y, drawn_v, d)
    drawn_w = 1.0 / drawn_v
    drawn_mu = np.sum(drawn_w * drawn_y, axis=-1, keepdims=True) / drawn_w.sum(axis=-1, keepdims=True)
    drawn_q = np.sum(drawn_w * (drawn_y - drawn_mu) ** 2, axis=-1)
    return float((1 + np.sum(statistics >= observed)) / (draws + 1)), float(drawn_q.mean())


def _welch_statistic(y: np.ndarray, v: np.ndarray, dof: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Welch's F statistic over the last axis of effects `y` with variances `v` on `dof` degrees of
    freedom (welch_test), and its L."""
    k, w = y.shape[-1], 1.0 / v
    mu = np.sum(w * y, axis=-1, keepdims=True) / w.sum(axis=-1, keepdims=True)
    spread = np.sum(w * (y - mu) ** 2, axis=-1) / (k - 1)
    uncertainty = np.sum((1.0 - w / w.sum(axis=-1, keepdims=True)) ** 2 / dof, axis=-1)
    return spread / (1.0 + 2.0 * (k - 2) * uncertainty / (k**2 - 1)), uncertainty


def meta_analyse(
    groups: pd.DataFrame,
    models: Mapping[str, ModelInfo],
    runs: pd.DataFrame,
    *,
    estimator: str = REML,
    padjust: str = "holm",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each pair's model-level results combined across models, per training set and, when
    there are several, over all of them (scope ALL_TRAIN_SETS).

    `groups` is `combine_runs`' table (its r, z and z_se per model, training
    set and pair) of the run-level pairs `runs` (`all_run_pairs`: their seed,
    shots and r pair the training sets' runs); `models` orders members by
    family and size. Returns the pooled rows (POOLED_COLUMNS; each adjusted
    column adjusts the pairs of one scope as one family) and the member rows
    (MEMBER_COLUMNS: each model's estimate and its relative weight, NaN with
    the group's reason where it is left out).
    """
    groups = in_first_seen_order(groups)
    train_sets = list(dict.fromkeys(groups["train_set"]))
    scopes = {name: groups[groups["train_set"] == name].assign(paired_corr=np.nan) for name in train_sets}
    shared = groups.groupby(["x", "y"], sort=False)["train_set"].transform("nunique") == len(train_sets)
    if len(train_sets) > 1 and shared.any():
        scopes[ALL_TRAIN_SETS] = per_model(groups[shared], runs)
    primary = primary_scope(train_sets)
    pooled, members = [], []
    for scope, scoped in scopes.items():
        rows = []
        for (x, y), pair in _ordered(scoped, models).groupby(["x", "y"], sort=False):
            row, weights = _combine_models(pair, estimator)
            rows.append({"scope": scope, "x": x, "y": y} | row | {"primary": scope == primary})
            members.append(pair.assign(scope=scope, weight=weights)[list(MEMBER_COLUMNS)])
        family = pd.DataFrame(rows)
        for column in ("p", "welch_p"):
            family[f"{column}_adj"] = adjust_pvalues(family[column].to_numpy(), padjust)
        pooled.append(family)
    return (
        pd.concat(pooled, ignore_index=True)[list(POOLED_COLUMNS)],
        pd.concat(members, ignore_index=True),
    )


def primary_scope(train_sets: list[str]) -> str:
    """The scope whose pairs are the study's one family of tests: every training set together
    (ALL_TRAIN_SETS, the pairs that every training set defines) when there are several, else the one."""
    return ALL_TRAIN_SETS if len(train_sets) > 1 else train_sets[0]


def trend(low: float, high: float) -> str:
    """What an interval of r says of a trend (TRENDS): positive or negative where it excludes 0,
    none where it lies within +-TREND_MARGIN, undetermined otherwise (or undefined)."""
    if low > 0.0:
        return "positive"
    if high < 0.0:
        return "negative"
    if -TREND_MARGIN < low and high < TREND_MARGIN:
        return "none"
    return "undetermined"


def trend_summary(pooled: pd.DataFrame) -> str:
    """One sentence on the primary scope's pairs: how many show a trend, or exclude one, by their
    pooled and prediction intervals (never by a p above a threshold)."""
    primary = pooled[pooled["primary"]]
    if primary.empty:
        return ""
    pooled_counts = primary["trend"].value_counts()
    new_counts = primary["trend_new_model"].value_counts()

    def counted(counts: pd.Series) -> str:
        return ", ".join(f"{counts.get(name, 0)} {name}" for name in TRENDS)

    return (
        f"Primary scope ({primary['scope'].iloc[0]}, {len(primary)} pairs, adjusted together): by the pooled "
        f"95% interval, {counted(pooled_counts)} (none: every |r| of {TREND_MARGIN} or more excluded, "
        f"the only ground for 'no overarching trend'); by the 95% prediction interval for a new model, "
        f"{counted(new_counts)}."
    )


def per_model(groups: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """`groups` (combine_runs' rows) with each model's training sets combined into one row per pair,
    its train_set ALL_TRAIN_SETS (module docstring): z the mean of the training sets' z, z_se the
    root of its paired or unpaired variance with degrees of freedom z_dof, paired_corr the
    training sets' estimated correlation (the mean over pairs of sets when more than two; NaN
    when unpaired), seed_corr the within-seed correlation of the paired averages (pooled over
    models and pairs), n_runs their runs; r and the t interval from them.
    `runs` are the run-level rows whose seed and shots pair the training sets' runs.
    Training sets without a within-model variance are left out of the mean; a model with none
    keeps one row without an estimate, its training sets' reasons joined."""
    run_z = _run_z_by_pair(runs)
    column = {name: groups[name].to_numpy() for name in ("train_set", "z", "z_se", "z_dof", "n_runs", "reason")}
    indices = groups.groupby(["model", "x", "y"], sort=False).indices
    members = []
    for (model, x, y), at in sorted(indices.items(), key=lambda item: item[1][0]):
        usable = at[column["z_se"][at] > 0]  # NaN (undefined, one run) compares False
        train_sets, keys, paired = run_z.get((model, *sorted((x, y))), ([], None, None))
        if paired is not None and usable.size:
            paired = paired[:, [train_sets.index(name) for name in column["train_set"][usable]]]
        full = None  # every run of two or more training sets paired: their run z and (seed, shots)
        if paired is not None and keys is not None and usable.size >= 2 and len(paired) >= 2:
            full = (paired, keys) if np.isfinite(paired).all() else None
        members.append((model, x, y, at, usable, paired, full))
    averages = [
        pd.DataFrame({"model": model, "x": x, "y": y, "z": full[0].mean(axis=1)}, index=full[1]).reset_index()
        for model, x, y, _, _, _, full in members
        if full is not None
    ]
    rho = seed_correlation(anova_tables(pd.concat(averages), ["model", "x", "y"])) if averages else np.nan
    rows = []
    for model, x, y, at, usable, paired, full in members:
        row = {"model": model, "train_set": ALL_TRAIN_SETS, "x": x, "y": y, "n_runs": int(column["n_runs"][at].sum())}
        if usable.size == 0:
            reasons = "; ".join(
                dict.fromkeys(f"{t}: {why}" for t, why in zip(column["train_set"][at], column["reason"][at]))
            )
            rows.append(row | {"reason": f"no training set with a variance across runs ({reasons})"})
            continue
        common: float
        if full is not None:
            variance, dof = clustered_variance(full[0].mean(axis=1), full[1].get_level_values(SEED).to_numpy(), rho)
            corr, common = _mean_paired_correlation(full[0]), len(full[0])
            row |= {"seed_corr": rho}
        else:
            v, dofs = column["z_se"][usable] ** 2, column["z_dof"][usable].astype(float)
            variance, dof, corr, common = _pooled_variance(v, dofs, paired)
        row |= {"z": float(column["z"][usable].mean()), "z_se": float(np.sqrt(variance)), "z_dof": dof}
        few = f"variance from {common} paired runs (fewer than {MIN_SOLID_PAIRS})" if common < MIN_SOLID_PAIRS else ""
        rows.append(row | {"paired_corr": corr, "reason": few})
    combined = pd.DataFrame(rows, columns=["model", "train_set", "x", "y", "n_runs", *_PER_MODEL_STATS, "reason"])
    half_width = scipy.stats.t.ppf(0.5 + CONFIDENCE / 2, combined["z_dof"]) * combined["z_se"]
    return combined.assign(
        r=np.tanh(combined["z"]),
        ci_low=np.tanh(combined["z"] - half_width),
        ci_high=np.tanh(combined["z"] + half_width),
    )


_PER_MODEL_STATS = ("z", "z_se", "z_dof", "paired_corr", "seed_corr")


def _mean_paired_correlation(paired: np.ndarray) -> float:
    """The mean over pairs of training sets of their run z's correlation (NaN where one is constant)."""
    correlations = [
        float(np.corrcoef(paired[:, s], paired[:, u])[0, 1]) if np.ptp(paired[:, [s, u]], axis=0).min() > 0 else np.nan
        for s, u in itertools.combinations(range(paired.shape[1]), 2)
    ]
    return float(np.mean(correlations))


def _run_z_by_pair(runs: pd.DataFrame) -> dict[tuple[str, str, str], tuple[list[str], pd.MultiIndex, np.ndarray]]:
    """Each (model, x, y)'s run z (as combine_runs takes them): the training sets, the (seed, shots) of
    each row, and a matrix of one row per (seed, shots) and one column per training set, NaN where a
    run leaves the pair undefined or is missing; x and y sorted, since r is symmetric."""
    in_order = runs["x"] <= runs["y"]
    low, high = runs["x"].where(in_order, runs["y"]), runs["y"].where(in_order, runs["x"])
    z = fisher_z(runs["r"].to_numpy(dtype=float))
    keys = ["model", "low", "high", *PAIRING_COLUMNS, "train_set"]
    table = runs.assign(low=low, high=high, z=z).set_index(keys)["z"].unstack("train_set")  # sorted by key
    codes, uniques = pd.factorize(table.index.droplevel(list(PAIRING_COLUMNS)))
    starts = np.flatnonzero(np.diff(codes, prepend=-1))
    values, train_sets = table.to_numpy(), list(table.columns)
    pairing = table.index.droplevel(["model", "low", "high"])
    return {
        uniques[codes[start]]: (train_sets, pairing[start:end], values[start:end])
        for start, end in zip(starts, [*starts[1:], len(codes)])
    }


def _pooled_variance(v: np.ndarray, dof: np.ndarray, paired: np.ndarray | None) -> tuple[float, float, float, float]:
    """The variance of the mean of training sets' z whose variances are `v` on `dof` degrees of
    freedom where their runs are partly paired, its degrees of freedom, the training sets' mean
    paired correlation and the fewest common runs (module docstring); `paired` holds their run z,
    one row per (seed, shots), one column per training set. Unpaired (fewer than MIN_PAIRED_RUNS
    common runs for some two sets, or one set): sum v / T^2 on Welch-Satterthwaite's degrees of
    freedom, correlation NaN, and inf common runs."""
    t = v.size
    unpaired = float(v.sum() / t**2), float(v.sum() ** 2 / np.sum(v**2 / dof)), np.nan, np.inf
    if t < 2 or paired is None:
        return unpaired
    counts = np.isfinite(paired).sum(axis=0)
    total, correlations, common_counts = v.sum(), [], []
    for s, u in itertools.combinations(range(t), 2):
        common = paired[:, [s, u]][np.isfinite(paired[:, [s, u]]).all(axis=1)]
        if len(common) < MIN_PAIRED_RUNS or np.ptp(common, axis=0).min() == 0:
            return unpaired
        corr = float(np.corrcoef(common.T)[0, 1])
        total += 2 * corr * np.sqrt(v[s] * v[u]) * len(common) / np.sqrt(counts[s] * counts[u])
        correlations.append(corr)
        common_counts.append(len(common))
    return float(total / t**2), float(min(common_counts) - 1), float(np.mean(correlations)), min(common_counts)


def _combine_models(pair: pd.DataFrame, estimator: str) -> tuple[dict, np.ndarray]:
    """The pooled row of one pair in one scope, and each member's relative weight (NaN where
    it is left out for want of an r with a within-model variance)."""
    usable = (pair["z_se"] > 0).to_numpy()  # NaN (undefined, one run) compares False
    weights = np.full(len(pair), np.nan)
    row = dict.fromkeys(POOLED_COLUMNS[3:], np.nan) | {
        "trend": "undetermined",
        "trend_new_model": "undetermined",
        "k": int(usable.sum()),
        "n_left_out": int((~usable).sum()),
        "reason": "",
    }
    if usable.sum() < 2:
        return row | {"reason": f"{row['k']} model(s) with a variance across runs: a meta-analysis needs two"}, weights
    z, variances = pair["z"].to_numpy()[usable], pair["z_se"].to_numpy()[usable] ** 2
    result = random_effects(z, variances, estimator=estimator)
    welch_p, expected_q = bootstrap_heterogeneity(z, variances, pair["z_dof"].to_numpy()[usable])
    weights[usable] = result.weights
    row |= {
        "r": np.tanh(result.mu),
        "ci_low": np.tanh(result.ci_low),
        "ci_high": np.tanh(result.ci_high),
        "p": result.p,
        "pi_low": np.tanh(result.pi_low),
        "pi_high": np.tanh(result.pi_high),
        "tau2": result.tau2,
        "i2": max(0.0, (result.q - expected_q) / result.q) if result.q > 0 else 0.0,
        "q": result.q,
        "q_p": result.q_p,
        "welch_p": welch_p,
        "n_agree": int((np.sign(z) == np.sign(result.mu)).sum()),
        "trend": trend(np.tanh(result.ci_low), np.tanh(result.ci_high)),
        "trend_new_model": trend(np.tanh(result.pi_low), np.tanh(result.pi_high)),
    }
    if result.k < 3:
        row["reason"] = "two models: no prediction interval (needs three)"
    return row, weights


def _ordered(groups: pd.DataFrame, models: Mapping[str, ModelInfo]) -> pd.DataFrame:
    """Members by family, size (unknown last), model and training set, as tables list them."""
    keys = ["family", "size_billions", *GROUP_COLUMNS]
    return (
        groups.assign(
            family=groups["model"].map(lambda model: models[model].family),
            size_billions=groups["model"].map(lambda model: models[model].size_billions),
        )
        .sort_values(keys, kind="stable")
        .drop(columns=keys[:2])
    )


def _weighted_squares(y: np.ndarray, w: np.ndarray) -> float:
    """sum w (y - mu_w)^2 about the w-weighted mean mu_w: Q for w = 1 / v."""
    return float(w @ (y - w @ y / w.sum()) ** 2)


def _tau2_dersimonian_laird(y: np.ndarray, v: np.ndarray) -> float:
    """The one-step moment estimate: (Q - (k - 1)) / (sum w - sum w^2 / sum w), at least 0."""
    w = 1.0 / v
    q = _weighted_squares(y, w)
    return float(max(0.0, (q - (y.size - 1)) / (w.sum() - (w**2).sum() / w.sum())))


def _tau2_paule_mandel(y: np.ndarray, v: np.ndarray) -> float:
    """The tau^2 at which the generalised Q, sum w (y - mu_w)^2, equals its expectation k - 1.

    Q falls as tau^2 grows, so the root is unique; at tau^2 = sum (y - mean y)^2 / (k - 1)
    every w is below 1 / tau^2, so Q is below k - 1 there and the root lies between.
    """

    def excess(tau2: float) -> float:
        return _weighted_squares(y, 1.0 / (v + tau2)) - (y.size - 1)

    if excess(0.0) <= 0.0:
        return 0.0
    return float(scipy.optimize.brentq(excess, 0.0, np.sum((y - y.mean()) ** 2) / (y.size - 1), xtol=1e-15, rtol=1e-13))


def _tau2_reml(y: np.ndarray, v: np.ndarray) -> float:
    """The tau^2 >= 0 that maximises the restricted log-likelihood
    -1/2 (sum log(v + tau^2) + log sum w + sum w (y - mu_w)^2), w = 1 / (v + tau^2):
    the root of its score, twice its derivative, sum w^2 (y - mu_w)^2 - sum w +
    sum w^2 / sum w; 0 when the score is not positive at 0. The score is negative for
    large tau^2, so the upper end of the bracket doubles until it is.
    """

    def score(tau2: float) -> float:
        w = 1.0 / (v + tau2)
        mu = w @ y / w.sum()
        return float((w**2) @ (y - mu) ** 2 - w.sum() + (w**2).sum() / w.sum())

    if score(0.0) <= 0.0:
        return 0.0
    upper = max(np.var(y), v.max())
    while score(upper) > 0.0:
        upper *= 2.0
    return float(scipy.optimize.brentq(score, 0.0, upper, xtol=1e-15, rtol=1e-13))


_TAU2 = {
    REML: _tau2_reml,
    PAULE_MANDEL: _tau2_paule_mandel,
    DERSIMONIAN_LAIRD: _tau2_dersimonian_laird,
}
