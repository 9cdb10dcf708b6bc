"""The in-domain covariate's measurement error (issue 54): the bias it puts in partial correlations, its
SIMEX correction, and which meta-analysis findings do not survive it."""

import numpy as np
import pandas as pd
import pytest
from fixtures_results import IN_DOMAIN_EXAMPLES

from analysis import measurement_error
from analysis.stats import partial_corr


def test_simex_removes_most_of_the_bias_a_noisy_in_domain_accuracy_puts_in_partial_correlations():
    """120 runs of 21 evaluations on a plateau: true in-domain accuracy 0.8 + 0.025 N(0, 1), measured on 1,000
    examples (binomial: reliability 0.80); two OOD testsets 0.6 + (true - 0.8) + 0.02 N(0, 1), independent given
    the true accuracy, so every true partial r is 0. Through the linear residualiser the partial covariance is
    biased by Var(a) (1 - lambda): r by 1.25e-4 / (4e-4 + 1.25e-4) = +0.24, the uncorrected mean z's
    (measured: +0.28, its standard error 0.02). Required: the corrected mean z at most half the uncorrected one
    (measured: +0.11, standard error 0.03; without the correction the two are equal). Fixed seed."""
    rng = np.random.default_rng(54)
    naive, corrected = [], []
    for _ in range(120):
        true = 0.8 + 0.025 * rng.normal(size=21)
        measured = rng.binomial(IN_DOMAIN_EXAMPLES, true) / IN_DOMAIN_EXAMPLES
        x, y = 0.6 + (true - 0.8) + 0.02 * rng.normal(size=(2, 21))

        def z_given(covariate: np.ndarray) -> np.ndarray:
            return np.array([np.arctanh(partial_corr(x, y, covariate).r)])

        naive.append(z_given(measured)[0])
        error_variance = measurement_error.binomial_variance(measured, IN_DOMAIN_EXAMPLES)
        reliability = measurement_error.reliability(measured, IN_DOMAIN_EXAMPLES)
        corrected.append(measurement_error.simex(z_given, measured, error_variance, reliability, rng)[0])
    assert np.mean(naive) > 0.15
    assert abs(np.mean(corrected)) < 0.5 * np.mean(naive)


def test_reliability_is_the_share_of_variance_that_is_not_binomial_noise():
    """1 - mean(p (1 - p) / N) / Var(p): 0.75 where the noise is a quarter of the variance, clipped at 0 where
    it exceeds it, 0 for a constant series."""
    accuracy = np.array([0.4, 0.6, 0.4, 0.6])
    variance = np.var(accuracy, ddof=1)
    examples = 0.24 / (0.25 * variance)  # p (1 - p) = 0.24 at every point
    assert measurement_error.reliability(accuracy, examples) == pytest.approx(0.75)
    assert measurement_error.reliability(accuracy, examples / 10) == 0.0
    assert measurement_error.reliability(np.full(5, 0.7), 100) == 0.0


def test_findings_that_do_not_survive_the_correction_are_named():
    """A Welch or pooled finding (adjusted p < 0.05) lost under the correction is named; one kept, or one that
    was no finding, is not; a pooled r whose sign flips does not survive even if still significant."""
    keys = {"scope": ["mnli"] * 3, "x": ["a", "a", "b"], "y": ["b", "c", "c"]}
    ignored = pd.DataFrame(keys | {"r": [0.2, 0.3, 0.1], "p_adj": [0.01, 0.01, 0.5], "welch_p_adj": [0.01, 0.2, 0.01]})
    corrected = pd.DataFrame(keys | {"r": [0.1, -0.2, 0.1], "p_adj": [0.2, 0.01, 0.5], "welch_p_adj": [0.3, 0.2, 0.01]})
    lost = measurement_error.not_surviving(ignored, corrected)
    assert lost[["x", "y", "finding"]].values.tolist() == [
        ["a", "b", "heterogeneity"],
        ["a", "b", "pooled"],
        ["a", "c", "pooled"],
    ]
