"""Hugging Face checkpoints -> NNX models, one tensor at a time, straight onto their devices.

The model is first built abstractly (``nnx.eval_shape``: shapes, no memory);
each parameter is then filled from its tensor with ``jax.make_array_from_callback``,
which asks only for the slices each device holds, read from the file (only the
rows a slice covers), converted to the target dtype and transposed for linear
layers. So no full-precision copy of the model, nor of any sharded tensor,
exists on the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError
from jax.sharding import Mesh, Sharding, SingleDeviceSharding

from oodjax.models.checkpoint import PICKLE, PICKLE_INDEX, SAFETENSORS_INDEX, Checkpoint, open_checkpoint
from oodjax.models.config import DecoderConfig
from oodjax.models.layers import CausalLM
from oodjax.models.llama import LlamaForCausalLM
from oodjax.models.olmo2 import Olmo2ForCausalLM
from oodjax.models.opt import OPTForCausalLM
from oodjax.models.partitioning import param_sharding

# config.json's model_type -> the class that ports it (its ``config_class`` reads the config).
ARCHITECTURES: dict[str, type[CausalLM]] = {
    "opt": OPTForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "llama": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,
}

# Our parameter leaf name -> (HF's, whether HF stores it transposed).
_LEAF_NAMES = {
    "kernel": ("weight", True),
    "embedding": ("weight", False),
    "scale": ("weight", False),
    "bias": ("bias", False),
}

# transformers' base_model_prefix: checkpoints saved from the bare model lack it.
_BASE_PREFIX = "model."

# Buffers older transformers versions saved, which it ignores on load.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def config_from_dict(config: Mapping[str, Any], *, remat: bool = False) -> DecoderConfig:
    """The frozen config of the family ``config["model_type"]`` names, read from a config.json dict."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json: unknown model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type].config_class.from_hf(config, remat=remat)


def _float_dtype(dtype: Any) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating type such as 'float32' or 'bfloat16', got {dtype}")
    return dtype


def _build(config: DecoderConfig, dtype: jnp.dtype, seed: int | jax.Array) -> CausalLM:
    return ARCHITECTURES[config.model_type](config, dtype=dtype, rngs=nnx.Rngs(seed))


def from_config(
    config: Mapping[str, Any], *, dtype: Any = "float32", seed: int = 0, remat: bool = False
) -> CausalLM:
    """A randomly initialised model (HF's normal(0, 0.02) init) from a config.json dict; no checkpoint needed."""
    config, dtype = config_from_dict(config, remat=remat), _float_dtype(dtype)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: _build(config, dtype, 0)))
    # Parameters do not depend on remat, so both settings share one compiled initialiser.
    state = _initial_state(dataclasses.replace(config, remat=False), dtype, jax.random.key(seed))
    return nnx.merge(graphdef, state)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _initial_state(config: DecoderConfig, dtype: jnp.dtype, key: jax.Array) -> nnx.State:
    """All parameters initialised by one compiled program, compiled once per (config, dtype).

    Built eagerly, every initialiser would be compiled on its own, which is what takes time.
    """
    return nnx.state(_build(config, dtype, key))


def hf_parameter_name(path: tuple[Any, ...]) -> tuple[str, bool]:
    """``("model", "layers", 0, "mlp", "up_proj", "kernel")`` -> ``("model.layers.0.mlp.up_proj.weight", True)``.

    The bool says the checkpoint stores the tensor transposed ([out, in]).
    """
    *modules, leaf = path
    name, transposed = _LEAF_NAMES[leaf]
    return ".".join([*map(str, modules), name]), transposed


def _resolve(path: str | pathlib.Path, allow_pickle: bool) -> pathlib.Path:
    """A local folder as is; anything else is taken for a hub id and downloaded (weights and config only)."""
    local = pathlib.Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise NotADirectoryError(f"{local} is a file; load_pretrained needs a folder with config.json and weights")
    patterns = ["config.json", "*.safetensors", SAFETENSORS_INDEX]
    if allow_pickle:
        patterns += [PICKLE, "pytorch_model-*.bin", PICKLE_INDEX]
    try:
        return pathlib.Path(snapshot_download(str(path), allow_patterns=patterns))
    except (HFValidationError, HfHubHTTPError, LocalEntryNotFoundError) as error:
        raise OSError(
            f"{str(path)!r} is not a local folder, and fetching it from the Hugging Face hub failed "
            f"({type(error).__name__}: {error}). With HF_HUB_OFFLINE=1 only hub ids already in the cache load."
        ) from error


