"""The data of the runs trained together: the evaluation pool, training streams, and each step's batch.

Testsets are loaded, capped and tokenised once and shared by all runs; each
run draws its own few-shot set and data order from its seed, so a run's data
does not depend on what trains beside it.

Every evaluated example keeps the row it has in its dataset as loaded
(``DATASET_INDEX``), which metrics.npz stores beside its margins, so that a
result can be joined back to its example.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import datasets
import grain
import numpy as np
from absl import logging
from transformers import PreTrainedTokenizerBase

from analysis import schema
from oodjax.data import (
    DEFAULT_ANSWERS,
    DEFAULT_MAX_LENGTH,
    DEFAULT_TEMPLATE,
    TESTSETS,
    InContextSet,
    TestsetSpec,
    TokenizedSet,
    check_neutral,
    few_shot,
    load_testset,
    prompt_lengths,
    stratified_subset,
    tokenize_in_context,
    tokenize_testset,
    training_pool,
)
from oodjax.data.prompts import check_template
from oodjax.data.testsets import Neutral, testset_spec, testset_table, training_sets
from oodjax.engine.evaluation import EvalPool
from oodjax.engine.geometry import BatchGeometry
from oodjax.engine.steps import micro_batch_branches
from oodjax.settings import setting
from oodjax.usage_errors import ConfigError, MissingInputError

# The column ``capped_testsets`` and ``few_shot_datasets`` give their datasets: each example's row in the dataset as
# loaded (``load_testset``'s split before any cap; ``training_pool``'s pool), which the caps and draws carry along.
DATASET_INDEX = "dataset_index"


def _declared_testsets(extra: Mapping[str, Any], file: str | None) -> dict[str, TestsetSpec]:
    """The built-in and declared testsets (``testset_table``); a bad declaration is a ``ConfigError`` naming it
    and its field, a missing file a ``MissingInputError``."""
    if not isinstance(extra, Mapping):
        raise ConfigError(f"data.extra_testsets must be a dict of testset declarations, got {extra!r}")
    if file and not pathlib.Path(file).expanduser().is_file():
        raise MissingInputError(f"data.extra_testsets_file {file!r} is not a file")
    try:
        table = testset_table(dict(extra), file)
    except ValueError as error:  # the message names the declaration and its field
        raise ConfigError(str(error)) from error
    if schema.TRAIN_TESTSET in table:
        raise ConfigError(
            f"{table[schema.TRAIN_TESTSET].origin}: {schema.TRAIN_TESTSET!r} is the results' name for each run's "
            "own training set; name the testset otherwise"
        )
    return table


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """What a job's data is (its data section, resolved): where the few-shot pool and the testsets come from,
    how prompts are made, and which testsets are evaluated with what cap."""

    # Testset whose examples the few-shot training sets are drawn from, and
    # which counts as in-domain in the results ("mnli" or "snli").
    train_set: str = setting("mnli", path="data.train_set")
    # Split of `train_set` the few-shot sets are drawn from; empty = the data
    # layer's offline pool (MNLI validation_mismatched, SNLI validation: in the
    # shared data, for the demo, tests and laptop configs). The study configs
    # set `train`, as the study did (configs/models.py, docs/protocol.md).
    pool_split: str | None = setting(None, path="data.pool_split")
    # Local mirror laid out as <hub_id>/<config>/<split>.jsonl; empty =
    # $OODJAX_DATA_DIR, or the Hugging Face hub when that is unset. A split
    # missing from the mirror comes from the hub, unless it is offline.
    data_dir: str | None = setting(None, path="data.data_dir")
    # Testsets evaluated at step 0 and through each run (eval.points or
    # eval.every; the training set is evaluated too, always): built-in or
    # declared ones.
    testsets: tuple[str, ...] = setting(tuple(TESTSETS), path="data.testsets")
    # Testsets declared here rather than in code, name -> fields: source (a
    # hub id, or a local .jsonl/.parquet/.csv file), config (hub config,
    # optional), split (hub sources), premise, hypothesis, label (column
    # names), entailment, not_entailment (lists of label values), neutral
    # (values handled as data.neutral says), unlabelled (values always
    # dropped), cap (replaces eval_cap). A built-in's name overrides the
    # fields given, e.g. {'anli': {'split': 'test_r1'}}. Assign the whole
    # dict in a config file. See docs/data.md.
    extra_testsets: Mapping[str, Any] = setting({}, path="data.extra_testsets")
    # A JSON or YAML file of more such declarations (name -> fields); relative
    # source files in it are relative to its folder. Empty = none.
    extra_testsets_file: str | None = setting(None, path="data.extra_testsets_file")
    # Cap each testset to this many examples (stratified by label, seeded by
    # `eval_seed`) so dense evaluation stays affordable; 0 = the full split.
    # The in-domain testset (data.train_set) only with cap_in_domain.
    eval_cap: int = setting(0, path="data.eval_cap")
    # Also cap the in-domain testset (by eval_cap, or its own declared cap).
    # Off: it is evaluated whole, since the partial correlations control for
    # its accuracy, and a noisy covariate biases them upward (by about +0.09
    # at a cap of 2,000, +0.28 at 500 in a simulation: docs/analysis.md).
    cap_in_domain: bool = setting(False, path="data.cap_in_domain")
    eval_seed: int = setting(0, path="data.eval_seed")  # seed of the `eval_cap` subsets
    # Prompt template; the model scores the next token (data.answers).
    template: str = setting(DEFAULT_TEMPLATE, path="data.template")
    # The answer words (yes, no) whose next-token logits are read: entailment
    # is the first. Each must be one token of the model's tokenizer, leading
    # space included.
    answers: tuple[str, str] = setting(DEFAULT_ANSWERS, path="data.answers")
    # Prompts longer than this are truncated inside the premise.
    max_length: int = setting(DEFAULT_MAX_LENGTH, path="data.max_length")
    # Neutral examples of three-way testsets: "drop" them, or count them as
    # "not_entailment".
    neutral: Neutral = setting("drop", path="data.neutral")
    # Where tokenised testsets are cached; empty = $OODJAX_CACHE_DIR, else
    # ~/.cache/oodjax.
    cache_dir: str | None = setting(None, path="data.cache_dir")
    # every testset a name can mean: the built-in ones and those declared (testset_table)
    table: Mapping[str, TestsetSpec] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "table", _declared_testsets(self.extra_testsets, self.extra_testsets_file))
        if not self.testsets:
            raise ConfigError("data.testsets is empty: name the testsets to evaluate (at least data.train_set)")
        for name in self.testsets:
            try:
                testset_spec(name, self.table)
            except KeyError as error:  # an unknown name: the message lists the known ones
                raise ConfigError(f"data.testsets: {error.args[0]}") from None
        if len(set(self.testsets)) != len(self.testsets):
            raise ConfigError(f"data.testsets lists a testset twice: {list(self.testsets)}")
        if self.train_set not in training_sets():
            raise ConfigError(
                f"data.train_set {self.train_set!r} is not a training set; few-shot pools exist for: "
                f"{', '.join(training_sets())}"
            )
        if self.train_set not in self.testsets:
            raise ConfigError(
                f"data.train_set {self.train_set!r} must also be in data.testsets: it is the in-domain testset"
            )
        if self.eval_cap < 0:
            raise ConfigError(f"data.eval_cap must be >= 0 (0 = no cap), got {self.eval_cap}")
        try:
            check_neutral(self.neutral)
        except ValueError as error:
            raise ConfigError(f"data.{error}") from None
        try:
            check_template(self.template)
        except ValueError as error:
            raise ConfigError(f"data.template: {error}") from None
        if len(self.answers) != 2 or len(set(self.answers)) != 2 or not all(self.answers):
            raise ConfigError(f"data.answers must be two different non-empty words (yes, no), got {list(self.answers)}")


@dataclasses.dataclass(frozen=True)
class IndexedSet(TokenizedSet):
    """A TokenizedSet that knows its prompts' rows in their dataset (``DATASET_INDEX``): what results join on."""

    dataset_index: np.ndarray  # [N] int64


