"""Training: every run's seeded, resumable stream of examples, laid out step by step in rows built ahead.

Run r's stream is its few-shot set's epochs one after another, each a numpy
permutation drawn whole, so drawing a batch costs a few slices. A step lays
all runs' prompts out together (``step_layout``); the train step adapts each
token with its own run's adapters. ``replay_rows`` works out from prompt
lengths alone what a job's steps will hold, so the step's shapes are known
before it compiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import grain
import numpy as np

from oodjax.data.batches import Batch, packed_rows_batch, row_positions
from oodjax.data.packing import balance_rows
from oodjax.data.prompts import TokenizedSet

TRAIN_PREFETCH = 2  # training steps a stream builds ahead, in a background thread
_ENDLESS = 2**62  # the length of an endless stream of steps (grain needs one)
_UNBOUNDED = 2**62  # no limit on a row's tokens or prompts, for the replay


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How a training step lays its runs' prompts out: ``micro_batches`` blocks of ``rows`` global rows."""

    micro_batches: int
    rows: int
    packed: bool


def step_layout(
    lengths: Sequence[np.ndarray],
    layout: StepLayout,
    *,
    row_length: int = _UNBOUNDED,
    prompts_per_row: int = _UNBOUNDED,
) -> list[list[tuple[int, int]]]:
    """The step's rows, micro-batch after micro-batch, each a list of (run, example in its run's batch).

    One prompt a row: micro-batch i holds slice i of each run's prompts
    sorted by length, so its rows are of similar length. Packed: all runs'
    prompts balanced over all rows (``balance_rows``). Deterministic, so
    every process lays a step out alike.
    """
    if not layout.packed:
        per_micro = [len(run) // layout.micro_batches for run in lengths]
        orders = [np.argsort(run, kind="stable") for run in lengths]
        return [
            [(r, int(e))]
            for i in range(layout.micro_batches)
            for r, order in enumerate(orders)
            for e in order[i * per_micro[r] : (i + 1) * per_micro[r]]
        ]
    items = [(r, e) for r, run in enumerate(lengths) for e in range(len(run))]
    members = balance_rows(
        np.concatenate(lengths),
        num_rows=layout.micro_batches * layout.rows,
        row_length=row_length,
        prompts_per_row=prompts_per_row,
    )
    return [[items[i] for i in row] for row in members]


def train_steps(
    sets: Sequence[TokenizedSet],
    seeds: Sequence[int],
    *,
    batch_size: int,
    layout: StepLayout,
    seq_len: int,
    prompts_per_row: int = 1,
    rows: Sequence[int] | None = None,
    pad_id: int = 0,
    prefetch: int = TRAIN_PREFETCH,
) -> grain.DatasetIterator:
    """An endless stream of training steps (``oodjax.data.batches``' layout): run r draws from ``sets[r]``.

    This process keeps positions ``rows`` of each micro-batch (None: all):
    positions, not a stride, keep every prompt on the device and row where a
    single process puts it. The iterator's state counts the steps handed
    out, not those built ahead, and resumes the stream exactly.
    """
    if not sets or len(sets) != len(seeds):
        raise ValueError(f"train_steps needs one set per seed, got {len(sets)} sets and {len(seeds)} seeds")
    if batch_size < 1 or batch_size % layout.micro_batches:
        raise ValueError(f"batch_size {batch_size} must be a positive multiple of {layout.micro_batches} micro-batches")
    if min(seeds) < 0:
        raise ValueError(f"training streams' seeds must be >= 0, got {list(seeds)}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 steps, got {prefetch}")
    if any(len(tokenized) == 0 for tokenized in sets):
        raise ValueError("cannot train on an empty set")
    if not layout.packed and layout.rows * layout.micro_batches != len(sets) * batch_size:
        raise ValueError(
            f"one prompt a row, {layout.micro_batches} micro-batches of {len(sets)} runs' batches of {batch_size} "
            f"need {len(sets) * batch_size // layout.micro_batches} rows each, not {layout.rows}"
        )
    keep, outside = row_positions(range(layout.rows) if rows is None else rows, layout.rows)
    if outside.size or len(np.unique(keep)) != len(keep) or not len(keep):
        raise ValueError(
            f"rows must be distinct positions in a micro-batch of {layout.rows} rows; got {keep[:8].tolist()}"
            + (f" (outside [0, {layout.rows}): {outside[:5].tolist()})" if outside.size else "")
        )
    longest = max(int(tokenized.lengths.max()) for tokenized in sets)
    if seq_len < longest:
        raise ValueError(f"seq_len {seq_len} is shorter than the longest training prompt ({longest} tokens)")

    def step(index: int) -> Batch:
        examples = [stream_examples(seed, len(t), batch_size, index) for t, seed in zip(sets, seeds, strict=True)]
        lengths = [t.lengths[e] for t, e in zip(sets, examples, strict=True)]
        members = step_layout(lengths, layout, row_length=seq_len, prompts_per_row=prompts_per_row)
        prompts = [[(run, int(examples[run][example])) for run, example in row] for row in members]
        per_slot = {
            "run": [[run for run, _ in row] for row in members],
            "example": [[e for _, e in row] for row in members],
        }
        batch = packed_rows_batch(sets, prompts, prompts_per_row, seq_len, pad_id=pad_id, per_slot=per_slot)
        return {
            key: value.reshape(layout.micro_batches, layout.rows, *value.shape[1:])[:, keep]
            for key, value in batch.items()
        }

    options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)
    return iter(grain.MapDataset.range(_ENDLESS).map(step).to_iter_dataset(options))


