"""`python -m launch.estimate CONFIG [CONFIG ...]`: what a config's job costs before it is submitted.

For each config: parameter count, training memory per device (`launch.costs`
says how each part is measured), train step layout, FLOPs per train step and
per evaluation, and the accelerator-hours of all its runs on a stated device
at a stated utilisation. The engine's own rules work out the mesh, layout and
cadence, so the estimate is what a run would do. --layers and --platform cpu
make it comparable with `python -m launch.preflight --layers N` on a machine
without an accelerator.

By default the prompts are the config's real ones (`RealPrompts`), so it
needs the tokenizer and the data, as a run does. --prompt_len N prices every
prompt at N tokens instead (data.max_length: an upper bound), without them.

A testset whose local file is a sample of the hub's split (`TestsetSpec.hub_rows`)
is counted at the size a job reading the hub's split evaluates (`study_samples`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import math
import os
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import pyarrow.parquet
from jax.sharding import Mesh
from transformers import PreTrainedTokenizerBase

from configs.models import architecture
from launch import costs
from launch.config_files import experiment_config_paths, load_config
from oodjax import usage_errors
from oodjax.data import TokenizedSet, load_testset, load_tokenizer, prompt_lengths
from oodjax.data.testsets import default_data_dir, local_path
from oodjax.engine import sharding
from oodjax.engine.evaluation import EvalPool, pool_figures
from oodjax.engine.geometry import BatchGeometry, EvalGeometry, batch_geometry, eval_geometry
from oodjax.engine.run_data import DataSettings, IndexedSet, capped_testsets, load_testsets
from oodjax.engine.setup import set_up
from oodjax.job import Job, read
from oodjax.models.loading import ModelSettings
from oodjax.usage_errors import ConfigError

GB = 1e9
# What a missing tokenizer or testset leaves possible.
WITHOUT_DATA = (
    "--prompt_len N prices prompts of N tokens without the tokenizer, and --eval_examples M evaluations of M "
    "examples without the testsets"
)


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device, from the vendor's data sheet
    memory_gb: float
    platform: str  # JAX's name for its backend: what decides how the compiled step stores bf16
    # Bytes a second one device sends (and as many it receives) to the others of its node or slice, all its links
    # together: half the bidirectional figure published. A ring collective's traffic per device divided by this is
    # its time at best (launch.preflight's communication estimate).
    interconnect_bytes_per_s: float
    interconnect: str  # the links' name, for the reader
    # Devices of one node, and what one device sends a second over the network between nodes (its NIC's rate):
    # where a job spread over nodes communicates (launch.preflight). None for TPUs: ICI joins a slice's hosts.
    node_devices: int | None = None
    network_bytes_per_s: float | None = None
    network: str = ""


# Interconnect figures, bidirectional per device as published, halved above:
#   A100 SXM: NVLink 3, 600 GB/s (12 links of 50 GB/s; e.g. AWS's p4d instance table, "NVLink gen 3 (600 GB/s)").
#   H100 SXM: NVLink 4, 900 GB/s (18 links of 50 GB/s; MLCommons' H100/H200 SXM system descriptions,
#     "18x 4th Gen NVLink, 900GB/s"; Scaleway's H100 SXM notes, "900 GB/s of bidirectional bandwidth").
#   TPU v5e: ICI 400 GB/s per chip, v5p: 1200 GB/s per chip ("Bidirectional inter-chip interconnect (ICI) bandwidth
#     (per chip)", https://docs.cloud.google.com/tpu/docs/v5e and /v5p); v5e's "All-reduce bandwidth per Pod" of
#     51.2 TB/s over its 256 chips is the same 200 GB/s one way.
#   TPU v4: no per-chip figure is published (https://docs.cloud.google.com/tpu/docs/v4); its "All-reduce bandwidth
#     per Pod", 1.1 PB/s over 4096 chips, is 268 GB/s a chip, taken as its one-way figure as v5e's is.
# On a TPU torus a collective over one mesh axis uses only that axis's links, so there the figure is an upper bound.
# Networks between GPU nodes, as NVIDIA's reference nodes have them, one NIC per GPU (a site's may be slower):
#   DGX A100: 8 GPUs, "8x Single-Port Mellanox ConnectX-6 VPI 200Gb/s HDR InfiniBand": 25 GB/s a GPU each way.
#   DGX H100: 8 GPUs, "8x single-port NVIDIA ConnectX-7 VPI, 400 Gb/s InfiniBand/Ethernet": 50 GB/s a GPU each way.
DEVICES: Mapping[str, Device] = {
    "a100": Device("A100 80GB", 312e12, 80, "gpu", 300e9, "NVLink 3", 8, 25e9, "InfiniBand HDR"),
    "h100": Device("H100 SXM", 989e12, 80, "gpu", 450e9, "NVLink 4", 8, 50e9, "InfiniBand NDR"),
    "v4": Device("TPU v4 chip", 275e12, 32, "tpu", 268e9, "ICI"),
    "v5e": Device("TPU v5e chip", 197e12, 16, "tpu", 200e9, "ICI"),
    "v5p": Device("TPU v5p chip", 459e12, 95, "tpu", 600e9, "ICI"),
}

# The share of a GPU's memory JAX's allocator takes: JAX reads XLA_CLIENT_MEM_FRACTION (or its deprecated name
# XLA_PYTHON_CLIENT_MEM_FRACTION; both set is an error at start-up), 0.75 when neither is set.
# launch/slurm.sbatch exports MEMORY_FRACTION_DEFAULT unless one is set (tests/test_launch_scripts.py holds the
# two equal), and a job's memory must fit that share, not the whole device. TPUs take no fraction (the variables
# configure JAX's GPU client only).
MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
MEMORY_FRACTION_DEFAULT = 0.9


def memory_fraction(environ: Mapping[str, str] | None = None) -> tuple[float, str]:
    """(fraction of a GPU's memory JAX may use, where it comes from: ``VARIABLE=value``), read from the
    environment as JAX reads it, else the default launch/slurm.sbatch exports."""
    environ = os.environ if environ is None else environ
    given = {name: environ[name] for name in MEMORY_FRACTION_VARIABLES if environ.get(name)}
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)} are both set; JAX refuses to start: unset the deprecated "
            f"{MEMORY_FRACTION_VARIABLES[1]}"
        )
    if not given:
        default = f"{MEMORY_FRACTION_VARIABLES[0]}={MEMORY_FRACTION_DEFAULT}, launch/slurm.sbatch's default"
        return MEMORY_FRACTION_DEFAULT, default
    ((name, value),) = given.items()
    try:
        fraction = float(value)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:
        raise ConfigError(f"{name}={value}: must be a fraction in (0, 1]")
    return fraction, f"{name}={value}"


def usable_memory(device: Device, environ: Mapping[str, str] | None = None) -> tuple[float, str]:
    """(bytes of one ``device`` a job's arrays may take, why): a GPU's memory times ``memory_fraction``, a TPU's
    whole memory."""
    if device.platform != "gpu":
        return device.memory_gb * GB, "TPU: the whole memory"
    fraction, source = memory_fraction(environ)
    return device.memory_gb * GB * fraction, source


def describe_fit(total_bytes: float, device: Device, environ: Mapping[str, str] | None = None) -> str:
    """Whether ``total_bytes`` per device fit the memory JAX can use on ``device``, e.g. "fits in 72 GB of the
    H100 SXM's 80 GB (XLA_CLIENT_MEM_FRACTION=0.9, launch/slurm.sbatch's default)"."""
    return fit_text(total_bytes, device, *usable_memory(device, environ))


def fit_text(total_bytes: float, device: Device, usable: float, source: str) -> str:
    """``describe_fit``'s words for ``usable`` bytes of ``device`` (``usable_memory``'s, said by ``source``)."""
    verdict = "fits in" if total_bytes <= usable else "DOES NOT FIT in"
    if device.platform != "gpu":
        return f"{verdict} the {_gb(usable)} GB of a {device.name}"
    return f"{verdict} {_gb(usable)} GB of the {device.name}'s {_gb(device.memory_gb * GB)} GB ({source})"


def _gb(size: float) -> str:
    return f"{size / GB:.1f}".removesuffix(".0")


@dataclasses.dataclass(frozen=True)
class Estimate:
    config_path: str
    model: str
    parameters: int
    mesh: Mapping[str, int]
    memory: costs.Memory
    train_step_flops: float
    eval_flops: float
    first_eval_flops: float  # step 0's evaluation: every run is the base model, so each example is scored once
    evaluations: float  # per run, step 0's among them (a mean over runs of different lengths: train.epochs)
    total_flops: float
    accelerator_hours: float
    geometry: BatchGeometry  # the train step's layout the estimate is made for
    prompts: RealPrompts | AssumedPrompts  # what it is made for (assumed ones with their length)
    samples: Mapping[str, Sample]  # testsets whose local files are samples, counted at the hub's size


@dataclasses.dataclass(frozen=True)
class AssumedPrompts:
    """Prompts all of `length` tokens (None: data.max_length), evaluated one a row; `eval_examples` None counts
    the testsets."""

    length: int | None = None
    eval_examples: int | None = None


@dataclasses.dataclass(frozen=True)
class Target:
    """What a job is costed on: `devices` devices of `device`'s kind at `utilisation` of their peak FLOP/s, its
    memory as `platform` allocates it (None: the device's; "cpu" to set it beside a preflight on a CPU)."""

    devices: int
    device: Device
    utilisation: float
    platform: str | None = None


@dataclasses.dataclass(frozen=True)
class RealPrompts:
    """A config's real prompts as its job lays them out (``PromptCounter``), counted with ``tokenizer``."""

    tokenizer: str  # the tokenizer that counted them: the config's own or a stand-in
    geometry: BatchGeometry  # the train step's layout, from the runs' few-shot sets
    eval_rows: Mapping[int, int]  # row length -> rows of it one evaluation computes (every run's lane, empty rows too)
    first_eval_rows: Mapping[int, int]  # the same for step 0's, which scores each example once for all runs
    eval_prompts: int  # prompts one evaluation scores: every run's testsets and its own few-shot set
    eval_prompt_tokens: int  # their tokens
    eval_real_token_share: float  # eval_prompt_tokens over the tokens of eval_rows (``pool_figures``)
    samples: Mapping[str, Sample]  # testsets whose local files are samples: their prompts repeated to the hub's size

    @property
    def mean_length(self) -> float:
        """Tokens of the average prompt an evaluation scores."""
        return self.eval_prompt_tokens / self.eval_prompts


def architecture_of(model: ModelSettings, layers: int | None = None) -> dict:
    """config.json numbers: the table's for a listed checkpoint, else the config's own random-model fields;
    ``layers`` replaces the decoder depth (what the estimate and the preflight cut a model to)."""
    if model.path:
        try:
            arch = dict(architecture(model.path))
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


@dataclasses.dataclass(frozen=True)
class Sample:
    """A testset whose local files hold fewer rows than its split on the hub (``TestsetSpec.hub_rows``): a sample
    (the shared data's HANS), standing in for the split a job reads where the hub is reached or the split fetched."""

    local_rows: int  # rows of the local files
    hub_rows: int  # rows of the hub's split
    prompts: int  # what a job reading the hub's split evaluates: the rows the sample keeps, scaled, then capped


def study_samples(data: DataSettings) -> dict[str, Sample]:
    """The testsets of ``data`` whose local files are samples, each with the prompts a job reading the hub's
    split evaluates: the sample's kept rows scaled to the hub's size, then capped."""
    root = pathlib.Path(data.data_dir) if data.data_dir is not None else default_data_dir()
    found = {}
    for name in data.testsets:
        spec = data.table[name]
        parts = spec.split_groups.get(spec.split, (spec.split,))
        if root is None or spec.is_local_file or not all(part in spec.hub_rows for part in parts):
            continue
        try:
            local = sum(_file_rows(local_path(spec, part, root)) for part in parts)
        except FileNotFoundError:  # read from the hub: the whole split
            continue
        hub = sum(spec.hub_rows[part] for part in parts)
        if local >= hub:
            continue
        kept = len(load_testset(name, data_dir=root, neutral=data.neutral, table=data.table))
        prompts, cap = round(kept * hub / local), spec.eval_cap(data.eval_cap)
        found[name] = Sample(local, hub, min(prompts, cap) if cap else prompts)
    return found


def _file_rows(path: pathlib.Path) -> int:
    """Rows of a mirror's file as the data layer reads it: a JSON-lines file's non-blank lines, a parquet file's
    rows."""
    if path.suffix == ".parquet":
        return pyarrow.parquet.ParquetFile(path).metadata.num_rows
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def count_eval_examples(data: DataSettings, samples: Mapping[str, Sample] | None = None) -> int:
    """Examples in one full evaluation: every testset as the engine caps it, a local sample at the hub's size."""
    samples = study_samples(data) if samples is None else samples
    return sum(
        samples[name].prompts if name in samples else len(testset) for name, testset in capped_testsets(data).items()
    )


def study_testsets(
    data: DataSettings, tokenizer: PreTrainedTokenizerBase, samples: Mapping[str, Sample] | None = None
) -> dict[str, IndexedSet]:
    """The testsets a job evaluates, tokenised (``load_testsets``), each local sample's prompts repeated to the
    prompts it counts for (``samples``, default ``study_samples``): the evaluation pool of the hub's splits."""
    samples = study_samples(data) if samples is None else samples
    testsets = load_testsets(data, tokenizer)
    return testsets | {name: _repeated(testsets[name], sample.prompts) for name, sample in samples.items()}


def _repeated(testset: IndexedSet, count: int) -> IndexedSet:
    """``testset``'s prompts in order, again and again, to ``count`` prompts: a sample standing in for its split."""
    order = np.arange(count) % len(testset)
    lengths = np.diff(testset.starts)
    whole, rest = divmod(count, len(testset))
    return dataclasses.replace(
        testset,
        token_ids=np.concatenate([np.tile(testset.token_ids, whole), testset.token_ids[: testset.starts[rest]]]),
        starts=np.concatenate([[0], np.cumsum(lengths[order])]).astype(testset.starts.dtype),
        labels=testset.labels[order],
        truncated=testset.truncated[order],
        dataset_index=testset.dataset_index[order],
    )


def assumed_geometry(job: Job, batch_shards: int, prompt_len: int) -> BatchGeometry:
    """The engine's train step layout for ``job`` when every prompt has ``prompt_len`` tokens; prompts all alike
    lay every step out alike, so one step is replayed rather than train.steps."""
    max_length = job.batches.max_length
    if not 0 < prompt_len <= max_length:
        raise ConfigError(f"prompt length {prompt_len} must be in [1, data.max_length={max_length}]")
    runs = job.runs.runs()
    train_sets = [_prompts_alike(run.shots, prompt_len, max_length) for run in runs]
    return batch_geometry(job.batches, geometry_mesh(batch_shards), train_sets, [run.seed for run in runs], 1)


def _prompts_alike(count: int, length: int, max_length: int) -> TokenizedSet:
    """A tokenised set of ``count`` prompts of ``length`` tokens each."""
    return TokenizedSet(
        token_ids=np.zeros(count * length, dtype=np.int32),
        starts=np.arange(count + 1, dtype=np.int64) * length,
        labels=np.zeros(count, dtype=np.int32),
        truncated=np.zeros(count, dtype=bool),
        max_length=max_length,
    )


def geometry_mesh(shards: int) -> Mesh:
    """A mesh of ``shards`` host CPU devices on its data axis: the batch layout depends only on the batch
    shards, so it can be worked out for devices this machine does not have."""
    cpus = jax.devices("cpu")
    if len(cpus) < shards:
        raise RuntimeError(
            f"laying out batches over {shards} devices takes as many host CPU devices; JAX has {len(cpus)} "
            "(jax_num_cpu_devices is set before JAX starts: `main` does)"
        )
    return sharding.make_mesh(shards, 1, 1, devices=cpus[:shards])


class PromptCounter:
    """Configs' real prompts, counted with ``tokenizer`` when given, else each config's own.

    The engine's own set-up (``run_data.set_up``) lays them out, as the loop and the preflight do. Configs
    with the same tokenizer, data and evaluation batches' shape share one pool.
    """

    def __init__(self, tokenizer: str | None = None) -> None:
        self.tokenizer = tokenizer
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}
        # Keyed by (tokenizer, the data settings' repr, the runs' (seed, shots), the evaluation batches' shape):
        # DataSettings holds the testset table's dicts, so its repr stands for it.
        self._pools: dict[tuple[str, str, tuple[tuple[int, int], ...], EvalGeometry], dict[str, Any]] = {}

    def __call__(self, job: Job, mesh: Mapping[str, int]) -> RealPrompts:
        """``job``'s real prompts on a mesh of these axis sizes (resolved)."""
        source = self.tokenizer or job.model.tokenizer
        if source not in self._tokenizers:
            self._tokenizers[source] = load_tokenizer(source)
        shards = math.prod(mesh[axis] for axis in sharding.BATCH_AXES)
        runs = tuple((run.seed, run.shots) for run in job.runs.runs())
        pool = (source, repr(job.data), runs, eval_geometry(job.batches, shards))
        samples = None if pool in self._pools else study_samples(job.data)
        testsets = None if samples is None else functools.partial(study_testsets, samples=samples)
        longest = job.groups[-1].total_steps  # all runs laid out together, over the longest run's steps
        setup = set_up(
            job,
            geometry_mesh(shards),
            job.runs.runs(),
            longest,
            tokenizer=self._tokenizers[source],
            testsets=testsets,
            prefetch=0,
        )
        if setup.data is not None:
            counts = _evaluation_counts(setup.data.eval_pool, setup.data.first_eval_pool)
            self._pools[pool] = {**counts, "samples": samples}
        return RealPrompts(tokenizer=source, geometry=setup.geometry, **self._pools[pool])


