"""Case 2, training throughput: LoRA r=8 on q/k/v/o, batch 16, AdamW, on an MNLI few-shot set.

Every call of every contender takes the same batches from the same weights,
so every repetition does the same work and their spread is the machine's
(a batch holding the set's longest prompt costs PyTorch twice another's).
oodjax packs each batch as the run loop does. The first step of each
contender must give the same loss: all three compute the same objective.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import flops, harness, settings
from benchmarks.settings import Mode
from benchmarks.workload import Workload, mode_workload, training_order
from oodjax.data import TokenizedSet, bucket_lengths, fitting_bucket
from oodjax.engine.geometry import BatchGeometry

CONTENDERS = ("oodjax", "pytorch-original", "pytorch-tuned")


def _steps(mode: Mode, tokenized: TokenizedSet) -> list[np.ndarray]:
    """The rows of each step one call takes: the same for every call and every contender."""
    return training_order(len(tokenized), mode.train_steps_per_repeat, settings.TRAIN_BATCH)


def contender(name: str, *, mode: str, checkpoint: str) -> tuple[Callable[[], list[float]], dict[str, Any]]:
    """``name``'s training, built in its own process: a call takes the case's steps and returns their losses."""
    sizes = settings.MODES[mode]
    workload = mode_workload(sizes)
    tokenized = workload.train_set
    steps = _steps(sizes, tokenized)
    total_steps = (sizes.warmup + sizes.repeats) * len(steps)  # every call the process will make, for the schedule
    answers = dict(yes_id=workload.yes_id, no_id=workload.no_id)
    if name == "oodjax":
        from benchmarks.oodjax_contenders import contender_job, train_geometry, training_engine

        job = contender_job(checkpoint, seeds=[0], shots=sizes.train_shots, total_steps=total_steps, dtype="float32")
        geometry = train_geometry(tokenized, [[rows] for rows in steps], bucket_lengths(settings.MAX_LENGTH))
        engine = training_engine(job, (workload.yes_id, workload.no_id), geometry)
        compiled: list[bool] = []

        def step(rows: np.ndarray) -> float:
            if not compiled:  # the warm-up compiles the step (a branch per bucket)
                engine.compile_train(tokenized, [rows])
                compiled.append(True)
            return float(engine.train(tokenized, [rows])[0])

        real_tokens = sum(int(tokenized.lengths[rows].sum()) for rows in steps)
        computed = sum(_computed_tokens(engine.train_batch(tokenized, [rows]), geometry) for rows in steps)
        built = {
            "rows": geometry.rows,
            "lengths": list(geometry.micro_batch_lengths),
            "padding_efficiency": real_tokens / computed,
        }
    elif name in CONTENDERS:
        from benchmarks import torch_contenders

        model = torch_contenders.attach_lora(torch_contenders.load_model(checkpoint), seed=0)
        trainer = torch_contenders.Trainer(model, tuned=name == "pytorch-tuned", total_steps=total_steps, **answers)

        def step(rows: np.ndarray) -> float:
            return trainer.step(tokenized, rows)

        built = {}
    else:
        raise ValueError(f"no training contender {name!r}; the contenders are {CONTENDERS}")
    return (lambda: [step(rows) for rows in steps]), built


def run(
    mode: Mode, workload: Workload, checkpoint: pathlib.Path, peak_flops: float, workdir: pathlib.Path
) -> dict[str, Any]:
    tokenized = workload.train_set
    per_repeat = mode.train_steps_per_repeat
    steps = _steps(mode, tokenized)
    comparison = harness.compare(
        "case_train",
        CONTENDERS,
        {"mode": mode.name, "checkpoint": str(checkpoint)},
        repeats=mode.repeats,
        warmup=mode.warmup,
        logs=workdir,
    )
    oodjax = comparison.processes["oodjax"]
    call_flops = sum(
        flops.train_flops(mode.model, tokenized.lengths[rows], lora_rank=settings.LORA["rank"]) for rows in steps
    )
    repeat_flops = [call_flops] * mode.repeats
    results = {
        name: t.summary(per_repeat * settings.TRAIN_BATCH, flops=repeat_flops, peak_flops=peak_flops)
        for name, t in comparison.timings.items()
    }
    first = {name: returned[0][0] for name, returned in comparison.returned.items()}  # the warm-up's first step
    return {
        "case": "train",
        "title": "Training throughput",
        "unit": "examples/s",
        "description": (
            f"LoRA r={settings.LORA['rank']} on q/k/v/o, batch {settings.TRAIN_BATCH}, AdamW with clipping, "
            f"the same {per_repeat} step(s) every repetition, of an MNLI few-shot set of {len(tokenized)} (mean "
            f"{tokenized.lengths.mean():.0f} tokens, max {tokenized.lengths.max()}; these steps' prompts: mean "
            f"{np.mean([tokenized.lengths[rows].mean() for rows in steps]):.0f}, max "
            f"{max(tokenized.lengths[rows].max() for rows in steps)}). oodjax: engine train step, "
            f"each batch packed into {settings.TRAIN_GRAD_ACCUM} micro-batch(es) of {oodjax['rows']} rows of at "
            f"most {settings.MAX_LENGTH} tokens (the fewest that hold every batch), balanced, each cut to the "
            f"smallest of the lengths {oodjax['lengths']} (the loop's default) holding its longest row, empty "
            "ones skipped (compiled in the warm-up); "
            f"pytorch-original: peft, padded to {settings.MAX_LENGTH}, full logits; "
            "pytorch-tuned: peft, padded to each batch's longest prompt, head at the answer position only."
        ),
        "contenders": results,
        "agreement": {
            "first_step_loss": first,
            "oodjax_vs_pytorch_tuned": abs(first["oodjax"] - first["pytorch-tuned"]),
            "pytorch_original_vs_tuned": abs(first["pytorch-original"] - first["pytorch-tuned"]),
        },
        "oodjax_padding_efficiency": oodjax["padding_efficiency"],
        "processes": comparison.processes,
        **harness.ratio_fields(results, "oodjax"),
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
