"""The device mesh, and where batches, the frozen base and the runs' state live on it.

The mesh has three axes, ("data", "fsdp", "tensor"). Parameters are placed by
their logical axis names through the one rules table in
``oodjax.models.partitioning``; adapters and optimizer moments inherit the
names of the projection they adapt, behind a replicated run axis. Batches are
split along their example axis over the axes the table gives "batch".

``shard_batch`` takes the whole global batch in one process. With several
processes (``oodjax.engine.distributed``) each would hold only its share and
build the global array with ``jax.make_array_from_process_local_data``; that
is issue 5's part, not built here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from oodjax.models.partitioning import LOGICAL_AXIS_RULES, logical_to_spec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES: tuple[str, ...] = tuple(dict(LOGICAL_AXIS_RULES)["batch"])


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices: list | None = None) -> Mesh:
    """A mesh of ``devices`` (default: all) with axes ("data", "fsdp", "tensor").

    One size may be -1: it takes whatever the others leave. The sizes must use
    every device, so a mis-sized config fails here rather than idling hardware.
    """
    devices = list(jax.devices()) if devices is None else list(devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes (data, fsdp, tensor) = {tuple(sizes)}: each must be >= 1, at most one -1")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if len(devices) % known:
            raise ValueError(f"mesh sizes {tuple(sizes)}: {len(devices)} devices are not divisible by {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh sizes (data, fsdp, tensor) = {tuple(sizes)} need {math.prod(sizes)} devices; "
            f"there are {len(devices)}"
        )
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_batch(batch: Mapping[str, Any], mesh: Mesh, *, batch_axis: int = 0) -> dict[str, jax.Array]:
    """Puts each array of ``batch`` on ``mesh``, split along ``batch_axis`` over the batch axes.

    ``batch_axis`` is 0 for eval batches [B, S] and 2 for train batches
    [R, grad_accum, B, S]. The example count must divide evenly.
    """
    ways = math.prod(mesh.shape[axis] for axis in BATCH_AXES)
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.ndim <= batch_axis or value.shape[batch_axis] % ways:
            raise ValueError(
                f"batch[{key!r}] has shape {value.shape}: axis {batch_axis} must exist and be divisible by "
                f"{ways} (mesh axes {BATCH_AXES})"
            )
        spec = PartitionSpec(*([None] * batch_axis), BATCH_AXES)
        out[key] = jax.device_put(value, NamedSharding(mesh, spec))
    return out


def _stacked_sharding(leaf: Any, mesh: Mesh) -> Any:
    """A run-stacked leaf: a Variable keeps its (unstacked) logical names, the run axis is replicated."""
    if isinstance(leaf, nnx.Variable):
        names = leaf.get_metadata().get("out_sharding")
        if not names:
            return leaf.replace(replicated(mesh))
        return leaf.replace(NamedSharding(mesh, logical_to_spec((None, *names), tuple(leaf.shape), mesh)))
    return replicated(mesh)


def runs_shardings(runs: Any, mesh: Mesh) -> Any:
    """NamedShardings for a ``RunsState`` (or any run-stacked tree): adapters and optimizer moments
    sharded like their projection, counters and keys replicated."""
    return jax.tree.map(lambda x: _stacked_sharding(x, mesh), runs, is_leaf=lambda x: isinstance(x, nnx.Variable))