def _evaluation_counts(pool: EvalPool, first_pool: EvalPool) -> dict[str, Any]:
    """``RealPrompts``' evaluation fields, read from the batches of ``pool`` and step 0's ``first_pool``."""
    return dict(
        eval_rows=rows_by_length(pool),
        first_eval_rows=rows_by_length(first_pool),
        eval_prompts=sum(int(batch["valid"].sum()) for batch in pool.batches),
        eval_prompt_tokens=sum(int(prompt_lengths(batch).sum()) for batch in pool.batches),
        eval_real_token_share=pool_figures(pool)["eval_real_token_share"],
    )


def rows_flops(dims: costs.Dimensions, rows: Mapping[int, int], lora_parameters: int) -> float:
    """FLOPs of computing ``rows`` (row length -> rows, ``rows_by_length``) through a model of ``dims`` and one
    run's adapters of ``lora_parameters`` weights a row."""
    return sum(
        costs.eval_flops(dims, runs=1, examples=count, seq_len=length, lora_parameters=lora_parameters)
        for length, count in rows.items()
    )


def rows_by_length(pool: EvalPool) -> dict[int, int]:
    """Row length -> rows of it ``pool``'s batches compute (every lane's, empty rows too)."""
    rows: collections.Counter[int] = collections.Counter()
    for batch in pool.batches:
        length = batch["input_ids"].shape[-1]
        rows[length] += batch["input_ids"].size // length
    return dict(sorted(rows.items()))


