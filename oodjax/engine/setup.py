"""A run group made ready to run: ``prepare`` gives its model split into base and adapters, its compiled steps
and its data, for the loop and ``oodjax.evaluate`` (a zero-step run: evaluated once, at step 0); ``set_up``, its
data alone, is also what the preflight and the estimate lay out, so what they lay out is what a job lays out.
``start_process`` is what the entry points that compute (``oodjax.main``, ``oodjax.evaluate``) do first."""

from __future__ import annotations

import dataclasses
import logging as python_logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import datasets
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh
from transformers import PreTrainedTokenizerBase

from analysis import schema
from oodjax import versions
from oodjax.data import TRAIN_PREFETCH, answer_token_ids, load_tokenizer, train_steps
from oodjax.engine import distributed, sharding, steps
from oodjax.engine.evaluation import make_eval_pool
from oodjax.engine.geometry import BatchGeometry, EvalGeometry, batch_geometry, eval_geometry
from oodjax.engine.run_data import (
    DataSettings,
    IndexedSet,
    RunsData,
    dataset_indices,
    few_shot_sets,
    in_context_sets,
    load_testsets,
    pad_id,
)
from oodjax.models.lora import LoRAConfig, lora_from_peft

if TYPE_CHECKING:
    from oodjax.config_read import Job
    from oodjax.engine.cadence import RunGroup
    from oodjax.engine.results import Run


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What ``set_up`` gives: everything a job's runs need before its model does."""

    tokenizer: PreTrainedTokenizerBase
    answer_ids: tuple[int, int]  # the (entailment, not entailment) answer words' token ids
    geometry: BatchGeometry
    data: RunsData | None  # None: no testsets asked for


def set_up(
    job: Job,
    mesh: Mesh,
    runs: Sequence[Run],
    total_steps: int,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    testsets: Callable[[DataSettings, PreTrainedTokenizerBase], Mapping[str, IndexedSet]] | None = load_testsets,
    prefetch: int = TRAIN_PREFETCH,
) -> RunSetup:
    """The set-up of ``runs`` training ``total_steps`` together on ``mesh`` (a ``RunGroup``'s); ``testsets``
    None gives no ``RunsData`` (the estimate's, counting a pool it has), and ``prefetch`` steps are built ahead
    in a background thread."""
    tokenizer = load_tokenizer(job.model.tokenizer) if tokenizer is None else tokenizer
    answer_ids = answer_token_ids(tokenizer, job.data.answers)
    seeds = [run.seed for run in runs]
    train_sets = few_shot_sets(job.data, tokenizer, [(run.seed, run.shots) for run in runs])
    geometry = batch_geometry(job.batches, mesh, train_sets, seeds, total_steps)
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
    own = [{schema.TRAIN_TESTSET: tokenized} for tokenized in train_sets]
    index = [{**dataset_indices(evaluated), schema.TRAIN_TESTSET: tokenized.dataset_index} for tokenized in train_sets]
    assert geometry.evaluation is not None  # batch_geometry gives the job's evaluation batches
    data = _runs_data(evaluated, own, index, geometry.evaluation, tokenizer, train_stream)
    return RunSetup(tokenizer, answer_ids, geometry, data)


