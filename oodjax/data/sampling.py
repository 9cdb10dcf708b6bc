"""Sampling: each run's few-shot training set and the capped evaluation subsets, balanced and seeded.

Randomness comes only from explicitly seeded numpy Generators, so samples
are the same on every machine and in every process.
"""

from __future__ import annotations

import datasets
import numpy as np

LABELS = (0, 1)  # 0 = entailment, 1 = not entailment (``load_testset`` maps every testset's labels to these)


def few_shot(pool: datasets.Dataset, n: int, seed: int) -> datasets.Dataset:
    """n examples drawn without replacement, ceil(n/2) of label 0 and floor(n/2) of label 1, shuffled."""
    if n < 1:
        raise ValueError(f"few-shot size n must be positive, got {n}")
    labels = _binary_labels(pool, "few-shot pool")
    per_label = (n - n // 2, n // 2)
    rng = np.random.default_rng(seed)
    chosen = []
    for label, count in zip(LABELS, per_label):
        candidates = np.flatnonzero(labels == label)
        if count > len(candidates):
            raise ValueError(
                f"few-shot n={n} needs {count} examples of label {label} but the pool "
                f"({len(pool)} rows) has only {len(candidates)}"
            )
        chosen.append(rng.choice(candidates, size=count, replace=False))
    return pool.select(rng.permutation(np.concatenate(chosen)).tolist())


def stratified_subset(ds: datasets.Dataset, n: int, seed: int) -> datasets.Dataset:
    """At most n rows in their original order, each label's share rounded by largest remainder."""
    if n < 1:
        raise ValueError(f"subset size n must be positive, got {n}")
    if n >= len(ds):
        return ds
    labels = _binary_labels(ds, "dataset to subsample")
    counts = np.array([(labels == label).sum() for label in LABELS])
    shares = n * counts / len(ds)
    take = np.floor(shares).astype(int)
    by_remainder = np.argsort(-(shares - take), kind="stable")
    take[by_remainder[: n - take.sum()]] += 1
    rng = np.random.default_rng(seed)
    chosen = [rng.choice(np.flatnonzero(labels == label), size=k, replace=False) for label, k in zip(LABELS, take)]
    return ds.select(np.sort(np.concatenate(chosen)).tolist())


def _binary_labels(ds: datasets.Dataset, what: str) -> np.ndarray:
    if "label" not in ds.column_names:
        raise ValueError(f"{what} has no 'label' column (columns: {ds.column_names})")
    labels = np.asarray(ds["label"][:])
    unexpected = sorted(set(np.unique(labels).tolist()) - set(LABELS))
    if unexpected:
        raise ValueError(f"{what} has labels {unexpected}; expected binary labels {LABELS} (load_testset maps them)")
    return labels
