"""Case 2, training throughput: LoRA r=8 on q/k/v/o, batch 16, AdamW, on an MNLI few-shot set.

Every contender takes the same sequence of batches (one fixed shuffled
order). oodjax runs each batch as the run loop does: packed several prompts
to a row, balanced over the fewest rows of at most MAX_LENGTH tokens that
hold every batch, run at the smallest bucket that holds the longest. The
first step
of each contender (a warm-up step, on the same batch, with the adapters'
B still zero) must give the same loss: that checks all three compute the
same objective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import peft

from benchmarks import flops, harness, settings, torch_contenders
from benchmarks.oodjax_contenders import Engine, train_geometry
from benchmarks.settings import Mode
from benchmarks.workload import Workload, training_order
from oodjax.data import fitting_bucket
from oodjax.engine.geometry import BatchGeometry


def run(mode: Mode, workload: Workload, engine: Engine, torch_model: peft.PeftModel, peak_flops: float) -> dict[str, Any]:
    tokenized = workload.train_set
    per_repeat = mode.train_steps_per_repeat
    calls = mode.warmup + mode.repeats
    order = training_order(len(tokenized), calls * per_repeat, settings.TRAIN_BATCH)
    answers = dict(yes_id=workload.yes_id, no_id=workload.no_id, total_steps=len(order))
    trainers = {
        "pytorch-original": torch_contenders.Trainer(torch_model, tuned=False, **answers),
        "pytorch-tuned": torch_contenders.Trainer(torch_model, tuned=True, **answers),
    }
    geometry = train_geometry(tokenized, [[rows] for rows in order], mode.buckets)
    steps = {
        "oodjax": lambda rows: float(engine.train(geometry, tokenized, [rows])[0]),
        **{name: (lambda rows, t=trainer: t.step(tokenized, rows)) for name, trainer in trainers.items()},
    }
    losses: dict[str, list[float]] = {name: [] for name in steps}

    def contender(name: str) -> Callable[[], None]:
        def call() -> None:
            first = len(losses[name]) * per_repeat
            if name == "oodjax" and not first:  # the warm-up compiles the step (a branch per bucket)
                engine.compile_train(geometry, tokenized, [order[0]])
            for rows in order[first : first + per_repeat]:
                losses[name].append(steps[name](rows))

        return call

    timings = harness.compare({name: contender(name) for name in steps}, repeats=mode.repeats, warmup=mode.warmup)
    timed_calls = range(mode.warmup, calls)
    repeat_flops = [
        sum(
            flops.train_flops(mode.model, tokenized.lengths[rows], lora_rank=settings.LORA["rank"])
            for rows in order[call * per_repeat : (call + 1) * per_repeat]
        )
        for call in timed_calls
    ]
    results = {
        name: t.summary(per_repeat * settings.TRAIN_BATCH, flops=repeat_flops, peak_flops=peak_flops)
        for name, t in timings.items()
    }
    first = {name: values[0] for name, values in losses.items()}
    real_tokens = sum(int(tokenized.lengths[rows].sum()) for rows in order)
    computed_tokens = sum(_computed_tokens(Engine.train_batch(geometry, tokenized, [rows]), geometry) for rows in order)
    return {
        "case": "train",
        "title": "Training throughput",
        "unit": "examples/s",
        "description": (
            f"LoRA r={settings.LORA['rank']} on q/k/v/o, batch {settings.TRAIN_BATCH}, AdamW with clipping, "
            f"{per_repeat} step(s) per repetition, MNLI few-shot set of {len(tokenized)} (mean "
            f"{tokenized.lengths.mean():.0f} tokens, max {tokenized.lengths.max()}). oodjax: engine train step, "
            f"each batch packed into {settings.TRAIN_GRAD_ACCUM} micro-batch(es) of {geometry.rows} rows of at "
            f"most {settings.MAX_LENGTH} tokens (the fewest that hold every batch), balanced, each cut to the "
            "smallest of the "
            f"buckets {mode.buckets} holding its longest row, empty ones skipped (compiled in the warm-up); "
            f"pytorch-original: peft, padded to {settings.MAX_LENGTH}, full logits; "
            "pytorch-tuned: peft, padded to each batch's longest prompt, head at the answer position only."
        ),
        "contenders": results,
        "agreement": {
            "first_step_loss": first,
            "oodjax_vs_pytorch_tuned": abs(first["oodjax"] - first["pytorch-tuned"]),
            "pytorch_original_vs_tuned": abs(first["pytorch-original"] - first["pytorch-tuned"]),
        },
        "oodjax_padding_efficiency": real_tokens / computed_tokens,
        "ratios": harness.ratios(results, "oodjax"),
    }


def _computed_tokens(batch: dict[str, np.ndarray], geometry: BatchGeometry) -> int:
    """Tokens the train step computes for a host step [grad_accum, rows, S]: rows x the length (of
    ``geometry.micro_batch_lengths``) of each non-empty micro-batch."""
    lengths = geometry.micro_batch_lengths
    total = 0
    for mask, valid in zip(batch["segment_ids"], batch["valid"]):
        if valid.any():
            total += len(mask) * fitting_bucket(lengths, int((mask != 0).sum(axis=-1).max()))
    return total
