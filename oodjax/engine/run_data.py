"""The data of the runs trained together: the evaluation pool, training streams, and each step's batch.

Testsets are loaded, capped and tokenised once (the data layer caches the
tokenisation on disk) and shared by all runs. Each run draws its own few-shot
set and data order from its seed. The testsets and the runs' few-shot sets
are evaluated as one pool (``oodjax.engine.evaluation``), each run scoring
the testsets and its own few-shot set only. Training batches have rows of
one length for the whole job, one prompt a row sorted by length or, with
train.pack, several prompts a row, fullest rows first; the train step runs
each micro-batch at the smallest bucket that holds it and skips those that
hold no prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import datasets
import grain
import numpy as np
from absl import logging
from ml_collections import config_dict
from transformers import PreTrainedTokenizerBase

from analysis import schema
from oodjax.data import (
    Batch,
    TokenizedSet,
    few_shot,
    load_testset,
    stratified_subset,
    tokenize_testset,
    train_batches,
    training_pool,
)
from oodjax.engine.evaluation import EvalPool, make_eval_pool
from oodjax.engine.geometry import BatchGeometry

# What the train step reads of a batch.
TRAIN_KEYS = ("input_ids", "attention_mask", "answer_pos", "label", "valid")


@dataclasses.dataclass(frozen=True)
class RunsData:
    eval_pool: EvalPool  # config.data.testsets in order, then run r's few-shot set as schema.TRAIN_TESTSET
    streams: list[grain.DatasetIterator]  # run r's training batches, rows of geometry.seq_len tokens


def few_shot_sets(
    config: config_dict.ConfigDict, tokenizer: PreTrainedTokenizerBase, runs: Sequence[tuple[int, int]]
) -> list[TokenizedSet]:
    """Each run's tokenised few-shot training set; ``runs`` are (seed, shots) pairs.

    Cheap (a few hundred prompts), so the job's ``BatchGeometry``, which
    needs their lengths, is known before the testsets are tokenised.
    """
    data = config.data
    pool = training_pool(data.train_set, split=data.pool_split or None, data_dir=data.data_dir or None)
    return [_tokenize(config, few_shot(pool, shots, seed), tokenizer) for seed, shots in runs]


def load_runs_data(
    config: config_dict.ConfigDict,
    tokenizer: PreTrainedTokenizerBase,
    seeds: Sequence[int],
    train_sets: Sequence[TokenizedSet],
    geometry: BatchGeometry,
) -> RunsData:
    """The evaluation pool and run r's training stream, seeded by ``seeds[r]``, over ``train_sets[r]``.

    Training batches have ``geometry``'s shape, of which this process feeds
    its ``process_rows``; an evaluation batch holds ``geometry.eval_rows``
    rows of data.max_length tokens at most, each packed with as many prompts
    as fit.
    """
    data = config.data
    testsets = {}
    for name in data.testsets:
        dataset = load_testset(name, data_dir=data.data_dir or None, neutral=data.neutral)
        if data.eval_cap:
            dataset = stratified_subset(dataset, data.eval_cap, seed=data.eval_seed)
        tokenized = testsets[name] = _tokenize(config, dataset, tokenizer)
        if tokenized.num_truncated:
            logging.info(
                "%s: %d of %d prompts truncated to %d tokens", name, tokenized.num_truncated, len(tokenized),
                data.max_length,
            )
    streams = [
        train_batches(
            tokenized,
            batch_size=geometry.batch_size,
            seed=seed,
            seq_len=geometry.seq_len,
            pack=geometry.prompts_per_row is not None,
            prompts_per_row=geometry.prompts_per_row,
            rows=geometry.process_rows,
            pad_id=_pad_id(tokenizer),
        )
        for seed, tokenized in zip(seeds, train_sets, strict=True)
    ]
    eval_pool = make_eval_pool(
        testsets,
        [{schema.TRAIN_TESTSET: tokenized} for tokenized in train_sets],
        batch_tokens=geometry.eval_batch_tokens,
        row_multiple=geometry.batch_shards,
        pad_id=_pad_id(tokenizer),
    )
    return RunsData(eval_pool=eval_pool, streams=streams)


def step_batch(per_run: Sequence[Batch], *, grad_accum: int) -> Batch:
    """The runs' batches of one step as the train step takes them: [R, grad_accum, micro_batch, S].

    Every run's stream has rows of the same length S (``BatchGeometry.seq_len``),
    and packed rows the same prompt slots, so the step compiles once; it cuts
    each micro-batch to its own bucket.
    """

    def stacked(key: str) -> np.ndarray:
        return np.stack([batch[key].reshape(grad_accum, -1, *batch[key].shape[1:]) for batch in per_run])

    return {key: stacked(key) for key in TRAIN_KEYS}


def _tokenize(
    config: config_dict.ConfigDict, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> TokenizedSet:
    data = config.data
    return tokenize_testset(
        dataset, tokenizer, template=data.template, max_length=data.max_length, cache_dir=data.cache_dir or None
    )


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Padding is masked, so any valid id serves; GPT-2's tokenizer has no pad token."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0
