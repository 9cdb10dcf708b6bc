"""`python -m launch.preflight --config configs/X.py [--devices N] [--layers N] [--json OUT] [--hlo DIR]`.

Compiles a config's real train and eval steps ahead of time, on abstract
inputs, before a GPU-hour is spent: the step factories, geometry and
shardings `python -m oodjax.main` uses, on the config's mesh, with training
batches of the real few-shot sets' geometry and evaluation batches of the
real pool's longest rows. Nothing of the model is read or allocated: its
numbers come from `configs.models` or `model.hf_config`. Settings go in
`--config.<field>=<value>` as for `oodjax.main`; the tokenizer is
`config.tokenizer` (else `model.path`), so offline pass a local one.

It replays the config's data as the run loop would (`DATA_STEPS` steps) for
the share of prompt tokens a step computes and the host time its batches
take, and reports per step XLA's per-device memory, the seconds to lower and
compile, and the collectives, with the bytes they move per device set
against the estimated compute seconds (`launch.estimate`, on
`ESTIMATE_DEVICE`): whether a step is communication-bound. Without an
accelerator `--devices N` fakes N host CPU devices; CPU figures are
indicative only (2.5-3.4x a GPU's memory, measured), so there the fit is
judged by the estimate costed for the GPU. A model cut with `--layers` is
judged beside the full model's estimate, and a data-parallel job spread
over nodes (`--node_devices`, `--network_gb_s`) is set against one node.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from absl import flags
from ml_collections import config_dict

from launch import costs, topologies
from launch import estimate as estimator
from launch.compiled import Communication, CompiledStep, abstract_steps, compile_step, largest_group
from launch.devices import DEVICES, GB, Device, fit_text, host_devices, usable_memory
from launch.prompts import rows_by_length
from oodjax import config_cli
from oodjax.config_read import Job, read
from oodjax.engine.evaluation import pool_figures
from oodjax.engine.run_data import training_figures
from oodjax.usage_errors import UsageError

# The entry of launch.devices' table the estimate is made for (its memory does not depend on it),
# and the utilisation its step time assumes: compiling on abstract inputs runs nothing, so the step time
# the preflight can report is the estimator's FLOPs (which count what the remat policy recomputes).
ESTIMATE_DEVICE = "h100"
ESTIMATE_UTILISATION = 0.4
# Training steps of the real streams replayed for the token share and host time, at most the job's own: its
# layout is made for those, and a step after them need not fit it.
DATA_STEPS = 200


@dataclasses.dataclass(frozen=True)
class MemoryLimit:
    """The memory the fit is judged against: ``usable_bytes`` of the estimate device's ``device_bytes``."""

    device: str
    device_bytes: int
    usable_bytes: int
    source: str  # why that much (``launch.devices.usable_memory``)


@dataclasses.dataclass(frozen=True)
class Interconnect:
    device: str
    name: str
    bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class FullModel:
    """A cut compile's model at full depth, so that the verdict does not read as the whole model's."""

    layers: int
    device_estimate_bytes: int


@dataclasses.dataclass(frozen=True)
class Nodes:
    """A job spread over nodes (``over_nodes``)."""

    count: int
    devices_per_node: int
    network: str
    network_bytes_per_s: float
    data_parallel: bool
    job_s: dict[str, float] | None = None  # data parallel: {"over_nodes", "one_node"}, compute and communication


@dataclasses.dataclass(frozen=True)
class Layout:
    """The shapes the steps were compiled for: the train step's geometry and the evaluation pool's rows."""

    runs: int
    grad_accum: int
    rows: int
    rows_per_device: int
    seq_len: int
    packed: bool
    prompt_slots: int
    train_lengths: list[int]
    eval_rows: int
    eval_seq_len: int
    eval_prompt_slots: int
    eval_row_lengths: list[int]
    eval_batches: int


