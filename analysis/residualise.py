"""Residualisers: fits of a variable on the covariates, whose residuals are correlated.

A fit also reports its effective number of parameters (the trace of its hat
matrix, intercept included), which sets the degrees of freedom of the
partial correlation: k + 1 for least squares on k covariates, and between 2
and the number of distinct covariate values for a smoothing spline.
"""

import dataclasses
from collections.abc import Callable

import numpy as np
import scipy.optimize
from scipy.interpolate import make_smoothing_spline

LINEAR = "linear"
SPLINE = "spline"
RESIDUALISERS = (LINEAR, SPLINE)

# A natural cubic smoothing spline needs at least this many distinct abscissae.
MIN_SPLINE_POINTS = 5

# A spline fit to n points may spend at most n / SPLINE_POINTS_PER_EDF effective
# parameters, between MIN_SPLINE_EDF (a line and one bend) and MAX_SPLINE_EDF
# (mgcv's default basis, k = 10): two thirds of a short run's points are left
# to its residuals (a fixed cap of 10 left 42-60% of 11-evaluation runs without
# a test). Without a cap, GCV has a well-known degenerate minimum at
# near-interpolation when two covariate values almost coincide.
MAX_SPLINE_EDF = 10.0
MIN_SPLINE_EDF = 3.0
SPLINE_POINTS_PER_EDF = 3.0

