"""The collectives of an SPMD-partitioned HLO module and the bytes they move, read from its text.

The preflight's communication figures: XLA prints no per-collective traffic, so the module's text is
parsed as far as they need (computations, instruction types, replica groups, loop trip counts).
"""

import collections
import functools
import re
from collections.abc import Callable
from typing import Any

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# One HLO instruction: `[ROOT] %name = <result type> <opcode>(<operands>)...`.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][\w\-]*)\((?P<operands>[^)]*)\)", re.M
)
_ARRAY_TYPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_DTYPE_BYTES = {
    **dict.fromkeys(("pred", "s4", "u4", "s8", "u8"), 1),
    **dict.fromkeys(("bf16", "f16", "s16", "u16"), 2),
    **dict.fromkeys(("f32", "s32", "u32"), 4),
    **dict.fromkeys(("f64", "s64", "u64", "c64"), 8),
    "c128": 16,
}


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {"count", "max_bytes"}} of the collectives in an HLO module's text, as written (a loop's counted
    once, async ones at their -start); ``max_bytes`` is one instruction's largest operand."""
    module = _HloModule(hlo_text)
    found = {op: {"count": 0, "max_bytes": 0} for op in COLLECTIVES}
    for instruction in module.instructions():
        op = _collective(instruction)
        if op is not None:
            found[op]["count"] += 1
            found[op]["max_bytes"] = max(found[op]["max_bytes"], *module.operand_bytes(instruction))
    return found


def communication(hlo_text: str) -> dict[str, Any]:
    """What one execution of an SPMD-partitioned HLO module sends over the interconnect, per device:
    {"bytes", "by_op": {op: bytes}, "loops_without_trip_count"}.

    Each collective moves what a ring algorithm over its group sends (``_RING_SHARE``). Collectives are
    counted as often as they run: a while loop's body times XLA's ``known_trip_count`` (a loop without one
    is counted once and reported), a conditional's costliest branch."""
    module = _HloModule(hlo_text)
    unknown_trips: set[str] = set()

    @functools.cache
    def traffic(computation: str) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter()
        for instruction in module.computations.get(computation, ()):  # a reduction's (to_apply) may be absent
            line = instruction.string
            op = _collective(instruction)
            if op is not None:
                group = 1 if op == "collective-permute" else module.group_size(line)
                total[op] += round(sum(module.operand_bytes(instruction)) * _RING_SHARE[op](group))
            if instruction["op"] == "while":
                trips = _TRIP_COUNT.search(line)
                if trips is None:
                    unknown_trips.add(instruction["name"])
                body = traffic(_called(line, "body")[0]) + traffic(_called(line, "condition")[0])
                total.update({op: count * (int(trips[1]) if trips else 1) for op, count in body.items()})
            elif instruction["op"] == "conditional":
                pair = _called(line, "true_computation") + _called(line, "false_computation")
                branches = _called(line, "branch_computations") or pair
                total.update(max((traffic(branch) for branch in branches), key=lambda t: sum(t.values())))
            elif not instruction["op"].endswith(("-update", "-done")):  # an async op's computation runs once
                for attribute in ("calls", "to_apply", "called_computations"):
                    for called in _called(line, attribute):
                        total.update(traffic(called))
        return total

    by_op = traffic(module.entry)
    return {
        "bytes": int(sum(by_op.values())),
        "by_op": {op: int(by_op[op]) for op in COLLECTIVES},
        "loops_without_trip_count": len(unknown_trips),
    }


# The custom call a Pallas kernel compiles to: Mosaic's on a TPU, Triton's on a GPU.
_KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton")


def kernels(hlo_text: str) -> int:
    """The Pallas kernels (custom calls to Mosaic or Triton) in an HLO module's text, as written (a loop's
    counted once): the fused attention compiled into a step, where XLA's own would count none."""
    return sum(
        instruction["op"] == "custom-call"
        and any(f'custom_call_target="{t}"' in instruction.string for t in _KERNEL_TARGETS)
        for instruction in _HloModule(hlo_text).instructions()
    )


