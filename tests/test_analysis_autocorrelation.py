"""Run-level p-values of `python -m analysis` hold under autocorrelated evaluation steps.

Issue 41: on null data (OOD testsets independent given in-domain accuracy, AR(1)
noise of coefficient 0.85 over 21 steps, 72 runs, 8 testsets: 1,512 tests), the
independent-rows t test puts 9.9% of p below 0.05; with the effective sample
size the run-level rows use, at most 8% (6.1% with these seeds), while a real
shared component is still found.
"""

import numpy as np
import pytest
from fixtures_results import TESTSETS, ar1_noise, autocorrelated_accuracies, write_run

from analysis import pairwise_partial_corr, partial_corr
from analysis.aggregate import all_run_pairs
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
    # 1..5: centred -2..2, lag-1 products sum to 4 over squares 10, a = 0.4 in both.
    line = np.arange(1.0, 6.0)
    assert effective_sample_size(line, line) == pytest.approx(5 * (1 - 0.16) / (1 + 0.16), abs=1e-12)
    # Autocorrelations of opposite signs would claim more than n: capped at n.
    assert effective_sample_size(line, np.array([1.0, -1.0, 1.0, -1.0, 1.0])) == 5
    rng = np.random.default_rng(1)
    noise = ar1_noise(rng, 20000, 2, 0.85)
    assert effective_sample_size(*noise.T) == pytest.approx(20000 * (1 - 0.85**2) / (1 + 0.85**2), rel=0.05)


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
