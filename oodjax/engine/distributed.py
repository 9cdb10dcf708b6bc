"""Multi-host start: one JAX process per node or per GPU, found from SLURM, a TPU pod or explicit values.

JAX's own auto-detection binds each SLURM task to the GPU numbered by its
local task id, so one task per node silently trains on one GPU of each.
Here the layout is a stated choice, OODJAX_PROCESSES_PER `per_node` or
`per_device` (required under SLURM, `per_node` on TPU pods), and one that
contradicts the allocation is an error before any device is touched.

Sources, first match wins: explicit OODJAX_COORDINATOR_ADDRESS,
OODJAX_NUM_PROCESSES and OODJAX_PROCESS_ID (or arguments); SLURM's
variables; a TPU pod's TPU_WORKER_HOSTNAMES and TPU_WORKER_ID; else a
single process, and nothing is initialised.

Failures between hosts are one line, not a traceback after minutes: a
host name that resolves to loopback on a multi-host CPU run (gloo would
advertise it), a coordinator not joined within OODJAX_COORDINATOR_TIMEOUT,
and a process lost mid-run (``lost_peer``; oodjax.main ends the others).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Literal, TypedDict, Unpack

import jax

from oodjax import usage_errors

ProcessesPer = Literal["per_node", "per_device"]
PROCESSES_PER: tuple[ProcessesPer, ...] = ("per_node", "per_device")
# Coordinator ports: SLURM jobs pick one from the job id so that two jobs
# sharing a first node do not collide; TPU pods use JAX's usual 8476.
SLURM_PORT_BASE, SLURM_PORT_RANGE = 61440, 4096
TPU_COORDINATOR_PORT = 8476
# Seconds: how long the processes wait for each other at start (OODJAX_COORDINATOR_TIMEOUT; JAX's own
# timeout, a fatal-error dump, is set a margin later), and how long a process may send no heartbeat before
# JAX ends the others (OODJAX_HEARTBEAT_TIMEOUT; JAX's default is 100).
COORDINATOR_TIMEOUT_S = 300
HEARTBEAT_TIMEOUT_S = 30
_JAX_TIMEOUT_MARGIN_S = 60
LOST_PEER_EXIT_CODE = 1  # a collective lost a process of another host (``lost_peer``)


class LayoutError(usage_errors.UsageError, ValueError):
    """The process layout cannot be determined, contradicts the allocation, or cannot work on this network."""


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """Everything `jax.distributed.initialize` needs; `local_device_ids` None: every device it sees."""

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None
    source: str
    hosts: tuple[str, ...] = dataclasses.field(default=(), compare=False)  # each process's host, where known


def detect_layout(
    env: Mapping[str, str] | None = None,
    *,
    processes_per: ProcessesPer | None = None,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> ProcessLayout | None:
    """The layout of this process, or None when it is the only one; arguments take precedence over variables."""
    env = os.environ if env is None else env
    per = processes_per or env.get("OODJAX_PROCESSES_PER") or None
    if per is not None and per not in PROCESSES_PER:
        raise LayoutError(f"processes_per (OODJAX_PROCESSES_PER) must be one of {PROCESSES_PER}, got {per!r}")
    layout = _explicit_layout(env, coordinator_address, num_processes, process_id)
    if layout is None and "SLURM_JOB_ID" in env and "SLURM_PROCID" in env:
        layout = _slurm_layout(env, per)
    elif layout is None and "TPU_WORKER_HOSTNAMES" in env:
        layout = _tpu_layout(env, per)
    return layout if layout is not None and layout.num_processes > 1 else None


class ExplicitLayout(TypedDict, total=False):
    """``detect_layout``'s arguments, which ``initialize`` passes on."""

    processes_per: ProcessesPer | None
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


