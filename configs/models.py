"""The study's eight models, what each is and what each needs at its size: the one table of them.

Sized so that the 9 runs of one model and training set, trained together on
one node of 8 devices, fit the 72 GB JAX may use of an 80 GB GPU (A100-80GB,
H100), from what `python -m launch.preflight --config configs/X.py` compiles
and its communication estimate, at the study's real prompt lengths
(docs/clusters.md, "Sizing", has each config's figures and reasons). The
axis marked -1 takes every device of the job, so a config runs unchanged on
4, 8 or 16 devices (the micro-batch, 16 / grad_accum, must divide by the
devices). A step holds about 900 tokens a device, so the frozen base, its
copies and its transfers, decide the layout, not activations. Up to 13B a
full copy of the bf16 base fits every device beside the step's activations,
so the batch is split over the devices (data parallel: no collective but the
adapters' gradients); the 30B models are sharded over pairs of devices and
the batch split over the pairs (fsdp 2: half the base a device, each weight
gathered from one other device, half the traffic of sharding over all 8).
One micro-batch a step (grad_accum 1: a sharded base is gathered once a step,
not once a micro-batch), and nothing recomputed (remat "none") except in
OLMo2-32B, whose layers keep only the projections' outputs for the backward
pass (remat "save_dots": norms, RoPE and activations are recomputed, the
matmuls and the fused attention are not): all it would keep else, 27 GB,
beside half its base, 32 GB, leaves too little of the 72. On devices of less
memory (a TPU v4's 32 GB) shard more: `--config.mesh.data=1
--config.mesh.fsdp=-1`. The protocol fields (batch size 16, steps, learning
rate) stay at base.py's values for every model: only resources change with
size.

Each entry also holds the checkpoint's architecture, the config.json fields
that decide its parameter count and cost, copied from the Hugging Face hub
pages (so estimates and tests need no download), and the parameter count its
authors published, which the estimator's count is tested against:
  OPT: Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models",
       Table 1 (2.7B, 6.7B, 13B, 30B);
  OLMo 2: the model cards of allenai/OLMo-2-1124-7B, -13B and OLMo-2-0325-32B
       (7.30B, 13.7B, 32.2B parameters, as listed on the hub);
  SmolLM3: the model card of HuggingFaceTB/SmolLM3-3B (3.08B parameters), SmolLM3-3B-Base post-trained:
       the same architecture and count.

And each entry lists the weight files its repository publishes on its `main`
branch (flax and TF weights included), from which
`oodjax.models.hf_checkpoint.files_to_download` picks what the loader reads:
the OPT repositories hold only pickled `pytorch_model*.bin` weights there
(safetensors exist only in unmerged `refs/pr/N` branches), OLMo 2 and SmolLM3
safetensors. Each listing's source is beside it: the repository's
`/tree/main` page where the search index held it, else the newest page of
`main`'s history it held (said so); the pages show relative dates only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ml_collections import config_dict

from configs import base

TRAIN_SETS = ("mnli", "snli")


def _shards(stem: str, count: int, extension: str) -> tuple[str, ...]:
    """transformers' shard names: `pytorch_model-00001-of-00007.bin` ..."""
    return tuple(f"{stem}-{i:05d}-of-{count:05d}.{extension}" for i in range(1, count + 1))


