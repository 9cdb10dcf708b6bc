"""OLMo-2 13B trained on few-shot SNLI; sizes and resources come from configs/models.py."""

from ml_collections import config_dict

from configs.models import model_config


def get_config() -> config_dict.ConfigDict:
    return model_config("olmo13", "snli")
