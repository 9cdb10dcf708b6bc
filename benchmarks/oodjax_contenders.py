"""The oodjax side: the engine's own jitted steps and evaluation, as the run loop calls them.

As in the loop, everything lives on a device mesh (here of the one CPU
device) and batches are placed with the engine's ``shard_batch``.
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
from oodjax.data import TokenizedSet, balanced_batch, train_prompts_per_row
from oodjax.engine import sharding, steps
from oodjax.engine.evaluation import EvalPool, evaluate, make_eval_pool
from oodjax.engine.geometry import BatchGeometry
from oodjax.engine.run_data import step_batch
from oodjax.models.lora import LoRAConfig

EVAL_SET = "testsets"  # the name of the one set the evaluation case's pool holds


@dataclasses.dataclass
class Engine:
    """One frozen base with R runs' adapters, and the compiled steps over them."""

    mesh: jax.sharding.Mesh
    base_state: Any
    runs: steps.TrainState
    eval_step: Callable[..., jax.Array]
    train_step: Callable[..., tuple[steps.TrainState, jax.Array]]

    def margins(self, pool: EvalPool) -> list[dict[str, np.ndarray]]:
        """Each run's margins per set, through the engine's ``evaluate`` (all batches dispatched, then fetched)."""
        return evaluate(self.eval_step, self.base_state, self.runs.lora, pool,
                        place=lambda batch: sharding.shard_batch(batch, self.mesh, batch_axis=1))

    def train(self, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> np.ndarray:
        """One optimizer step; ``rows[r]`` are run r's examples, packed and cut to buckets as the loop does."""
        self.runs, loss = self.train_step(self.base_state, self.runs, self._placed(self.train_batch(tokenized, rows)))
        return np.asarray(jax.device_get(loss))

    def eval_pool(self, tokenized: TokenizedSet, *, batch_tokens: int) -> EvalPool:
        """The loop's evaluation pool of ``tokenized`` as one set (``EVAL_SET``) of one run, built once."""
        return make_eval_pool({EVAL_SET: tokenized}, [{}], batch_tokens=batch_tokens)

    def compile_train(self, tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> None:
        """Compiles the train step (one program, a branch per bucket) without taking a step.

        The loop compiles it at its first step; a timed step must not, so the
        warm-up compiles it ahead (and is charged).
        """
        self.train_step.lower(self.base_state, self.runs, self._placed(self.train_batch(tokenized, rows))).compile()

    @staticmethod
    def train_batch(tokenized: TokenizedSet, rows: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """The host batch [R, grad_accum, micro_batch, ...] as the loop's stream gives it: packed rows of MAX_LENGTH."""
        slots = train_prompts_per_row([tokenized], batch_size=settings.TRAIN_BATCH, seq_len=settings.MAX_LENGTH)
        per_run = [
            balanced_batch(
                tokenized, r, settings.TRAIN_BATCH, settings.MAX_LENGTH, slots, micro_batches=settings.TRAIN_GRAD_ACCUM
            )
            for r in rows
        ]
        return step_batch(per_run, grad_accum=settings.TRAIN_GRAD_ACCUM)

    def _placed(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return sharding.shard_batch(batch, self.mesh, batch_axis=2)


def lora_config() -> LoRAConfig:
    lora = settings.LORA
    return LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"], targets=lora["targets"])


def build_engine(
    checkpoint: pathlib.Path, *, seeds: Sequence[int], total_steps: int, yes_id: int, no_id: int,
    buckets: Sequence[int],
) -> Engine:
    """The float32 checkpoint loaded by ``load_pretrained``, one adapter per seed, the steps made by steps.py."""
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = models.load_pretrained(checkpoint, dtype="float32", mesh=mesh)
    optimizer = steps.make_optimizer(settings.LEARNING_RATE, total_steps, settings.warmup_steps(total_steps),
                                     weight_decay=0.0, max_grad_norm=settings.MAX_GRAD_NORM)
    graphdef, base_state, runs = steps.init_runs(model, list(seeds), lora_config(), optimizer, mesh=mesh)
    geometry = BatchGeometry(
        runs=len(seeds), batch_size=settings.TRAIN_BATCH, grad_accum=settings.TRAIN_GRAD_ACCUM,
        seq_len=settings.MAX_LENGTH, buckets=tuple(buckets),
    )
    return Engine(
        mesh=mesh,
        base_state=base_state,
        runs=runs,
        eval_step=steps.make_eval_step(graphdef, yes_id, no_id, mesh=mesh),
        train_step=steps.make_train_step(graphdef, optimizer, yes_id, no_id, geometry, mesh=mesh,
                                         base_state=base_state, runs=runs),
    )
