"""The oodjax side: the engine's own jitted steps and evaluation, as the run loop calls them.

As in the loop, everything lives on a device mesh (here of the one CPU
device), training steps are laid out by ``oodjax.data.train_steps`` and
batches are placed with the engine's ``shard_batch``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from benchmarks import settings
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
from oodjax.engine import sharding, steps
from oodjax.engine.evaluation import EvalPool, evaluate, make_eval_pool
from oodjax.engine.geometry import BatchGeometry
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
    made: dict[BatchGeometry, Any] = dataclasses.field(default_factory=dict)  # train steps, by geometry

    def margins(self, pool: EvalPool) -> list[dict[str, np.ndarray]]:
        """Each run's margins per set, through the engine's ``evaluate`` (all batches dispatched, then fetched)."""
        return evaluate(
            self.eval_step,
            self.base_state,
            self.runs.lora,
            pool,
            place=lambda batch: sharding.shard_batch(batch, self.mesh, batch_axis=1),
        )

    def train(self, geometry: BatchGeometry, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> np.ndarray:
        """One optimizer step; ``rows[r]`` are run r's examples, laid out as the loop lays a step out."""
        step = self.train_step(geometry)
        self.runs, metrics = step(self.base_state, self.runs, self._placed(self.train_batch(geometry, tokenized, rows)))
        return np.asarray(jax.device_get(metrics["loss"]))

    def eval_pool(self, tokenized: TokenizedSet, *, batch_tokens: int, runs: int | None = None) -> EvalPool:
        """The loop's evaluation pool of ``tokenized`` as one set (``EVAL_SET``) every run scores, built once; for
        the engine's runs, or for the first ``runs`` of them."""
        runs = self.runs.num_runs if runs is None else runs
        return make_eval_pool({EVAL_SET: tokenized}, [{}] * runs, batch_tokens=batch_tokens)

    def compile_train(self, geometry: BatchGeometry, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> None:
        """Compiles the train step without taking a step: a timed step must not compile, so the warm-up
        compiles it ahead (and is charged)."""
        batch = self._placed(self.train_batch(geometry, tokenized, rows))
        self.train_step(geometry).lower(self.base_state, self.runs, batch).compile()

    def train_step(self, geometry: BatchGeometry) -> Any:
        """The jitted train step of ``geometry``, made once."""
        if geometry not in self.made:
            self.made[geometry] = self.make_train_step(geometry, self.runs)
        return self.made[geometry]

    @staticmethod
    def train_batch(
        geometry: BatchGeometry, tokenized: TokenizedSet, rows: Sequence[np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The host step [grad_accum, rows, ...] as the loop's stream gives it (``oodjax.data.train_steps``):
        all runs' prompts packed in ``geometry``'s rows, run r's being ``rows[r]``, in that order."""
        stream = train_steps(
            _in_stream_order(tokenized, rows),
            [STREAM_SEED] * len(rows),
            batch_size=settings.TRAIN_BATCH,
            layout=geometry.layout,
            seq_len=geometry.seq_len,
            prompts_per_row=geometry.prompts_per_row,
            prefetch=0,
        )
        return next(stream)

    def _placed(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """What the train step reads of a step, split over the rows (the loop's ``_next_batch``)."""
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


def lora_config() -> LoRAConfig:
    return LoRAConfig(**settings.LORA)


def build_engine(
    model: Callable[[jax.sharding.Mesh], nnx.Module],
    *,
    seeds: Sequence[int],
    total_steps: int,
    yes_id: int,
    no_id: int,
) -> Engine:
    """``model(mesh)`` (a checkpoint loaded by ``load_pretrained``, or a random model) on the first device, one
    adapter per seed, the steps made by steps.py (the train step once its geometry is known:
    ``Engine.train_step``)."""
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = model(mesh)
    optimizer = steps.make_optimizer(
        settings.LEARNING_RATE,
        total_steps,
        settings.warmup_steps(total_steps),
        weight_decay=0.0,
        max_grad_norm=settings.MAX_GRAD_NORM,
    )
    graphdef, base_state, runs = steps.attach_runs(model, list(seeds), lora_config(), optimizer, mesh=mesh)

    def make_train_step(geometry: BatchGeometry, runs: steps.TrainState) -> Any:
        return steps.make_train_step(
            graphdef, optimizer, yes_id, no_id, geometry, mesh=mesh, base_state=base_state, state=runs
        )

    return Engine(
        mesh=mesh,
        base_state=base_state,
        runs=runs,
        eval_step=steps.make_eval_step(graphdef, yes_id, no_id, mesh=mesh),
        make_train_step=make_train_step,
    )


def checkpoint_engine(checkpoint: str, *, total_steps: int, yes_id: int, no_id: int) -> Engine:
    """One run (seed 0) on the CPU cases' float32 checkpoint, as their oodjax contenders score and train it."""
    from oodjax import models

    def load(mesh: jax.sharding.Mesh) -> nnx.Module:
        return models.load_pretrained(checkpoint, dtype="float32", mesh=mesh)

    return build_engine(load, seeds=[0], total_steps=total_steps, yes_id=yes_id, no_id=no_id)
