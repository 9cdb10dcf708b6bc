"""The run loop: train a config's runs, evaluate them as they go, keep everything, resume run by run.

`train(job)` loads the model once, attaches one set of adapters per run
(seeds x shots), and trains them step by step (``_Loop``), each step handed
to hooks that keep their own state and apply their own rule of
``cadence.Cadence``: the losses' check and log, a stop, evaluation,
checkpoint, export.

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
import functools
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
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
from oodjax.engine.distributed import is_primary, lost_peer
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
    from oodjax.config_read import Job


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
        _Loop(job.of_length(key[2]), mesh, model, groups[key], stop).run()


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
    out = job.runs.output_dir
    where = f"{out} (metrics.npz and events.jsonl per run; `python -m analysis.runs {out}` lists them, "
    logging.info("done: %d runs; results in %s`python -m analysis %s --out DIR` analyses them)", len(runs), where, out)


def _run_record(job: Job, run: Run, **more: Any) -> dict[str, Any]:
    """The job's record with the run's own section (its metrics.npz's), and ``more`` in that section."""
    section = {
        schema.RUN_MODEL: job.model.name,
        schema.RUN_SEED: run.seed,
        schema.RUN_SHOTS: run.shots,
        schema.RUN_STEPS: job.cadence.total_steps,
        **more,
    }
    return dict(job.record, **{schema.RUN_SECTION: section})


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """A trained step as the hooks see it: its number, the runs' state after it, and its metrics (on device)."""

    step: int
    state: steps.TrainState
    metrics: dict[str, jax.Array]


class _Clock:
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
class _Group:
    """What the hooks of one group share and none owns: the job (of the group's length), the runs' starts,
    their event logs (the primary's; only it writes) and checkpointers, and the training clock."""

    job: Job
    starts: Sequence[RunStart]
    events: Sequence[EventLog]
    checkpointers: Sequence[checkpoints.RunCheckpointer]
    clock: _Clock

    @property
    def runs(self) -> list[Run]:
        return [start.run for start in self.starts]


class TrainLosses:
    """Hook: keeps each step's metrics on device until the cadence waits for them (``Cadence.syncs``), then
    fetches them, stops at a non-finite loss, and logs the window; sums each run's loss since the last
    evaluation (its train_loss, which checkpoints keep)."""

    def __init__(self, group: _Group, geometry: BatchGeometry):
        self.group, self.geometry = group, geometry
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []  # not yet fetched
        self.window: list[dict[str, np.ndarray]] = []  # fetched since the last log line
        self.sum, self.steps = np.zeros(len(group.starts)), 0
        if (restored := group.starts[0].checkpoint) is not None:
            self.sum = np.array([start.checkpoint.loop_state["loss_sum"] for start in group.starts])
            self.steps = restored.loop_state["loss_steps"]

    def __call__(self, info: StepInfo) -> None:
        self.pending.append((info.step, info.metrics))
        if self.group.job.cadence.syncs(info.step):
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
        job, clock = self.group.job, self.group.clock
        loss, grad_norm = (np.mean([metrics[key] for metrics in self.window], axis=0) for key in ("loss", "grad_norm"))
        # the optimizer's own schedule; step s's update is its (s-1)-th
        learning_rate = float(job.optimizer.learning_rate_schedule(step - 1))
        metrics = {"train/loss": loss, "train/grad_norm": grad_norm, "train/learning_rate": learning_rate}
        line = f"step {step}/{job.cadence.total_steps}: lr {learning_rate:.3g}"
        window, seconds = clock.lap()
        if window:
            rate = self.geometry.runs * self.geometry.batch_size * window / seconds
            eta = clock.seconds / clock.steps * (job.cadence.total_steps - step)
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
    """Hook: at the cadence's evaluation steps, evaluates every run on every testset and its own training set
    and rewrites each metrics.npz (``RunResults``)."""

    def __init__(
        self,
        group: _Group,
        data: RunsData,
        losses: TrainLosses,
        eval_step: Callable[..., Any],
        base_state: nnx.State,
        mesh: jax.sharding.Mesh,
    ):
        self.group, self.data, self.losses = group, data, losses
        self.eval_step, self.base_state, self.mesh = eval_step, base_state, mesh
        self.compiled = False
        self.results = [
            RunResults(
                run.directory,
                labels=data.eval_pool.labels_of(r),
                dataset_index=data.dataset_index[r],
                in_domain=group.job.data.train_set,
                config=_run_record(group.job, run),
            )
            for r, run in enumerate(group.runs)
        ]

    def __call__(self, info: StepInfo) -> None:
        if self.group.job.cadence.evaluation_due(info.step):
            self.evaluate(info.step, info.state)
            self.group.clock.restart()

    def begin(self, state: steps.TrainState) -> None:
        """Evaluates step 0 of new runs; reloads resumed runs' evaluations up to their step from their
        metrics.npz, then does that step's evaluation if they were stopped before it."""
        first = self.group.starts[0]
        if first.checkpoint is None:
            return self.evaluate(0, state)
        evaluated = [step for step in self.group.job.cadence.evaluated_steps() if step <= first.step]
        if first.evaluation_pending:
            evaluated.remove(first.step)
        for run_results in self.results:
            run_results.resume(first.step, evaluated)
        if first.evaluation_pending:
            self.evaluate(first.step, state)

    def evaluate(self, step: int, state: steps.TrainState) -> None:
        start, primary = time.perf_counter(), is_primary()
        pool = self.data.first_eval_pool if adds_nothing(state.lora) else self.data.eval_pool
        compiling = console.first_call("evaluation step") if not self.compiled else contextlib.nullcontext()
        desc = f"evaluate step {step}"
        with (
            compiling,
            console.bar(total=len(pool.batches), desc=desc, unit="batch", enabled=primary, leave=False) as bar,
        ):
            eval_step = self._eval_step_counted(bar) if not bar.disable else self.eval_step
            place = functools.partial(sharding.shard_batch, mesh=self.mesh, batch_axis=1)
            margins = evaluate(eval_step, self.base_state, state.lora, pool, place=place)
        self.compiled = True
        once = ", each example once for all runs: no adapter adds anything yet" if pool.interchangeable else ""
        seconds = time.perf_counter() - start
        logging.info("evaluated step %d (%d batches%s) in %.1f s", step, len(pool.batches), once, seconds)
        train_loss, clock = self.losses.since_evaluation(), self.group.clock.seconds
        accuracies = [
            run_results.add(step, margins[r], train_loss[r], train_clock=clock, evaluation_seconds=seconds)
            for r, run_results in enumerate(self.results)
        ]
        if step == 0:  # the base model's own outputs
            refuse_non_finite_model(self.group.job.model.source, accuracies)
        for r, (run, run_results, run_accuracies) in enumerate(zip(self.group.runs, self.results, accuracies)):
            if primary:
                run_results.write()
                self.group.events[r].log(step, {f"accuracy/{name}": value for name, value in run_accuracies.items()})
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
            in_flight.append(self.eval_step(*args))
            return in_flight[-1]

        return counted


class Checkpoints:
    """Hook: at the cadence's checkpoint steps, saves each run's slice of the state and its loop state (the
    data stream's, its loss sum) in the run's own folder."""

    def __init__(self, group: _Group, data: RunsData, losses: TrainLosses):
        self.group, self.data, self.losses = group, data, losses

    def __call__(self, info: StepInfo) -> None:
        if self.group.job.cadence.checkpoint_due(info.step):
            self.save(info.step, info.state)
            self.group.clock.restart()

    def save(self, step: int, state: steps.TrainState, *, evaluation_pending: bool = False) -> None:
        comparable, data = comparable_stored(self.group.job.record), self.data.train_stream.get_state()
        run_states = checkpoints.split_runs(state)
        for r, (checkpointer, run_state) in enumerate(zip(self.group.checkpointers, run_states, strict=True)):
            loop_state = {
                "config": comparable,
                "loss_sum": float(self.losses.sum[r]),
                "loss_steps": self.losses.steps,
                "data": data,
                "evaluation_pending": evaluation_pending,
            }
            checkpointer.save(step, run_state, loop_state)


class Export:
    """Hook: with export.peft, writes each run's adapters to <run_dir>/adapter/ in PEFT format at the last
    step's checkpoint, or at every checkpoint with export.every_checkpoint."""

    def __init__(self, group: _Group):
        self.group = group

    def __call__(self, info: StepInfo) -> None:
        cadence, export = self.group.job.cadence, self.group.job.export
        last_or_every = info.step == cadence.total_steps or export.every_checkpoint
        if export.peft and cadence.checkpoint_due(info.step) and last_or_every:
            self.export(info.step, info.state)
            self.group.clock.restart()

    def export(self, step: int, state: steps.TrainState) -> None:
        for r, run in enumerate(self.group.runs):
            _export_adapters(self.group.job, run, steps.select_run(state.lora, r), step)


class Stopping:
    """Hook: on a stop signal (agreed across processes at the steps the cadence waits for anyway), checkpoints
    every run at the step unless it already is, waits until that is on disk everywhere, and raises
    ``Preempted``. Registered after the losses' log (the resumed run keeps the lines up to its checkpoint) and
    before evaluation (left to the resumed run)."""

    def __init__(self, group: _Group, stop: StopSignals, losses: TrainLosses, saves: Checkpoints):
        self.group, self.stop, self.losses, self.saves = group, stop, losses, saves

    def __call__(self, info: StepInfo) -> None:
        cadence = self.group.job.cadence
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


class _Loop:
    """The trainer of one group of runs that stand at one step: a stepper (``_steps``) whose every step's
    ``StepInfo`` goes to the hooks in the order registered (``hooks``)."""

    def __init__(
        self, job: Job, mesh: jax.sharding.Mesh, model: models.CausalLM, starts: Sequence[RunStart], stop: StopSignals
    ):
        """Sets up the runs that stand at one step, from their checkpoints (or from scratch at step 0); ``job`` is
        of their length (``Job.of_length``)."""
        runs = [start.run for start in starts]
        logging.info(
            "training %d runs from step %d: %s", len(runs), starts[0].step, ", ".join(run.name for run in runs)
        )
        setup = set_up(job, mesh, runs)
        geometry, data, (yes_id, no_id) = setup.geometry, setup.data, setup.answer_ids
        assert geometry is not None and data is not None  # set up for runs, with their testsets
        seeds = [run.seed for run in runs]
        graphdef, base_state, state = steps.attach_runs(model, seeds, job.lora, job.optimizer.transformation, mesh=mesh)
        if starts[0].checkpoint is not None:
            state = checkpoints.stack_runs([start.checkpoint.state for start in starts], like=state)
            data.train_stream.set_state(starts[0].checkpoint.loop_state["data"])  # the runs stand at one step
            for start in starts:  # the restored slices now live in the stacked state
                start.checkpoint = dataclasses.replace(start.checkpoint, state=None)
        self.train_step, eval_step = steps.make_steps(
            job.optimizer, job.model.compute_dtype, geometry, graphdef, base_state, state, yes_id, no_id, mesh
        )
        self.geometry, self.data, self.mesh, self.stop = geometry, data, mesh, stop
        self.base_state, self.state = base_state, state
        kept_through = starts[0].step if starts[0].checkpoint is not None else -1  # the redone steps' lines go
        events = [
            EventLog(
                run.directory,
                run_name=run.name,
                kept_through=kept_through,
                wandb=job.trackers.wandb,
                tensorboard=job.trackers.tensorboard,
                config=_run_record(job, run, train_set=job.data.train_set),  # its training set too, for W&B's filters
            )
            for run in (runs if is_primary() else [])  # only process 0 writes results and event logs
        ]
        if events and (wandb_destination := events[0].wandb_destination()) is not None:
            logging.info("%s", wandb_destination)  # once, in place of W&B's banner and footer per run
        keep = job.cadence.checkpoint_keep
        checkpointers = [checkpoints.RunCheckpointer(run.directory, name=run.name, max_to_keep=keep) for run in runs]
        self.group = group = _Group(job, starts, events, checkpointers, _Clock())
        losses = TrainLosses(group, geometry)
        saves = Checkpoints(group, data, losses)
        self.evaluation = Evaluation(group, data, losses, eval_step, base_state, mesh)
        self.export, self.stopping = Export(group), Stopping(group, stop, losses, saves)
        # After each step, in this order: the losses' check and log line, a stop, evaluation, checkpoint, export.
        self.hooks: list[Callable[[StepInfo], None]] = [losses, self.stopping, self.evaluation, saves, self.export]

    def run(self) -> None:
        with contextlib.ExitStack() as closing:  # every one closed, whatever fails
            for events in self.group.events:
                closing.callback(events.close)
            closing.push(self._close_checkpointers)
            with console.logs_above_bars():
                self.evaluation.begin(self.state)
                start = self.group.starts[0].step
                if start < self.group.job.cadence.total_steps:
                    self._train(start)
                elif self.group.job.export.peft:  # stopped at the last step before its evaluation, now done
                    self.export.export(start, self.state)

    def _close_checkpointers(self, _kind: object, error: BaseException | None, _traceback: object) -> None:
        """Waits for the pending saves and closes, unless a collective lost another host's process: the
        saves' barriers would wait for it until JAX's heartbeat timeout aborts this process with a dump."""
        if error is not None and lost_peer(error) is not None:
            return
        with contextlib.ExitStack() as closing:
            for checkpointer in self.group.checkpointers:
                closing.callback(checkpointer.close)

    def _train(self, start: int) -> None:
        """Steps start+1 .. total through the hooks. The first step, which compiles, runs before the bar and
        the training clock start, so neither the ETA nor examples/s counts its compilation."""
        if self.stop.agreed():  # a signal while loading, compiling or evaluating
            self.stopping.stop_at(start, self.state, evaluation_pending=False)
        stepper, clock = self._steps(start), self.group.clock
        with console.first_call("train step"):
            first = next(stepper)
            jax.block_until_ready(first.metrics)
        clock.restart()
        total = self.group.job.cadence.total_steps
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
        for step in range(start + 1, self.group.job.cadence.total_steps + 1):
            batch = next(self.data.train_stream)  # this process's rows of the global micro-batches
            batch = {key: batch[key] for key in TRAIN_KEYS}
            batch = sharding.shard_process_batch(batch, self.mesh, batch_axis=1, num_rows=self.geometry.rows)
            self.state, metrics = self.train_step(self.base_state, self.state, batch)
            self.group.clock.window += 1
            self.stop.step_trained(step)
            yield StepInfo(step, self.state, metrics)
