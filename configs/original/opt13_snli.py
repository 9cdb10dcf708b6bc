"""OPT-13B trained on few-shot SNLI with the predecessor code's protocol choices (configs/original/__init__.py)."""

from ml_collections import config_dict

from configs.original import preset


def get_config() -> config_dict.ConfigDict:
    return preset("opt13", "snli")
