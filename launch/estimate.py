"""`python -m launch.estimate CONFIG [CONFIG ...]`: what a config's job costs before it is submitted.

For each config: parameter count, training memory per device (frozen
weights, adapters, gradients, optimizer state, saved activations, the
backward pass's working set; `launch.costs` says how each is measured) for
its mesh, train step layout (`oodjax.engine.geometry`: train.grad_accum
micro-batches of all runs' prompts, packed with train.pack into the fewest
rows per device of at most data.max_length tokens) and remat policy, FLOPs
per train step and per full evaluation, and the accelerator-hours of all its
runs on a stated device at a stated utilisation. With several configs a closing line sums
the hours. --layers cuts the model to that depth and --platform cpu costs
memory as XLA's CPU backend allocates it, so that the estimate can be set
beside `python -m launch.preflight --layers N` on a machine without an
accelerator.

Prompts are costed at `data.max_length` tokens unless --prompt_len says
otherwise (most NLI prompts are far shorter, so the default is an upper
bound), training rows at the length such prompts make (`train_row_length`:
one a row, or a packed row's share of all runs' prompts) unless --seq_len
gives it (the preflight passes its geometry's). The evaluation size is counted
from the testsets themselves (`oodjax.data.load_testset`, with the config's
neutral handling and cap) unless --eval_examples gives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Mapping, Sequence

from ml_collections import config_dict

from configs.models import architecture
from launch import costs
from launch.config_files import experiment_config_paths, load_config
from oodjax.data import bucket_lengths, fitting_bucket
from oodjax.engine.geometry import BatchGeometry
from oodjax.models.lora import LoRAConfig

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device, from the vendor's data sheet
    memory_gb: float
    platform: str  # JAX's name for its backend: what decides how the compiled step stores bf16


DEVICES: Mapping[str, Device] = {
    "a100": Device("A100 80GB", 312e12, 80, "gpu"),
    "h100": Device("H100 SXM", 989e12, 80, "gpu"),
    "v4": Device("TPU v4 chip", 275e12, 32, "tpu"),
    "v5e": Device("TPU v5e chip", 197e12, 16, "tpu"),
    "v5p": Device("TPU v5p chip", 459e12, 95, "tpu"),
}


@dataclasses.dataclass(frozen=True)
class Estimate:
    config_path: str
    model: str
    parameters: int
    mesh: Mapping[str, int]
    memory: costs.Memory
    train_step_flops: float
    eval_flops: float
    evaluations: int
    total_flops: float
    accelerator_hours: float
    geometry: BatchGeometry  # the train step's layout the estimate is made for


def resolve_mesh(mesh: Mapping[str, int], devices: int) -> dict[str, int]:
    """Mesh axis sizes with the one -1 axis filled so that their product is `devices`."""
    sizes = {axis: int(mesh[axis]) for axis in ("data", "fsdp", "tensor")}
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    fixed = 1
    for axis, size in sizes.items():
        if axis not in fill:
            fixed *= size
    if devices % fixed:
        raise ValueError(f"mesh {sizes} does not fit {devices} devices")
    if fill:
        sizes[fill[0]] = devices // fixed
    elif fixed != devices:
        raise ValueError(f"mesh {sizes} uses {fixed} devices, not the {devices} given")
    return sizes


def architecture_of(config: config_dict.ConfigDict, layers: int | None = None) -> dict:
    """config.json numbers: the table's for a listed checkpoint, else the config's own random-model fields;
    ``layers`` replaces the decoder depth (what the estimate and the preflight cut a model to)."""
    if config.model.path:
        arch = dict(architecture(config.model.path))
    elif config.model.hf_config:
        arch = config.model.hf_config.to_dict()
    else:
        raise ValueError("config names neither model.path nor model.hf_config")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        arch["num_hidden_layers"] = layers
    return arch


@functools.cache
def count_eval_examples(
    testsets: tuple[str, ...], data_dir: str, neutral: str, cap: int, declared: str = "{}", declared_file: str = ""
) -> int:
    """Examples in one full evaluation: every testset after label mapping, each capped at its own cap or `cap`
    (0 = none). `declared` is the JSON of data.extra_testsets (a string, so that the count is cached)."""
    from oodjax.data import testsets as testset_module

    table = testset_module.testset_table(json.loads(declared), declared_file or None)
    total = 0
    for name in testsets:
        size = len(testset_module.load_testset(name, data_dir=data_dir or None, neutral=neutral, table=table))
        own_cap = table[name].eval_cap(cap)
        total += min(size, own_cap) if own_cap else size
    return total


def packed_rows(config: config_dict.ConfigDict, batch_shards: int, prompt_len: int) -> tuple[int, int]:
    """(rows per device, prompts a row holds) of a packed micro-batch when every prompt has ``prompt_len`` tokens,
    as ``oodjax.engine.geometry`` lays it out: a device's share of all runs' prompts, rounded up, balanced over
    the fewest rows of at most data.max_length tokens."""
    runs = len(config.runs.seeds) * len(config.runs.shots)
    prompts = -(-runs * config.train.batch_size // (config.train.grad_accum * batch_shards))
    rows = -(-prompts // (config.data.max_length // prompt_len))
    return rows, -(-prompts // rows)


def train_row_length(config: config_dict.ConfigDict, batch_shards: int, prompt_len: int) -> int:
    """Tokens per training row when every prompt has ``prompt_len`` tokens, as ``oodjax.engine.geometry``
    sizes rows: the bucket holding one prompt, or with train.pack a packed row's prompts (``packed_rows``)."""
    max_length = config.data.max_length
    if not 0 < prompt_len <= max_length:
        raise ValueError(f"prompt length {prompt_len} must be in [1, data.max_length={max_length}]")
    prompts = packed_rows(config, batch_shards, prompt_len)[1] if config.train.pack else 1
    return fitting_bucket(bucket_lengths(max_length, tuple(config.data.buckets) or None), prompts * prompt_len)


