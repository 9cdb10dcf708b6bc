"""Training streams: each run's endless, seeded, resumable stream of batches, built ahead in a thread.

The stream is the few-shot set's epochs one after another, each a numpy
permutation drawn whole (``epoch_permutation``), so a batch costs a few
slices; batches are laid out as ``oodjax.data.batches`` describes, one
prompt a row by length or packed and balanced (``oodjax.data.packing``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import grain
import numpy as np

from oodjax.data.batches import (
    Batch,
    bucket_lengths,
    by_length,
    fitting_bucket,
    make_batch,
    packed_rows_batch,
    row_positions,
)
from oodjax.data.packing import balance_rows
from oodjax.data.prompts import TokenizedSet

TRAIN_PREFETCH = 2  # training batches a stream builds ahead, in a background thread
_ENDLESS = 2**62  # the length of an endless stream of batches (grain needs one)


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
    keep, outside = row_positions(range(batch_size) if rows is None else rows, batch_size)
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


def micro_batch_longest_rows(
    tokenized: TokenizedSet,
    *,
    batch_size: int,
    seed: int,
    seq_len: int,
    steps: int,
    pack: bool,
    grad_accum: int,
    prompts_per_row: int | None,
) -> np.ndarray:
    """[steps, grad_accum]: the tokens of the longest row of each micro-batch of the stream's first ``steps``
    global batches (0 for a micro-batch without a prompt), worked out from the prompts' lengths alone.

    The rows are those ``train_batches`` lays out with the same arguments
    (all rows of each batch; with ``pack``, ``prompts_per_row`` slots a row):
    one prompt a row, shortest first (``by_length``), or packed by
    ``balance_rows``; micro-batch i is rows [i * B / grad_accum, (i + 1) * B
    / grad_accum). A whole training's worth costs about a millisecond a step.
    """
    longest = np.zeros((steps, grad_accum), dtype=np.int64)
    for index in range(steps):
        examples = stream_examples(seed, len(tokenized), batch_size, index)
        if pack:
            lengths = tokenized.lengths[examples]
            members = balance_rows(
                lengths, num_rows=batch_size, micro_batches=grad_accum, row_length=seq_len,
                prompts_per_row=prompts_per_row,
            )  # fmt: skip
            rows = np.array([lengths[row].sum() for row in members], dtype=np.int64)
        else:
            rows = tokenized.lengths[by_length(tokenized, examples)]
        longest[index] = rows.reshape(grad_accum, -1).max(axis=1)
    return longest


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
    rows, balanced by ``balance_rows``; in ``packed_rows_batch``' layout with ``prompts_per_row`` slots a row."""
    examples = np.asarray(examples)
    members = balance_rows(
        tokenized.lengths[examples], num_rows=num_rows, micro_batches=micro_batches, row_length=seq_len,
        prompts_per_row=prompts_per_row,
    )  # fmt: skip
    rows = [examples[row].tolist() for row in members]
    return packed_rows_batch(tokenized, rows, prompts_per_row, seq_len, pad_id=pad_id)
