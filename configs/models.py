"""The study's eight models and what each needs at its size: the one table the model configs read.

Sized so that the 9 runs of one model and training set, trained together on
one node of 8 devices, fit 80 GB GPUs (A100-80GB, H100), as `python -m
launch.preflight --config configs/X.py` compiles them and `python -m
launch.estimate` counts them (docs/clusters.md, "Preflight", has each
config's figures). The axis marked -1 takes every device of the job, so a
config runs unchanged on 4, 8 or 16 devices (the micro-batch, 16 /
grad_accum, must divide by the devices). Models up to 7B keep a full copy of
the bf16 base on every device and split the batch (data parallel); from 13B
the base is sharded over the devices (fsdp). Models whose activations would
crowd a device keep only the projections' outputs for the backward pass
(remat "save_dots": norms, RoPE, attention and activations are recomputed,
the matmuls are not); the 30B models also split each step into two
micro-batches, and OLMo2-32B computes its 9 runs three at a time
(runs_chunk), each chunk gathering the sharded weights anew.
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
    remat: str  # config.model.remat: a policy name of oodjax.models.REMAT_POLICIES
    dtype: str = "bfloat16"
    runs_chunk: int = 0  # config.runs.chunk: runs computed at once in the train step; 0 = all


MODELS: dict[str, ModelResources] = {
    "smol3": ModelResources("HuggingFaceTB/SmolLM3-3B", (-1, 1, 1), 1, 128, remat="save_dots"),
    "opt2.7": ModelResources("facebook/opt-2.7b", (-1, 1, 1), 1, 128, remat="none"),
    "opt6.7": ModelResources("facebook/opt-6.7b", (-1, 1, 1), 2, 64, remat="none"),
    "olmo7": ModelResources("allenai/OLMo-2-1124-7B", (-1, 1, 1), 2, 64, remat="save_dots"),
    "opt13": ModelResources("facebook/opt-13b", (1, -1, 1), 2, 64, remat="none"),
    "olmo13": ModelResources("allenai/OLMo-2-1124-13B", (1, -1, 1), 2, 64, remat="save_dots"),
    "opt30": ModelResources("facebook/opt-30b", (1, -1, 1), 2, 32, remat="save_dots"),
    "olmo32": ModelResources("allenai/OLMo-2-0325-32B", (1, -1, 1), 2, 32, remat="save_dots", runs_chunk=3),
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
    config.runs.chunk = resources.runs_chunk
    config.data.train_set = train_set
    config.train.grad_accum = resources.grad_accum
    config.eval.batch_size = resources.eval_batch_size
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = resources.mesh
    return config