def initialize(env: Mapping[str, str] | None = None, **explicit: Unpack[ExplicitLayout]) -> ProcessLayout | None:
    """Starts JAX's multi-controller runtime (before any device use), its own detection off; None: one process."""
    env = os.environ if env is None else env
    layout = detect_layout(env, **explicit)
    if layout is None:
        return None
    check_host_address(layout, jax.config.values["jax_platforms"] or env.get("JAX_PLATFORMS", ""))
    timeout = _seconds(env, "OODJAX_COORDINATOR_TIMEOUT", COORDINATOR_TIMEOUT_S)
    # XLA's SIGTERM handler would swallow a SIGTERM that comes before ``oodjax.engine.preemption``'s are in place.
    jax.config.update("jax_enable_preemption_service", False)
    # JAX's own timeout ends the process with a fatal-error dump: this one line comes first.
    waiting = threading.Timer(timeout, _not_joined, (layout, timeout))
    waiting.daemon = True
    waiting.start()
    try:
        jax.distributed.initialize(
            coordinator_address=layout.coordinator_address,
            num_processes=layout.num_processes,
            process_id=layout.process_id,
            local_device_ids=list(layout.local_device_ids) if layout.local_device_ids is not None else None,
            cluster_detection_method="deactivate",
            initialization_timeout=timeout + _JAX_TIMEOUT_MARGIN_S,
            heartbeat_timeout_seconds=_seconds(env, "OODJAX_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S),
        )
    finally:
        waiting.cancel()
    return layout


def _not_joined(layout: ProcessLayout, timeout: int) -> None:
    """Ends the process, from the timer thread, while JAX still waits for the coordinator."""
    host = layout.coordinator_address.rsplit(":", 1)[0]
    print(
        f"oodjax: error: process {layout.process_id} of {layout.num_processes} waited {timeout} s for the JAX "
        f"coordinator at {layout.coordinator_address} and the other processes: check that process 0 runs on "
        f"{host}, that this host reaches that address and port, or raise OODJAX_COORDINATOR_TIMEOUT",
        file=sys.stderr,
        flush=True,
    )
    os._exit(usage_errors.EXIT_STATUS)


def check_host_address(layout: ProcessLayout, platforms: str) -> None:
    """Stops a CPU job across hosts whose host name resolves to a loopback address: gloo, JAX's CPU
    collectives, would give the other hosts that address, and each would time out connecting to itself."""
    if len(set(layout.hosts)) < 2 or platforms.split(",")[0] not in ("", "cpu"):
        return
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError as error:
        raise LayoutError(
            f"this host's name {name} does not resolve ({error}): JAX's CPU collectives "
            f"need it to; map {name} to this host's address in /etc/hosts or DNS"
        ) from None
    if ipaddress.ip_address(address).is_loopback:
        raise LayoutError(
            f"this host's name {name} resolves to {address}, a loopback address: JAX's CPU collectives (gloo) "
            f"would give the other hosts of the job that address; map {name} to the address they reach it at "
            "in /etc/hosts (Debian maps the host name to 127.0.1.1) or DNS"
        )


def lost_peer(error: BaseException) -> str | None:
    """The host whose process a failed CPU collective lost, as "name (address)", or None when ``error`` is not
    that: gloo names the peer whose connection broke ("Gloo all-reduce failed: ... Read error [ADDRESS]:PORT:
    Connection reset by peer")."""
    match = re.search(r"Gloo [\w-]+ failed: .*?\[([^\]]+)\]:\d+", str(error))
    if match is None:
        return None
    try:
        return f"{socket.gethostbyaddr(match[1])[0]} ({match[1]})"
    except OSError:
        return match[1]


def is_primary() -> bool:
    """True in process 0, the only process that writes results, logs and tables."""
    return jax.process_index() == 0


def _explicit_layout(
    env: Mapping[str, str], coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> ProcessLayout | None:
    values = {
        "OODJAX_COORDINATOR_ADDRESS": coordinator_address or env.get("OODJAX_COORDINATOR_ADDRESS"),
        "OODJAX_NUM_PROCESSES": num_processes if num_processes is not None else env.get("OODJAX_NUM_PROCESSES"),
        "OODJAX_PROCESS_ID": process_id if process_id is not None else env.get("OODJAX_PROCESS_ID"),
    }
    given = {name for name, value in values.items() if value not in (None, "")}
    if not given:
        return None
    if len(given) < len(values):
        missing = sorted(set(values) - given)
        raise LayoutError(f"explicit multi-process start needs all of {sorted(values)}; missing {missing}")
    address = str(values["OODJAX_COORDINATOR_ADDRESS"])
    if not re.fullmatch(r"[^:\s]+:\d+", address):
        raise LayoutError(f"OODJAX_COORDINATOR_ADDRESS must be host:port, got {address!r}")
    count = _positive_int("OODJAX_NUM_PROCESSES", values["OODJAX_NUM_PROCESSES"])
    index = _process_index("OODJAX_PROCESS_ID", values["OODJAX_PROCESS_ID"], count)
    return ProcessLayout(address, count, index, None, "explicit")


def _slurm_layout(env: Mapping[str, str], processes_per: ProcessesPer | None) -> ProcessLayout:
    count = _positive_int("SLURM_NTASKS", _require(env, "SLURM_NTASKS"))
    index = _process_index("SLURM_PROCID", _require(env, "SLURM_PROCID"), count)
    if count == 1:
        return ProcessLayout("", 1, 0, None, "slurm")
    if processes_per is None:
        raise LayoutError(
            f"SLURM started {count} tasks: set OODJAX_PROCESSES_PER to 'per_node' (one process drives "
            "all GPUs of its node) or 'per_device' (one process per GPU)"
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or _require(env, "SLURM_JOB_NODELIST")
    port = SLURM_PORT_BASE + int(_require(env, "SLURM_JOB_ID")) % SLURM_PORT_RANGE
    nodes = expand_nodelist(nodelist)
    address = f"{nodes[0]}:{port}"
    counts = _tasks_per_node(env)
    tasks_here = counts[_process_index("SLURM_NODEID", env.get("SLURM_NODEID", "0"), len(counts))]
    # SLURM's default (block) distribution: the first node's tasks first. Only the lost-peer line names them.
    hosts = tuple(node for node, tasks in zip(nodes, counts) for _ in range(tasks))
    if processes_per == "per_node":
        if tasks_here != 1:
            raise LayoutError(
                f"processes_per='per_node' but SLURM started {tasks_here} tasks on this node; "
                "launch with --ntasks-per-node=1, or choose 'per_device'"
            )
        return ProcessLayout(address, count, index, None, "slurm", hosts)
    local_id = _process_index("SLURM_LOCALID", _require(env, "SLURM_LOCALID"), tasks_here)
    visible = _visible_gpus(env)
    if visible == 1:
        device_ids = None  # SLURM already bound one GPU to this task
    elif visible is None or visible == tasks_here:
        device_ids = (local_id,)
    else:
        raise LayoutError(
            f"processes_per='per_device' but this node has {tasks_here} task(s) for {visible} visible GPUs; "
            f"launch with --ntasks-per-node={visible}, or choose 'per_node'"
        )
    return ProcessLayout(address, count, index, device_ids, "slurm", hosts)


def _tpu_layout(env: Mapping[str, str], processes_per: ProcessesPer | None) -> ProcessLayout:
    if processes_per == "per_device":
        raise LayoutError("TPU pods run one process per host: choose processes_per='per_node'")
    hosts = [host.strip() for host in env["TPU_WORKER_HOSTNAMES"].split(",") if host.strip()]
    if not hosts:
        raise LayoutError("TPU_WORKER_HOSTNAMES is empty")
    index = _process_index("TPU_WORKER_ID", _require(env, "TPU_WORKER_ID"), len(hosts))
    return ProcessLayout(f"{hosts[0]}:{TPU_COORDINATOR_PORT}", len(hosts), index, None, "tpu", tuple(hosts))


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list as host names: `scontrol show hostnames` where it is here, else ours."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        answer = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True)
        hosts = answer.stdout.split()
        if answer.returncode == 0 and hosts:
            return hosts
    return parse_nodelist(nodelist)


def parse_nodelist(nodelist: str) -> list[str]:
    """A SLURM host list ("gpu[01-03,07],node[1-2]-ib[0-1]") expanded, zero-padded as written."""
    names = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist)
    if ",".join(names) != nodelist:
        raise LayoutError(f"cannot parse SLURM node list {nodelist!r}: unbalanced brackets")
    hosts = [host for name in names for host in _expand_name(name, nodelist)]
    if not hosts:
        raise LayoutError(f"empty SLURM node list {nodelist!r}")
    return hosts


def _expand_name(name: str, nodelist: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\]]*)\](.*)", name)
    if match is None:
        if "[" in name or "]" in name:
            raise LayoutError(f"cannot parse SLURM node list {nodelist!r} at {name!r}")
        return [name]
    prefix, ranges, rest = match.groups()
    numbers = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise LayoutError(f"cannot parse SLURM node list {nodelist!r} at {part!r}")
        numbers += [f"{number:0{len(first)}d}" for number in range(int(first), int(last or first) + 1)]
    return [f"{prefix}{number}{suffix}" for number in numbers for suffix in _expand_name(rest, nodelist)]


