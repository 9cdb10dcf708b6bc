"""Model family and size come from a run's config, and file stems never collide."""

import math

import pytest
from fixtures_results import SHIPPED_CONFIGS, shipped_config

from analysis.naming import DISPLAY_NAMES, UNKNOWN, ModelInfo, display_name, hub_id_info, model_info, slug, unique_stems
from analysis.padjust import PADJUST_METHODS
from analysis.stats import METHODS
from oodjax.data.testsets import TESTSETS

# What each shipped model name stands for: family and parameters in billions.
SHIPPED_MODELS = {
    "opt2.7": ("opt", 2.7),
    "opt6.7": ("opt", 6.7),
    "opt13": ("opt", 13.0),
    "opt30": ("opt", 30.0),
    "olmo7": ("olmo2", 7.0),
    "olmo13": ("olmo2", 13.0),
    "olmo32": ("olmo2", 32.0),
    "smol3": ("smollm3", 3.0),
}


@pytest.mark.parametrize(
    "hub_id, family, billions, label",
    [
        ("facebook/opt-2.7b", "opt", 2.7, "2.7B"),
        ("facebook/opt-125m", "opt", 0.125, "125M"),
        ("allenai/OLMo-2-1124-7B", "olmo2", 7.0, "7B"),
        ("allenai/OLMo-2-0325-32B", "olmo2", 32.0, "32B"),
        ("HuggingFaceTB/SmolLM3-3B", "smollm3", 3.0, "3B"),
        ("HuggingFaceTB/SmolLM3-3B-Base", "smollm3", 3.0, "3B"),  # a variant after the size
        ("allenai/OLMo-2-1124-7B-Instruct", "olmo2", 7.0, "7B"),
        ("HuggingFaceTB/SmolLM2-135M", "smollm2", 0.135, "135M"),
        ("meta-llama/Llama-3.2-1B", "llama3.2", 1.0, "1B"),
        ("/checkpoints/opt-6.7b/", "opt", 6.7, "6.7B"),  # a local directory
        ("someone/tiny-model", "tinymodel", math.nan, UNKNOWN),
    ],
)
def test_family_and_size_from_a_hub_id(hub_id, family, billions, label):
    info = hub_id_info(hub_id)
    assert info.family == family
    assert info.size_label == label
    assert info.size_billions == pytest.approx(billions, nan_ok=True)


def test_a_random_model_has_its_model_type_as_family_and_an_unknown_size():
    info = model_info({"model": {"path": "", "hf_config": {"model_type": "olmo2"}}})
    assert (info.family, info.size_label) == ("olmo2", UNKNOWN)
    assert model_info({}).family == UNKNOWN


def test_the_shipped_configs_give_each_model_its_family_and_size():
    assert len(SHIPPED_CONFIGS) == 2 * len(SHIPPED_MODELS)
    for path in SHIPPED_CONFIGS:
        config = shipped_config(path)
        info = model_info(config)
        expected = SHIPPED_MODELS[config["model"]["name"]]
        assert (info.family, info.size_billions) == pytest.approx(expected), path.name


def test_stems_keep_dots_and_make_hub_ids_safe():
    stems = unique_stems([("opt2.7", "mnli"), ("opt2.7", "snli"), ("facebook/opt-2.7b", "mnli")])
    assert list(stems.values()) == ["opt2.7_mnli", "opt2.7_snli", "facebook-opt-2.7b_mnli"]
    assert slug("a b/c_d", "snli") == "a-b-c-d_snli"


@pytest.mark.parametrize("first, second", [("facebook/opt-2.7b", "facebook-opt-2.7b"), ("OPT-1b", "opt-1b")])
def test_stems_that_would_overwrite_each_other_are_an_error(first, second):
    with pytest.raises(ValueError, match="would write to the same files"):
        unique_stems([(first, "mnli"), (second, "mnli")])


def test_the_built_in_testsets_print_as_published():
    assert sorted(display_name(name) for name in TESTSETS) == sorted(
        ["SNLI", "MNLI", "SciTail", "RTE", "HANS", "ANLI", "WNLI", "PAWS"]
    )


def test_every_method_and_shipped_family_has_a_display_name():
    families = {model_info(shipped_config(path)).family for path in SHIPPED_CONFIGS}
    assert {*METHODS, *PADJUST_METHODS, *families} <= set(DISPLAY_NAMES)
    assert ModelInfo("olmo2", 7.0).description == "OLMo 2 7B"
    assert ModelInfo("newfamily", math.nan).description == "newfamily, size unknown"  # as it is
