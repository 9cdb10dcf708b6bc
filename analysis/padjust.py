"""Multiple-comparison adjustment of a family of p-values.

Missing p-values (NaN: a pair whose correlation is undefined) are not tests,
so they are left out of the family: they neither count towards its size nor
receive an adjusted value.
"""

import numpy as np
import scipy.stats

PADJUST_METHODS = ("holm", "bonferroni", "fdr_bh", "none")


def adjust_pvalues(p: np.ndarray, method: str = "holm") -> np.ndarray:
    """Adjusted p-values, NaN where `p` is NaN; the family is the finite entries."""
    if method not in PADJUST_METHODS:
        raise ValueError(f"padjust must be one of {PADJUST_METHODS}, got {method!r}")
    p = np.asarray(p, dtype=float)
    if np.any((p < 0) | (p > 1)):
        raise ValueError(f"p-values must lie in [0, 1], got {p[(p < 0) | (p > 1)]}")
    adjusted = np.full(p.shape, np.nan)
    tested = ~np.isnan(p)
    if not tested.any():
        return adjusted
    family = p[tested]
    if method == "holm":
        adjusted[tested] = _holm(family)
    elif method == "bonferroni":
        adjusted[tested] = np.minimum(family * family.size, 1.0)
    elif method == "fdr_bh":
        adjusted[tested] = scipy.stats.false_discovery_control(family, method="bh")
    else:
        adjusted[tested] = family
    return adjusted


def _holm(p: np.ndarray) -> np.ndarray:
    """Holm's step-down: the running maximum of (m - i) p_(i) over sorted p-values."""
    order = np.argsort(p, kind="stable")
    scaled = (p.size - np.arange(p.size)) * p[order]
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(np.maximum.accumulate(scaled), 1.0)
    return adjusted
