"""The run loop: train a config's runs together, evaluate them as they go, keep everything.

`train(config)` loads the model once, attaches one set of adapters per run
(seeds x shots), and alternates jitted train steps with evaluations of every
testset (and each run's own training set) at step 0 and every `eval.every`
steps. After each evaluation every run's metrics.npz is rewritten; every
`checkpoint_every` steps the runs' adapters, optimizer states, data-iterator
states and RNGs are checkpointed, and a rerun with the same output directory
resumes from the latest checkpoint to the same results an uninterrupted run
would have written. With `export.peft`, each run's adapters are written in
PEFT format to `<run_dir>/adapter/` when training ends (and at every
checkpoint with `export.every_checkpoint`), and pushed to `export.hub_repo`.
What it prints (compilations announced and timed, progress, a closing
summary) is described in `oodjax.engine.console`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import huggingface_hub
import jax
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from ml_collections import config_dict
from tqdm import tqdm
from transformers import AutoTokenizer

from analysis import schema
from oodjax import models
from oodjax.data import answer_token_ids
from oodjax.engine import checks, console, sharding, steps
from oodjax.engine.checkpoints import Checkpointer
from oodjax.engine.distributed import is_primary
from oodjax.engine.evaluation import evaluate
from oodjax.engine.events import EventLog, WandbSettings
from oodjax.engine.results import RunResults, run_name
from oodjax.engine.geometry import BatchGeometry, batch_geometry
from oodjax.engine.run_data import RunsData, few_shot_sets, load_runs_data, step_batch
from oodjax.models.lora import LoRAConfig, export_peft

# Config fields a resumed run may change: they do not affect its results.
_RESUMABLE_CHANGES = ("output_dir", "log_every", "wandb", "tensorboard", "export")

ADAPTER_DIR = "adapter"  # <run_dir>/adapter/: the run's adapters in PEFT format


@dataclasses.dataclass(frozen=True)
class Run:
    """One (seed, shots) fine-tuning job of the config."""

    seed: int
    shots: int
    name: str
    directory: pathlib.Path


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite; the runs stop, their last good checkpoint kept."""


def plan_runs(config: config_dict.ConfigDict) -> list[Run]:
    """The config's runs: every (seed, shots) pair, seeds outermost."""
    model = model_name(config)
    runs = []
    for seed, shots in itertools.product(config.runs.seeds, config.runs.shots):
        name = run_name(model, config.data.train_set, seed, shots)
        runs.append(Run(seed=seed, shots=shots, name=name, directory=pathlib.Path(config.output_dir) / name))
    return runs


def model_name(config: config_dict.ConfigDict) -> str:
    """model.name, else the checkpoint's last path component, else "<model_type>-random"."""
    if config.model.name:
        return config.model.name
    if config.model.path:
        return pathlib.Path(config.model.path.rstrip("/")).name
    return f"{config.model.hf_config.model_type}-random"


def train(config: config_dict.ConfigDict) -> list[Run]:
    """Trains and evaluates the config's runs (resuming if their checkpoints exist); returns them."""
    checks.check_config(config)
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    runs = plan_runs(config)
    logging.info("runs: %s", ", ".join(run.name for run in runs))

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model.path)
    yes_id, no_id = answer_token_ids(tokenizer)
    seeds = [run.seed for run in runs]
    train_sets = few_shot_sets(config, tokenizer, [(run.seed, run.shots) for run in runs])
    geometry = batch_geometry(config, mesh, train_sets)
    data = load_runs_data(config, tokenizer, seeds, train_sets, geometry)
    model = _load_model(config, mesh)
    graphdef, base_state, state = steps.init_runs(model, seeds, lora_config(config), optimizer(config), mesh=mesh)
    train_step, eval_step = make_steps(config, geometry, graphdef, base_state, state, yes_id, no_id, mesh)
    _Loop(config, runs, mesh, geometry, train_step, eval_step, base_state, state, data).run()
    return runs


def optimizer(config: config_dict.ConfigDict) -> optax.GradientTransformation:
    """The config's optimizer (``steps.make_optimizer`` of its train section)."""
    train = config.train
    return steps.make_optimizer(
        train.learning_rate, train.steps, train.warmup_steps, train.weight_decay, train.max_grad_norm
    )


def lora_config(config: config_dict.ConfigDict) -> LoRAConfig:
    """The config's adapters (its lora section)."""
    lora = config.lora
    return LoRAConfig(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(lora.targets) or None)


