"""Hugging Face checkpoints -> NNX models, one parameter at a time, straight onto their devices.

The model is built abstractly, then each parameter is filled from its
tensors into the blocks this process's devices hold. Each tensor is read
once per process, only the rows its devices need, so an fsdp- or
tensor-sharded block never costs a re-read; the host holds at most this
process's share of one parameter and one layer's tensor at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from huggingface_hub import HfApi, is_offline_mode, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError, HTTPError, OfflineModeIsEnabled, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id
from jax.sharding import Mesh, Sharding, SingleDeviceSharding

from oodjax.models.config import DecoderConfig
from oodjax.models.flash_attention import IMPLEMENTATIONS
from oodjax.models.gemma import GemmaForCausalLM
from oodjax.models.hf_checkpoint import CONFIG, Checkpoint, files_to_download, open_checkpoint, read_json, weight_map
from oodjax.models.layers import STACKED, CausalLM, check_remat, per_layer_paths
from oodjax.models.llama import LlamaForCausalLM
from oodjax.models.lora import LoRAConfig, apply_lora
from oodjax.models.olmo2 import Olmo2ForCausalLM
from oodjax.models.opt import OPTForCausalLM
from oodjax.models.partitioning import param_sharding
from oodjax.settings import setting
from oodjax.usage_errors import ConfigError, DamagedInputError, MissingInputError, NotFetchedError

# config.json's model_type -> the class that ports it (its ``config_class`` reads the config).
ARCHITECTURES: dict[str, type[CausalLM]] = {
    "opt": OPTForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    **dict.fromkeys(("llama", "smollm3", "qwen2", "qwen3", "mistral", "phi3"), LlamaForCausalLM),
    **dict.fromkeys(("gemma2", "gemma3_text"), GemmaForCausalLM),
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


def config_from_dict(config: Mapping[str, Any], *, remat: str = "none", attention: str = "auto") -> DecoderConfig:
    """The frozen config of a config.json dict's family, with the engine's choices that change no parameter."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json: unknown model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    return dataclasses.replace(ARCHITECTURES[model_type].config_class.from_hf(config, remat=remat), attention=attention)


def _float_dtype(dtype: Any) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating type such as 'float32' or 'bfloat16', got {dtype}")
    return dtype


def _build(config: DecoderConfig, dtype: jnp.dtype, seed: int | jax.Array) -> CausalLM:
    return ARCHITECTURES[config.model_type](config, dtype=dtype, rngs=nnx.Rngs(seed))


def from_config(
    config: Mapping[str, Any], *, dtype: Any = "float32", seed: int = 0, remat: str = "none", attention: str = "auto"
) -> CausalLM:
    """A randomly initialised model (HF's normal(0, 0.02) init) from a config.json dict; no checkpoint needed."""
    decoder, dtype = config_from_dict(config, remat=remat, attention=attention), _float_dtype(dtype)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: _build(decoder, dtype, 0)))
    # Parameters depend on neither remat nor attention, so every choice shares one compiled initialiser.
    state = _initial_state(dataclasses.replace(decoder, remat="none", attention="auto"), dtype, jax.random.key(seed))
    return nnx.merge(graphdef, state)