def replay_rows(
    sets: Sequence[TokenizedSet], seeds: Sequence[int], *, batch_size: int, layout: StepLayout, steps: int
) -> tuple[np.ndarray, int]:
    """From the prompts' lengths alone, the first ``steps`` steps' [steps, micro_batches] longest rows and
    the most prompts a row holds; ``train_steps`` lays them out alike within bounds at least these."""
    longest = np.zeros((steps, layout.micro_batches), dtype=np.int64)
    most_prompts = 1
    for index in range(steps):
        lengths = [
            t.lengths[stream_examples(seed, len(t), batch_size, index)] for t, seed in zip(sets, seeds, strict=True)
        ]
        members = step_layout(lengths, layout)
        tokens = np.array([sum(int(lengths[r][e]) for r, e in row) for row in members], dtype=np.int64)
        longest[index] = tokens.reshape(layout.micro_batches, -1).max(axis=1)
        most_prompts = max(most_prompts, max(len(row) for row in members))
    return longest, most_prompts


def packed_layout(
    sets: Sequence[TokenizedSet],
    seeds: Sequence[int],
    *,
    batch_size: int,
    micro_batches: int,
    shards: int,
    row_length: int,
    steps: int,
) -> tuple[StepLayout, np.ndarray, int]:
    """The packed layout with the fewest rows (a multiple of ``shards``) that keeps every row of the first
    ``steps`` steps within ``row_length``, and ``replay_rows``' figures; bounded because a row computes
    attention between all its prompts."""
    totals = np.zeros(steps, dtype=np.int64)
    for index in range(steps):
        for tokenized, seed in zip(sets, seeds, strict=True):
            lengths = tokenized.lengths[stream_examples(seed, len(tokenized), batch_size, index)]
            totals[index] += int(lengths.sum())
            if lengths.max() > row_length:
                raise ValueError(f"a training prompt of {int(lengths.max())} tokens outgrows rows of {row_length}")
    # A step's tokens spread over all its rows: at least that many rows of row_length each, per device.
    per_device = max(1, -(-int(totals.max(initial=0)) // (micro_batches * shards * row_length)))
    while True:
        layout = StepLayout(micro_batches=micro_batches, rows=shards * per_device, packed=True)
        longest, most_prompts = replay_rows(sets, seeds, batch_size=batch_size, layout=layout, steps=steps)
        if longest.max(initial=0) <= row_length:  # more rows than prompts hold one each: this ends
            return layout, longest, most_prompts
        per_device += 1


def stream_examples(seed: int, size: int, batch_size: int, index: int) -> np.ndarray:
    """The examples of global batch ``index`` of a training stream; a batch may straddle two epochs."""
    positions = np.arange(index * batch_size, (index + 1) * batch_size)
    epochs, offsets = np.divmod(positions, size)
    return np.concatenate([epoch_permutation(seed, size, int(e))[offsets[epochs == e]] for e in np.unique(epochs)])


@functools.lru_cache(maxsize=64)
def epoch_permutation(seed: int, size: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s order, seeded by (seed, epoch) so that runs seeded s and s + 1 share none."""
    order = np.random.default_rng([seed, epoch]).permutation(size)
    order.flags.writeable = False
    return order
