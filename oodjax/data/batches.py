"""Batches: their layout, the lengths their rows come in, and the one builder of their packed rows.

Every batch is a dict of numpy arrays, its rows packed with one prompt or
more (``packed_rows_batch``):

    input_ids      [B, S] int32  prompts one after another from the row's start, right-padded with `pad_id`
    segment_ids    [B, S] int32  each token's prompt slot in the row plus 1 (1, 2, ...), 0 on padding:
                                 the models' ``attention_mask``
    answer_pos     [B, P] int32  index in the row of each prompt's last token (its logits score the answer)
    label          [B, P] int32  0 = entailment (" Yes"), 1 = not entailment (" No")
    index          [B, P] int32  the prompt's row in its TokenizedSet; -1 on empty slots
    valid          [B, P] bool   False on empty slots, which must be masked out

with P prompt slots a row. A training step adds per slot ``run`` and
``example`` (its place in its run's batch, which keys its dropout), and a
leading micro-batch axis; evaluation's batches of several lanes a leading
lane axis.

Padding changes no prompt's result and makes no NaN: a token attends only
to earlier tokens of its own non-zero segment (``oodjax.models.flash_attention.attention``),
an empty slot is masked by ``valid``, and an empty row still gives its first
position segment 1, so that no row is all padding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grain
import numpy as np

from oodjax.data.packing import pair_rows
from oodjax.data.prompts import TokenizedSet

Batch = dict[str, np.ndarray]
SEQUENCE_KEYS = ("input_ids", "segment_ids")  # [..., S]: a batch's other arrays are per prompt slot
EVAL_KEYS = (*SEQUENCE_KEYS, "answer_pos", "label", "valid")  # what evaluation gives the eval step
TRAIN_ONLY_KEYS = ("run", "example")  # what a training step adds per prompt slot
TRAIN_KEYS = (*EVAL_KEYS, *TRAIN_ONLY_KEYS)  # what the loop gives the train step
MIN_BUCKET = 64
BUCKETS_PER_DOUBLING = 4  # default training lengths: 64, 80, 96, 112, 128, 160, ...
MIN_EVAL_ROW = 32  # default evaluation row lengths: 32, 48, 64, 96, 128, 192, ...


def bucket_lengths(max_length: int, buckets: Sequence[int] | None = None) -> tuple[int, ...]:
    """Sorted sequence lengths training micro-batches are cut to; the last is always max_length.

    Four lengths per doubling by default: a micro-batch runs at most 25% longer than its longest row
    (powers of two would allow 100%).
    """
    steps = [step * MIN_BUCKET // BUCKETS_PER_DOUBLING for step in range(BUCKETS_PER_DOUBLING)]
    return _lengths_up_to(max_length, buckets, MIN_BUCKET, steps, "bucket lengths")


def eval_row_lengths(max_length: int, row_lengths: Sequence[int] | None = None) -> tuple[int, ...]:
    """Sorted lengths of evaluation rows; the last is always max_length.

    32 and 48 times the powers of two by default: a row of one or two prompts is nearly full, and
    evaluation compiles a handful of batch shapes.
    """
    return _lengths_up_to(max_length, row_lengths, MIN_EVAL_ROW, [0, MIN_EVAL_ROW // 2], "evaluation row lengths")


def _lengths_up_to(
    max_length: int, lengths: Sequence[int] | None, first: int, offsets: Sequence[int], what: str
) -> tuple[int, ...]:
    """``lengths`` below max_length, then max_length; None: ``first`` plus each of ``offsets``, times the
    powers of two."""
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


def packed_rows_batch(
    sets: Sequence[TokenizedSet],
    rows: Sequence[Sequence[tuple[int, int]]],
    prompts_per_row: int,
    seq_len: int,
    *,
    pad_id: int,
    per_slot: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> Batch:
    """The batch (module docstring) whose row r holds the prompts ``rows[r]``, (s, i) being prompt i of
    ``sets[s]``; ``per_slot`` adds [B, P] arrays laid out as the prompts are."""
    per_slot = per_slot or {}
    shape = (len(rows), prompts_per_row)
    input_ids = np.full((len(rows), seq_len), pad_id, dtype=np.int32)
    segment_ids = np.zeros(input_ids.shape, dtype=np.int32)
    segment_ids[:, 0] = 1  # an empty row's first position too (the module docstring's padding)
    slots = {key: np.zeros(shape, dtype=np.int32) for key in ("answer_pos", "label", *per_slot)}
    index = np.full(shape, -1, dtype=np.int32)
    for r, members in enumerate(rows):
        start = 0
        for slot, (s, i) in enumerate(members):
            prompt = sets[s].prompt(i)
            stop = start + len(prompt)
            input_ids[r, start:stop] = prompt
            segment_ids[r, start:stop] = slot + 1
            slots["answer_pos"][r, slot] = stop - 1
            slots["label"][r, slot] = sets[s].labels[i]
            for key, values in per_slot.items():
                slots[key][r, slot] = values[r][slot]
            index[r, slot] = i
            start = stop
    return {"input_ids": input_ids, "segment_ids": segment_ids, **slots, "index": index, "valid": index >= 0}


def prompt_lengths(batch: Batch) -> np.ndarray:
    """Each prompt's token count in ``answer_pos``'s shape, 0 on invalid prompts: a packed row's prompts lie
    one after another, so each begins after the previous one's answer."""
    answer_pos = np.asarray(batch["answer_pos"], dtype=np.int64)
    previous: int | np.ndarray = -1
    if answer_pos.ndim == np.ndim(batch["input_ids"]):  # a prompt-slot axis: packed rows
        previous = np.concatenate([np.full((*answer_pos.shape[:-1], 1), -1), answer_pos[..., :-1]], axis=-1)
    return np.where(batch["valid"], answer_pos - previous, 0)


