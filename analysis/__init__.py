"""Analysis of oodjax results: partial correlations of OOD accuracies given in-domain accuracy.

Imports only numpy, scipy, pandas and matplotlib, so it runs without JAX.
`python -m analysis RESULTS_DIR --out OUT_DIR` writes tables, figures and a CSV.
"""

from analysis.stats import pairwise_partial_corr, partial_corr

__all__ = ["pairwise_partial_corr", "partial_corr"]
