"""Cluster tooling: SLURM and TPU-pod launchers, the sweep generator and the cost estimator."""

# Before any launcher imports transformers: oodjax's package init drops transformers' "PyTorch was not
# found" notice (oodjax.TORCH_NOT_FOUND_NOTICE), as for every entry point.
import oodjax  # noqa: F401
