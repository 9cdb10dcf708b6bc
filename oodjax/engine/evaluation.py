"""Batched evaluation of all runs: the margin logit(Yes) - logit(No) of every example each run scores.

An evaluation is one pool of examples: the testsets, which every run
scores, and each run's own few-shot training set. The pool's prompts are
packed as a whole and cut into batches by a token budget, so little is
padding and the last, partly filled batch of a row length happens once per
evaluation rather than once per testset. Batches carry a run axis
[R, B, ...]: run r's lane holds the examples run r scores. They are built
once and replayed by every evaluation through the same compiled steps.

When every testset of every run has a non-finite margin in a model's first
evaluation, the checkpoint is broken, and ``refuse_non_finite_model`` stops
the job before anything is recorded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from oodjax.data import EVAL_KEYS, Batch, TokenizedSet, batch_layout, eval_batches, prompt_lengths
from oodjax.usage_errors import UsageError


class NonFiniteModelError(UsageError):
    """Every margin set of a model's first evaluation holds NaN or infinite values: its weights are broken (not a
    config mistake, but the user's to fix: the checkpoint), so nothing is recorded."""


def refuse_non_finite_model(model: str, accuracies: Sequence[Mapping[str, float]]) -> None:
    """Raises ``NonFiniteModelError`` naming ``model`` when every testset's accuracy of every run (one mapping
    per run, as ``RunResults.add`` returns them) is NaN, i.e. each has a margin that is not finite."""
    if not accuracies or not all(math.isnan(value) for run in accuracies for value in run.values()):
        return
    testsets = ", ".join(accuracies[0])
    raise NonFiniteModelError(
        f"model {model}: its outputs are not finite: in its first evaluation every run ({len(accuracies)}) has "
        f"NaN or infinite margins on every testset ({testsets}), so nothing was recorded. Its weights are broken "
        "(a NaN or infinite tensor, a damaged download: fetch the checkpoint again) or overflow in model.dtype"
    )


@dataclasses.dataclass(frozen=True)
class EvalPool:
    """The examples of one evaluation, as the padded [R, B, ...] batches every evaluation replays."""

    sets: tuple[dict[str, slice], ...]  # run r: each set it scores -> that set's rows of the pool
    labels: np.ndarray  # [pool rows] 0 = entailment
    batches: tuple[Batch, ...]  # `index` [R, B, P] is the pool row, -1 on empty prompt slots
    interchangeable: bool = False  # each row is scored once, in any lane, for every run (make_eval_pool's like)

    @property
    def num_runs(self) -> int:
        return len(self.sets)

    def labels_of(self, run: int) -> dict[str, np.ndarray]:
        """Run ``run``'s sets and their labels, shared sets first."""
        return {name: self.labels[rows] for name, rows in self.sets[run].items()}


def make_eval_pool(
    shared: Mapping[str, TokenizedSet],
    own: Sequence[Mapping[str, TokenizedSet]],
    *,
    batch_tokens: int,
    row_multiple: int = 1,
    pad_id: int = 0,
    row_lengths: Sequence[int] | None = None,
    like: EvalPool | None = None,
) -> EvalPool:
    """The pool of the ``shared`` sets (scored by every run) and run r's ``own[r]`` (by run r alone).

    Batches hold about ``batch_tokens`` tokens at most, a multiple of ``row_multiple`` rows (the devices the
    batch is split over).

    With ``like`` (the pool of the same sets made without it), the runs score as one model, as they do while
    every adapter adds zero (step 0): each example is scored once, in whichever lane it is dealt to, so the
    shared sets cost one run's share, not R runs'. They are packed in ``like``'s batch shapes, so nothing
    compiles again.
    """
    if not own:
        raise ValueError("make_eval_pool needs one mapping in `own` per run (an empty one for a run without sets)")
    for run, run_sets in enumerate(own):
        if not shared and not run_sets:
            raise ValueError(f"run {run} scores no set: `shared` and own[{run}] are both empty")
        clash = sorted(set(run_sets) & set(shared))
        if clash:
            raise ValueError(f"run {run}'s own sets {clash} have the names of shared sets")
    parts = [*shared.values(), *(t for run_sets in own for t in run_sets.values())]
    pooled = _concatenate(parts)
    offsets = np.cumsum([0] + [len(t) for t in parts]).tolist()
    spans = iter([slice(start, stop) for start, stop in zip(offsets[:-1], offsets[1:])])
    shared_rows = {name: next(spans) for name in shared}
    sets = tuple({**shared_rows, **{name: next(spans) for name in run_sets}} for run_sets in own)
    if like is not None and like.sets != sets:
        raise ValueError("make_eval_pool: `like` was made from other sets than these (its sets' rows differ)")
    if like is None:
        lanes = [np.concatenate([np.arange(span.start, span.stop) for span in run_sets.values()]) for run_sets in sets]
    else:
        longest_first = np.argsort(-pooled.lengths, kind="stable")
        lanes = [longest_first[lane :: len(own)] for lane in range(len(own))]
    batches = eval_batches(
        pooled,
        batch_tokens=batch_tokens,
        row_multiple=row_multiple,
        pad_id=pad_id,
        lanes=lanes,
        row_lengths=row_lengths,
        layout=None if like is None else batch_layout(like.batches),
    )
    return EvalPool(
        sets=sets,
        labels=np.asarray(pooled.labels, dtype=np.int32),
        batches=tuple(batches),
        interchangeable=like is not None,
    )


