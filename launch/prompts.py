"""A config's prompts as its job lays them out, counted for the estimate (and evaluated by the preflight).

The real ones (``PromptCounter``: the engine's own set-up on the config's tokenizer and data), or prompts all of
one assumed length (``assumed_geometry``). A testset whose local file is a sample of the hub's split
(``TestsetSpec.hub_rows``) counts at the size a job reading the hub's split evaluates (``study_samples``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import pyarrow.parquet
from jax.sharding import Mesh
from transformers import PreTrainedTokenizerBase

from oodjax.config_read import Job
from oodjax.data import TokenizedSet, load_testset, load_tokenizer, prompt_lengths
from oodjax.data.testsets import default_data_dir, local_path
from oodjax.engine import sharding
from oodjax.engine.evaluation import EvalPool, pool_figures
from oodjax.engine.geometry import BatchGeometry, EvalGeometry, batch_geometry, eval_geometry
from oodjax.engine.run_data import DataSettings, IndexedSet, capped_testsets, load_testsets
from oodjax.engine.setup import set_up
from oodjax.usage_errors import ConfigError


@dataclasses.dataclass(frozen=True)
class AssumedPrompts:
    """Prompts all of `length` tokens (None: data.max_length), evaluated one a row; `eval_examples` None counts
    the testsets."""

    length: int | None = None
    eval_examples: int | None = None


@dataclasses.dataclass(frozen=True)
class RealPrompts:
    """A config's real prompts as its job lays them out (``PromptCounter``), counted with ``tokenizer``."""

    tokenizer: str  # the tokenizer that counted them: the config's own or a stand-in
    geometry: BatchGeometry  # the train step's layout, from the runs' few-shot sets
    eval_rows: Mapping[int, int]  # row length -> rows of it one evaluation computes (every run's lane, empty rows too)
    first_eval_rows: Mapping[int, int]  # the same for step 0's, which scores each example once for all runs
    eval_prompts: int  # prompts one evaluation scores: every run's testsets and its own few-shot set
    eval_prompt_tokens: int  # their tokens
    eval_real_token_share: float  # eval_prompt_tokens over the tokens of eval_rows (``pool_figures``)
    samples: Mapping[str, Sample]  # testsets whose local files are samples: their prompts repeated to the hub's size

    @property
    def mean_length(self) -> float:
        """Tokens of the average prompt an evaluation scores."""
        return self.eval_prompt_tokens / self.eval_prompts


@dataclasses.dataclass(frozen=True)
class Sample:
    """A testset whose local files hold fewer rows than its split on the hub (``TestsetSpec.hub_rows``): a sample
    (the shared data's HANS), standing in for the split a job reads where the hub is reached or the split fetched."""

    local_rows: int  # rows of the local files
    hub_rows: int  # rows of the hub's split
    prompts: int  # what a job reading the hub's split evaluates: the rows the sample keeps, scaled, then capped


def study_samples(data: DataSettings) -> dict[str, Sample]:
    """The testsets of ``data`` whose local files are samples, each with the prompts a job reading the hub's
    split evaluates: the sample's kept rows scaled to the hub's size, then capped."""
    root = pathlib.Path(data.data_dir) if data.data_dir is not None else default_data_dir()
    found = {}
    for name in data.testsets:
        spec = data.table[name]
        parts = spec.split_groups.get(spec.split, (spec.split,))
        if root is None or spec.is_local_file or not all(part in spec.hub_rows for part in parts):
            continue
        try:
            local = sum(_file_rows(local_path(spec, part, root)) for part in parts)
        except FileNotFoundError:  # read from the hub: the whole split
            continue
        hub = sum(spec.hub_rows[part] for part in parts)
        if local >= hub:
            continue
        kept = len(load_testset(name, data_dir=root, neutral=data.neutral, table=data.table))
        prompts, cap = round(kept * hub / local), spec.eval_cap(data.eval_cap)
        found[name] = Sample(local, hub, min(prompts, cap) if cap else prompts)
    return found


def _file_rows(path: pathlib.Path) -> int:
    """Rows of a mirror's file as the data layer reads it: a JSON-lines file's non-blank lines, a parquet file's
    rows."""
    if path.suffix == ".parquet":
        return pyarrow.parquet.ParquetFile(path).metadata.num_rows
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def count_eval_examples(data: DataSettings, samples: Mapping[str, Sample] | None = None) -> int:
    """Examples in one full evaluation: every testset as the engine caps it, a local sample at the hub's size."""
    samples = study_samples(data) if samples is None else samples
    return sum(
        samples[name].prompts if name in samples else len(testset) for name, testset in capped_testsets(data).items()
    )


def study_testsets(
    data: DataSettings, tokenizer: PreTrainedTokenizerBase, samples: Mapping[str, Sample] | None = None
) -> dict[str, IndexedSet]:
    """The testsets a job evaluates, tokenised (``load_testsets``), each local sample's prompts repeated to the
    prompts it counts for (``samples``, default ``study_samples``): the evaluation pool of the hub's splits."""
    samples = study_samples(data) if samples is None else samples
    testsets = load_testsets(data, tokenizer)
    return testsets | {name: _repeated(testsets[name], sample.prompts) for name, sample in samples.items()}


