"""Batched evaluation of all runs on a testset: the margin logit(Yes) - logit(No) of every example.

A testset's batches are built once (static, bucketed shapes) and kept, so
every evaluation replays the same arrays through the same compiled step:
after the first evaluation nothing compiles again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from oodjax.data import Batch, TokenizedSet, eval_batches

# What the eval step reads; `index` stays on the host to place the margins.
_STEP_KEYS = ("input_ids", "attention_mask", "answer_pos", "label", "valid")


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """A tokenised testset as the padded batches every evaluation replays."""

    name: str
    labels: np.ndarray  # [N] 0 = entailment
    batches: tuple[Batch, ...]

    def __len__(self) -> int:
        return len(self.labels)


def make_eval_set(
    name: str, tokenized: TokenizedSet, *, batch_size: int, buckets: Sequence[int], pad_id: int
) -> EvalSet:
    batches = tuple(eval_batches(tokenized, batch_size=batch_size, buckets=buckets, pad_id=pad_id))
    return EvalSet(name=name, labels=np.asarray(tokenized.labels, dtype=np.int32), batches=batches)


def evaluate(
    eval_step: Callable[..., jax.Array],
    base_state,
    lora,
    eval_set: EvalSet,
    *,
    num_runs: int,
    place: Callable[[Batch], Batch],
) -> np.ndarray:
    """Margins [R, N] float32 of every run on every example, in the testset's row order.

    All batches are dispatched before any result is fetched, so the host
    never waits on the device between batches. `place` puts a batch on the
    devices (sharded over the batch axes).
    """
    outputs = [
        eval_step(base_state, lora, place({key: batch[key] for key in _STEP_KEYS})) for batch in eval_set.batches
    ]
    margins = np.zeros((num_runs, len(eval_set)), dtype=np.float32)
    covered = np.zeros(len(eval_set), dtype=bool)
    for batch, output in zip(eval_set.batches, outputs):
        rows = batch["index"][batch["valid"]]
        margins[:, rows] = np.asarray(jax.device_get(output))[:, batch["valid"]]
        covered[rows] = True
    if not covered.all():
        missing = np.flatnonzero(~covered)
        raise RuntimeError(f"{eval_set.name}: no batch holds examples {missing[:10].tolist()} ({len(missing)} in all)")
    return margins
