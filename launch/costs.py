"""Parameter counts, memory and FLOPs of a decoder LM from its config.json numbers, without allocating it.

Everything is read from our NNX port built abstractly (`architecture_model`), so the figures cannot drift from
what the engine trains; the memory the backward pass keeps is JAX's own list of the train step loss's residuals.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
import transformers
from flax import nnx
from jax.extend.core import Literal
from jax.extend.core.primitives import reduce_precision_p
from jax.sharding import AbstractMesh, AxisType

from configs.models import architecture as listed_architecture
from oodjax import models
from oodjax.data import TRAIN_KEYS
from oodjax.engine import steps
from oodjax.engine.sharding import MESH_AXES
from oodjax.models.layers import ATTENTION_PROJECTION, MLP_PROJECTION, REMAT_POLICIES, Linear
from oodjax.models.loading import ModelSettings
from oodjax.models.lora import LoRAConfig
from oodjax.usage_errors import ConfigError

# What each remat policy recomputes in the backward pass, of the forward pass's FLOPs (``ForwardFlops``'
# fields), keyed by the policies' names (``oodjax.models.layers.REMAT_POLICIES``; tests/test_launch_estimate.py
# holds the two alike): "full" the whole forward; "save_dots" only the attention scores and their product with
# the values (the projections' outputs are kept); "save_dots_except_mlp" those and the MLP's matmuls.
RECOMPUTED: Mapping[str, tuple[str, ...]] = {
    "none": (),
    "full": ("projections", "mlp", "adapters", "attention"),
    "save_dots": ("attention",),
    "save_dots_except_mlp": ("attention", "mlp"),
}
# What the step is compiled for: only "cpu" changes the memory model (see `stored_itemsize`).
PLATFORMS = ("gpu", "tpu", "cpu")
# The backward pass through one decoder layer holds the gradients of its widest activations
# (attention scores, the MLP's inner width) beside what the layer kept: about this fraction of the
# layer's activations without remat, fitted to XLA's compiled train steps of the study models (a trace gives
# what the forward keeps, not the peak of XLA's fused backward; only a compile for the device does).
BACKWARD_TEMPORARIES = 0.5
# The base's parameters without the adapters (a LoRAParam is a Param).
_FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


@dataclasses.dataclass(frozen=True)
class Dimensions:
    """The sizes that decide FLOPs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    q_dim: int  # num_heads * head_dim
    attention_parameters: int  # one decoder layer's attention projection weights (q, k, v and the output)
    mlp_parameters: int  # one decoder layer's MLP weights

    @property
    def layer_matmul_parameters(self) -> int:
        """Weights of one decoder layer's matrix multiplies (what costs FLOPs per token)."""
        return self.attention_parameters + self.mlp_parameters


def architecture_of(model: ModelSettings, layers: int | None = None) -> dict:
    """config.json numbers: the table's for a listed checkpoint, else the config's own random-model fields;
    ``layers`` replaces the decoder depth (what the estimate and the preflight cut a model to)."""
    if model.path:
        try:
            arch = dict(listed_architecture(model.path))
        except KeyError as error:  # a checkpoint configs/models.py does not list
            raise ConfigError(f"model.path: {error.args[0]}") from error
    elif model.hf_config:
        arch = dict(model.hf_config)
    else:
        raise ConfigError("config names neither model.path nor model.hf_config")
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"layers must be >= 1, got {layers}")
        arch["num_hidden_layers"] = layers
    return arch


def full_config(architecture: Mapping[str, Any]) -> transformers.PretrainedConfig:
    """The transformers config for these numbers, every unspecified field at its family default."""
    fields = dict(architecture)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"architecture needs a model_type; got fields {sorted(architecture)}")
    return transformers.AutoConfig.for_model(model_type, **fields)


def _key(architecture: Mapping[str, Any]) -> str:
    """The numbers as JSON: hashable, for the caches (the benchmarks count one model for every step they time)."""
    return json.dumps(dict(architecture), sort_keys=True)


