"""The run loop: train a config's runs, evaluate them as they go, keep everything, resume run by run.

`train(job)` loads the model once, attaches one set of adapters per run
(seeds x shots), and trains them step by step (a ``Trainer``), each step
handed to the hooks added to it (``oodjax.engine.hooks``), which keep their
own state and apply their own rule of ``cadence.Cadence``: the losses' check
and log, a stop, evaluation, checkpoint, export.

Runs are the unit of resumption (``oodjax.engine.resumption``). Runs train
in lockstep, so the unfinished ones are trained in groups of one length
(the job's ``RunGroup``) and one resume step, each group with its own cadence,
schedule, geometry and compiled steps; each run ends with the results an
uninterrupted run would have written (to float32 rounding where its group's
size differs). A job locks its runs before it reads where they stand
(``oodjax.engine.run_lock``), so a second job on them writes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from absl import logging

from analysis import schema
from oodjax import models
from oodjax.data import TRAIN_KEYS
from oodjax.engine import checkpoints, console, hooks, resumption, run_lock, sharding, steps
from oodjax.engine.distributed import is_primary, lost_peer
from oodjax.engine.events import EventLog
from oodjax.engine.hooks import Checkpoints, Clock, Evaluation, Hook, NonFiniteLossError, StepInfo, Stopping
from oodjax.engine.preemption import StopSignals
from oodjax.engine.results import Run
from oodjax.engine.resumption import RunStart, read_start, refuse_changed_config, set_aside_damaged
from oodjax.engine.setup import Prepared, PreparedTraining, prepare_training

__all__ = ["NonFiniteLossError", "Trainer", "train"]  # what a caller of train catches, the trainer, and train

if TYPE_CHECKING:
    from oodjax.config_read import Job


def train(job: Job) -> list[Run]:
    """Trains and evaluates the job's unfinished runs, each from its newest intact checkpoint; returns all its
    runs (less those another job locks, with runs.skip_locked)."""
    with run_lock.locked_runs(job.runs.runs(), skip_locked=job.runs.skip_locked) as runs:
        job.log_config()
        output_dir = job.runs.output_dir
        resumption.warn_of_shared_checkpoints(output_dir)
        group_of = {run: group for group in job.groups for run in group.runs}
        starts = [read_start(group_of[run], run) for run in runs]
        # before anything is written (the locks' new folders go with them)
        refuse_changed_config(job.record, job.settings, output_dir, starts)
        where = [start.describe() for start in starts]
        logging.info("%s", console.by_run(f"{len(runs)} runs in {output_dir}", runs, where))
        to_train = [start for start in starts if not start.finished]
        to_export = [start for start in starts if start.finished and job.export.peft]
        if to_train or to_export:
            with StopSignals() as stop:
                _train_runs(job, to_train, to_export, stop)
        if is_primary():
            _summary(job, starts)
    return runs


def _train_runs(job: Job, to_train: list[RunStart], to_export: list[RunStart], stop: StopSignals) -> None:
    """Loads the model once, restores every run's checkpoint, then trains the runs group by group (one resume
    step and one length each, the furthest along first) and exports the finished runs' adapters if asked."""
    mesh = job.mesh.make()
    model = job.model.load(mesh)
    resumed = [start for start in to_train if start.checkpoint is not None] + to_export
    if resumed and (optimizer := resumed[0].group.optimizer) is not None:  # groups that train have one
        # its state's structure is every length's
        _, _, one_run = steps.attach_runs(model, [0], job.lora, optimizer.transformation, mesh=mesh)
        target = checkpoints.run_target(one_run)
        del one_run
        for start in resumed:
            start.checkpoint = checkpoints.restore_newest(start.run.directory, target)
        set_aside_damaged(resumed)
    for start in to_export:
        _export_finished(job, start)
    groups = collections.defaultdict(list)
    for start in to_train:
        groups[(start.step, start.evaluation_pending, start.group.total_steps)].append(start)
    for key in sorted(groups, reverse=True):
        _Loop(job, mesh, model, groups[key], stop).run()


