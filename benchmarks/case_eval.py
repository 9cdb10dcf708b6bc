"""Case 1, evaluation throughput: margins logit(Yes) - logit(No) of real prompts from the eight testsets.

The three contenders run on the same weights (the run's checkpoint), each in
a process of its own (``benchmarks.harness.compare``), and the margins their
timed calls computed are compared: a contender that computed less, or
something else, would show here rather than as a flattering speed-up.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import flops, harness, settings
from benchmarks.settings import Mode
from benchmarks.workload import Workload, mode_workload

CONTENDERS = ("oodjax", "pytorch-original", "pytorch-tuned")


def _examples(mode: Mode, name: str, tokenized_size: int) -> np.ndarray:
    """The rows ``name`` scores: all, but the original approach's first ``mode.original_eval_examples`` only."""
    rows = np.arange(tokenized_size)
    return rows[: mode.original_eval_examples] if name == "pytorch-original" else rows


def contender(name: str, *, mode: str, checkpoint: str) -> tuple[Callable[[], list[float]], dict[str, Any]]:
    """``name``'s scoring of the case's prompts, built in its own process (``benchmarks.worker``); a call
    returns the margins it computed. oodjax reports its pool's padded tokens."""
    sizes = settings.MODES[mode]
    workload = mode_workload(sizes)
    tokenized = workload.eval_set
    rows = _examples(sizes, name, len(tokenized))
    if name == "oodjax":
        from benchmarks.oodjax_contenders import EVAL_SET, contender_job, evaluation_engine

        job = contender_job(checkpoint, seeds=[0], shots=sizes.train_shots, total_steps=1, dtype="float32")
        engine = evaluation_engine(job, (workload.yes_id, workload.no_id))
        pool = engine.eval_pool(tokenized, batch_tokens=_batch_tokens(sizes))
        padded_tokens = sum(int(batch["input_ids"].size) for batch in pool.batches)
        return (lambda: engine.margins(pool)[0][EVAL_SET].tolist()), {"padded_tokens": padded_tokens}
    if name not in CONTENDERS:
        raise ValueError(f"no evaluation contender {name!r}; the contenders are {CONTENDERS}")
    from benchmarks import torch_contenders

    model = torch_contenders.attach_lora(torch_contenders.load_model(checkpoint), seed=0)
    margins = torch_contenders.margins_original if name == "pytorch-original" else torch_contenders.margins_tuned
    answers = dict(yes_id=workload.yes_id, no_id=workload.no_id, batch_size=sizes.eval_batch_size)
    return (lambda: margins(model, tokenized, rows, **answers).tolist()), {}


def _batch_tokens(mode: Mode) -> int:
    """oodjax's evaluation batch budget: the loop's eval.batch_size x max_length."""
    return mode.eval_batch_size * settings.MAX_LENGTH


def run(
    mode: Mode, workload: Workload, checkpoint: pathlib.Path, peak_flops: float, workdir: pathlib.Path
) -> dict[str, Any]:
    tokenized = workload.eval_set
    rows = np.arange(len(tokenized))
    original_rows = _examples(mode, "pytorch-original", len(tokenized))
    comparison = harness.compare(
        "case_eval",
        CONTENDERS,
        {"mode": mode.name, "checkpoint": str(checkpoint)},
        repeats=mode.repeats,
        warmup=mode.warmup,
        logs=workdir,
    )
    margins = {name: np.asarray(returned[-1]) for name, returned in comparison.returned.items()}
    padded_tokens = comparison.processes["oodjax"]["padded_tokens"]
    agreement = {  # from the last repetition of each: the margins every timed call computed
        "oodjax_vs_pytorch_tuned": float(np.abs(margins["oodjax"] - margins["pytorch-tuned"]).max()),
        "pytorch_original_vs_tuned": float(
            np.abs(margins["pytorch-original"] - margins["pytorch-tuned"][original_rows]).max()
        ),
        "max_abs_margin": float(np.abs(margins["pytorch-tuned"]).max()),
    }
    results = {}
    for name, timing in comparison.timings.items():
        lengths = tokenized.lengths[_examples(mode, name, len(tokenized))]
        model_flops = flops.eval_flops(mode.model, lengths, lora_rank=settings.LORA["rank"])
        results[name] = timing.summary(len(lengths), flops=[model_flops] * len(timing.seconds), peak_flops=peak_flops)
    return {
        "case": "eval",
        "title": "Evaluation throughput",
        "unit": "examples/s",
        "description": (
            f"{len(rows)} real prompts ({mode.eval_per_testset} per testset, mean "
            f"{tokenized.lengths.mean():.0f} GPT-2 tokens, max {tokenized.lengths.max()}), batch "
            f"{mode.eval_batch_size}, one LoRA adapter. oodjax: the run loop's evaluation, one pool packed "
            f"several prompts to a row of {settings.MAX_LENGTH} tokens, batches of at most {_batch_tokens(mode)} "
            f"tokens; pytorch-original: padded to {settings.MAX_LENGTH}, full logits "
            f"(timed on the first {len(original_rows)} prompts: its cost per prompt does not depend on the "
            "prompt); pytorch-tuned: length-sorted dynamic padding, two head columns at the answer position."
        ),
        "contenders": results,
        "agreement": agreement,
        "oodjax_padding_efficiency": float(tokenized.lengths.sum() / padded_tokens),
        "processes": comparison.processes,
        **harness.ratio_fields(results, "oodjax"),
    }
