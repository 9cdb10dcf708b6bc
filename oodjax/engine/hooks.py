"""The trainer's hooks: each step's ``StepInfo`` goes to objects that keep their own state and apply their
own rule of ``cadence.Cadence``: the losses' check and log, a stop, evaluation, checkpoint, export.
``oodjax.engine.loop`` registers them for a group of runs; ``oodjax.evaluate`` runs the evaluation alone, once
at step 0."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
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
from oodjax.engine import checkpoints, console, sharding, steps
from oodjax.engine.distributed import is_primary
from oodjax.engine.evaluation import evaluate, refuse_non_finite_model
from oodjax.engine.events import EventLog
from oodjax.engine.preemption import Preempted, StopSignals
from oodjax.engine.results import ADAPTER_DIR, Run, RunResults
from oodjax.engine.resumption import RunStart
from oodjax.engine.run_data import RunsData
from oodjax.models.lora import adds_nothing, export_peft

if TYPE_CHECKING:
    from oodjax.config_read import Job
    from oodjax.engine.cadence import Cadence, RunGroup
    from oodjax.engine.setup import Prepared


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite; the runs stop, their last good checkpoint kept."""


def export_adapters(job: Job, run: Run, adapters: nnx.State, step: int) -> None:
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


def run_record(job: Job, run: Run, model: str, **more: Any) -> dict[str, Any]:
    """The job's record with the run's own section (its metrics.npz's): its model, seed and shots, then ``more``."""
    section = {schema.RUN_MODEL: model, schema.RUN_SEED: run.seed, schema.RUN_SHOTS: run.shots, **more}
    return dict(job.record, **{schema.RUN_SECTION: section})


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """A trained step as the hooks see it: its number, the runs' state after it, and its metrics (on device)."""

    step: int
    state: steps.TrainState
    metrics: dict[str, jax.Array]


class Clock:
    """The training clock: steps and seconds of training alone (no compiling, evaluating or checkpointing), and
    the progress bar whose timer it resumes. A zero-step run's (``oodjax.evaluate``) starts at NaN: nothing
    trained is measured."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.steps = seconds, 0
        self.bar: tqdm | None = None
        self.restart()

    def restart(self) -> None:
        """A new window, after work that is not training."""
        self.start, self.window = time.perf_counter(), 0
        if self.bar is not None:
            self.bar.unpause()

    def lap(self) -> tuple[int, float]:
        """The window's steps and seconds, added to the totals; a new window starts now."""
        now = time.perf_counter()
        window, seconds = self.window, now - self.start
        if window:
            self.seconds, self.steps = self.seconds + seconds, self.steps + window
        self.start, self.window = now, 0
        return window, seconds


@dataclasses.dataclass(frozen=True)
class Shared:
    """What the hooks of one group share and none owns: the job, the runs' group (of their length), their
    starts, event logs (the primary's; only it writes) and checkpointers, and the training clock."""

    job: Job
    plan: RunGroup
    starts: Sequence[RunStart]
    events: Sequence[EventLog]
    checkpointers: Sequence[checkpoints.RunCheckpointer]
    clock: Clock

    @property
    def runs(self) -> list[Run]:
        return [start.run for start in self.starts]

    @property
    def cadence(self) -> Cadence:
        return self.plan.cadence


