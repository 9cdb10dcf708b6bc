"""`python -m launch.estimate CONFIG [CONFIG ...]`: what a config's job costs before it is submitted.

For each config: parameter count, training memory per device (`launch.costs`
says how each part is measured), train step layout, FLOPs per train step and
per evaluation, and the accelerator-hours of all its runs on a stated device
at a stated utilisation. The engine's own rules work out the mesh, layout and
cadence, so the estimate is what a run would do. --layers and --platform cpu
make it comparable with `python -m launch.preflight --layers N` on a machine
without an accelerator.

By default the prompts are the config's real ones (`launch.prompts`), so it
needs the tokenizer and the data, as a run does. --prompt_len N prices every
prompt at N tokens instead (data.max_length: an upper bound), without them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from launch import costs
from launch.config_files import experiment_config_paths, load_config
from launch.devices import DEVICES, GB, Device, fit_text, host_devices, memory_fraction, usable_memory
from launch.prompts import (
    AssumedPrompts,
    PromptCounter,
    RealPrompts,
    Sample,
    assumed_geometry,
    count_eval_examples,
    study_samples,
)
from oodjax import usage_errors
from oodjax.config_read import Job, read
from oodjax.engine import sharding
from oodjax.engine.geometry import BatchGeometry
from oodjax.usage_errors import ConfigError

# What a missing tokenizer or testset leaves possible.
WITHOUT_DATA = (
    "--prompt_len N prices prompts of N tokens without the tokenizer, and --eval_examples M evaluations of M "
    "examples without the testsets"
)


@dataclasses.dataclass(frozen=True)
class Estimate:
    config_path: str
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
class Target:
    """What a job is costed on: `devices` devices of `device`'s kind at `utilisation` of their peak FLOP/s, its
    memory as `platform` allocates it (None: the device's; "cpu" to set it beside a preflight on a CPU)."""

    devices: int
    device: Device
    utilisation: float
    platform: str | None = None


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


def train_flops(job: Job, arch: Mapping[str, Any], geometry: BatchGeometry) -> float:
    """FLOPs of one optimizer step of the runs laid out as ``geometry`` (the job's, or a run group's)."""
    return costs.train_step_flops(
        costs.dimensions(arch),
        runs=geometry.runs,
        rows=geometry.grad_accum * geometry.rows,
        seq_len=geometry.seq_len,
        prompts=geometry.runs * geometry.batch_size,
        lora_parameters=costs.lora_parameter_count(arch, job.lora.rank, job.lora.targets),
        remat=job.model.remat,
    )


def eval_flops(job: Job, arch: Mapping[str, Any], runs: int, rows: Mapping[int, int]) -> float:
    """FLOPs of scoring ``rows`` (row length -> rows), each through all ``runs`` runs' adapters."""
    adapters = runs * costs.lora_parameter_count(arch, job.lora.rank, job.lora.targets)
    return costs.eval_flops(costs.dimensions(arch), rows, adapters)


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
    arch = costs.architecture_of(job.model, layers)
    runs = len(job.runs.runs())
    scoring = functools.partial(eval_flops, job, arch, runs)  # every row through all runs' adapters
    if isinstance(prompts, RealPrompts):
        geometry, samples = prompts.geometry, prompts.samples
        evaluation, first_evaluation = scoring(prompts.eval_rows), scoring(prompts.first_eval_rows)
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
        own = scoring({length: training_sets})
        evaluation = own + scoring({length: runs * examples})
        first_evaluation = own + scoring({length: examples})
    if seq_len:
        geometry = dataclasses.replace(geometry, seq_len=seq_len)
    memory = train_memory(job, arch, mesh, geometry, target.platform or target.device.platform)
    step = train_flops(job, arch, geometry)
    # Each run's own length (train.epochs); a step or an evaluation above is every run's, so each run costs a
    # share of it. Each length's runs train apart and begin with one step-0 evaluation of their own.
    steps_per_run = sum(len(group.runs) * group.total_steps for group in job.groups) / runs
    evaluations = sum(len(group.runs) * len(group.cadence.evaluated_steps()) for group in job.groups) / runs
    total = steps_per_run * step + len(job.groups) * first_evaluation + (evaluations - 1) * evaluation
    hours = total / (target.device.peak_flops * target.utilisation) / 3600
    return Estimate(
        config_path,
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
    fit = fit_text(m.total, device, *usable_memory(device))
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
            f"{result.config_path}: {job.model.source}, {result.parameters:,} parameters",
            f"  mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']}; {runs} runs x batch "
            f"{g.batch_size} in {g.grad_accum} micro-batch{'es' if g.grad_accum > 1 else ''} of {rows}; "
            f"{job.model.dtype}, remat {job.model.remat}",
            f"  memory per device (GB): frozen weights {m.frozen_weights / GB:.2f}{upcast}, adapters "
            f"{m.adapters / GB:.3f}, gradients {m.gradients / GB:.3f}, optimizer state {m.optimizer_state / GB:.3f}, "
            f"activations {m.activations / GB:.2f}, the larger of a layer's backward {m.layer_transients / GB:.2f} "
            f"and the head's {m.head_transients / GB:.2f}; total {m.total / GB:.2f}; {fit}",
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
    host_devices(args.devices)
    target = Target(args.devices, DEVICES[args.device], args.utilisation, args.platform)
    with usage_errors.reported(parser.prog):
        paths = experiment_config_paths(args.configs)
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
        print(describe(result, job, target.device, args.utilisation))
        total_hours += result.accelerator_hours
        total_runs += len(job.runs.runs())
    if len(paths) > 1:
        print(
            f"total: {total_runs} runs in {len(paths)} configs, {total_hours:,.0f} {target.device.name}-hours "
            f"at {args.utilisation:.0%} utilisation"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
