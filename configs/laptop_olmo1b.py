"""OLMo-2-0425-1B (allenai/OLMo-2-0425-1B) at laptop scale (see configs/laptop_common.py)."""

from ml_collections import config_dict

from configs.laptop_common import laptop_config


def get_config() -> config_dict.ConfigDict:
    return laptop_config("allenai/OLMo-2-0425-1B", "olmo2-1b")