def abstract_model(
    config: Mapping[str, Any],
    *,
    dtype: Any = "bfloat16",
    remat: str = "none",
    attention: str = "auto",
    lora: LoRAConfig | None = None,
) -> CausalLM:
    """The model of a config.json dict with ``jax.ShapeDtypeStruct`` parameters (with ``lora``, its adapters)."""
    decoder, dtype = config_from_dict(config, remat=remat, attention=attention), _float_dtype(dtype)
    if lora is None:
        return nnx.eval_shape(lambda: _build(decoder, dtype, 0))
    return nnx.eval_shape(lambda: apply_lora(_build(decoder, dtype, 0), lora, rngs=nnx.Rngs(0)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _initial_state(config: DecoderConfig, dtype: jnp.dtype, key: jax.Array) -> nnx.State:
    """All parameters initialised by one compiled program: eagerly, every initialiser compiles on its own."""
    return nnx.state(_build(config, dtype, key))


def hf_parameter_names(path: tuple[Any, ...], num_layers: int) -> tuple[list[str], bool]:
    """The checkpoint's names for the tensors of our parameter at ``path`` (one per layer where stacked), and
    whether it stores them [out, in]."""
    *modules, leaf = path
    name, transposed = _LEAF_NAMES[leaf]
    return [".".join([*layer_path, name]) for layer_path in per_layer_paths(tuple(modules), num_layers)], transposed


def _resolve(path: str | pathlib.Path) -> pathlib.Path:
    """A local folder as is; a hub id's ``files_to_download``, downloaded or, with the hub out of reach, cached."""
    local = pathlib.Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise NotADirectoryError(f"{local} is a file; load_pretrained needs a folder with config.json and weights")
    repo = str(path)
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise MissingInputError(f"{repo!r} is neither a local folder nor a hub id (owner/name)") from None
    listing = None if is_offline_mode() else _hub_listing(repo)
    if listing is None:
        return _cached_snapshot(repo)
    try:
        wanted = files_to_download(listing)
    except FileNotFoundError as error:
        raise MissingInputError(f"hub repository {repo!r}: {error}") from None
    return pathlib.Path(snapshot_download(repo, allow_patterns=wanted))


def _hub_listing(repo: str) -> list[str] | None:
    """The files of the hub repository ``repo``'s main branch, or None when the hub cannot be reached."""
    try:
        return HfApi().list_repo_files(repo)
    except RepositoryNotFoundError as error:  # gated and private repositories too: the user's to fix
        raise MissingInputError(
            f"{repo!r} is neither a local folder nor a repository the Hugging Face hub lets us read "
            f"({type(error).__name__}: {error})"
        ) from error
    except (OfflineModeIsEnabled, HTTPError) as error:  # no network, or the hub is down
        logging.warning("the Hugging Face hub cannot be reached (%s); trying the local cache", error)
        return None


def _cached_snapshot(repo: str) -> pathlib.Path:
    """The cached copy of hub repository ``repo``, checked to hold what the loader reads (offline the
    listing is unknown, so the cached folder's own files are chosen from)."""
    cached_config = try_to_load_from_cache(repo, CONFIG)
    if not isinstance(cached_config, str):
        raise NotFetchedError(
            f"{repo!r} is not a local folder, and with the hub out of reach (HF_HUB_OFFLINE, or no network) the "
            "Hugging Face cache has no copy of it either"
        )
    directory = pathlib.Path(cached_config).parent
    try:
        wanted = files_to_download(entry.name for entry in directory.iterdir() if entry.is_file())
        for index in (name for name in wanted if name.endswith(".index.json")):
            weight_map(directory, index)
    except FileNotFoundError as error:
        raise NotFetchedError(
            f"{repo!r}: its copy in the Hugging Face cache is incomplete ({error}), and the hub is out of reach "
            "(HF_HUB_OFFLINE, or no network)"
        ) from None
    return directory


def _read_config(directory: pathlib.Path) -> dict[str, Any]:
    config_file = directory / CONFIG
    if not config_file.is_file():
        raise MissingInputError(f"{directory} has no config.json")
    return read_json(config_file)


def _checkpoint_names(checkpoint: Checkpoint) -> dict[str, str]:
    """Our (prefixed) name -> the checkpoint's name for every tensor it holds."""
    names = checkpoint.weight_map
    add_prefix = not any(name.startswith(_BASE_PREFIX) for name in names)
    return {(_BASE_PREFIX + name if add_prefix and not name.startswith("lm_head.") else name): name for name in names}


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where one parameter's values come from: one tensor, or one per layer for a stacked parameter."""

    variable: nnx.Variable
    names: list[str]  # the checkpoint's names, in layer order when stacked
    transposed: bool
    stacked: bool


def _match(model: CausalLM, checkpoint: Checkpoint, directory: pathlib.Path) -> list[_Source]:
    """Pair every parameter with its tensors; fail naming each missing, unexpected or misshapen tensor."""
    available = _checkpoint_names(checkpoint)
    sources: list[_Source] = []
    missing: list[str] = []
    misshapen: list[str] = []
    for path, variable in nnx.iter_graph(model):
        if not isinstance(variable, nnx.Param):
            continue
        names, transposed = hf_parameter_names(path, model.config.num_hidden_layers)
        stacked = STACKED in map(str, path)
        shape = tuple(variable.shape[1:] if stacked else variable.shape)
        expected = shape[::-1] if transposed else shape
        missing += [name for name in names if name not in available]
        stored_names = [available.pop(name) for name in names if name in available]
        misshapen += [
            f"{stored!r} in {checkpoint.weight_map[stored]} has shape {checkpoint.shape(stored)}, expected {expected}"
            for stored in stored_names
            if checkpoint.shape(stored) != expected
        ]
        sources.append(_Source(variable, stored_names, transposed, stacked))
    ignorable = ("lm_head.weight",) if model.config.tie_word_embeddings else ()  # HF ties after loading
    unexpected = sorted(
        stored for name, stored in available.items() if name not in ignorable and not name.endswith(_IGNORED_SUFFIXES)
    )
    problems = [
        f"{what}: {found}"
        for what, found in [
            ("missing tensors", missing),
            (f"unexpected tensors (not used by model_type {model.config.model_type!r})", unexpected),
            ("wrong shapes", "; ".join(misshapen)),
        ]
        if found
    ]
    if problems:
        raise DamagedInputError(f"checkpoint {directory} does not fit its config.json: " + " | ".join(problems))
    return sources


Bounds = tuple[tuple[int, int], ...]


def _bounds(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Bounds:
    """A device's block as (start, stop) per dimension (shardings give unit-step slices)."""
    assert index is not None  # jax's type allows None, but the shardings here index every device
    return tuple(s.indices(size)[:2] for s, size in zip(index, shape, strict=True))


def _place(checkpoint: Checkpoint, source: _Source, dtype: jnp.dtype, sharding: Sharding) -> jax.Array:
    """One parameter on its devices, each tensor read once over the region covering every block that needs
    it: read per device block, an fsdp-sharded tensor would be read once per device."""
    shape = tuple(source.variable.shape)
    blocks = {
        bounds: np.empty([stop - start for start, stop in bounds], dtype)
        for bounds in {_bounds(index, shape) for index in sharding.addressable_devices_indices_map(shape).values()}
    }
    lead = 1 if source.stacked else 0  # the layer axis is not a dimension of the stored tensors
    for layer, name in enumerate(source.names):
        holders = [b for b in blocks if not source.stacked or b[0][0] <= layer < b[0][1]]
        if not holders:
            continue
        region = tuple((min(b[d][0] for b in holders), max(b[d][1] for b in holders)) for d in range(lead, len(shape)))
        index = tuple(slice(start, stop) for start, stop in region)
        data = checkpoint.read(name, index[::-1] if source.transposed else index)
        data = (data.T if source.transposed else data).astype(dtype)
        for bounds in holders:
            within = tuple(slice(start - low, stop - low) for (start, stop), (low, _) in zip(bounds[lead:], region))
            target = blocks[bounds][layer - bounds[0][0]] if source.stacked else blocks[bounds]
            target[...] = data[within]
    return jax.make_array_from_callback(shape, sharding, lambda index: blocks[_bounds(index, shape)])


DTYPES = ("float32", "bfloat16", "float16")  # a job's model.dtype and model.compute_dtype


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The frozen base a job uses (its model section and tokenizer, resolved)."""

    # Local checkpoint directory (config.json + safetensors) or a hub id.
    # Leave empty to build a randomly initialised model from `hf_config`.
    path: str | None = setting(None, path="model.path")
    # A transformers-style config (model_type, hidden_size, ...) for a random
    # model; used only when `path` is empty (demo, tests, benchmarks).
    hf_config: Mapping[str, Any] = setting({}, path="model.hf_config")
    # Seed of the random initialisation from `hf_config`.
    init_seed: int = setting(0, path="model.init_seed")
    # Short model name used in run directory names; empty = derived from
    # `path` (its last component) or from `hf_config.model_type`.
    name: str = setting("", path="model.name")
    # dtype of the frozen base weights: "bfloat16" for real runs, "float32"
    # for exact tests. LoRA adapters and optimizer state are always float32.
    dtype: str = setting("bfloat16", path="model.dtype")
    # dtype the forward and backward passes compute in (base and adapters cast
    # to it inside the step); empty = the base's dtype. "bfloat16" with a
    # float32 base is mixed precision.
    compute_dtype: str | None = setting(None, path="model.compute_dtype")
    # Rematerialisation policy of each (scanned) decoder layer: what it keeps
    # for the backward pass, the rest recomputed (oodjax.models.REMAT_POLICIES).
    # "none" keeps everything (fastest, most memory); "full" keeps only the
    # layer's input; "save_dots" keeps the matmul outputs; "save_dots_except_mlp"
    # keeps them but for the MLP's, the largest.
    remat: str = setting("none", path="model.remat")
    # Attention implementation (oodjax.models.flash_attention): "auto" = the
    # fused kernel of the platform (cuDNN's on GPU where it applies, else
    # XLA's; splash on TPU), XLA's on CPU; or "xla", "cudnn", "splash" by
    # name, or "pallas_gpu" (Triton; its backward is unverified on sm80+).
    # Sliding windows and soft caps always take XLA's path.
    attention: str = setting("auto", path="model.attention")
    # Tokenizer directory or hub id; empty = the same as `model.path`.
    tokenizer: str = setting("", path="tokenizer")

    def __post_init__(self) -> None:
        # In run names: model.name, else the checkpoint folder's name, else "<model_type>-random".
        named = (
            pathlib.Path(self.path.rstrip("/")).name if self.path else f"{self.hf_config.get('model_type', '')}-random"
        )
        object.__setattr__(self, "name", self.name or named)
        object.__setattr__(self, "tokenizer", self.tokenizer or self.path or "")
        if bool(self.path) == bool(self.hf_config):
            raise ConfigError(
                "set exactly one of model.path (a checkpoint) and model.hf_config (a random model); "
                f"got path={self.path or ''!r} and {'a' if self.hf_config else 'no'} hf_config"
            )
        if self.hf_config and "model_type" not in self.hf_config:
            raise ConfigError("model.hf_config needs a model_type (e.g. 'opt')")
        if not self.tokenizer:
            raise ConfigError(
                "tokenizer is empty: a random model (model.hf_config) needs a tokenizer directory or hub id"
            )
        for field, value in {"model.dtype": self.dtype, "model.compute_dtype": self.compute_dtype}.items():
            if value and value not in DTYPES:
                raise ConfigError(f"{field} must be one of {DTYPES}, got {value!r}")
        try:
            check_remat(self.remat)
        except ValueError as error:
            raise ConfigError(f"model.remat: {error}") from None
        if self.attention not in IMPLEMENTATIONS:
            raise ConfigError(f"model.attention must be one of {IMPLEMENTATIONS}, got {self.attention!r}")

    @property
    def source(self) -> str:
        """The model as messages and exports name it: its checkpoint, else its name."""
        return self.path or self.name

    def load(self, mesh: Mesh) -> CausalLM:
        options = dict(dtype=self.dtype, remat=self.remat, attention=self.attention)
        if self.path:
            return load_pretrained(self.path, mesh=mesh, **options)
        return from_config(dict(self.hf_config), seed=self.init_seed, **options)


def load_pretrained(
    path: str | pathlib.Path,
    *,
    dtype: Any = "float32",
    mesh: Mesh | None = None,
    remat: str = "none",
    attention: str = "auto",
) -> CausalLM:
    """Load a Hugging Face checkpoint (local folder or hub id) as an NNX model, cast to ``dtype`` and placed on
    ``mesh`` (without one, the default device)."""
    dtype = _float_dtype(dtype)
    directory = _resolve(path)
    model = abstract_model(_read_config(directory), dtype=dtype, remat=remat, attention=attention)
    default_sharding = SingleDeviceSharding(jax.local_devices()[0])
    with contextlib.ExitStack() as stack:
        checkpoint = open_checkpoint(directory, stack=stack)
        for source in _match(model, checkpoint, directory):
            sharding = param_sharding(source.variable, mesh) if mesh is not None else default_sharding
            source.variable.set_value(_place(checkpoint, source, dtype, sharding))
    return model


def verify_checkpoint(directory: str | pathlib.Path) -> int:
    """Check that the checkpoint in ``directory`` fits its config.json, from the files' headers alone, as
    ``load_pretrained`` pairs them; returns the number of tensors checked."""
    directory = pathlib.Path(directory)
    with contextlib.ExitStack() as stack:
        sources = _match(abstract_model(_read_config(directory)), open_checkpoint(directory, stack=stack), directory)
    return sum(len(source.names) for source in sources)
