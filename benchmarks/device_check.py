"""`python -m benchmarks.device_check [--smoke] [--json OUT]`: the one prepared check a session lent a GPU runs first.

Device time comes in short loans, so what a GPU must show is one command
that prints one table: versions against the pins, the demo trained in bf16
with one run and with two, oodjax's training and evaluation MFU at
configs/smol3_*.py's layout (``benchmarks.case_device``), each fused
attention path against XLA's (``benchmarks.attention_parity``), and the
preflight's compiled memory beside its estimate. Each check runs even when
one before it failed; exit status 1 when one failed. ``--smoke`` runs the
same code tiny on any backend (the tests run it on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator

from benchmarks import environment, report, settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The study config whose compiled memory is checked, read offline: GPT-2's tokenizer and the shared testsets
# and few-shot pools standing in for the hub's (the shapes, not the values, decide the memory).
STUDY_CONFIG = ROOT / "configs" / "smol3_mnli.py"
# (batch, length) of the attention parity: the study's shapes on a GPU; tiny for the interpret mode on CPU.
PARITY_SIZES = {"gpu": (4, 384), "smoke": (1, 128)}
# The share of the memory JAX may use that a layout's estimate must fit in: an estimate at 0.75 of it needed
# all of it (docs/performance.md), and XLA then stalled for minutes instead of failing.
HEADROOM = 0.7
TOLERANCE = 0.05  # attention_parity's: the largest error relative to the reference's largest value, bf16


@dataclasses.dataclass
class Row:
    check: str
    result: str
    ok: bool
    seconds: float


def versions_check() -> tuple[str, bool]:
    from oodjax import versions

    found = versions.running()
    differ = versions.differences(found, versions.pins())
    stack = ", ".join(f"{name} {found[name]}" for name in versions.PINNED if found[name] is not None)
    return stack + ("; DIFFERS from the pins: " + ", ".join(differ) if differ else "; as pinned"), True


def demo_check(runs: int, workdir: pathlib.Path, smoke: bool) -> tuple[str, bool]:
    """configs/demo.py in bf16 with ``runs`` runs, through the engine as `python -m oodjax.main` runs it."""
    import jax

    from analysis import schema
    from configs import demo
    from oodjax.config_checks import check_config
    from oodjax.engine import loop
    from oodjax.models import flash_attention

    config = demo.get_config()
    config.model.dtype = "bfloat16"
    config.runs.seeds = (0, 42)[:runs]
    config.output_dir = str(workdir / f"demo-{runs}")
    if smoke:
        config.train.steps = config.eval.every = config.checkpoint_every = 2
        config.train.warmup_steps = 1
        config.data.eval_cap = 4
    start = time.perf_counter()
    loop.train(check_config(config))
    seconds = time.perf_counter() - start
    written = sorted(pathlib.Path(config.output_dir).glob(f"*/{schema.RESULTS_FILENAME}"))
    accuracies = [
        testset[schema.RESULTS_FINAL][schema.RESULTS_ACCURACY]
        for path in written
        for testset in json.loads(path.read_text())[schema.RESULTS_PER_TESTSET].values()
    ]
    complete = all((path.parent / schema.METRICS_FILENAME).is_file() for path in written)
    ok = len(written) == runs and complete and all(a is not None and math.isfinite(a) for a in accuracies)  # NaN: null
    attention = flash_attention.resolve("auto")
    head = config.model.hf_config
    shape = jax.ShapeDtypeStruct(
        (1, 64, head.num_attention_heads, head.hidden_size // head.num_attention_heads), "bfloat16"
    )
    unsupported = flash_attention.cudnn_unsupported(shape, shape) if attention == "cudnn" else None
    chosen = f"xla ({unsupported})" if unsupported else attention
    return (
        f"{seconds:.0f} s with compiles, attention {chosen}, results of {len(written)}/{runs} runs written"
        f"{'' if ok else ' INCOMPLETE or not finite'}",
        ok,
    )


def layouts(mode: settings.DeviceMode, device_kind: str) -> Iterator[tuple[settings.DeviceMode, str]]:
    """``mode`` with each remat policy and micro-batches whose estimated training memory fits the device with
    ``HEADROOM``, fewest micro-batches then least recomputation first, with the estimate in words."""
    from benchmarks import case_device
    from benchmarks.oodjax_contenders import train_geometry
    from launch import costs, devices
    from oodjax.data import DEFAULT_MAX_LENGTH
    from oodjax.models.lora import LoRAConfig

    device = case_device.device_of(device_kind) or devices.DEVICES["h100"]
    usable, _ = devices.usable_memory(device)
    workload, seeds, batches, _ = case_device.inputs(mode)
    one_device, lora = {"data": 1, "fsdp": 1, "tensor": 1}, LoRAConfig(**settings.LORA)
    for grad_accum in (n for n in (1, 2, 4, 8, 16) if settings.TRAIN_BATCH % n == 0):
        geometry = train_geometry(workload.train_set, batches, grad_accum=grad_accum, row_length=DEFAULT_MAX_LENGTH)
        for remat in ("none", "save_dots", "full"):
            per_device = costs.train_memory_per_device(
                mode.model,
                lora,
                dtype="bfloat16",
                remat=remat,
                mesh=one_device,
                runs=len(seeds),
                rows=geometry.rows,
                seq_len=geometry.seq_len,
                prompts_per_row=geometry.prompts_per_row,
            )
            memory = per_device.total
            if memory <= HEADROOM * usable:
                fits = (
                    f"estimate {memory / 2**30:.1f} of {HEADROOM * usable / 2**30:.1f} GiB, {HEADROOM} of the "
                    f"{usable / 2**30:.1f} JAX may use on the {device.name}"
                )
                yield dataclasses.replace(mode, remat=remat, grad_accum=grad_accum), fits


def mfu_check(smoke: bool) -> tuple[str, bool]:
    """The benchmark's oodjax phase at SmolLM3-3B's shape (``--device gpu``; tiny with --smoke), in the first
    layout of ``layouts`` that does not run out of device memory (the estimate is not the compiler)."""
    import jax

    from benchmarks import case_device

    base = settings.DEVICE_MODES["gpu-smoke" if smoke else "gpu"]
    # one repetition (24 steps and an evaluation after the warm-up's), to fit the check's 5 minutes
    tried = []
    for mode, fits in layouts(dataclasses.replace(base, repeats=1), jax.devices()[0].device_kind):
        workload, seeds, batches, answers = case_device.inputs(mode)
        try:
            result, _, _ = case_device.oodjax_phase(mode, workload, seeds, batches, answers)
        except jax.errors.JaxRuntimeError as error:
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            tried.append(f"remat {mode.remat}, {mode.grad_accum} micro-batch(es) ran out of memory ({fits})")
            continue
        break
    else:
        return "; ".join(tried) or "no layout fits by the estimate", False
    figures = []
    for case in case_device.assemble(mode, {"oodjax": result})["cases"]:
        ours = case["contenders"]["oodjax"]
        fraction = f"MFU {ours['peak_fraction']:.0%}" if "peak_fraction" in ours else "MFU: peak unknown"
        rate = f"{ours['rate_median']:.1f} examples/s, {ours['model_gflops_median']:.3g} GFLOP/s"
        figures.append(f"{case['case'].removeprefix('device-')} {rate}, {fraction}")
    memory = result["peak_bytes"]
    peak = f", peak {memory / 2**30:.1f} GiB" if memory else ""
    layout = f"remat {mode.remat}, {mode.grad_accum} micro-batch(es) ({fits}{peak})"
    return "; ".join([*tried, layout + ": " + "; ".join(figures)]), True


def attention_check(kernel: str, smoke: bool) -> tuple[str, bool]:
    """``kernel`` against XLA's attention in float32 at the study's head shapes."""
    from benchmarks import attention_parity

    batch, length = PARITY_SIZES["smoke" if smoke else "gpu"]
    shapes = {"smoke (4 x 16, 2 kv)": (4, 2, 16)} if smoke else attention_parity.SHAPES
    worst = 0.0
    for shape in shapes.values():
        output, gradients = attention_parity.errors(kernel, *shape, batch=batch, length=length)
        worst = max(worst, output, gradients)
    ok = worst <= TOLERANCE
    where = ", ".join(shapes)
    return f"largest relative error {worst:.1e} (outputs and gradients; {where})", ok


def preflight_check(smoke: bool) -> tuple[str, bool]:
    """The preflight of configs/smol3_mnli.py (with --smoke configs/demo.py) compiled for one device."""
    from benchmarks.workload import DATA_DIR, GPT2_TOKENIZER
    from launch import preflight
    from launch.config_files import load_config
    from oodjax.config_read import read

    path = ROOT / "configs" / "demo.py" if smoke else STUDY_CONFIG
    config = load_config(path)
    config.tokenizer, config.data.data_dir = str(GPT2_TOKENIZER), str(DATA_DIR)
    config.data.pool_split = ""  # the offline few-shot pools
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
    measured = preflight.preflight(read(config), devices=1)
    train, evaluation = (step.memory_bytes.total / 2**30 for step in (measured.train, measured.eval))
    estimate = measured.device_estimate_bytes / 2**30
    return (
        f"{path.stem}: train step {train:.2f} GiB compiled ({measured.platform}), estimate for the GPU "
        f"{estimate:.2f}; eval step {evaluation:.2f} GiB",
        True,
    )


def checks(smoke: bool, workdir: pathlib.Path) -> list[tuple[str, Callable[[], tuple[str, bool]]]]:
    kernels = ["pallas_gpu"] if smoke else ["cudnn", "pallas_gpu"]
    return [
        ("versions", versions_check),
        ("demo, bf16, 1 run", lambda: demo_check(1, workdir, smoke)),
        ("demo, bf16, 2 runs", lambda: demo_check(2, workdir, smoke)),
        ("MFU at smol3's layout", lambda: mfu_check(smoke)),
        *((f"attention {kernel}", lambda kernel=kernel: attention_check(kernel, smoke)) for kernel in kernels),
        ("preflight memory", lambda: preflight_check(smoke)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny, on any backend (the tests run it on CPU)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="oodjax-device-check-") as tmp:
        workdir = pathlib.Path(tmp)
        environment.configure(workdir / "tokenized-cache", accelerator=not args.smoke)
        import jax

        if not args.smoke and jax.default_backend() != "gpu":
            parser.exit(
                2, f"{parser.prog}: error: needs JAX's GPU backend, found {jax.default_backend()} (--smoke runs tiny)\n"
            )
        device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}), JAX {jax.__version__}"
        rows = []
        for name, check in checks(args.smoke, workdir):
            print(f"[device_check] {name}: started", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                result, ok = check()
            except Exception as error:  # each check runs even when one before it failed; the table says which
                traceback.print_exc()
                result, ok = f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:200]}", False
            rows.append(Row(name, result, ok, time.perf_counter() - start))
            print(f"[device_check] {name}: done in {rows[-1].seconds:.0f} s", file=sys.stderr, flush=True)
    print(f"device check on {device}")
    print(
        report.table(
            ["check", "result", "ok", "s"],
            [[r.check, r.result, "yes" if r.ok else "NO", f"{r.seconds:.0f}"] for r in rows],
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"device": device, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
