"""The run loop: train a config's runs, evaluate them as they go, keep everything, resume run by run.

`train(job)` loads the model once, attaches one set of adapters per run
(seeds x shots), and alternates jitted train steps with evaluations as
``cadence.Cadence`` says.

Runs are the unit of resumption (``oodjax.engine.resumption``). Runs train
in lockstep, so the unfinished ones are trained in groups of one length
(``Job.of_length``) and one resume step, each group with its own cadence,
schedule, geometry and compiled steps; each run ends with the results an
uninterrupted run would have written (to float32 rounding where its group's
size differs). A job locks its runs before it reads where they stand
(``oodjax.engine.run_lock``), so a second job on them writes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import huggingface_hub
import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from analysis import schema
from oodjax import models
from oodjax.data import TRAIN_KEYS
from oodjax.engine import checkpoints, console, run_lock, sharding, steps
from oodjax.engine.distributed import is_primary
from oodjax.engine.evaluation import evaluate, refuse_non_finite_model
from oodjax.engine.events import EventLog
from oodjax.engine.geometry import BatchGeometry
from oodjax.engine.preemption import Preempted, StopSignals
from oodjax.engine.results import ADAPTER_DIR, Run, RunResults
from oodjax.engine.resumption import (
    RunStart,
    comparable_stored,
    read_start,
    refuse_changed_config,
    set_aside_damaged,
    warn_of_shared_checkpoints,
)
from oodjax.engine.run_data import RunsData
from oodjax.engine.setup import set_up
from oodjax.models.lora import adds_nothing, export_peft

if TYPE_CHECKING:
    from oodjax.job import Job


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite; the runs stop, their last good checkpoint kept."""


def train(job: Job) -> list[Run]:
    """Trains and evaluates the job's unfinished runs, each from its newest intact checkpoint; returns all its
    runs (less those another job locks, with runs.skip_locked)."""
    with run_lock.locked_runs(job.runs.runs(), skip_locked=job.runs.skip_locked) as runs:
        job.log_config()
        output_dir = job.runs.output_dir
        warn_of_shared_checkpoints(output_dir)
        starts = [read_start(job.total_steps(run.shots), run) for run in runs]
        # before anything is written (the locks' new folders go with them)
        refuse_changed_config(job.record, output_dir, starts)
        where = [start.describe(job.total_steps(start.run.shots)) for start in starts]
        logging.info("%s", console.by_run(f"{len(runs)} runs in {output_dir}", runs, where))
        to_train = [start for start in starts if not start.finished]
        to_export = [start for start in starts if start.finished and job.export.peft]
        if to_train or to_export:
            with StopSignals() as stop:
                _train_runs(job, to_train, to_export, stop)
        if is_primary():
            _summary(job, runs)
    return runs


def _train_runs(job: Job, to_train: list[RunStart], to_export: list[RunStart], stop: StopSignals) -> None:
    """Loads the model once, restores every run's checkpoint, then trains the runs group by group (one resume
    step and one length each, the furthest along first) and exports the finished runs' adapters if asked."""
    mesh = job.mesh.make()
    model = job.model.load(mesh)
    resumed = [start for start in to_train if start.checkpoint is not None] + to_export
    if resumed:
        _, _, one_run = steps.attach_runs(model, [0], job.lora, job.optimizer.transformation, mesh=mesh)
        target = checkpoints.run_target(one_run)
        del one_run
        for start in resumed:
            start.checkpoint = checkpoints.restore_newest(start.run.directory, target)
        set_aside_damaged(resumed)
    for start in to_export:
        _export_finished(job, start)
    groups = collections.defaultdict(list)
    for start in to_train:
        groups[(start.step, start.evaluation_pending, job.total_steps(start.run.shots))].append(start)
    for key in sorted(groups, reverse=True):
        _train_group(job.of_length(key[2]), mesh, model, groups[key], stop)


