"""Training: every run's seeded, resumable stream of examples, laid out step by step in rows built ahead.

Run r's stream is its few-shot set's epochs one after another, each a numpy
permutation drawn whole (``epoch_permutation``), so drawing a batch costs a
few slices. A step takes each run's next batch_size examples and lays all
runs' prompts out together (``step_layout``): one prompt a row, each run's
by length, or packed, each row holding prompts of any runs, balanced over
the rows (``oodjax.data.packing.balance_rows``); the train step adapts each
token with its own run's adapters. ``train_steps`` builds the steps ahead
in a background thread; ``replay_rows`` works out from prompt lengths alone
what a job's steps will hold, so the step's shapes are known before it
compiles, and ``packed_layout`` how many packed rows keep every row within
a length.
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
    """How a training step lays its runs' prompts out: ``micro_batches`` blocks of ``rows`` rows (global), one
    prompt a row (then ``rows`` is every run's share of a micro-batch) or packed (``packed_layout``)."""

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
    """The step's rows, micro-batch after micro-batch: each a list of (run, example) pairs, ``example`` being
    the prompt's place in its run's batch; ``lengths[r]`` are run r's batch's prompt lengths, in order.

    One prompt a row: micro-batch i holds, run after run, slice i of each
    run's prompts ordered by length (shortest first, ties in order), so a
    micro-batch's rows are of similar length, as each run's would be alone.
    Packed: all runs' prompts, longest first, each to the least-filled row
    (``balance_rows``) of all micro-batches' rows, so every row, and so every
    micro-batch's longest, is as short as the prompts allow; rows hold at
    most ``row_length`` tokens and ``prompts_per_row`` prompts.
    Deterministic, so every process lays a step out alike.
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
    """An endless stream of training steps: run r draws its batches from ``sets[r]`` seeded by ``seeds[r]``.

    Step t holds each run's global batch t (``stream_examples``) laid out by
    ``step_layout``, as the train step takes it: input_ids and segment_ids
    [micro_batches, rows, seq_len] (segment ids number a row's prompts 1, 2,
    ...; 0 on padding), and per prompt slot [micro_batches, rows,
    prompts_per_row] answer_pos, label, valid, run (the prompt's run),
    example (its place in its run's batch) and index (its row in its run's
    set, -1 on an empty slot). Of the rows of each micro-batch, this process
    keeps positions ``rows`` (None: all): taking positions, not a stride,
    keeps every prompt on the device and row where a single process puts
    it.

    A background thread builds the next ``prefetch`` steps ahead (0: each is
    built when asked for). The returned grain iterator's
    get_state()/set_state() (``{"next_index": steps handed out}``,
    JSON-able) count the steps handed out, not those built ahead, and resume
    the stream exactly.
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
    num_rows = layout.rows
    if not layout.packed and num_rows * layout.micro_batches != len(sets) * batch_size:
        raise ValueError(
            f"one prompt a row, {layout.micro_batches} micro-batches of {len(sets)} runs' batches of {batch_size} "
            f"need {len(sets) * batch_size // layout.micro_batches} rows each, not {num_rows}"
        )
    keep, outside = row_positions(range(num_rows) if rows is None else rows, num_rows)
    if outside.size or len(np.unique(keep)) != len(keep) or not len(keep):
        raise ValueError(
            f"rows must be distinct positions in a micro-batch of {num_rows} rows; got {keep[:8].tolist()}"
            + (f" (outside [0, {num_rows}): {outside[:5].tolist()})" if outside.size else "")
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
            key: value.reshape(layout.micro_batches, num_rows, *value.shape[1:])[:, keep]
            for key, value in batch.items()
        }

    options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)
    return iter(grain.MapDataset.range(_ENDLESS).map(step).to_iter_dataset(options))


def replay_rows(
    sets: Sequence[TokenizedSet], seeds: Sequence[int], *, batch_size: int, layout: StepLayout, steps: int
) -> tuple[np.ndarray, int]:
    """What the first ``steps`` steps of ``train_steps`` hold, from the prompts' lengths alone: [steps,
    micro_batches] tokens of each micro-batch's longest row, and the most prompts any row holds.

    Rows are laid out as ``train_steps`` lays them out, unbounded (it lays
    them out alike when its bounds are at least these figures: each prompt
    goes where it would go here). About a millisecond a step for 9 runs.
    """
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
    """The packed layout of the first ``steps`` steps with the fewest rows (the same number on each of
    ``shards`` devices) that keeps every row within ``row_length`` tokens, and what ``replay_rows`` says of it.

    Rows are bounded, not one a device of whatever length a device's share
    of the step makes, because a row computes attention between all its
    prompts. The fewest rows that fit make each as full as the prompts
    allow.
    """
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
