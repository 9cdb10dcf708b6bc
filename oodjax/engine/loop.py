"""The run loop: train a config's runs together, evaluate them as they go, keep everything.

`train(config)` loads the model once, attaches one set of adapters per run
(seeds x shots), and alternates jitted train steps with evaluations of every
testset (and each run's own training set) at step 0 and every `eval.every`
steps. After each evaluation every run's metrics.npz is rewritten; every
`checkpoint_every` steps the runs' adapters, optimizer states, data-iterator
states and RNGs are checkpointed, and a rerun with the same output directory
resumes from the latest checkpoint to the same results an uninterrupted run
would have written.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from absl import logging
from flax import nnx
from ml_collections import config_dict
from tqdm import tqdm
from transformers import AutoTokenizer

from analysis import schema
from oodjax import models
from oodjax.data import answer_token_ids
from oodjax.engine import checks, sharding, steps
from oodjax.engine.checkpoints import Checkpointer
from oodjax.engine.distributed import is_primary
from oodjax.engine.evaluation import evaluate
from oodjax.engine.events import EventLog
from oodjax.engine.results import RunResults, run_name
from oodjax.engine.geometry import BatchGeometry, batch_geometry
from oodjax.engine.run_data import RunsData, few_shot_sets, load_runs_data, step_batch
from oodjax.models.lora import LoRAConfig

# Config fields a resumed run may change: they do not affect its results.
_RESUMABLE_CHANGES = ("output_dir", "log_every", "wandb")


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
        compute_dtype=compute_dtype,
    )  # fmt: skip
    eval_step = steps.make_eval_step(graphdef, yes_id, no_id, mesh=mesh, compute_dtype=compute_dtype)
    return train_step, eval_step


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
        wandb_project = config.wandb.project if config.wandb.enabled else None
        self.events = [
            EventLog(run.directory, run_name=run.name, config=config_json, wandb_project=wandb_project)
            for run in runs
        ] if self.primary else []
        # Per-run loss sums since the last evaluation (its train_loss); the
        # losses since the last log line; device losses not yet checked.
        self.loss_sum, self.loss_steps = np.zeros(len(runs)), 0
        self.window: list[np.ndarray] = []
        self.window_start = time.perf_counter()
        self.pending: list[tuple[int, jax.Array]] = []

    def _run_results(self, index: int, run: Run, config_json: dict[str, Any]) -> RunResults:
        labels = self.data.eval_pool.labels_of(index)
        identity = {schema.RUN_MODEL: model_name(self.config), schema.RUN_SEED: run.seed, schema.RUN_SHOTS: run.shots}
        return RunResults(
            run.directory,
            labels=labels,
            in_domain=self.config.data.train_set,
            config=dict(config_json, **{schema.RUN_SECTION: identity}),
        )

    def run(self) -> None:
        try:
            start = self._resume_or_start()
            if start >= self.total_steps:
                logging.info("the runs finished already (step %d of %d)", start, self.total_steps)
                return
            self._train(start)
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
        examples_per_step = self.geometry.runs * self.geometry.batch_size
        with tqdm(total=self.total_steps, initial=start, desc="train", unit="step", disable=not self.primary) as bar:
            for step in range(start + 1, self.total_steps + 1):
                self.state, loss = self.train_step(self.base_state, self.state, self._next_batch())
                self.pending.append((step, loss))
                evaluation_due = self._evaluation_due(step)
                checkpoint_due = step % self.config.checkpoint_every == 0 or step == self.total_steps
                if evaluation_due or checkpoint_due or step % self.config.log_every == 0:
                    self._check_losses()  # before anything is evaluated or saved
                    self._log_window(step, examples_per_step, bar)
                bar.update(1)
                if evaluation_due:
                    self._evaluate(step)
                if checkpoint_due:
                    self._checkpoint(step)
                if evaluation_due or checkpoint_due:
                    self.window_start = time.perf_counter()  # examples/s counts training only

    def _evaluation_due(self, step: int) -> bool:
        return step % self.config.eval.every == 0 or step == self.total_steps

    def _next_batch(self) -> dict[str, jax.Array]:
        """Each run's next batch, as [R, grad_accum, micro_batch, ...] arrays sharded over the micro-batch."""
        per_run = [next(stream) for stream in self.data.streams]
        stacked = step_batch(per_run, grad_accum=self.geometry.grad_accum)
        # The streams yield this process's rows of the global micro-batches.
        return sharding.shard_process_batch(stacked, self.mesh, batch_axis=2, num_rows=self.geometry.micro_batch)

    def _check_losses(self) -> None:
        """Fetches the pending losses; stops at the first non-finite one, naming its step."""
        for step, loss in self.pending:
            values = np.asarray(jax.device_get(loss), dtype=np.float64)
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
            self.window.append(values)
        self.pending = []

    def _log_window(self, step: int, examples_per_step: int, bar: tqdm) -> None:
        """Logs the mean loss per run since the last log line, and the training throughput."""
        now = time.perf_counter()
        mean = np.mean(self.window, axis=0)
        rate = examples_per_step * len(self.window) / max(now - self.window_start, 1e-9)
        bar.set_postfix(loss=f"{mean.mean():.4f}", examples_per_s=f"{rate:.1f}")
        logging.info("step %d: loss %s, %.1f examples/s", step, np.array2string(mean, precision=4), rate)
        for log, loss in zip(self.events, mean):
            log.log(step, {"train/loss": loss, "train/examples_per_s": rate})
        self.window, self.window_start = [], now

    def _evaluate(self, step: int) -> None:
        """Evaluates every run on every testset and its own training set; rewrites each metrics.npz."""
        num_runs = len(self.runs)
        margins = evaluate(
            self.eval_step, self.base_state, self.state.lora, self.data.eval_pool,
            place=lambda batch: sharding.shard_batch(batch, self.mesh, batch_axis=1),
        )
        train_loss = self.loss_sum / self.loss_steps if self.loss_steps else np.full(num_runs, np.nan)
        for r, (run, results, run_margins) in enumerate(zip(self.runs, self.results, margins)):
            accuracies = results.add(step, run_margins, train_loss[r])
            if self.primary:
                results.write()
                self.events[r].log(step, {f"accuracy/{name}": value for name, value in accuracies.items()})
            summary = ", ".join(f"{name} {value:.3f}" for name, value in accuracies.items())
            logging.info("step %d, %s: %s", step, run.name, summary)
        self.loss_sum, self.loss_steps = np.zeros(num_runs), 0

    def _checkpoint(self, step: int) -> None:
        loop_state = {
            "config": _comparable_config(self.config),
            "loss_sum": self.loss_sum.tolist(),
            "loss_steps": self.loss_steps,
        }
        self.checkpointer.save(step, self.state, self.data.streams, loop_state)
