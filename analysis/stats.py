"""Partial correlations of two variables given covariates, with p-values and intervals.

The partial correlation is the Pearson correlation of the residuals of x and
y after each is fitted on the covariates (a residualiser, see residualise.py).
With k covariates and the linear residualiser it is the classical partial
correlation: p from Student's t with n - k - 2 degrees of freedom, 95%
interval tanh(atanh(r) +- z_0.975 / sqrt(n - k - 3)). With the spline
residualiser, k is replaced by its effective number of covariates, edf - 1,
where edf is the trace of the spline's hat matrix (intercept included, as
k + 1 is for least squares), taking the larger of the two fits (x's and
y's) to stay conservative; it reduces to the linear formula when the spline
is a straight line (edf = 2).

Successive evaluation steps of a run are autocorrelated, and the t test above
assumes independent rows: on null data with AR(1) noise of coefficient 0.85
over 21 steps, 10% of its p are below 0.05. `autocorrelation=True` (what
`python -m analysis` uses for its run-level rows) replaces n by an effective
sample size from the residuals' autocorrelations (`effective_sample_size`,
Bartlett's variance of a correlation between two autocorrelated series) in the
degrees of freedom and the interval; null rates at 11 to 41 steps and AR(1)
0 to 0.95 are in docs/analysis.md (`python -m analysis.null_rates`).

Undefined correlations (a column without any value, too few points, a
constant column, a variable the covariates explain entirely) are NaN with a
stated reason, never an error: in a sweep of hundreds of runs some testsets
saturate or go unevaluated, and that is data.
"""

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import pandas as pd
import scipy.stats

from analysis.padjust import adjust_pvalues
from analysis.residualise import (
    LINEAR,
    MIN_SPLINE_POINTS,
    RESIDUALISERS,
    SPLINE,
    as_covariate_matrix,
    fit,
)

PEARSON = "pearson"
SPEARMAN = "spearman"
METHODS = (PEARSON, SPEARMAN)

# Accuracies of exactly 0 or 1 have an infinite probit; they are clipped to
# [PROBIT_CLIP, 1 - PROBIT_CLIP] first (|probit| <= 3.09), i.e. treated as if
# one error in a thousand examples had been made or avoided.
PROBIT_CLIP = 1e-3

CONFIDENCE = 0.95

# Bartlett's sum in `effective_sample_size` runs over the first n // 5 lags.
POINTS_PER_BARTLETT_LAG = 5

PAIR_COLUMNS = ("x", "y", "n", "r", "ci_low", "ci_high", "p", "p_adj", "n_eff", "dof", "reason")


@dataclasses.dataclass(frozen=True)
class PartialCorrelation:
    """One partial correlation; `reason` says why r (or, for too few effective points, its p and
    interval) is NaN and is empty otherwise; `n_eff` is the sample size its p and interval
    assume (n unless corrected for autocorrelation)."""

    n: int
    n_eff: float
    r: float
    ci_low: float
    ci_high: float
    p: float
    dof: float
    reason: str = ""


def partial_corr(
    x: Sequence[float],
    y: Sequence[float],
    covar: Sequence[float] | np.ndarray,
    *,
    method: str = PEARSON,
    residualiser: str = LINEAR,
    probit: bool = False,
    differences: bool = False,
    autocorrelation: bool = False,
) -> PartialCorrelation:
    """Partial correlation of x and y given covar ([n] or [n, k]).

    Rows with a NaN anywhere are dropped. `method="spearman"` ranks x, y and
    every covariate (after dropping) before residualising. `probit=True`
    applies the probit to all variables (accuracies in [0, 1]) first, as
    "accuracy on the line" does. `differences=True` correlates first
    differences between successive rows (evaluation steps, in order), which
    removes the shared trend that makes successive steps autocorrelated.
    `autocorrelation=True` takes rows as a series in step order and tests
    with an effective sample size (module docstring).
    """
    _check_options(method, residualiser)
    x, y = _vector(x, "x"), _vector(y, "y")
    covar = as_covariate_matrix(covar)
    if not (len(x) == len(y) == len(covar)):
        raise ValueError(f"x, y and covar must have the same length, got {len(x)}, {len(y)}, {len(covar)}")
    names = ["covar"] if covar.shape[1] == 1 else [f"covar[{i}]" for i in range(covar.shape[1])]
    return _partial_corr(
        {"x": x, "y": y} | dict(zip(names, covar.T)),
        "x",
        "y",
        names,
        method=method,
        residualiser=residualiser,
        probit=probit,
        differences=differences,
        autocorrelation=autocorrelation,
        residual_cache={},
    )