def pool_figures(pool: EvalPool) -> dict[str, float]:
    """What an evaluation of ``pool`` computes against what its prompts need, over every run's lane.

    ``eval_real_token_share``: prompt tokens over all rows' tokens (empty rows are computed too).
    ``eval_attention_waste``: causal attention scores computed over those the prompts need, as the fused
    kernels compute them, so only attention between prompts, and on padding, counts as waste.
    """
    real = tokens = needed = computed = 0
    for batch in pool.batches:
        lengths = prompt_lengths(batch)
        row_length = batch["input_ids"].shape[-1]
        rows = batch["input_ids"].size // row_length
        real += int(lengths.sum())
        needed += int((lengths * (lengths + 1) // 2).sum())
        tokens += rows * row_length
        computed += rows * row_length * (row_length + 1) // 2
    return {"eval_real_token_share": real / tokens, "eval_attention_waste": computed / needed}


def _concatenate(parts: Sequence[TokenizedSet]) -> TokenizedSet:
    """One TokenizedSet of ``parts``' prompts, in order (they must share a max_length, the row length)."""
    max_lengths = sorted({t.max_length for t in parts})
    if len(max_lengths) != 1:
        raise ValueError(f"the sets of one evaluation must share a max_length; got {max_lengths}")
    lengths = np.concatenate([t.lengths for t in parts])
    return TokenizedSet(
        token_ids=np.concatenate([t.token_ids for t in parts]),
        starts=np.concatenate([[0], np.cumsum(lengths)]),
        labels=np.concatenate([t.labels for t in parts]),
        truncated=np.concatenate([t.truncated for t in parts]),
        max_length=max_lengths[0],
    )


def evaluate(
    eval_step: Callable[..., jax.Array],
    base_state: object,
    lora: object,
    pool: EvalPool,
    *,
    place: Callable[[Batch], Mapping[str, jax.Array]],
) -> list[dict[str, np.ndarray]]:
    """Run r's margins (float32) on each set it scores, in the set's row order: ``[{name: [N]}] * R``.

    All batches are dispatched before any result is fetched, so the host never waits on the device between
    batches.
    """
    # `index` stays on the host, to place the margins.
    outputs = [eval_step(base_state, lora, place({key: batch[key] for key in EVAL_KEYS})) for batch in pool.batches]
    margins = np.zeros((pool.num_runs, len(pool.labels)), dtype=np.float32)
    covered = np.zeros(margins.shape, dtype=bool)
    for batch, output in zip(pool.batches, outputs):
        valid = batch["valid"]
        runs, rows = np.nonzero(valid)[0], batch["index"][valid]
        margins[runs, rows] = np.asarray(jax.device_get(output))[valid]
        covered[runs, rows] = True
    if pool.interchangeable:  # each row was scored once, in one lane, for every run
        lane, rows = covered.argmax(axis=0), np.arange(margins.shape[1])
        margins = np.repeat(margins[lane, rows][None], pool.num_runs, axis=0)
        covered = np.repeat(covered[lane, rows][None], pool.num_runs, axis=0)
    for run, run_sets in enumerate(pool.sets):
        for name, span in run_sets.items():
            missing = np.flatnonzero(~covered[run, span])
            if missing.size:
                raise RuntimeError(
                    f"run {run}, {name}: no batch holds examples {missing[:10].tolist()} ({missing.size} in all)"
                )
    return [{name: margins[run, span] for name, span in run_sets.items()} for run, run_sets in enumerate(pool.sets)]
