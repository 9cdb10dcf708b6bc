"""SmolLM2-135M (HuggingFaceTB/SmolLM2-135M) at laptop scale (see configs/laptop_common.py)."""

from ml_collections import config_dict

from configs.laptop_common import laptop_config


def get_config() -> config_dict.ConfigDict:
    return laptop_config("HuggingFaceTB/SmolLM2-135M", "smollm2-135m")
