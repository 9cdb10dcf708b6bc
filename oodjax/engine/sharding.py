"""The device mesh, and where batches, the frozen base and the runs' state live on it.

Parameters are placed by their logical axis names through the one rules
table, ``oodjax.models.partitioning``; adapters and optimizer moments take
their projection's, behind a replicated run axis. In a multi-process job no
process addresses the whole mesh, so each supplies only its devices' blocks:
``place`` for state every process computed identically, ``shard_batch`` for
a batch every process holds whole, ``shard_process_batch`` for one of which
each holds its own rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from oodjax.models.partitioning import LOGICAL_AXIS_RULES, logical_to_spec
from oodjax.settings import setting
from oodjax.usage_errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES: tuple[str, ...] = tuple(dict(LOGICAL_AXIS_RULES)["batch"] or ())


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The mesh a job asks for; one size may be -1, "whatever the others leave", which ``sizes`` resolves
    for the engine, the estimator and the preflight alike."""

    data: int = setting(-1, path="mesh.data")  # data parallel: each holds the whole (frozen) model
    # fully sharded data parallel: splits the batch and the parameters
    fsdp: int = setting(1, path="mesh.fsdp")
    tensor: int = setting(1, path="mesh.tensor")  # tensor parallel: splits each layer's matrices

    def __post_init__(self) -> None:
        sizes = dataclasses.astuple(self)
        if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
            raise ConfigError(f"mesh sizes (data, fsdp, tensor) = {sizes}: each must be >= 1, at most one -1")

    def sizes(self, devices: int) -> dict[str, int]:
        """The axis sizes on ``devices`` devices; a mesh that leaves devices idle is an error."""
        sizes = list(dataclasses.astuple(self))
        if -1 in sizes:
            known = math.prod(s for s in sizes if s != -1)
            if devices % known:
                raise ConfigError(f"mesh sizes {tuple(sizes)}: {devices} devices are not divisible by {known}")
            sizes[sizes.index(-1)] = devices // known
        if math.prod(sizes) != devices:
            raise ConfigError(
                f"mesh sizes (data, fsdp, tensor) = {tuple(sizes)} need {math.prod(sizes)} devices; there are {devices}"
            )
        return dict(zip(MESH_AXES, sizes))

    def make(self, devices: list[jax.Device] | None = None) -> Mesh:
        return make_mesh(self.data, self.fsdp, self.tensor, devices=devices)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices: list[jax.Device] | None = None) -> Mesh:
    """A mesh of ``devices`` (default: all), sized by ``MeshShape``."""
    devices = list(jax.devices()) if devices is None else list(devices)
    sizes = MeshShape(data, fsdp, tensor).sizes(len(devices))
    return jax.make_mesh(tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place(tree: Any, shardings: Any) -> Any:
    """Puts every leaf of ``tree``, the same in every process, on its sharding; each process fills its devices."""

    def put(leaf: Any, target: NamedSharding) -> jax.Array:
        if isinstance(leaf, jax.Array) and leaf.committed and leaf.sharding.is_equivalent_to(target, leaf.ndim):
            return leaf
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(jax.random.key_data(leaf), target), impl=jax.random.key_impl(leaf))
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, target, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def batch_shards(mesh: Mesh) -> int:
    """The number of devices a batch's example axis is split over."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def batch_sharding(mesh: Mesh, batch_axis: int) -> NamedSharding:
    """Where a batch lives: split along ``batch_axis`` over the batch axes, whole along the others."""
    return NamedSharding(mesh, PartitionSpec(*([None] * batch_axis), BATCH_AXES))


def shard_batch(batch: Mapping[str, Any], mesh: Mesh, *, batch_axis: int = 0) -> dict[str, jax.Array]:
    """Puts ``batch``, held whole by every process, on ``mesh``, split along ``batch_axis``."""
    ways, where = batch_shards(mesh), batch_sharding(mesh, batch_axis)
    must = f"exist and be divisible by {ways} (mesh axes {BATCH_AXES})"
    arrays = _arrays(batch, batch_axis, lambda rows: rows % ways == 0, "batch", must)
    return {key: jax.make_array_from_callback(value.shape, where, value.__getitem__) for key, value in arrays.items()}


def _arrays(
    batch: Mapping[str, Any], axis: int, fits: Callable[[int], bool], name: str, must: str
) -> dict[str, np.ndarray]:
    """``batch``'s leaves as numpy arrays, each checked to have an ``axis`` whose size ``fits``."""
    arrays = {key: np.asarray(value) for key, value in batch.items()}
    for key, value in arrays.items():
        if value.ndim <= axis or not fits(value.shape[axis]):
            raise ValueError(f"{name}[{key!r}] has shape {value.shape}: axis {axis} must {must}")
    return arrays


def process_batch_rows(mesh: Mesh, num_rows: int) -> np.ndarray:
    """The rows of a batch axis of ``num_rows`` that this process's devices hold, sorted.

    So the global batch is the one a single process would build: the same
    examples on the same devices, hence the same dropout masks and results.
    """
    ways = batch_shards(mesh)
    if num_rows < 1 or num_rows % ways:
        raise ValueError(
            f"a batch of {num_rows} rows cannot be split evenly over {ways} devices (mesh axes {BATCH_AXES})"
        )
    indices = batch_sharding(mesh, 0).addressable_devices_indices_map((num_rows,)).values()
    return np.unique(np.concatenate([np.arange(num_rows)[index] for index in indices]))


def shard_process_batch(
    local_batch: Mapping[str, Any], mesh: Mesh, *, batch_axis: int, num_rows: int
) -> dict[str, jax.Array]:
    """The global batch from this process's rows of it (``process_batch_rows``, in order)."""
    rows, where = len(process_batch_rows(mesh, num_rows)), batch_sharding(mesh, batch_axis)
    must = f"hold this process's {rows} of {num_rows} rows (process {jax.process_index()} of {jax.process_count()})"
    arrays = _arrays(local_batch, batch_axis, lambda local: local == rows, "local batch", must)
    return {
        key: jax.make_array_from_process_local_data(
            where, value, (*value.shape[:batch_axis], num_rows, *value.shape[batch_axis + 1 :])
        )
        for key, value in arrays.items()
    }


def _stacked_sharding(leaf: Any, mesh: Mesh) -> Any:
    """A run-stacked leaf: a Variable keeps its (unstacked) logical names, the run axis is replicated."""
    if isinstance(leaf, nnx.Variable):
        names = leaf.get_metadata().get("out_sharding")
        if not names:
            return leaf.replace(replicated(mesh))
        return leaf.replace(NamedSharding(mesh, logical_to_spec((None, *names), tuple(leaf.shape), mesh)))
    return replicated(mesh)


def runs_shardings(runs: Any, mesh: Mesh) -> Any:
    """NamedShardings for a run-stacked tree (a ``TrainState``)."""
    return jax.tree.map(lambda x: _stacked_sharding(x, mesh), runs, is_leaf=lambda x: isinstance(x, nnx.Variable))
