"""The preflight compiles for a Cloud TPU slice on this CPU machine, with the TPU compiler (libtpu, pinned in
requirements-tpu.txt, unpacked by `make install-tpu-compiler`, which `make test` runs).

The demo at full depth and SmolLM3-3B's study config cut to 2 layers compile for a v5litepod-8 (8 v5e chips):
the report's memory is the TPU compiler's per chip, judged against the chip's 16 GB, and within
``ESTIMATE_BAND`` of the estimate for a TPU; the train step holds splash attention's Mosaic kernels (forward,
dK/dV and dQ, once a micro-batch length) and the eval step its forward. A model widened past a v5e chip's
memory is said not to fit. A slice name the preflight does not know, a missing libtpu and a device count beside a
slice are each one line and exit status 2.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest

from launch import compiled, devices, hlo, preflight, topologies
from launch.config_files import load_config
from oodjax.config_read import read
from oodjax.usage_errors import EXIT_STATUS, UsageError
from tests.conftest import ROOT

# estimate / the TPU compiler's train-step total per chip on a v5litepod-8, as measured (docs/performance.md,
# "Compiled memory on a TPU against the estimate"): the demo 0.94, SmolLM3-3B at 2 layers 1.06 (4 layers 1.10,
# 8 layers 1.09). The estimate's tolerance, as for the GPU's compiled totals (0.97-0.99 there): within 15%.
ESTIMATE_BAND = (0.85, 1.15)


@pytest.fixture(scope="module", autouse=True)
def tpu_compiler():
    """The tests need the TPU compiler; without it they fail saying how to install it (never skip)."""
    try:
        topologies.compiler_path()
    except UsageError as error:
        pytest.fail(str(error))


@pytest.fixture(scope="module", autouse=True)
def run_precision():
    """Compiled at a run's matmul precision, not the tests' "highest" (tests/conftest.py): at that precision
    Mosaic refuses splash's bf16 matmuls ("Bad lhs type")."""
    with jax.default_matmul_precision(None):
        yield


def demo(**hf_config):
    config = load_config(ROOT / "configs" / "demo.py")
    config.model.hf_config.update(hf_config)
    return read(config)


@pytest.fixture(scope="module")
def demo_report():
    return preflight.preflight(demo(), topology="v5litepod-8")


@pytest.fixture(scope="module")
def smol3_report(gpt2_tokenizer_dir):
    config = load_config(ROOT / "configs" / "smol3_mnli.py")
    config.tokenizer = str(gpt2_tokenizer_dir)  # offline: the checkpoint's own tokenizer is not here
    config.data.pool_split = "validation_mismatched"  # nor is MNLI's train split
    return preflight.preflight(read(config), topology="v5litepod-8", layers=2)


def test_the_demo_compiles_for_a_v5e_slice(demo_report):
    report, v5e = demo_report, devices.DEVICES["v5e"]
    assert (report.platform, report.topology, report.devices, report.layers) == ("tpu", "v5litepod-8", 8, 2)
    assert report.compiler == (
        f"the TPU compiler (libtpu {topologies.compiler_version()}) for a v5litepod-8 of TPU v5 lite chips"
    )
    assert topologies.compiler_version() in (ROOT / "requirements-tpu.txt").read_text()
    assert (report.memory_limit.device, report.memory_limit.device_bytes) == ("v5e", 16 * 2**30)
    assert report.interconnect.bytes_per_s == v5e.interconnect_bytes_per_s
    text = preflight.describe(report)
    assert text.startswith(f"compiled by {report.compiler};")
    assert "fits in the 16 GiB of a TPU v5e chip" in text and "on the H100" not in text
    report_json = json.loads(report.to_json())
    assert report_json["compiler"] == report.compiler and report_json["topology"] == "v5litepod-8"
    # Two micro-batch lengths (the demo's buckets), each with splash's forward and two backward kernels.
    assert (report.train.kernels, report.eval.kernels) == (6, 1)


@pytest.mark.parametrize("name", ["demo", "smol3"])
def test_the_tpu_compilers_memory_is_the_estimates(name, demo_report, smol3_report):
    report = {"demo": demo_report, "smol3": smol3_report}[name]
    total = report.train.memory_bytes.total
    print(f"{name}: estimate / TPU compiler = {report.estimate_bytes / total:.3f} ({total / 2**30:.2f} GiB a chip)")
    assert ESTIMATE_BAND[0] <= report.estimate_bytes / total <= ESTIMATE_BAND[1]


def test_smol3_cut_names_the_full_models_estimate_on_the_chip(smol3_report):
    full = smol3_report.full_model
    assert full is not None and full.layers == 36
    assert "the full model, 36 layers (this compile 2)" in preflight.describe(smol3_report)
    assert smol3_report.train.kernels >= 3 and smol3_report.eval.kernels >= 1


def test_a_model_past_a_v5e_chip_is_said_not_to_fit():
    """The demo's OPT widened to 3 float32 layers of 8,192 x 65,536: about 18 GB of weights on every chip of a
    data-parallel mesh, past a v5e chip's 16 GB. The TPU compiler refuses it, and the preflight says so."""
    wide = demo(hidden_size=8192, word_embed_proj_dim=8192, ffn_dim=65536, num_attention_heads=64, num_hidden_layers=3)
    with pytest.raises(
        compiled.OutOfMemory, match=r"^the train step DOES NOT FIT: Ran out of memory on HBM, .*\(24\.\d+G\)"
    ):
        preflight.preflight(wide, topology="v5litepod-8")