def eval_batches(
    tokenized: TokenizedSet,
    *,
    batch_tokens: int,
    row_multiple: int = 1,
    pad_id: int = 0,
    lanes: Sequence[Sequence[int] | np.ndarray] | None = None,
    row_lengths: Sequence[int] | None = None,
    layout: Mapping[int, tuple[int, int]] | None = None,
) -> grain.MapDataset:
    """One pass over every example exactly once, prompts packed one or two to a row of one of ``row_lengths``.

    At most two prompts a row: a row of max_length holding a dozen short
    prompts would compute a dozen times the attention scores they need. Each
    row length has its own batches of about `batch_tokens` tokens (so a
    jitted step compiles once per length), B a multiple of `row_multiple`.

    `lanes` batches several lists of rows in lockstep (one per run), adding
    a leading lane axis. `layout` (another pool's ``batch_layout``) gives
    every batch one of that pool's shapes, so a step compiled for it runs
    these without compiling again.
    """
    if batch_tokens < 1 or row_multiple < 1:
        raise ValueError(f"batch_tokens and row_multiple must be positive, got {batch_tokens} and {row_multiple}")
    if lanes is None:
        lane_rows = [np.arange(len(tokenized))]
    elif not lanes:
        raise ValueError("lanes is empty: give at least one lane of rows (or None for every row)")
    else:
        lane_rows = [_lane_rows(tokenized, rows, lane) for lane, rows in enumerate(lanes)]
    lengths = tuple(sorted(layout)) if layout else eval_row_lengths(tokenized.max_length, row_lengths)
    # Per row length, each lane's packed rows in packing order, as packed_rows_batch takes them: (0, row of
    # ``tokenized``) per prompt.
    by_length: dict[int, list[list[list[tuple[int, int]]]]] = {length: [[] for _ in lane_rows] for length in lengths}
    for lane, rows in enumerate(lane_rows):
        for length, members in pair_rows(tokenized.lengths[rows], lengths):
            if layout and len(members) > layout[length][1]:
                split = [(fitting_bucket(lengths, int(tokenized.lengths[rows[m]])), [m]) for m in members]
            else:
                split = [(length, members)]
            for row_length, row_members in split:
                by_length[row_length][lane].append([(0, i) for i in rows[row_members].tolist()])
    plan: list[tuple[int, int, list[list[list[tuple[int, int]]]]]] = []
    for length, packed in by_length.items():
        most_rows = max(len(rows) for rows in packed)
        if not most_rows:
            continue
        if layout:
            size, prompts_per_row = layout[length]
        else:
            prompts_per_row = max(len(row) for rows in packed for row in rows)
            size = max(row_multiple, batch_tokens // length // row_multiple * row_multiple)
            per_batch = _ceil_div(most_rows, _ceil_div(most_rows, size))  # the fewest batches of at most `size`, evened
            size = min(size, _ceil_div(per_batch, row_multiple) * row_multiple)
        for first in range(0, most_rows, size):
            chunks = [lane[first : first + size] for lane in packed]
            plan.append((length, prompts_per_row, [chunk + [[]] * (size - len(chunk)) for chunk in chunks]))

    def batch(entry: tuple[int, int, list[list[list[tuple[int, int]]]]]) -> Batch:
        length, prompts_per_row, chunks = entry
        per_lane = [packed_rows_batch([tokenized], chunk, prompts_per_row, length, pad_id=pad_id) for chunk in chunks]
        return per_lane[0] if lanes is None else {key: np.stack([b[key] for b in per_lane]) for key in per_lane[0]}

    return grain.MapDataset.source(plan).map(batch)


def batch_layout(batches: Sequence[Batch]) -> dict[int, tuple[int, int]]:
    """{row length: (rows a batch, prompt slots a row)} of ``eval_batches``' batches, for its ``layout``."""
    return {
        batch["input_ids"].shape[-1]: (batch["input_ids"].shape[-2], batch["answer_pos"].shape[-1]) for batch in batches
    }


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def row_positions(rows: Sequence[int] | np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` as a flat int array, and those outside [0, size), for the caller's error message."""
    flat = np.asarray(rows, dtype=np.int64).reshape(-1)
    return flat, flat[(flat < 0) | (flat >= size)]


def _lane_rows(tokenized: TokenizedSet, rows: Sequence[int] | np.ndarray, lane: int) -> np.ndarray:
    positions, outside = row_positions(rows, len(tokenized))
    if outside.size:
        raise ValueError(f"lane {lane} names rows outside [0, {len(tokenized)}): {outside[:5].tolist()}")
    return positions
