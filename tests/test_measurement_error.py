"""The in-domain covariate's measurement error (issue 54): the bias it puts in partial correlations, its
SIMEX correction, and which meta-analysis findings do not survive it."""

import numpy as np
import pandas as pd
import pytest
from fixtures_results import IN_DOMAIN_EXAMPLES, write_run

from analysis import measurement_error, runs
from analysis.aggregate import corrected_run_pairs, fisher_z, run_pairs
from analysis.residualise import SPLINE

OPTIONS = {"residualiser": SPLINE, "method": "pearson", "padjust": "holm", "probit": False, "differences": False}


def test_simex_removes_most_of_the_bias_a_noisy_in_domain_accuracy_puts_in_partial_correlations(tmp_path):
    """30 runs of 21 evaluations: true in-domain accuracy 0.5 at step 0, then a plateau 0.8 + 0.02 N(0, 1),
    measured on 1,000 examples (binomial: reliability 0.71 on the plateau); two OOD testsets
    0.6 + (true - 0.8) + 0.02 N(0, 1) each, independent given the true accuracy, so every true partial r is 0.
    The bias is b_x b_y Var(a) (1 - lambda) in covariance, about +0.2 in r; the quadratic extrapolant removes
    about 73% of it in the linear errors-in-variables model at this reliability (and never over-corrects).
    Required: the uncorrected mean z above 0.1 (the bias is there), the corrected one within 0.4 of it from 0;
    fixed seed, its standard error over 30 runs about 0.05 (run z sd about 0.3)."""
    rng = np.random.default_rng(54)
    naive, corrected = [], []
    for index in range(30):
        true = np.r_[0.5, 0.8 + 0.02 * rng.normal(size=20)]
        measured = rng.binomial(IN_DOMAIN_EXAMPLES, true) / IN_DOMAIN_EXAMPLES
        ood = 0.6 + (true[:, None] - 0.8) + 0.02 * rng.normal(size=(21, 2))
        path = write_run(
            tmp_path / f"run{index}",
            steps=25 * np.arange(21),
            testsets=["mnli", "hans", "rte"],
            accuracy=np.column_stack([measured, ood]),
            in_domain="mnli",
            model="opt-125m",
            seed=index,
            shots=32,
        )
        run = runs.load_run(path)
        naive.append(fisher_z(run_pairs(run, **OPTIONS)["r"].to_numpy())[0])
        corrected.append(fisher_z(corrected_run_pairs(run, **OPTIONS)["r"].to_numpy())[0])
    assert np.mean(naive) > 0.1
    assert abs(np.mean(corrected)) < 0.4 * np.mean(naive)


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
