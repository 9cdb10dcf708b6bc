"""LoRA adapters on a frozen base, and export in Hugging Face PEFT's format.

An adapter adds ``dropout(x) @ A @ B * alpha / rank`` to a projection's output,
exactly as peft's ``lora.Linear`` does, so an adapter trained here can be
loaded onto the PyTorch model with ``peft.PeftModel.from_pretrained``. A is
drawn like peft's default (kaiming-uniform with a = sqrt(5)), B starts at zero,
so a fresh adapter leaves the model's outputs unchanged.

The adapter parameters are ``nnx.LoRAParam`` (a subclass of ``nnx.Param``), so
``nnx.split(model, nnx.LoRAParam, ...)`` separates them from the frozen base;
they are kept in float32 whatever the base's dtype, as peft does.

Dropout keys come from ONE stream shared by every adapter of a model: each
call draws the next key from it, so the adapters of q, k and v (which see the
same input) get independent masks, and a training step only has to reseed
that one stream (``nnx.reseed(model, dropout=key)``) to make dropout a pure
function of (run, step, micro-batch). The masks themselves take a quarter of
the threefry hashes ``jax.random.bernoulli`` would (``dropout_keep_mask``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from jax.extend.random import threefry2x32_p

from oodjax.models.layers import STACKED, Linear, per_layer_paths, recomputed_in_backward



def _peft_a_init(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """peft's default A init, kaiming_uniform_(a=sqrt(5)) on its [rank, in] weight: bound = sqrt(6 / ((1 + a^2)
    * fan_in)) = 1 / sqrt(fan_in), i.e. variance scale 1/3; leading axes (the stacked layers) are batch axes."""
    batch_axis = tuple(range(len(shape) - 2))
    return nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform", batch_axis=batch_axis)(
        key, shape, jnp.float32
    )

# Attention projections adapted by default: q/k/v and the output projection,
# which OPT calls out_proj and OLMo2/Llama call o_proj. Phi-3 keeps q/k/v fused
# as qkv_proj: one adapter on it, as peft puts one there.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "out_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """What an adapter looks like; the study's defaults (r=8, alpha=32, dropout 0.1, q/k/v/o).

    ``targets`` are names of ``Linear`` attributes (e.g. ``("q_proj", "v_proj")``);
    None means the model's attention projections (``ATTENTION_PROJECTIONS`` it has).
    """

    rank: int = 8
    alpha: float = 32.0
    dropout: float = 0.1
    targets: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank > 0):
            raise ValueError(f"LoRAConfig.rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        dropout_threshold(self.dropout)  # a rate the 16-bit masks realise
        if self.targets is not None:
            if isinstance(self.targets, str) or not self.targets:
                raise ValueError(
                    f"LoRAConfig.targets must be a non-empty sequence of layer names, got {self.targets!r}"
                )
            object.__setattr__(self, "targets", tuple(self.targets))

    @classmethod
    def from_config(cls, lora: Any) -> LoRAConfig:
        """The adapters a config's ``lora`` section describes (rank, alpha, dropout, targets; () = the default
        targets): the one reading of that section, which the config checks use to refuse a bad one early."""
        return cls(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(lora.targets) or None)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# Dropout masks draw 16-bit uniforms: a rate is realised in steps of 2**-16 (0.1 as 6554 / 65536, within
# 2**-17 of it), and four of them come from each threefry2x32 hash (its two 32-bit output words split in
# halves; the hash is ``jax.extend.random.threefry2x32_p``, the primitive jax.random's threefry binds), where
# ``jax.random.bernoulli`` hashes once per element and keeps 23 bits of it: a quarter of the hashes, ~5x
# faster on a CPU for a [16, 256, 4096] mask. (8-bit uniforms would halve the hashes again but realise 0.1 as
# 26 / 256 = 0.1016; Philox, jax.random's "philox4x32", fails to compile on a sharded array in JAX 0.10.2.)
DROPOUT_BITS = 16
_UNIFORMS_PER_HASH = 64 // DROPOUT_BITS


def dropout_threshold(rate: float) -> int:
    """The 16-bit uniforms below this drop their element: ``rate * 2**16`` rounded, so the realised rate is
    ``dropout_threshold(rate) / 2**16``; an error for a non-zero rate that would round to 0 or to 1."""
    threshold = round(rate * 2**DROPOUT_BITS)
    if rate != 0 and not 0 < threshold < 2**DROPOUT_BITS:
        raise ValueError(
            f"dropout rate {rate!r} is realised as {threshold} / 2**{DROPOUT_BITS} (masks draw {DROPOUT_BITS}-bit "
            f"uniforms): use 0, or a rate from 2**-{DROPOUT_BITS + 1} to 1 - 2**-{DROPOUT_BITS + 1}"
        )
    return threshold


def _threefry_words(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Both 32-bit words threefry2x32 hashes each counter of ``shape`` to under ``key``.

    Element (i..., j) hashes the counter (flat index of i..., j): a function
    of the key and the element's index alone, elementwise, so the SPMD
    partitioner splits the draw like any elementwise op and a mesh's layout
    never changes the values (``jax.random``'s partitionable threefry does
    the same, then XORs the two words into one).
    """
    data = jax.random.key_data(key)
    if data.shape[-1:] != (2,):
        raise ValueError(
            f"LoRA dropout draws from threefry2x32 keys (jax_default_prng_impl's default); got a key of "
            f"{jax.random.key_impl(key)}"
        )
    *lead, last = shape
    if math.prod(lead) > 2**32 or last > 2**32:
        raise ValueError(f"a dropout mask of shape {shape} has more rows or columns than 32-bit counters number")
    leading = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(lead))):
        leading = leading + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= lead[axis]
    along = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
    first, second = threefry2x32_p.bind(data[0], data[1], leading, along)
    return first, second


