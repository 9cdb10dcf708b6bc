"""`python -m oodjax.evaluate --config configs/X.py [--config.model.adapters=DIR,... | --config.eval.in_context]`.

Evaluation, no training; also the `oodjax-evaluate` command. It takes the
configs and overrides `oodjax.main` takes and writes, for each run it
evaluates, the usual `<output_dir>/<run>/metrics.npz` (and results.json)
with one evaluation, at step 0, so `python -m analysis` and `python -m
analysis.runs` read it like any other; its run section's `evaluated`
(`schema.RUN_EVALUATED`: base, adapter or in_context) tells it from a
trained run. What is evaluated, on `data.testsets`:

- without `model.adapters`: the base model itself, as one run named
  `<model>_<train_set>_base` (seed 0, shots 0 in its run section);
- with `model.adapters`, a list of PEFT LoRA adapter folders (written by
  `export.peft`, or by peft's `save_pretrained`): each adapter as its own
  run, all evaluated together on one copy of the base. An adapter that
  `export.peft` wrote into `<run_dir>/adapter/` keeps that run's name, seed
  and shots (read from the run's metrics.npz); any other is named after its
  folder, with its position in the list as its seed and shots 0;
- with `eval.in_context`, the in-context-learning baseline: each (seed,
  shots) of `runs.seeds` x `runs.shots` is a run of the base model named as
  a trained run of model `<model>-icl` (its run section's model, so the
  analysis groups it apart), in which every test prompt is preceded by the
  few-shot set that run would train on (same seed, balanced, in its drawn
  order) as demonstrations, each the template with its answer word filled
  in (`oodjax.data.tokenize_in_context`). Prompts over data.max_length lose
  whole demonstrations from the front, never the test prompt.

The adapters of one call must share rank, alpha and targets, since they are
stacked like the runs of a training job; the runs of the other two kinds
all have a zero adapter, the base model's own outputs. A run whose
metrics.npz exists already is skipped, so an interrupted call resumes and
nothing written is lost. Each run is locked while it is evaluated, as a
training job locks its runs (``oodjax.engine.run_lock``), and a model whose
outputs are not finite (NaN or infinite margins on every testset of every
run) is refused with one line, nothing written.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx
from ml_collections import config_dict

from analysis import schema
from oodjax import config_cli
from oodjax.config_checks import check_config
from oodjax.config_read import Job
from oodjax.engine import results, run_data, run_lock, sharding, steps
from oodjax.engine.distributed import is_primary
from oodjax.engine.evaluation import evaluate, make_eval_pool, refuse_non_finite_model
from oodjax.engine.geometry import eval_geometry
from oodjax.engine.setup import set_up
from oodjax.main import start_process
from oodjax.models.lora import LoRAConfig, apply_lora, lora_from_peft, read_peft
from oodjax.models.partitioning import param_shardings
from oodjax.usage_errors import ConfigError

BASE_RUN_SUFFIX = "base"
IN_CONTEXT_SUFFIX = "-icl"  # of the model name of in-context runs: the analysis groups them apart


@dataclasses.dataclass(frozen=True)
class EvaluatedRun:
    """One model (the base, the base with one adapter, or the base in context) evaluated as a run."""

    name: str
    model: str  # its run section's model: the config's, or "<model>-icl" in context
    seed: int
    shots: int
    directory: pathlib.Path
    adapter: pathlib.Path | None  # None: the base model alone (or in context)


def plan_evaluation(job: Job) -> list[EvaluatedRun]:
    """The runs ``evaluate_job`` evaluates: the base model, one per adapter folder, or one per (seed, shots)
    in context (see the module)."""
    model, train_set, output = job.model.name, job.data.train_set, job.runs.output_dir
    if job.in_context:
        model = f"{model}{IN_CONTEXT_SUFFIX}"
        planned = []
        for run in job.runs.runs():  # the grid training would run, in its order
            name = results.run_name(model, train_set, run.seed, run.shots)
            planned.append(EvaluatedRun(name, model, run.seed, run.shots, output / name, None))
        return planned
    if not job.adapters:
        name = f"{results.path_safe(model)}_{train_set}_{BASE_RUN_SUFFIX}"
        return [EvaluatedRun(name, model, 0, 0, output / name, None)]
    planned = []
    for index, folder in enumerate(job.adapters):
        identity = _trained_run_identity(folder)
        if identity is not None:
            seed, shots = identity
            name = results.run_name(model, train_set, seed, shots)
        else:
            seed, shots = index, 0
            name = f"{results.path_safe(model)}_{train_set}_{results.path_safe(folder.name)}"
        planned.append(EvaluatedRun(name, model, seed, shots, output / name, folder))
    names = [run.name for run in planned]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"model.adapters: two adapters would both be evaluated as {repeated}; rename a folder")
    return planned


def evaluate_job(job: Job) -> list[EvaluatedRun]:
    """Evaluates the config's base model, adapters or in-context runs (``plan_evaluation``) and writes their
    metrics.npz; returns its runs (those locked by another job left out, with runs.skip_locked).

    Each run is locked while it is evaluated, as training locks its runs.
    """
    with run_lock.locked_runs(plan_evaluation(job), skip_locked=job.runs.skip_locked) as planned:
        job.log_config()
        todo = [run for run in planned if not (run.directory / schema.METRICS_FILENAME).exists()]
        for run in planned:
            if run not in todo:
                logging.info("%s: evaluated already (%s), skipped", run.name, run.directory / schema.METRICS_FILENAME)
        if todo:
            _evaluate_runs(job, todo)
    return planned


def _evaluate_runs(job: Job, todo: list[EvaluatedRun]) -> None:
    """Evaluates ``todo`` together on one copy of the base and writes each run's metrics.npz."""
    adapters = [read_peft(run.adapter) for run in todo if run.adapter is not None]
    lora_cfg = _shared_adapter_config(adapters, [run.adapter for run in todo if run.adapter is not None])

    mesh = job.mesh.make()
    setup = set_up(job, mesh, runs=())  # nothing trains: the tokenizer and answer ids
    tokenizer, (yes_id, no_id) = setup.tokenizer, setup.answer_ids
    model = job.model.load(mesh)
    apply_lora(model, lora_cfg, rngs=nnx.Rngs(0))  # B = 0: the base model's own outputs, exactly
    fresh = nnx.state(model, nnx.LoRAParam)
    per_run = [
        lora_from_peft(fresh, tensors, source=str(run.adapter)) if run.adapter is not None else fresh
        for run, (_, tensors) in zip(todo, adapters or [(None, None)] * len(todo), strict=True)
    ]
    graphdef, _, base_state = nnx.split(model, nnx.LoRAParam, ...)
    base_state = sharding.place(base_state, param_shardings(base_state, mesh))
    lora = jax.tree.map(lambda *xs: jnp.stack(xs), *per_run)
    lora = sharding.place(lora, sharding.runs_shardings(lora, mesh))

    if job.in_context:  # each run scores its own in-context copy of the testsets
        shared = {}
        dataset_index, own = run_data.in_context_sets(job.data, tokenizer, [(run.seed, run.shots) for run in todo])
    else:
        shared, own = run_data.load_testsets(job.data, tokenizer), [{} for _ in todo]
        dataset_index = run_data.dataset_indices(shared)
    layout = eval_geometry(job.batches, sharding.batch_shards(mesh))
    pool = make_eval_pool(
        shared,
        own,
        batch_tokens=layout.batch_tokens,
        row_multiple=layout.batch_shards,
        pad_id=run_data.pad_id(tokenizer),
        row_lengths=layout.row_lengths,
    )
    eval_step = steps.make_eval_step(graphdef, yes_id, no_id, mesh=mesh, compute_dtype=job.model.compute_dtype)
    evaluation_start = time.perf_counter()
    margins = evaluate(
        eval_step, base_state, lora, pool, place=lambda batch: sharding.shard_batch(batch, mesh, batch_axis=1)
    )
    evaluation_seconds = time.perf_counter() - evaluation_start
    evaluated = []
    for r, run in enumerate(todo):
        kind = (
            schema.EVALUATED_IN_CONTEXT
            if job.in_context
            else schema.EVALUATED_ADAPTER
            if run.adapter is not None
            else schema.EVALUATED_BASE
        )
        identity = {
            schema.RUN_MODEL: run.model,
            schema.RUN_SEED: run.seed,
            schema.RUN_SHOTS: run.shots,
            schema.RUN_EVALUATED: kind,
        }
        run_results = results.RunResults(
            run.directory,
            labels=pool.labels_of(r),
            dataset_index=dataset_index,
            in_domain=job.data.train_set,
            config=dict(job.record, **{schema.RUN_SECTION: identity}),
        )
        evaluated.append(
            (run, run_results, run_results.add(0, margins[r], float("nan"), evaluation_seconds=evaluation_seconds))
        )
    base = job.model.source
    refuse_non_finite_model(
        f"{base} with its adapters" if adapters else base, [accuracies for _, _, accuracies in evaluated]
    )
    for run, run_results, accuracies in evaluated:
        if is_primary():
            run_results.write()
        logging.info("%s: %s", run.name, ", ".join(f"{name} {value:.3f}" for name, value in accuracies.items()))
    logging.info("done: %d runs evaluated; results in %s", len(todo), job.runs.output_dir)


