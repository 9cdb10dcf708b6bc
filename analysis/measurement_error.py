"""The in-domain covariate's measurement error: its reliability, and partial correlations corrected for it.

In-domain accuracy p is measured on N examples, with binomial noise of
variance p(1 - p) / N at each evaluation. Residualising on a noisy covariate
leaves part of the in-domain signal in both OOD residuals: for OOD slopes
beta_x and beta_y on true in-domain accuracy a, the partial covariance is
biased by beta_x beta_y Var(a) (1 - lambda), lambda the covariate's
reliability, so its sign is that of the two slopes' product: a study whose
models' slopes differ in sign makes the models' partial correlations differ
where their true ones do not (docs/analysis.md, "A noisy in-domain
covariate").

- `reliability`: lambda = 1 - mean(p(1 - p) / N) / Var(p), the share of the
  measured accuracy's variance that is not binomial noise (a moment
  estimate, clipped to [0, 1]). The binomial variance is that of N fresh
  examples; a run evaluates one fixed example set, whose predictions change
  only in part between evaluations, so the noise between evaluations is at
  most that, and lambda a lower bound.
- `simex`: SIMEX (Cook and Stefanski 1994, JASA 89:1314; Carroll, Ruppert,
  Stefanski and Crainiceanu 2006, Measurement Error in Nonlinear Models,
  ch. 5): the estimate is recomputed with extra noise of variance zeta times
  the measurement error's added to the covariate, for zeta in SIMEX_ZETAS
  (SIMEX_DRAWS draws each, averaged), and its trend in zeta extrapolated back
  to zeta = -1, no noise. It works through any residualiser, the spline
  included, which a moment correction does not. The extrapolant is Cook and
  Stefanski's rational one, a + b / (pole + zeta), exact for a partial
  covariance through a straight line, whose pole there is Var(measured) /
  error variance = 1 / (1 - lambda): the pole is taken from the run's
  reliability rather than fitted (a fitted pole is what makes the rational
  extrapolant unstable), and the reliability floored at MIN_RELIABILITY, so
  that a run whose in-domain accuracy is mostly noise is corrected only in
  part instead of over-corrected, as the moment correction (subtracting the
  binomial variance, this extrapolant with the pole unfloored) is at 2,000 and
  500 examples. The quadratic extrapolant, Carroll et al.'s conservative
  default, removed 55% of the bias at reliability 0.71 where this one removed
  73% (docs/analysis.md).
"""

from collections.abc import Callable

import numpy as np
import pandas as pd

# The added noise's variance in multiples of the measurement error's, and draws per multiple.
SIMEX_ZETAS = (0.5, 1.0, 1.5, 2.0)
SIMEX_DRAWS = 10
# The extrapolant's reliability is floored here (also analysis.runs' threshold for a flat run): below it the
# extrapolation to no noise would multiply the estimates' trend by more than 1 / (pole - 1) = 1 and, where the
# reliability is estimated from one run's 20 evaluations, over-correct as the moment correction does.
MIN_RELIABILITY = 0.5


def binomial_variance(accuracy: np.ndarray, examples: int) -> np.ndarray:
    """p (1 - p) / N: the variance of an accuracy p measured on N examples."""
    accuracy = np.asarray(accuracy, dtype=float)
    return accuracy * (1.0 - accuracy) / examples


def reliability(accuracy: np.ndarray, examples: int) -> float:
    """1 - mean(p (1 - p) / N) / Var(p) over the given evaluations (sample variance), clipped to [0, 1]:
    0 where the accuracy does not vary at all."""
    accuracy = np.asarray(accuracy, dtype=float)
    variance = float(np.var(accuracy, ddof=1))
    if variance == 0.0:
        return 0.0
    return float(np.clip(1.0 - binomial_variance(accuracy, examples).mean() / variance, 0.0, 1.0))


def simex(
    estimate: Callable[[np.ndarray], np.ndarray],
    covariate: np.ndarray,
    error_variance: np.ndarray,
    reliability: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """The SIMEX estimates (module docstring) of `estimate`, a function of the covariate returning a vector (NaN
    where undefined), for a covariate measured with independent errors of variance `error_variance` (one per
    value) and of `reliability` (`reliability`; floored at MIN_RELIABILITY). Remeasured values are clipped to
    [0, 1], as accuracies. NaN where the estimate is undefined without noise or at every draw of a zeta; the
    estimate itself where the reliability is 1 (no noise to remove)."""
    covariate = np.asarray(covariate, dtype=float)
    sd = np.sqrt(np.asarray(error_variance, dtype=float))
    levels = [estimate(covariate)]
    if reliability >= 1.0:
        return levels[0]
    for zeta in SIMEX_ZETAS:
        draws = np.array(
            [
                estimate(np.clip(covariate + np.sqrt(zeta) * sd * rng.normal(size=covariate.size), 0.0, 1.0))
                for _ in range(SIMEX_DRAWS)
            ]
        )
        defined = np.isfinite(draws).sum(axis=0)
        levels.append(np.where(defined > 0, np.nansum(draws, axis=0) / np.maximum(defined, 1), np.nan))
    values = np.array(levels)  # [1 + zetas, estimates]
    # The rational extrapolant a + b / (pole + zeta), its pole Var(measured) / error variance = 1 / (1 - lambda).
    pole = 1.0 / (1.0 - max(reliability, MIN_RELIABILITY))
    result = np.full(values.shape[1], np.nan)
    usable = np.isfinite(values).all(axis=0)
    if usable.any():
        line = np.polyfit(1.0 / (pole + np.array([0.0, *SIMEX_ZETAS])), values[:, usable], 1)
        result[usable] = np.polyval(line, 1.0 / (pole - 1.0))
    return result


def not_surviving(ignored: pd.DataFrame, corrected: pd.DataFrame, significance: float = 0.05) -> pd.DataFrame:
    """The meta-analysis' findings (`meta.meta_analyse`'s pooled rows, per scope and pair) that hold with the
    in-domain noise ignored and not with it corrected: a heterogeneity finding is Welch's adjusted p below
    `significance`, a pooled one the pooled r's adjusted p below it; corrected, it fails to stay below, or
    the pooled r changes sign. Columns scope, x, y, finding (`heterogeneity` or `pooled`)."""
    keys = ["scope", "x", "y"]
    both = ignored.merge(corrected, on=keys, suffixes=("", "_corrected"))
    heterogeneity = (both["welch_p_adj"] < significance) & ~(both["welch_p_adj_corrected"] < significance)
    pooled = (both["p_adj"] < significance) & ~(
        (both["p_adj_corrected"] < significance) & (np.sign(both["r"]) == np.sign(both["r_corrected"]))
    )
    found = {"heterogeneity": heterogeneity, "pooled": pooled}
    return pd.concat([both.loc[rows, keys].assign(finding=name) for name, rows in found.items()], ignore_index=True)
