"""Cluster tooling: SLURM and TPU-pod launchers, the sweep generator and the cost estimator."""