def _shared_adapter_config(adapters: Sequence[tuple[LoRAConfig, Any]], folders: Sequence[pathlib.Path]) -> LoRAConfig:
    """The one LoRAConfig of every adapter (dropout aside); the base model alone gets a rank-1 zero adapter."""
    if not adapters:
        return LoRAConfig(rank=1, alpha=1.0, dropout=0.0)
    first = adapters[0][0]
    for (cfg, _), folder in zip(adapters, folders, strict=True):
        if (cfg.rank, cfg.alpha, cfg.targets) != (first.rank, first.alpha, first.targets):
            raise ConfigError(
                f"model.adapters: {folder} has rank {cfg.rank}, alpha {cfg.alpha}, targets {list(cfg.targets)} but "
                f"{folders[0]} has rank {first.rank}, alpha {first.alpha}, targets {list(first.targets)}; adapters "
                "evaluated together must agree (evaluate the others in a call of their own)"
            )
    return dataclasses.replace(first, dropout=0.0)


def _trained_run_identity(adapter: pathlib.Path) -> tuple[int, int] | None:
    """(seed, shots) of the oodjax run whose `<run_dir>/adapter/` this is, read from its metrics.npz; else None."""
    if adapter.name != results.ADAPTER_DIR:
        return None
    progress = results.read_progress(adapter.parent)
    if progress is None:
        return None
    section = progress.config.get(schema.RUN_SECTION, {})
    return int(section[schema.RUN_SEED]), int(section[schema.RUN_SHOTS])


def main(config: config_dict.ConfigDict) -> None:
    """Evaluates `config` (the command line's, its overrides applied) on this process's share of the devices."""
    start_process()
    evaluate_job(check_config(config, evaluation=True))


def run() -> None:
    """Entry point of `python -m oodjax.evaluate` and the `oodjax-evaluate` command; parses sys.argv."""
    config_cli.run(main, __doc__)


if __name__ == "__main__":
    run()
