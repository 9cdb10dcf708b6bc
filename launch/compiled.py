"""A job's real train and eval steps on abstract inputs of its real geometry, lowered and compiled.

The step factories, geometry and shardings `python -m oodjax.main` uses (``steps.make_steps``, ``set_up``), on
the config's mesh; nothing of the model is read or allocated. The preflight compiles them; the lowering tests
lower them for other platforms.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from launch import costs, hlo
from launch.prompts import study_testsets
from oodjax import models
from oodjax.config_read import Job
from oodjax.data import EVAL_KEYS, TRAIN_KEYS
from oodjax.engine import sharding, steps
from oodjax.engine.cadence import RunGroup
from oodjax.engine.geometry import BatchGeometry
from oodjax.engine.setup import set_up
from oodjax.models import flash_attention
from oodjax.models.partitioning import param_shardings
from oodjax.usage_errors import UsageError


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's per-device bytes of a compiled step (``compiled.memory_analysis()``); ``total`` is what lives at once
    when donated inputs are reused for outputs."""

    argument: int
    output: int
    temp: int
    alias: int
    total: int


@dataclasses.dataclass(frozen=True)
class Communication:
    """What one run of a compiled step's collectives sends per device (``communication``), and in how long over
    the estimate device's interconnect."""

    bytes: int
    by_op: dict[str, int]
    loops_without_trip_count: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    lower_s: float
    compile_s: float
    memory_bytes: CompiledMemory
    collectives: dict[str, dict[str, int]]  # ``collectives``
    communication: Communication
    kernels: int  # Pallas kernels compiled into the program (Mosaic's on a TPU: ``hlo.kernels``)


@dataclasses.dataclass
class AbstractSteps:
    """A job's real train and eval steps (``steps.MeshStep``s) and the abstract arguments of their real
    geometry, with what they were made from."""

    train_step: Any
    eval_step: Any
    train_args: tuple[Any, ...]
    eval_args: tuple[Any, ...]
    geometry: BatchGeometry
    data: Any
    arch: dict[str, Any]
    longest_rows: dict[str, np.ndarray]


class OutOfMemory(UsageError):
    """The compiler refused a step for want of the device's memory: the preflight's verdict, in one line."""


def largest_group(job: Job) -> RunGroup:
    """The run group the preflight compiles: the most runs (the most memory), then the longest."""
    return max(job.groups, key=lambda group: (len(group.runs), group.total_steps))


def abstract_steps(job: Job, *, devices: Sequence[jax.Device], layers: int | None) -> AbstractSteps:
    """The steps ``preflight`` compiles, on ``devices`` (this machine's, or a TPU slice's compile-only ones:
    ``launch.topologies``) and the model cut to ``layers``; also lowered for other platforms
    (``tests/test_lowering_accelerators.py``)."""
    mesh = job.mesh.make(list(devices))
    arch = costs.architecture_of(job.model, layers)
    # a local sample at the hub's size, as a job reads it
    group = largest_group(job)
    setup = set_up(job, mesh, group.runs, group.total_steps, prefetch=0, testsets=study_testsets)
    geometry, data, (yes_id, no_id) = setup.geometry, setup.data, setup.answer_ids
    assert geometry is not None and data is not None  # set up for the group's runs, with their testsets
    seeds = [run.seed for run in group.runs]
    # The evaluation batch [R, rows, row length] compiled is the pool's longest rows': batches share a token
    # budget, so those hold the most attention scores.
    longest_rows = max(data.eval_pool.batches, key=lambda batch: batch["input_ids"].shape[-1])
    eval_batch = costs.abstract_batch(
        longest_rows["input_ids"].shape, longest_rows["answer_pos"].shape, EVAL_KEYS, sharding.batch_sharding(mesh, 1)
    )

    def make_model() -> models.CausalLM:
        return models.abstract_model(arch, dtype=job.model.dtype, remat=job.model.remat, attention=job.model.attention)

    assert group.optimizer is not None  # a group read from a config trains
    graphdef, base, state = steps.abstract_attach_runs(make_model, seeds, job.lora, group.optimizer.transformation)
    train_step, eval_step = steps.make_steps(
        group.optimizer, job.model.compute_dtype, geometry, graphdef, base, state, yes_id, no_id, mesh
    )
    base_in = _with_shardings(base, param_shardings(base, mesh))
    runs_in = _with_shardings(state, sharding.runs_shardings(state, mesh))
    train_args, eval_args = (base_in, runs_in, train_batch(geometry, mesh)), (base_in, runs_in.lora, eval_batch)
    return AbstractSteps(train_step, eval_step, train_args, eval_args, geometry, data, arch, longest_rows)


def train_batch(geometry: BatchGeometry, mesh: jax.sharding.Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """An abstract training batch of ``geometry``'s shape, sharded as the loop shards it (rows over the batch
    axes)."""
    rows = geometry.train_rows_shape
    placed = sharding.batch_sharding(mesh, 1)
    return costs.abstract_batch((*rows, geometry.seq_len), (*rows, geometry.prompts_per_row), TRAIN_KEYS, placed)


def _with_shardings(tree: Any, shardings: Any) -> Any:
    """Abstract leaves carrying their shardings, as lowering takes them."""
    return jax.tree.map(lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree, shardings)


def compile_step(
    name: str, step: Any, args: tuple[Any, ...], hlo_dir: pathlib.Path | None, interconnect_bytes_per_s: float
) -> CompiledStep:
    """Lowers and compiles ``step`` on ``args`` for their devices' platform (``model.attention=auto`` picks that
    platform's kernel, not this machine's): times, per-device memory, collectives, kernels."""
    start = time.perf_counter()
    with flash_attention.target_platform(step.mesh.devices.flat[0].platform):
        lowered = step.lower(*args)
    lowered_at = time.perf_counter()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        # The TPU compiler refuses a program larger than the chip's memory, where other backends compile it.
        if not str(error).startswith("RESOURCE_EXHAUSTED"):
            raise
        raise OutOfMemory(f"the {name} step DOES NOT FIT: {str(error).removeprefix('RESOURCE_EXHAUSTED: ')}") from None
    compiled_at = time.perf_counter()
    text = compiled.as_text()
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{name}_step.hlo.txt").write_text(text)
    stats = compiled.memory_analysis()
    argument, output, temp = (
        int(size) for size in (stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.temp_size_in_bytes)
    )
    alias = int(stats.alias_size_in_bytes)
    moved = hlo.communication(text)
    return CompiledStep(
        lower_s=lowered_at - start,
        compile_s=compiled_at - lowered_at,
        memory_bytes=CompiledMemory(argument, output, temp, alias, total=argument + output + temp - alias),
        collectives=hlo.collectives(text),
        communication=Communication(**moved, seconds=moved["bytes"] / interconnect_bytes_per_s),
        kernels=hlo.kernels(text),
    )
