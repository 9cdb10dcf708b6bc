"""Analysis of oodjax results: partial correlations of OOD accuracies given in-domain accuracy.

Imports only numpy, scipy, pandas (with pyarrow for Parquet), matplotlib and
tqdm, so it runs without JAX. `python -m analysis RESULTS_DIR --out OUT_DIR`
writes tables, figures and CSVs; `python -m analysis.runs RESULTS_DIR` lists
the runs.

The statistics are imported on first use: the engine imports
``analysis.schema`` (the results' key names) and should not pay for scipy.
"""

from typing import Any

__all__ = ["pairwise_partial_corr", "partial_corr"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from analysis import stats

        return getattr(stats, name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")
