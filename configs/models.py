"""The study's eight models and what each needs at its size: the one table the model configs read.

Sized so that the 9 runs of one model and training set, trained together on
one node of 8 devices, fit 80 GB GPUs (A100-80GB, H100): `python -m
launch.estimate configs/X.py` puts them at 44-51 GB per device with every
sequence padded to data.max_length (512), and under 30 GB at 256 tokens.
The axis marked -1 takes every device of the job, so a config runs
unchanged on 4, 8 or 16 devices (the micro-batch, 16 / grad_accum, must
divide by the devices). Models up to 7B keep a full copy of the bf16 base on
every device and split the batch (data parallel); from 13B the base is
sharded over the devices (fsdp), and the 30B models recompute activations
(remat).
The protocol fields (batch size 16, steps, learning rate) stay at base.py's
values for every model: only resources change with size.
"""

from __future__ import annotations

import dataclasses

from ml_collections import config_dict

from configs import base

TRAIN_SETS = ("mnli", "snli")


@dataclasses.dataclass(frozen=True)
class ModelResources:
    hub_id: str
    mesh: tuple[int, int, int]  # data, fsdp, tensor; -1 = the remaining devices
    grad_accum: int  # micro-batches per optimizer step (divides base's batch of 16)
    eval_batch_size: int
    remat: bool
    dtype: str = "bfloat16"


MODELS: dict[str, ModelResources] = {
    "smol3": ModelResources("HuggingFaceTB/SmolLM3-3B", (-1, 1, 1), 1, 128, remat=False),
    "opt2.7": ModelResources("facebook/opt-2.7b", (-1, 1, 1), 1, 128, remat=False),
    "opt6.7": ModelResources("facebook/opt-6.7b", (-1, 1, 1), 2, 64, remat=False),
    "olmo7": ModelResources("allenai/OLMo-2-1124-7B", (-1, 1, 1), 2, 64, remat=False),
    "opt13": ModelResources("facebook/opt-13b", (1, -1, 1), 2, 64, remat=False),
    "olmo13": ModelResources("allenai/OLMo-2-1124-13B", (1, -1, 1), 2, 64, remat=False),
    "opt30": ModelResources("facebook/opt-30b", (1, -1, 1), 1, 32, remat=True),
    "olmo32": ModelResources("allenai/OLMo-2-0325-32B", (1, -1, 1), 1, 32, remat=True),
}


def model_config(model: str, train_set: str) -> config_dict.ConfigDict:
    """base.py's config for one model of the table trained on one training set."""
    if model not in MODELS:
        raise KeyError(f"unknown model {model!r}; the table has {sorted(MODELS)}")
    if train_set not in TRAIN_SETS:
        raise ValueError(f"train_set must be one of {TRAIN_SETS}, got {train_set!r}")
    resources = MODELS[model]
    config = base.get_config()
    config.model.path = resources.hub_id
    config.model.name = model
    config.model.dtype = resources.dtype
    config.model.remat = resources.remat
    config.data.train_set = train_set
    config.train.grad_accum = resources.grad_accum
    config.eval.batch_size = resources.eval_batch_size
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = resources.mesh
    return config
