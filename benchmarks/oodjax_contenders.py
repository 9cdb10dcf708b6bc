"""The oodjax side: the engine's own jitted steps and evaluation, as the run loop calls them.

The contenders are jobs read from a config (``contender_job``), set up by the
engine's ``setup`` as the loop sets a run group up, on a device mesh (here of
one device); the case chooses each step's rows, laid out by
``oodjax.data.train_steps`` and placed with the engine's ``shard_batch``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from ml_collections import config_dict

from benchmarks import grid_config, settings
from oodjax import config_read
from oodjax.config_read import Job
from oodjax.data import (
    TRAIN_KEYS,
    TokenizedSet,
    bucket_lengths,
    fitting_bucket,
    packed_layout,
    replay_rows,
    stream_examples,
    train_steps,
)
from oodjax.engine import setup, sharding, steps
from oodjax.engine.evaluation import EvalPool, evaluate, make_eval_pool
from oodjax.engine.geometry import BatchGeometry

EVAL_SET = "testsets"  # the name of the one set the evaluation case's pool holds
STREAM_SEED = 0  # the seed of every run's training stream (its order is the batch's own: ``_in_stream_order``)


@dataclasses.dataclass
class Engine:
    """A job's frozen base with its R runs' adapters, and its compiled eval step."""

    job: Job
    mesh: jax.sharding.Mesh
    base_state: Any
    runs: steps.TrainState
    eval_step: Callable[..., jax.Array]

    def margins(self, pool: EvalPool) -> list[dict[str, np.ndarray]]:
        """Each run's margins per set, through the engine's ``evaluate`` (all batches dispatched, then fetched)."""
        return evaluate(
            self.eval_step,
            self.base_state,
            self.runs.lora,
            pool,
            place=lambda batch: sharding.shard_batch(batch, self.mesh, batch_axis=1),
        )

    def eval_pool(self, tokenized: TokenizedSet, *, batch_tokens: int, runs: int | None = None) -> EvalPool:
        """The loop's evaluation pool of ``tokenized`` as one set (``EVAL_SET``) every run scores, built once; for
        the engine's runs, or for the first ``runs`` of them."""
        runs = self.runs.num_runs if runs is None else runs
        return make_eval_pool({EVAL_SET: tokenized}, [{}] * runs, batch_tokens=batch_tokens)


@dataclasses.dataclass
class TrainingEngine(Engine):
    """``Engine`` with the train step of its steps' layout."""

    train_step: Any
    geometry: BatchGeometry

    def train(self, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> np.ndarray:
        """One optimizer step; ``rows[r]`` are run r's examples, laid out as the loop lays a step out."""
        self.runs, metrics = self.train_step(self.base_state, self.runs, self._placed(tokenized, rows))
        return np.asarray(jax.device_get(metrics["loss"]))

    def compile_train(self, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> None:
        """Compiles the train step without taking a step: a timed step must not compile, so the warm-up
        compiles it ahead (and is charged)."""
        self.train_step.lower(self.base_state, self.runs, self._placed(tokenized, rows)).compile()

    def train_batch(self, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """The host step [grad_accum, rows, ...] as the loop's stream gives it (``oodjax.data.train_steps``):
        all runs' prompts packed in ``geometry``'s rows, run r's being ``rows[r]``, in that order."""
        stream = train_steps(
            _in_stream_order(tokenized, rows),
            [STREAM_SEED] * len(rows),
            batch_size=settings.TRAIN_BATCH,
            layout=self.geometry.layout,
            seq_len=self.geometry.seq_len,
            prompts_per_row=self.geometry.prompts_per_row,
            prefetch=0,
        )
        return next(stream)

    def _placed(self, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> dict[str, jax.Array]:
        """What the train step reads of ``train_batch``, split over the rows (the loop's ``_next_batch``)."""
        batch = self.train_batch(tokenized, rows)
        return sharding.shard_batch({key: batch[key] for key in TRAIN_KEYS}, self.mesh, batch_axis=1)


def train_geometry(
    tokenized: TokenizedSet,
    batches: Sequence[Sequence[np.ndarray]],
    buckets: Sequence[int] = (),
    *,
    grad_accum: int = settings.TRAIN_GRAD_ACCUM,
    row_length: int = settings.MAX_LENGTH,
) -> BatchGeometry:
    """The train step's layout for steps of ``batches``, as the loop's ``batch_geometry`` lays its steps out
    with train.pack on one device."""
    common = dict(batch_size=settings.TRAIN_BATCH, steps=1)
    steps = [(_in_stream_order(tokenized, rows), [STREAM_SEED] * len(rows)) for rows in batches]
    layouts = [
        packed_layout(sets, seeds, micro_batches=grad_accum, shards=1, row_length=row_length, **common)[0]
        for sets, seeds in steps
    ]
    layout = max(layouts, key=lambda layout: layout.rows)
    replays = [replay_rows(sets, seeds, layout=layout, **common) for sets, seeds in steps]
    longest = max(int(longest.max()) for longest, _ in replays)
    return BatchGeometry(
        runs=len(batches[0]),
        batch_size=settings.TRAIN_BATCH,
        grad_accum=grad_accum,
        seq_len=fitting_bucket(bucket_lengths(row_length), longest),
        buckets=tuple(sorted(int(b) for b in buckets)),
        packed=True,
        packed_rows_per_device=layout.rows,
        prompts_per_row=max(most for _, most in replays),
        batch_shards=1,
    )


def _in_stream_order(tokenized: TokenizedSet, runs_rows: Sequence[np.ndarray]) -> list[TokenizedSet]:
    """Each run's set of its ``runs_rows`` alone, ordered so that a training stream seeded STREAM_SEED draws
    them as its first batch in the order given (its first epoch's permutation undone), each at its place."""
    return [_run_in_stream_order(tokenized, rows) for rows in runs_rows]


def _run_in_stream_order(tokenized: TokenizedSet, rows: np.ndarray) -> TokenizedSet:
    """One run's set of ``rows`` alone, in the stream's order (``_in_stream_order``)."""
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


def contender_job(
    model: str | dict[str, Any], *, seeds: Sequence[int], shots: int, total_steps: int, dtype: str, remat: str = "none"
) -> Job:
    """The contenders' runs read as ``oodjax.main`` reads a job: the grid's settings (``engine_config``) for
    ``model`` (a checkpoint folder or a random model's config) and one run per seed, ``settings.LORA``'s adapters."""
    config = grid_config.engine_config(seeds=tuple(seeds), shots=(shots,), steps=total_steps)
    if isinstance(model, str):
        config.model.path = model
    else:
        with config.unlocked():
            config.model.hf_config = config_dict.ConfigDict(model)
    config.model.dtype, config.model.remat = dtype, remat
    config.lora.update(settings.LORA)
    return config_read.read(config)


def evaluation_engine(job: Job, answer_ids: tuple[int, int]) -> Engine:
    """``job``'s runs on the first device, its model loaded and set up as a job's (``setup.attach_evaluation``)."""
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    attached = setup.attach_evaluation(job, job.groups[0], mesh, job.model.load(mesh), job.lora, answer_ids)
    return Engine(job, mesh, *attached)


def training_engine(job: Job, answer_ids: tuple[int, int], geometry: BatchGeometry) -> TrainingEngine:
    """``job``'s runs on the first device, set up as the loop sets them up (``setup.attach_training``)."""
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    base_state, runs, train_step, eval_step = setup.attach_training(
        job, job.groups[0], mesh, job.model.load(mesh), geometry, answer_ids
    )
    return TrainingEngine(job, mesh, base_state, runs, eval_step, train_step, geometry)
