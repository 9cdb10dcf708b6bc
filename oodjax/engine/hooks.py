"""The trainer's hooks: each step's ``StepInfo`` goes to objects that keep their own state and apply their
own rule of ``cadence.Cadence``: the losses' check and log, a stop, evaluation, checkpoint, export. Each takes
the pieces it uses, not the job: ``oodjax.engine.loop`` registers them all on a group's trainer (``add_hook``),
``oodjax.evaluate`` the evaluation alone, for a zero-step run evaluated once at step 0."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import grain
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
from oodjax.models.lora import LoRAConfig, adds_nothing, export_peft

if TYPE_CHECKING:
    from oodjax.engine.cadence import Cadence, ExportSettings, RunGroup
    from oodjax.engine.setup import Prepared


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite; the runs stop, their last good checkpoint kept."""


def export_adapters(
    settings: ExportSettings, lora: LoRAConfig, base_model: str, run: Run, adapters: nnx.State, step: int
) -> None:
    """Writes one run's adapters (of ``lora``, on ``base_model``) to <run_dir>/adapter/ in PEFT format and
    pushes them to the hub; every process takes part in gathering them, only the primary writes."""
    adapters = multihost_utils.process_allgather(adapters, tiled=True)
    if not is_primary():
        return
    folder = export_peft(adapters, lora, run.directory / ADAPTER_DIR, base_model_name_or_path=base_model)
    logging.info("%s: adapters at step %d (PEFT format) written to %s", run.name, step, folder)
    if hub_repo := settings.hub_repo:
        huggingface_hub.create_repo(hub_repo, exist_ok=True)
        huggingface_hub.upload_folder(
            repo_id=hub_repo,
            folder_path=folder,
            path_in_repo=run.name,
            commit_message=f"{run.name}: adapters at step {step}",
        )


def run_record(record: Mapping[str, Any], run: Run, model: str, **more: Any) -> dict[str, Any]:
    """The job's ``record`` with the run's own section (its metrics.npz's): its model, seed and shots, then
    ``more``."""
    section = {schema.RUN_MODEL: model, schema.RUN_SEED: run.seed, schema.RUN_SHOTS: run.shots, **more}
    return dict(record, **{schema.RUN_SECTION: section})


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """A trained step as the hooks see it: its number, the runs' state after it, and its metrics (on device)."""

    step: int
    state: steps.TrainState
    metrics: dict[str, jax.Array]


class Hook:
    """What a trainer calls (``oodjax.engine.loop.Trainer.add_hook``): ``begin`` once, at the step it starts
    from, before any step is trained; then the hook itself with each trained step's ``StepInfo``."""

    def begin(self, step: int, state: steps.TrainState) -> None:
        """Nothing, unless a hook has work before the first step."""

    def __call__(self, info: StepInfo) -> None:
        raise NotImplementedError