def _tasks_per_node(env: Mapping[str, str]) -> list[int]:
    """Tasks SLURM placed on each node of the step, from its "2(x3),1"-style counts."""
    name = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in env else "SLURM_TASKS_PER_NODE"
    counts: list[int] = []
    for item in _require(env, name).split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise LayoutError(f"cannot parse {name}={env[name]!r} at {item!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _visible_gpus(env: Mapping[str, str]) -> int | None:
    if env.get("CUDA_VISIBLE_DEVICES"):
        return len(env["CUDA_VISIBLE_DEVICES"].split(","))
    if env.get("SLURM_GPUS_ON_NODE"):
        return _positive_int("SLURM_GPUS_ON_NODE", env["SLURM_GPUS_ON_NODE"])
    return None


def _seconds(env: Mapping[str, str], name: str, default: int) -> int:
    return _positive_int(name, env[name]) if env.get(name) else default


def _require(env: Mapping[str, str], name: str) -> str:
    if not env.get(name):
        raise LayoutError(f"{name} is not set; it is needed to place this process")
    return env[name]


def _positive_int(name: str, value: str | int | None) -> int:
    number = _integer(name, value)
    if number < 1:
        raise LayoutError(f"{name} must be at least 1, got {number}")
    return number


def _process_index(name: str, value: str | int | None, count: int) -> int:
    index = _integer(name, value)
    if not 0 <= index < count:
        raise LayoutError(f"{name}={index} is outside 0..{count - 1}")
    return index


def _integer(name: str, value: str | int | None) -> int:
    try:
        return int("" if value is None else value)  # None (not given) fails as a non-number does
    except ValueError:
        raise LayoutError(f"{name} must be an integer, got {value!r}") from None