_OPT_COMMON = dict(model_type="opt", vocab_size=50272, max_position_embeddings=2048, enable_bias=True)
_OLMO2_COMMON = dict(model_type="olmo2", vocab_size=100352, attention_bias=False, tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class ModelResources:
    hub_id: str
    mesh: tuple[int, int, int]  # data, fsdp, tensor; -1 = the remaining devices
    grad_accum: int  # micro-batches per optimizer step (divides base's batch of 16)
    eval_batch_size: int
    remat: str  # config.model.remat: a policy name of oodjax.models.REMAT_POLICIES
    # The checkpoint's config.json fields that decide its parameter count and cost (copied from its hub
    # page; tests and estimates never download it), and the parameter count its authors published.
    architecture: Mapping[str, Any]
    published_parameters: float
    # The weight files (and shard indexes) its hub repository publishes on `main`; empty where no listing of
    # `main` was found (the source is a comment beside each).
    published_files: tuple[str, ...]
    dtype: str = "bfloat16"


MODELS: dict[str, ModelResources] = {
    "smol3": ModelResources(
        # The base checkpoint, as every other model of the study is (HuggingFaceTB/SmolLM3-3B is it post-trained
        # for chat and reasoning): docs/protocol.md, "The SmolLM3 checkpoint".
        "HuggingFaceTB/SmolLM3-3B-Base",
        (-1, 1, 1),
        1,
        128,
        remat="none",
        architecture=dict(
            model_type="smollm3",
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=4,
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=True,
            max_position_embeddings=65536,
        ),
        published_parameters=3.08e9,
        # No listing of https://huggingface.co/HuggingFaceTB/SmolLM3-3B-Base/tree/main was found (its hub page is
        # tagged Safetensors and ONNX). SmolLM3-3B, the same model post-trained, publishes two safetensors
        # shards and their index (its tree/main, newest commit a07cc9a, "5 months ago").
        published_files=(),
    ),
    "opt2.7": ModelResources(
        "facebook/opt-2.7b",
        (-1, 1, 1),
        1,
        128,
        remat="none",
        architecture=dict(
            _OPT_COMMON,
            hidden_size=2560,
            word_embed_proj_dim=2560,
            ffn_dim=10240,
            num_hidden_layers=32,
            num_attention_heads=32,
        ),
        published_parameters=2.7e9,
        # https://huggingface.co/facebook/opt-2.7b/tree/main (newest commit 905a4b6, "over 1 year ago"): 5.3 GB
        # of fp16 pickle, 5.3 GB of msgpack, 10.6 GB of TF weights.
        published_files=("flax_model.msgpack", "pytorch_model.bin", "tf_model.h5"),
    ),
    "opt6.7": ModelResources(
        "facebook/opt-6.7b",
        (-1, 1, 1),
        1,
        64,
        remat="none",
        architecture=dict(
            _OPT_COMMON,
            hidden_size=4096,
            word_embed_proj_dim=4096,
            ffn_dim=16384,
            num_hidden_layers=32,
            num_attention_heads=32,
        ),
        published_parameters=6.7e9,
        # No /tree/main page found. main's commit b58ac05, "Add TF weights (#5)"
        # (https://huggingface.co/facebook/opt-6.7b/tree/b58ac05da9efca444e813370f5a454aa1a1a01fb), holds the
        # pickle shards and index; "Add Flax weights" (#7, merged Jun 24, 2022:
        # https://huggingface.co/facebook/opt-6.7b/discussions/7) added the msgpack shards and index. The TF
        # shards' names are cut off on that page, so they are not listed here.
        published_files=(
            *_shards("pytorch_model", 2, "bin"),
            "pytorch_model.bin.index.json",
            *_shards("flax_model", 2, "msgpack"),
            "flax_model.msgpack.index.json",
        ),
    ),
    "olmo7": ModelResources(
        "allenai/OLMo-2-1124-7B",
        (-1, 1, 1),
        1,
        64,
        remat="none",
        architecture=dict(
            _OLMO2_COMMON,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
        ),
        published_parameters=7.30e9,
        # No /tree/main page found; the newest commit found, 7df9a82 ("Update README.md", 34 commits:
        # https://huggingface.co/allenai/OLMo-2-1124-7B/tree/7df9a82518afdecae4e8c026b27adccc8c1f0032).
        published_files=(*_shards("model", 6, "safetensors"), "model.safetensors.index.json"),
    ),
    "opt13": ModelResources(
        "facebook/opt-13b",
        (-1, 1, 1),
        1,
        64,
        remat="none",
        architecture=dict(
            _OPT_COMMON,
            hidden_size=5120,
            word_embed_proj_dim=5120,
            ffn_dim=20480,
            num_hidden_layers=40,
            num_attention_heads=40,
        ),
        published_parameters=13e9,
        # No /tree/main page found. main's commit d4fe85a, "Fix scripts (#6)"
        # (https://huggingface.co/facebook/opt-13b/tree/d4fe85a76c6ff6fe7398f9bee596fa47c8101d85): msgpack shards,
        # their index and the single 25.7 GB msgpack, pickle shards (the page is cut after the second; the
        # third and the index are on every earlier page, e.g. commit 9c10d01), and the 25.7 GB tf_model.h5 of
        # "Add tf_weights" (9c10d01), which refs/pr/26 (unmerged) proposes deleting from main.
        published_files=(
            *_shards("flax_model", 3, "msgpack"),
            "flax_model.msgpack",
            "flax_model.msgpack.index.json",
            *_shards("pytorch_model", 3, "bin"),
            "pytorch_model.bin.index.json",
            "tf_model.h5",
        ),
    ),
    "olmo13": ModelResources(
        "allenai/OLMo-2-1124-13B",
        (-1, 1, 1),
        1,
        64,
        remat="none",
        architecture=dict(
            _OLMO2_COMMON,
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=40,
            max_position_embeddings=4096,
        ),
        published_parameters=13.7e9,
        # https://huggingface.co/allenai/OLMo-2-1124-13B/tree/main (newest commit b7add06, "8 days ago"); the page
        # is cut after model-00010-of-00012: shards 11 and 12 and the index follow from that naming.
        published_files=(*_shards("model", 12, "safetensors"), "model.safetensors.index.json"),
    ),
    "opt30": ModelResources(
        "facebook/opt-30b",
        (-1, 2, 1),
        1,
        32,
        remat="none",
        architecture=dict(
            _OPT_COMMON,
            hidden_size=7168,
            word_embed_proj_dim=7168,
            ffn_dim=28672,
            num_hidden_layers=48,
            num_attention_heads=56,
        ),
        published_parameters=30e9,
        # No /tree/main page found. The pickle shards are on every page of the history (e.g.
        # https://huggingface.co/facebook/opt-30b/tree/dc0db6de0956e0f10259a4e2e3b90c9a9af802cd), the index has
        # its own history ("upload 30b", bd8ae41, the commit that uploaded the shards), and main holds the msgpack
        # shards of "Add Flax weights (#5)", Jun 23, 2022
        # (https://huggingface.co/facebook/opt-30b/commits/main/flax_model-00004-of-00007.msgpack; names and index
        # as in that PR, https://huggingface.co/facebook/opt-30b/tree/refs%2Fpr%2F5). TF weights were merged too
        # ("Add TF weights", #4, Jun 23, 2022: https://huggingface.co/facebook/opt-30b/discussions/4), their
        # names not shown, so not listed here.
        published_files=(
            *_shards("pytorch_model", 7, "bin"),
            "pytorch_model.bin.index.json",
            *_shards("flax_model", 7, "msgpack"),
            "flax_model.msgpack.index.json",
        ),
    ),
    "olmo32": ModelResources(
        "allenai/OLMo-2-0325-32B",
        (-1, 2, 1),
        1,
        32,
        remat="save_dots",
        architecture=dict(
            _OLMO2_COMMON,
            hidden_size=5120,
            intermediate_size=27648,
            num_hidden_layers=64,
            num_attention_heads=40,
            num_key_value_heads=8,
            max_position_embeddings=4096,
        ),
        published_parameters=32.2e9,
        # No listing of main found (neither its /tree/main page nor a page of its history): not guessed.
        published_files=(),
    ),
}


# The weight files the laptop configs' checkpoints (configs/laptop_*.py) publish on `main`, as above.
LAPTOP_PUBLISHED_FILES: dict[str, tuple[str, ...]] = {
    # No /tree/main page found; the newest commit found, 27dcfa7 ("Update README.md (#38)", 32 commits:
    # https://huggingface.co/facebook/opt-125m/tree/27dcfa74d334bc871f3234de431e71c6eeba5dd6).
    "facebook/opt-125m": ("flax_model.msgpack", "pytorch_model.bin", "tf_model.h5"),
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M/tree/main (newest commit 93efa2f, "2 months ago")
    "HuggingFaceTB/SmolLM2-135M": ("model.safetensors",),
    # https://huggingface.co/allenai/OLMo-2-0425-1B/tree/main (newest commit a1847df, "10 months ago")
    "allenai/OLMo-2-0425-1B": (*_shards("model", 2, "safetensors"), "model.safetensors.index.json"),
}


def architecture(hub_id: str) -> Mapping[str, Any]:
    """The config.json numbers of a checkpoint of the table; an unknown id is an error naming the known ones."""
    for resources in MODELS.values():
        if resources.hub_id == hub_id:
            return resources.architecture
    raise KeyError(f"no architecture numbers for {hub_id!r}; known: {sorted(r.hub_id for r in MODELS.values())}")


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
    # Few-shot sets are drawn from the training set's own `train` split, as in the study (MNLI 393k rows,
    # SNLI 550k): the table's offline default pools (MNLI validation_mismatched, whose genres the in-domain
    # validation_matched does not share) are for the demo, the tests and the laptop configs.
    config.data.pool_split = "train"
    config.train.grad_accum = resources.grad_accum
    config.eval.batch_size = resources.eval_batch_size
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = resources.mesh
    return config