@dataclasses.dataclass(frozen=True)
class RunsData:
    eval_pool: EvalPool  # data.testsets in order, then run r's few-shot set as schema.TRAIN_TESTSET
    first_eval_pool: EvalPool  # the same, each example scored once for all runs: while no adapter adds anything
    train_stream: grain.DatasetIterator | None  # the runs' training steps (train_steps), this process's rows;
    # None: a zero-step run's (oodjax.evaluate)
    dataset_index: tuple[dict[str, np.ndarray], ...]  # run r: each set of eval_pool.labels_of(r) -> IndexedSet's


def dataset_indices(sets: Mapping[str, IndexedSet]) -> dict[str, np.ndarray]:
    """Each set's ``IndexedSet.dataset_index``, by name: what ``RunResults`` stores beside the margins."""
    return {name: tokenized.dataset_index for name, tokenized in sets.items()}


def few_shot_sets(
    data: DataSettings, tokenizer: PreTrainedTokenizerBase, runs: Sequence[tuple[int, int]]
) -> list[IndexedSet]:
    """Each run's tokenised few-shot training set; ``runs`` are (seed, shots) pairs.

    Cheap, so the job's ``BatchGeometry``, which needs their lengths, is known before the testsets are tokenised.
    """
    return [_tokenize(data, dataset, tokenizer) for dataset in few_shot_datasets(data, runs)]


def few_shot_datasets(data: DataSettings, runs: Sequence[tuple[int, int]]) -> list[datasets.Dataset]:
    """Each run's few-shot set, balanced and in its seeded order, untokenised, with its rows in the pool
    (``DATASET_INDEX``); ``runs`` are (seed, shots) pairs."""
    pool = training_pool(data.train_set, split=data.pool_split, data_dir=data.data_dir)
    pool = pool.add_column(DATASET_INDEX, np.arange(len(pool)))
    return [few_shot(pool, shots, seed) for seed, shots in runs]