def train_memory(
    job: Job, arch: Mapping[str, Any], mesh: Mapping[str, int], geometry: BatchGeometry, platform: str
) -> costs.Memory:
    """Memory per device of the train step of the runs laid out as ``geometry`` (the job's, or a run group's),
    on a mesh of these sizes."""
    return costs.train_memory_per_device(
        arch,
        job.lora,
        dtype=job.model.dtype,
        compute_dtype=job.model.compute_dtype,
        remat=job.model.remat,
        mesh=mesh,
        runs=geometry.runs,
        rows=geometry.rows,
        seq_len=geometry.seq_len,
        prompts_per_row=geometry.prompts_per_row,
        platform=platform,
    )


def train_step_flops(job: Job, arch: Mapping[str, Any], geometry: BatchGeometry) -> float:
    """FLOPs of one optimizer step of the runs laid out as ``geometry`` (the job's, or a run group's)."""
    runs = geometry.runs
    return costs.train_step_flops(
        costs.dimensions(arch),
        runs=runs,
        rows=geometry.grad_accum * geometry.rows,
        seq_len=geometry.seq_len,
        prompts=runs * geometry.batch_size,
        lora_parameters=costs.lora_parameter_count(arch, job.lora.rank, job.lora.targets),
        remat=job.model.remat,
    )


