"""A tiny random OPT that runs the whole pipeline on 2 CPU cores in a few minutes.

It shows the engine end to end (two runs trained together, the eight
testsets evaluated every 10 steps, checkpoints at 25 and 50, metrics.npz
ready for `python -m analysis`); its accuracies mean nothing.
"""

import pathlib

from ml_collections import config_dict

from configs import base

# The offline copies next to the repository, when present; else the hub.
_SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
_LOCAL_GPT2 = _SHARED_DATA / "tokenizers" / "gpt2"
_LOCAL_TESTSETS = _SHARED_DATA / "hf"


def get_config() -> config_dict.ConfigDict:
    config = base.get_config()
    with config.unlocked():
        # OPT-125m's layout scaled down; vocab 50272 as in every OPT checkpoint,
        # which covers the GPT-2 tokenizer's 50257 ids.
        config.model.hf_config = config_dict.ConfigDict(
            dict(
                model_type="opt",
                vocab_size=50272,
                hidden_size=64,
                word_embed_proj_dim=64,
                ffn_dim=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=512,
                do_layer_norm_before=True,
                pad_token_id=1,
                bos_token_id=2,
                eos_token_id=2,
            )
        )
    config.model.name = "opt-tiny-random"
    config.model.dtype = "float32"
    config.tokenizer = str(_LOCAL_GPT2) if _LOCAL_GPT2.is_dir() else "gpt2"
    config.data.data_dir = str(_LOCAL_TESTSETS) if _LOCAL_TESTSETS.is_dir() else ""
    config.data.train_set = "mnli"
    config.data.eval_cap = 200
    # MNLI too (about 6,000 rows whole): a demo in minutes, whose analysis names its runs as capped in-domain.
    config.data.cap_in_domain = True
    config.data.max_length = 128
    config.data.buckets = (64, 128)
    config.runs.seeds = (0, 42)
    config.runs.shots = (32,)
    config.train.steps = 50
    config.train.batch_size = 8
    config.train.learning_rate = 1e-3
    config.train.warmup_steps = 5
    config.eval.every = 10  # six evaluations: enough points for the partial correlations
    config.eval.batch_size = 64
    config.output_dir = "results/demo"
    config.checkpoint_every = 25
    config.log_every = 5
    return config