class TrainLosses:
    """Hook: keeps each step's metrics on device until the cadence waits for them (``Cadence.syncs``), then
    fetches them, stops at a non-finite loss, and logs the window; sums each run's loss since the last
    evaluation (its train_loss, which checkpoints keep)."""

    def __init__(self, group: Shared):
        self.group = group
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []  # not yet fetched
        self.window: list[dict[str, np.ndarray]] = []  # fetched since the last log line
        self.sum, self.steps = np.zeros(len(group.starts)), 0
        if (restored := group.starts[0].checkpoint) is not None:
            self.sum = np.array([start.checkpoint.loop_state["loss_sum"] for start in group.starts])
            self.steps = restored.loop_state["loss_steps"]

    def __call__(self, info: StepInfo) -> None:
        self.pending.append((info.step, info.metrics))
        if self.group.cadence.syncs(info.step):
            self.log(info.step)

    def check(self) -> None:
        """Fetches the pending step metrics; stops at the first non-finite loss, naming its step."""
        for step, metrics in self.pending:
            metrics = {key: np.asarray(value, dtype=np.float64) for key, value in jax.device_get(metrics).items()}
            if not np.isfinite(values := metrics["loss"]).all():
                runs = zip(self.group.runs, values)
                bad = ", ".join(f"{run.name}={value}" for run, value in runs if not np.isfinite(value))
                for checkpointer in self.group.checkpointers:
                    checkpointer.wait()
                raise NonFiniteLossError(
                    f"non-finite training loss at step {step} ({bad}); stopped. The runs' last good checkpoints are "
                    f"at step {self.group.checkpointers[0].latest_step()} (<run_dir>/{checkpoints.CHECKPOINT_DIR}/ "
                    f"under {self.group.job.runs.output_dir}); metrics.npz holds every evaluation up to it"
                )
            self.sum, self.steps = self.sum + values, self.steps + 1
            self.window.append(metrics)
        self.pending = []

    def log(self, step: int) -> None:
        """Checks the losses, then logs the learning rate, throughput and ETA (from the training clock), and
        each run's mean loss and gradient norm since the last log line."""
        self.check()
        plan, clock = self.group.plan, self.group.clock
        loss, grad_norm = (np.mean([metrics[key] for metrics in self.window], axis=0) for key in ("loss", "grad_norm"))
        # the optimizer's own schedule; step s's update is its (s-1)-th
        assert plan.optimizer is not None  # a group that trains steps
        learning_rate = float(plan.optimizer.learning_rate_schedule(step - 1))
        metrics = {"train/loss": loss, "train/grad_norm": grad_norm, "train/learning_rate": learning_rate}
        line = f"step {step}/{plan.total_steps}: lr {learning_rate:.3g}"
        window, seconds = clock.lap()
        if window:
            rate = len(self.group.starts) * self.group.job.batches.batch_size * window / seconds
            eta = clock.seconds / clock.steps * (plan.total_steps - step)
            metrics["train/examples_per_s"] = rate
            line += f", {rate:.1f} examples/s, training ETA {console.duration(eta)}"
            if clock.bar is not None:
                clock.bar.set_postfix(loss=f"{loss.mean():.4f}", examples_per_s=f"{rate:.1f}")
        per_run = [f"{run_loss:.4f} ({run_norm:.3g})" for run_loss, run_norm in zip(loss, grad_norm)]
        logging.info("%s; %s", line, console.by_run("loss (grad norm)", self.group.runs, per_run))
        for r, log in enumerate(self.group.events):
            log.log(step, {key: value if np.ndim(value) == 0 else value[r] for key, value in metrics.items()})
        self.window = []

    def since_evaluation(self) -> np.ndarray:
        """Each run's mean loss since the last evaluation (NaN before any step); the sums start again."""
        mean = self.sum / self.steps if self.steps else np.full(len(self.sum), np.nan)
        self.sum, self.steps = np.zeros(len(self.sum)), 0
        return mean


class Evaluation:
    """Hook: at the cadence's evaluation steps, evaluates every run on every set of its pool (the testsets and
    its own training set, or what ``oodjax.evaluate`` asks) and rewrites each metrics.npz (``RunResults``), its
    config ``records[r]``. A run with no ``losses`` trains nothing: its train_loss is NaN."""

    def __init__(
        self,
        group: Shared,
        prepared: Prepared,
        losses: TrainLosses | None,
        records: Sequence[dict[str, Any]],
        model: str,
    ):
        """``model`` is what a first evaluation with no finite output names."""
        self.group, self.prepared, self.losses, self.model = group, prepared, losses, model
        self.compiled = False
        data = prepared.data
        self.results = [
            RunResults(
                run.directory,
                labels=data.eval_pool.labels_of(r),
                dataset_index=data.dataset_index[r],
                in_domain=group.job.data.train_set,
                config=record,
            )
            for r, (run, record) in enumerate(zip(group.runs, records, strict=True))
        ]

    def __call__(self, info: StepInfo) -> None:
        if self.group.cadence.evaluation_due(info.step):
            self.evaluate(info.step, info.state)
            self.group.clock.restart()

    def begin(self, state: steps.TrainState) -> None:
        """Evaluates step 0 of new runs; reloads resumed runs' evaluations up to their step from their
        metrics.npz, then does that step's evaluation if they were stopped before it."""
        first = self.group.starts[0]
        if first.checkpoint is None:
            return self.evaluate(0, state)
        evaluated = [step for step in self.group.cadence.evaluated_steps() if step <= first.step]
        if first.evaluation_pending:
            evaluated.remove(first.step)
        for run_results in self.results:
            run_results.resume(first.step, evaluated)
        if first.evaluation_pending:
            self.evaluate(first.step, state)

    def evaluate(self, step: int, state: steps.TrainState) -> None:
        start, primary = time.perf_counter(), is_primary()
        prepared = self.prepared
        pool = prepared.data.first_eval_pool if adds_nothing(state.lora) else prepared.data.eval_pool
        compiling = console.first_call("evaluation step") if not self.compiled else contextlib.nullcontext()
        desc = f"evaluate step {step}"
        with (
            compiling,
            console.bar(total=len(pool.batches), desc=desc, unit="batch", enabled=primary, leave=False) as bar,
        ):
            eval_step = self._eval_step_counted(bar) if not bar.disable else prepared.eval_step
            place = functools.partial(sharding.shard_batch, mesh=prepared.mesh, batch_axis=1)
            margins = evaluate(eval_step, prepared.base_state, state.lora, pool, place=place)
        self.compiled = True
        once = ", each example once for all runs: no adapter adds anything yet" if pool.interchangeable else ""
        seconds = time.perf_counter() - start
        logging.info("evaluated step %d (%d batches%s) in %.1f s", step, len(pool.batches), once, seconds)
        runs, clock = len(self.results), self.group.clock.seconds
        train_loss = self.losses.since_evaluation() if self.losses is not None else np.full(runs, np.nan)
        accuracies = [
            run_results.add(step, margins[r], train_loss[r], train_clock=clock, evaluation_seconds=seconds)
            for r, run_results in enumerate(self.results)
        ]
        if step == 0:  # the model's first outputs
            refuse_non_finite_model(self.model, accuracies)
        if primary:
            for run_results in self.results:
                run_results.write()
        for events, run_accuracies in zip(self.group.events, accuracies):  # the primary's (none: no event log)
            events.log(step, {f"accuracy/{name}": value for name, value in run_accuracies.items()})
        for run, run_accuracies in zip(self.group.runs, accuracies):
            summary = ", ".join(f"{name} {value:.3f}" for name, value in run_accuracies.items())
            logging.info("step %d, %s: %s", step, run.name, summary)

    def _eval_step_counted(self, bar: tqdm) -> Callable[..., jax.Array]:
        """The eval step, advancing ``bar`` as batches finish: each call first waits for the batch two calls
        back, so the bar shows computed batches while two stay in flight (the host still runs ahead)."""
        in_flight: collections.deque[jax.Array] = collections.deque()

        def counted(*args: Any) -> jax.Array:
            if len(in_flight) == 2:
                jax.block_until_ready(in_flight.popleft())
                bar.update(1)
            in_flight.append(self.prepared.eval_step(*args))
            return in_flight[-1]

        return counted