def _export_finished(job: Job, start: RunStart) -> None:
    """A finished run rerun with export.peft: its final checkpoint's adapters, exported."""
    restored, total_steps = start.checkpoint, job.total_steps(start.run.shots)
    if restored is None or restored.step != total_steps:
        logging.warning(
            "%s: cannot export its adapters: it has no intact checkpoint at its last step %d",
            start.run.name,
            total_steps,
        )
        return
    _export_adapters(job, start.run, restored.state.lora, restored.step)
    start.checkpoint = dataclasses.replace(restored, state=None)  # its memory goes


def _train_group(
    job: Job,
    mesh: jax.sharding.Mesh,
    model: models.CausalLM,
    group: list[RunStart],
    stop: StopSignals,
) -> None:
    """Trains runs that stand at one step together, from their checkpoints (or from scratch at step 0); ``job``
    is of their length (``Job.of_length``)."""
    runs = [start.run for start in group]
    logging.info("training %d runs from step %d: %s", len(runs), group[0].step, ", ".join(run.name for run in runs))
    setup = set_up(job, mesh, runs)
    geometry, data, (yes_id, no_id) = setup.geometry, setup.data, setup.answer_ids
    seeds = [run.seed for run in runs]
    graphdef, base_state, state = steps.attach_runs(model, seeds, job.lora, job.optimizer.transformation, mesh=mesh)
    if group[0].checkpoint is not None:
        state = checkpoints.stack_runs([start.checkpoint.state for start in group], like=state)
        data.train_stream.set_state(group[0].checkpoint.loop_state["data"])  # the group's runs stand at one step
    train_step, eval_step = make_steps(job, geometry, graphdef, base_state, state, yes_id, no_id, mesh)
    loop = _Loop(job, group, mesh, geometry, train_step, eval_step, base_state, state, data, stop)
    for start in group:  # the restored slices now live in the stacked state
        if start.checkpoint is not None:
            start.checkpoint = dataclasses.replace(start.checkpoint, state=None)
    loop.run()