def dropout_keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Which elements dropout keeps: a bool array of ``shape``, each True with probability ``1 - rate`` (as
    ``dropout_threshold`` realises it), independently.

    ``key`` is a key of the dropout stream (folded per run, step, micro-batch,
    layer and adapter), so the mask is a pure function of those five indices
    and of nothing else (not the mesh: ``_threefry_words``). Four consecutive
    elements of the last axis share one hash, one 16-bit quarter each
    (``DROPOUT_BITS``); ``tests/test_lora.py`` checks the rate and the
    independence of masks and of neighbours statistically.
    """
    threshold = np.uint32(dropout_threshold(rate))
    *lead, width = shape
    hashes = -(-width // _UNIFORMS_PER_HASH)
    first, second = _threefry_words(key, (*lead, hashes))
    uniforms = (first & 0xFFFF, first >> 16, second & 0xFFFF, second >> 16)
    keep = jnp.stack([uniform >= threshold for uniform in uniforms], axis=-1)
    return keep.reshape(*lead, _UNIFORMS_PER_HASH * hashes)[..., :width]


def _dropped_out(x: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """``x`` where ``keep``, scaled by the inverse of the realised keep probability (so the expectation is
    exactly x; ``1 / (1 - rate)`` to within 2**-16 relative, as torch scales), zero elsewhere."""
    if keep is None:
        return x
    realised_keep = 1.0 - dropout_threshold(rate) / 2**DROPOUT_BITS
    return jnp.where(keep, x / realised_keep, 0)


class LoRADropout(nnx.Dropout):
    """``nnx.Dropout`` (so ``nnx.view(model, deterministic=True)`` turns it off) whose masks come from
    ``dropout_keep_mask``; ``keep_mask`` draws one without applying it, for the adapter to apply."""

    def keep_mask(self, shape: tuple[int, ...], *, rngs: nnx.Rngs) -> jax.Array | None:
        """The next mask of ``rngs``' dropout stream for an input of ``shape``; None when dropout is off."""
        if self.rate == 0.0 or self.deterministic:
            return None
        return dropout_keep_mask(rngs[self.rng_collection](), shape, self.rate)

    def __call__(self, inputs: jax.Array, *, rngs: nnx.Rngs) -> jax.Array:  # type: ignore[override]
        """``inputs`` with the next mask applied (kept ones scaled as ``_dropped_out`` says), as they are when off."""
        return _dropped_out(inputs, self.keep_mask(inputs.shape, rngs=rngs), self.rate)


def _adapter_delta(
    x: jax.Array, keep: jax.Array | None, a: jax.Array, b: jax.Array, *, rate: float, scale: float
) -> jax.Array:
    """``dropout(x) @ A @ B * scale`` in A's dtype, returned in x's.

    Its backward pass keeps x, the mask and the factors, and recomputes the
    dropped-out float32 input from them (``recomputed_in_backward``): left to
    autodiff, each adapter would keep its own float32 copy of it, twice the
    bytes of the bf16 x (which q, k and v share), plus a float32 zeros
    array. The recomputation adds ``dropout(x) @ A``, a rank-wide matmul.
    """

    def delta(x: jax.Array, keep: jax.Array | None, a: jax.Array, b: jax.Array) -> jax.Array:
        return ((_dropped_out(x.astype(a.dtype), keep, rate) @ a) @ b * scale).astype(x.dtype)

    return recomputed_in_backward(delta)(x, keep, a, b)


