"""Sampling (few-shot sets, evaluation subsets) and grain pipelines of padded, static-shape batches.

Every batch is a dict of numpy arrays. One prompt a row (``make_batch``,
and ``train_batches`` by default):

    input_ids      [B, S] int32  prompt tokens, right-padded with `pad_id`
    attention_mask [B, S] int32  1 on prompt tokens
    answer_pos     [B]    int32  index of the last prompt token (its logits score the answer)
    label          [B]    int32  0 = entailment (" Yes"), 1 = not entailment (" No")
    index          [B]    int32  row of the example in its TokenizedSet; -1 on padding rows
    valid          [B]    bool   False on padding rows, which must be masked out

Evaluation batches, and training batches with `pack`, hold several prompts a
row (``eval_batches``): the attention mask numbers the prompts of a row 1, 2,
..., and the per-prompt arrays gain a prompt-slot axis, [B, P].

Padding rows attend to their first position only (so no row is fully masked and
attention cannot produce NaN) and carry label 0; only `valid` says to ignore them.

All randomness comes from numpy Generators or grain's index shuffle seeded
explicitly, never from Python's hash(), so samples and batch orders are the same
on every machine and in every process.
"""

from __future__ import annotations

import collections
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
    batch_tokens: int,
    row_multiple: int = 1,
    pad_id: int = 0,
    lanes: Sequence[Sequence[int]] | None = None,
) -> grain.MapDataset:
    """One pass over every example exactly once, prompts packed into rows of ``max_length`` tokens.

    Packing (``pack_rows``) leaves little padding whatever the mix of
    lengths, and gives every batch one shape, so a jitted step compiles once.
    A batch is a dict of numpy arrays:

        input_ids      [B, S]    int32  prompts one after another, right-padded with `pad_id`
        attention_mask [B, S]    int32  prompt ids within the row (1, 2, ...), 0 on padding
        answer_pos     [B, P]    int32  index in the row of each prompt's last token
        label, index, valid [B, P]     as in `make_batch`, per prompt slot (-1 / False on empty slots)

    with S = max_length and P the most prompts any row of the pass holds.
    A batch has about `batch_tokens` tokens: B rows, a multiple of
    `row_multiple` (the devices a batch is split over), the packed rows
    spread evenly over the fewest batches that allows.

    `lanes` batches several lists of rows in lockstep (e.g. one per run, each
    run scoring its own examples), each lane's rows once: every leaf gains a
    leading lane axis [L, B, ...] and lane l of batch k holds the k-th chunk
    of lane l's packed rows, with empty rows where lane l has fewer than the
    fullest lane. A row may be in several lanes. Without `lanes`: one lane of
    every row, and no lane axis.
    """
    if batch_tokens < 1 or row_multiple < 1:
        raise ValueError(f"batch_tokens and row_multiple must be positive, got {batch_tokens} and {row_multiple}")
    if lanes is None:
        lane_rows = [np.arange(len(tokenized))]
    elif not lanes:
        raise ValueError("lanes is empty: give at least one lane of rows (or None for every row)")
    else:
        lane_rows = [_lane_rows(tokenized, rows, lane) for lane, rows in enumerate(lanes)]
    row_length = tokenized.max_length
    packed = [[lane[row] for row in pack_rows(tokenized.lengths[lane], row_length)] for lane in lane_rows]
    most_rows = max(len(rows) for rows in packed)
    prompts_per_row = max((len(row) for rows in packed for row in rows), default=1)
    rows = max(row_multiple, batch_tokens // row_length // row_multiple * row_multiple)
    if most_rows:
        per_batch = _ceil_div(most_rows, _ceil_div(most_rows, rows))  # the fewest batches of at most `rows`, evened
        rows = min(rows, _ceil_div(per_batch, row_multiple) * row_multiple)
    plan = []
    for first in range(0, most_rows, rows):
        chunks = [lane[first : first + rows] for lane in packed]
        plan.append([chunk + [[]] * (rows - len(chunk)) for chunk in chunks])

    def batch(chunks: list[list[list[int]]]) -> Batch:
        per_lane = [_packed_batch(tokenized, chunk, prompts_per_row, row_length, pad_id=pad_id) for chunk in chunks]
        if lanes is None:
            return per_lane[0]
        return {key: np.stack([b[key] for b in per_lane]) for key in per_lane[0]}

    return grain.MapDataset.source(plan).map(batch)


def pack_rows(lengths: np.ndarray, row_length: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows whose lengths sum to at most ``row_length``.

    Best-fit decreasing: longest prompts first, each into the fullest row
    it still fits, which packs close to the fewest rows possible. Deterministic,
    so every process packs a pool the same way.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    too_long = np.flatnonzero(lengths > row_length)
    if too_long.size:
        raise ValueError(f"prompts {too_long[:5].tolist()} are longer than the row length {row_length}")
    rows: list[list[int]] = []
    count_with_room = np.zeros(row_length + 1, dtype=np.int64)  # rows by the tokens they have left
    rows_with_room: dict[int, list[int]] = collections.defaultdict(list)
    for item in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[item])
        fitting = np.flatnonzero(count_with_room[need:])
        if fitting.size:
            room = need + int(fitting[0])
            row = rows_with_room[room].pop()
            count_with_room[room] -= 1
        else:
            room, row = row_length, len(rows)
            rows.append([])
        rows[row].append(item)
        rows_with_room[room - need].append(row)
        count_with_room[room - need] += 1
    return rows


def _packed_batch(
    tokenized: TokenizedSet, rows: list[list[int]], prompts_per_row: int, seq_len: int, *, pad_id: int
) -> Batch:
    """The batch of packed rows (each a list of TokenizedSet rows, [] for an empty row) of ``seq_len`` tokens."""
    shape = (len(rows), prompts_per_row)
    input_ids = np.full((len(rows), seq_len), pad_id, dtype=np.int32)
    attention_mask = np.zeros(input_ids.shape, dtype=np.int32)
    attention_mask[:, 0] = 1  # as in make_batch: an empty row attends to its first position
    answer_pos = np.zeros(shape, dtype=np.int32)
    label = np.zeros(shape, dtype=np.int32)
    index = np.full(shape, -1, dtype=np.int32)
    for r, members in enumerate(rows):
        start = 0
        for slot, i in enumerate(members):
            prompt = tokenized.prompt(i)
            stop = start + len(prompt)
            input_ids[r, start:stop] = prompt
            attention_mask[r, start:stop] = slot + 1
            answer_pos[r, slot] = stop - 1
            label[r, slot] = tokenized.labels[i]
            index[r, slot] = i
            start = stop
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "answer_pos": answer_pos,
        "label": label,
        "index": index,
        "valid": index >= 0,
    }


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