# The share of the buffer a device passes to a collective that it sends, ring algorithm, n devices in its group
# (``communication``).
_RING_SHARE: dict[str, Callable[[int], float]] = {
    "all-gather": lambda n: n - 1,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "collective-permute": lambda n: 1,
}
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*->.*\{\s*$")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _collective(instruction: re.Match[str]) -> str | None:
    """The collective an instruction starts (an async one at its -start), else None."""
    op = instruction["op"].removesuffix("-start")
    return op if op in COLLECTIVES else None


def _called(line: str, attribute: str) -> list[str]:
    """The computations an instruction's ``attribute`` names (``body=%b``, ``branch_computations={%a, %b}``)."""
    found = re.search(rf"\b{attribute}=(\{{[^}}]*\}}|%[\w.\-]+)", line)
    return re.findall(r"%([\w.\-]+)", found[1]) if found else []


class _HloModule:
    """An HLO module's text parsed as far as the collectives need: its computations' instructions, the types of
    the values they define and its device count."""

    def __init__(self, hlo_text: str):
        self.computations: dict[str, list[re.Match[str]]] = {}
        self.entry = ""
        lines = hlo_text.splitlines()
        current: list[re.Match[str]] | None = None
        for line in lines:
            header = _COMPUTATION.match(line) if current is None else None
            if header:
                current = self.computations.setdefault(header["name"], [])
                self.entry = header["name"] if header["entry"] else self.entry
            elif line.rstrip() == "}":  # a computation's end (a multi-line attribute may close with "}}")
                current = None
            elif current is not None and (instruction := _INSTRUCTION.match(line)):
                current.append(instruction)
        if not self.computations:  # bare instructions (no computation headers): one entry computation of them all
            self.computations[""] = [instruction for line in lines if (instruction := _INSTRUCTION.match(line))]
        self.types = {match["name"]: match["type"] for match in self.instructions()}
        partitions = re.search(r"\bnum_partitions=(\d+)", hlo_text)
        replicas = re.search(r"\breplica_count=(\d+)", hlo_text)
        self.devices = (int(partitions[1]) if partitions else 1) * (int(replicas[1]) if replicas else 1)

    def instructions(self) -> list[re.Match[str]]:
        return [instruction for computation in self.computations.values() for instruction in computation]

    def operand_bytes(self, instruction: re.Match[str]) -> list[int]:
        """Each operand's bytes (a tuple operand's summed)."""
        operands = [self.types.get(name, "") for name in re.findall(r"%([\w.\-]+)", instruction["operands"])]
        if not any(operands):  # operands printed with their types
            operands = [instruction["operands"]]
        return [sum(_array_bytes(*array) for array in _ARRAY_TYPE.findall(t)) for t in operands]

    def group_size(self, line: str) -> int:
        """The devices of each of a collective's replica groups: listed (``{{0,1},{2,3}}``), an iota
        (``[2,4]<=[8]``: 2 groups of 4), named mesh axes (``mesh['x'=2,'y'=4] {'y'}``), or every device (none
        given, or ``{}``)."""
        if (listed := re.search(r"replica_groups=\{\{([^}]*)\}", line)) is not None:
            return len(listed[1].split(","))
        if (iota := re.search(r"replica_groups=\[([\d,]+)\]<=", line)) is not None:
            return int(iota[1].split(",")[-1])
        # The mesh form may reorder the devices (``mesh[...], device_ids=([4,2]T(1,0)) {'x'}``): sizes are unchanged.
        mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(.*?\))?\s*\{([^}]*)\}", line)
        if mesh is not None:
            sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh[1])}
            names = re.findall(r"'([^']+)'", mesh[2])
            if not names or any(name not in sizes for name in names):
                raise ValueError(f"replica groups over unknown mesh axes: {mesh[0]!r}")
            return int(np.prod([sizes[name] for name in names]))
        if re.search(r"replica_groups=(\{\}|[,\s]|$)", line) or "replica_groups=" not in line:
            return self.devices
        raise ValueError(f"unrecognised replica groups in {line.strip()[:300]!r}")


def _array_bytes(dtype: str, dims: str) -> int:
    if dtype not in _DTYPE_BYTES and not dtype.startswith("f8"):
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _DTYPE_BYTES.get(dtype, 1)
