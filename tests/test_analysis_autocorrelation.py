"""Run-level p-values of `python -m analysis` hold under autocorrelated evaluation steps.

Issue 41: on null data (OOD testsets independent given in-domain accuracy, AR(1)
noise of coefficient 0.85 over 21 steps, 72 runs, 8 testsets: 1,512 tests), the
independent-rows t test puts 9.9% of p below 0.05; with the effective sample
size the run-level rows use, at most 8% (6.1% with these seeds), while a real
shared component is still found.
"""

import numpy as np
import pytest
from fixtures_results import TESTSETS, autocorrelated_accuracies, write_run

from analysis import pairwise_partial_corr, partial_corr
from analysis.aggregate import all_run_pairs
from analysis.null_rates import ar1_noise, rates
from analysis.runs import find_runs
from analysis.stats import effective_sample_size

STEPS = np.arange(21) * 25
OOD_PAIRS = 21  # the 7 OOD testsets of each run, in pairs
RUNS = 72


def write_runs(root, *, coefficient: float, shared: float, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    testsets = [t for t in TESTSETS if t != "train"]
    for index in range(RUNS):
        accuracy = autocorrelated_accuracies(rng, STEPS, testsets, "mnli", coefficient=coefficient, shared=shared)
        write_run(
            root / f"run{index}",
            steps=STEPS,
            testsets=testsets,
            accuracy=accuracy,
            in_domain="mnli",
            model="opt-125m",
            seed=index,
            shots=32,
        )
    return find_runs(root)


def rejection_rate(pairs) -> float:
    assert len(pairs) == RUNS * OOD_PAIRS and pairs["p"].notna().mean() > 0.99
    return float((pairs["p"].dropna() < 0.05).mean())


@pytest.fixture(scope="module")
def null_runs(tmp_path_factory):
    return write_runs(tmp_path_factory.mktemp("null"), coefficient=0.85, shared=0.0)


def test_run_level_p_values_keep_their_size_on_autocorrelated_null_data(null_runs):
    corrected = all_run_pairs(null_runs, residualiser="spline")
    assert rejection_rate(corrected) <= 0.08
    # The same data under the independent-rows test: what the correction is for.
    plain = [
        pairwise_partial_corr(run.accuracy, run.ood_testsets, run.in_domain, residualiser="spline") for run in null_runs
    ]
    assert np.mean([rate for table in plain for rate in (table["p"] < 0.05)]) > 0.08


def test_a_shared_component_is_still_found(tmp_path):
    """Power beside the size: half the OOD noise shared (residual correlation 0.5)."""
    pairs = all_run_pairs(write_runs(tmp_path, coefficient=0.85, shared=0.5), residualiser="spline")
    assert rejection_rate(pairs) >= 0.3
    assert pairs["r"].mean() > 0.3


def test_effective_sample_size_is_bartletts_for_two_ar1_series():
    # 1..5: centred -2..2, lag-1 products sum to 4 over squares 10, a = 0.4 in both; one lag (5 // 5), whose sum
    # 5 / (1 + 2 (0.16)) = 3.79 is more than the AR(1) extrapolation.
    line = np.arange(1.0, 6.0)
    assert effective_sample_size(line, line) == pytest.approx(5 * (1 - 0.16) / (1 + 0.16), abs=1e-12)
    # Autocorrelations of opposite signs would claim more than n: capped at n.
    assert effective_sample_size(line, np.array([1.0, -1.0, 1.0, -1.0, 1.0])) == 5
    rng = np.random.default_rng(1)
    noise = ar1_noise(rng, (2,), 20000, 0.85)
    assert effective_sample_size(*noise) == pytest.approx(20000 * (1 - 0.85**2) / (1 + 0.85**2), rel=0.05)


def test_negative_lag1_autocorrelations_are_clipped_at_zero():
    """Two series that alternate (lag-1 autocorrelation -0.8 each, as a smoother's residuals can) are worth all
    their n = 5 points; their positive product would have claimed 5 (1 - 0.64) / (1 + 0.64) = 1.1."""
    alternating = np.array([1.0, -1.0, 1.0, -1.0, 1.0])
    assert effective_sample_size(alternating, alternating) == 5


def test_longer_lags_count_where_the_ar1_extrapolation_misses_them():
    """Lag 1 nearly uncorrelated, lags 2 and 4 strongly: a period-4 wave over n = 20 has autocorrelations 0.05, -0.9,
    -0.05, 0.8 at lags 1-4 (the n // 5 counted), so n_eff = 20 / (1 + 2 (0.0025 + 0.81 + 0.0025 + 0.64)) = 5.1,
    where AR(1) alone would say 19.9."""
    wave = np.tile([1.0, 1.0, -1.0, -1.0], 5)
    centred = wave - wave.mean()
    autocorrelation = [centred[k:] @ centred[:-k] / (centred @ centred) for k in (1, 2, 3, 4)]
    np.testing.assert_allclose(autocorrelation, [0.05, -0.9, -0.05, 0.8], atol=1e-12)
    assert effective_sample_size(wave, wave) == pytest.approx(20 / (1 + 2 * 1.455), abs=1e-12)


def test_41_evaluations_of_ar1_095_noise_keep_the_size():
    """The edge issue 48 found: spline residuals, 41 evaluations, AR(1) 0.95, 10-12% of null p below 0.05 with
    the AR(1) extrapolation alone (10.0% of these 300 runs; binomial sd 1.3% at 5%); at most 8% (5.7%)."""
    rejected, untested = rates("spline", 41, 0.95, replicates=300, seed=48)
    assert rejected <= 0.08 and untested < 0.05


def test_too_few_effective_points_keep_r_and_lose_the_test():
    """Two trends over eight steps (plain p 0.0015) are worth fewer than the four points a test needs: r is the
    plain partial r, p and its interval are missing, and the reason says why."""
    steps = np.arange(8.0)
    covar = np.array([0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4, 0.6])
    x, y = covar + steps / 8, covar + (steps / 8) ** 2 + 0.05 * np.sin(2 * steps)
    plain = partial_corr(x, y, covar)
    corrected = partial_corr(x, y, covar, autocorrelation=True)
    assert corrected.r == plain.r and not np.isnan(plain.p)
    assert corrected.n_eff < 4 and np.isnan(corrected.p) and np.isnan(corrected.ci_low)
    assert corrected.reason.startswith(f"no test: n_eff={corrected.n_eff:.1f} of n=8 (autocorrelated steps)")
