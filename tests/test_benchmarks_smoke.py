"""`python -m benchmarks --quick --smoke` runs end to end and writes well-formed results.

No speed is asserted: CI machines are shared and tiny models say nothing
about speed. What is asserted is what makes the figures trustworthy: every
case and contender is there with the repetitions its mode configures (smoke
mode times each once, and runs a one-run grid, to stay quick), each
contender of a case ran in a process of its own with the run's fixed thread
settings, the contenders computed the same margins and first-step losses,
nothing recompiled while being timed, ratios and their per-round spread
come from the same repetitions, and the markdown and the generated section
of docs/performance.md are generated from the JSON. The harness's parts
(turn order, waiting for idle processes, per-round ratios, comparing two
runs) and the training case's repetitions (each the same batches) are
checked on their own below.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest

from benchmarks import case_matmul, harness, machine, report, settings

ROOT = pathlib.Path(__file__).resolve().parents[1]

CONTENDERS = {
    "peak": {"jax", "pytorch"},
    "eval": {"oodjax", "pytorch-original", "pytorch-tuned"},
    "train": {"oodjax", "pytorch-original", "pytorch-tuned"},
    "loading": {"oodjax", "transformers"},
    "grid": {"oodjax-one-process", "oodjax-process-per-run", "pytorch-tuned-sequential"},
}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "OODJAX_CACHE_DIR"}
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # a caller's setting the benchmark's fixed environment must drop
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_every_case_and_contender_is_measured(smoke_run):
    results, _ = smoke_run
    assert results["mode"] == "smoke"
    assert {case["case"]: set(case["contenders"]) for case in results["cases"]} == CONTENDERS
    smoke = settings.MODES["smoke"]
    expected_repeats = {
        "peak": case_matmul.REPEATS,
        "eval": smoke.repeats,
        "train": smoke.repeats,
        "loading": smoke.loading_repeats,
        "grid": smoke.grid_repeats,
    }
    for case in results["cases"]:
        for name, c in case["contenders"].items():
            where = f"{case['case']}/{name}"
            assert c["repeats"] == expected_repeats[case["case"]] == len(c["seconds"]), where
            assert all(_finite_positive(s) for s in c["seconds"]), where
            assert c["min_s"] <= c["median_s"] <= c["max_s"], where


def test_each_contender_ran_in_a_process_of_its_own_with_the_fixed_thread_settings(smoke_run):
    results, _ = smoke_run
    cores = machine.usable_cores()
    assert results["machine"]["thread_environment"] == {
        "OMP_NUM_THREADS": str(cores),
        "MKL_NUM_THREADS": str(cores),
        "OMP_WAIT_POLICY": None,
        "GOMP_SPINCOUNT": None,
        "KMP_BLOCKTIME": None,
    }
    cases = {case["case"]: case for case in results["cases"]}
    pids = []
    for name in ("eval", "train"):
        processes = cases[name]["processes"]
        assert set(processes) == CONTENDERS[name]
        pids += [process["pid"] for process in processes.values()]
        assert all(process["torch_threads"] == cores for process in processes.values()), processes
    assert len(set(pids)) == len(pids), pids  # no two contenders, of one case or two, shared a process
    for case in results["cases"]:
        if case["case"] != "loading":  # each load is a process of its own, timed from inside
            for name, c in case["contenders"].items():
                assert len(c["other_cpu_s"]) == c["repeats"] and min(c["other_cpu_s"]) >= 0, (case["case"], name)


def test_rates_and_flops_are_consistent(smoke_run):
    results, _ = smoke_run
    cases = {case["case"]: case for case in results["cases"]}
    assert _finite_positive(cases["peak"]["peak_gflops"])
    for name in ("eval", "train"):
        for contender, c in cases[name]["contenders"].items():
            assert c["rate_median"] == pytest.approx(c["work_per_repeat"] / c["median_s"])
            assert c["rate_min"] <= c["rate_median"] <= c["rate_max"]
            assert _finite_positive(c["model_gflops_median"]), contender
            assert c["peak_fraction"] == pytest.approx(c["model_gflops_median"] / cases["peak"]["peak_gflops"])
            assert c["compile_during_timing_s"] == 0.0, f"{name}/{contender} compiled while being timed"
        assert cases[name]["contenders"]["oodjax"]["compile_s"] > 0  # the first call's compilation is counted apart
        contenders = cases[name]["contenders"]
        for other in ("pytorch-original", "pytorch-tuned"):
            fastest, medians = (
                contenders["oodjax"][key] / contenders[other][key] for key in ("rate_max", "rate_median")
            )
            assert cases[name]["ratios"][f"oodjax/{other}"] == pytest.approx(fastest)
            assert cases[name]["ratios_of_medians"][f"oodjax/{other}"] == pytest.approx(medians)
    for case in results["cases"]:  # one repetition: its round's ratio is the ratio of medians
        if "ratios_per_round" in case:
            assert case["ratios_per_round"].keys() == case["ratios"].keys(), case["case"]
            for key, rounds in case["ratios_per_round"].items():
                assert rounds == [pytest.approx(case["ratios"][key])], (case["case"], key)


def test_contenders_compute_the_same_thing(smoke_run):
    results, _ = smoke_run
    cases = {case["case"]: case for case in results["cases"]}
    eval_agreement = cases["eval"]["agreement"]
    assert eval_agreement["max_abs_margin"] > 0
    assert eval_agreement["oodjax_vs_pytorch_tuned"] < 1e-4
    assert eval_agreement["pytorch_original_vs_tuned"] < 1e-4
    train_agreement = cases["train"]["agreement"]
    assert train_agreement["oodjax_vs_pytorch_tuned"] < 1e-4
    assert train_agreement["pytorch_original_vs_tuned"] < 1e-4


def test_loading_and_grid_are_recorded(smoke_run):
    results, _ = smoke_run
    cases = {case["case"]: case for case in results["cases"]}
    loading = cases["loading"]
    assert loading["checkpoint_bytes"] > 1_000_000
    for c in loading["contenders"].values():
        assert _finite_positive(c["peak_rss_mib_median"]) and _finite_positive(c["load_rss_growth_mib_median"])
    grid = cases["grid"]
    runs = len(settings.MODES["smoke"].grid_seeds) * len(settings.MODES["smoke"].grid_shots)
    for c in grid["contenders"].values():
        assert c["runs_completed"] == [runs] * c["repeats"]
    ours = grid["contenders"]["oodjax-one-process"]["min_s"]
    for other in CONTENDERS["grid"] - {"oodjax-one-process"}:  # the same number of runs: a ratio of fastest times
        assert grid["ratios"][f"oodjax-one-process/{other}"] == pytest.approx(grid["contenders"][other]["min_s"] / ours)


def test_markdown_and_the_pages_section_come_from_the_json(smoke_run, tmp_path):
    results, markdown = smoke_run
    assert markdown == report.markdown(results)
    assert results["machine"]["cpu"] in markdown
    for case in results["cases"]:
        assert case["title"] in markdown
    assert "not measured" not in report.targets_table(results)  # every target names a measured quantity
    page = tmp_path / "performance.md"
    page.write_text(f"# x\n\n## Performance\n\n{report.BEGIN}\nold figures\n{report.END}\n\n## After\n")
    report.update_page(page, results)
    text = page.read_text()
    assert "old figures" not in text and text.endswith("\n## After\n")
    assert report.markdown(results).rstrip() in text
    report.update_page(page, results)  # idempotent: regenerating changes nothing
    assert page.read_text() == text


def test_the_published_page_holds_the_committed_results_figures():
    """docs/performance.md's tables are benchmarks/results.json's, and the page stays the method and the latest
    figures (the history of runs lives in git)."""
    text = (ROOT / "docs" / "performance.md").read_text()
    assert report.performance_section(report.load(report.DEFAULT_RESULTS)) in text
    assert len(text.splitlines()) <= 300


def test_a_page_without_markers_is_refused(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text("# no markers here\n")
    with pytest.raises(ValueError, match="must hold the lines"):
        report.update_page(page, {})


def test_turns_rotate_so_no_contender_always_goes_first():
    assert harness.alternating(["a", "b", "c"], 4) == [
        (0, "a"),
        (0, "b"),
        (0, "c"),
        (1, "b"),
        (1, "c"),
        (1, "a"),
        (2, "c"),
        (2, "a"),
        (2, "b"),
        (3, "a"),
        (3, "b"),
        (3, "c"),
    ]


def test_per_round_ratios_pair_each_repetition_with_the_same_round_of_the_other():
    results = {
        "ours": {"work_per_repeat": 4, "seconds": [1.0, 2.0, 4.0]},  # rates 4, 2, 1
        "theirs": {"work_per_repeat": 2, "seconds": [2.0, 1.0, 4.0]},  # rates 1, 2, 0.5
    }
    assert harness.ratios_per_round(results, "ours") == {"ours/theirs": [4.0, 1.0, 2.0]}


def test_ratios_are_of_the_fastest_repetitions_with_the_medians_beside():
    """A slow spell of the machine (benchmarks.harness) lengthens some repetitions; the headline ratio is of
    each contender's fastest, the medians' ratio is kept for information."""
    results = {
        "ours": {"work_per_repeat": 4, "seconds": [1.0, 3.0, 3.0], "min_s": 1.0, "median_s": 3.0},
        "theirs": {"work_per_repeat": 2, "seconds": [1.0, 1.0, 2.0], "min_s": 1.0, "median_s": 1.0},
    }
    fields = harness.ratio_fields(results, "ours")
    assert fields["ratios"] == {"ours/theirs": 2.0}
    assert fields["ratios_of_medians"] == {"ours/theirs": pytest.approx(2 / 3)}
    assert fields["ratios_per_round"] == {"ours/theirs": [2.0, pytest.approx(2 / 3), pytest.approx(4 / 3)]}


def test_turns_wait_until_a_spinning_process_is_idle():
    """A process busy for a while (as OpenMP threads spin after a parallel region) holds the next turn back
    until it stops; an idle one does not."""
    code = "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass\ntime.sleep(30)"
    with subprocess.Popen([sys.executable, "-c", code]) as spinner:
        try:
            time.sleep(0.1)
            start = time.monotonic()
            harness.settle([spinner.pid])
            waited = time.monotonic() - start
            start = time.monotonic()
            harness.settle([spinner.pid])
            waited_idle = time.monotonic() - start
        finally:
            spinner.kill()
    assert waited >= 0.3, waited
    assert waited_idle < 0.3, waited_idle


def test_busy_cpu_counts_everything_but_idle_and_iowait():
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat = "cpu  100 1 50 1000 20 5 4 10 7 0\ncpu0 50 0 25 500 10 2 2 5 3 0\n"
    assert machine.busy_cpu_seconds(stat) == pytest.approx((100 + 1 + 50 + 5 + 4 + 10) / os.sysconf("SC_CLK_TCK"))


def test_a_contender_that_fails_to_build_is_reported_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)contender nope exited \(1\).*no matmul contender 'nope'"):
        harness.compare("case_matmul", ["nope"], {"size": 8}, repeats=1, warmup=1, logs=tmp_path)


def _run_with(eval_ratio: float) -> dict:
    return {
        "finished": f"run {eval_ratio}",
        "cases": [
            {
                "case": "eval",
                "ratios": {"oodjax/pytorch-tuned": eval_ratio},
                "contenders": {"oodjax": {"peak_fraction_max": 0.7}, "pytorch-tuned": {}},
            },
            {"case": "peak", "contenders": {"jax": {}, "pytorch": {}}},
        ],
    }


def test_two_runs_agree_when_every_ratio_is_within_ten_percent():
    table, agree = report.agreement_table(_run_with(2.15), _run_with(2.0))
    assert agree and "| eval | oodjax/pytorch-tuned | 2.15 | 2.00 | 7.5% | yes |" in table
    assert "| eval | oodjax peak fraction | 0.7 | 0.7 | 0.0% | yes |" in table
    table, agree = report.agreement_table(_run_with(1.0), _run_with(1.24))
    assert not agree and "| eval | oodjax/pytorch-tuned | 1.00 | 1.24 | 24.0% | no |" in table


def test_bad_arguments_are_refused():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--cases", "eval,speed"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "unknown cases ['speed']" in done.stderr


@pytest.fixture(scope="module")
def device_smoke_run(tmp_path_factory) -> tuple[dict, str]:
    """``--device gpu --smoke``: the accelerator mode's code, tiny, on this machine's CPU. Its results file is
    read as each phase's "done" line appears on stderr (``snapshots``), and its progress lines kept."""
    out = tmp_path_factory.mktemp("bench-device") / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "OODJAX_CACHE_DIR"}
    snapshots, progress = {}, []
    with (out.parent / "stdout").open("w") as stdout:
        process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks", "--device", "gpu", "--smoke", "--out", str(out)],
            cwd=ROOT,
            env=env,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
        )
        tail = []
        for line in process.stderr:
            tail = (tail + [line])[-40:]
            if line.startswith("[benchmarks] "):
                progress.append(line.rstrip("\n"))
                if ": done in " in line:
                    snapshots[line.split()[1].rstrip(":")] = json.loads(out.read_text())
        assert process.wait(timeout=600) == 0, "".join(tail)
    return json.loads(out.read_text()), out.with_suffix(".md").read_text(), snapshots, progress


