"""The shape of every batch a job feeds its steps, worked out once.

The data streams, the train step, the loop and the preflight must all agree
on these shapes, so ``batch_geometry`` derives and validates them in one
place: a config that cannot work fails before anything is tokenised at
length or compiled, with an error naming its field. eval.batch_size is a
token budget of that many rows of data.max_length, which shorter rows fill
with more of them.

With train.pack (the default), all runs' prompts are balanced over all
micro-batches' rows, a row mixing runs; each device holds the fewest rows
that keep every row within data.max_length, so rows come out nearly equal
(little padding) and bounded (little attention between a row's prompts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

from oodjax.data import (
    DEFAULT_MAX_LENGTH,
    StepLayout,
    TokenizedSet,
    bucket_lengths,
    eval_row_lengths,
    fitting_bucket,
    packed_layout,
    replay_rows,
)
from oodjax.engine import sharding
from oodjax.settings import setting
from oodjax.usage_errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """What a job asks of its batches (train.batch_size, grad_accum, pack; data.max_length, buckets;
    eval.batch_size, row_lengths): ``batch_geometry`` and ``eval_geometry`` work the shapes out from them, the
    former for a run length."""

    batch_size: int = setting(16, path="train.batch_size")  # examples per optimizer step, per run
    # Micro-batches per optimizer step (gradients accumulated inside the
    # jitted step); must divide batch_size. Every run's prompts of a step are
    # spread over them, so more micro-batches hold fewer tokens at once: the
    # memory knob. The update is the same.
    grad_accum: int = setting(1, path="train.grad_accum")
    # Pack all runs' prompts of a step into the fewest rows per device per
    # micro-batch of at most data.max_length tokens, a row mixing runs (each
    # token adapted by its own run's adapters), balanced over the rows, so
    # little is padding and little attention crosses prompts. Off: one
    # prompt a row, each run's micro-batch a grad_accum-th of its batch.
    # Same examples per step and the same update either way, up to dropout
    # masks: they are keyed by each prompt's run, place in its run's batch
    # and token position, the same within a layout whatever trains beside it.
    pack: bool = setting(True, path="train.pack")
    max_length: int = DEFAULT_MAX_LENGTH  # the longest training and evaluation row (data.max_length)
    # Evaluation batches hold about batch_size x max_length tokens, in rows of
    # one of row_lengths, each holding one or two prompts (little padding,
    # little attention between prompts; one compiled shape per row length).
    eval_batch_size: int = setting(32, path="eval.batch_size")
    # Static sequence lengths a training micro-batch is cut to (a branch of the
    # train step each); empty = from 64, four per doubling (64, 80, 96, 112,
    # 128, 160, ...) up to max_length. Evaluation rows: eval.row_lengths.
    buckets: tuple[int, ...] | None = setting(None, path="data.buckets")
    # Lengths of evaluation rows; empty = 32 and 48 times the powers of two
    # (32, 48, 64, 96, 128, ...) up to data.max_length.
    eval_row_lengths: tuple[int, ...] | None = setting(None, path="eval.row_lengths")

    def __post_init__(self) -> None:
        positive = {
            "train.batch_size": self.batch_size,
            "train.grad_accum": self.grad_accum,
            "data.max_length": self.max_length,
            "eval.batch_size": self.eval_batch_size,
        }
        for field, value in positive.items():
            if value < 1:
                raise ConfigError(f"{field} must be >= 1, got {value}")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"train.batch_size {self.batch_size} must be a multiple of train.grad_accum {self.grad_accum}"
            )
        for field, lengths in {"data.buckets": self.buckets, "eval.row_lengths": self.eval_row_lengths}.items():
            if any(length < 1 for length in lengths or ()):
                raise ConfigError(f"{field} must be positive lengths, got {list(lengths or ())}")


@dataclasses.dataclass(frozen=True)
class EvalGeometry:
    """The shape of evaluation batches: rows of one of ``row_lengths`` (the last ``seq_len``,
    data.max_length), about ``rows`` x ``seq_len`` tokens a batch (eval.batch_size rows of the longest
    length; more rows when they are shorter), a multiple of ``batch_shards`` rows. Sizes are global."""

    rows: int  # rows per evaluation batch at the longest row length (eval.batch_size)
    seq_len: int  # the longest evaluation row (data.max_length)
    row_lengths: tuple[int, ...]  # lengths of evaluation rows, the last seq_len
    batch_shards: int = 1  # devices a batch's example axis is split over (mesh data x fsdp)

    def __post_init__(self) -> None:  # the config's own values are BatchSettings' to check
        if self.rows % self.batch_shards:
            raise ConfigError(
                f"eval.batch_size {self.rows} must be a multiple of the {self.batch_shards} batch shards "
                "(mesh.data x mesh.fsdp)"
            )

    @property
    def batch_tokens(self) -> int:
        """The token budget of one evaluation batch."""
        return self.rows * self.seq_len


def eval_geometry(batches: BatchSettings, batch_shards: int) -> EvalGeometry:
    """The evaluation batches of ``batches`` on a mesh whose batch axis has ``batch_shards`` devices."""
    return EvalGeometry(
        rows=batches.eval_batch_size,
        seq_len=batches.max_length,
        row_lengths=eval_row_lengths(batches.max_length, batches.eval_row_lengths),
        batch_shards=batch_shards,
    )


@dataclasses.dataclass(frozen=True)
class BatchGeometry:
    """A job's batch shapes, global (all processes together). A training step is [grad_accum, rows, seq_len]
    (per-prompt leaves [grad_accum, rows, prompts_per_row])."""

    runs: int  # R: runs trained together (seeds x shots)
    batch_size: int  # examples per optimizer step, per run
    grad_accum: int  # micro-batches per optimizer step
    seq_len: int  # tokens per training row
    buckets: tuple[int, ...] = ()  # lengths a training micro-batch may be cut to
    packed: bool = False  # rows packed with prompts of any runs (train.pack), else one prompt a row
    packed_rows_per_device: int = 1  # packed: rows of a micro-batch each device holds
    prompts_per_row: int = 1  # prompt slots of a training row
    batch_shards: int = 1  # devices a batch's row axis is split over (mesh data x fsdp)
    process_rows: tuple[int, ...] | None = None  # rows of each micro-batch this process feeds
    evaluation: EvalGeometry | None = None  # the job's evaluation batches (None: a train step alone)

    def __post_init__(self) -> None:
        positive = {  # the config's own values are BatchSettings' to check
            "runs (runs.seeds x runs.shots)": self.runs,
            "training row length": self.seq_len,
            "batch shards": self.batch_shards,
            "training prompt slots": self.prompts_per_row,
            "packed rows per device": self.packed_rows_per_device,
        }
        for field, value in positive.items():
            if value < 1:
                raise ConfigError(f"{field} must be >= 1, got {value}")
        if not self.packed and self.batch_size // self.grad_accum % self.batch_shards:
            raise ConfigError(
                f"train micro-batch {self.batch_size // self.grad_accum} (train.batch_size / train.grad_accum) must "
                f"be a multiple of the {self.batch_shards} batch shards (mesh.data x mesh.fsdp) without train.pack"
            )

    @property
    def layout(self) -> StepLayout:
        """How ``oodjax.data.train_steps`` lays a step out."""
        return StepLayout(micro_batches=self.grad_accum, rows=self.rows, packed=self.packed)

    @property
    def rows(self) -> int:
        """Rows per micro-batch (global): ``packed_rows_per_device`` per device when packed, else one per prompt
        of every run."""
        if self.packed:
            return self.batch_shards * self.packed_rows_per_device
        return self.runs * self.batch_size // self.grad_accum

    @property
    def rows_per_device(self) -> int:
        """Rows of one micro-batch each device holds."""
        return self.rows // self.batch_shards

    @property
    def micro_batch_lengths(self) -> tuple[int, ...]:
        """The lengths a micro-batch may run at: the buckets below ``seq_len``, then ``seq_len``."""
        return micro_batch_lengths(self.buckets, self.seq_len)

    @property
    def train_rows_shape(self) -> tuple[int, int]:
        """The leading axes of every leaf of a training step: (grad_accum, rows)."""
        return (self.grad_accum, self.rows)


def micro_batch_lengths(buckets: Sequence[int] | None, seq_len: int) -> tuple[int, ...]:
    """The lengths a micro-batch of a ``seq_len`` batch may run at: the buckets below it, then ``seq_len``."""
    return tuple(int(b) for b in sorted(buckets or ()) if b < seq_len) + (seq_len,)


def batch_geometry(
    batches: BatchSettings, mesh: Mesh, train_sets: Sequence[TokenizedSet], seeds: Sequence[int], total_steps: int
) -> BatchGeometry:
    """The geometry of runs of ``total_steps`` from the batch settings, the mesh and the runs' tokenised few-shot
    sets and seeds (one each).

    The streams are seeded, so replaying the runs' steps from the prompts' lengths (``oodjax.data.replay_rows``)
    tells before it starts what every step holds. Rows are as long as the bucket of the longest, so all steps
    share one compiled program (with a branch per bucket the micro-batches run at).
    """
    if not train_sets or len(train_sets) != len(seeds):
        raise ValueError(
            f"batch_geometry needs one few-shot set and seed per run, got {len(train_sets)} and {len(seeds)}"
        )
    geometry = BatchGeometry(
        runs=len(train_sets),
        batch_size=batches.batch_size,
        grad_accum=batches.grad_accum,
        seq_len=batches.max_length,
        packed=batches.pack,
        batch_shards=sharding.batch_shards(mesh),
        evaluation=eval_geometry(batches, sharding.batch_shards(mesh)),
    )  # its fit on the mesh checked, errors naming the fields
    replay = dict(batch_size=geometry.batch_size, steps=total_steps)
    if geometry.packed:
        layout, longest, prompts_per_row = packed_layout(
            train_sets,
            seeds,
            micro_batches=geometry.grad_accum,
            shards=geometry.batch_shards,
            row_length=batches.max_length,
            **replay,
        )
        geometry = dataclasses.replace(geometry, packed_rows_per_device=layout.rows // geometry.batch_shards)
    else:
        longest, prompts_per_row = replay_rows(train_sets, seeds, layout=geometry.layout, **replay)
    buckets = bucket_lengths(batches.max_length, batches.buckets)
    seq_len = fitting_bucket(buckets, max(int(longest.max()), max(int(t.lengths.max()) for t in train_sets)))
    lengths = micro_batch_lengths(buckets, seq_len)
    used = tuple(sorted({fitting_bucket(lengths, int(tokens)) for tokens in np.unique(longest) if tokens > 0}))
    return dataclasses.replace(
        geometry,
        seq_len=seq_len,
        buckets=used,
        prompts_per_row=prompts_per_row,
        process_rows=tuple(sharding.process_batch_rows(mesh, geometry.rows).tolist()),
    )