@dataclasses.dataclass(frozen=True)
class Report:
    """The preflight's findings; `--json` writes them with these names (``to_json``)."""

    train_real_token_share: float  # of the tokens a train step computes, those of prompts (replayed streams)
    host_batch_ms: float  # host time one step's batches take to build
    eval_real_token_share: float
    eval_attention_waste: float  # attention scores computed over those the prompts need (``pool_figures``)
    replayed_steps: int
    group_steps: int  # the steps of the run group compiled: the largest (most runs, then longest)
    groups: int  # the job's run groups, which train apart, each as the one compiled
    train: CompiledStep
    eval: CompiledStep  # its largest batch's
    estimate_bytes: int  # the train step's estimate as this platform allocates it
    device_estimate_bytes: int  # as the estimate device's platform does
    memory_limit: MemoryLimit
    interconnect: Interconnect
    train_step_flops: float
    estimate_step_s: float
    eval_step_flops: float  # the largest evaluation batch's
    estimate_eval_step_s: float
    devices: int
    layers: int
    full_model: FullModel | None  # a cut model's full depth
    nodes: Nodes | None
    platform: str
    compiler: str  # what compiled the steps, so what their memory and collectives are of (``compiler_of``)
    topology: str | None  # the TPU slice compiled for (``launch.topologies``), else None: this machine's devices
    geometry: Layout

    def to_json(self) -> str:
        report = dataclasses.asdict(self)
        if self.nodes is not None and self.nodes.job_s is None:
            del report["nodes"]["job_s"]  # compared only for a data-parallel mesh
        return json.dumps(report, indent=2) + "\n"


def preflight(
    job: Job,
    *,
    devices: int | None = None,
    topology: str | None = None,
    layers: int | None = None,
    hlo_dir: str | pathlib.Path | None = None,
    node_devices: int | None = None,
    network_gb_s: float | None = None,
) -> Report:
    """Compiles ``job``'s train and eval steps on the first ``devices`` devices, or for the TPU slice named
    ``topology`` (all its chips, by the TPU compiler: ``launch.topologies``), the model cut to ``layers``, and
    sets them beside the estimate (costed for that slice's chip, else ``ESTIMATE_DEVICE``)."""
    if topology is None:
        available, device_name = jax.devices(), ESTIMATE_DEVICE
    elif devices is not None:
        raise UsageError("--devices and --topology: a TPU slice's devices are all its chips; give one of them")
    else:
        target = topologies.find(topology)
        available, device_name = topologies.devices(target), target.device
    devices = devices or len(available)
    if devices > len(available):
        raise UsageError(f"--devices {devices}: only {len(available)} {available[0].platform} devices are visible")
    group = largest_group(job)
    steps_ = abstract_steps(job, devices=available[:devices], layers=layers)
    geometry, data, arch, longest_rows = steps_.geometry, steps_.data, steps_.arch, steps_.longest_rows
    replayed = min(DATA_STEPS, group.total_steps)
    device = DEVICES[device_name]
    hlo_dir = pathlib.Path(hlo_dir) if hlo_dir else None
    train = compile_step("train", steps_.train_step, steps_.train_args, hlo_dir, device.interconnect_bytes_per_s)
    evaluation = compile_step("eval", steps_.eval_step, steps_.eval_args, hlo_dir, device.interconnect_bytes_per_s)
    platform = available[0].platform
    mesh = job.mesh.sizes(devices)

    def estimate_bytes(arch: Mapping[str, Any], platform: str) -> int:
        return int(estimator.train_memory(job, arch, mesh, geometry, platform).total)

    scoring = functools.partial(estimator.eval_flops, job, arch, geometry.runs)  # the estimate's, for this group
    full, full_model = costs.architecture_of(job.model), None
    if int(arch["num_hidden_layers"]) != int(full["num_hidden_layers"]):
        full_model = FullModel(int(full["num_hidden_layers"]), estimate_bytes(full, device.platform))
    lanes, eval_rows, eval_row_length = longest_rows["input_ids"].shape
    train_step_flops = estimator.train_flops(job, arch, geometry)
    eval_step_flops = scoring({eval_row_length: lanes * eval_rows})
    usable, source = usable_memory(device)
    compute_flops = devices * device.peak_flops * ESTIMATE_UTILISATION
    # The job's parts: (how often, compute seconds, bytes a device its collectives move), an evaluation's
    # collectives taken as its largest batch's for each of its batches.
    parts = [
        (group.total_steps, train_step_flops / compute_flops, train.communication.bytes),
        *(
            (count, scoring(rows_by_length(pool)) / compute_flops, evaluation.communication.bytes * len(pool.batches))
            for count, pool in ((len(group.cadence.evaluated_steps()) - 1, data.eval_pool), (1, data.first_eval_pool))
        ),
    ]
    network = device if network_gb_s is None else given_network(device, network_gb_s)
    return Report(
        **training_figures(data.train_stream, geometry, steps=replayed),
        **pool_figures(data.eval_pool),
        replayed_steps=replayed,
        group_steps=group.total_steps,
        groups=len(job.groups),
        train=train,
        eval=evaluation,
        estimate_bytes=estimate_bytes(arch, platform),
        device_estimate_bytes=estimate_bytes(arch, device.platform),
        memory_limit=MemoryLimit(device_name, int(device.memory_bytes), int(usable), source),
        interconnect=Interconnect(device_name, device.interconnect, device.interconnect_bytes_per_s),
        train_step_flops=train_step_flops,
        estimate_step_s=train_step_flops / compute_flops,
        eval_step_flops=eval_step_flops,
        estimate_eval_step_s=eval_step_flops / compute_flops,
        devices=devices,
        layers=int(arch["num_hidden_layers"]),
        full_model=full_model,
        nodes=over_nodes(job, network, devices, node_devices or device.node_devices, parts),
        platform=platform,
        compiler=compiler_of(available[0], topology),
        topology=topology,
        geometry=Layout(
            **{field: getattr(geometry, field) for field in ("runs", "grad_accum", "rows", "rows_per_device")},
            seq_len=geometry.seq_len,
            packed=geometry.packed,
            prompt_slots=geometry.prompts_per_row,
            train_lengths=list(geometry.micro_batch_lengths),
            eval_rows=eval_rows,
            eval_seq_len=eval_row_length,
            eval_prompt_slots=longest_rows["answer_pos"].shape[-1],
            eval_row_lengths=sorted({b["input_ids"].shape[-1] for b in data.eval_pool.batches}),
            eval_batches=len(data.eval_pool.batches),
        ),
    )