def _read_config(directory: pathlib.Path) -> dict[str, Any]:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    return json.loads(config_file.read_text())


def _checkpoint_names(checkpoint: Checkpoint) -> dict[str, str]:
    """Our (prefixed) name -> the checkpoint's name for every tensor it holds."""
    names = checkpoint.names()
    add_prefix = not any(name.startswith(_BASE_PREFIX) for name in names)
    return {
        (_BASE_PREFIX + name if add_prefix and not name.startswith("lm_head.") else name): name for name in names
    }


def _match(
    model: CausalLM, checkpoint: Checkpoint, directory: pathlib.Path
) -> list[tuple[nnx.Variable, str, bool]]:
    """Pair every parameter with its tensor; fail naming each missing, unexpected or misshapen tensor."""
    available = _checkpoint_names(checkpoint)
    pairs, missing, misshapen = [], [], []
    for path, variable in nnx.iter_graph(model):
        if not isinstance(variable, nnx.Param):
            continue
        name, transposed = hf_parameter_name(path)
        if name not in available:
            missing.append(name)
            continue
        stored = available.pop(name)
        expected = tuple(variable.shape[::-1] if transposed else variable.shape)
        if checkpoint.shape(stored) != expected:
            misshapen.append(
                f"{stored!r} in {checkpoint.file(stored)} has shape {checkpoint.shape(stored)}, expected {expected}"
            )
        pairs.append((variable, stored, transposed))
    ignorable = ("lm_head.weight",) if model.config.tie_word_embeddings else ()  # HF ties after loading
    unexpected = sorted(
        stored for name, stored in available.items() if name not in ignorable and not name.endswith(_IGNORED_SUFFIXES)
    )
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors (not used by model_type {model.config.model_type!r}): {unexpected}")
    if misshapen:
        problems.append("wrong shapes: " + "; ".join(misshapen))
    if problems:
        raise ValueError(f"checkpoint {directory} does not fit its config.json: " + " | ".join(problems))
    return pairs


def _place(
    checkpoint: Checkpoint, name: str, transposed: bool, shape: tuple[int, ...], dtype: jnp.dtype, sharding: Sharding
) -> jax.Array:
    """One parameter on its devices; each distinct block is read and converted once.

    Devices holding the same block (replicated dimensions) share one host copy,
    so a parameter never costs more host memory than itself in ``dtype``.
    """
    blocks: dict[tuple[tuple[int | None, ...], ...], np.ndarray] = {}

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in blocks:
            data = checkpoint.read(name, index[::-1] if transposed else index)
            blocks[key] = (data.T if transposed else data).astype(dtype)
        return blocks[key]

    return jax.make_array_from_callback(shape, sharding, block)


def load_pretrained(
    path: str | pathlib.Path,
    *,
    dtype: Any = "float32",
    mesh: Mesh | None = None,
    allow_pickle: bool = False,
    remat: bool = False,
) -> CausalLM:
    """Load a Hugging Face checkpoint (local folder or hub id) as an NNX model.

    The architecture comes from config.json's ``model_type``. Parameters are
    cast to ``dtype`` and, with a ``mesh`` (axes "data", "fsdp", "tensor"),
    placed on the shardings ``partitioning.LOGICAL_AXIS_RULES`` gives them;
    without one, on the default device. ``remat`` recomputes each decoder
    layer's activations in the backward pass to save memory.
    """
    dtype = _float_dtype(dtype)
    directory = _resolve(path, allow_pickle)
    config = config_from_dict(_read_config(directory), remat=remat)
    model = nnx.eval_shape(lambda: _build(config, dtype, seed=0))
    default_sharding = SingleDeviceSharding(jax.local_devices()[0])
    with contextlib.ExitStack() as stack:
        checkpoint = open_checkpoint(directory, allow_pickle=allow_pickle, stack=stack)
        for variable, name, transposed in _match(model, checkpoint, directory):
            sharding = param_sharding(variable, mesh) if mesh is not None else default_sharding
            variable.set_value(_place(checkpoint, name, transposed, tuple(variable.shape), dtype, sharding))
    return model
