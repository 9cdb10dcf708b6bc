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
from collections.abc import Sequence
from typing import Any

from absl import logging
from ml_collections import config_dict

from analysis import schema
from oodjax import config_cli
from oodjax.config_checks import check_config
from oodjax.config_read import Job
from oodjax.engine import hooks, results, run_lock
from oodjax.engine.cadence import RunGroup
from oodjax.engine.loop import Trainer
from oodjax.engine.results import Run
from oodjax.engine.setup import prepare_evaluation, start_process
from oodjax.models.lora import LoRAConfig, read_peft
from oodjax.usage_errors import ConfigError

BASE_RUN_SUFFIX = "base"
IN_CONTEXT_SUFFIX = "-icl"  # of the model name of in-context runs: the analysis groups them apart


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvaluatedRun(Run):
    """One model (the base, the base with one adapter, or the base in context) evaluated as a run."""

    model: str  # its run section's model: the config's, or "<model>-icl" in context
    adapter: pathlib.Path | None  # None: the base model alone (or in context)


def plan_evaluation(job: Job) -> list[EvaluatedRun]:
    """The runs ``evaluate_job`` evaluates: the base model, one per adapter folder, or one per (seed, shots)
    in context (see the module)."""
    train_set, output = job.data.train_set, job.runs.output_dir
    model = f"{job.model.name}{IN_CONTEXT_SUFFIX}" if job.in_context else job.model.name

    def planned_run(seed: int, shots: int, adapter: pathlib.Path | None, suffix: str | None = None) -> EvaluatedRun:
        """Named as a trained run of its seed and shots, or by its name's ``suffix``."""
        if suffix is None:
            name = results.run_name(model, train_set, seed, shots)
        else:
            name = f"{results.path_safe(model)}_{train_set}_{suffix}"
        return EvaluatedRun(seed, shots, name, output / name, model=model, adapter=adapter)

    if job.in_context:  # the grid training would run, in its order
        return [planned_run(run.seed, run.shots, None) for run in job.runs.runs()]
    if not job.adapters:
        return [planned_run(0, 0, None, BASE_RUN_SUFFIX)]
    planned = []
    for index, folder in enumerate(job.adapters):
        identity = _trained_run_identity(folder)
        suffix = None if identity else results.path_safe(folder.name)
        planned.append(planned_run(*(identity or (index, 0)), folder, suffix))
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
    """Evaluates ``todo`` together on one copy of the base, as a zero-step run: a trainer of no steps with the
    evaluation hook alone, which evaluates step 0 and writes each run's metrics.npz."""
    adapters = [(run.adapter, read_peft(run.adapter)) for run in todo if run.adapter is not None]
    lora = _shared_adapter_config([peft for _, peft in adapters], [folder for folder, _ in adapters])
    mesh = job.mesh.make()
    group = RunGroup(total_steps=0, runs=tuple(todo), optimizer=None, cadence=job.cadence.build(0))
    loaded = [(str(folder), tensors) for folder, (_, tensors) in adapters]
    prepared = prepare_evaluation(job, group, mesh, job.model.load(mesh), lora, loaded)
    records = [
        hooks.run_record(job.record, run, run.model, **{schema.RUN_EVALUATED: _evaluated(job, run)}) for run in todo
    ]
    model = f"{job.model.source} with its adapters" if adapters else job.model.source
    trainer = Trainer(prepared, prepared.state, start=0, total_steps=0)
    trainer.add_hook(hooks.Evaluation(prepared, group, records, model, job.data.train_set))
    trainer.run()
    logging.info("done: %d runs evaluated; results in %s", len(todo), job.runs.output_dir)


def _evaluated(job: Job, run: EvaluatedRun) -> str:
    """What an evaluated run is, in its run section (``schema.RUN_EVALUATED``): base, adapter or in context."""
    if job.in_context:
        return schema.EVALUATED_IN_CONTEXT
    return schema.EVALUATED_ADAPTER if run.adapter is not None else schema.EVALUATED_BASE


def _shared_adapter_config(adapters: Sequence[tuple[LoRAConfig, Any]], folders: Sequence[pathlib.Path]) -> LoRAConfig:
    """The one LoRAConfig of every adapter (dropout aside); the base model alone gets a rank-1 zero adapter."""
    if not adapters:
        return LoRAConfig(rank=1, alpha=1.0, dropout=0.0)
    first = adapters[0][0]
    for (cfg, _), folder in zip(adapters, folders, strict=True):
        if (cfg.rank, cfg.alpha, cfg.targets) != (first.rank, first.alpha, first.targets):
            raise ConfigError(
                f"model.adapters: {folder} has rank {cfg.rank}, alpha {cfg.alpha}, targets {list(cfg.targets or ())} "
                f"but {folders[0]} has rank {first.rank}, alpha {first.alpha}, targets {list(first.targets or ())}; "
                "adapters evaluated together must agree (evaluate the others in a call of their own)"
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