def compiler_of(device: jax.Device, topology: str | None) -> str:
    """What compiles for ``device``, with its version: the figures of a compile are that compiler's."""
    if topology is not None:
        kind = device.device_kind
        return f"the TPU compiler (libtpu {topologies.compiler_version()}) for a {topology} of {kind} chips"
    return f"XLA's {device.platform.upper()} compiler (JAX {jax.__version__}) on this machine"


def given_network(device: Device, gb_s: float) -> Device:
    """``device`` on a network between nodes of ``gb_s`` GB/s a device each way (a site's, not the table's)."""
    if not gb_s > 0:
        raise UsageError(f"--network_gb_s must be > 0, got {gb_s}")
    return dataclasses.replace(device, network_bytes_per_s=gb_s * 1e9, network="the network given")


def over_nodes(
    job: Job, device: Device, devices: int, node_devices: int | None, parts: Sequence[tuple[int, float, float]]
) -> Nodes | None:
    """A job on ``devices`` devices, ``node_devices`` a node, against the same job on one node (None on one node,
    or where the device has no nodes: a TPU slice's ICI joins its hosts).

    ``parts``: (how often, compute seconds, bytes its collectives move a device). Compute and communication
    are added, not overlapped. Only a data-parallel mesh is compared: on one node its step is the same.
    """
    network = device.network_bytes_per_s
    if node_devices is None or devices <= node_devices or network is None:
        return None
    mesh = job.mesh.sizes(devices)
    data_parallel = mesh["fsdp"] == mesh["tensor"] == 1
    job_s = None
    if data_parallel:
        scale = devices / node_devices
        job_s = {
            "over_nodes": sum(n * (compute + moved / network) for n, compute, moved in parts),
            "one_node": sum(
                n * (compute * scale + moved / device.interconnect_bytes_per_s) for n, compute, moved in parts
            ),
        }
    return Nodes(-(-devices // node_devices), node_devices, device.network, network, data_parallel, job_s)


def describe(report: Report) -> str:
    """The report as lines for a terminal."""
    layout = report.geometry
    rows = f"packed, {layout.prompt_slots} prompt slots a row" if layout.packed else "one prompt a row"
    group = f" (the largest of {report.groups} run groups, which train apart)" if report.groups > 1 else ""
    lines = [
        f"compiled by {report.compiler}; FLOPs, step times and the estimate are launch.estimate's (analytic)",
        f"{report.devices} {report.platform} devices, {report.layers} layers; {layout.runs} runs of "
        f"{report.group_steps} steps{group} in "
        f"[{layout.grad_accum} x {layout.rows} rows x {layout.seq_len} tokens] per train step ({rows}; "
        f"micro-batches run at {layout.train_lengths} tokens); eval {layout.eval_batches} batches in rows of "
        f"{layout.eval_row_lengths} tokens, the largest [{layout.eval_rows} rows x {layout.eval_seq_len}]",
        f"real data: train steps compute {report.train_real_token_share:.1%} prompt tokens "
        f"({report.replayed_steps} steps of the runs' streams), their batches take "
        f"{report.host_batch_ms:.2f} ms of host time a step; evaluation computes "
        f"{report.eval_real_token_share:.1%} prompt tokens and "
        f"{report.eval_attention_waste:.2f}x the (causal) attention scores its prompts need",
    ]
    limit = report.memory_limit
    device = DEVICES[limit.device]
    compiled_for_device = report.platform == device.platform

    def fit(total: float) -> str:
        return fit_text(total, device, limit.usable_bytes, limit.source)

    elsewhere = f"as the {report.platform} backend allocates it, not the {device.name} (the fit is below)"
    for name, step in (("train", report.train), ("eval", report.eval)):
        memory = step.memory_bytes
        present = [
            f"{op} x{c['count']} (largest {c['max_bytes'] / 1e6:.1f} MB)"
            for op, c in step.collectives.items()
            if c["count"]
        ]
        lines += [
            f"{name} step: lowered in {step.lower_s:.1f} s, compiled in {step.compile_s:.1f} s",
            f"  memory per device (GB): arguments {memory.argument / GB:.2f}, "
            f"outputs {memory.output / GB:.2f}, temporaries {memory.temp / GB:.2f}, "
            f"aliased {memory.alias / GB:.2f}; total {memory.total / GB:.2f}; "
            f"{fit(memory.total) if compiled_for_device else elsewhere}",
            f"  collectives: {', '.join(present) or 'none'}; Pallas kernels: {step.kernels}",
        ]
    lines.append(f"analytic estimate (launch.estimate, train): {report.estimate_bytes / GB:.2f} GB per device")
    if not compiled_for_device:
        # A CPU's compile allocates several times a GPU's; the GPU estimate tracks it (docs/performance.md).
        lines.append(
            f"on the {device.name}: the train step needs {report.device_estimate_bytes / GB:.2f} GB per device by "
            f"the estimate for a {device.platform.upper()} (0.97-0.99x a GPU's compiled total where measured); "
            f"{fit(report.device_estimate_bytes)}"
        )
    if (full := report.full_model) is not None:
        lines.append(
            f"the full model, {full.layers} layers (this compile {report.layers}): the train step needs "
            f"{full.device_estimate_bytes / GB:.2f} GB per device by the estimate for a {device.platform.upper()}; "
            f"{fit(full.device_estimate_bytes)}"
        )
    on = f"on {report.devices} {limit.device} at {ESTIMATE_UTILISATION:.0%} utilisation"
    link = report.interconnect
    lines.append(
        f"train step: {report.train_step_flops:.3e} FLOPs (remat recomputation included), "
        f"{report.estimate_step_s:.3f} s {on}; "
        f"{_communication_text(report.train.communication, link, report.estimate_step_s)}"
    )
    lines.append(
        f"eval step (its largest batch): {report.eval_step_flops:.3e} FLOPs, {report.estimate_eval_step_s:.3f} s "
        f"{on}; {_communication_text(report.eval.communication, link, report.estimate_eval_step_s)}"
    )
    lines += _nodes_text(report)
    if report.platform == "cpu":
        lines.append(
            "note: CPU figures are indicative only (XLA's CPU backend computes bf16 matmuls in f32, keeps f32 "
            "copies of bf16 weights and gathers them as f32, twice the bytes a GPU's or TPU's collectives move; "
            "where measured, its train step took 2.5-3.4x a GPU's memory)"
        )
    return "\n".join(lines)


def _nodes_text(report: Report) -> list[str]:
    """What spreading the job over nodes costs against one node (``over_nodes``), a warning where it is slower."""
    nodes = report.nodes
    if nodes is None:
        return []
    spread = f"{report.devices} devices on {nodes.count} nodes of {nodes.devices_per_node}"
    network = f"{nodes.network} at {nodes.network_bytes_per_s / 1e9:.0f} GB/s a device"
    if nodes.job_s is None:
        return [f"{spread}: collectives cross nodes over {network}; not compared with one node (not data parallel)"]
    over, one = nodes.job_s["over_nodes"], nodes.job_s["one_node"]
    times = (
        f"the job's steps take {over:,.0f} s of compute and communication (over {network}) against {one:,.0f} s on "
        f"one node's {nodes.devices_per_node} (over {report.interconnect.name})"
    )
    if over > one:
        return [f"WARNING: data parallel over {spread} is slower than one node: {times}; run it on one node"]
    return [f"data parallel over {spread}: {times}"]


def _communication_text(moved: Communication, link: Interconnect, compute_s: float) -> str:
    """What a step's collectives move per device and how long that takes against its compute, in words."""
    bound = "communication-bound" if moved.seconds > compute_s else "compute-bound"
    unknown = moved.loops_without_trip_count
    return (
        f"its collectives move {moved.bytes / 1e9:.2f} GB a device, {moved.seconds:.3f} s over {link.name} at "
        f"{link.bytes_per_s / 1e9:.0f} GB/s: {bound} (communication {moved.seconds / compute_s:.2f}x the compute)"
        + (f"; {unknown} loops without a known trip count counted once" if unknown else "")
    )


def _define_flags() -> None:
    """The command line's flags besides `--config` (defined only when run as a program, so importing this
    module defines none); `--config` and its overrides are `oodjax.config_cli`'s, as for `oodjax.main`."""
    flags.DEFINE_integer("devices", None, "Devices of the mesh (default: all; on CPU, N fake host devices).")
    flags.DEFINE_string(
        "topology",
        None,
        "Compile for this Cloud TPU slice, a gcloud accelerator type (v5litepod-8, v5p-64), with the TPU compiler "
        "(make install-tpu-compiler) on any machine.",
    )
    flags.DEFINE_integer("layers", None, "Compile the model cut to this many decoder layers.")
    flags.DEFINE_integer(
        "node_devices", None, f"Devices of one node (default the {ESTIMATE_DEVICE}'s node's): more are over nodes."
    )
    flags.DEFINE_float(
        "network_gb_s",
        None,
        f"GB/s one device sends over the network between nodes (default the {ESTIMATE_DEVICE} node's, launch.DEVICES).",
    )
    flags.DEFINE_string("json", None, "Write the report as JSON to this file.")
    flags.DEFINE_string("hlo", None, "Write each compiled step's HLO text into this directory.")


def main(config: config_dict.ConfigDict) -> None:
    """Compiles `config` (the command line's, its overrides applied; read without the checks of files and hubs,
    ``oodjax.config_read.read``, as the estimate reads it) and prints (and writes) the report."""
    options = flags.FLAGS
    if options.devices:
        host_devices(options.devices)
    report = preflight(
        read(config),
        devices=options.devices,
        topology=options.topology,
        layers=options.layers,
        hlo_dir=options.hlo,
        node_devices=options.node_devices,
        network_gb_s=options.network_gb_s,
    )
    print(describe(report))
    if options.json:
        pathlib.Path(options.json).write_text(report.to_json())


def run() -> None:
    """Entry point of `python -m launch.preflight` and the `oodjax-preflight` command."""
    _define_flags()
    config_cli.run(main, __doc__)


if __name__ == "__main__":
    run()
