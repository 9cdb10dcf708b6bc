"""OLMo-2 32B trained on few-shot SNLI by llmft's few-shot LoRA recipe (configs/llmft/__init__.py)."""

from ml_collections import config_dict

from configs.llmft import preset


def get_config() -> config_dict.ConfigDict:
    return preset("olmo32", "snli")
