"""Logical axis names -> mesh axes, in one table (MaxText style), for parameters and activations.

Constraining the activations too is what makes ``fsdp`` FSDP: each device
computes its own rows and all-gathers one layer's weights at a time, instead
of the compiler gathering activations and all-reducing activation-sized
partial sums. Changing the parallelism layout means changing this table,
nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

LOGICAL_AXIS_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # parameters
    ("layers", None),  # the stacked decoder layers' leading axis (scanned over)
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("norm", None),
    ("positions", None),
    ("word_embed", None),
    # activations and batches
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
)

# A decoder's hidden states [batch, length, width] between and inside layers.
HIDDEN = ("batch", "length", "activation_embed")
# Per-head activations [batch, length, heads, head_dim], the MLP's inner width, and per-token ids [batch, length].
QUERY_HEADS = ("batch", "length", "activation_heads", None)
KV_HEADS = ("batch", "length", "activation_kv_heads", None)
MLP_HIDDEN = ("batch", "length", "activation_mlp")
TOKENS = ("batch", "length")


def logical_to_spec(
    logical_axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh | AbstractMesh
) -> PartitionSpec:
    """The PartitionSpec for an array of ``shape`` whose dimensions carry ``logical_axes``.

    A dimension the mesh axes do not divide (a 50257-token vocabulary), or whose axis an earlier dimension
    uses, is replicated, so any checkpoint loads on any mesh.
    """
    rules = dict(LOGICAL_AXIS_RULES)
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name, size in zip(logical_axes, shape, strict=True):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule in LOGICAL_AXIS_RULES ({sorted(rules)})")
        targets = rules.get(name) if name is not None else None
        targets = (targets,) if isinstance(targets, str) else tuple(targets or ())
        targets = tuple(axis for axis in targets if axis in mesh.shape and axis not in used)
        if not targets or size % math.prod(mesh.shape[axis] for axis in targets):
            spec.append(None)
            continue
        used.update(targets)
        spec.append(targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*spec)


def check_mesh(mesh: Mesh | AbstractMesh) -> None:
    """Refuses Explicit mesh axes (``jax.make_mesh``'s default): the models rely on GSPMD, which needs Auto."""
    explicit = [name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Auto]
    if explicit:
        raise ValueError(
            f"mesh axes {explicit} are not AxisType.Auto; build the mesh with "
            f"jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * {len(mesh.axis_names)})"
        )


def param_sharding(variable: nnx.Variable, mesh: Mesh | AbstractMesh) -> NamedSharding:
    """Where one (possibly abstract) parameter lives on ``mesh``; unannotated ones are replicated."""
    check_mesh(mesh)
    logical_axes = variable.get_metadata().get("out_sharding")
    if not logical_axes:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_to_spec(tuple(logical_axes), tuple(variable.shape), mesh))


def param_shardings(abstract_state: Any, mesh: Mesh) -> Any:
    """``abstract_state`` with each value replaced by its NamedSharding."""
    return jax.tree.map(
        lambda v: v.replace(param_sharding(v, mesh)), abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """``x`` constrained to the sharding its logical axes give on the ``jax.set_mesh`` mesh; without one, ``x``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(mesh.axis_names) >= {"data", "fsdp", "tensor"}:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))