def test_device_mode_reports_each_phase_as_it_goes_and_writes_its_results_after_each(device_smoke_run):
    """A line as each phase starts and ends (what it is, its seconds, what is left); the results file rewritten
    after each, holding what that phase measured (oodjax's timings alone, then the agreement, then PyTorch's and
    the ratios): a run cut short keeps its phases' figures."""
    results, _, snapshots, progress = device_smoke_run
    phases = ["oodjax", "agreement", "pytorch"]
    assert [line.split()[1].rstrip(":") + (" done" if " done in " in line else " started") for line in progress] == [
        f"{phase} {event}" for phase in phases for event in ("started", "done")
    ]
    assert progress[0].startswith("[benchmarks] oodjax: started, oodjax's runs trained and evaluated, timed; left:")
    assert progress[-1].endswith("results written; nothing left")
    assert [snapshots[phase]["phases_done"] for phase in phases] == [phases[:1], phases[:2], phases]
    first = {case["case"]: case for case in snapshots["oodjax"]["cases"]}
    assert set(first["device-train"]["contenders"]) == {"oodjax"} and "ratios" not in first["device-train"]
    assert "agreement" not in first["device-eval"] and "agreement" in snapshots["agreement"]["cases"][1]
    assert "partial: agreement, pytorch not done" in report.markdown(snapshots["oodjax"])
    assert set(results["phase_seconds"]) == set(phases) and results["phases"] == phases
    assert results["versions"]["differs"] == [] and results["versions"]["jax"] == "0.10.2"


