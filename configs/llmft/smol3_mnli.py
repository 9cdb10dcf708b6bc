"""SmolLM3 3B (the checkpoint configs/models.py names) trained on few-shot MNLI by llmft's few-shot LoRA recipe
(configs/llmft/__init__.py)."""

from ml_collections import config_dict

from configs.llmft import preset


def get_config() -> config_dict.ConfigDict:
    return preset("smol3", "mnli")