# Smoothing parameters searched by GCV, as log10(lambda) on a covariate rescaled
# to [0, 1]: from near interpolation to a straight line for any realistic n.
_LOG_LAMBDA_GRID = np.arange(-10.0, 4.0001, 0.05)


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted residualiser: fitted values at the data, a curve for new covariate rows
    (`predict`, used to draw the fit), and the effective number of parameters."""

    fitted: np.ndarray
    predict: Callable[[np.ndarray], np.ndarray]
    edf: float


def as_covariate_matrix(covar: np.ndarray) -> np.ndarray:
    """Covariates as an [n, k] float matrix (a vector is one covariate)."""
    covar = np.asarray(covar, dtype=float)
    return covar[:, None] if covar.ndim == 1 else covar


def fit(covar: np.ndarray, y: np.ndarray, residualiser: str) -> Fit:
    if residualiser == LINEAR:
        return fit_linear(covar, y)
    if residualiser == SPLINE:
        return fit_spline(covar, y)
    raise ValueError(f"residualiser must be one of {RESIDUALISERS}, got {residualiser!r}")


def fit_linear(covar: np.ndarray, y: np.ndarray) -> Fit:
    """Least squares with an intercept; covariates standardised first for conditioning."""
    covar = as_covariate_matrix(covar)
    centre, scale = covar.mean(axis=0), covar.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)

    def design(c: np.ndarray) -> np.ndarray:
        standardised = (as_covariate_matrix(c) - centre) / scale
        return np.column_stack([np.ones(len(standardised)), standardised])

    coef, _, rank, _ = np.linalg.lstsq(design(covar), y, rcond=None)
    return Fit(fitted=design(covar) @ coef, predict=lambda c: design(c) @ coef, edf=float(rank))


def fit_spline(covar: np.ndarray, y: np.ndarray) -> Fit:
    """Penalised cubic smoothing spline of y on one covariate, smoothing chosen by GCV.

    The spline minimises sum (y_i - f(x_i))^2 + lambda * integral f''^2
    (scipy's make_smoothing_spline); lambda minimises generalised
    cross-validation, GCV = n RSS / (n - edf)^2, over a log grid refined by
    bounded Brent search, among fits with at most `max_spline_edf(n)` effective
    parameters. The covariate is rescaled to [0, 1] so that the searched range
    of lambda does not depend on its units.

    Ties in the covariate: the spline is fitted to the mean of y at each
    distinct covariate value, weighted by the number of points there. That is
    exactly the least-squares problem on all points (the within-tie scatter is
    a constant), and GCV is evaluated on all n points: its RSS includes the
    within-tie scatter, and the hat matrix on all points has the same trace.
    """
    covar = as_covariate_matrix(covar)
    if covar.shape[1] != 1:
        raise ValueError(f"the spline residualiser takes exactly one covariate, got {covar.shape[1]}")
    values, group, counts = np.unique(covar[:, 0], return_inverse=True, return_counts=True)
    if values.size < MIN_SPLINE_POINTS:
        raise ValueError(
            f"the spline residualiser needs at least {MIN_SPLINE_POINTS} distinct covariate values, got {values.size}"
        )
    low, span = values[0], values[-1] - values[0]
    knots = (values - low) / span
    means = np.bincount(group, weights=y) / counts
    smoother = SplineSmoother(knots, counts.astype(float))
    within_ties = float(np.sum((y - means[group]) ** 2))
    cap = max_spline_edf(y.size)

    def gcv(log_lambda: np.ndarray) -> np.ndarray:
        edf = smoother.edf(log_lambda)
        rss = within_ties + smoother.weighted_rss(means, log_lambda)
        score = y.size * rss / (y.size - edf) ** 2
        return np.where(edf > cap, np.inf, score)

    scores = gcv(_LOG_LAMBDA_GRID)
    best = int(np.argmin(scores))
    # Refine between the grid neighbours; edf falls as lambda grows, so only the
    # smaller neighbour can be over the edf cap.
    lower = best - 1 if best > 0 and np.isfinite(scores[best - 1]) else best
    upper = min(best + 1, scores.size - 1)
    refined = scipy.optimize.minimize_scalar(
        lambda value: float(gcv(np.array([value]))[0]),
        bounds=(_LOG_LAMBDA_GRID[lower], _LOG_LAMBDA_GRID[upper]),
        method="bounded",
        options={"xatol": 1e-4},
    )
    log_lambda = refined.x if refined.fun < scores[best] else _LOG_LAMBDA_GRID[best]
    chosen = np.array([log_lambda])
    spline = make_smoothing_spline(knots, means, w=counts, lam=10.0**log_lambda)
    return Fit(
        fitted=smoother.fitted(means, chosen)[0][group],
        predict=lambda c: spline((as_covariate_matrix(c)[:, 0] - low) / span),
        edf=float(smoother.edf(chosen)[0]),
    )


def max_spline_edf(n: int) -> float:
    """The most effective parameters a spline fit to n points may spend (see SPLINE_POINTS_PER_EDF)."""
    return float(np.clip(n / SPLINE_POINTS_PER_EDF, MIN_SPLINE_EDF, MAX_SPLINE_EDF))


class SplineSmoother:
    """The hat matrix of a weighted cubic smoothing spline for every lambda at once.

    With W = diag(weights) and Omega the roughness matrix of natural cubic
    splines through the knots (integral f''^2 = f' Omega f; Green and
    Silverman 1994, section 2.1), the fitted values are S y with
    S = (W + lambda Omega)^-1 W. In the coordinates u = W^1/2 f, S is
    E diag(1 / (1 + lambda d)) E' for the eigenpairs (d, E) of
    W^-1/2 Omega W^-1/2 (Demmler-Reinsch), so its trace and fitted values
    cost O(knots) per lambda: that makes a GCV search affordable, and scipy
    does not expose the trace. Straight lines are not penalised; their two
    modes are given eigenvalue 0 exactly, and the rest is decomposed on
    their complement, so that large lambda gives exactly the weighted
    least-squares line despite Omega's wide range of scales.
    """

    def __init__(self, knots: np.ndarray, weights: np.ndarray):
        root_weights = np.sqrt(weights)
        lines = root_weights[:, None] * np.column_stack([np.ones_like(knots), knots])
        basis, _ = np.linalg.qr(lines, mode="complete")
        line_modes, rest = basis[:, :2], basis[:, 2:]
        scaled = roughness_matrix(knots) / np.outer(root_weights, root_weights)
        eigenvalues, rotation = np.linalg.eigh(rest.T @ scaled @ rest)
        self.eigenvalues = np.concatenate([[0.0, 0.0], np.maximum(eigenvalues, 0.0)])
        self.eigenvectors = np.column_stack([line_modes, rest @ rotation])
        self.root_weights = root_weights

    def shrinkage(self, log_lambda: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + 10.0 ** np.asarray(log_lambda)[:, None] * self.eigenvalues)

    def edf(self, log_lambda: np.ndarray) -> np.ndarray:
        """Trace of the hat matrix for each log10(lambda)."""
        return self.shrinkage(log_lambda).sum(axis=1)

    def fitted(self, y: np.ndarray, log_lambda: np.ndarray) -> np.ndarray:
        """Fitted values at the knots, [len(log_lambda), knots]."""
        smoothed = (self.shrinkage(log_lambda) * self._coefficients(y)) @ self.eigenvectors.T
        return smoothed / self.root_weights

    def weighted_rss(self, y: np.ndarray, log_lambda: np.ndarray) -> np.ndarray:
        """sum_i w_i (y_i - f_i)^2 for each log10(lambda)."""
        removed = (1.0 - self.shrinkage(log_lambda)) * self._coefficients(y)
        return np.sum(removed**2, axis=1)

    def _coefficients(self, y: np.ndarray) -> np.ndarray:
        return self.eigenvectors.T @ (self.root_weights * y)


def roughness_matrix(knots: np.ndarray) -> np.ndarray:
    """Omega = Q R^-1 Q' with integral f''^2 = f' Omega f for the natural cubic spline through f.

    Q ([m, m-2]) takes second divided differences and R ([m-2, m-2]) is the
    tridiagonal Gram matrix of the spline's second derivatives at the interior
    knots (Green and Silverman 1994, eqs. 2.1-2.3).
    """
    h = np.diff(knots)
    interior = np.arange(knots.size - 2)
    q = np.zeros((knots.size, knots.size - 2))
    q[interior, interior] = 1.0 / h[:-1]
    q[interior + 1, interior] = -1.0 / h[:-1] - 1.0 / h[1:]
    q[interior + 2, interior] = 1.0 / h[1:]
    r = np.diag((h[:-1] + h[1:]) / 3.0) + np.diag(h[1:-1] / 6.0, 1) + np.diag(h[1:-1] / 6.0, -1)
    return q @ np.linalg.solve(r, q.T)