def make_steps(
    config: config_dict.ConfigDict,
    geometry: BatchGeometry,
    graphdef: nnx.GraphDef,
    base_state: nnx.State,
    runs: steps.RunsState,
    yes_id: int,
    no_id: int,
    mesh: jax.sharding.Mesh,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The config's (train_step, eval_step): what ``train`` runs and ``launch.preflight`` compiles.

    ``base_state`` and ``runs`` may be concrete or abstract (shapes and
    dtypes); they fix the steps' shardings on ``mesh``.
    """
    compute_dtype = config.model.compute_dtype or None
    train_step = steps.make_train_step(
        graphdef, optimizer(config), yes_id, no_id, geometry, mesh=mesh, base_state=base_state, runs=runs,
        compute_dtype=compute_dtype, metrics=True,
    )  # fmt: skip
    eval_step = steps.make_eval_step(graphdef, yes_id, no_id, mesh=mesh, compute_dtype=compute_dtype)
    return train_step, eval_step


def _wandb_settings(config: config_dict.ConfigDict) -> WandbSettings:
    """The config's W&B destination; its runs grouped as "<model>_<train_set>" unless wandb.group says."""
    wandb = config.wandb
    return WandbSettings(
        project=wandb.project,
        entity=wandb.entity or None,
        group=wandb.group or f"{model_name(config)}_{config.data.train_set}",
        tags=tuple(wandb.tags),
        mode=wandb.mode or None,
    )


def _load_model(config: config_dict.ConfigDict, mesh: jax.sharding.Mesh) -> models.CausalLM:
    if config.model.path:
        return models.load_pretrained(config.model.path, dtype=config.model.dtype, mesh=mesh, remat=config.model.remat)
    return models.from_config(
        config.model.hf_config.to_dict(), dtype=config.model.dtype, seed=config.model.init_seed,
        remat=config.model.remat,
    )


def _comparable_config(config: config_dict.ConfigDict) -> dict[str, Any]:
    """The config as JSON data, without the fields a resumption may change."""
    data = json.loads(config.to_json())
    for field in _RESUMABLE_CHANGES:
        data.pop(field, None)
    return data


class _Loop:
    """The loop over steps for one `train` call, and what it keeps between steps."""

    def __init__(self, config, runs, mesh, geometry, train_step, eval_step, base_state, state, data: RunsData):
        self.config, self.runs, self.mesh, self.geometry, self.data = config, runs, mesh, geometry, data
        self.train_step, self.eval_step = train_step, eval_step
        self.base_state, self.state = base_state, state
        self.total_steps = config.train.steps
        self.checkpointer = Checkpointer(config.output_dir)
        self.primary = is_primary()  # only process 0 writes results and event logs
        config_json = json.loads(config.to_json())
        self.results = [self._run_results(r, run, config_json) for r, run in enumerate(runs)]
        wandb = _wandb_settings(config) if config.wandb.enabled else None
        self.events = [
            EventLog(
                run.directory, run_name=run.name, wandb=wandb, tensorboard=config.tensorboard.enabled,
                # the run's identity and training set in a section of their own, for W&B's filters
                config=dict(config_json, **{schema.RUN_SECTION: self._identity(run, train_set=True)}),
            )  # fmt: skip
            for run in runs
        ] if self.primary else []
        self.learning_rate = steps.make_schedule(
            config.train.learning_rate, config.train.steps, config.train.warmup_steps
        )  # the optimizer's (``optimizer``), read on the host for the log
        # Per-run loss sums since the last evaluation (its train_loss); the
        # per-run losses and gradient norms since the last log line; the
        # train step's device metrics not yet checked.
        self.loss_sum, self.loss_steps = np.zeros(len(runs)), 0
        self.window: list[dict[str, np.ndarray]] = []
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []
        # The training clock: steps and seconds of training alone (no compiling,
        # evaluating or checkpointing), for examples/s and the ETA.
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.train_seconds, self.timed_steps = 0.0, 0
        self.bar: tqdm | None = None  # the training progress bar, while it is live
        self.eval_compiled = False

    def _identity(self, run: Run, *, train_set: bool = False) -> dict[str, Any]:
        """The run's model, seed and shots (metrics.npz's run section), and its training set if asked."""
        identity = {schema.RUN_MODEL: model_name(self.config), schema.RUN_SEED: run.seed, schema.RUN_SHOTS: run.shots}
        return dict(identity, train_set=self.config.data.train_set) if train_set else identity

    def _run_results(self, index: int, run: Run, config_json: dict[str, Any]) -> RunResults:
        labels = self.data.eval_pool.labels_of(index)
        return RunResults(
            run.directory,
            labels=labels,
            in_domain=self.config.data.train_set,
            config=dict(config_json, **{schema.RUN_SECTION: self._identity(run)}),
        )

    def run(self) -> None:
        try:
            with console.logs_above_bars():
                start = self._resume_or_start()
                if start >= self.total_steps:
                    logging.info("the runs finished already (step %d of %d)", start, self.total_steps)
                    if self.config.export.peft:  # a finished job rerun with export on: its final adapters
                        self._export()
                else:
                    self._train(start)
                if self.primary:
                    self._summary()
        finally:
            self.checkpointer.close()
            for log in self.events:
                log.close()

    def _resume_or_start(self) -> int:
        """Restores the latest checkpoint and returns its step; without one, evaluates step 0."""
        latest = self.checkpointer.latest_step()
        if latest is None:
            self._evaluate(0)
            return 0
        self.state, loop_state = self.checkpointer.restore(latest, self.state, self.data.streams)
        current = _comparable_config(self.config)
        if loop_state["config"] != current:
            stored = loop_state["config"]
            changed = sorted(key for key in {*current, *stored} if current.get(key) != stored.get(key))
            raise ValueError(
                f"{self.config.output_dir} holds runs started with another config (sections {changed} differ); "
                "resume with the same config or use a new output_dir"
            )
        self.loss_sum, self.loss_steps = np.array(loop_state["loss_sum"]), loop_state["loss_steps"]
        evaluated = [0] + [step for step in range(1, latest + 1) if self._evaluation_due(step)]
        for results in self.results:
            results.resume(latest, evaluated)
        logging.info("resumed from the checkpoint at step %d", latest)
        return latest

    def _train(self, start: int) -> None:
        """Steps start+1 .. total. The first step, which compiles, runs before the bar and the training
        clock start, so neither the ETA nor examples/s counts its compilation."""
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
        self.state, metrics = self.train_step(self.base_state, self.state, self._next_batch())
        self.pending.append((step, metrics))
        self.window_steps += 1

    def _after_train_step(self, step: int) -> None:
        """What is due after ``step``: a log line, an evaluation, a checkpoint (and an export)."""
        evaluation_due = self._evaluation_due(step)
        checkpoint_due = step % self.config.checkpoint_every == 0 or step == self.total_steps
        if evaluation_due or checkpoint_due or step % self.config.log_every == 0:
            self._check_losses()  # before anything is evaluated or saved
            self._log_window(step)
        if evaluation_due:
            self._evaluate(step)
        if checkpoint_due:
            self._checkpoint(step)
            if self.config.export.peft and (step == self.total_steps or self.config.export.every_checkpoint):
                self._export()
        if evaluation_due or checkpoint_due:
            self._restart_clock()

    def _restart_clock(self) -> None:
        """Restarts the training clock and the bar's timer after work that is not training."""
        self.window_start, self.window_steps = time.perf_counter(), 0
        if self.bar is not None:
            self.bar.unpause()

    def _evaluation_due(self, step: int) -> bool:
        return step % self.config.eval.every == 0 or step == self.total_steps

    def _next_batch(self) -> dict[str, jax.Array]:
        """Each run's next batch, as [R, grad_accum, micro_batch, ...] arrays sharded over the micro-batch."""
        per_run = [next(stream) for stream in self.data.streams]
        stacked = step_batch(per_run, grad_accum=self.geometry.grad_accum)
        # The streams yield this process's rows of the global micro-batches.
        return sharding.shard_process_batch(stacked, self.mesh, batch_axis=2, num_rows=self.geometry.micro_batch)

    def _check_losses(self) -> None:
        """Fetches the pending step metrics; stops at the first non-finite loss, naming its step."""
        for step, metrics in self.pending:
            metrics = {key: np.asarray(value, dtype=np.float64) for key, value in jax.device_get(metrics).items()}
            values = metrics["loss"]
            if not np.isfinite(values).all():
                bad = ", ".join(
                    f"{run.name}={value}" for run, value in zip(self.runs, values) if not np.isfinite(value)
                )
                self.checkpointer.wait()
                raise NonFiniteLossError(
                    f"non-finite training loss at step {step} ({bad}); stopped. The last good checkpoint is step "
                    f"{self.checkpointer.latest_step()} under {self.config.output_dir}; metrics.npz holds every "
                    "evaluation up to it"
                )
            self.loss_sum += values
            self.loss_steps += 1
            self.window.append(metrics)
        self.pending = []

    def _log_window(self, step: int) -> None:
        """Logs per run the mean loss and gradient norm since the last log line, the learning rate of the
        step's update, and the training throughput and ETA (from the training clock; none is measured for a
        window that holds only the compiling first step)."""
        now = time.perf_counter()
        loss, grad_norm = (np.mean([metrics[key] for metrics in self.window], axis=0) for key in ("loss", "grad_norm"))
        learning_rate = float(self.learning_rate(step - 1))  # step s's update is the optimizer's (s-1)-th
        metrics = {"train/loss": loss, "train/grad_norm": grad_norm, "train/learning_rate": learning_rate}
        line = (
            f"step {step}/{self.total_steps}: loss {np.array2string(loss, precision=4)}, "
            f"grad norm {np.array2string(grad_norm, precision=3)}, lr {learning_rate:.3g}"
        )
        if self.window_steps:
            rate = self.geometry.runs * self.geometry.batch_size * self.window_steps / (now - self.window_start)
            self.train_seconds += now - self.window_start
            self.timed_steps += self.window_steps
            eta = self.train_seconds / self.timed_steps * (self.total_steps - step)
            metrics["train/examples_per_s"] = rate
            line += f", {rate:.1f} examples/s, training ETA {console.duration(eta)}"
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{loss.mean():.4f}", examples_per_s=f"{rate:.1f}")
        logging.info("%s", line)
        for r, log in enumerate(self.events):
            log.log(step, {key: value if np.ndim(value) == 0 else value[r] for key, value in metrics.items()})
        self.window, self.window_start, self.window_steps = [], now, 0

    def _evaluate(self, step: int) -> None:
        """Evaluates every run on every testset and its own training set; rewrites each metrics.npz."""
        num_runs = len(self.runs)
        start = time.perf_counter()
        batches = len(self.data.eval_pool.batches)
        compiling = console.first_call("evaluation step") if not self.eval_compiled else contextlib.nullcontext()
        with compiling, console.bar(
            total=batches, desc=f"evaluate step {step}", unit="batch", enabled=self.primary, leave=False
        ) as bar:  # fmt: skip
            margins = evaluate(
                self._eval_step_counted(bar) if not bar.disable else self.eval_step,
                self.base_state, self.state.lora, self.data.eval_pool,
                place=lambda batch: sharding.shard_batch(batch, self.mesh, batch_axis=1),
            )  # fmt: skip
        self.eval_compiled = True
        logging.info("evaluated step %d (%d batches) in %.1f s", step, batches, time.perf_counter() - start)
        train_loss = self.loss_sum / self.loss_steps if self.loss_steps else np.full(num_runs, np.nan)
        for r, (run, results, run_margins) in enumerate(zip(self.runs, self.results, margins)):
            accuracies = results.add(step, run_margins, train_loss[r])
            if self.primary:
                results.write()
                self.events[r].log(step, {f"accuracy/{name}": value for name, value in accuracies.items()})
            summary = ", ".join(f"{name} {value:.3f}" for name, value in accuracies.items())
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

    def _summary(self) -> None:
        """The closing lines: each run's final in-domain and mean OOD accuracy, and where the results are."""
        in_domain = self.config.data.train_set
        for run, results in zip(self.runs, self.results):
            final = dict(zip(results.testsets, results.accuracy[-1]))
            ood = [name for name in results.testsets if name not in (in_domain, schema.TRAIN_TESTSET)]
            mean_ood = f"{np.mean([final[name] for name in ood]):.3f}" if ood else "n/a"
            logging.info(
                "%s at step %d: in-domain %s %.3f, mean OOD %s (%s)",
                run.name, results.steps[-1], in_domain, final[in_domain], mean_ood, ", ".join(ood),
            )  # fmt: skip
        logging.info(
            "done: %d runs; results in %s (metrics.npz and events.jsonl per run; `python -m analysis.runs %s` "
            "lists them, `python -m analysis %s --out DIR` analyses them)",
            len(self.runs), self.config.output_dir, self.config.output_dir, self.config.output_dir,
        )  # fmt: skip

    def _checkpoint(self, step: int) -> None:
        loop_state = {
            "config": _comparable_config(self.config),
            "loss_sum": self.loss_sum.tolist(),
            "loss_steps": self.loss_steps,
        }
        self.checkpointer.save(step, self.state, self.data.streams, loop_state)

    def _export(self) -> None:
        """Writes each run's current adapters to <run_dir>/adapter/ in PEFT format; pushes them to the hub.

        Every process takes part in gathering a run's adapters (they may be
        sharded over hosts); only the primary writes and pushes.
        """
        base_model = self.config.model.path or model_name(self.config)
        for r, run in enumerate(self.runs):
            adapters = multihost_utils.process_allgather(steps.select_run(self.state.lora, r), tiled=True)
            if not self.primary:
                continue
            folder = export_peft(
                adapters, lora_config(self.config), run.directory / ADAPTER_DIR, base_model_name_or_path=base_model
            )
            if self.config.export.hub_repo:
                huggingface_hub.create_repo(self.config.export.hub_repo, exist_ok=True)
                huggingface_hub.upload_folder(
                    repo_id=self.config.export.hub_repo, folder_path=folder, path_in_repo=run.name,
                    commit_message=f"{run.name}: adapters at step {int(self.state.step)}",
                )  # fmt: skip
        logging.info("adapters (PEFT format) written to <run_dir>/%s/ under %s", ADAPTER_DIR, self.config.output_dir)