def dimensions(architecture: Mapping[str, Any]) -> Dimensions:
    """The model's matmul sizes: a layer's weights are its kernels, split as the remat policies name their
    outputs (``Linear.saved_as``), so a family's MLP or fused projections need nothing here."""
    return _dimensions(_key(architecture))


@functools.cache
def _dimensions(architecture: str) -> Dimensions:
    model = architecture_model(json.loads(architecture))
    weights: collections.Counter[str] = collections.Counter()
    for _, linear in nnx.iter_modules(model):
        if isinstance(linear, Linear) and linear.saved_as:
            weights[linear.saved_as] += math.prod(linear.kernel.shape)
    config = model.config
    layers = config.num_hidden_layers
    return Dimensions(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=layers,
        q_dim=config.num_attention_heads * config.head_dim,
        attention_parameters=weights[ATTENTION_PROJECTION] // layers,
        mlp_parameters=weights[MLP_PROJECTION] // layers,
    )


def architecture_model(
    architecture: Mapping[str, Any],
    *,
    dtype: str = "float32",
    remat: str = "none",
    layers: int | None = None,
    lora: LoRAConfig | None = None,
) -> models.CausalLM:
    """Our port of these numbers (`models.abstract_model`), unspecified fields at transformers' defaults, as a
    checkpoint with this config.json loads; `layers` overrides the depth, `lora` attaches one run's adapters."""
    if layers is not None:
        architecture = dict(architecture, num_hidden_layers=layers)
    return models.abstract_model(full_config(architecture).to_dict(), dtype=dtype, remat=remat, lora=lora)


def _count(model: nnx.Module, kind: type[nnx.Variable]) -> int:
    """Elements of `model`'s variables of `kind` (LoRAParam is a Param: count a base before adapting it)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(model, kind)))


def parameter_count(architecture: Mapping[str, Any]) -> int:
    """Parameters of the model of these numbers (tied weights once), as transformers counts them."""
    return _count(architecture_model(architecture), nnx.Param)


def lora_parameter_count(architecture: Mapping[str, Any], rank: int, targets: Sequence[str] | None = None) -> int:
    """Adapter parameters of one run; `targets` None or empty means the attention projections."""
    lora = LoRAConfig(rank=rank, targets=tuple(targets) if targets else None)
    return _lora_parameter_count(_key(architecture), lora)


@functools.cache
def _lora_parameter_count(architecture: str, lora: LoRAConfig) -> int:
    return _count(architecture_model(json.loads(architecture), lora=lora), nnx.LoRAParam)


@dataclasses.dataclass(frozen=True)
class ForwardFlops:
    """FLOPs of a forward pass through the decoder layers, by what computes them (the head is apart:
    ``head_flops``). Multiply-adds count 2; norms, activations and softmax are left out."""

    projections: float  # the attention's q, k, v and output projections (frozen weights)
    mlp: float  # the MLP's matrices (frozen weights)
    adapters: float  # the LoRA adapters' products
    attention: float  # the scores (q.k) and their product with the values

    @property
    def total(self) -> float:
        return self.projections + self.mlp + self.adapters + self.attention

    @property
    def backward(self) -> float:
        """LoRA's backward pass: the frozen weights need only activation gradients (one product each), the
        attention and the adapters two."""
        return self.projections + self.mlp + 2 * self.attention + 2 * self.adapters


def forward_flops(d: Dimensions, *, tokens: int, attention_pairs: int, adapter_parameters: int = 0) -> ForwardFlops:
    """``tokens`` tokens through the decoder layers and all runs' adapters, attention over ``attention_pairs``
    (query, key) pairs: 2 FLOPs per token and weight, 4 per pair, query feature and layer."""
    return ForwardFlops(
        projections=2.0 * d.num_layers * d.attention_parameters * tokens,
        mlp=2.0 * d.num_layers * d.mlp_parameters * tokens,
        adapters=2.0 * adapter_parameters * tokens,
        attention=4.0 * d.num_layers * d.q_dim * attention_pairs,
    )


def head_flops(d: Dimensions, columns: int) -> float:
    """The head at one position: the final hidden state times ``columns`` columns of the vocabulary."""
    return 2.0 * d.hidden_size * columns


def train_step_flops(
    d: Dimensions, *, runs: int, rows: int, seq_len: int, prompts: int, lora_parameters: int, remat: str
) -> float:
    """One optimizer step of all runs: ``rows`` rows of ``seq_len`` tokens, padding included; ``lora_parameters``
    are one run's.

    Attention covers the whole row (packed prompts are masked, not skipped) and every token goes through all
    runs' adapters. The backward pass also recomputes the adapters' forward (counted whole: an upper bound)
    and what the remat policy did not keep.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; known: {sorted(REMAT_POLICIES)}")
    tokens = rows * seq_len
    forward = forward_flops(
        d, tokens=tokens, attention_pairs=tokens * seq_len, adapter_parameters=runs * lora_parameters
    )
    recomputed = sum(getattr(forward, part) for part in RECOMPUTED[remat])
    head = 2 * head_flops(d, d.vocab_size) * prompts
    return forward.total + forward.backward + forward.adapters + recomputed + head