class LoRA(nnx.Module):
    """The low-rank update of one projection: ``dropout(x) @ A @ B * scale``.

    Computes in the adapter's dtype (float32) and returns the input's dtype, as
    peft does for a bf16 base. ``kernel_shape`` and ``kernel_axes`` are the
    adapted kernel's ``[..., in, out]`` (leading axes: the stacked layers);
    A [..., in, rank] inherits the leading and input axes, B [..., rank, out]
    the leading and output axes, so adapters are stacked and sharded like the
    projection they adapt (placed by the engine, hence ``eager_sharding=False``).
    """

    def __init__(
        self,
        kernel_shape: tuple[int, ...],
        *,
        rank: int,
        scale: float,
        dropout: float,
        dropout_stream: nnx.Rngs,
        kernel_axes: tuple | None,
        rngs: nnx.Rngs,
    ):
        *lead, in_features, out_features = kernel_shape
        *lead_axes, in_axis, out_axis = kernel_axes if kernel_axes else (None,) * len(kernel_shape)
        self.lora_a = nnx.LoRAParam(
            _peft_a_init(rngs.params(), (*lead, in_features, rank)),
            out_sharding=(*lead_axes, in_axis, None),
            eager_sharding=False,
        )
        self.lora_b = nnx.LoRAParam(
            jnp.zeros((*lead, rank, out_features), jnp.float32),
            out_sharding=(*lead_axes, None, out_axis),
            eager_sharding=False,
        )
        self.scale = scale
        self.dropout = LoRADropout(dropout)
        self.dropout_stream = dropout_stream

    def __call__(self, x: jax.Array) -> jax.Array:
        keep = self.dropout.keep_mask(x.shape, rngs=self.dropout_stream)
        return _adapter_delta(x, keep, self.lora_a[...], self.lora_b[...], rate=self.dropout.rate, scale=self.scale)


def find_targets(model: nnx.Module, targets: Sequence[str] | None) -> list[tuple[tuple, Linear]]:
    """The (path, Linear) pairs an adapter goes on, in the model's module order.

    Each named target must match at least one layer, so a typo (or OPT's
    ``out_proj`` vs Llama's ``o_proj``) fails loudly instead of silently
    training fewer adapters than asked for.
    """
    linears = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Linear)]
    available = sorted({str(path[-1]) for path, _ in linears})
    if targets is None:
        names = [n for n in ATTENTION_PROJECTIONS if n in available]
        if not names:
            raise ValueError(
                f"model has none of the default LoRA targets {ATTENTION_PROJECTIONS}; "
                f"its linear layers are {available}"
            )
    else:
        names = list(targets)
        missing = [n for n in names if n not in available]
        if missing:
            raise ValueError(
                f"LoRA targets {missing} match no linear layer of the model; its linear layers are {available}"
            )
    return [(path, m) for path, m in linears if path[-1] in names]


def _kernel_axes(linear: Linear) -> tuple | None:
    axes = linear.kernel.get_metadata().get("out_sharding")
    return tuple(axes) if axes else None


