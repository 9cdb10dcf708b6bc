"""Which prompts share a row: index logic only, the arrays are laid out by ``oodjax.data.batches``.

Both packers are greedy and deterministic, so every process packs a pool
alike: ``pair_rows`` for evaluation (every prompt once, rows as full as
possible), ``balance_rows`` for training (a step's prompts spread evenly
over a fixed number of rows, so the longest, which a micro-batch runs at, is
as short as the prompts allow).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence

import numpy as np

# At most two prompts an evaluation row: a row then computes at most about twice the
# (causal) attention scores its prompts need, however its length is split between them.
EVAL_PROMPTS_PER_ROW = 2


def pair_rows(
    lengths: np.ndarray, row_lengths: Sequence[int], prompts_per_row: int = EVAL_PROMPTS_PER_ROW
) -> list[tuple[int, list[int]]]:
    """(row length, indices) of ``lengths`` packed into rows of the sorted ``row_lengths``.

    The longest prompt opens the row length that it and the longest
    remaining prompts that fit fill most fully; with many prompts, a pair
    nearly always fills a row to within a few tokens.
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

    def longest_fitting(room: int, taken: collections.Counter[int]) -> int | None:
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
            filling, room = list[int](), row_length - first
            while len(filling) + 1 < prompts_per_row and (fit := longest_fitting(room, taken)) is not None:
                filling.append(fit)
                taken[fit] += 1
                room -= fit
            if best is None or (row_length - room) * best[1] > best[0] * row_length:  # a fuller row
                best = (row_length - room, row_length, filling)
        assert best is not None  # the longest row holds any prompt (checked above)
        _, row_length, filling = best
        rows.append((int(row_length), [take(length) for length in [first, *filling]]))
    return rows


def balance_rows(lengths: np.ndarray, *, num_rows: int, row_length: int, prompts_per_row: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``num_rows`` rows: longest first, each to the least-filled row with room."""
    lengths = np.asarray(lengths, dtype=np.int64)
    load, members = [0] * num_rows, [list[int]() for _ in range(num_rows)]
    for item in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[item])
        room = [row for row, filled in enumerate(load) if filled + need <= row_length]
        room = [row for row in room if len(members[row]) < prompts_per_row]  # and a free prompt slot
        if not room:
            raise ValueError(
                f"{len(lengths)} prompts of {int(lengths.sum())} tokens (longest {int(lengths.max())}) do not fit "
                f"{num_rows} rows of {row_length} tokens and {prompts_per_row} prompt slots; at prompt {item} "
                f"({need} tokens)"
            )
        row = min(room, key=load.__getitem__)  # the least filled; the first of equals
        load[row] += need
        members[row].append(item)
    return members