class Checkpoints:
    """Hook: at the cadence's checkpoint steps, saves each run's slice of the state and its loop state (the
    data stream's, its loss sum) in the run's own folder."""

    def __init__(self, group: Shared, data: RunsData, losses: TrainLosses):
        self.group, self.data, self.losses = group, data, losses

    def __call__(self, info: StepInfo) -> None:
        if self.group.cadence.checkpoint_due(info.step):
            self.save(info.step, info.state)
            self.group.clock.restart()

    def save(self, step: int, state: steps.TrainState, *, evaluation_pending: bool = False) -> None:
        job, group, data = self.group.job, self.group, self.data.train_stream.get_state()
        run_states = checkpoints.split_runs(state)
        runs = zip(group.runs, group.checkpointers, run_states, strict=True)
        for r, (run, checkpointer, run_state) in enumerate(runs):
            loop_state = {
                "config": run_record(job, run, job.model.name, **group.plan.plan()),
                "loss_sum": float(self.losses.sum[r]),
                "loss_steps": self.losses.steps,
                "data": data,
                "evaluation_pending": evaluation_pending,
            }
            checkpointer.save(step, run_state, loop_state)


class Export:
    """Hook: with export.peft, writes each run's adapters to <run_dir>/adapter/ in PEFT format at the last
    step's checkpoint, or at every checkpoint with export.every_checkpoint."""

    def __init__(self, group: Shared):
        self.group = group

    def __call__(self, info: StepInfo) -> None:
        cadence, export = self.group.cadence, self.group.job.export
        last_or_every = info.step == cadence.total_steps or export.every_checkpoint
        if export.peft and cadence.checkpoint_due(info.step) and last_or_every:
            self.export(info.step, info.state)
            self.group.clock.restart()

    def export(self, step: int, state: steps.TrainState) -> None:
        for r, run in enumerate(self.group.runs):
            export_adapters(self.group.job, run, steps.select_run(state.lora, r), step)


class Stopping:
    """Hook: on a stop signal (agreed across processes at the steps the cadence waits for anyway), checkpoints
    every run at the step unless it already is, waits until that is on disk everywhere, and raises
    ``Preempted``. Registered after the losses' log (the resumed run keeps the lines up to its checkpoint) and
    before evaluation (left to the resumed run)."""

    def __init__(self, group: Shared, stop: StopSignals, losses: TrainLosses, saves: Checkpoints):
        self.group, self.stop, self.losses, self.saves = group, stop, losses, saves

    def __call__(self, info: StepInfo) -> None:
        cadence = self.group.cadence
        if self.stop.agreed(synced=cadence.syncs(info.step)):
            self.stop_at(info.step, info.state, evaluation_pending=cadence.evaluation_due(info.step))

    def stop_at(self, step: int, state: steps.TrainState, *, evaluation_pending: bool) -> NoReturn:
        self.losses.check()
        if any(checkpointer.latest_step() != step for checkpointer in self.group.checkpointers):
            self.saves.save(step, state, evaluation_pending=evaluation_pending)
        for checkpointer in self.group.checkpointers:
            checkpointer.wait()
        signal_name = self.stop.received or "a signal to another process"
        where = f"<run_dir>/{checkpoints.CHECKPOINT_DIR}/{step} under {self.group.job.runs.output_dir}"
        left = ", its evaluation left for the resumed run" if evaluation_pending else ""
        runs = len(self.group.starts)
        message = f"the checkpoints of {runs} runs at step {step} are saved ({where}){left}; rerun the same command"
        logging.warning("stopping after step %d on %s: %s to resume", step, signal_name, message)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("oodjax: checkpoints saved before stopping")
        raise Preempted(step, [run.name for run in self.group.runs], signal_name)