def pairwise_partial_corr(
    df: pd.DataFrame,
    columns: Sequence[str] | None,
    covar: str | Sequence[str],
    *,
    method: str = PEARSON,
    residualiser: str = LINEAR,
    padjust: str = "holm",
    probit: bool = False,
    differences: bool = False,
    autocorrelation: bool = False,
) -> pd.DataFrame:
    """Partial correlation of every pair of `columns` given `covar`, adjusted for multiplicity.

    `columns=None` takes every numeric column that is not a covariate. Rows
    with a missing value in x, y or a covariate are dropped per pair. Returns
    one row per pair with columns x, y, n, r, ci_low, ci_high, p, p_adj,
    n_eff, dof, reason; p_adj adjusts the finite p-values as one family
    (`padjust`: holm, bonferroni, fdr_bh or none). With `differences=True`
    or `autocorrelation=True` the rows of `df` must be in step order.
    """
    _check_options(method, residualiser)
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame, got {type(df).__name__}")
    covariates = [covar] if isinstance(covar, str) else list(covar)
    if not covariates:
        raise ValueError("covar must name at least one column")
    if columns is None:
        columns = [c for c in df.select_dtypes("number").columns if c not in covariates]
    variables = [c for c in columns if c not in covariates]
    _check_columns(df, variables + covariates)
    if len(variables) < 2:
        raise ValueError(f"need at least two columns besides the covariates, got {variables}")

    data = {name: df[name].to_numpy(dtype=float) for name in variables + covariates}
    residual_cache: dict = {}
    rows = []
    for x, y in itertools.combinations(variables, 2):
        result = _partial_corr(
            data,
            x,
            y,
            covariates,
            method=method,
            residualiser=residualiser,
            probit=probit,
            differences=differences,
            autocorrelation=autocorrelation,
            residual_cache=residual_cache,
        )
        rows.append({"x": x, "y": y} | dataclasses.asdict(result))
    table = pd.DataFrame(rows)
    table["p_adj"] = adjust_pvalues(table["p"].to_numpy(), padjust)
    return table[list(PAIR_COLUMNS)]


def fisher_interval(r: float, se: float) -> tuple[float, float]:
    """CONFIDENCE interval of a correlation: symmetric on the Fisher z scale."""
    half_width = scipy.stats.norm.ppf(0.5 + CONFIDENCE / 2) * se
    with np.errstate(divide="ignore"):  # r = +-1 gives z = +-inf and the interval [r, r]
        z = np.arctanh(r)
    return float(np.tanh(z - half_width)), float(np.tanh(z + half_width))


def correlation_pvalue(r: float, dof: float) -> float:
    """Two-sided p of H0: rho = 0, from t = r sqrt(dof / (1 - r^2)) ~ t(dof)."""
    if abs(r) == 1.0:
        return 0.0
    t = r * np.sqrt(dof / (1.0 - r**2))
    return float(2.0 * scipy.stats.t.sf(abs(t), dof))


def probit_transform(values: np.ndarray, name: str) -> np.ndarray:
    """Probit of accuracies, clipped to [PROBIT_CLIP, 1 - PROBIT_CLIP]."""
    outside = (values < 0) | (values > 1)
    if outside.any():
        raise ValueError(f"probit needs accuracies in [0, 1]; column {name!r} has {values[outside][:3]}")
    return scipy.stats.norm.ppf(np.clip(values, PROBIT_CLIP, 1.0 - PROBIT_CLIP))


