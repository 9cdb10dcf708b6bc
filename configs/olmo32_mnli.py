"""OLMo-2 32B trained on few-shot MNLI; sizes and resources come from configs/models.py."""

from ml_collections import config_dict

from configs.models import model_config


def get_config() -> config_dict.ConfigDict:
    return model_config("olmo32", "mnli")
