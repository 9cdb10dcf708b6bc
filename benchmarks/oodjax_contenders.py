"""The oodjax side: the engine's own jitted steps and evaluation, as the run loop calls them.

As in the loop, everything lives on a device mesh (here of the one CPU
device), training steps are laid out by ``oodjax.data.train_steps`` and
batches are placed with the engine's ``shard_batch``.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from benchmarks import settings
from oodjax import models
from oodjax.data import TokenizedSet, bucket_lengths, fitting_bucket, stream_examples, train_steps
from oodjax.engine import sharding, steps
from oodjax.engine.evaluation import EvalPool, evaluate, make_eval_pool
from oodjax.engine.geometry import BatchGeometry
from oodjax.engine.run_data import TRAIN_KEYS
from oodjax.models.lora import LoRAConfig

EVAL_SET = "testsets"  # the name of the one set the evaluation case's pool holds
STREAM_SEED = 0  # the seed of every run's training stream (its order is the batch's own: ``_in_stream_order``)


@dataclasses.dataclass
class Engine:
    """One frozen base with R runs' adapters, and the compiled steps over them."""

    mesh: jax.sharding.Mesh
    base_state: Any
    runs: steps.TrainState
    eval_step: Callable[..., jax.Array]
    make_train_step: Callable[[BatchGeometry, steps.TrainState], Any]  # steps.make_train_step for a geometry
    buckets: tuple[int, ...] = ()  # lengths a training micro-batch is cut to (below its rows' length)
    made: dict[BatchGeometry, Any] = dataclasses.field(default_factory=dict)  # train steps, by geometry

    def margins(self, pool: EvalPool) -> list[dict[str, np.ndarray]]:
        """Each run's margins per set, through the engine's ``evaluate`` (all batches dispatched, then fetched)."""
        return evaluate(self.eval_step, self.base_state, self.runs.lora, pool,
                        place=lambda batch: sharding.shard_batch(batch, self.mesh, batch_axis=1))

    def train(self, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> np.ndarray:
        """One optimizer step; ``rows[r]`` are run r's examples, laid out as the loop lays a step out."""
        step = self.train_step(train_geometry(tokenized, len(rows), self.buckets))
        self.runs, loss = step(self.base_state, self.runs, self._placed(self.train_batch(tokenized, rows)))
        return np.asarray(jax.device_get(loss))

    def eval_pool(self, tokenized: TokenizedSet, *, batch_tokens: int) -> EvalPool:
        """The loop's evaluation pool of ``tokenized`` as one set (``EVAL_SET``) of one run, built once."""
        return make_eval_pool({EVAL_SET: tokenized}, [{}], batch_tokens=batch_tokens)

    def compile_train(self, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> None:
        """Compiles the train step (one program, a branch per bucket) without taking a step.

        The loop compiles it at its first step; a timed step must not, so the
        warm-up compiles it ahead (and is charged).
        """
        step = self.train_step(train_geometry(tokenized, len(rows), self.buckets))
        step.lower(self.base_state, self.runs, self._placed(self.train_batch(tokenized, rows))).compile()

    def train_step(self, geometry: BatchGeometry) -> Any:
        """The jitted train step of ``geometry``, made once."""
        if geometry not in self.made:
            self.made[geometry] = self.make_train_step(geometry, self.runs)
        return self.made[geometry]

    @staticmethod
    def train_batch(tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """The host step [grad_accum, rows, ...] as the loop's stream gives it (``oodjax.data.train_steps``):
        all runs' prompts packed in ``train_geometry``'s rows, run r's being ``rows[r]``, in that order."""
        geometry = train_geometry(tokenized, len(rows))
        stream = train_steps(
            [_in_stream_order(tokenized, r) for r in rows], [STREAM_SEED] * len(rows), batch_size=settings.TRAIN_BATCH,
            layout=geometry.layout, seq_len=geometry.seq_len, prompts_per_row=geometry.prompts_per_row, prefetch=0,
        )  # fmt: skip
        return next(stream)

    def _placed(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """What the train step reads of a step, split over the rows (the loop's ``_next_batch``)."""
        return sharding.shard_batch({key: batch[key] for key in TRAIN_KEYS}, self.mesh, batch_axis=1)


def train_geometry(tokenized: TokenizedSet, runs: int, buckets: Sequence[int] = ()) -> BatchGeometry:
    """The train step's layout for ``runs`` runs' batches of settings.TRAIN_BATCH prompts of ``tokenized``, as
    the loop lays a step out with train.pack on one device: settings.TRAIN_GRAD_ACCUM micro-batches of one row.

    The loop sizes its rows by replaying its seeded streams; the benchmark's
    batches follow their own order, so rows are sized for any batch of the
    set. Balanced rows (longest prompt first, each to the least-filled row)
    hold at most the longest prompt plus an even share of the rest, and at
    most every prompt but one per other row; so the stream's bounds never
    bind and it lays every batch out as the loop would. Rows are the bucket
    of that bound on the loop's default ladder (going on past
    settings.MAX_LENGTH); a micro-batch runs at the smallest of ``buckets``
    that holds its row, else at the rows' length (the geometry's
    ``micro_batch_lengths``).
    """
    prompts, num_rows = runs * settings.TRAIN_BATCH, settings.TRAIN_GRAD_ACCUM
    # The longest prompts a batch may hold: a run's batch may repeat an example where it straddles two epochs.
    repeats = runs * (1 + -(-settings.TRAIN_BATCH // len(tokenized)))
    longest = np.sort(np.tile(tokenized.lengths, repeats))[::-1][:prompts].astype(np.int64)
    row = int(longest[0]) + -(-int(longest.sum() - longest[0]) // num_rows)
    seq_len = fitting_bucket(bucket_lengths(max(settings.MAX_LENGTH, 2 * row)), row)
    return BatchGeometry(
        runs=runs, batch_size=settings.TRAIN_BATCH, grad_accum=settings.TRAIN_GRAD_ACCUM, seq_len=seq_len,
        buckets=tuple(sorted(int(b) for b in buckets)), packed=True, prompts_per_row=max(1, prompts - num_rows + 1),
        batch_shards=1,
    )  # fmt: skip


def _in_stream_order(tokenized: TokenizedSet, rows: np.ndarray) -> TokenizedSet:
    """The set of ``rows`` alone, ordered so that a training stream seeded STREAM_SEED draws them as its first
    batch in the order given (its first epoch's permutation undone), each at its place in ``rows``."""
    rows = np.asarray(rows)
    order = np.empty_like(rows)
    order[stream_examples(STREAM_SEED, len(rows), len(rows), 0)] = rows
    lengths = tokenized.lengths[order]
    return TokenizedSet(
        token_ids=np.concatenate([tokenized.prompt(int(i)) for i in order]).astype(tokenized.token_ids.dtype),
        starts=np.concatenate([[0], np.cumsum(lengths)]).astype(tokenized.starts.dtype),
        labels=tokenized.labels[order],
        truncated=tokenized.truncated[order],
        max_length=tokenized.max_length,
    )


def lora_config() -> LoRAConfig:
    lora = settings.LORA
    return LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"], targets=lora["targets"])


def build_engine(
    checkpoint: pathlib.Path, *, seeds: Sequence[int], total_steps: int, yes_id: int, no_id: int,
    buckets: Sequence[int],
) -> Engine:
    """The float32 checkpoint loaded by ``load_pretrained``, one adapter per seed, the steps made by steps.py
    (the train step once its geometry is known: ``Engine.train_step``)."""
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = models.load_pretrained(checkpoint, dtype="float32", mesh=mesh)
    optimizer = steps.make_optimizer(settings.LEARNING_RATE, total_steps, settings.warmup_steps(total_steps),
                                     weight_decay=0.0, max_grad_norm=settings.MAX_GRAD_NORM)
    graphdef, base_state, runs = steps.init_runs(model, list(seeds), lora_config(), optimizer, mesh=mesh)

    def make_train_step(geometry: BatchGeometry, runs: steps.TrainState) -> Any:
        return steps.make_train_step(graphdef, optimizer, yes_id, no_id, geometry, mesh=mesh, base_state=base_state,
                                     runs=runs)

    return Engine(
        mesh=mesh,
        base_state=base_state,
        runs=runs,
        eval_step=steps.make_eval_step(graphdef, yes_id, no_id, mesh=mesh),
        make_train_step=make_train_step,
        buckets=tuple(buckets),
    )