def estimate(
    config_path: str,
    job: Job,
    prompts: RealPrompts | AssumedPrompts,
    target: Target,
    *,
    layers: int | None = None,
    seq_len: int | None = None,
) -> Estimate:
    """The costs of `job` on `target` for `prompts`, the model cut to `layers` and the training rows to
    `seq_len` tokens where given (to set the estimate beside a preflight's compile)."""
    mesh = job.mesh.sizes(target.devices)
    arch = architecture_of(job.model, layers)
    dims = costs.dimensions(arch)
    lora = costs.lora_parameter_count(arch, job.lora.rank, job.lora.targets)
    runs = len(job.runs.runs())
    if isinstance(prompts, RealPrompts):
        geometry, samples = prompts.geometry, prompts.samples
        evaluation = rows_flops(dims, prompts.eval_rows, lora)
        first_evaluation = rows_flops(dims, prompts.first_eval_rows, lora)
    else:
        length = job.batches.max_length if prompts.length is None else prompts.length
        prompts = dataclasses.replace(prompts, length=length)
        geometry = assumed_geometry(job, math.prod(mesh[axis] for axis in sharding.BATCH_AXES), length)
        examples, samples = prompts.eval_examples, {}
        if examples is None:
            samples = study_samples(job.data)
            examples = count_eval_examples(job.data, samples)
        # Each run is also evaluated on its own few-shot training set; at step 0 the testsets once for all runs.
        training_sets = len(job.runs.seeds) * sum(job.runs.shots)
        own = costs.eval_flops(dims, runs=1, examples=training_sets, seq_len=length, lora_parameters=lora)
        evaluation = own + costs.eval_flops(dims, runs=runs, examples=examples, seq_len=length, lora_parameters=lora)
        first_evaluation = own + costs.eval_flops(dims, runs=1, examples=examples, seq_len=length, lora_parameters=lora)
    if seq_len:
        geometry = dataclasses.replace(geometry, seq_len=seq_len)
    memory = train_memory(job, arch, mesh, geometry, target.platform or target.device.platform)
    step = train_step_flops(job, arch, geometry)
    # Each run's own length (train.epochs); a step or an evaluation above is every run's, so each run costs a
    # share of it. Each length's runs train apart and begin with one step-0 evaluation of their own.
    steps_per_run = sum(len(group.runs) * group.total_steps for group in job.groups) / runs
    evaluations = sum(len(group.runs) * len(group.cadence.evaluated_steps()) for group in job.groups) / runs
    first_evaluations = len(job.groups)
    total = steps_per_run * step + first_evaluations * first_evaluation + (evaluations - 1) * evaluation
    hours = total / (target.device.peak_flops * target.utilisation) / 3600
    return Estimate(
        config_path,
        job.model.source,
        costs.parameter_count(arch),
        mesh,
        memory,
        step,
        evaluation,
        first_evaluation,
        evaluations,
        total,
        hours,
        geometry,
        prompts,
        samples,
    )