def test_phases_are_chosen_on_the_command_line():
    """--phases with --device gpu only, among the three, agreement with oodjax; the copies of case_device's and
    launch.estimate's names agree with them."""
    from benchmarks import __main__ as cli
    from benchmarks import case_device, environment
    from launch import devices

    assert cli.PHASES == case_device.PHASES
    assert environment.MEMORY_FRACTION_VARIABLES == devices.MEMORY_FRACTION_VARIABLES
    assert float(environment.MEMORY_FRACTION) == devices.MEMORY_FRACTION_DEFAULT
    assert cli.parse(["--device", "gpu"]).phases == ["oodjax", "agreement", "pytorch"]
    assert cli.parse(["--device", "gpu", "--phases", "oodjax"]).phases == ["oodjax"]
    for wrong in (
        ["--phases", "oodjax"],
        ["--device", "gpu", "--phases", "agreement"],
        ["--device", "gpu", "--phases", "jax"],
    ):
        with pytest.raises(SystemExit) as stopped:
            cli.parse(wrong)
        assert stopped.value.code == 2, wrong


def test_device_mode_times_both_phases_of_every_run_and_checks_the_attention_paths(device_smoke_run):
    """Both phases, both contenders, timed per repetition with work and FLOPs that match the mode; nothing
    compiled while timed; the fused-attention margins checked against XLA's (equal on CPU, where ``auto``
    is XLA); the targets are the accelerator's."""
    results, markdown, _, _ = device_smoke_run
    mode = settings.DEVICE_MODES["gpu-smoke"]
    assert results["mode"] == "gpu-smoke" and markdown == report.markdown(results)
    cases = {case["case"]: case for case in results["cases"]}
    assert set(cases) == {"device-train", "device-eval"}
    work = {"device-train": mode.steps * mode.runs * 16, "device-eval": None}
    for name, case in cases.items():
        assert set(case["contenders"]) == {"oodjax", "pytorch-tuned-sequential"}
        for contender, c in case["contenders"].items():
            assert c["repeats"] == mode.repeats == len(c["seconds"]), (name, contender)
            assert all(_finite_positive(s) for s in c["seconds"]) and _finite_positive(c["model_gflops_median"])
            assert "peak_fraction" not in c  # no MFU against an unknown peak (a CPU)
        if work[name]:
            assert all(c["work_per_repeat"] == work[name] for c in case["contenders"].values())
        ours = case["contenders"]["oodjax"]
        assert ours["compile_s"] > 0 and ours["compile_during_timing_s"] == 0.0
        assert case["ratios"]["oodjax/pytorch-tuned-sequential"] == pytest.approx(
            ours["rate_max"] / case["contenders"]["pytorch-tuned-sequential"]["rate_max"]
        )
    eval_work = cases["device-eval"]["contenders"]["oodjax"]["work_per_repeat"]
    assert eval_work == mode.runs * 8 * mode.eval_per_testset  # every run scores every testset prompt
    agreement = cases["device-eval"]["agreement"]
    # On a CPU ``auto`` is XLA's attention: the fused and XLA margins are one computation. Each bf16 path, the
    # one-run map too, differs from float32 by rounding alone, well below the margins' size
    assert agreement["max_abs_margin"] > 0 and agreement["fused_vs_xla_max_abs_margin_diff"] == 0.0
    for path in ("fused", "xla", "one_run"):
        assert 0 < agreement[f"{path}_vs_float32_max_abs_margin_diff"] < 0.1 * agreement["max_abs_margin"]
    assert "device-train | oodjax peak fraction | at least 0.35 | not measured" in report.targets_table(results)
    assert f"remat {mode.remat}" in cases["device-train"]["description"]


