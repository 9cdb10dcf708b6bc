"""Residualisers against scipy and least squares; ground-truth recovery of partial correlations."""

import numpy as np
import pytest
from scipy.interpolate import make_smoothing_spline

from analysis import partial_corr
from analysis.residualise import SplineSmoother, fit_linear, fit_spline, max_spline_edf, roughness_matrix


def spline_data(seed: int, size: int = 30):
    rng = np.random.default_rng(seed)
    x = np.sort(rng.uniform(size=size))
    x = (x - x[0]) / (x[-1] - x[0])  # fit_spline works on the covariate rescaled to [0, 1]
    return x, np.sin(6 * x) + rng.normal(scale=0.2, size=size), rng


@pytest.mark.parametrize("log_lambda", [-6.0, -3.0, -1.0, 1.0])
def test_smoother_equals_scipy_spline_at_fixed_lambda(log_lambda):
    x, y, rng = spline_data(0)
    weights = rng.integers(1, 4, x.size).astype(float)
    smoother = SplineSmoother(x, weights)
    scipy_fit = make_smoothing_spline(x, y, w=weights, lam=10.0**log_lambda)
    scipy_hat = make_smoothing_spline(x, np.eye(x.size), w=weights, lam=10.0**log_lambda)(x)
    chosen = np.array([log_lambda])
    np.testing.assert_allclose(smoother.fitted(y, chosen)[0], scipy_fit(x), atol=1e-8, rtol=0)
    assert smoother.edf(chosen)[0] == pytest.approx(np.trace(scipy_hat), abs=1e-8)
    residual = y - scipy_fit(x)
    assert smoother.weighted_rss(y, chosen)[0] == pytest.approx(weights @ residual**2, rel=1e-8)


def test_smoother_becomes_the_weighted_least_squares_line():
    x, y, rng = spline_data(1, size=100)
    weights = rng.integers(1, 4, x.size).astype(float)
    line = np.polyval(np.polyfit(x, y, 1, w=np.sqrt(weights)), x)
    fitted = SplineSmoother(x, weights).fitted(y, np.array([9.0]))[0]
    np.testing.assert_allclose(fitted, line, atol=1e-8, rtol=0)


def test_gcv_choice_matches_scipy_without_ties():
    """scipy's make_smoothing_spline(lam=None) minimises the same GCV (its own optimiser)."""
    for seed in (2, 3):
        x, y, _ = spline_data(seed, size=40)
        ours = fit_spline(x, y)
        theirs = make_smoothing_spline(x, y)
        np.testing.assert_allclose(ours.fitted, theirs(x), atol=1e-3 * y.std(), rtol=0)
        np.testing.assert_allclose(ours.predict(x), ours.fitted, atol=1e-8, rtol=0)
        assert 2.0 < ours.edf < 10.0


