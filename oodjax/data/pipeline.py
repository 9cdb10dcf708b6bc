"""Sampling (few-shot sets, evaluation subsets) and grain pipelines of padded, static-shape batches.

Every batch, for evaluation and training alike, is a dict of numpy arrays:

    input_ids      [B, S] int32  prompt tokens, right-padded with `pad_id`
    attention_mask [B, S] int32  1 on prompt tokens
    answer_pos     [B]    int32  index of the last prompt token (its logits score the answer)
    label          [B]    int32  0 = entailment (" Yes"), 1 = not entailment (" No")
    index          [B]    int32  row of the example in its TokenizedSet; -1 on padding rows
    valid          [B]    bool   False on padding rows, which must be masked out

Padding rows attend to their first position only (so no row is fully masked and
attention cannot produce NaN) and carry label 0; only `valid` says to ignore them.

All randomness comes from numpy Generators or grain's index shuffle seeded
explicitly, never from Python's hash(), so samples and batch orders are the same
on every machine and in every process.
"""

from __future__ import annotations

from collections.abc import Sequence

import datasets
import grain
import numpy as np

from oodjax.data.prompts import TokenizedSet

Batch = dict[str, np.ndarray]
LABELS = (0, 1)
MIN_BUCKET = 64


def few_shot(pool: datasets.Dataset, n: int, seed: int) -> datasets.Dataset:
    """n examples drawn without replacement, balanced across the two labels.

    Label 0 gets ceil(n/2) examples and label 1 floor(n/2) (an odd n gives the
    extra example to entailment). The draw is shuffled, so the two labels are
    interleaved in the returned order.
    """
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
    """At most n rows, keeping the label proportions; rows stay in their original order.

    Each label gets its proportional share, rounded by largest remainder (ties
    to label 0), so the subset's counts differ from exact proportions by less
    than one. A dataset of n rows or fewer is returned whole.
    """
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