def train_geometry(config: config_dict.ConfigDict, batch_shards: int, prompt_len: int, seq_len: int) -> BatchGeometry:
    """The train step's layout for ``config`` on ``batch_shards`` devices (data x fsdp), prompts of
    ``prompt_len`` tokens in rows of ``seq_len``: the engine's ``BatchGeometry`` (its checks included), packed
    rows as ``packed_rows`` counts them."""
    rows, prompts = packed_rows(config, batch_shards, prompt_len) if config.train.pack else (1, 1)
    return BatchGeometry(
        runs=len(config.runs.seeds) * len(config.runs.shots), batch_size=config.train.batch_size,
        grad_accum=config.train.grad_accum, seq_len=seq_len, packed=config.train.pack,
        packed_rows_per_device=rows, prompts_per_row=prompts, batch_shards=batch_shards,
    )  # fmt: skip


def evaluation_steps(steps: int, every: int) -> int:
    """How many evaluations a run makes: at step 0, every `every` steps, and at the last step."""
    return len(set(range(0, steps + 1, every)) | {steps})


def estimate(
    config_path: str,
    config: config_dict.ConfigDict,
    *,
    devices: int,
    device: Device,
    utilisation: float,
    seq_len: int | None = None,
    prompt_len: int | None = None,
    geometry: BatchGeometry | None = None,
    eval_examples: int | None = None,
    layers: int | None = None,
    platform: str | None = None,
) -> Estimate:
    """The costs of `config`'s job on `devices` devices of `device`'s kind. `seq_len` is the training rows'
    length (default `train_row_length` of `prompt_len`), `prompt_len` a prompt's (default data.max_length;
    evaluation is costed one prompt a row); `geometry`, the job's own train step layout (the preflight's,
    replayed from its real data), replaces the one laid out from them. `layers` cuts the model to that depth
    and `platform` (default: the device's) decides how memory is costed, so that the estimate can be compared
    with the preflight's compile on a CPU."""
    arch = architecture_of(config, layers)
    dims = costs.dimensions(arch)
    parameters = costs.parameter_count(arch)
    lora = costs.lora_parameter_count(arch, config.lora.rank, tuple(config.lora.targets))
    runs = len(config.runs.seeds) * len(config.runs.shots)
    mesh = resolve_mesh(config.mesh, devices)
    shards = mesh["data"] * mesh["fsdp"]
    prompt_len = prompt_len or config.data.max_length
    if geometry is None:
        geometry = train_geometry(config, shards, prompt_len, seq_len or train_row_length(config, shards, prompt_len))
    memory = costs.train_memory_per_device(
        arch, LoRAConfig.from_config(config.lora), dtype=config.model.dtype,
        compute_dtype=config.model.compute_dtype or None, remat=config.model.remat, mesh=mesh, runs=runs,
        rows=geometry.rows, seq_len=geometry.seq_len, prompts_per_row=geometry.prompts_per_row,
        platform=platform or device.platform,
    )  # fmt: skip
    step = costs.train_step_flops(
        dims, runs=runs, rows=geometry.grad_accum * geometry.rows, seq_len=geometry.seq_len,
        prompts=runs * geometry.batch_size, lora_parameters=lora, remat=config.model.remat,
    )  # fmt: skip
    if eval_examples is None:
        eval_examples = count_eval_examples(
            tuple(config.data.testsets), config.data.data_dir, config.data.neutral, config.data.eval_cap,
            json.dumps(config.data.extra_testsets.to_dict(), sort_keys=True), config.data.extra_testsets_file,
        )
    # Each run is also evaluated on its own few-shot training set.
    training_sets = len(config.runs.seeds) * sum(config.runs.shots)
    evaluation = costs.eval_flops(dims, runs=runs, examples=eval_examples, seq_len=prompt_len, lora_parameters=lora)
    evaluation += costs.eval_flops(dims, runs=1, examples=training_sets, seq_len=prompt_len, lora_parameters=lora)
    evaluations = evaluation_steps(config.train.steps, config.eval.every)
    total = config.train.steps * step + evaluations * evaluation
    hours = total / (device.peak_flops * utilisation) / 3600
    name = config.model.path or config.model.name
    return Estimate(
        config_path, name, parameters, mesh, memory, step, evaluation, evaluations, total, hours, geometry
    )