def apply_lora(model: nnx.Module, cfg: LoRAConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """Attaches fresh adapters (replacing any) to the target layers, in place; returns the model.

    A's are drawn from ``rngs.params()`` in module order and the dropout stream
    is seeded from ``rngs.dropout()``, so the same seed gives the same adapters
    whether a run is trained alone or with others.
    """
    dropout_stream = nnx.Rngs(dropout=rngs.dropout())
    for _, linear in find_targets(model, cfg.targets):
        linear.lora = nnx.data(
            LoRA(
                tuple(linear.kernel.shape),
                rank=cfg.rank,
                scale=cfg.scale,
                dropout=cfg.dropout,
                dropout_stream=dropout_stream,
                kernel_axes=_kernel_axes(linear),
                rngs=rngs,
            )
        )
    return model


# peft names the two factors lora_A / lora_B and stores torch Linear weights [out, in].
_PEFT_NAMES = {"lora_a": "lora_A", "lora_b": "lora_B"}


def peft_tensors(lora: nnx.State) -> dict[str, np.ndarray]:
    """One run's adapters as peft's safetensors dict (``base_model.model.<hf path>.lora_A.weight``).

    Relies on the models mirroring Hugging Face module paths: the stacked
    layers' slice i of ``model.decoder.layers.self_attn.q_proj`` is the PyTorch
    module ``model.decoder.layers.i.self_attn.q_proj``.
    """
    tensors = {}
    for path, value in nnx.to_flat_state(lora):
        *module_path, lora_module, factor = path
        if lora_module != "lora" or factor not in _PEFT_NAMES:
            raise ValueError(f"not a LoRA adapter parameter: {'.'.join(map(str, path))}")
        array = np.asarray(jax.device_get(value[...]), dtype=np.float32)
        stacked = STACKED in map(str, module_path)
        if array.ndim != 2 + stacked:
            raise ValueError(
                f"{'.'.join(map(str, path))} has shape {array.shape}; export one run at a time (select_run)"
            )
        layer_paths = per_layer_paths(tuple(module_path), array.shape[0] if stacked else 1)
        for layer_path, weight in zip(layer_paths, array if stacked else array[None], strict=True):
            name = ".".join(layer_path)
            tensors[f"base_model.model.{name}.{_PEFT_NAMES[factor]}.weight"] = np.ascontiguousarray(weight.T)
    return tensors


def export_peft(
    lora: nnx.State,
    cfg: LoRAConfig,
    path: str | pathlib.Path,
    *,
    base_model_name_or_path: str,
) -> pathlib.Path:
    """Writes adapter_config.json + adapter_model.safetensors that ``PeftModel.from_pretrained`` loads."""
    tensors = peft_tensors(lora)
    target_modules = sorted({key.split(".")[-3] for key in tensors})
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    safetensors.numpy.save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


# adapter_config.json fields whose non-default values change what the adapter computes beyond
# ``x @ A @ B * alpha / r``; an adapter that sets one is refused rather than evaluated wrongly.
_PEFT_UNSUPPORTED = {
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "layers_to_transform": None,
}


def read_peft(path: str | pathlib.Path) -> tuple[LoRAConfig, dict[str, np.ndarray]]:
    """A PEFT LoRA adapter folder (``export_peft``'s, or peft's ``save_pretrained``): its LoRAConfig and tensors.

    The targets are read from the tensors' names (``target_modules`` may be a
    regex in peft); dropout is kept but evaluation does not use it.
    """
    folder = pathlib.Path(path)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for required in (config_path, weights_path):
        if not required.is_file():
            raise FileNotFoundError(f"adapter folder {folder} has no {required.name} (not a PEFT adapter)")
    try:
        adapter = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from error
    if adapter.get("peft_type") != "LORA":
        raise ValueError(f"{config_path}: peft_type is {adapter.get('peft_type')!r}; only LORA adapters load")
    for field, default in _PEFT_UNSUPPORTED.items():
        if adapter.get(field, default) not in (default, None, {}, False, "none"):
            raise ValueError(f"{config_path}: {field}={adapter[field]!r} is not supported (only plain LoRA)")
    try:
        tensors = safetensors.numpy.load_file(str(weights_path))
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{weights_path}: not a readable safetensors file ({error})") from error
    targets = tuple(sorted({name.split(".")[-3] for name in tensors}))
    if not targets:
        raise ValueError(f"{weights_path} holds no tensors")
    cfg = LoRAConfig(
        rank=int(adapter["r"]), alpha=float(adapter["lora_alpha"]), dropout=float(adapter.get("lora_dropout", 0.0)),
        targets=targets,
    )  # fmt: skip
    return cfg, tensors


def lora_from_peft(lora_like: nnx.State, tensors: dict[str, np.ndarray], *, source: str) -> nnx.State:
    """One run's adapter state, shaped like ``lora_like``, filled from peft's tensors (``peft_tensors``' inverse).

    Every tensor is accounted for: an adapter the model lacks, or one of the
    model's adapters missing from the file, is an error naming it and
    ``source``, as is a shape that differs.
    """
    remaining = dict(tensors)
    flat = []
    for path, value in nnx.to_flat_state(lora_like):
        *module_path, _, factor = path
        stacked = STACKED in map(str, module_path)
        layers = value.shape[0] if stacked else 1
        weights = []
        for layer_path in per_layer_paths(tuple(module_path), layers):
            name = f"base_model.model.{'.'.join(layer_path)}.{_PEFT_NAMES[factor]}.weight"
            if name not in remaining:
                raise ValueError(f"{source}: adapter tensor {name} is missing (the model has this adapter)")
            weights.append(remaining.pop(name).T)
        array = np.stack(weights) if stacked else weights[0]
        if array.shape != tuple(value.shape):
            raise ValueError(
                f"{source}: {'.'.join(map(str, path))} has shape {array.shape} in the file, {tuple(value.shape)} "
                "in the model (another rank or another model?)"
            )
        flat.append((path, value.replace(jnp.asarray(array, dtype=value.dtype))))
    if remaining:
        raise ValueError(f"{source}: {len(remaining)} tensors match no adapter of the model: {sorted(remaining)[:4]}")
    return nnx.from_flat_state(flat)
