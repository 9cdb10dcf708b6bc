"""LoRA adapters on a frozen base, and export in Hugging Face PEFT's format.

An adapter adds ``dropout(x) @ A @ B * alpha / rank`` to a projection's output,
initialised and computed as peft's ``lora.Linear`` (float32 whatever the base's
dtype), so an adapter trained here loads with ``peft.PeftModel.from_pretrained``.

Every adapter of a model shares one ``AdapterTokens``: which run each token
trains (a packed row may mix runs) and its identity. Dropout masks are a
function of (run key, step, layer, adapter, example, position, feature) alone,
so a run draws the same masks wherever its prompts sit and whatever trains
beside it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Hashable, Sequence
from typing import Any, Final, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from jax.extend.random import threefry2x32_p

from oodjax.models.layers import STACKED, Linear, per_layer_paths, recomputed_in_backward
from oodjax.settings import setting
from oodjax.usage_errors import ConfigError, DamagedInputError, MissingInputError


def _peft_a_init(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """peft's default A init, kaiming_uniform_(a=sqrt(5)) on its [rank, in] weight: bound = sqrt(6 / ((1 + a^2)
    * fan_in)) = 1 / sqrt(fan_in), i.e. variance scale 1/3; leading axes (the stacked layers) are batch axes."""
    init = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform", batch_axis=tuple(range(len(shape) - 2)))
    return init(key, shape, jnp.float32)


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

    rank: int = setting(8, path="lora.rank")  # inner dimension of each adapter (B @ A)
    alpha: float = setting(32.0, path="lora.alpha")  # the adapter output is scaled by alpha / rank
    dropout: float = setting(0.1, path="lora.dropout")  # dropout on the adapter input, training only
    # Names of the linear layers that get adapters (e.g. ("q_proj", "v_proj"));
    # empty = the model's attention projections q/k/v and the output
    # projection (OPT's out_proj, OLMo2/Llama's o_proj).
    targets: tuple[str, ...] | None = setting(None, path="lora.targets")

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

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# Dropout masks draw 16-bit uniforms, four per threefry2x32 hash: a rate is realised within 2**-17, where
# 8 bits would realise 0.1 as 0.1016. (Philox fails to compile on a sharded array.)
DROPOUT_BITS: Final = 16
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


def _threefry(key: jax.Array, counters: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """threefry2x32 of two uint32 counter arrays under ``key`` [..., 2], elementwise, so a mesh's layout never
    changes the values."""
    shape = jnp.broadcast_shapes(key.shape[:-1], counters[0].shape, counters[1].shape)
    words = [jnp.broadcast_to(x.astype(jnp.uint32), shape) for x in (key[..., 0], key[..., 1], *counters)]
    first, second = threefry2x32_p.bind(*words)
    return first, second


def dropout_keep_mask(token_keys: jax.Array, counters: jax.Array, width: int, rate: float) -> jax.Array:
    """Which elements dropout keeps: bool [..., width], each True with probability ``1 - rate``.

    Element (..., j) is a function of the key, the counter and j alone; four neighbours share one threefry
    hash, a quarter of what ``jax.random.bernoulli`` would spend.
    """
    threshold = np.uint32(dropout_threshold(rate))
    hashes = -(-width // _UNIFORMS_PER_HASH)
    along = jax.lax.broadcasted_iota(jnp.uint32, (*counters.shape, hashes), counters.ndim)
    first, second = _threefry(token_keys[..., None, :], (counters[..., None], along))
    uniforms = (first & 0xFFFF, first >> 16, second & 0xFFFF, second >> 16)
    keep = jnp.stack([uniform >= threshold for uniform in uniforms], axis=-1)
    return keep.reshape(*counters.shape, _UNIFORMS_PER_HASH * hashes)[..., :width]


def _dropped_out(x: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """``x`` where ``keep``, scaled by the inverse of the realised keep probability (so the expectation is
    exactly x; ``1 / (1 - rate)`` to within 2**-16 relative, as torch scales), zero elsewhere."""
    if keep is None:
        return x
    realised_keep = 1.0 - dropout_threshold(rate) / 2**DROPOUT_BITS
    return jnp.where(keep, x / realised_keep, 0)


class TokenIdentity(nnx.Variable[jax.Array]):
    """Per-token facts the train step gives the adapters (``AdapterTokens.set``); not a parameter."""


# A token's dropout counter is (its example's place in its run's batch) * 2**16 + (its position in the prompt).
_POSITION_BITS = 16


class AdapterTokens(nnx.Module):
    """What the adapters of a model know about the tokens they adapt: one module, shared by every ``LoRA``.

    Unset (evaluation), the adapters are one run's and dropout needs no token identity.
    """

    def __init__(self) -> None:
        self.stream = nnx.Rngs(dropout=0)
        self.runs: TokenIdentity | None = nnx.data(None)  # [...] int32: the run each token trains
        self.counters: TokenIdentity | None = nnx.data(None)  # [...] uint32: example * 2**16 + position
        self.run_keys: TokenIdentity | None = nnx.data(None)  # [R, 2] uint32: each run's dropout key this step

    def set(self, *, runs: jax.Array, examples: jax.Array, positions: jax.Array, run_keys: jax.Array) -> None:
        """Gives every token its run, and its identity for dropout: its example's place in its run's batch and
        its position in its prompt (both below 2**16); ``run_keys`` [R, 2] are the runs' keys for this step."""
        self.runs = TokenIdentity(runs.astype(jnp.int32))
        counters = (examples.astype(jnp.uint32) << _POSITION_BITS) | positions.astype(jnp.uint32)
        self.counters = TokenIdentity(counters)
        self.run_keys = TokenIdentity(run_keys.astype(jnp.uint32))

    def run_weights(self, shape: tuple[int, ...], num_runs: int) -> jax.Array:
        """[*shape, num_runs] float32: 1 where a token (of ``shape``, the activations' leading axes) trains that
        run, else 0; all ones for one run's adapters when no runs are set."""
        if self.runs is None:
            if num_runs != 1:
                raise ValueError(
                    f"adapters of {num_runs} runs need each token's run (AdapterTokens.set, as the train step does)"
                )
            return jnp.ones((*shape, 1), jnp.float32)
        self._check(self.runs, shape)
        return jax.nn.one_hot(self.runs[...], num_runs, dtype=jnp.float32)

    def keep_mask(self, shape: tuple[int, ...], rate: float) -> jax.Array:
        """The next dropout mask for activations of ``shape`` [..., width]: each token's run key, hashed with the
        stream's next draw, keys ``dropout_keep_mask`` at the token's counter."""
        if self.runs is None or self.counters is None or self.run_keys is None:
            raise ValueError(
                "LoRA dropout needs each token's run and identity (AdapterTokens.set, as the train step does); "
                "evaluation turns dropout off (nnx.view(model, deterministic=True))"
            )
        self._check(self.runs, shape[:-1])
        draw = jax.random.key_data(self.stream.dropout())
        run_keys = jnp.stack(_threefry(self.run_keys[...], (draw[0], draw[1])), axis=-1)  # [R, 2]
        return dropout_keep_mask(run_keys[self.runs[...]], self.counters[...], shape[-1], rate)

    def _check(self, runs: TokenIdentity, shape: tuple[int, ...]) -> None:
        if tuple(runs[...].shape) != tuple(shape):
            raise ValueError(
                f"adapter input of leading shape {tuple(shape)}; the tokens set are {tuple(runs[...].shape)}"
            )