def test_device_mode_takes_the_remat_policy_and_micro_batches_given():
    """--remat and --grad-accum replace the device mode's (and only with --device gpu); the CLI's remat names
    are the model's policies."""
    from benchmarks import __main__ as cli
    from oodjax.models.layers import REMAT_POLICIES

    assert sorted(cli.REMAT_CHOICES) == sorted(REMAT_POLICIES)
    default = cli.device_mode(cli.parse(["--device", "gpu"]))
    assert default == settings.DEVICE_MODES["gpu"]
    assert (default.remat, default.grad_accum) == ("save_dots", 1)
    given = cli.device_mode(cli.parse(["--device", "gpu", "--smoke", "--remat", "none", "--grad-accum", "2"]))
    assert given.name == "gpu-smoke" and (given.remat, given.grad_accum) == ("none", 2)
    for wrong in (["--remat", "none"], ["--device", "gpu", "--grad-accum", "3"], ["--device", "gpu", "--remat", "x"]):
        with pytest.raises(SystemExit) as stopped:
            cli.parse(wrong)
        assert stopped.value.code == 2, wrong


def test_every_training_repetition_takes_the_same_batches(tmp_path, monkeypatch):
    """Each call of a training contender (the warm-up and every repetition) steps through the same rows,
    so repetitions differ only by the machine, not by which batch each drew."""
    from benchmarks import case_train, torch_contenders

    checkpoint = tmp_path / "checkpoint"
    torch_contenders.build_model(settings.MODES["smoke"].model, seed=0).save_pretrained(checkpoint)
    taken = []
    monkeypatch.setattr(torch_contenders.Trainer, "step", lambda self, tokenized, rows: taken.append(rows) or 0.0)
    call, _ = case_train.contender("pytorch-tuned", mode="smoke", checkpoint=str(checkpoint))
    calls = []
    for _ in range(2):  # smoke mode's warm-up and its one repetition
        taken.clear()
        call()
        calls.append(list(taken))
    warm_up, repetition = calls
    assert len(warm_up) == len(repetition) == settings.MODES["smoke"].train_steps_per_repeat
    assert all(len(rows) == settings.TRAIN_BATCH for rows in warm_up)
    assert all((a == b).all() for a, b in zip(warm_up, repetition))