def _export_finished(job: Job, start: RunStart) -> None:
    """A finished run rerun with export.peft: its final checkpoint's adapters, exported."""
    restored, total_steps = start.checkpoint, start.group.total_steps
    if restored is None or restored.state is None or restored.step != total_steps:
        logging.warning(
            "%s: cannot export its adapters: it has no intact checkpoint at its last step %d",
            start.run.name,
            total_steps,
        )
        return
    adapters = restored.state.lora
    hooks.export_adapters(job.export, job.lora, job.model.source, start.run, adapters, restored.step)
    start.checkpoint = dataclasses.replace(restored, state=None)  # its memory goes


def _summary(job: Job, starts: Sequence[RunStart]) -> None:
    """The closing lines: each run's final in-domain and mean OOD accuracy (read from its metrics.npz, so runs
    skipped as finished are listed too), and where the results are."""
    in_domain = job.data.train_set
    ood = [name for name in job.data.testsets if name != in_domain]  # every run's: a changed config is refused
    cells, runs = [], [start.run for start in starts]
    for start in starts:
        path = start.run.directory / schema.METRICS_FILENAME
        if not path.is_file():
            cells.append("no results yet")
            continue
        with np.load(path, allow_pickle=False) as stored:
            final = dict(zip(stored[schema.TESTSETS].tolist(), stored[schema.ACCURACY][-1].tolist()))
            step = int(stored[schema.STEP][-1])
        mean_ood = f"{np.mean([final[name] for name in ood]):.3f}" if ood else "n/a"
        last = f" (step {step})" if step != start.group.total_steps else ""
        cells.append(f"{final[in_domain]:.3f} / {mean_ood}{last}")
    lengths = sorted({start.group.total_steps for start in starts})
    at = f"step {lengths[0]}" if len(lengths) == 1 else f"each run's last step ({', '.join(map(str, lengths))})"
    label = f"final accuracy at {at}, in-domain {in_domain} / mean OOD ({', '.join(ood)})"
    logging.info("%s", console.by_run(label, runs, cells))
    out = job.runs.output_dir
    where = f"{out} (metrics.npz and events.jsonl per run; `python -m analysis.runs {out}` lists them, "
    logging.info("done: %d runs; results in %s`python -m analysis %s --out DIR` analyses them)", len(runs), where, out)


class Trainer:
    """Steps a prepared group of runs from ``start`` to ``total_steps``: first each hook's ``begin``, then
    every step's ``StepInfo`` to the hooks in the order added (``add_hook``). A group of zero steps
    (``oodjax.evaluate``) only begins; one that trains is ``PreparedTraining``, and with a ``stopping`` hook
    (set by a subclass) its stop signals are taken at every step, and before the first."""

    def __init__(self, prepared: Prepared, state: steps.TrainState, start: int, total_steps: int):
        self.prepared, self.state, self.start, self.total_steps = prepared, state, start, total_steps
        self.clock = Clock()
        self.stopping: Stopping | None = None
        self.hooks: list[Hook] = []

    def add_hook(self, hook: Hook) -> None:
        """Adds ``hook``, called after those added before it."""
        self.hooks.append(hook)

    def run(self) -> None:
        for hook in self.hooks:
            hook.begin(self.start, self.state)
        if self.start < self.total_steps:
            self._train(self.start)

    def _train(self, start: int) -> None:
        """Steps start+1 .. total through the hooks. The first step, which compiles, runs before the bar and
        the training clock start, so neither the ETA nor examples/s counts its compilation."""
        # a signal while loading, compiling or evaluating
        if self.stopping is not None and self.stopping.stop.agreed():
            self.stopping.stop_at(start, self.state, evaluation_pending=False)
        stepper, clock = self._steps(start), self.clock
        with console.first_call("train step"):
            first = next(stepper)
            jax.block_until_ready(first.metrics)
        clock.restart()
        total = self.total_steps
        with console.bar(total=total, initial=first.step, desc="train", unit="step", enabled=is_primary()) as bar:
            clock.bar = bar
            for info in itertools.chain([first], stepper):
                if info is not first:
                    bar.update(1)
                for hook in self.hooks:
                    hook(info)
        clock.bar = None

    def _steps(self, start: int) -> Iterator[StepInfo]:
        """The stepper: trains steps start+1 .. total, each when asked for."""
        prepared = self.prepared
        assert isinstance(prepared, PreparedTraining)  # a group that trains steps
        for step in range(start + 1, self.total_steps + 1):
            batch = next(prepared.train_stream)  # this process's rows of the global micro-batches
            batch = {key: batch[key] for key in TRAIN_KEYS}
            batch = sharding.shard_process_batch(batch, prepared.mesh, batch_axis=1, num_rows=prepared.geometry.rows)
            self.state, metrics = prepared.train_step(prepared.base_state, self.state, batch)
            self.clock.window += 1
            if self.stopping is not None:
                self.stopping.stop.step_trained(step)
            yield StepInfo(step, self.state, metrics)


