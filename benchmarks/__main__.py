"""`python -m benchmarks [--quick] [--smoke] [--out FILE] [--cases A,B] [--device gpu [--phases A,B] [...]]`.

Runs the cases against PyTorch + PEFT, each contender in a process of its
own taking turns (``benchmarks.harness``), and writes FILE and the same
report as markdown beside it (FILE with .md). ``--device gpu`` runs
``benchmarks.case_device`` instead, the study's 9 runs at SmolLM3-3B's shape
on one GPU; FILE is rewritten after every phase, so a run cut short keeps
what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import shlex
import sys
import tempfile
import time

from benchmarks import environment, report, settings
from oodjax import storage

HERE = pathlib.Path(__file__).resolve().parent
CASES = ("eval", "train", "loading", "grid")  # the matmul peak always runs: the others are fractions of it
# benchmarks.case_device.PHASES, spelled out for the same reason as REMAT_CHOICES (the tests check they agree).
PHASES = ("oodjax", "agreement", "pytorch")
# oodjax.models.layers.REMAT_POLICIES' names, spelled out: importing it would import JAX before
# benchmarks.environment configures it (tests/test_benchmarks_smoke.py checks the two agree).
REMAT_CHOICES = ("full", "none", "save_dots", "save_dots_except_mlp")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="oodjax against transformers + peft")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smaller model and fewer examples (~5 minutes, most of it starting processes)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny everything, to show it runs (CI)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="results JSON (markdown goes beside it)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="gpu: 9 runs at SmolLM3-3B's shape, bf16, on one GPU (the CPU cases are not run)",
    )
    parser.add_argument(
        "--remat",
        choices=REMAT_CHOICES,
        default=None,
        help="with --device gpu: the train step's remat policy (default save_dots: settings.DeviceMode says why)",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        help=f"with --device gpu: micro-batches a training step (default 1; must divide {settings.TRAIN_BATCH})",
    )
    parser.add_argument(
        "--phases",
        default=None,
        help=f"with --device gpu: a comma-separated subset of {','.join(PHASES)} (default all; agreement needs oodjax)",
    )
    args = parser.parse_args(argv)
    if args.device != "gpu" and (args.remat is not None or args.grad_accum is not None or args.phases is not None):
        parser.error("--remat, --grad-accum and --phases apply to --device gpu only")
    args.phases = [p for p in (args.phases or ",".join(PHASES)).split(",") if p]
    if sorted(set(args.phases) - set(PHASES)) or not args.phases:
        parser.error(f"--phases takes a comma-separated subset of {','.join(PHASES)}, got {','.join(args.phases)!r}")
    if "agreement" in args.phases and "oodjax" not in args.phases:
        parser.error("--phases agreement compares the runs the oodjax phase trains: add oodjax")
    if args.grad_accum is not None and (args.grad_accum < 1 or settings.TRAIN_BATCH % args.grad_accum):
        parser.error(f"--grad-accum must divide the batch of {settings.TRAIN_BATCH} examples, got {args.grad_accum}")
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    accelerator = args.device == "gpu"
    # --smoke wins over --quick: it is the smallest size, the one CI runs
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = device_mode(args) if accelerator else settings.MODES[size]
    out = args.out or HERE / ("results.json" if mode.name == "full" else f"results-{mode.name}.json")
    started = time.perf_counter()
    command = shlex.join(["python", "-m", "benchmarks", *argv])

    def save(results: dict) -> None:
        """Writes ``results`` as they stand (after every --device gpu phase, and at the end)."""
        results.update(command=command, finished=datetime.datetime.now().isoformat(timespec="seconds"))
        results["wall_s"] = time.perf_counter() - started
        for path, text in (
            (out, json.dumps(results, indent=1) + "\n"),
            (out.with_suffix(".md"), report.markdown(results)),
        ):
            storage.write_atomic(path, lambda file, text=text: file.write(text.encode()), intact="the earlier file")

    with tempfile.TemporaryDirectory(prefix="oodjax-bench-") as tmp:
        workdir = pathlib.Path(tmp)
        environment.configure(workdir / "tokenized-cache", accelerator=accelerator)
        from oodjax import versions

        stack = {**versions.running(), "pins": versions.pins(), "differs": versions.warn_if_unpinned()}
        if accelerator:
            results = run_device(mode, args.phases, out, lambda partial: save({**partial, "versions": stack}))
        else:
            results = run(mode, args.cases, workdir)
    results["versions"] = stack
    save(results)
    print(report.markdown(results))
    print(f"wrote {out} and {out.with_suffix('.md')}")


def device_mode(args: argparse.Namespace) -> settings.DeviceMode:
    """The --device gpu mode (--smoke: its tiny one), with the remat policy and micro-batches given."""
    mode = settings.DEVICE_MODES["gpu-smoke" if args.smoke else "gpu"]
    given = {"remat": args.remat, "grad_accum": args.grad_accum}
    return dataclasses.replace(mode, **{field: value for field, value in given.items() if value is not None})


def run_device(mode: settings.DeviceMode, phases: list[str], out: pathlib.Path, save) -> dict:
    """The --device gpu phases (``benchmarks.case_device``), ``save``d after each; the time each phase took
    in an earlier run of the same mode at ``out`` is its estimate."""
    from benchmarks import case_device, machine

    described = {"mode": mode.name, "device_mode": json.loads(json.dumps(dataclasses.asdict(mode))), "phases": phases}
    earlier = json.loads(out.read_text()) if out.is_file() else {}
    same = earlier.get("device_mode") == described["device_mode"]
    described["machine"] = machine.describe(torch_threads=None)  # PyTorch's are its own process's

    def save_with_machine(measured: dict) -> None:
        if "torch_threads" in measured:
            described["machine"]["torch_threads"] = measured.pop("torch_threads")
        save({**described, **measured})

    measured = case_device.run(
        mode, phases, save=save_with_machine, earlier=earlier.get("phase_seconds") if same else None
    )
    return {**described, **measured}


def run(mode: settings.Mode, cases: list[str], workdir: pathlib.Path) -> dict:
    """Every requested case; each case's contenders run in processes of their own (``benchmarks.harness``),
    on the checkpoint and tokenisation cache this process writes first."""
    import torch

    from benchmarks import case_eval, case_grid, case_loading, case_matmul, case_train, machine, torch_contenders
    from benchmarks.workload import mode_workload

    clock = time.perf_counter()

    def record(case: dict) -> None:
        nonlocal clock
        case["case_wall_s"] = time.perf_counter() - clock
        clock = time.perf_counter()
        results["cases"].append(case)
        print(f"[benchmarks] {case['case']} done in {case['case_wall_s']:.0f} s", file=sys.stderr, flush=True)

    results = {"mode": mode.name, "machine": machine.describe(torch_threads=torch.get_num_threads()), "cases": []}
    peak = case_matmul.run(mode, workdir / "logs")
    record(peak)
    peak_flops = peak["peak_gflops"] * 1e9

    checkpoint = workdir / "checkpoint"
    if {"eval", "train", "loading"} & set(cases):
        # float32 safetensors: every contender of the evaluation and training cases loads it, and loading times it
        torch_contenders.build_model(mode.model, seed=0).save_pretrained(checkpoint)
    if {"eval", "train"} & set(cases):
        workload = mode_workload(mode)  # also fills the run's tokenisation cache, which the contenders read
        results["workload"] = workload.describe()
        if "eval" in cases:
            record(case_eval.run(mode, workload, checkpoint, peak_flops, workdir / "logs"))
        if "train" in cases:
            record(case_train.run(mode, workload, checkpoint, peak_flops, workdir / "logs"))
    if "loading" in cases:
        record(case_loading.run(mode, checkpoint))
    if "grid" in cases:
        record(case_grid.run(mode, workdir / "grid"))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
