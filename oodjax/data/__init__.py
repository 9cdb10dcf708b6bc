"""The eight NLI testsets, few-shot sampling, prompts and batches (see DESIGN.md)."""

from oodjax.data.pipeline import (
    Batch,
    bucket_lengths,
    by_length,
    eval_batches,
    few_shot,
    fitting_bucket,
    make_batch,
    pack_rows,
    packed_batch,
    stratified_subset,
    train_batches,
    train_prompts_per_row,
)
from oodjax.data.prompts import (
    DEFAULT_MAX_LENGTH,
    DEFAULT_TEMPLATE,
    TokenizedSet,
    answer_token_ids,
    format_prompt,
    tokenize_testset,
)
from oodjax.data.testsets import TESTSETS, TestsetSpec, load_testset, testset_spec, training_pool

__all__ = [
    "Batch",
    "DEFAULT_MAX_LENGTH",
    "DEFAULT_TEMPLATE",
    "TESTSETS",
    "TestsetSpec",
    "TokenizedSet",
    "answer_token_ids",
    "bucket_lengths",
    "by_length",
    "eval_batches",
    "few_shot",
    "fitting_bucket",
    "format_prompt",
    "load_testset",
    "make_batch",
    "pack_rows",
    "packed_batch",
    "stratified_subset",
    "testset_spec",
    "tokenize_testset",
    "train_batches",
    "train_prompts_per_row",
    "training_pool",
]
