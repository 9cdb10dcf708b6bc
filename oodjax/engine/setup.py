"""A job's set-up (tokenizer, answer ids, few-shot sets, geometry, data), one function for the loop,
``oodjax.evaluate``, the preflight and the estimate: what they lay out is what a job lays out."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from jax.sharding import Mesh
from transformers import PreTrainedTokenizerBase

from analysis import schema
from oodjax.data import TRAIN_PREFETCH, answer_token_ids, load_tokenizer, train_steps
from oodjax.engine.evaluation import make_eval_pool
from oodjax.engine.geometry import BatchGeometry, batch_geometry
from oodjax.engine.run_data import (
    DataSettings,
    IndexedSet,
    RunsData,
    dataset_indices,
    few_shot_sets,
    load_testsets,
    pad_id,
)

if TYPE_CHECKING:
    from oodjax.config_read import Job
    from oodjax.engine.results import Run


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What ``set_up`` gives: everything a job's runs need before its model does."""

    tokenizer: PreTrainedTokenizerBase
    answer_ids: tuple[int, int]  # the (entailment, not entailment) answer words' token ids
    geometry: BatchGeometry | None  # None: no runs
    data: RunsData | None  # None: no runs, or no testsets asked for


def set_up(
    job: Job,
    mesh: Mesh,
    runs: Sequence[Run] | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    testsets: Callable[[DataSettings, PreTrainedTokenizerBase], Mapping[str, IndexedSet]] | None = load_testsets,
    prefetch: int = TRAIN_PREFETCH,
) -> RunSetup:
    """The set-up of ``runs`` (default: the job's; none: the tokenizer and answer ids alone) on ``mesh``;
    ``testsets`` None gives no ``RunsData``, and ``prefetch`` steps are built ahead in a background thread."""
    tokenizer = load_tokenizer(job.model.tokenizer) if tokenizer is None else tokenizer
    answer_ids = answer_token_ids(tokenizer, job.data.answers)
    runs = job.runs.runs() if runs is None else runs
    if not runs:
        return RunSetup(tokenizer, answer_ids, None, None)
    seeds = [run.seed for run in runs]
    train_sets = few_shot_sets(job.data, tokenizer, [(run.seed, run.shots) for run in runs])
    geometry = batch_geometry(job.batches, mesh, train_sets, seeds)
    if testsets is None:
        return RunSetup(tokenizer, answer_ids, geometry, None)
    evaluated = testsets(job.data, tokenizer)
    train_stream = train_steps(
        train_sets,
        seeds,
        batch_size=geometry.batch_size,
        layout=geometry.layout,
        seq_len=geometry.seq_len,
        prompts_per_row=geometry.prompts_per_row,
        rows=geometry.process_rows,
        pad_id=pad_id(tokenizer),
        prefetch=prefetch,
    )
    assert geometry.evaluation is not None  # batch_geometry gives the job's evaluation batches
    pool = functools.partial(
        make_eval_pool,
        evaluated,
        [{schema.TRAIN_TESTSET: tokenized} for tokenized in train_sets],
        batch_tokens=geometry.evaluation.batch_tokens,
        row_multiple=geometry.evaluation.batch_shards,
        pad_id=pad_id(tokenizer),
        row_lengths=geometry.evaluation.row_lengths,
    )
    eval_pool = pool()
    dataset_index = tuple(
        {**dataset_indices(evaluated), schema.TRAIN_TESTSET: train_set.dataset_index} for train_set in train_sets
    )
    data = RunsData(
        eval_pool, first_eval_pool=pool(like=eval_pool), train_stream=train_stream, dataset_index=dataset_index
    )
    return RunSetup(tokenizer, answer_ids, geometry, data)
