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
function of (run, step, micro-batch).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from oodjax.models.layers import STACKED, Linear, per_layer_paths



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
        if self.targets is not None:
            if isinstance(self.targets, str) or not self.targets:
                raise ValueError(
                    f"LoRAConfig.targets must be a non-empty sequence of layer names, got {self.targets!r}"
                )
            object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


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
        self.dropout = nnx.Dropout(dropout)
        self.dropout_stream = dropout_stream

    def __call__(self, x: jax.Array) -> jax.Array:
        a, b = self.lora_a[...], self.lora_b[...]
        h = self.dropout(x.astype(a.dtype), rngs=self.dropout_stream)
        return ((h @ a) @ b * self.scale).astype(x.dtype)


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