class LoRADropout(nnx.Dropout):
    """``nnx.Dropout`` (so ``nnx.view(model, deterministic=True)`` turns it off) whose masks come from
    ``AdapterTokens.keep_mask``; ``keep_mask`` draws one without applying it, for the adapter to apply."""

    def keep_mask(self, shape: tuple[int, ...], *, tokens: AdapterTokens) -> jax.Array | None:
        """The next mask of ``tokens``' stream for an input of ``shape``; None when dropout is off."""
        return None if self.rate == 0.0 or self.deterministic else tokens.keep_mask(shape, self.rate)

    def __call__(self, inputs: jax.Array, *, tokens: AdapterTokens) -> jax.Array:  # type: ignore[override]
        """``inputs`` with the next mask applied (kept ones scaled as ``_dropped_out`` says), as they are when off."""
        return _dropped_out(inputs, self.keep_mask(inputs.shape, tokens=tokens), self.rate)


def _adapter_delta(
    x: jax.Array,
    keep: jax.Array | None,
    run_weights: jax.Array,
    a: jax.Array,
    b: jax.Array,
    *,
    rate: float,
    scale: float,
) -> jax.Array:
    """``dropout(x) @ A_r @ B_r * scale`` for each token's run r, in A's dtype, returned in x's.

    Every token goes through all R adapters (R x rank extra columns) and ``run_weights`` [..., R] keeps its
    own. The backward pass recomputes the dropped-out float32 input: left to autodiff, each adapter would
    keep its own float32 copy, twice the bytes of the bf16 x that q, k and v share.
    """

    def delta(x: jax.Array, keep: jax.Array | None, run_weights: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        low_rank = jnp.einsum("...i,rik->...rk", _dropped_out(x.astype(a.dtype), keep, rate), a)
        own = low_rank * run_weights[..., None].astype(a.dtype)
        return (jnp.einsum("...rk,rko->...o", own, b) * scale).astype(x.dtype)

    return recomputed_in_backward(delta)(x, keep, run_weights, a, b)


class LoRA(nnx.Module):
    """The low-rank update of one projection: ``dropout(x) @ A @ B * scale``.

    Merged with several runs' adapters ([R, in, rank]), each token takes its own run's. A [..., in, rank]
    and B [..., rank, out] inherit the adapted kernel's axes, so they are stacked and sharded like it.
    """

    def __init__(
        self,
        kernel_shape: tuple[int, ...],
        *,
        rank: int,
        scale: float,
        dropout: float,
        tokens: AdapterTokens,
        kernel_axes: tuple[str | None, ...] | None,
        rngs: nnx.Rngs,
    ):
        *lead, in_features, out_features = kernel_shape
        *lead_axes, in_axis, out_axis = kernel_axes if kernel_axes else (None,) * len(kernel_shape)
        a = _peft_a_init(rngs.params(), (*lead, in_features, rank))
        self.lora_a = nnx.LoRAParam(a, out_sharding=(*lead_axes, in_axis, None), eager_sharding=False)
        b = jnp.zeros((*lead, rank, out_features), jnp.float32)
        self.lora_b = nnx.LoRAParam(b, out_sharding=(*lead_axes, None, out_axis), eager_sharding=False)
        self.scale = scale
        self.dropout = LoRADropout(dropout)
        self.tokens = tokens

    def __call__(self, x: jax.Array) -> jax.Array:
        a, b = self.lora_a[...], self.lora_b[...]
        if a.ndim == 2:  # one run's adapter
            a, b = a[None], b[None]
        keep = self.dropout.keep_mask(x.shape, tokens=self.tokens)
        run_weights = self.tokens.run_weights(x.shape[:-1], a.shape[0])
        return _adapter_delta(x, keep, run_weights, a, b, rate=self.dropout.rate, scale=self.scale)


def adds_nothing(lora: nnx.State) -> bool:
    """Whether every B factor in ``lora`` is zero, so every run's model is the base model (step 0 then scores
    each example once for all runs)."""
    factors = [value[...] for path, value in nnx.to_flat_state(lora) if path[-1] == "lora_b"]
    return bool(factors) and all(bool(jnp.all(factor == 0)) for factor in factors)


def adapter_tokens(model: nnx.Module) -> AdapterTokens:
    """The ``AdapterTokens`` the adapters of ``model`` share (``apply_lora`` attaches them)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, AdapterTokens):
            return module
    raise ValueError("the model has no LoRA adapters (apply_lora attaches them)")


def find_targets(model: nnx.Module, targets: Sequence[str] | None) -> list[tuple[tuple[Hashable, ...], Linear]]:
    """The (path, Linear) pairs an adapter goes on, in module order; a target matching no layer (a typo, or
    OPT's ``out_proj`` vs Llama's ``o_proj``) fails rather than silently training fewer adapters."""
    linears = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Linear)]
    available = sorted({str(path[-1]) for path, _ in linears})
    if targets is None:
        names = [n for n in ATTENTION_PROJECTIONS if n in available]
        if not names:
            raise ValueError(
                f"model has none of the default LoRA targets {ATTENTION_PROJECTIONS}; its linear layers are {available}"
            )
    else:
        names = list(targets)
        missing = [n for n in names if n not in available]
        if missing:
            raise ValueError(
                f"LoRA targets {missing} match no linear layer of the model; its linear layers are {available}"
            )
    return [(path, m) for path, m in linears if path[-1] in names]


def _kernel_axes(linear: Linear) -> tuple[str | None, ...] | None:
    axes = linear.kernel.get_metadata().get("out_sharding")
    return tuple(axes) if axes else None


_Model = TypeVar("_Model", bound=nnx.Module)


def apply_lora(model: _Model, cfg: LoRAConfig, *, rngs: nnx.Rngs) -> _Model:
    """Attaches fresh adapters (replacing any) to the target layers, in place; returns the model.

    A's are drawn in module order, so a seed gives the same adapters whether a run trains alone or with others.
    """
    options: dict[str, Any] = dict(
        rank=cfg.rank, scale=cfg.scale, dropout=cfg.dropout, tokens=AdapterTokens(), rngs=rngs
    )
    for _, linear in find_targets(model, cfg.targets):
        linear.lora = nnx.data(LoRA(tuple(linear.kernel.shape), kernel_axes=_kernel_axes(linear), **options))
    return model


# peft names the two factors lora_A / lora_B and stores torch Linear weights [out, in].
_PEFT_NAMES = {"lora_a": "lora_A", "lora_b": "lora_B"}


def _peft_name(layer_path: Sequence[str], factor: Any) -> str:
    return f"base_model.model.{'.'.join(layer_path)}.{_PEFT_NAMES[factor]}.weight"


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
            tensors[_peft_name(layer_path, factor)] = np.ascontiguousarray(weight.T)
    return tensors


def export_peft(
    lora: nnx.State, cfg: LoRAConfig, path: str | pathlib.Path, *, base_model_name_or_path: str
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

    The targets are read from the tensors' names, since peft's ``target_modules`` may be a regex.
    """
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise MissingInputError(f"adapter folder {folder} does not exist")
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for required in (config_path, weights_path):
        if not required.is_file():
            inside = folder / "adapter"
            hint = f"; {inside} is one" if (inside / required.name).is_file() else ""
            raise MissingInputError(f"adapter folder {folder} has no {required.name} (not a PEFT adapter){hint}")
    try:
        adapter = json.loads(config_path.read_text())
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise DamagedInputError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(adapter, dict) or adapter.get("peft_type") != "LORA":
        kind = adapter.get("peft_type") if isinstance(adapter, dict) else None
        raise DamagedInputError(f"{config_path}: peft_type is {kind!r}; only LORA adapters load")
    for field, default in _PEFT_UNSUPPORTED.items():
        if adapter.get(field, default) not in (default, None, {}, False, "none"):
            raise DamagedInputError(f"{config_path}: {field}={adapter[field]!r} is not supported (only plain LoRA)")
    try:
        tensors = safetensors.numpy.load_file(str(weights_path))
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise DamagedInputError(f"{weights_path}: not a readable safetensors file ({error})") from None
    targets = tuple(sorted({name.split(".")[-3] for name in tensors}))
    if not targets:
        raise DamagedInputError(f"{weights_path} holds no tensors")
    try:
        cfg = LoRAConfig(
            rank=int(adapter["r"]),
            alpha=float(adapter["lora_alpha"]),
            dropout=float(adapter.get("lora_dropout", 0.0)),
            targets=targets,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise DamagedInputError(f"{config_path}: no usable r, lora_alpha and lora_dropout ({error!r})") from None
    ranks = {name: tensor.shape[0 if ".lora_A." in name else -1] for name, tensor in tensors.items()}
    other = {name: rank for name, rank in ranks.items() if rank != cfg.rank}
    if other:
        name, rank = next(iter(other.items()))
        raise DamagedInputError(
            f"{folder}: adapter_config.json says r={cfg.rank}, but {len(other)} tensors have another rank "
            f"({name} has rank {rank})"
        )
    return cfg, tensors


def lora_from_peft(lora_like: nnx.State, tensors: dict[str, np.ndarray], *, source: str) -> nnx.State:
    """One run's adapter state, shaped like ``lora_like``, from peft's tensors (``peft_tensors``' inverse).

    Every tensor must match one of the model's adapters and vice versa: a mismatch means another model's adapter.
    """
    remaining = dict(tensors)
    flat = []
    for path, value in nnx.to_flat_state(lora_like):
        *module_path, _, factor = path
        stacked = STACKED in map(str, module_path)
        layers = value.shape[0] if stacked else 1
        weights = []
        for layer_path in per_layer_paths(tuple(module_path), layers):
            name = _peft_name(layer_path, factor)
            if name not in remaining:
                raise ConfigError(f"{source}: adapter tensor {name} is missing (the model has this adapter)")
            weights.append(remaining.pop(name).T)
        array = np.stack(weights) if stacked else weights[0]
        if array.shape != tuple(value.shape):
            raise ConfigError(
                f"{source}: {'.'.join(map(str, path))} has shape {array.shape} in the file, {tuple(value.shape)} "
                "in the model (an adapter of another model?)"
            )
        flat.append((path, value.replace(jnp.asarray(array, dtype=value.dtype))))
    if remaining:
        raise ConfigError(f"{source}: {len(remaining)} tensors match no adapter of the model: {sorted(remaining)[:4]}")
    return nnx.from_flat_state(flat)