def dense_gcv_fit(covariate: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Brute force on all n points: hat = P (P'P + lambda Omega)^-1 P' with P the n x knots
    incidence matrix of the tied values; GCV over a fine grid, edf capped at 10."""
    values, group = np.unique(covariate, return_inverse=True)
    incidence = np.eye(values.size)[group]
    omega = roughness_matrix((values - values[0]) / (values[-1] - values[0]))
    best = (np.inf, None, None)
    for log_lambda in np.arange(-8.0, 4.0, 0.005):
        hat = incidence @ np.linalg.solve(incidence.T @ incidence + 10.0**log_lambda * omega, incidence.T)
        edf = np.trace(hat)
        score = y.size * np.sum((y - hat @ y) ** 2) / (y.size - edf) ** 2
        if edf <= 10.0 and score < best[0]:
            best = (score, hat @ y, edf)
    return best[1], best[2]


def test_ties_are_fitted_as_least_squares_on_all_points():
    rng = np.random.default_rng(4)
    values = np.round(rng.uniform(0.6, 0.9, 60), 2)  # accuracies on a grid: many ties
    y = np.sin(20 * values) + rng.normal(scale=0.2, size=values.size)
    assert np.unique(values).size < values.size / 2
    fit = fit_spline(values, y)
    fitted, edf = dense_gcv_fit(values, y)
    np.testing.assert_allclose(fit.fitted, fitted, atol=1e-3 * y.std(), rtol=0)
    assert fit.edf == pytest.approx(edf, abs=0.01)
    assert 3.0 < edf < 10.0


def test_linear_fit_is_least_squares_with_intercept():
    rng = np.random.default_rng(5)
    covar = rng.normal(size=(30, 2)) * [1.0, 1000.0] + [0.0, 5e4]
    y = rng.normal(size=30)
    design = np.column_stack([np.ones(30), covar])
    expected = design @ np.linalg.lstsq(design, y, rcond=None)[0]
    fit = fit_linear(covar, y)
    np.testing.assert_allclose(fit.fitted, expected, atol=1e-10, rtol=0)
    assert fit.edf == 3.0


def test_spline_needs_one_covariate_with_five_distinct_values():
    with pytest.raises(ValueError, match="at least 5 distinct covariate values, got 4"):
        fit_spline(np.repeat([0.1, 0.2, 0.3, 0.4], 3), np.arange(12.0))
    result = partial_corr(
        np.arange(12.0) ** 2,
        np.sin(np.arange(12.0)),
        np.repeat([0.1, 0.2, 0.3, 0.4], 3),
        residualiser="spline",
    )
    assert np.isnan(result.r)
    assert result.reason == "spline needs at least 5 distinct covariate values, got 4"


def synthetic_runs(nonlinear: bool, rho: float, count: int = 60, steps: int = 25):
    """Runs whose two OOD accuracies depend on in-domain accuracy `a` through f(a)
    (a tanh kink, or a line) plus residuals with correlation rho."""
    rng = np.random.default_rng(6)
    for _ in range(count):
        t = np.arange(steps)
        a = 0.5 + 0.35 * (1 - np.exp(-t / 6)) + rng.normal(0, 0.02, steps)
        f = 0.15 * np.tanh(12 * (a - 0.7)) if nonlinear else 0.4 * (a - 0.7)
        e = rng.multivariate_normal([0, 0], [[1, rho], [rho, 1]], steps) * 0.015
        yield a, 0.55 + f + e[:, 0], 0.6 + 0.8 * f + e[:, 1]


def mean_r(nonlinear: bool, residualiser: str, rho: float = 0.3) -> tuple[float, float, float]:
    """Mean r over runs (Fisher z), CI coverage of rho, and mean t-test dof."""
    results = [partial_corr(x, y, a, residualiser=residualiser) for a, x, y in synthetic_runs(nonlinear, rho)]
    r = np.array([res.r for res in results])
    coverage = np.mean([res.ci_low <= rho <= res.ci_high for res in results])
    mean_dof = np.mean([res.dof for res in results])
    return np.tanh(np.arctanh(r).mean()), coverage, mean_dof


# Every scenario draws the same residuals, so the linear residualiser on the
# linear relation, which removes f exactly, is the oracle: the partial
# correlation these residuals have. It estimates rho up to sampling error.
def test_spline_recovers_the_residual_correlation_where_linear_is_biased():
    oracle, _, _ = mean_r(False, "linear")
    assert oracle == pytest.approx(0.3, abs=0.07)
    spline_r, spline_coverage, _ = mean_r(True, "spline")
    linear_r, linear_coverage, _ = mean_r(True, "linear")
    assert spline_r == pytest.approx(oracle, abs=0.05)
    assert spline_coverage >= 0.85
    assert linear_r > oracle + 0.3  # the shared kink stays in both residuals
    assert linear_coverage < 0.3


def test_spline_behaves_like_linear_on_a_linear_relation():
    oracle, oracle_coverage, oracle_dof = mean_r(False, "linear")
    spline_r, spline_coverage, spline_dof = mean_r(False, "spline")
    assert spline_r == pytest.approx(oracle, abs=0.03)
    assert oracle_coverage >= 0.85 and spline_coverage >= 0.85
    # GCV mostly picks (nearly) a straight line: close to the linear n - 3 dof.
    assert oracle_dof == 25 - 3
    assert oracle_dof - 3.0 <= spline_dof <= oracle_dof + 1e-9


def test_the_spline_edf_cap_scales_with_the_number_of_points():
    """A wiggly curve over 12 points: under a fixed cap of 10 GCV spends 9.9 of them, which leaves the partial
    correlation 1.1 degrees of freedom; capped at 12 / 3 = 4, it keeps at least 12 - 3 - 2 = 7."""
    assert [max_spline_edf(n) for n in (6, 12, 21, 41)] == pytest.approx([3.0, 4.0, 7.0, 10.0])
    x = np.linspace(0.0, 1.0, 12)
    rng = np.random.default_rng(7)
    wiggly = np.sin(12 * x) + rng.normal(scale=0.05, size=12)
    assert 3.5 < fit_spline(x, wiggly).edf <= 4.0
    result = partial_corr(wiggly + rng.normal(scale=0.1, size=12), wiggly, x, residualiser="spline")
    assert result.reason == "" and result.dof >= 12 - 3 - 2