class _Loop(Trainer):
    """The trainer of one group of runs of the job that stand at one step, with the job's hooks: the losses'
    check and log, a stop, evaluation, checkpoint, export (``hooks``); it closes the runs' event logs and
    checkpointers, whatever fails."""

    def __init__(
        self, job: Job, mesh: jax.sharding.Mesh, model: models.CausalLM, starts: Sequence[RunStart], stop: StopSignals
    ):
        """Sets up the runs that stand at one step, from their checkpoints (or from scratch at step 0); they are
        of one length, their group's."""
        runs = [start.run for start in starts]
        plan = dataclasses.replace(starts[0].group, runs=tuple(runs))  # those of its runs that stand here
        logging.info(
            "training %d runs from step %d: %s", len(runs), starts[0].step, ", ".join(run.name for run in runs)
        )
        prepared = prepare_training(job, plan, mesh, model)
        state, restored = prepared.state, [start.checkpoint for start in starts if start.checkpoint is not None]
        if restored:  # the runs stand at one step, all restored or none
            states = [checkpoint.state for checkpoint in restored if checkpoint.state is not None]  # all, restored
            state = checkpoints.stack_runs(states, like=state)
            prepared.train_stream.set_state(restored[0].loop_state["data"])
            for start in starts:  # the restored slices now live in the stacked state
                if start.checkpoint is not None:
                    start.checkpoint = dataclasses.replace(start.checkpoint, state=None)
        length = plan.plan()  # in each run's section
        kept_through = starts[0].step if restored else -1  # the redone steps' lines go
        events = [
            EventLog(
                run.directory,
                run_name=run.name,
                kept_through=kept_through,
                wandb=job.trackers.wandb,
                tensorboard=job.trackers.tensorboard,
                # its training set too, for W&B's filters
                config=hooks.run_record(job.record, run, job.model.name, **length, train_set=job.data.train_set),
            )
            for run in (runs if is_primary() else [])  # only process 0 writes results and event logs
        ]
        if events and (wandb_destination := events[0].wandb_destination()) is not None:
            logging.info("%s", wandb_destination)  # once, in place of W&B's banner and footer per run
        keep = plan.cadence.checkpoint_keep
        checkpointers = [checkpoints.RunCheckpointer(run.directory, name=run.name, max_to_keep=keep) for run in runs]
        super().__init__(prepared, state, starts[0].step, plan.total_steps)
        self.group = group = hooks.Shared(plan, starts, events, checkpointers, self.clock, job.runs.output_dir)
        losses = hooks.TrainLosses(group, job.batches.batch_size)
        records = [hooks.run_record(job.record, run, job.model.name, **length) for run in runs]
        saves = Checkpoints(group, prepared.train_stream, losses, records)
        self.stopping = stopping = Stopping(group, stop, losses, saves)
        pending = starts[0].evaluation_pending if restored else None
        source, in_domain = job.model.source, job.data.train_set
        evaluation = Evaluation(prepared, plan, records, source, in_domain, losses=losses, pending=pending)
        # After each step, in this order: the losses' check and log line, a stop, evaluation, checkpoint, export.
        for hook in (losses, stopping, evaluation, saves, hooks.Export(group, job.export, job.lora, source)):
            self.add_hook(hook)

    def run(self) -> None:
        with contextlib.ExitStack() as closing:  # every one closed, whatever fails
            for events in self.group.events:
                closing.callback(events.close)
            closing.push(self._close_checkpointers)
            with console.logs_above_bars():
                super().run()

    def _close_checkpointers(self, _kind: object, error: BaseException | None, _traceback: object) -> None:
        """Waits for the pending saves and closes, unless a collective lost another host's process: the
        saves' barriers would wait for it until JAX's heartbeat timeout aborts this process with a dump."""
        if error is not None and lost_peer(error) is not None:
            return
        with contextlib.ExitStack() as closing:
            for checkpointer in self.group.checkpointers:
                closing.callback(checkpointer.close)