def describe(result: Estimate, config: config_dict.ConfigDict, device: Device, utilisation: float) -> str:
    """The estimate as lines for a terminal: the job's shape, memory per device by holder, FLOPs, hours."""
    m, mesh = result.memory, result.mesh
    runs = len(config.runs.seeds) * len(config.runs.shots)
    fits = "fits" if m.total <= device.memory_gb * GB else "DOES NOT FIT"
    upcast = f", float32 copies of the layers (CPU) {m.upcast_weights / GB:.2f}" if m.upcast_weights else ""
    g = result.geometry
    rows = (
        f"{g.rows_per_device} packed row{'s' if g.rows_per_device > 1 else ''} per device ({g.seq_len} tokens, "
        f"{g.prompts_per_row} prompt slot{'s' if g.prompts_per_row > 1 else ''})" if g.packed
        else f"{g.rows_per_device} rows per device, one prompt a row ({g.seq_len} tokens)"
    )  # fmt: skip
    return "\n".join([
        f"{result.config_path}: {result.model}, {result.parameters:,} parameters",
        f"  mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']}; {runs} runs x batch "
        f"{g.batch_size} in {g.grad_accum} micro-batch{'es' if g.grad_accum > 1 else ''} of {rows}; "
        f"{config.model.dtype}, remat {config.model.remat}",
        f"  memory per device (GB): frozen weights {m.frozen_weights / GB:.2f}{upcast}, adapters "
        f"{m.adapters / GB:.3f}, gradients {m.gradients / GB:.3f}, optimizer state {m.optimizer_state / GB:.3f}, "
        f"activations {m.activations / GB:.2f}, the larger of a layer's backward {m.layer_transients / GB:.2f} "
        f"and the head's {m.head_transients / GB:.2f}; total {m.total / GB:.2f} ({fits} in {device.name}'s "
        f"{device.memory_gb:.0f} GB)",
        f"  FLOPs: {result.train_step_flops:.3e} per train step, {result.eval_flops:.3e} per full evaluation",
        f"  whole sweep ({runs} runs, {config.train.steps} steps, {result.evaluations} evaluations): "
        f"{result.total_flops:.3e} FLOPs = {result.accelerator_hours:,.1f} {device.name}-hours at "
        f"{utilisation:.0%} utilisation",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.estimate", description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+", help="config files or shell patterns, e.g. 'configs/*_mnli.py'")
    parser.add_argument("--devices", type=int, default=8, help="devices of one job (default 8)")
    parser.add_argument("--device", choices=sorted(DEVICES), default="a100")
    parser.add_argument("--utilisation", type=float, default=0.4, help="fraction of peak FLOP/s achieved")
    parser.add_argument("--prompt_len", type=int, help="tokens per prompt (default: data.max_length)")
    parser.add_argument(
        "--seq_len", type=int, help="tokens per training row (default: the rows --prompt_len prompts make)"
    )
    parser.add_argument("--eval_examples", type=int, help="examples per full evaluation (default: counted)")
    parser.add_argument("--layers", type=int, help="cut the model to this many decoder layers (as the preflight's)")
    parser.add_argument(
        "--platform", choices=costs.PLATFORMS, help="cost memory as this backend allocates it (default: --device's)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.utilisation <= 1:
        parser.error(f"--utilisation must be in (0, 1], got {args.utilisation}")
    device = DEVICES[args.device]
    total_hours, total_runs = 0.0, 0
    try:
        paths = experiment_config_paths(args.configs)
    except ValueError as error:
        parser.error(str(error))
    for path in paths:
        config = load_config(path)
        result = estimate(
            path, config, devices=args.devices, device=device, utilisation=args.utilisation,
            seq_len=args.seq_len, prompt_len=args.prompt_len, eval_examples=args.eval_examples, layers=args.layers,
            platform=args.platform,
        )
        print(describe(result, config, device, args.utilisation))
        total_hours += result.accelerator_hours
        total_runs += len(config.runs.seeds) * len(config.runs.shots)
    if len(paths) > 1:
        print(f"total: {total_runs} runs in {len(paths)} configs, {total_hours:,.0f} {device.name}-hours "
              f"at {args.utilisation:.0%} utilisation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