def _repeated(testset: IndexedSet, count: int) -> IndexedSet:
    """``testset``'s prompts in order, again and again, to ``count`` prompts: a sample standing in for its split."""
    order = np.arange(count) % len(testset)
    lengths = np.diff(testset.starts)
    whole, rest = divmod(count, len(testset))
    return dataclasses.replace(
        testset,
        token_ids=np.concatenate([np.tile(testset.token_ids, whole), testset.token_ids[: testset.starts[rest]]]),
        starts=np.concatenate([[0], np.cumsum(lengths[order])]).astype(testset.starts.dtype),
        labels=testset.labels[order],
        truncated=testset.truncated[order],
        dataset_index=testset.dataset_index[order],
    )


def assumed_geometry(job: Job, batch_shards: int, prompt_len: int) -> BatchGeometry:
    """The engine's train step layout for ``job`` when every prompt has ``prompt_len`` tokens; prompts all alike
    lay every step out alike, so one step is replayed rather than train.steps."""
    max_length = job.batches.max_length
    if not 0 < prompt_len <= max_length:
        raise ConfigError(f"prompt length {prompt_len} must be in [1, data.max_length={max_length}]")
    runs = job.runs.runs()
    train_sets = [_prompts_alike(run.shots, prompt_len, max_length) for run in runs]
    return batch_geometry(job.batches, geometry_mesh(batch_shards), train_sets, [run.seed for run in runs], 1)


def _prompts_alike(count: int, length: int, max_length: int) -> TokenizedSet:
    """A tokenised set of ``count`` prompts of ``length`` tokens each."""
    return TokenizedSet(
        token_ids=np.zeros(count * length, dtype=np.int32),
        starts=np.arange(count + 1, dtype=np.int64) * length,
        labels=np.zeros(count, dtype=np.int32),
        truncated=np.zeros(count, dtype=bool),
        max_length=max_length,
    )


def geometry_mesh(shards: int) -> Mesh:
    """A mesh of ``shards`` host CPU devices on its data axis: the batch layout depends only on the batch
    shards, so it can be worked out for devices this machine does not have."""
    cpus = jax.devices("cpu")
    if len(cpus) < shards:
        raise RuntimeError(
            f"laying out batches over {shards} devices takes as many host CPU devices; JAX has {len(cpus)} "
            "(jax_num_cpu_devices is set before JAX starts: `main` does)"
        )
    return sharding.make_mesh(shards, 1, 1, devices=cpus[:shards])


class PromptCounter:
    """Configs' real prompts, counted with ``tokenizer`` when given, else each config's own.

    The engine's own set-up (``run_data.set_up``) lays them out, as the loop and the preflight do. Configs
    with the same tokenizer, data and evaluation batches' shape share one pool.
    """

    def __init__(self, tokenizer: str | None = None) -> None:
        self.tokenizer = tokenizer
        self._load_tokenizer = functools.cache(load_tokenizer)
        # Keyed by (tokenizer, the data settings' repr, the runs' (seed, shots), the evaluation batches' shape):
        # DataSettings holds the testset table's dicts, so its repr stands for it.
        self._pools: dict[tuple[str, str, tuple[tuple[int, int], ...], EvalGeometry], dict[str, Any]] = {}

    def __call__(self, job: Job, mesh: Mapping[str, int]) -> RealPrompts:
        """``job``'s real prompts on a mesh of these axis sizes (resolved)."""
        source = self.tokenizer or job.model.tokenizer
        shards = math.prod(mesh[axis] for axis in sharding.BATCH_AXES)
        runs = tuple((run.seed, run.shots) for run in job.runs.runs())
        pool = (source, repr(job.data), runs, eval_geometry(job.batches, shards))
        samples = None if pool in self._pools else study_samples(job.data)
        testsets = None if samples is None else functools.partial(study_testsets, samples=samples)
        setup = set_up(
            job,
            geometry_mesh(shards),
            job.runs.runs(),
            job.groups[-1].total_steps,  # all runs laid out together, over the longest run's steps
            tokenizer=self._load_tokenizer(source),
            testsets=testsets,
            prefetch=0,
        )
        if setup.data is not None:
            counts = _evaluation_counts(setup.data.eval_pool, setup.data.first_eval_pool)
            self._pools[pool] = {**counts, "samples": samples}
        return RealPrompts(tokenizer=source, geometry=setup.geometry, **self._pools[pool])


def _evaluation_counts(pool: EvalPool, first_pool: EvalPool) -> dict[str, Any]:
    """``RealPrompts``' evaluation fields, read from the batches of ``pool`` and step 0's ``first_pool``."""
    return dict(
        eval_rows=rows_by_length(pool),
        first_eval_rows=rows_by_length(first_pool),
        eval_prompts=sum(int(batch["valid"].sum()) for batch in pool.batches),
        eval_prompt_tokens=sum(int(prompt_lengths(batch).sum()) for batch in pool.batches),
        eval_real_token_share=pool_figures(pool)["eval_real_token_share"],
    )


def rows_by_length(pool: EvalPool) -> dict[int, int]:
    """Row length -> rows of it ``pool``'s batches compute (every lane's, empty rows too)."""
    rows: collections.Counter[int] = collections.Counter()
    for batch in pool.batches:
        length = batch["input_ids"].shape[-1]
        rows[length] += batch["input_ids"].size // length
    return dict(sorted(rows.items()))
