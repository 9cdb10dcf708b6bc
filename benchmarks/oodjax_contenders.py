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
from oodjax.data import TokenizedSet, make_batch
from oodjax.engine import sharding, steps
from oodjax.engine.evaluation import EvalSet, evaluate, make_eval_set
from oodjax.models.lora import LoRAConfig


@dataclasses.dataclass
class Engine:
    """One frozen base with R runs' adapters, and the compiled steps over them."""

    mesh: jax.sharding.Mesh
    base_state: Any
    runs: steps.RunsState
    eval_step: Callable[..., jax.Array]
    train_step: Callable[..., tuple[steps.RunsState, jax.Array]]

    def margins(self, eval_set: EvalSet) -> np.ndarray:
        """[R, N] margins, through the engine's ``evaluate`` (all batches dispatched, then fetched)."""
        return evaluate(self.eval_step, self.base_state, self.runs.lora, eval_set, num_runs=self.runs.num_runs,
                        place=lambda batch: sharding.shard_batch(batch, self.mesh))

    def train(self, tokenized: TokenizedSet, rows: Sequence[np.ndarray], seq_len: int) -> np.ndarray:
        """One optimizer step; ``rows[r]`` are run r's examples, padded to ``seq_len`` as the loop pads them."""
        per_run = [make_batch(tokenized, np.asarray(r), seq_len) for r in rows]
        batch = {
            key: np.stack([b[key][None] for b in per_run])  # [R, grad_accum=1, B, ...]
            for key in ("input_ids", "attention_mask", "answer_pos", "label", "valid")
        }
        placed = sharding.shard_batch(batch, self.mesh, batch_axis=2)
        self.runs, loss = self.train_step(self.base_state, self.runs, placed)
        return np.asarray(jax.device_get(loss))


def lora_config() -> LoRAConfig:
    lora = settings.LORA
    return LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"], targets=lora["targets"])


def build_engine(
    checkpoint: pathlib.Path, *, seeds: Sequence[int], total_steps: int, yes_id: int, no_id: int
) -> Engine:
    """The float32 checkpoint loaded by ``load_pretrained``, one adapter per seed, the steps made by steps.py."""
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = models.load_pretrained(checkpoint, dtype="float32", mesh=mesh)
    optimizer = steps.make_optimizer(settings.LEARNING_RATE, total_steps, settings.warmup_steps(total_steps),
                                     weight_decay=0.0, max_grad_norm=settings.MAX_GRAD_NORM)
    graphdef, base_state, runs = steps.init_runs(model, list(seeds), lora_config(), optimizer, mesh=mesh)
    return Engine(
        mesh=mesh,
        base_state=base_state,
        runs=runs,
        eval_step=steps.make_eval_step(graphdef, yes_id, no_id, mesh=mesh),
        train_step=steps.make_train_step(graphdef, optimizer, yes_id, no_id, grad_accum=1, mesh=mesh, runs=runs),
    )


def eval_set(tokenized: TokenizedSet, *, batch_size: int) -> EvalSet:
    """The engine's bucketed, padded evaluation batches (built once, replayed every evaluation)."""
    return make_eval_set("benchmark", tokenized, batch_size=batch_size, buckets=settings.BUCKETS, pad_id=0)


def train_seq_len(tokenized: TokenizedSet) -> int:
    """The loop's one training length: the smallest bucket that holds the longest training prompt."""
    longest = int(tokenized.lengths.max())
    return next(b for b in settings.BUCKETS if b >= longest)
