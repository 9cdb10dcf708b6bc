"""Sampling (few-shot sets, evaluation subsets) and grain pipelines of padded, static-shape batches.

Every batch is a dict of numpy arrays. One prompt a row (``make_batch``,
and ``train_batches`` without `pack`):

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

All randomness comes from numpy Generators seeded explicitly, never from
Python's hash(), so samples and batch orders are the same on every machine
and in every process.
"""

from __future__ import annotations

import bisect
import collections
import functools
from collections.abc import Sequence

import datasets
import grain
import numpy as np

from oodjax.data.prompts import TokenizedSet

Batch = dict[str, np.ndarray]
LABELS = (0, 1)
MIN_BUCKET = 64
BUCKETS_PER_DOUBLING = 4  # default training lengths: 64, 80, 96, 112, 128, 160, ...
MIN_EVAL_ROW = 32  # default evaluation row lengths: 32, 48, 64, 96, 128, 192, ...
# At most two prompts an evaluation row: a row then computes at most about twice the
# (causal) attention scores its prompts need, however its length is split between them.
EVAL_PROMPTS_PER_ROW = 2
TRAIN_PREFETCH = 2  # training batches a stream builds ahead, in a background thread
_ENDLESS = 2**62  # the length of an endless stream of batches (grain needs one)


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
    """Sorted sequence lengths training micro-batches are cut to; the last is always max_length.

    Default: from 64, four lengths per doubling in equal steps (64, 80, 96,
    112, 128, 160, 192, 224, 256, 320, ...) below max_length, then
    max_length itself, so a micro-batch runs at most 25% longer than its
    longest row (powers of two would allow 100%) and every prompt (at most
    max_length tokens) fits the last.
    """
    steps = [step * MIN_BUCKET // BUCKETS_PER_DOUBLING for step in range(BUCKETS_PER_DOUBLING)]
    return _lengths_up_to(max_length, buckets, MIN_BUCKET, steps, "bucket lengths")


def eval_row_lengths(max_length: int, row_lengths: Sequence[int] | None = None) -> tuple[int, ...]:
    """Sorted lengths of evaluation rows; the last is always max_length.

    Default: 32 and 48 times the powers of two (32, 48, 64, 96, 128, 192,
    256, 384, ...) below max_length, then max_length: fine enough that a row
    of one or two prompts is nearly full, few enough that evaluation
    compiles a handful of batch shapes.
    """
    return _lengths_up_to(max_length, row_lengths, MIN_EVAL_ROW, [0, MIN_EVAL_ROW // 2], "evaluation row lengths")


def _lengths_up_to(
    max_length: int, lengths: Sequence[int] | None, first: int, offsets: Sequence[int], what: str
) -> tuple[int, ...]:
    """``lengths`` below max_length, then max_length, sorted; None: the default ladder, ``first`` times the
    powers of two, each plus ``offsets`` scaled with it (offsets are fractions of ``first``)."""
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if lengths is None:
        lengths, scale = [], 1
        while first * scale < max_length:
            lengths += [(first + offset) * scale for offset in offsets]
            scale *= 2
    if any(length < 1 for length in lengths):
        raise ValueError(f"{what} must be positive, got {list(lengths)}")
    return tuple(sorted({length for length in lengths if length < max_length} | {max_length}))


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
    row_lengths: Sequence[int] | None = None,
) -> grain.MapDataset:
    """One pass over every example exactly once, prompts packed one or two to a row of one of ``row_lengths``.

    Rows of several lengths (``eval_row_lengths``; default its series up to
    the set's max_length), each holding at most two prompts and filled as
    fully as the pool allows (``pair_rows``), leave little padding and
    compute little attention between prompts: a row of two prompts computes
    at most about twice the attention scores they need, where a row of
    max_length holding a dozen short prompts computes a dozen times more.
    A batch is a dict of numpy arrays:

        input_ids      [B, S]    int32  prompts one after another, right-padded with `pad_id`
        attention_mask [B, S]    int32  prompt ids within the row (1, 2, ...), 0 on padding
        answer_pos     [B, P]    int32  index in the row of each prompt's last token
        label, index, valid [B, P]     as in `make_batch`, per prompt slot (-1 / False on empty slots)

    with S one of the row lengths and P the most prompts a row of that length
    holds. Each row length has its own batches (so a jitted step compiles
    once per row length used), of about `batch_tokens` tokens: B rows, a
    multiple of `row_multiple` (the devices a batch is split over), that
    length's rows spread evenly over the fewest batches that allows;
    shorter rows come first.

    `lanes` batches several lists of rows in lockstep (e.g. one per run, each
    run scoring its own examples), each lane's rows once: every leaf gains a
    leading lane axis [L, B, ...] and lane l of batch k holds the k-th chunk
    of lane l's packed rows of that length, with empty rows where lane l has
    fewer than the fullest lane. A row may be in several lanes. Without
    `lanes`: one lane of every row, and no lane axis.
    """
    if batch_tokens < 1 or row_multiple < 1:
        raise ValueError(f"batch_tokens and row_multiple must be positive, got {batch_tokens} and {row_multiple}")
    if lanes is None:
        lane_rows = [np.arange(len(tokenized))]
    elif not lanes:
        raise ValueError("lanes is empty: give at least one lane of rows (or None for every row)")
    else:
        lane_rows = [_lane_rows(tokenized, rows, lane) for lane, rows in enumerate(lanes)]
    lengths = eval_row_lengths(tokenized.max_length, row_lengths)
    # Per row length, each lane's packed rows (lists of TokenizedSet rows), in packing order.
    by_length: dict[int, list[list[list[int]]]] = {length: [[] for _ in lane_rows] for length in lengths}
    for lane, rows in enumerate(lane_rows):
        for length, members in pair_rows(tokenized.lengths[rows], lengths):
            by_length[length][lane].append(rows[members].tolist())
    plan = []
    for length, packed in by_length.items():
        most_rows = max(len(rows) for rows in packed)
        if not most_rows:
            continue
        prompts_per_row = max(len(row) for rows in packed for row in rows)
        rows = max(row_multiple, batch_tokens // length // row_multiple * row_multiple)
        per_batch = _ceil_div(most_rows, _ceil_div(most_rows, rows))  # the fewest batches of at most `rows`, evened
        rows = min(rows, _ceil_div(per_batch, row_multiple) * row_multiple)
        for first in range(0, most_rows, rows):
            chunks = [lane[first : first + rows] for lane in packed]
            plan.append((length, prompts_per_row, [chunk + [[]] * (rows - len(chunk)) for chunk in chunks]))

    def batch(entry: tuple[int, int, list[list[list[int]]]]) -> Batch:
        length, prompts_per_row, chunks = entry
        per_lane = [_packed_batch(tokenized, chunk, prompts_per_row, length, pad_id=pad_id) for chunk in chunks]
        if lanes is None:
            return per_lane[0]
        return {key: np.stack([b[key] for b in per_lane]) for key in per_lane[0]}

    return grain.MapDataset.source(plan).map(batch)


def pair_rows(
    lengths: np.ndarray, row_lengths: Sequence[int], prompts_per_row: int = EVAL_PROMPTS_PER_ROW
) -> list[tuple[int, list[int]]]:
    """Indices of ``lengths`` grouped into rows of the sorted ``row_lengths``, at most ``prompts_per_row`` a row:
    (row length, indices) pairs.

    Longest prompt first: it opens a row of the length that it and its
    filling fill most fully (the shortest such), the filling being, one
    after another, the longest remaining prompts that still fit. With many
    prompts to choose from, a pair nearly always fills a row to within a few
    tokens, so rows are almost all prompt while no row holds more than a
    couple of them. Deterministic, so every process packs a pool the same way.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    longest = int(row_lengths[-1])
    too_long = np.flatnonzero(lengths > longest)
    if too_long.size:
        raise ValueError(f"prompts {too_long[:5].tolist()} are longer than the longest row, {longest}")
    if prompts_per_row < 1:
        raise ValueError(f"rows need at least one prompt slot, got {prompts_per_row}")
    # The remaining prompts: the distinct lengths, sorted, and per length its indices (the earliest on top).
    waiting: dict[int, list[int]] = collections.defaultdict(list)
    for item in np.argsort(-lengths, kind="stable")[::-1].tolist():
        waiting[int(lengths[item])].append(item)
    available = sorted(waiting)

    def longest_fitting(room: int, taken: collections.Counter) -> int | None:
        """The longest remaining length of at most ``room`` tokens, not counting the ``taken`` ones."""
        position = bisect.bisect_right(available, room) - 1
        while position >= 0 and taken[available[position]] >= len(waiting[available[position]]):
            position -= 1
        return available[position] if position >= 0 else None

    def take(length: int) -> int:
        item = waiting[length].pop()
        if not waiting[length]:
            available.remove(length)
        return item

    rows = []
    while available:
        first = available[-1]
        best = None  # (tokens, row length, filling lengths)
        for row_length in row_lengths:
            if row_length < first:
                continue
            taken = collections.Counter({first: 1})
            filling, room = [], row_length - first
            while len(filling) + 1 < prompts_per_row and (fit := longest_fitting(room, taken)) is not None:
                filling.append(fit)
                taken[fit] += 1
                room -= fit
            if best is None or (row_length - room) * best[1] > best[0] * row_length:  # a fuller row
                best = (row_length - room, row_length, filling)
        _, row_length, filling = best
        rows.append((int(row_length), [take(length) for length in [first, *filling]]))
    return rows


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
    grad_accum: int = 1,
    prompts_per_row: int | None = None,
    rows: Sequence[int] | None = None,
    pad_id: int = 0,
    prefetch: int = TRAIN_PREFETCH,
) -> grain.DatasetIterator:
    """An endless, shuffled stream of training batches; this process's rows of each global batch.

    The global stream is the set's epochs one after another, each a seeded
    numpy permutation of it (``epoch_permutation``); global batch t is
    elements [t*B, (t+1)*B) of it, laid out in B rows of `seq_len` tokens,
    so that the train step, which cuts each micro-batch to the bucket of its
    longest row and skips empty ones, computes little padding. Either one
    prompt a row, ordered by length (``by_length``), so consecutive
    micro-batches hold prompts of similar length; or, with `pack`, packed
    several to a row and balanced (``balanced_batch``): the B rows are
    `grad_accum` micro-batches of B / grad_accum rows (one per device, as
    ``BatchGeometry`` lays a packed batch out), and each prompt goes to the
    least-filled row of the first micro-batch with room, so a micro-batch's
    longest row, the length it runs at, is as short as the prompts allow and
    later micro-batches stay empty; rows have `prompts_per_row` prompt slots
    (default: ``train_prompts_per_row`` of this set; runs trained together
    must share it). `rows` are the row positions of that batch this process
    feeds to its devices (None: all B). Taking positions, not a stride of
    the stream, keeps every example on the device and row where a
    single-process run puts it, so per-row randomness such as dropout masks
    is the same however many processes share the batch. `seq_len` defaults
    to the smallest default bucket holding the longest example.

    A background thread builds the next `prefetch` batches ahead (0: each
    is built when asked for). The returned grain iterator's
    get_state()/set_state() (``{"next_index": batches consumed}``, JSON-able)
    count the batches handed out, not those built ahead, and resume the
    stream exactly.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if seed < 0:
        raise ValueError(f"the training stream's seed must be >= 0, got {seed}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 batches, got {prefetch}")
    if grad_accum < 1 or batch_size % grad_accum:
        raise ValueError(f"grad_accum must be a positive divisor of batch_size {batch_size}, got {grad_accum}")
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

    def batch(index: int) -> Batch:
        examples = stream_examples(seed, len(tokenized), batch_size, index)
        if not pack:
            return make_batch(tokenized, by_length(tokenized, examples)[keep], seq_len, pad_id=pad_id)
        packed = balanced_batch(
            tokenized, examples, batch_size, seq_len, prompts_per_row, micro_batches=grad_accum, pad_id=pad_id
        )
        return {key: value[keep] for key, value in packed.items()}

    options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)
    return iter(grain.MapDataset.range(_ENDLESS).map(batch).to_iter_dataset(options))


def stream_examples(seed: int, size: int, batch_size: int, index: int) -> np.ndarray:
    """The examples of global batch ``index`` of a training stream: elements [index * batch_size, (index + 1) *
    batch_size) of the set's epochs (``epoch_permutation``) one after another; a batch may straddle two epochs."""
    positions = np.arange(index * batch_size, (index + 1) * batch_size)
    epochs, offsets = np.divmod(positions, size)
    return np.concatenate([epoch_permutation(seed, size, int(e))[offsets[epochs == e]] for e in np.unique(epochs)])


@functools.lru_cache(maxsize=64)
def epoch_permutation(seed: int, size: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s order of a training set of ``size`` examples: numpy's permutation, seeded by (seed, epoch).

    Drawn whole, once per epoch (cached, read-only), so a batch costs a few
    slices, not a shuffle per example; runs seeded s and s + 1 share no
    epoch order.
    """
    order = np.random.default_rng([seed, epoch]).permutation(size)
    order.flags.writeable = False
    return order


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


def balanced_batch(
    tokenized: TokenizedSet,
    examples: np.ndarray,
    num_rows: int,
    seq_len: int,
    prompts_per_row: int,
    *,
    micro_batches: int,
    pad_id: int = 0,
) -> Batch:
    """``examples`` packed into ``num_rows`` rows of ``seq_len`` tokens, ``micro_batches`` consecutive blocks of
    rows, balanced by ``balance_rows``; in ``eval_batches``' layout with ``prompts_per_row`` slots a row."""
    examples = np.asarray(examples)
    members = balance_rows(
        tokenized.lengths[examples], num_rows=num_rows, micro_batches=micro_batches, row_length=seq_len,
        prompts_per_row=prompts_per_row,
    )  # fmt: skip
    rows = [examples[row].tolist() for row in members]
    return _packed_batch(tokenized, rows, prompts_per_row, seq_len, pad_id=pad_id)


def balance_rows(
    lengths: np.ndarray, *, num_rows: int, micro_batches: int, row_length: int, prompts_per_row: int
) -> list[list[int]]:
    """Indices of ``lengths`` in ``num_rows`` rows (``micro_batches`` consecutive blocks of rows), each row at most
    ``row_length`` tokens and ``prompts_per_row`` prompts.

    Longest first, each prompt goes to the least-filled row (the first of
    equals) of the first micro-batch that has room for it. A micro-batch
    runs at the length of its longest row, and on a mesh its rows are its
    devices' (one each), so spreading the prompts evenly over its rows
    makes that length as short as the prompts allow; filling the first
    micro-batch before the next leaves the later ones empty, to be skipped.
    Deterministic, so every process places every prompt alike.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if micro_batches < 1 or num_rows % micro_batches:
        raise ValueError(f"{num_rows} rows cannot be split into {micro_batches} micro-batches of equal size")
    per_micro_batch = num_rows // micro_batches
    load, members = [0] * num_rows, [[] for _ in range(num_rows)]
    for item in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[item])
        for first in range(0, num_rows, per_micro_batch):
            row = _least_filled(load, members, first, first + per_micro_batch, need, row_length, prompts_per_row)
            if row is not None:
                break
        else:
            raise ValueError(
                f"{len(lengths)} prompts of {int(lengths.sum())} tokens (longest {int(lengths.max())}) do not fit "
                f"{num_rows} rows of {row_length} tokens and {prompts_per_row} prompt slots; at prompt {item} "
                f"({need} tokens)"
            )
        load[row] += need
        members[row].append(item)
    return members


def _least_filled(
    load: list[int], members: list[list[int]], start: int, stop: int, need: int, row_length: int, slots: int
) -> int | None:
    """The least-filled of rows [start, stop) with room for ``need`` more tokens and another prompt, or None."""
    best = None
    for row in range(start, stop):
        if load[row] + need <= row_length and len(members[row]) < slots and (best is None or load[row] < load[best]):
            best = row
    return best


def prompt_lengths(batch: Batch) -> np.ndarray:
    """Each prompt's token count in ``answer_pos``'s shape, 0 on invalid prompts (one prompt a row or packed,
    with or without leading run and micro-batch axes): a packed row's prompts lie one after another from its
    start, so each ends at its answer and begins after the previous one's."""
    answer_pos = np.asarray(batch["answer_pos"], dtype=np.int64)
    previous = -1
    if answer_pos.ndim == np.ndim(batch["input_ids"]):  # a prompt-slot axis: packed rows
        previous = np.concatenate([np.full((*answer_pos.shape[:-1], 1), -1), answer_pos[..., :-1]], axis=-1)
    return np.where(batch["valid"], answer_pos - previous, 0)


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