@pytest.mark.parametrize(
    "name, chips, grid, kind",
    [
        ("v4-8", 4, "v4:2x2x1", "TPU v4"),
        ("v5p-8", 4, "v5:2x2x1", "TPU v5"),
        ("v5p-64", 32, "v5:2x4x4", "TPU v5"),
        ("v5litepod-8", 8, "v5e:2x4", "TPU v5 lite"),
        ("v6e-8", 8, "v6e:2x4", "TPU v6 lite"),
    ],
)
def test_gcloud_names_are_the_slices_chips(name, chips, grid, kind):
    """gcloud counts a v4's or v5p's TensorCores (two a chip, one JAX device: megacore), a v5e's or v6e's chips.
    The pod variables libtpu loads with are gone afterwards: a process started later would take itself for a
    pod worker (oodjax.engine.distributed)."""
    target = topologies.find(name)
    assert (target.chips, target.topology) == (chips, grid)
    found = topologies.devices(target)
    assert len(found) == chips and {device.device_kind for device in found} == {kind}
    assert "TPU_WORKER_HOSTNAMES" not in os.environ and "TPU_ACCELERATOR_TYPE" not in os.environ


def _refusal(*args, program="python -m launch.preflight"):
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_STATUS and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: "), result.stderr[-3000:]
    return lines[0]


def test_an_unknown_slice_is_one_line_naming_those_there_are():
    line = _refusal("-m", "launch.preflight", "--config=configs/demo.py", "--topology=v5e-8")
    assert "'v5e-8': not a TPU slice" in line and "v5litepod-8" in line and "v5p-64" in line


def test_a_gpu_is_one_line_naming_the_jax_issue():
    line = _refusal("-m", "launch.preflight", "--config=configs/demo.py", "--topology=h100-8")
    assert "'h100-8': compiles for TPU slices only" in line and "jax-ml/jax#23971" in line


def test_without_libtpu_it_is_one_line_saying_what_to_install(tmp_path):
    program = (
        "import pathlib, sys; from launch import preflight, topologies; "
        f"topologies.COMPILER_DIR = pathlib.Path({str(tmp_path)!r}); sys.argv[0] = preflight.__file__; "
        "preflight.run()"
    )
    line = _refusal("-c", program, "--config=configs/demo.py", "--topology=v5litepod-8", program="preflight.py")
    assert "the TPU compiler (libtpu), which is not installed: run make install-tpu-compiler" in line


def test_devices_beside_a_slice_are_refused():
    with pytest.raises(UsageError, match="--devices and --topology"):
        preflight.preflight(demo(), topology="v5litepod-8", devices=4)


def test_the_compiler_is_outside_the_venv():
    """The CPU stack never finds libtpu (JAX would look for a TPU at every start): it lies in .tpu-compiler/."""
    assert importlib.util.find_spec("libtpu") is None
    assert topologies.compiler_path() == str(ROOT / ".tpu-compiler" / "libtpu" / "libtpu.so")


def test_kernels_are_counted_past_a_multi_line_attribute():
    """The TPU compiler prints a Mosaic kernel's backend config over several lines, the last opening with "}}":
    read as the computation's end, it hid the kernels and collectives after it (4 of a train step's 6 counted)."""
    text = """HloModule m, num_partitions=8

ENTRY %main (p: f32[8,128]) -> f32[8,128] {
  %p = f32[8,128]{1,0} parameter(0)
  %fwd = f32[8,128]{1,0} custom-call(%p), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {
"body": "abc"
}}, metadata={op_name="pallas_call"}
  %dq = f32[8,128]{1,0} custom-call(%fwd), custom_call_target="tpu_custom_call", backend_config={"a": 1}
  %sum = f32[8,128]{1,0} all-reduce(%dq), replica_groups={}, to_apply=%add
  ROOT %xla = f32[8,128]{1,0} custom-call(%sum), custom_call_target="Sharding"
}
"""
    assert hlo.kernels(text) == 2
    assert hlo.collectives(text)["all-reduce"]["count"] == 1


def test_make_test_installs_the_pinned_compiler_outside_the_venv(tmp_path):
    """`make test` (CI's entry) runs `make install-tpu-compiler`, which unpacks requirements-tpu.txt's libtpu pin
    (its one pin) into .tpu-compiler/ with the venv's pip, never into the venv."""
    make = ["make", "-n", "-B", f"VENV={tmp_path / 'venv'}"]
    install = subprocess.run([*make, "install-tpu-compiler"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert (
        f"{tmp_path / 'venv'}/bin/python -m pip install -q --no-deps --target .tpu-compiler "
        "$(grep '^libtpu==' requirements-tpu.txt)"
    ) in install.stdout
    test = subprocess.run([*make, "test"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "--target .tpu-compiler" in test.stdout
    assert sum(line.startswith("libtpu==") for line in (ROOT / "requirements-tpu.txt").read_text().splitlines()) == 1
