"""Same-seed runs: how alike they are, and the variance of a mean over them.

The study builds each run's LoRA initialisation and dropout keys from its seed
alone (oodjax/engine/steps.py), so the 32-, 64- and 128-shot runs of one seed,
on either training set, start alike: their z are correlated, and a mean over a
model's runs varies more than the spread of its runs over their count says.

The within-seed correlation rho (an intraclass correlation) is estimated by a
seeds x shots analysis of variance of run z in every (model, training set,
pair) whose runs fill a complete seeds x shots table, shots a fixed effect (a
shot count may move every seed's r alike). In one table, SS_seed ~ sigma^2
(1 + (K - 1) rho) chi^2_{S-1} and SS_error ~ sigma^2 (1 - rho) chi^2_{(S-1)(K-1)},
so its between-seed share f = SS_seed / (SS_seed + SS_error) is lambda B /
(lambda B + 1 - B), B ~ Beta((S-1)/2, (S-1)(K-1)/2), lambda = (1 + (K - 1) rho)
/ (1 - rho): free of sigma^2, which differs between models and pairs. rho is
the value at which the mean of f over the tables equals its expectation (one
rho pooled over pairs and models: a single 3 x 3 table holds 2 and 4 degrees
of freedom, 336 tables hold enough). It is floored at 0, since a negative
estimate is noise and would shrink every variance below the independent runs'.

A mean of n runs in seed clusters of n_s runs each, runs of one seed
correlated at rho and of different seeds independent, has variance
sigma^2 (1 + rho (sum n_s^2 / n - 1)) / n, and the runs' sample variance s^2 has
expectation sigma^2 (1 - rho (sum n_s^2 - n) / (n (n - 1))): `clustered_variance`
estimates the former from the latter with the pooled rho, on the
Satterthwaite degrees of freedom of s^2's between- and within-seed parts.
A mixed model with a seed effect whose variance (as a share, rho) is pooled
across pairs and models, rather than clustering by seed: with 3 seeds a
cluster-robust variance (the spread of 3 seed means) rests on 2 degrees of
freedom per model, and every test across models would lose most of its power.
"""

import numpy as np
import pandas as pd
import scipy.integrate
import scipy.optimize
import scipy.stats

# Each (model, training set, pair) or (model, pair) table of runs: one value per seed and shot count.
SEED = "seed"
SHOTS = "shots"


def anova_tables(runs: pd.DataFrame, keys: list[str], value: str = "z") -> pd.DataFrame:
    """Per group of `keys`, the seeds x shots analysis of variance of `value` (NaN rows dropped),
    shots fixed: n_seeds, n_shots, ss_seed, ss_shots, ss_error; only groups whose runs fill a
    complete table (each seed at each shot count once, at least 2 seeds and 2 shot counts)."""
    defined = runs.dropna(subset=[value])
    sizes = defined.groupby(keys, sort=False).agg(
        n=(value, "size"), n_seeds=(SEED, "nunique"), n_shots=(SHOTS, "nunique")
    )
    cells = defined.groupby([*keys, SEED, SHOTS], sort=False).size().groupby(keys, sort=False).max()
    complete = (sizes["n"] == sizes["n_seeds"] * sizes["n_shots"]) & (cells == 1)
    complete &= (sizes["n_seeds"] >= 2) & (sizes["n_shots"] >= 2)
    chosen = defined.join(complete.rename("complete"), on=keys)
    chosen = chosen[chosen["complete"]]
    grand = chosen.groupby(keys, sort=False)[value].transform("mean")
    seed_mean = chosen.groupby([*keys, SEED], sort=False)[value].transform("mean")
    shots_mean = chosen.groupby([*keys, SHOTS], sort=False)[value].transform("mean")
    parts = chosen.assign(
        ss_seed=(seed_mean - grand) ** 2,
        ss_shots=(shots_mean - grand) ** 2,
        ss_error=(chosen[value] - seed_mean - shots_mean + grand) ** 2,
    )
    sums = parts.groupby(keys, sort=False)[["ss_seed", "ss_shots", "ss_error"]].sum()
    return sizes.loc[complete[complete].index, ["n_seeds", "n_shots"]].join(sums).reset_index()


def seed_correlation(tables: pd.DataFrame) -> float:
    """The within-seed correlation of run z pooled over `anova_tables`' rows (module docstring),
    floored at 0; NaN without a table that has a spread."""
    tables = tables[(tables["ss_seed"] + tables["ss_error"]) > 0]
    if tables.empty:
        return np.nan
    share = (tables["ss_seed"] / (tables["ss_seed"] + tables["ss_error"])).to_numpy()
    designs = tables.groupby(["n_seeds", "n_shots"]).size()

    def excess(rho: float) -> float:
        expected = sum(
            count * _expected_share(int(seeds), int(shots), rho) for (seeds, shots), count in designs.items()
        )
        return float(share.sum() - expected)

    if excess(0.0) <= 0.0:
        return 0.0
    if excess(0.999) >= 0.0:
        return 0.999
    return float(scipy.optimize.brentq(excess, 0.0, 0.999, xtol=1e-6))


def clustered_variance(z: np.ndarray, seeds: np.ndarray, rho: float) -> tuple[float, float]:
    """The variance of the mean of runs `z` in clusters by `seeds`, runs of one seed correlated
    at `rho` (module docstring), and its degrees of freedom; rho NaN or 0 gives s^2 / n on n - 1."""
    n = z.size
    _, sizes = np.unique(seeds, return_counts=True)
    rho = 0.0 if np.isnan(rho) else rho
    squares = float(np.sum(sizes.astype(float) ** 2))
    sigma2 = z.var(ddof=1) / (1.0 - rho * (squares - n) / (n * (n - 1)))
    variance = sigma2 * (1.0 + rho * (squares / n - 1.0)) / n
    clusters = sizes.size
    between_dof, within_dof = clusters - 1, n - clusters
    typical = (n - squares / n) / between_dof if between_dof else 0.0
    between = between_dof * (1.0 - rho + typical * rho)
    within = within_dof * (1.0 - rho)
    parts = [(between, between_dof), (within, within_dof)]
    dof = (between + within) ** 2 / sum(part**2 / count for part, count in parts if count)
    return float(variance), float(dof)


def _expected_share(seeds: int, shots: int, rho: float) -> float:
    """E[lambda B / (lambda B + 1 - B)], B ~ Beta((S-1)/2, (S-1)(K-1)/2), lambda from rho."""
    ratio = (1.0 + (shots - 1) * rho) / (1.0 - rho)
    beta = scipy.stats.beta((seeds - 1) / 2, (seeds - 1) * (shots - 1) / 2)
    value, _ = scipy.integrate.quad(lambda b: ratio * b / (ratio * b + 1.0 - b) * beta.pdf(b), 0.0, 1.0)
    return float(value)
