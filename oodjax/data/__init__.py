"""The eight NLI testsets, few-shot sampling, prompts and batches (see DESIGN.md)."""

from oodjax.data.batches import (
    EVAL_KEYS,
    SEQUENCE_KEYS,
    TRAIN_KEYS,
    TRAIN_ONLY_KEYS,
    Batch,
    batch_layout,
    bucket_lengths,
    eval_batches,
    eval_row_lengths,
    fitting_bucket,
    prompt_lengths,
)
from oodjax.data.in_context import InContextSet, tokenize_in_context
from oodjax.data.packing import balance_rows, pair_rows
from oodjax.data.prompts import (
    DEFAULT_ANSWERS,
    DEFAULT_MAX_LENGTH,
    DEFAULT_TEMPLATE,
    TokenizedSet,
    answer_token_ids,
    format_prompt,
    load_tokenizer,
    tokenize_testset,
)
from oodjax.data.sampling import few_shot, stratified_subset
from oodjax.data.testset_rows import load_testset, training_pool
from oodjax.data.testsets import TESTSETS, TestsetSpec, check_neutral, testset_spec, testset_table
from oodjax.data.training_stream import (
    TRAIN_PREFETCH,
    StepLayout,
    epoch_permutation,
    packed_layout,
    replay_rows,
    step_layout,
    stream_examples,
    train_steps,
)

__all__ = [
    "Batch",
    "EVAL_KEYS",
    "SEQUENCE_KEYS",
    "TRAIN_KEYS",
    "TRAIN_ONLY_KEYS",
    "DEFAULT_ANSWERS",
    "DEFAULT_MAX_LENGTH",
    "DEFAULT_TEMPLATE",
    "InContextSet",
    "TESTSETS",
    "TRAIN_PREFETCH",
    "StepLayout",
    "TestsetSpec",
    "TokenizedSet",
    "answer_token_ids",
    "bucket_lengths",
    "check_neutral",
    "eval_batches",
    "eval_row_lengths",
    "few_shot",
    "fitting_bucket",
    "format_prompt",
    "load_testset",
    "load_tokenizer",
    "balance_rows",
    "batch_layout",
    "epoch_permutation",
    "pair_rows",
    "prompt_lengths",
    "packed_layout",
    "replay_rows",
    "step_layout",
    "stream_examples",
    "stratified_subset",
    "testset_spec",
    "testset_table",
    "tokenize_in_context",
    "tokenize_testset",
    "train_steps",
    "training_pool",
]