def _runs_data(
    shared: Mapping[str, IndexedSet],
    own: Sequence[Mapping[str, IndexedSet]],
    index: Sequence[dict[str, np.ndarray]],
    layout: EvalGeometry,
    tokenizer: PreTrainedTokenizerBase,
    train_stream: grain.DatasetIterator | None,
) -> RunsData:
    """The pool of the sets every run scores and each run's own, in ``layout``'s batches. Runs that train also
    get step 0's pool (``make_eval_pool``'s ``like``); a zero-step run's adapters may be loaded, so it has one."""
    batches = dict(
        batch_tokens=layout.batch_tokens,
        row_multiple=layout.batch_shards,
        row_lengths=layout.row_lengths,
        pad_id=pad_id(tokenizer),
    )
    pool = make_eval_pool(shared, own, **batches)
    first = pool if train_stream is None else make_eval_pool(shared, own, like=pool, **batches)
    return RunsData(pool, first_eval_pool=first, train_stream=train_stream, dataset_index=tuple(index))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A run group ready to run: the model split into its frozen base and the runs' stacked adapters
    (``TrainState``), its compiled steps and its data."""

    base_state: nnx.State
    state: steps.TrainState  # the runs' adapters, optimizer state and dropout keys
    train_step: Callable[..., Any] | None  # None: a zero-step run
    eval_step: Callable[..., Any]
    data: RunsData
    geometry: BatchGeometry | None  # the training batches' (None: a zero-step run)
    mesh: Mesh


def prepare(
    job: Job,
    group: RunGroup,
    mesh: Mesh,
    model: nnx.Module,
    *,
    lora: LoRAConfig | None = None,
    adapters: Sequence[tuple[str, Mapping[str, Any]]] = (),
) -> Prepared:
    """``group`` on ``mesh``, its adapters attached to ``model`` (in place; ``lora``, default the job's) from
    each run's keys (``RunPlan.key_seed``), or loaded from ``adapters`` ((folder, PEFT tensors) a run).

    A group of runs that train gets its few-shot sets' training stream and evaluation pool (each run's own
    set beside the testsets). A zero-step run (``oodjax.evaluate``) trains nothing: its pool is the testsets,
    or with eval.in_context each run's copy of them preceded by its few-shot set's demonstrations.
    """
    seeds, optimizer = [job.runs.key_seed(run) for run in group.runs], group.optimizer
    transformation = optimizer.transformation if optimizer is not None else optax.identity()  # zero steps: no state
    graphdef, base_state, state = steps.attach_runs(model, seeds, lora or job.lora, transformation, mesh=mesh)
    if adapters:
        template = nnx.state(model, nnx.LoRAParam)
        loaded = [lora_from_peft(template, tensors, source=folder) for folder, tensors in adapters]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *loaded)
        state = state.replace(lora=sharding.place(stacked, sharding.runs_shardings(stacked, mesh)))
    compute_dtype = job.model.compute_dtype
    if optimizer is not None:
        setup = set_up(job, mesh, group.runs, group.total_steps)
        train_step, eval_step = steps.make_steps(
            optimizer, compute_dtype, setup.geometry, graphdef, base_state, state, *setup.answer_ids, mesh
        )
        return Prepared(base_state, state, train_step, eval_step, setup.data, setup.geometry, mesh)
    tokenizer = load_tokenizer(job.model.tokenizer)
    if job.in_context:  # each run scores its own in-context copy of the testsets
        shared: Mapping[str, IndexedSet] = {}
        index, own = in_context_sets(job.data, tokenizer, [(run.seed, run.shots) for run in group.runs])
    else:
        shared, own = load_testsets(job.data, tokenizer), [{} for _ in group.runs]
        index = dataset_indices(shared)
    layout = eval_geometry(job.batches, sharding.batch_shards(mesh))
    data = _runs_data(shared, own, [index] * len(group.runs), layout, tokenizer, None)
    answers = answer_token_ids(tokenizer, job.data.answers)
    eval_step = steps.make_eval_step(graphdef, *answers, mesh=mesh, compute_dtype=compute_dtype)
    return Prepared(base_state, state, None, eval_step, data, None, mesh)


class _QuietCheckpointing(python_logging.Filter):
    """Drops orbax's INFO chatter (dozens of lines per checkpoint), so the run's own log stays readable."""

    def filter(self, record: python_logging.LogRecord) -> bool:
        return record.levelno >= python_logging.WARNING or "/orbax/" not in record.pathname


def start_process() -> None:
    """What every entry point that computes does first: quiet the libraries' logs, join the job's other
    processes (before anything touches a device), and leave INFO logging to process 0."""
    logging.get_absl_handler().addFilter(_QuietCheckpointing())
    # No noise by default: JAX's INFO line for every backend it could not start
    # ("Unable to initialize backend 'tpu'"), and datasets' bars per split read.
    python_logging.getLogger("jax._src.xla_bridge").setLevel(python_logging.WARNING)
    datasets.disable_progress_bars()
    layout = distributed.initialize()  # before anything touches a device
    if layout is not None:
        logging.info("process %d of %d (layout from %s)", layout.process_id, layout.num_processes, layout.source)
        if not distributed.is_primary():
            logging.set_verbosity(logging.WARNING)  # process 0 logs progress; the others only problems
    versions.warn_if_unpinned()
