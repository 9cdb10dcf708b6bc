"""`python -m oodjax.main`: locked configs, --help, paths checked before any work, and an end-to-end smoke run."""

import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from analysis import schema
from configs import base, demo
from oodjax import config_checks
from oodjax.config_checks import check_config
from oodjax.engine import loop
from oodjax.usage_errors import ConfigError
from tests.engine_configs import SHRUNK_DEMO_ARGS, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_configs_are_locked():
    for config in (base.get_config(), demo.get_config()):
        with pytest.raises(AttributeError, match='"stepz" does not exist'):
            config.train.stepz = 10
        with pytest.raises(AttributeError, match='"hidden" does not exist'):
            config.model.hf_config.hidden = 10


def _run_main(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "oodjax.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_the_config_fields_with_their_defaults_and_meaning():
    """The one run of the real command line's --help (the parsing itself is tested in process, test_config_cli.py)."""
    result = _run_main("--help", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("`python -m oodjax.main --config configs/X.py")
    assert "--config: Experiment config file" in result.stdout
    assert "  runs.shots = 32,64,128\n      Sizes of the few-shot training sets" in result.stdout
    assert "  data.eval_cap = 0\n      Cap each testset to this many examples" in result.stdout


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("data.data_dir", "/no/such/data", "data.data_dir '/no/such/data' is not a directory"),
        ("tokenizer", "/no/such/tokenizer", "tokenizer: '/no/such/tokenizer' does not exist"),
        ("model.path", "/no/such/model", "model.path: '/no/such/model' does not exist"),
        ("model.path", "no-such-org/no-such-model", "is not in the local cache"),
    ],
)
def test_missing_paths_fail_before_any_compilation(tmp_path, gpt2_tokenizer_dir, hf_data_dir, field, value, message):
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    if field == "model.path":
        config.model.hf_config = {}
    section, _, key = field.rpartition(".")
    (config[section] if section else config)[key] = value
    compilations = []

    def listener(event, duration, **kwargs):
        compilations.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with pytest.raises(FileNotFoundError, match=message.replace("(", r"\(")):
            loop.train(check_config(config))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compilations == []
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, marker", [("model.path", "config.json"), ("tokenizer", "tokenizer_config.json")])
def test_a_junk_json_in_a_model_or_tokenizer_folder_is_named_before_anything_loads(
    tmp_path, gpt2_tokenizer_dir, hf_data_dir, field, marker
):
    folder = tmp_path / "folder"
    shutil.copytree(gpt2_tokenizer_dir, folder)
    (folder / marker).write_text('{"model_type": "op')  # cut short, as an interrupted copy leaves it
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    if field == "model.path":
        config.model.hf_config = {}
    section, _, key = field.rpartition(".")
    (config[section] if section else config)[key] = str(folder)
    with pytest.raises(ValueError, match=rf"^{field}: {re.escape(str(folder / marker))} is not valid JSON"):
        loop.train(check_config(config))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("train.grad_accum", 3, "train.batch_size 8 must be a multiple of train.grad_accum 3"),
        ("train.warmup_steps", 5, r"train.warmup_steps must be in \[0, train.steps=4\], got 5"),
        ("data.train_set", "snli", "data.train_set 'snli' must also be in data.testsets"),
        ("data.testsets", ("mnli", "hanz"), "unknown testset 'hanz'; known testsets: snli, mnli"),
        ("runs.seeds", (0, 0), r"runs.seeds must be a non-empty list without repeats, got \[0, 0\]"),
        ("runs.seeds", ("0",), r"runs.seeds must be a list of int, got \('0',\)"),
        ("data.testsets", (), r"data.testsets is empty"),
        ("model.dtype", "float64", "model.dtype must be one of"),
        ("eval.batch_size", 12, "eval.batch_size 12 must be a multiple of the 8 batch shards"),
    ],
)
def test_bad_config_values_are_named(tmp_path, gpt2_tokenizer_dir, hf_data_dir, field, value, message):
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    section, _, key = field.rpartition(".")
    config[section][key] = value
    with pytest.raises((ValueError, KeyError), match=message):
        loop.train(check_config(config))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("model.remat", "everything", "remat policy 'everything' is not one of"),
        ("lora.rank", 0, "lora: LoRAConfig.rank must be a positive integer, got 0"),
        ("lora.dropout", 1.0, r"lora: LoRAConfig.dropout must be in \[0, 1\)"),
    ],
)
def test_values_other_modules_own_are_checked_with_the_config(
    tmp_path, gpt2_tokenizer_dir, hf_data_dir, field, value, message
):
    """The config checks ask the remat table and LoRAConfig, so a bad value is refused with the rest, before
    the model is built."""
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    section, _, key = field.rpartition(".")
    config[section][key] = value
    with pytest.raises(ValueError, match=message):
        config_checks.check_config(config)


def test_wandb_enabled_without_wandb_is_an_error(tmp_path, gpt2_tokenizer_dir, hf_data_dir, monkeypatch):
    monkeypatch.setattr(config_checks, "installed", lambda module: module != "wandb")
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.wandb.enabled = True
    with pytest.raises(ValueError, match="wandb.enabled is True but wandb is not installed"):
        loop.train(check_config(config))


def test_wandb_online_without_a_login_is_an_error_before_anything_loads(
    tmp_path, gpt2_tokenizer_dir, hf_data_dir, monkeypatch
):
    """wandb.init would say so only after the model and data had loaded; offline needs no login (test_console)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for variable in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.wandb.enabled = True
    config.wandb.mode = "online"
    with pytest.raises(ConfigError, match="wandb.enabled: W&B online needs a login and this machine has none"):
        loop.train(check_config(config))
    assert not (tmp_path / "out").exists()


def test_main_runs_the_demo_end_to_end(tmp_path):
    """The demo config, shrunk on the command line (to the shapes of the other engine tests): two runs."""
    out = tmp_path / "demo"
    result = _run_main(*SHRUNK_DEMO_ARGS, f"--config.output_dir={out}", f"--config.data.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.name for p in out.iterdir() if p.name != "checkpoints")
    assert runs == ["opt-tiny-random_mnli_seed0_shots32", "opt-tiny-random_mnli_seed42_shots32"]
    for run in runs:
        with np.load(out / run / schema.METRICS_FILENAME, allow_pickle=False) as npz:
            assert npz[schema.STEP].tolist() == [0, 2, 4]
            assert npz[schema.TESTSETS].tolist() == ["mnli", "hans", "rte", schema.TRAIN_TESTSET]
            assert npz[schema.margin_key("hans")].shape == (3, 16)
            assert npz[schema.label_key(schema.TRAIN_TESTSET)].shape == (32,)
            assert np.isfinite(npz[schema.TRAIN_LOSS][1:]).all()