def describe(result: Estimate, job: Job, device: Device, utilisation: float) -> str:
    """The estimate as lines for a terminal: the job's shape, memory per device by holder, FLOPs, hours."""
    m, mesh = result.memory, result.mesh
    runs = len(job.runs.runs())
    upcast = f", float32 copies of the layers (CPU) {m.upcast_weights / GB:.2f}" if m.upcast_weights else ""
    g = result.geometry
    rows = (
        f"{g.rows_per_device} packed row{'s' if g.rows_per_device > 1 else ''} per device ({g.seq_len} tokens, "
        f"{g.prompts_per_row} prompt slot{'s' if g.prompts_per_row > 1 else ''})"
        if g.packed
        else f"{g.rows_per_device} rows per device, one prompt a row ({g.seq_len} tokens)"
    )
    return "\n".join(
        [
            f"{result.config_path}: {result.model}, {result.parameters:,} parameters",
            f"  mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']}; {runs} runs x batch "
            f"{g.batch_size} in {g.grad_accum} micro-batch{'es' if g.grad_accum > 1 else ''} of {rows}; "
            f"{job.model.dtype}, remat {job.model.remat}",
            f"  memory per device (GB): frozen weights {m.frozen_weights / GB:.2f}{upcast}, adapters "
            f"{m.adapters / GB:.3f}, gradients {m.gradients / GB:.3f}, optimizer state {m.optimizer_state / GB:.3f}, "
            f"activations {m.activations / GB:.2f}, the larger of a layer's backward {m.layer_transients / GB:.2f} "
            f"and the head's {m.head_transients / GB:.2f}; total {m.total / GB:.2f}; {describe_fit(m.total, device)}",
            describe_prompts(result, job),
            *describe_samples(result),
            f"  FLOPs: {result.train_step_flops:.3e} per train step, {result.eval_flops:.3e} per full evaluation "
            f"({result.first_eval_flops:.3e} at step 0, each example once for all runs)",
            f"  whole sweep ({runs} runs, {_steps_per_run(job)} steps, {result.evaluations:g} evaluations): "
            f"{result.total_flops:.3e} FLOPs = {result.accelerator_hours:,.1f} {device.name}-hours at "
            f"{utilisation:.0%} utilisation",
        ]
    )


