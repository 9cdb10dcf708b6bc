"""The shape of every batch a job feeds its steps, worked out once.

How many runs, examples per step, micro-batches, rows per device, training
row length, buckets, packed prompt slots, evaluation row lengths and the
rows this process feeds are facts of one job that the data streams, the
train step, the loop and the preflight must all agree on. ``batch_geometry``
derives them from the config, the mesh and the runs' few-shot sets in one
place and validates them there, so a config that cannot work fails before
anything is tokenised at length or compiled, with an error naming its
field; everything else reads the frozen ``BatchGeometry``. Evaluation's
part, ``EvalGeometry`` (``eval_geometry``), is all ``oodjax.evaluate``
needs: eval.batch_size is a token budget of that many rows of
data.max_length, which shorter rows fill with more of them.

With train.pack, a training step is batch_size / (mesh.data x mesh.fsdp)
micro-batches of one row per device: each device's row packs its share of
the run's examples, balanced over the devices, and the first micro-batch
takes all it can hold, so the step runs one micro-batch at the length of
its fullest row and skips the empty rest. One row per device is the least
memory a micro-batch can take, so train.grad_accum, which bounds memory
when rows hold one prompt each, has nothing to bound there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh
from ml_collections import config_dict

from oodjax.data import (
    TokenizedSet,
    bucket_lengths,
    eval_row_lengths,
    fitting_bucket,
    micro_batch_longest_rows,
    train_prompts_per_row,
)
from oodjax.engine import sharding


@dataclasses.dataclass(frozen=True)
class EvalGeometry:
    """The shape of evaluation batches: rows of one of ``row_lengths`` (the last ``seq_len``,
    data.max_length), about ``rows`` x ``seq_len`` tokens a batch (eval.batch_size rows of the longest
    length; more rows when they are shorter), a multiple of ``batch_shards`` rows. Sizes are global."""

    rows: int  # rows per evaluation batch at the longest row length (eval.batch_size)
    seq_len: int  # the longest evaluation row (data.max_length)
    row_lengths: tuple[int, ...]  # lengths of evaluation rows, the last seq_len
    batch_shards: int = 1  # devices a batch's example axis is split over (mesh data x fsdp)

    def __post_init__(self) -> None:
        for field, value in {"eval.batch_size": self.rows, "data.max_length": self.seq_len}.items():
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if self.rows % self.batch_shards:
            raise ValueError(
                f"eval.batch_size {self.rows} must be a multiple of the {self.batch_shards} batch shards "
                "(mesh.data x mesh.fsdp)"
            )
        if any(length < 1 for length in self.row_lengths):
            raise ValueError(f"eval.row_lengths must be positive lengths, got {list(self.row_lengths)}")

    @property
    def batch_tokens(self) -> int:
        """The token budget of one evaluation batch."""
        return self.rows * self.seq_len


def eval_geometry(config: config_dict.ConfigDict, batch_shards: int) -> EvalGeometry:
    """The evaluation batches of ``config`` on a mesh whose batch axis has ``batch_shards`` devices."""
    max_length = config.data.max_length
    return EvalGeometry(
        rows=config.eval.batch_size,
        seq_len=max_length,
        row_lengths=eval_row_lengths(max_length, tuple(config.eval.row_lengths) or None),
        batch_shards=batch_shards,
    )


@dataclasses.dataclass(frozen=True)
class BatchGeometry:
    """A job's batch shapes. Training batches are [runs, grad_accum, micro_batch, seq_len] (per-prompt
    leaves [runs, grad_accum, micro_batch(, prompts_per_row)]); with packed rows ``micro_batch`` is the
    batch shards (one row per device). Its evaluation batches are ``evaluation``'s. Sizes are global (all
    processes together)."""

    runs: int  # R: runs trained together (seeds x shots)
    batch_size: int  # examples per optimizer step, per run
    grad_accum: int  # micro-batches per optimizer step
    seq_len: int  # tokens per training row: the bucket that holds the longest few-shot prompt
    buckets: tuple[int, ...] = ()  # lengths a training micro-batch may be cut to
    prompts_per_row: int | None = None  # prompt slots of a packed training row; None: one prompt a row
    run_chunk: int = 0  # runs the train step computes at once; 0: all of them
    batch_shards: int = 1  # devices a batch's example axis is split over (mesh data x fsdp)
    process_rows: tuple[int, ...] | None = None  # positions of a global training batch this process feeds
    evaluation: EvalGeometry | None = None  # the job's evaluation batches (None: a train step alone)

    def __post_init__(self) -> None:
        positive = {
            "runs (runs.seeds x runs.shots)": self.runs,
            "train.batch_size": self.batch_size,
            "train.grad_accum": self.grad_accum,
            "training row length": self.seq_len,
            "batch shards": self.batch_shards,
        }
        for field, value in positive.items():
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"train.batch_size {self.batch_size} must be a multiple of train.grad_accum {self.grad_accum}"
            )
        if self.micro_batch % self.batch_shards:
            raise ValueError(
                f"train micro-batch {self.micro_batch} (train.batch_size / train.grad_accum) must be a multiple of "
                f"the {self.batch_shards} batch shards (mesh.data x mesh.fsdp)"
            )
        if self.run_chunk < 0:
            raise ValueError(f"runs.chunk must be >= 0 (0 = all runs at once), got {self.run_chunk}")
        if any(b < 1 for b in self.buckets):
            raise ValueError(f"data.buckets must be positive lengths, got {list(self.buckets)}")
        if self.prompts_per_row is not None and self.prompts_per_row < 1:
            raise ValueError(f"packed rows need at least one prompt slot, got {self.prompts_per_row}")

    @property
    def micro_batch(self) -> int:
        """Rows per micro-batch, per run (global): examples, one a row, or with packed rows the batch shards."""
        return self.batch_size // self.grad_accum

    @property
    def rows_per_device(self) -> int:
        """Rows of one micro-batch each device holds."""
        return self.micro_batch // self.batch_shards

    @property
    def micro_batch_lengths(self) -> tuple[int, ...]:
        """The lengths a micro-batch may run at: the buckets below ``seq_len``, then ``seq_len``."""
        return micro_batch_lengths(self.buckets, self.seq_len)

    @property
    def train_rows_shape(self) -> tuple[int, int, int]:
        """The leading axes of every leaf of a training batch: (runs, grad_accum, micro_batch)."""
        return (self.runs, self.grad_accum, self.micro_batch)


def micro_batch_lengths(buckets: Sequence[int] | None, seq_len: int) -> tuple[int, ...]:
    """The lengths a micro-batch of a ``seq_len`` batch may run at: the buckets below it, then ``seq_len``."""
    return tuple(int(b) for b in sorted(buckets or ()) if b < seq_len) + (seq_len,)


def batch_geometry(
    config: config_dict.ConfigDict, mesh: Mesh, train_sets: Sequence[TokenizedSet], seeds: Sequence[int]
) -> BatchGeometry:
    """The job's geometry from its config, its mesh and its runs' tokenised few-shot sets and seeds (one each).

    Training rows are as long as the smallest bucket that holds the longest
    few-shot prompt of any run, so all runs share one compiled step; with
    train.pack, a step is batch_size / batch shards micro-batches of one row
    per device (see the module's docstring), rows with as many prompt slots
    as the shortest prompt fits. The buckets are those the job's micro-batches
    run at (``used_buckets``).
    """
    if not train_sets or len(train_sets) != len(seeds):
        raise ValueError(
            f"batch_geometry needs one few-shot set and seed per run, got {len(train_sets)} and {len(seeds)}"
        )
    max_length = config.data.max_length
    buckets = bucket_lengths(max_length, tuple(config.data.buckets) or None)
    seq_len = fitting_bucket(buckets, max(int(t.lengths.max()) for t in train_sets))
    batch_size = config.train.batch_size
    geometry = BatchGeometry(
        runs=len(train_sets),
        batch_size=batch_size,
        grad_accum=config.train.grad_accum,
        seq_len=seq_len,
        buckets=buckets,
        run_chunk=config.runs.chunk,
        batch_shards=sharding.batch_shards(mesh),
        evaluation=eval_geometry(config, sharding.batch_shards(mesh)),
    )  # the config's own fields checked, errors naming them
    if config.train.pack:
        geometry = dataclasses.replace(
            geometry,
            grad_accum=micro_batches_per_step(config, geometry.batch_shards),
            prompts_per_row=train_prompts_per_row(train_sets, batch_size=batch_size, seq_len=seq_len),
        )
    rows = sharding.process_step_rows(mesh, geometry.batch_size, geometry.grad_accum)  # valid once checked above
    geometry = dataclasses.replace(geometry, process_rows=tuple(int(row) for row in rows))
    return dataclasses.replace(geometry, buckets=used_buckets(geometry, train_sets, seeds, steps=config.train.steps))


def micro_batches_per_step(config: config_dict.ConfigDict, batch_shards: int) -> int:
    """How many micro-batches a training step of ``config`` takes with its batch split over ``batch_shards``
    devices: train.grad_accum, or with train.pack one row per device (the module's docstring)."""
    return config.train.batch_size // batch_shards if config.train.pack else config.train.grad_accum


def used_buckets(
    geometry: BatchGeometry, train_sets: Sequence[TokenizedSet], seeds: Sequence[int], *, steps: int
) -> tuple[int, ...]:
    """The lengths among ``geometry.micro_batch_lengths`` that the runs' micro-batches run at in ``steps`` steps.

    The train step compiles one ``lax.switch`` branch (a whole forward and
    backward pass) per length it may cut a micro-batch to, and picks the
    smallest that holds the micro-batch's longest row over all runs. The
    streams are seeded, so which lengths a job takes is known before it
    starts: replaying its steps from the prompts' lengths
    (``micro_batch_longest_rows``, about a millisecond a step for 9 runs)
    gives them, and the step compiles those alone (and ``seq_len``, which
    holds any row): the same length for every micro-batch as with all the
    buckets, and fewer branches to compile (the study's MNLI configs take 3
    of their 6, SNLI 3 of 5).
    """
    longest = np.max(
        [
            micro_batch_longest_rows(
                tokenized, batch_size=geometry.batch_size, seed=seed, seq_len=geometry.seq_len, steps=steps,
                pack=geometry.prompts_per_row is not None, grad_accum=geometry.grad_accum,
                prompts_per_row=geometry.prompts_per_row,
            )
            for tokenized, seed in zip(train_sets, seeds, strict=True)
        ],
        axis=0,
    )  # fmt: skip
    lengths = geometry.micro_batch_lengths
    return tuple(sorted({fitting_bucket(lengths, int(tokens)) for tokens in np.unique(longest) if tokens > 0}))