def train_batches(
    tokenized: TokenizedSet,
    *,
    batch_size: int,
    seed: int,
    seq_len: int | None = None,
    pack: bool = False,
    prompts_per_row: int | None = None,
    rows: Sequence[int] | None = None,
    pad_id: int = 0,
) -> grain.DatasetIterator:
    """An endless, shuffled stream of training batches; this process's rows of each global batch.

    The global stream is grain's index shuffle of the set, reshuffled every
    epoch; global batch t is elements [t*B, (t+1)*B) of it, laid out in B
    rows of `seq_len` tokens, so that the train step, which cuts each
    micro-batch to the bucket of its longest row and skips empty ones,
    computes little padding. Either one prompt a row, ordered by length
    (``by_length``), so consecutive micro-batches hold prompts of similar
    length; or, with `pack`, packed several to a row (``packed_batch``),
    fullest rows first and empty rows last, in ``eval_batches``' layout with
    `prompts_per_row` slots a row (default: ``train_prompts_per_row`` of this
    set; runs trained together must share it). `rows` are the row positions
    of that batch this process feeds to its devices (None: all B). Taking
    positions, not a stride of the stream, keeps every example on the device
    and row where a single-process run puts it, so per-row randomness such
    as dropout masks is the same however many processes share the batch.
    The returned grain iterator's get_state()/set_state() (a small JSON-able
    dict) resume the stream exactly. `seq_len` defaults to the smallest
    default bucket holding the longest example.
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
    if pack and prompts_per_row is None:
        prompts_per_row = train_prompts_per_row([tokenized], batch_size=batch_size, seq_len=seq_len)
    # Mix the run seed so that runs seeded s and s+1 do not share epoch orders
    # (grain seeds epoch e with seed + e).
    shuffle_seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
    stream = grain.MapDataset.range(len(tokenized)).shuffle(seed=shuffle_seed).repeat().batch(batch_size)

    def batch(global_rows: np.ndarray) -> Batch:
        if not pack:
            return make_batch(tokenized, by_length(tokenized, global_rows)[keep], seq_len, pad_id=pad_id)
        packed = packed_batch(tokenized, global_rows, batch_size, seq_len, prompts_per_row, pad_id=pad_id)
        return {key: value[keep] for key, value in packed.items()}

    # The set is in memory and a batch costs microseconds: read in this thread,
    # rather than grain's default of 16 threads prefetching 500 batches.
    return iter(stream.map(batch).to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


def train_prompts_per_row(sets: Sequence[TokenizedSet], *, batch_size: int, seq_len: int) -> int:
    """Prompt slots a packed training row needs: as many of the shortest prompt as fit, at most a batch."""
    shortest = min(int(t.lengths.min()) for t in sets)
    return max(1, min(batch_size, seq_len // shortest))


def packed_batch(
    tokenized: TokenizedSet,
    examples: np.ndarray,
    num_rows: int,
    seq_len: int,
    prompts_per_row: int,
    *,
    pad_id: int = 0,
) -> Batch:
    """``examples`` packed into ``num_rows`` rows of ``seq_len`` tokens, the fullest rows first, empty rows last."""
    examples = np.asarray(examples)
    rows = [examples[row].tolist() for row in pack_rows(tokenized.lengths[examples], seq_len)]
    rows.sort(key=lambda row: -int(tokenized.lengths[row].sum()))
    most_prompts = max(map(len, rows), default=0)
    if len(rows) > num_rows or most_prompts > prompts_per_row:
        raise ValueError(
            f"{len(examples)} prompts need {len(rows)} rows of {seq_len} tokens with up to {most_prompts} prompts "
            f"each; the batch has {num_rows} rows of {prompts_per_row} prompt slots"
        )
    return _packed_batch(tokenized, rows + [[]] * (num_rows - len(rows)), prompts_per_row, seq_len, pad_id=pad_id)


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
