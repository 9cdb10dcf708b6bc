"""OPT-125m (facebook/opt-125m) at laptop scale (see configs/laptop_common.py)."""

from ml_collections import config_dict

from configs.laptop_common import laptop_config


def get_config() -> config_dict.ConfigDict:
    return laptop_config("facebook/opt-125m", "opt-125m")