def bucket_lengths(max_length: int, buckets: Sequence[int] | None = None) -> tuple[int, ...]:
    """Sorted sequence lengths batches are padded to; the last is always max_length.

    Default: powers of two from 64 below max_length, then max_length itself, so
    every prompt (at most max_length tokens) fits the last bucket.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if buckets is None:
        buckets = []
        while MIN_BUCKET << len(buckets) < max_length:
            buckets.append(MIN_BUCKET << len(buckets))
    if any(b < 1 for b in buckets):
        raise ValueError(f"bucket lengths must be positive, got {list(buckets)}")
    return tuple(sorted({b for b in buckets if b < max_length} | {max_length}))


def fitting_bucket(buckets: Sequence[int], length: int) -> int:
    """The smallest of the sorted `buckets` that holds `length` tokens."""
    index = int(np.searchsorted(buckets, length))
    if index == len(buckets):
        raise ValueError(f"{length} tokens do not fit the largest bucket, {buckets[-1]} (buckets {list(buckets)})")
    return int(buckets[index])


def eval_batches(
    tokenized: TokenizedSet,
    *,
    batch_size: int | None = None,
    batch_tokens: int | None = None,
    buckets: Sequence[int] | None = None,
    row_multiple: int = 1,
    pad_id: int = 0,
    lanes: Sequence[Sequence[int]] | None = None,
    even: bool = False,
) -> grain.MapDataset:
    """One pass over every example exactly once, in length-bucketed, padded batches.

    Each example goes to the smallest bucket that holds it; within a bucket the
    examples keep their order and the last batch is filled with padding rows.
    Give either `batch_size` (rows per batch, all buckets) or `batch_tokens`
    (rows per batch = batch_tokens // bucket length, rounded down to a multiple
    of `row_multiple`, e.g. the number of data-parallel devices, and at least
    row_multiple). There is one batch shape per bucket, so a jitted step
    compiles at most len(buckets) times. The grain MapDataset has a length and
    random access; iterate it directly, or through `.to_iter_dataset()` to
    prefetch batches in a background thread.

    `even` spreads each bucket's examples evenly over the fewest batches that
    size allows (rows rounded up to `row_multiple`), so a bucket holding few
    examples gets a small batch rather than one made mostly of padding.

    `lanes` batches several lists of rows in lockstep (e.g. one per run, each
    run scoring its own examples), each lane's rows once: every leaf gains a
    leading lane axis [L, B, ...], lane l of a bucket's k-th batch holds the
    k-th chunk of lane l's rows in that bucket, padded where lane l has fewer
    rows there than the fullest lane. A row may be in several lanes. Without
    `lanes`: one lane of every row, and no lane axis.
    """
    lengths = bucket_lengths(tokenized.max_length, buckets)
    if (batch_size is None) == (batch_tokens is None):
        raise ValueError("give exactly one of batch_size (examples) and batch_tokens (tokens)")
    if (batch_size if batch_size is not None else batch_tokens) < 1 or row_multiple < 1:
        raise ValueError(
            f"batch_size, batch_tokens and row_multiple must be positive, got "
            f"{batch_size}, {batch_tokens} and {row_multiple}"
        )
    if lanes is None:
        lane_rows = [np.arange(len(tokenized))]
    elif not lanes:
        raise ValueError("lanes is empty: give at least one lane of rows (or None for every row)")
    else:
        lane_rows = [_lane_rows(tokenized, rows, lane) for lane, rows in enumerate(lanes)]
    bucket_of = np.searchsorted(lengths, tokenized.lengths)  # the smallest bucket >= length
    plan = []
    for b, seq_len in enumerate(lengths):
        if batch_size is not None:
            rows = batch_size
        else:
            rows = max(row_multiple, batch_tokens // seq_len // row_multiple * row_multiple)
        members = [lane[bucket_of[lane] == b] for lane in lane_rows]
        count = max(len(m) for m in members)
        if even and count:
            per_batch = _ceil_div(count, _ceil_div(count, rows))  # the fewest batches of at most `rows`, evened
            rows = min(rows, _ceil_div(per_batch, row_multiple) * row_multiple)
        for first in range(0, count, rows):
            chunks = [m[first : first + rows] for m in members]
            chunks = np.stack([np.pad(chunk, (0, rows - len(chunk)), constant_values=-1) for chunk in chunks])
            plan.append((chunks if lanes is not None else chunks[0], seq_len))
    return grain.MapDataset.source(plan).map(lambda item: _lane_batch(tokenized, *item, pad_id=pad_id))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _indices(rows: Sequence[int], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` as a flat int array, and those of them outside [0, size)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    return rows, rows[(rows < 0) | (rows >= size)]


def _lane_rows(tokenized: TokenizedSet, rows: Sequence[int], lane: int) -> np.ndarray:
    rows, outside = _indices(rows, len(tokenized))
    if outside.size:
        raise ValueError(f"lane {lane} names rows outside [0, {len(tokenized)}): {outside[:5].tolist()}")
    return rows


def _lane_batch(tokenized: TokenizedSet, rows: np.ndarray, seq_len: int, *, pad_id: int) -> Batch:
    """make_batch of a [B] row array, or of each lane of a [L, B] one, stacked on a lane axis."""
    if rows.ndim == 1:
        return make_batch(tokenized, rows, seq_len, pad_id=pad_id)
    per_lane = [make_batch(tokenized, lane, seq_len, pad_id=pad_id) for lane in rows]
    return {key: np.stack([batch[key] for batch in per_lane]) for key in per_lane[0]}


def train_batches(
    tokenized: TokenizedSet,
    *,
    batch_size: int,
    seed: int,
    seq_len: int | None = None,
    rows: Sequence[int] | None = None,
    pad_id: int = 0,
) -> grain.DatasetIterator:
    """An endless, shuffled stream of training batches; this process's rows of each global batch.

    The global stream is grain's index shuffle of the set, reshuffled every
    epoch; global batch t is elements [t*B, (t+1)*B) of it, ordered by
    prompt length (``by_length``) so that consecutive micro-batches hold
    prompts of similar length and the train step pads each little. `rows`
    are the positions within that ordered batch that this process feeds to
    its devices (None: all B). Taking positions, not a stride of the stream, keeps every
    example on the device and row where a single-process run puts it, so
    per-row randomness such as dropout masks is the same however many
    processes share the batch. The returned grain iterator's
    get_state()/set_state() (a small JSON-able dict) resume the stream
    exactly. `seq_len` defaults to the smallest default bucket holding the
    longest example.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    keep, outside = _indices(range(batch_size) if rows is None else rows, batch_size)
    if outside.size or len(np.unique(keep)) != len(keep) or not len(keep):
        raise ValueError(
            f"rows must be distinct positions in a batch of {batch_size}; got {keep[:8].tolist()}"
            + (f" (outside [0, {batch_size}): {outside[:5].tolist()})" if outside.size else "")
        )
    if len(tokenized) == 0:
        raise ValueError("cannot train on an empty set")
    longest = int(tokenized.lengths.max())
    if seq_len is None:
        seq_len = fitting_bucket(bucket_lengths(tokenized.max_length), longest)
    if seq_len < longest:
        raise ValueError(f"seq_len {seq_len} is shorter than the longest training prompt ({longest} tokens)")
    # Mix the run seed so that runs seeded s and s+1 do not share epoch orders
    # (grain seeds epoch e with seed + e).
    shuffle_seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
    stream = grain.MapDataset.range(len(tokenized)).shuffle(seed=shuffle_seed).repeat().batch(batch_size)
    batches = stream.map(
        lambda global_rows: make_batch(tokenized, by_length(tokenized, global_rows)[keep], seq_len, pad_id=pad_id)
    )
    # The set is in memory and a batch costs microseconds: read in this thread,
    # rather than grain's default of 16 threads prefetching 500 batches.
    return iter(batches.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


def by_length(tokenized: TokenizedSet, rows: np.ndarray) -> np.ndarray:
    """``rows`` ordered by prompt length, shortest first (ties keep their order)."""
    rows = np.asarray(rows)
    return rows[np.argsort(tokenized.lengths[rows], kind="stable")]


def make_batch(tokenized: TokenizedSet, rows: np.ndarray, seq_len: int, *, pad_id: int = 0) -> Batch:
    """The batch of the given TokenizedSet rows (-1 = padding row), right-padded to seq_len."""
    rows = np.asarray(rows)
    batch_rows = len(rows)
    input_ids = np.full((batch_rows, seq_len), pad_id, dtype=np.int32)
    attention_mask = np.zeros((batch_rows, seq_len), dtype=np.int32)
    attention_mask[:, 0] = 1
    answer_pos = np.zeros(batch_rows, dtype=np.int32)
    label = np.zeros(batch_rows, dtype=np.int32)
    for r, i in enumerate(rows):
        if i < 0:
            continue
        prompt = tokenized.prompt(i)
        input_ids[r, : len(prompt)] = prompt
        attention_mask[r, : len(prompt)] = 1
        answer_pos[r] = len(prompt) - 1
        label[r] = tokenized.labels[i]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "answer_pos": answer_pos,
        "label": label,
        "index": rows.astype(np.int32),
        "valid": rows >= 0,
    }


def _binary_labels(ds: datasets.Dataset, what: str) -> np.ndarray:
    if "label" not in ds.column_names:
        raise ValueError(f"{what} has no 'label' column (columns: {ds.column_names})")
    labels = np.asarray(ds["label"][:])
    unexpected = sorted(set(np.unique(labels).tolist()) - set(LABELS))
    if unexpected:
        raise ValueError(f"{what} has labels {unexpected}; expected binary labels {LABELS} (load_testset maps them)")
    return labels