def load_testsets(data: DataSettings, tokenizer: PreTrainedTokenizerBase) -> dict[str, IndexedSet]:
    """``capped_testsets``, tokenised, in order: what every run of a job is evaluated on."""
    capped = capped_testsets(data)
    return {name: _tokenize_testset(data, name, dataset, tokenizer) for name, dataset in capped.items()}


def capped_testsets(data: DataSettings) -> dict[str, datasets.Dataset]:
    """``data.testsets``, built-in or declared (data.extra_testsets[_file]), each capped (its own cap, else
    data.eval_cap; the in-domain one only with data.cap_in_domain: the analysis controls for its accuracy, which
    a subset makes noisy), in order, with each example's row in the uncapped split (``DATASET_INDEX``)."""
    testsets = {}
    for name in data.testsets:
        dataset = load_testset(name, data_dir=data.data_dir, neutral=data.neutral, table=data.table)
        dataset = dataset.add_column(DATASET_INDEX, np.arange(len(dataset)))
        cap = data.table[name].eval_cap(data.eval_cap) if name != data.train_set or data.cap_in_domain else 0
        testsets[name] = stratified_subset(dataset, cap, seed=data.eval_seed) if cap else dataset
    return testsets


def in_context_sets(
    data: DataSettings, tokenizer: PreTrainedTokenizerBase, runs: Sequence[tuple[int, int]]
) -> tuple[dict[str, np.ndarray], list[dict[str, InContextSet]]]:
    """The testsets' dataset index (``IndexedSet``; every run's), and run r's in-context testsets:
    ``capped_testsets``, each prompt preceded by the demonstrations of run r's few-shot set
    (``few_shot_datasets``) that fit in data.max_length (``oodjax.data.tokenize_in_context``)."""
    testsets = capped_testsets(data)
    zero_shot = {name: _tokenize_testset(data, name, dataset, tokenizer) for name, dataset in testsets.items()}
    prompts: dict[str, Any] = dict(template=data.template, answers=data.answers, max_length=data.max_length)
    per_run = []
    for (seed, shots), demonstrations in zip(runs, few_shot_datasets(data, runs), strict=True):
        sets = {}
        for name, dataset in testsets.items():
            sets[name] = tokenize_in_context(
                dataset, demonstrations, tokenizer, zero_shot=zero_shot[name], cache_dir=data.cache_dir, **prompts
            )
            kept = sets[name].demonstrations
            logging.info(
                "seed %d, %d shots, %s: %.1f demonstrations kept per prompt on average; %d of %d prompts with none",
                seed,
                shots,
                name,
                kept.mean(),
                np.count_nonzero(kept == 0),
                len(kept),
            )
        per_run.append(sets)
    return dataset_indices(zero_shot), per_run


def training_figures(stream: grain.DatasetIterator, geometry: BatchGeometry, *, steps: int) -> dict[str, float]:
    """Draws ``steps`` steps from ``stream`` (made with prefetch 0, so the time is the host's building, not a
    queue's) and measures ``train_real_token_share``, prompt tokens over those the train step computes, and
    ``host_batch_ms``, the mean host time to build one step."""
    real = computed = 0
    seconds = 0.0
    lengths = np.asarray((0, *geometry.micro_batch_lengths))  # per branch; branch 0 skips the micro-batch
    for _ in range(steps):
        start = time.perf_counter()
        batch = next(stream)
        seconds += time.perf_counter() - start
        branches = np.asarray(micro_batch_branches(batch, geometry))
        rows = batch["input_ids"].shape[1]
        computed += int(lengths[branches].sum()) * rows
        real += int(prompt_lengths(batch).sum())
    return {"train_real_token_share": real / computed, "host_batch_ms": 1e3 * seconds / steps}


def _tokenize(data: DataSettings, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase) -> IndexedSet:
    """``dataset`` (with its ``DATASET_INDEX`` column) tokenised."""
    tokenized = tokenize_testset(
        dataset, tokenizer, template=data.template, max_length=data.max_length, cache_dir=data.cache_dir
    )
    return IndexedSet(**vars(tokenized), dataset_index=np.asarray(dataset[DATASET_INDEX][:], dtype=np.int64))


def _tokenize_testset(
    data: DataSettings, name: str, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase
) -> IndexedSet:
    tokenized = _tokenize(data, dataset, tokenizer)
    if tokenized.num_truncated:
        logging.info(
            "%s: %d of %d prompts truncated to %d tokens",
            name,
            tokenized.num_truncated,
            len(tokenized),
            data.max_length,
        )
    return tokenized


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Padding is masked, so any valid id serves; GPT-2's tokenizer has no pad token."""
    return int(next((token for token in (tokenizer.pad_token_id, tokenizer.eos_token_id) if token is not None), 0))