class Clock:
    """The training clock: steps and seconds of training alone (no compiling, evaluating or checkpointing), and
    the progress bar whose timer it resumes."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0
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
    """What the training hooks of one group share and none owns: the runs' group (of their length), their
    starts, event logs (the primary's; only it writes) and checkpointers, the training clock, and the job's
    output_dir (that its messages name)."""

    plan: RunGroup
    starts: Sequence[RunStart]
    events: Sequence[EventLog]
    checkpointers: Sequence[checkpoints.RunCheckpointer]
    clock: Clock
    output_dir: pathlib.Path

    @property
    def runs(self) -> list[Run]:
        return [start.run for start in self.starts]

    @property
    def cadence(self) -> Cadence:
        return self.plan.cadence


class TrainLosses(Hook):
    """Hook: keeps each step's metrics on device until the cadence waits for them (``Cadence.syncs``), then
    fetches them, stops at a non-finite loss, and logs the window (throughput of ``batch_size`` examples a run
    a step); sums each run's loss since the last evaluation (its train_loss, which checkpoints keep)."""

    def __init__(self, group: Shared, batch_size: int):
        self.group, self.batch_size = group, batch_size
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []  # not yet fetched
        self.window: list[dict[str, np.ndarray]] = []  # fetched since the last log line
        self.sum, self.steps = np.zeros(len(group.starts)), 0
        restored = [start.checkpoint for start in group.starts if start.checkpoint is not None]
        if restored:  # the runs stand at one step, all restored or none
            self.sum = np.array([checkpoint.loop_state["loss_sum"] for checkpoint in restored])
            self.steps = restored[0].loop_state["loss_steps"]

    def __call__(self, info: StepInfo) -> None:
        self.pending.append((info.step, info.metrics))
        if self.group.cadence.syncs(info.step):
            self.log(info.step)

    def check(self) -> None:
        """Fetches the pending step metrics; stops at the first non-finite loss, naming its step."""
        for step, on_device in self.pending:
            metrics = {key: np.asarray(value, dtype=np.float64) for key, value in jax.device_get(on_device).items()}
            if not np.isfinite(values := metrics["loss"]).all():
                runs = zip(self.group.runs, values)
                bad = ", ".join(f"{run.name}={value}" for run, value in runs if not np.isfinite(value))
                for checkpointer in self.group.checkpointers:
                    checkpointer.wait()
                raise NonFiniteLossError(
                    f"non-finite training loss at step {step} ({bad}); stopped. The runs' last good checkpoints are "
                    f"at step {self.group.checkpointers[0].latest_step()} (<run_dir>/{checkpoints.CHECKPOINT_DIR}/ "
                    f"under {self.group.output_dir}); metrics.npz holds every evaluation up to it"
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
            rate = len(self.group.starts) * self.batch_size * window / seconds
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


class Evaluation(Hook):
    """Hook: at the cadence's evaluation steps, evaluates the ``plan``'s runs on every set of their pool (the
    testsets and each run's own training set, or what ``oodjax.evaluate`` asks) and rewrites each metrics.npz
    (``RunResults``), its config ``records[r]``, scoring ``in_domain`` as the in-domain set.

    Runs with no ``losses`` train nothing: their train_loss and train seconds are NaN; runs that train have
    their clock and event logs from the losses' group. ``pending`` says where runs resumed from a checkpoint
    stand: whether the evaluation of the step they start from is still to do; None: new runs."""

    def __init__(
        self,
        prepared: Prepared,
        plan: RunGroup,
        records: Sequence[dict[str, Any]],
        model: str,
        in_domain: str,
        *,
        losses: TrainLosses | None = None,
        pending: bool | None = None,
    ):
        """``model`` is what a first evaluation with no finite output names."""
        self.prepared, self.runs, self.cadence, self.model = prepared, plan.runs, plan.cadence, model
        self.losses, self.pending = losses, pending
        self.clock = None if losses is None else losses.group.clock
        self.events: Sequence[EventLog] = () if losses is None else losses.group.events
        self.compiled = False
        data = prepared.data
        self.results = [
            RunResults(
                run.directory,
                labels=data.eval_pool.labels_of(r),
                dataset_index=data.dataset_index[r],
                in_domain=in_domain,
                config=record,
            )
            for r, (run, record) in enumerate(zip(plan.runs, records, strict=True))
        ]

    def __call__(self, info: StepInfo) -> None:
        if self.cadence.evaluation_due(info.step):
            self.evaluate(info.step, info.state)
            if self.clock is not None:
                self.clock.restart()

    def begin(self, step: int, state: steps.TrainState) -> None:
        """Evaluates step 0 of new runs; reloads resumed runs' evaluations up to their ``step`` from their
        metrics.npz, then does that step's evaluation if they were stopped before it."""
        if self.pending is None:
            return self.evaluate(0, state)
        evaluated = [done for done in self.cadence.evaluated_steps() if done <= step]
        if self.pending:
            evaluated.remove(step)
        for run_results in self.results:
            run_results.resume(step, evaluated)
        if self.pending:
            self.evaluate(step, state)

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
        runs, clock = len(self.results), math.nan if self.clock is None else self.clock.seconds
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
        for events, run_accuracies in zip(self.events, accuracies):  # the primary's (none: no event log)
            events.log(step, {f"accuracy/{name}": value for name, value in run_accuracies.items()})
        for run, run_accuracies in zip(self.runs, accuracies):
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


class Checkpoints(Hook):
    """Hook: at the cadence's checkpoint steps, saves each run's slice of the state and its loop state (the
    training ``stream``'s, its loss sum, its ``records``' record, which resumption compares) in the run's own
    folder."""

    def __init__(
        self, group: Shared, stream: grain.DatasetIterator, losses: TrainLosses, records: Sequence[Mapping[str, Any]]
    ):
        self.group, self.stream, self.losses, self.records = group, stream, losses, records

    def __call__(self, info: StepInfo) -> None:
        if self.group.cadence.checkpoint_due(info.step):
            self.save(info.step, info.state)
            self.group.clock.restart()

    def save(self, step: int, state: steps.TrainState, *, evaluation_pending: bool = False) -> None:
        data, run_states = self.stream.get_state(), checkpoints.split_runs(state)
        for r, (checkpointer, run_state) in enumerate(zip(self.group.checkpointers, run_states, strict=True)):
            loop_state = {
                "config": self.records[r],
                "loss_sum": float(self.losses.sum[r]),
                "loss_steps": self.losses.steps,
                "data": data,
                "evaluation_pending": evaluation_pending,
            }
            checkpointer.save(step, run_state, loop_state)


class Export(Hook):
    """Hook: with export.peft, writes each run's adapters to <run_dir>/adapter/ in PEFT format at the last
    step's checkpoint, or at every checkpoint with export.every_checkpoint; runs resumed at their last step
    (stopped before its evaluation) at once."""

    def __init__(self, group: Shared, settings: ExportSettings, lora: LoRAConfig, base_model: str):
        self.group, self.settings, self.lora, self.base_model = group, settings, lora, base_model

    def begin(self, step: int, state: steps.TrainState) -> None:
        if step == self.group.cadence.total_steps and self.settings.peft:
            self.export(step, state)

    def __call__(self, info: StepInfo) -> None:
        cadence, export = self.group.cadence, self.settings
        last_or_every = info.step == cadence.total_steps or export.every_checkpoint
        if export.peft and cadence.checkpoint_due(info.step) and last_or_every:
            self.export(info.step, info.state)
            self.group.clock.restart()

    def export(self, step: int, state: steps.TrainState) -> None:
        for r, run in enumerate(self.group.runs):
            adapters = steps.select_run(state.lora, r)
            export_adapters(self.settings, self.lora, self.base_model, run, adapters, step)


class Stopping(Hook):
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
        where = f"<run_dir>/{checkpoints.CHECKPOINT_DIR}/{step} under {self.group.output_dir}"
        left = ", its evaluation left for the resumed run" if evaluation_pending else ""
        runs = len(self.group.starts)
        message = f"the checkpoints of {runs} runs at step {step} are saved ({where}){left}; rerun the same command"
        logging.warning("stopping after step %d on %s: %s to resume", step, signal_name, message)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("oodjax: checkpoints saved before stopping")
        raise Preempted(step, [run.name for run in self.group.runs], signal_name)