def _partial_corr(
    data: dict[str, np.ndarray],
    x: str,
    y: str,
    covariates: list[str],
    *,
    method: str,
    residualiser: str,
    probit: bool,
    differences: bool,
    autocorrelation: bool,
    residual_cache: dict,
) -> PartialCorrelation:
    """Core of both public functions; `residual_cache` reuses fits across pairs."""
    if residualiser == SPLINE and len(covariates) != 1:
        raise ValueError(f"the spline residualiser takes exactly one covariate, got {covariates}")
    names = [x, y, *covariates]
    table = np.column_stack([data[name] for name in names])
    if np.isinf(table).any():
        bad = [name for name, column in zip(names, table.T) if np.isinf(column).any()]
        raise ValueError(f"infinite values in {bad}; use NaN for missing values")
    # A column without any value (a testset never evaluated) would otherwise read as
    # "too few points: n=0", which hides which column is empty.
    empty = [name for name, column in zip(names, table.T) if np.isnan(column).all()]
    if empty:
        return PartialCorrelation(
            0, np.nan, np.nan, np.nan, np.nan, np.nan, np.nan, f"no value in {', '.join(map(repr, empty))}: all NaN"
        )
    if probit:
        table = np.column_stack([probit_transform(c, n) for c, n in zip(table.T, names)])
    if differences:
        table = np.diff(table, axis=0)
    keep = ~np.isnan(table).any(axis=1)
    table = table[keep]
    n, k = len(table), len(covariates)

    def undefined(reason: str) -> PartialCorrelation:
        return PartialCorrelation(n, np.nan, np.nan, np.nan, np.nan, np.nan, np.nan, reason)

    if n < k + 4:
        return undefined(f"too few points: n={n}, needs at least k + 4 = {k + 4}")
    constant = [name for name, column in zip(names, table.T) if np.ptp(column) == 0]
    if constant:
        return undefined(f"constant column: {', '.join(map(repr, constant))}")
    if residualiser == SPLINE and np.unique(table[:, 2]).size < MIN_SPLINE_POINTS:
        return undefined(
            f"spline needs at least {MIN_SPLINE_POINTS} distinct covariate values, got {np.unique(table[:, 2]).size}"
        )
    if method == SPEARMAN:
        table = np.column_stack([scipy.stats.rankdata(column) for column in table.T])

    covar = table[:, 2:]
    residuals, edfs = [], []
    for name, column in ((x, table[:, 0]), (y, table[:, 1])):
        key = (name, keep.tobytes())
        if key not in residual_cache:
            fitted = fit(covar, column, residualiser)
            residual_cache[key] = (column - fitted.fitted, fitted.edf)
        residual, edf = residual_cache[key]
        if np.std(residual) <= 1e-12 * np.std(column):
            return undefined(f"{name!r} is fully explained by the covariates")
        residuals.append(residual)
        edfs.append(edf)

    r = float(np.clip(np.corrcoef(residuals[0], residuals[1])[0, 1], -1.0, 1.0))
    effective_k = k if residualiser == LINEAR else max(edfs) - 1.0
    if n - effective_k - 2.0 <= 1.0:
        return undefined(f"too few points for the spline's {max(edfs):.1f} effective parameters: n={n}")
    n_eff = effective_sample_size(*residuals) if autocorrelation else float(n)
    dof = n_eff - effective_k - 2.0
    if dof <= 1.0:  # r stands; what it would take to test it is missing
        return PartialCorrelation(
            n,
            n_eff,
            r,
            np.nan,
            np.nan,
            np.nan,
            dof,
            f"no test: n_eff={n_eff:.1f} of n={n} (autocorrelated steps), {effective_k + 1:.1f} effective parameters",
        )
    ci_low, ci_high = fisher_interval(r, 1.0 / np.sqrt(dof - 1.0))
    return PartialCorrelation(n, n_eff, r, ci_low, ci_high, correlation_pvalue(r, dof), dof)


def effective_sample_size(x: np.ndarray, y: np.ndarray) -> float:
    """How many independent pairs the correlation of x and y (rows in step order) is worth, by
    Bartlett's (1946) variance of a correlation between two autocorrelated series,
    n / (1 + 2 sum_k a_x(k) a_y(k)), a the autocorrelations at lags k >= 1, read two ways; the
    smaller is kept, and never more than n:
    - AR(1): the lag-1 autocorrelations extrapolated geometrically, n (1 - a b) / (1 + a b);
    - the sum itself over the first n // POINTS_PER_BARTLETT_LAG lags (truncated as Pyper and Peterman 1998 do),
      which sees what a smoother leaves at longer lags; without it, spline residuals over 41
      evaluations of AR(1) 0.95 noise put 10-12% of null p below 0.05 (docs/analysis.md).
    Lag-1 autocorrelations are clipped at 0 in both: a negative one comes from the
    residualiser itself, and its product would make the test conservative."""
    n = len(x)
    lags = max(1, n // POINTS_PER_BARTLETT_LAG)
    a_x, a_y = _autocorrelations(x, lags), _autocorrelations(y, lags)
    a_x[0], a_y[0] = max(a_x[0], 0.0), max(a_y[0], 0.0)
    lag1 = a_x[0] * a_y[0]
    ar1 = n * (1.0 - lag1) / (1.0 + lag1)
    summed = n / (1.0 + 2.0 * max(float(a_x @ a_y), 0.0))
    return float(min(ar1, summed))


def _autocorrelations(series: np.ndarray, lags: int) -> np.ndarray:
    """Sample autocorrelations at lags 1..lags."""
    centred = series - series.mean()
    return np.array([centred[lag:] @ centred[:-lag] for lag in range(1, lags + 1)]) / (centred @ centred)


def _check_options(method: str, residualiser: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if residualiser not in RESIDUALISERS:
        raise ValueError(f"residualiser must be one of {RESIDUALISERS}, got {residualiser!r}")


def _check_columns(df: pd.DataFrame, names: list[str]) -> None:
    missing = [name for name in names if name not in df.columns]
    if missing:
        raise ValueError(f"columns not in the DataFrame: {missing}; it has {list(df.columns)}")
    not_numeric = [name for name in names if not pd.api.types.is_numeric_dtype(df[name])]
    if not_numeric:
        raise ValueError(f"columns are not numeric: {not_numeric}")


def _vector(values: Sequence[float], name: str) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    if values.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {values.shape}")
    return values