def _steps_per_run(job: Job) -> str:
    """The runs' steps: one number, or each shot count's with train.epochs."""
    lengths = {run.shots: group.total_steps for group in job.groups for run in group.runs}
    if len(set(lengths.values())) == 1:
        return str(next(iter(lengths.values())))
    return "/".join(map(str, lengths.values())) + f" (shots {'/'.join(map(str, lengths))})"


def describe_prompts(result: Estimate, job: Job) -> str:
    """The line saying which prompts the estimate is made for: the real ones, counted with which tokenizer, or
    ones of a given length."""
    if isinstance(result.prompts, AssumedPrompts):
        length = result.prompts.length
        bound = " = data.max_length: an upper bound" if length == job.batches.max_length else ""
        return f"  prompts: {length} tokens each (--prompt_len{bound}), evaluated one a row"
    p, own = result.prompts, job.model.tokenizer
    counted = f"its tokenizer {own}" if p.tokenizer == own else f"the tokenizer {p.tokenizer} standing in for {own}"
    return (
        f"  prompts: real, counted with {counted}: mean {p.mean_length:.1f} tokens; an evaluation scores "
        f"{p.eval_prompts:,} prompts ({p.eval_prompt_tokens:,} tokens, all runs) in rows of "
        f"{min(p.eval_rows)}-{max(p.eval_rows)} tokens, {p.eval_real_token_share:.1%} of their tokens; training "
        "rows laid out from the runs' few-shot sets"
    )


