"""Flax NNX ports that load Hugging Face checkpoints exactly: OPT, OLMo2, the Llama family
(Llama, SmolLM2, SmolLM3, Qwen2, Qwen3, Mistral, Phi-3) and Gemma (Gemma 2, Gemma 3 text)."""

from oodjax.models.config import DecoderConfig
from oodjax.models.gemma import GemmaConfig, GemmaForCausalLM
from oodjax.models.layers import REMAT_POLICIES, CausalLM, Linear
from oodjax.models.llama import LlamaConfig, LlamaForCausalLM
from oodjax.models.loading import (
    ARCHITECTURES,
    ModelSettings,
    abstract_model,
    config_from_dict,
    from_config,
    load_pretrained,
)
from oodjax.models.olmo2 import Olmo2Config, Olmo2ForCausalLM
from oodjax.models.opt import OPTConfig, OPTForCausalLM
from oodjax.models.partitioning import LOGICAL_AXIS_RULES, logical_to_spec, param_sharding, param_shardings

__all__ = [
    "ARCHITECTURES",
    "LOGICAL_AXIS_RULES",
    "CausalLM",
    "DecoderConfig",
    "GemmaConfig",
    "GemmaForCausalLM",
    "Linear",
    "LlamaConfig",
    "LlamaForCausalLM",
    "ModelSettings",
    "OPTConfig",
    "OPTForCausalLM",
    "REMAT_POLICIES",
    "Olmo2Config",
    "Olmo2ForCausalLM",
    "abstract_model",
    "config_from_dict",
    "from_config",
    "load_pretrained",
    "logical_to_spec",
    "param_sharding",
    "param_shardings",
]