def eval_flops(d: Dimensions, rows: Mapping[int, int], adapter_parameters: int) -> float:
    """FLOPs of scoring ``rows`` (row length -> rows), every row through ``adapter_parameters`` adapter weights:
    all runs', as the eval step computes every run's adapters on each row and keeps its own
    (``oodjax.models.lora``). The head reads two columns: negligible."""
    return sum(
        count * forward_flops(d, tokens=n, attention_pairs=n * n, adapter_parameters=adapter_parameters).total
        for n, count in rows.items()
    )


# --------------------------------------------------------------------------- memory


def abstract_mesh(mesh: Mapping[str, int]) -> AbstractMesh:
    """A device-free mesh of these axis sizes, for asking how the rules split an array."""
    sizes = tuple(int(mesh[axis]) for axis in MESH_AXES)
    return AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def stored_itemsize(dtype: Any, platform: str) -> int:
    """Bytes an element of `dtype` takes in the compiled step on `platform`: XLA's CPU backend computes
    half precision in float32, so it keeps float32 residuals."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; known: {PLATFORMS}")
    dtype = jnp.dtype(dtype) if isinstance(dtype, str) else dtype  # not PRNG key dtypes: jnp.dtype refuses them
    return max(dtype.itemsize, 4) if platform == "cpu" and jnp.issubdtype(dtype, jnp.floating) else dtype.itemsize


def bytes_per_device(state: nnx.State, mesh: AbstractMesh, *, leading: int = 1) -> int:
    """Bytes one device holds of `state` placed by the logical axis rules (`models.param_sharding`).

    A dimension the mesh does not divide stays whole, as the loader keeps it. `leading` multiplies every
    leaf by a replicated leading axis (the runs' stack).
    """
    total = 0
    for variable in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        shard = models.param_sharding(variable, mesh).shard_shape(tuple(variable.shape))
        total += leading * math.prod(shard) * jnp.dtype(variable.dtype).itemsize
    return total


def saved_activation_bytes(
    make_model: Callable[[], nnx.Module],
    lora: LoRAConfig,
    *,
    runs: int,
    rows: int,
    seq_len: int,
    prompts_per_row: int = 1,
    compute_dtype: str | None = None,
    platform: str = "gpu",
) -> int:
    """Bytes the backward pass keeps from the forward of one micro-batch, as `platform` stores them: the
    residuals of the train step's own loss on its own arguments (``steps.step_loss``), with `runs` runs'
    adapters attached as the engine attaches them (``steps.abstract_attach_runs``); only traced, so a full-size
    batch costs nothing."""
    graphdef, base, state = steps.abstract_attach_runs(make_model, range(runs), lora, optax.identity())
    batch = abstract_batch((1, rows, seq_len), (1, rows, prompts_per_row), TRAIN_KEYS)
    dtype = jnp.dtype(compute_dtype) if compute_dtype else None
    kept = []

    def measure(base: nnx.State, state: steps.TrainState, batch: Mapping[str, jax.Array]) -> jax.Array:
        loss, (lora, base, *rest) = steps.step_loss(
            base, state, batch, graphdef=graphdef, yes_id=0, no_id=1, compute_dtype=dtype
        )
        micro = {key: value[0] for key, value in batch.items()}
        kept.extend(residuals(lambda lora: loss(lora, base, micro, *rest)[0], lora))
        return jnp.zeros(())

    jax.eval_shape(measure, base, state, batch)
    return sum(aval.size * stored_itemsize(aval.dtype, platform) for aval in kept)


def abstract_batch(
    tokens: tuple[int, ...], prompts: tuple[int, ...], keys: Sequence[str], placed: Any = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of shapes only: token leaves of shape `tokens`, per-prompt ones of `prompts`, on `placed`."""
    shapes = {"input_ids": tokens, "segment_ids": tokens}
    return {
        key: jax.ShapeDtypeStruct(shapes.get(key, prompts), jnp.bool_ if key == "valid" else jnp.int32, sharding=placed)
        for key in keys
    }


def residuals(f: Any, *args: Any) -> list[jax.core.ShapedArray]:
    """What `jax.vjp(f, *args)` keeps that is new memory: not the arguments, the constants (counted apart as
    the step's arguments) or literals."""
    closed, shapes = jax.make_jaxpr(lambda *args: jax.vjp(f, *args), return_shape=True)(*args)
    jaxpr = closed.jaxpr
    given = {*jaxpr.invars, *jaxpr.constvars}
    through = {eqn.outvars[0]: eqn.invars[0] for eqn in jaxpr.eqns if eqn.primitive is reduce_precision_p}
    kept = jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(shapes[1])) :]
    return [v.aval for v in kept if not isinstance(v, Literal) and through.get(v, v) not in given]


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device during training, by what holds them.

    The first six are live through the whole step; of the two transients (one layer's backward pass, the
    head's logits) only the larger counts.
    """

    frozen_weights: float  # this device's shard of the base
    upcast_weights: float  # CPU only: the float32 copy of the layers' weights XLA multiplies by
    adapters: float  # every run's adapters (float32)
    gradients: float  # every run's adapter gradients, accumulated over the micro-batches (float32)
    optimizer_state: float  # AdamW's two moments of every run (float32)
    activations: float  # what the backward pass saves from the forward of one micro-batch (all runs' tokens)
    layer_transients: float  # one layer's backward: gradient temporaries, its recomputation, its gathered weights
    head_transients: float  # the head's weights gathered from fsdp shards (and their float32 copy on CPU)

    @property
    def total(self) -> float:
        """The peak: everything live throughout, plus the larger of the two transients."""
        steady = (self.frozen_weights, self.upcast_weights, self.adapters, self.gradients, self.optimizer_state)
        return sum(steady) + self.activations + max(self.layer_transients, self.head_transients)


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What one micro-batch's backward pass keeps, split by what it scales with (bytes)."""

    per_row_layer: int  # activations per row, per decoder layer
    per_row_outside: int  # activations per row, outside the layers
    fixed_layer: int  # per decoder layer, what does not grow with the batch (derived from the adapters)
    fixed_outside: int  # the same outside the layers (a tied head's transposed embedding)
    layer_weights: int  # one decoder layer's parameters, unsharded


@functools.cache
def _measure(architecture: str, lora: LoRAConfig, *, dtype: str, remat: str, **shape: Any) -> _Measured:
    """`saved_activation_bytes` taken apart: 2 layers minus 1 isolates a layer, two rows minus one what grows
    with the batch; ``shape`` is its other keywords (runs, seq_len, prompts_per_row, compute_dtype, platform)."""
    whole = abstract_mesh(dict(data=1, fsdp=1, tensor=1))
    saved, weights = {}, {}
    for layers in (1, 2):
        make = functools.partial(architecture_model, json.loads(architecture), dtype=dtype, remat=remat, layers=layers)
        for rows in (1, 2):
            saved[layers, rows] = saved_activation_bytes(make, lora, rows=rows, **shape)
        weights[layers] = bytes_per_device(nnx.state(make(), nnx.Param), whole)
    per_row = {layers: saved[layers, 2] - saved[layers, 1] for layers in (1, 2)}
    fixed = {layers: saved[layers, 1] - per_row[layers] for layers in (1, 2)}
    return _Measured(
        per_row_layer=per_row[2] - per_row[1],
        per_row_outside=2 * per_row[1] - per_row[2],
        fixed_layer=fixed[2] - fixed[1],
        fixed_outside=2 * fixed[1] - fixed[2],
        layer_weights=weights[2] - weights[1],
    )


def train_memory_per_device(
    architecture: Mapping[str, Any],
    lora: LoRAConfig,
    *,
    dtype: str,
    compute_dtype: str | None = None,
    remat: str,
    mesh: Mapping[str, int],
    runs: int,
    rows: int,
    seq_len: int,
    prompts_per_row: int = 1,
    platform: str = "gpu",
) -> Memory:
    """Training memory of one device for a mesh {"data", "fsdp", "tensor"}; a micro-batch's `rows` (all
    devices') are split over data x fsdp.

    Tensor parallelism is taken to split activations evenly (an upper bound on its saving: the residual
    stream is replicated). With fsdp a layer's backward pass holds its weights gathered whole.
    """
    shards = mesh["data"] * mesh["fsdp"]
    if rows % shards:
        raise ValueError(f"a micro-batch of {rows} rows does not split over data x fsdp = {shards} devices")
    devices = abstract_mesh(mesh)
    model = architecture_model(architecture, dtype=dtype, remat=remat, lora=lora)
    adapters = bytes_per_device(nnx.state(model, nnx.LoRAParam), devices, leading=runs)
    layers = full_config(architecture).num_hidden_layers
    shape = dict(
        runs=runs, seq_len=seq_len, prompts_per_row=prompts_per_row, compute_dtype=compute_dtype, platform=platform
    )
    key = _key(architecture)
    kept = _measure(key, lora, dtype=dtype, remat=remat, **shape)
    full_layer = _measure(key, lora, dtype=dtype, remat="none", **shape).per_row_layer
    per_device = rows // shards  # rows of a micro-batch on each device
    head = nnx.eval_shape(lambda model: model.head_kernel(), model)
    head_weights = math.prod(head.shape) * jnp.dtype(dtype).itemsize / mesh["tensor"]
    # Weights are multiplied as stored on GPU and TPU; on CPU, from a float32 copy.
    widening = stored_itemsize(dtype, platform) / jnp.dtype(dtype).itemsize
    upcast = widening if widening > 1 else 0.0
    gathered = 1 - 1 / mesh["fsdp"]
    # A tied head's transposed embedding fuses into its matmul, but from fsdp shards it is gathered
    # first, and the gathered copy is kept for the backward pass.
    sharded = mesh["fsdp"] > 1
    recomputed = remat != "none"
    return Memory(
        frozen_weights=bytes_per_device(nnx.state(model, _FROZEN), devices),
        upcast_weights=layers * kept.layer_weights / (mesh["fsdp"] * mesh["tensor"]) * upcast,
        adapters=adapters,
        gradients=adapters,
        optimizer_state=2 * adapters,
        activations=(
            layers * (per_device * kept.per_row_layer + kept.fixed_layer)
            + per_device * kept.per_row_outside
            + sharded * kept.fixed_outside
        )
        / mesh["tensor"],
        layer_transients=(per_device * full_layer * (BACKWARD_TEMPORARIES + recomputed) + kept.layer_weights * gathered)
        / mesh["tensor"],
        head_transients=head_weights * (gathered + upcast),
    )