def describe_samples(result: Estimate) -> list[str]:
    """A line naming the testsets whose local files are samples and what they were counted as, if any."""
    if not result.samples:
        return []
    counted = "prompts, the sample's repeated" if isinstance(result.prompts, RealPrompts) else "examples"
    each = "; ".join(
        f"{name} {sample.local_rows:,} of the hub split's {sample.hub_rows:,} rows, counted as {sample.prompts:,} "
        f"{counted}"
        for name, sample in result.samples.items()
    )
    return [f"  local samples (a job reads the hub's split, or the split fetched): {each}"]


def _host_devices(count: int) -> None:
    """Gives JAX's CPU backend ``count`` devices, for ``geometry_mesh``. Only before JAX starts; a program that
    has started it (the tests, with eight devices) keeps the devices it has."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX's backends have started
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.estimate", description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+", help="config files or shell patterns, e.g. 'configs/*_mnli.py'")
    parser.add_argument("--devices", type=int, default=8, help="devices of one job (default 8)")
    parser.add_argument("--device", choices=sorted(DEVICES), default="a100")
    parser.add_argument("--utilisation", type=float, default=0.4, help="fraction of peak FLOP/s achieved")
    parser.add_argument(
        "--tokenizer",
        help="count the real prompts with this tokenizer (a folder or hub id), standing in for the "
        "config's own (config.tokenizer, else model.path)",
    )
    parser.add_argument(
        "--offline_pools",
        action="store_true",
        help="draw the few-shot sets from the testset table's offline pools "
        "(MNLI validation_mismatched, SNLI validation), standing in for the configs' data.pool_split (the train "
        "splits) where those are not fetched; training is about 2%% of the study's cost",
    )
    parser.add_argument(
        "--prompt_len",
        type=int,
        help="price every prompt at this many tokens, without the tokenizer (default: "
        "the real prompts; data.max_length is an upper bound)",
    )
    parser.add_argument(
        "--seq_len",
        type=int,
        help="tokens per training row (default: the real prompts' rows, or those --prompt_len prompts make)",
    )
    parser.add_argument(
        "--eval_examples",
        type=int,
        help="with --prompt_len: examples per full evaluation, without the testsets (default: counted from them)",
    )
    parser.add_argument("--layers", type=int, help="cut the model to this many decoder layers (as the preflight's)")
    parser.add_argument(
        "--platform", choices=costs.PLATFORMS, help="cost memory as this backend allocates it (default: --device's)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.utilisation <= 1:
        parser.error(f"--utilisation must be in (0, 1], got {args.utilisation}")
    if args.devices < 1:
        parser.error(f"--devices must be >= 1, got {args.devices}")
    try:
        memory_fraction()  # the share of a GPU's memory the fit is tested against
    except ConfigError as error:
        parser.error(str(error))
    if args.prompt_len is None and args.eval_examples is not None:
        parser.error("--eval_examples goes with --prompt_len: the real prompts' evaluation has its own examples")
    if args.prompt_len is not None and args.tokenizer:
        parser.error("--tokenizer counts the real prompts, which --prompt_len replaces")
    _host_devices(args.devices)
    device = DEVICES[args.device]
    target = Target(args.devices, device, args.utilisation, args.platform)
    with usage_errors.reported(parser.prog):
        try:
            paths = experiment_config_paths(args.configs)
        except (ValueError, FileNotFoundError) as error:  # no experiment config among the files; no file
            raise usage_errors.UsageError(str(error)) from error
    count = PromptCounter(args.tokenizer)
    if args.offline_pools:
        print(
            "# few-shot sets drawn from the offline pools (--offline_pools), standing in for the configs' "
            "data.pool_split"
        )
    total_hours, total_runs = 0.0, 0
    for path in paths:
        with usage_errors.reported(parser.prog, config_spec=path):
            try:
                config = load_config(path)
                if args.offline_pools:
                    config.data.pool_split = ""  # the table's pool split
                job = read(config)
                prompts = (
                    count(job, job.mesh.sizes(args.devices))
                    if args.prompt_len is None
                    else AssumedPrompts(args.prompt_len, args.eval_examples)
                )
                result = estimate(path, job, prompts, target, layers=args.layers, seq_len=args.seq_len)
            except usage_errors.NotFetchedError as error:
                raise usage_errors.NotFetchedError(f"{error}; {WITHOUT_DATA}") from error
        print(describe(result, job, device, args.utilisation))
        total_hours += result.accelerator_hours
        total_runs += len(job.runs.runs())
    if len(paths) > 1:
        print(
            f"total: {total_runs} runs in {len(paths)} configs, {total_hours:,.0f} {device.name}-hours "
            f"at {args.utilisation:.0%} utilisation"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
