"""Case 1, evaluation throughput: margins logit(Yes) - logit(No) of real prompts from the eight testsets.

The three contenders run on the same weights, and the margins their timed
calls computed are compared: a contender that computed less, or something
else, would show here rather than as a flattering speed-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import peft

from benchmarks import flops, harness, oodjax_contenders, settings, torch_contenders
from benchmarks.oodjax_contenders import Engine
from benchmarks.settings import Mode
from benchmarks.workload import Workload


def run(mode: Mode, workload: Workload, engine: Engine, torch_model: peft.PeftModel, peak_flops: float) -> dict[str, Any]:
    tokenized = workload.eval_set
    rows = np.arange(len(tokenized))
    original_rows = rows[: mode.original_eval_examples]
    batch_tokens = mode.eval_batch_size * settings.MAX_LENGTH  # the loop's budget: eval.batch_size x max_length
    pool = engine.eval_pool(tokenized, batch_tokens=batch_tokens)
    answers = dict(yes_id=workload.yes_id, no_id=workload.no_id, batch_size=mode.eval_batch_size)

    compute = {
        "oodjax": lambda: engine.margins(pool)[0][oodjax_contenders.EVAL_SET],
        "pytorch-original": lambda: torch_contenders.margins_original(torch_model, tokenized, original_rows, **answers),
        "pytorch-tuned": lambda: torch_contenders.margins_tuned(torch_model, tokenized, rows, **answers),
    }
    examples = {"oodjax": rows, "pytorch-original": original_rows, "pytorch-tuned": rows}
    margins: dict[str, np.ndarray] = {}

    def contender(name: str) -> Callable[[], None]:
        def call() -> None:
            margins[name] = np.asarray(compute[name]())

        return call

    timings = harness.compare({name: contender(name) for name in compute}, repeats=mode.repeats, warmup=mode.warmup)
    agreement = {  # from the last repetition of each: the margins every timed call computed
        "oodjax_vs_pytorch_tuned": float(np.abs(margins["oodjax"] - margins["pytorch-tuned"]).max()),
        "pytorch_original_vs_tuned": float(
            np.abs(margins["pytorch-original"] - margins["pytorch-tuned"][original_rows]).max()
        ),
        "max_abs_margin": float(np.abs(margins["pytorch-tuned"]).max()),
    }
    results = {}
    for name, timing in timings.items():
        lengths = tokenized.lengths[examples[name]]
        model_flops = flops.eval_flops(mode.model, lengths, lora_rank=settings.LORA["rank"])
        results[name] = timing.summary(
            len(lengths), flops=[model_flops] * len(timing.seconds), peak_flops=peak_flops
        )
    padded_tokens = sum(b["input_ids"].size for b in pool.batches)
    return {
        "case": "eval",
        "title": "Evaluation throughput",
        "unit": "examples/s",
        "description": (
            f"{len(rows)} real prompts ({mode.eval_per_testset} per testset, mean "
            f"{tokenized.lengths.mean():.0f} GPT-2 tokens, max {tokenized.lengths.max()}), batch "
            f"{mode.eval_batch_size}, one LoRA adapter. oodjax: the run loop's evaluation, one pool packed "
            f"several prompts to a row of {settings.MAX_LENGTH} tokens, batches of at most {batch_tokens} tokens; "
            "pytorch-original: "
            f"padded to {settings.MAX_LENGTH}, full logits "
            f"(timed on the first {len(original_rows)} prompts: its cost per prompt does not depend on the "
            "prompt); pytorch-tuned: length-sorted dynamic padding, two head columns at the answer position."
        ),
        "contenders": results,
        "agreement": agreement,
        "oodjax_padding_efficiency": float(tokenized.lengths.sum() / padded_tokens),
        "ratios": harness.ratios(results, "oodjax"),
    }
