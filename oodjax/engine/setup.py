"""A run group made ready to run: its model split into base and adapters, its compiled steps and its data, by
``prepare_training`` for the loop or ``prepare_evaluation`` for ``oodjax.evaluate`` (a zero-step run: evaluated
once, at step 0), over one attach step (``attach_training``, ``attach_evaluation``); ``set_up``, its data alone, is
also what the preflight and the estimate lay out, so what they lay out is what a job lays out.
``start_process`` is what the entry points that compute (``oodjax.main``, ``oodjax.evaluate``) do first."""

from __future__ import annotations

import dataclasses
import functools
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
from oodjax.data import TRAIN_PREFETCH, TokenizedSet, answer_token_ids, load_tokenizer, train_steps
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
    shared: Mapping[str, TokenizedSet],
    own: Sequence[Mapping[str, TokenizedSet]],
    index: Sequence[dict[str, np.ndarray]],
    layout: EvalGeometry,
    tokenizer: PreTrainedTokenizerBase,
    train_stream: grain.DatasetIterator | None,
) -> RunsData:
    """The pool of the sets every run scores and each run's own, in ``layout``'s batches. Runs that train also
    get step 0's pool (``make_eval_pool``'s ``like``); a zero-step run's adapters may be loaded, so it has one."""
    batches = functools.partial(
        make_eval_pool,
        shared,
        own,
        batch_tokens=layout.batch_tokens,
        row_multiple=layout.batch_shards,
        row_lengths=layout.row_lengths,
        pad_id=pad_id(tokenizer),
    )
    pool = batches()
    first = pool if train_stream is None else batches(like=pool)
    return RunsData(pool, first_eval_pool=first, train_stream=train_stream, dataset_index=tuple(index))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Runs ready to evaluate: the model split into its frozen base and the runs' stacked adapters
    (``TrainState``), its compiled eval step and its data."""

    base_state: nnx.State
    state: steps.TrainState  # the runs' adapters, optimizer state and dropout keys
    eval_step: Callable[..., Any]
    data: RunsData
    mesh: Mesh


@dataclasses.dataclass(frozen=True)
class PreparedTraining(Prepared):
    """A run group ready to train: ``Prepared`` with its train step, its batches' geometry and their stream."""

    train_step: Callable[..., Any]
    geometry: BatchGeometry
    train_stream: grain.DatasetIterator  # this process's rows of the training steps (``data.train_stream``)


def _attach(
    job: Job, group: RunGroup, mesh: Mesh, model: nnx.Module, lora: LoRAConfig, optimizer: optax.GradientTransformation
) -> tuple[nnx.GraphDef, nnx.State, steps.TrainState]:
    """What both ways share: ``group``'s adapters attached to ``model`` (in place) from each run's keys
    (``RunPlan.key_seed``), ``optimizer``'s state beside them."""
    seeds = [job.runs.key_seed(run) for run in group.runs]
    return steps.attach_runs(model, seeds, lora, optimizer, mesh=mesh)


def prepare_training(job: Job, group: RunGroup, mesh: Mesh, model: nnx.Module) -> PreparedTraining:
    """``group`` on ``mesh``, ready to train: its few-shot sets' training stream and an evaluation pool of each
    run's own set beside the testsets."""
    setup = set_up(job, mesh, group.runs, group.total_steps)
    data = setup.data
    assert data is not None and data.train_stream is not None  # set_up's testsets, with training
    base_state, state, train, evaluate = attach_training(job, group, mesh, model, setup.geometry, setup.answer_ids)
    return PreparedTraining(base_state, state, evaluate, data, mesh, train, setup.geometry, data.train_stream)


def attach_training(
    job: Job, group: RunGroup, mesh: Mesh, model: nnx.Module, geometry: BatchGeometry, answer_ids: tuple[int, int]
) -> tuple[nnx.State, steps.TrainState, Callable[..., Any], Callable[..., Any]]:
    """``group`` attached (``_attach``) and its (train, eval) steps made for ``geometry``: also the benchmarks'
    contenders' set-up, whose steps hold rows they choose (laid out by them)."""
    assert group.optimizer is not None  # only a zero-step group has none
    graphdef, base_state, state = _attach(job, group, mesh, model, job.lora, group.optimizer.transformation)
    train_step, eval_step = steps.make_steps(
        group.optimizer, job.model.compute_dtype, geometry, graphdef, base_state, state, *answer_ids, mesh
    )
    return base_state, state, train_step, eval_step


def prepare_evaluation(
    job: Job,
    group: RunGroup,
    mesh: Mesh,
    model: nnx.Module,
    lora: LoRAConfig,
    adapters: Sequence[tuple[str, dict[str, np.ndarray]]] = (),
) -> Prepared:
    """A zero-step ``group`` (``oodjax.evaluate``) on ``mesh``, adapters of ``lora`` attached to ``model`` (in
    place), or loaded from ``adapters`` ((folder, PEFT tensors) a run). Its pool is the testsets, or with
    eval.in_context each run's copy of them preceded by its few-shot set's demonstrations."""
    tokenizer = load_tokenizer(job.model.tokenizer)
    answers = answer_token_ids(tokenizer, job.data.answers)
    base_state, state, eval_step = attach_evaluation(job, group, mesh, model, lora, answers)
    if adapters:
        template = nnx.state(model, nnx.LoRAParam)
        loaded = [lora_from_peft(template, tensors, source=folder) for folder, tensors in adapters]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *loaded)
        state = dataclasses.replace(state, lora=sharding.place(stacked, sharding.runs_shardings(stacked, mesh)))
    if job.in_context:  # each run scores its own in-context copy of the testsets
        shared: Mapping[str, IndexedSet] = {}
        index, own = in_context_sets(job.data, tokenizer, [(run.seed, run.shots) for run in group.runs])
    else:
        shared, own = load_testsets(job.data, tokenizer), [{} for _ in group.runs]
        index = dataset_indices(shared)
    layout = eval_geometry(job.batches, sharding.batch_shards(mesh))
    data = _runs_data(shared, own, [index] * len(group.runs), layout, tokenizer, None)
    return Prepared(base_state, state, eval_step, data, mesh)


def attach_evaluation(
    job: Job, group: RunGroup, mesh: Mesh, model: nnx.Module, lora: LoRAConfig, answer_ids: tuple[int, int]
) -> tuple[nnx.State, steps.TrainState, Callable[..., Any]]:
    """``group``'s adapters of ``lora`` attached (``_attach``, no optimizer state) and its eval step: also the
    benchmarks' evaluation contender's, which scores a pool of its own."""
    graphdef, base_state, state = _attach(job, group, mesh, model, lora, optax.identity())
    compute_dtype = jnp.dtype(job.model.compute_dtype) if job.model.compute_dtype else None
    return base_state, state, steps.make_eval_step(graphdef, *answer_ids, mesh=mesh, compute_dtype=compute_dtype)


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
