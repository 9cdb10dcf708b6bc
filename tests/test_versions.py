"""The running JAX stack against the pins: read from requirements lines, compared at the precision each library
reports, recorded in results.json and said in one warning as a job starts."""

import importlib.metadata
import importlib.util
import logging

import flax
import jax

from oodjax import main, versions
from oodjax.engine import results

LINES = [
    "# a comment",
    "jax==0.10.2",
    "jaxlib==0.10.2  # with a comment",
    "flax==0.12.8",
    "numpy==2.4.6",
    "jax[cuda12]==0.10.2",
    "nvidia-cuda-runtime-cu12==12.9.79",
    "nvidia-cudnn-cu12==9.28.0.42",
    "torch>=2",
]
PINS = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.8", "cuda": "12.9.79", "cudnn": "9.28.0.42"}


def test_pins_are_read_from_requirements_lines_and_the_checkouts_files():
    assert versions.pins(LINES) == PINS
    assert versions.pins(["jax==0.11.2"]) == {"jax": "0.11.2"}
    assert versions.pins() == PINS  # this checkout's requirements.txt and requirements-gpu.txt


def test_differences_compare_at_the_precision_each_library_reports():
    same = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.8", "cuda": "12.9", "cudnn": "9.28.0"}
    assert versions.differences(same, PINS) == []
    assert versions.differences({"jax": "0.10.2", "cuda": None, "cudnn": None}, PINS) == []  # no CUDA: nothing
    image = {"jax": "0.11.2", "jaxlib": "0.11.2", "flax": "0.12.10", "cuda": "13.0", "cudnn": "9.10.2"}
    assert versions.differences(image, PINS) == [
        "jax 0.11.2 (pinned 0.10.2)",
        "jaxlib 0.11.2 (pinned 0.10.2)",
        "flax 0.12.10 (pinned 0.12.8)",
        "cuda 13.0 (pinned 12.9.79)",
        "cudnn 9.10.2 (pinned 9.28.0.42)",
    ]
    assert versions.differences({"flax": "0.12.8"}, {"jax": "0.10.2"}) == []  # no pin: nothing to differ from


def test_this_process_runs_the_pins_and_results_json_records_them():
    found = versions.running()
    assert (found["jax"], found["flax"], found["cuda"], found["cudnn"]) == (
        jax.__version__,
        flax.__version__,
        None,
        None,
    )
    recorded = results.versions()
    assert recorded["pins"] == PINS and recorded["differs"] == [] and recorded["cudnn"] is None


def test_a_job_says_in_one_warning_where_its_versions_differ(monkeypatch, caplog):
    image = {"jax": "0.11.2", "jaxlib": "0.11.2", "flax": "0.12.8", "cuda": "13.0", "cudnn": "9.28.0"}
    monkeypatch.setattr(versions, "running", lambda: image)
    with caplog.at_level(logging.WARNING):
        main.start_process()
    lines = [record.getMessage() for record in caplog.records if "pins" in record.getMessage()]
    assert lines == [
        "versions differ from the pins (requirements*.txt): jax 0.11.2 (pinned 0.10.2), jaxlib 0.11.2 (pinned "
        "0.10.2), cuda 13.0 (pinned 12.9.79); results.json records them"
    ]
    monkeypatch.setattr(versions, "running", lambda: {"jax": "0.10.2", "cuda": None})
    caplog.clear()
    main.start_process()
    assert not [record for record in caplog.records if "pins" in record.getMessage()]


def test_cuda_versions_are_those_of_the_cuda_plugins_wheels(monkeypatch):
    """A CUDA 12 jax (its plugin importable) reports the CUDA runtime and cuDNN wheels pip installed for it."""
    wheels = {"nvidia-cuda-runtime-cu12": "12.9.79", "nvidia-cudnn-cu12": "9.28.0.42"}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: object() if name == "jax_cuda12_plugin" else find_spec(name)
    )
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: wheels[name] if name in wheels else version(name))
    found = versions.running()
    assert (found["cuda"], found["cudnn"]) == ("12.9.79", "9.28.0.42")
    assert versions.differences(found, PINS) == []