def make_steps(
    job: Job,
    geometry: BatchGeometry,
    graphdef: nnx.GraphDef,
    base_state: nnx.State,
    state: steps.TrainState,
    yes_id: int,
    no_id: int,
    mesh: jax.sharding.Mesh,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The job's (train_step, eval_step): what ``train`` runs and ``launch.preflight`` compiles (so
    ``base_state`` and ``state`` may be abstract)."""
    compute_dtype = job.model.compute_dtype
    train_step = steps.make_train_step(
        graphdef,
        job.optimizer.transformation,
        yes_id,
        no_id,
        geometry,
        mesh=mesh,
        base_state=base_state,
        state=state,
        compute_dtype=compute_dtype,
    )
    eval_step = steps.make_eval_step(graphdef, yes_id, no_id, mesh=mesh, compute_dtype=compute_dtype)
    return train_step, eval_step


def _export_adapters(job: Job, run: Run, adapters: nnx.State, step: int) -> None:
    """Writes one run's adapters to <run_dir>/adapter/ in PEFT format and pushes them to the hub; every process
    takes part in gathering them, only the primary writes."""
    adapters = multihost_utils.process_allgather(adapters, tiled=True)
    if not is_primary():
        return
    folder = export_peft(adapters, job.lora, run.directory / ADAPTER_DIR, base_model_name_or_path=job.model.source)
    logging.info("%s: adapters at step %d (PEFT format) written to %s", run.name, step, folder)
    if job.export.hub_repo:
        huggingface_hub.create_repo(job.export.hub_repo, exist_ok=True)
        huggingface_hub.upload_folder(
            repo_id=job.export.hub_repo,
            folder_path=folder,
            path_in_repo=run.name,
            commit_message=f"{run.name}: adapters at step {step}",
        )


def _summary(job: Job, runs: Sequence[Run]) -> None:
    """The closing lines: each run's final in-domain and mean OOD accuracy (read from its metrics.npz, so runs
    skipped as finished are listed too), and where the results are."""
    in_domain = job.data.train_set
    ood = [name for name in job.data.testsets if name != in_domain]  # every run's: a changed config is refused
    cells = []
    for run in runs:
        total_steps = job.total_steps(run.shots)
        path = run.directory / schema.METRICS_FILENAME
        if not path.is_file():
            cells.append("no results yet")
            continue
        with np.load(path, allow_pickle=False) as stored:
            final = dict(zip(stored[schema.TESTSETS].tolist(), stored[schema.ACCURACY][-1].tolist()))
            step = int(stored[schema.STEP][-1])
        mean_ood = f"{np.mean([final[name] for name in ood]):.3f}" if ood else "n/a"
        cells.append(f"{final[in_domain]:.3f} / {mean_ood}" + (f" (step {step})" if step != total_steps else ""))
    lengths = sorted({job.total_steps(run.shots) for run in runs})
    at = f"step {lengths[0]}" if len(lengths) == 1 else f"each run's last step ({', '.join(map(str, lengths))})"
    label = f"final accuracy at {at}, in-domain {in_domain} / mean OOD ({', '.join(ood)})"
    logging.info("%s", console.by_run(label, runs, cells))
    logging.info(
        "done: %d runs; results in %s (metrics.npz and events.jsonl per run; `python -m analysis.runs %s` "
        "lists them, `python -m analysis %s --out DIR` analyses them)",
        len(runs),
        job.runs.output_dir,
        job.runs.output_dir,
        job.runs.output_dir,
    )


class _Loop:
    """Trains one group of runs that stand at one step: a stepper (``_train``) and the hooks due after a step.
    Whenever a hook or a log line is due, the step's losses are fetched, checked and logged first."""

    def __init__(
        self,
        job: Job,
        group: Sequence[RunStart],
        mesh: jax.sharding.Mesh,
        geometry: BatchGeometry,
        train_step: Callable[..., Any],
        eval_step: Callable[..., Any],
        base_state: nnx.State,
        state: steps.TrainState,
        data: RunsData,
        stop: StopSignals,
    ):
        runs = [start.run for start in group]
        self.job, self.runs, self.mesh, self.geometry, self.data = job, runs, mesh, geometry, data
        self.cadence, self.total_steps = job.cadence, job.cadence.total_steps
        self.train_step, self.eval_step = train_step, eval_step
        self.base_state, self.state, self.stop = base_state, state, stop
        # The step the group starts from, whether it resumes, and whether that step's evaluation is still to do.
        self.start, self.resumed = group[0].step, group[0].checkpoint is not None
        self.evaluation_pending = group[0].evaluation_pending
        # After a step, in this order, the hooks whose cadence makes them due.
        self.hooks = [
            (self.cadence.evaluation_due, self._evaluate),
            (self.cadence.checkpoint_due, self._checkpoint),
            (self._export_due, self._export),
        ]
        self.checkpointers = [
            checkpoints.RunCheckpointer(run.directory, name=run.name, max_to_keep=self.cadence.checkpoint_keep)
            for run in runs
        ]
        self.primary = is_primary()  # only process 0 writes results and event logs
        self.results = [
            RunResults(
                run.directory,
                labels=data.eval_pool.labels_of(r),
                dataset_index=data.dataset_index[r],
                in_domain=job.data.train_set,
                config=self._record(run),
            )
            for r, run in enumerate(runs)
        ]
        self.events = [
            EventLog(
                run.directory,
                run_name=run.name,
                kept_through=self.start if self.resumed else -1,  # the steps the run redoes are dropped
                wandb=job.trackers.wandb,
                tensorboard=job.trackers.tensorboard,
                config=self._record(run, train_set=job.data.train_set),  # its training set too, for W&B's filters
            )
            for run in (runs if self.primary else [])
        ]
        if self.events and (wandb_destination := self.events[0].wandb_destination()) is not None:
            logging.info("%s", wandb_destination)  # once, in place of W&B's banner and footer per run
        # Per-run loss sums since the last evaluation (its train_loss); the per-run losses and gradient norms since
        # the last log line; the train step's device metrics not yet checked.
        self.loss_sum, self.loss_steps = np.zeros(len(runs)), 0
        if self.resumed:
            self.loss_sum = np.array([start.checkpoint.loop_state["loss_sum"] for start in group], dtype=np.float64)
            self.loss_steps = group[0].checkpoint.loop_state["loss_steps"]
        self.window: list[dict[str, np.ndarray]] = []
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []
        # The training clock: steps and seconds of training alone (no compiling, evaluating or checkpointing).
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.train_seconds, self.timed_steps = 0.0, 0
        self.bar: tqdm | None = None  # the training progress bar, while it is live
        self.eval_compiled = False

    def _record(self, run: Run, **more: Any) -> dict[str, Any]:
        """The job's record with the run's own section (its metrics.npz's), and ``more`` in that section."""
        section = {
            schema.RUN_MODEL: self.job.model.name,
            schema.RUN_SEED: run.seed,
            schema.RUN_SHOTS: run.shots,
            schema.RUN_STEPS: self.total_steps,
            **more,
        }
        return dict(self.job.record, **{schema.RUN_SECTION: section})

    def run(self) -> None:
        with contextlib.ExitStack() as closing:  # every one closed, whatever fails (pending saves waited for)
            for closable in (*self.checkpointers, *self.events):
                closing.callback(closable.close)
            with console.logs_above_bars():
                self._resume_or_start()
                if self.start < self.total_steps:
                    self._train(self.start)
                elif self.job.export.peft:  # stopped at the last step before its evaluation, now done
                    self._export(self.start)

    def _resume_or_start(self) -> None:
        """Evaluates step 0 of new runs; reloads resumed runs' evaluations up to their step from their
        metrics.npz, then does that step's evaluation if they were stopped before it."""
        if not self.resumed:
            self._evaluate(0)
            return
        evaluated = [step for step in self.cadence.evaluated_steps() if step <= self.start]
        if self.evaluation_pending:
            evaluated.remove(self.start)
        for run_results in self.results:
            run_results.resume(self.start, evaluated)
        if self.evaluation_pending:
            self._evaluate(self.start)

    # The stepper.
    def _train(self, start: int) -> None:
        """Steps start+1 .. total. The first step, which compiles, runs before the bar and the training
        clock start, so neither the ETA nor examples/s counts its compilation."""
        if self.stop.agreed():  # a signal while loading, compiling or evaluating
            self._stop(start, evaluation_pending=False)
        first = start + 1
        with console.first_call("train step"):
            self._train_step(first)
            jax.block_until_ready(self.pending[-1][1])
        self._restart_clock()
        with console.bar(
            total=self.total_steps, initial=first, desc="train", unit="step", enabled=self.primary
        ) as self.bar:
            self._after_train_step(first)
            for step in range(first + 1, self.total_steps + 1):
                self._train_step(step)
                self.bar.update(1)
                self._after_train_step(step)
        self.bar = None

    def _train_step(self, step: int) -> None:
        batch = next(self.data.train_stream)  # this process's rows of the global micro-batches
        batch = sharding.shard_process_batch(
            {key: batch[key] for key in TRAIN_KEYS}, self.mesh, batch_axis=1, num_rows=self.geometry.rows
        )
        self.state, metrics = self.train_step(self.base_state, self.state, batch)
        self.pending.append((step, metrics))
        self.window_steps += 1
        self.stop.step_trained(step)

    def _after_train_step(self, step: int) -> None:
        due = [hook for is_due, hook in self.hooks if is_due(step)]
        waits = bool(due) or self.cadence.log_due(step)  # for the step's losses
        if waits:
            self._log_window(step)  # before a stop too: the resumed run keeps the lines up to its checkpoint
        if self.stop.agreed(synced=waits):
            self._stop(step, evaluation_pending=self.cadence.evaluation_due(step))
        for hook in due:
            hook(step)
        if due:
            self._restart_clock()

    def _restart_clock(self) -> None:
        """Restarts the training clock and the bar's timer after work that is not training."""
        self.window_start, self.window_steps = time.perf_counter(), 0
        if self.bar is not None:
            self.bar.unpause()

    def _stop(self, step: int, *, evaluation_pending: bool) -> NoReturn:
        """Checkpoints every run at ``step`` (unless it already is), waits until it is on disk in every process,
        says so, and raises ``Preempted``."""
        self._check_losses()
        if any(checkpointer.latest_step() != step for checkpointer in self.checkpointers):
            self._checkpoint(step, evaluation_pending=evaluation_pending)
        for checkpointer in self.checkpointers:
            checkpointer.wait()
        signal_name = self.stop.received or "a signal to another process"
        logging.warning(
            "stopping after step %d on %s: the checkpoints of %d runs at step %d are saved (<run_dir>/%s/%d under "
            "%s)%s; rerun the same command to resume",
            step,
            signal_name,
            len(self.runs),
            step,
            checkpoints.CHECKPOINT_DIR,
            step,
            self.job.runs.output_dir,
            ", its evaluation left for the resumed run" if evaluation_pending else "",
        )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("oodjax: checkpoints saved before stopping")
        raise Preempted(step, [run.name for run in self.runs], signal_name)

    # The hooks: the log line (with the loss check), evaluation, checkpoint, export.
    def _check_losses(self) -> None:
        """Fetches the pending step metrics; stops at the first non-finite loss, naming its step."""
        for step, metrics in self.pending:
            metrics = {key: np.asarray(value, dtype=np.float64) for key, value in jax.device_get(metrics).items()}
            values = metrics["loss"]
            if not np.isfinite(values).all():
                bad = ", ".join(
                    f"{run.name}={value}" for run, value in zip(self.runs, values) if not np.isfinite(value)
                )
                for checkpointer in self.checkpointers:
                    checkpointer.wait()
                latest = self.checkpointers[0].latest_step()
                raise NonFiniteLossError(
                    f"non-finite training loss at step {step} ({bad}); stopped. The runs' last good checkpoints "
                    f"are at step {latest} (<run_dir>/{checkpoints.CHECKPOINT_DIR}/ under {self.job.runs.output_dir}); "
                    "metrics.npz holds every evaluation up to it"
                )
            self.loss_sum += values
            self.loss_steps += 1
            self.window.append(metrics)
        self.pending = []

    def _log_window(self, step: int) -> None:
        """Checks the losses, then logs the learning rate, throughput and ETA (from the training clock), and
        each run's mean loss and gradient norm since the last log line."""
        self._check_losses()
        now = time.perf_counter()
        loss, grad_norm = (np.mean([metrics[key] for metrics in self.window], axis=0) for key in ("loss", "grad_norm"))
        # the optimizer's own schedule; step s's update is its (s-1)-th
        learning_rate = float(self.job.optimizer.learning_rate_schedule(step - 1))
        metrics = {"train/loss": loss, "train/grad_norm": grad_norm, "train/learning_rate": learning_rate}
        line = f"step {step}/{self.total_steps}: lr {learning_rate:.3g}"
        if self.window_steps:
            rate = self.geometry.runs * self.geometry.batch_size * self.window_steps / (now - self.window_start)
            self.train_seconds += now - self.window_start
            self.timed_steps += self.window_steps
            eta = self.train_seconds / self.timed_steps * (self.total_steps - step)
            metrics["train/examples_per_s"] = rate
            line += f", {rate:.1f} examples/s, training ETA {console.duration(eta)}"
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{loss.mean():.4f}", examples_per_s=f"{rate:.1f}")
        per_run = [f"{run_loss:.4f} ({run_norm:.3g})" for run_loss, run_norm in zip(loss, grad_norm)]
        logging.info("%s; %s", line, console.by_run("loss (grad norm)", self.runs, per_run))
        for r, log in enumerate(self.events):
            log.log(step, {key: value if np.ndim(value) == 0 else value[r] for key, value in metrics.items()})
        self.window, self.window_start, self.window_steps = [], now, 0

    def _evaluate(self, step: int) -> None:
        """Evaluates every run on every testset and its own training set; rewrites each metrics.npz."""
        num_runs = len(self.runs)
        start = time.perf_counter()
        pool = self.data.first_eval_pool if adds_nothing(self.state.lora) else self.data.eval_pool
        batches = len(pool.batches)
        compiling = console.first_call("evaluation step") if not self.eval_compiled else contextlib.nullcontext()
        with (
            compiling,
            console.bar(
                total=batches, desc=f"evaluate step {step}", unit="batch", enabled=self.primary, leave=False
            ) as bar,
        ):
            margins = evaluate(
                self._eval_step_counted(bar) if not bar.disable else self.eval_step,
                self.base_state,
                self.state.lora,
                pool,
                place=lambda batch: sharding.shard_batch(batch, self.mesh, batch_axis=1),
            )
        self.eval_compiled = True
        once = ", each example once for all runs: no adapter adds anything yet" if pool.interchangeable else ""
        logging.info("evaluated step %d (%d batches%s) in %.1f s", step, batches, once, time.perf_counter() - start)
        train_loss = self.loss_sum / self.loss_steps if self.loss_steps else np.full(num_runs, np.nan)
        accuracies = [
            run_results.add(
                step,
                run_margins,
                train_loss[r],
                train_clock=self.train_seconds,
                evaluation_seconds=time.perf_counter() - start,
            )
            for r, (run_results, run_margins) in enumerate(zip(self.results, margins))
        ]
        if step == 0:  # the base model's own outputs
            refuse_non_finite_model(self.job.model.source, accuracies)
        for r, (run, run_results, run_accuracies) in enumerate(zip(self.runs, self.results, accuracies)):
            if self.primary:
                run_results.write()
                self.events[r].log(step, {f"accuracy/{name}": value for name, value in run_accuracies.items()})
            summary = ", ".join(f"{name} {value:.3f}" for name, value in run_accuracies.items())
            logging.info("step %d, %s: %s", step, run.name, summary)
        self.loss_sum, self.loss_steps = np.zeros(num_runs), 0

    def _eval_step_counted(self, bar: tqdm) -> Callable[..., jax.Array]:
        """The eval step, advancing ``bar`` as batches finish: each call first waits for the batch two calls
        back, so the bar shows computed batches while two stay in flight (the host still runs ahead)."""
        in_flight: collections.deque[jax.Array] = collections.deque()

        def counted(*args: Any) -> jax.Array:
            if len(in_flight) == 2:
                jax.block_until_ready(in_flight.popleft())
                bar.update(1)
            in_flight.append(self.eval_step(*args))
            return in_flight[-1]

        return counted

    def _checkpoint(self, step: int, *, evaluation_pending: bool = False) -> None:
        """Saves each run's slice of the state and its loop state at ``step`` in the run's own folder."""
        comparable = comparable_stored(self.job.record)
        run_states = checkpoints.split_runs(self.state)
        for r, (checkpointer, run_state) in enumerate(zip(self.checkpointers, run_states, strict=True)):
            loop_state = {
                "config": comparable,
                "loss_sum": float(self.loss_sum[r]),
                "loss_steps": self.loss_steps,
                "data": self.data.train_stream.get_state(),
                "evaluation_pending": evaluation_pending,
            }
            checkpointer.save(step, run_state, loop_state)

    def _export_due(self, step: int) -> bool:
        """With export.peft: at the last step's checkpoint, or at every checkpoint with export.every_checkpoint."""
        last_or_every = step == self.total_steps or self.job.export.every_checkpoint
        return self.job.export.peft and self.cadence.checkpoint_due(step) and last_or_every

    def _export(self, step: int) -> None:
        """Writes each run's current adapters to <run_dir>/adapter/ in PEFT format (``_export_adapters``)."""
        for r, run in enumerate(self.runs):
            _export_adapters(self.job, run, steps.select_run(self.state.lora, r), step)
