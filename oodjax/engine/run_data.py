"""The data of the runs trained together: evaluation sets, few-shot training sets, training streams.

Testsets are loaded, capped and tokenised once (the data layer caches the
tokenisation on disk) and shared by all runs. Each run draws its own few-shot
set and data order from its seed. The runs' few-shot sets are also evaluated,
as one concatenated set: the eval step shares its batch across runs, so one
pass with one set of compiled shapes serves every run, and each run keeps the
margins of its own rows.
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
    TokenizedSet,
    bucket_lengths,
    few_shot,
    load_testset,
    stratified_subset,
    tokenize_testset,
    train_batches,
    training_pool,
)
from oodjax.engine.evaluation import EvalSet, make_eval_set


@dataclasses.dataclass(frozen=True)
class RunsData:
    testsets: list[EvalSet]  # config.data.testsets, in order
    train_eval: EvalSet  # every run's few-shot set, concatenated in run order
    train_rows: list[slice]  # run r's rows of train_eval
    streams: list[grain.DatasetIterator]  # run r's training batches, [batch_size, seq_len] each


def load_runs_data(
    config: config_dict.ConfigDict, tokenizer: PreTrainedTokenizerBase, runs: Sequence[tuple[int, int]]
) -> RunsData:
    """`runs` are (seed, shots) pairs."""
    data = config.data
    testsets = []
    for name in data.testsets:
        dataset = load_testset(name, data_dir=data.data_dir or None, neutral=data.neutral)
        if data.eval_cap:
            dataset = stratified_subset(dataset, data.eval_cap, seed=data.eval_seed)
        tokenized = _tokenize(config, dataset, tokenizer)
        if tokenized.num_truncated:
            logging.info(
                "%s: %d of %d prompts truncated to %d tokens", name, tokenized.num_truncated, len(tokenized),
                data.max_length,
            )
        testsets.append(_eval_set(config, name, tokenized, tokenizer))

    pool = training_pool(data.train_set, split=data.pool_split or None, data_dir=data.data_dir or None)
    few_shot_sets = [few_shot(pool, shots, seed) for seed, shots in runs]
    train_sets = [_tokenize(config, dataset, tokenizer) for dataset in few_shot_sets]
    seq_len = _train_seq_len(config, train_sets)
    streams = [
        train_batches(
            tokenized, batch_size=config.train.batch_size, seed=seed, seq_len=seq_len, pad_id=_pad_id(tokenizer)
        )
        for (seed, _), tokenized in zip(runs, train_sets)
    ]
    all_train = _tokenize(config, datasets.concatenate_datasets(few_shot_sets), tokenizer)
    offsets = np.cumsum([0] + [len(dataset) for dataset in few_shot_sets]).tolist()
    return RunsData(
        testsets=testsets,
        train_eval=_eval_set(config, schema.TRAIN_TESTSET, all_train, tokenizer),
        train_rows=[slice(start, stop) for start, stop in zip(offsets[:-1], offsets[1:])],
        streams=streams,
    )


def _tokenize(
    config: config_dict.ConfigDict, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> TokenizedSet:
    data = config.data
    return tokenize_testset(
        dataset, tokenizer, template=data.template, max_length=data.max_length, cache_dir=data.cache_dir or None
    )


def _eval_set(
    config: config_dict.ConfigDict, name: str, tokenized: TokenizedSet, tokenizer: PreTrainedTokenizerBase
) -> EvalSet:
    return make_eval_set(
        name, tokenized, batch_size=config.eval.batch_size, buckets=_buckets(config), pad_id=_pad_id(tokenizer)
    )


def _train_seq_len(config: config_dict.ConfigDict, train_sets: Sequence[TokenizedSet]) -> int:
    """One training length for all runs (their batches are stacked): the smallest bucket holding every prompt."""
    buckets = _buckets(config)
    longest = max(int(t.lengths.max()) for t in train_sets)
    return buckets[int(np.searchsorted(buckets, longest))]


def _buckets(config: config_dict.ConfigDict) -> tuple[int, ...]:
    return bucket_lengths(config.data.max_length, tuple(config.data.buckets) or None)


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Padding is masked, so any valid id serves; GPT-2's tokenizer has no pad token."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0
