"""The laptop configs: each names its family's smallest checkpoint and a 3x3 grid, and runs through
`python -m oodjax.main` on a random model of that checkpoint's architecture (offline: the checkpoints are not
here), its config.json numbers shrunk to 2 layers and a tiny width."""

import importlib
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from analysis import schema
from oodjax.config_fields import EIGHT_TESTSETS

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Per config: (hub id, the checkpoint's architecture shrunk: its model_type, norms, RoPE, tying and special
# tokens kept; layers, widths and heads cut down, the head ratio of grouped-query attention kept).
CONFIGS = {
    "laptop_opt125m": (
        "facebook/opt-125m",
        dict(
            model_type="opt",
            vocab_size=50272,
            hidden_size=64,
            word_embed_proj_dim=64,
            ffn_dim=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=2048,
            do_layer_norm_before=True,
            enable_bias=True,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
        ),
    ),
    "laptop_smol135m": (
        "HuggingFaceTB/SmolLM2-135M",
        dict(
            # vocab 49152 in the checkpoint; raised to hold the GPT-2 tokenizer's ids, the one available offline
            model_type="llama",
            vocab_size=50304,
            hidden_size=96,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "laptop_olmo1b": (
        "allenai/OLMo-2-0425-1B",
        dict(
            model_type="olmo2",
            vocab_size=100352,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            rope_theta=500000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            pad_token_id=100277,
            eos_token_id=100257,
        ),
    ),
}

# A config file that takes a laptop config and swaps its checkpoint for the random model.
WRAPPER = """
from configs.{module} import get_config as laptop_config


def get_config():
    config = laptop_config()
    config.model.path = ""
    config.model.hf_config = {hf_config!r}
    config.tokenizer = {tokenizer!r}
    config.data.data_dir = {data_dir!r}
    return config
"""


@pytest.mark.parametrize("module", sorted(CONFIGS))
def test_each_config_is_its_checkpoints_3x3_grid_on_the_eight_testsets(module):
    config = importlib.import_module(f"configs.{module}").get_config()
    assert config.model.path == CONFIGS[module][0]
    assert (len(config.runs.seeds), len(config.runs.shots)) == (3, 3)
    assert tuple(config.data.testsets) == EIGHT_TESTSETS
    assert config.train.steps // config.eval.every + 1 >= 8  # enough evaluations for partial correlations
    assert config.model.dtype == "float32" and config.mesh.data == -1


@pytest.mark.parametrize("module", sorted(CONFIGS))
def test_each_config_trains_its_architecture_through_main(module, tmp_path, gpt2_tokenizer_dir, hf_data_dir):
    wrapper = tmp_path / f"random_{module}.py"
    wrapper.write_text(
        WRAPPER.format(
            module=module, hf_config=CONFIGS[module][1], tokenizer=str(gpt2_tokenizer_dir), data_dir=str(hf_data_dir)
        )
    )
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "oodjax.main",
            f"--config={wrapper}",
            "--config.train.steps=2",
            "--config.train.warmup_steps=1",
            "--config.eval.every=1",
            "--config.data.eval_cap=16",
            f"--config.output_dir={out}",
            f"--config.data.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(path.parent for path in out.glob(f"*/{schema.METRICS_FILENAME}"))
    assert len(runs) == 9
    for run in runs:
        with np.load(run / schema.METRICS_FILENAME, allow_pickle=False) as npz:
            assert npz[schema.STEP].tolist() == [0, 1, 2]
            assert npz[schema.TESTSETS].tolist() == [*EIGHT_TESTSETS, schema.TRAIN_TESTSET]
            assert np.isfinite(npz[schema.TRAIN_LOSS][1:]).all()
    assert f"done: 9 runs; results in {out}" in result.stderr
