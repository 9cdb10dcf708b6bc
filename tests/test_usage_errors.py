"""A user's mistake or an input not on this machine is one line and exit status 2; a bug keeps its traceback.

The entry points are run as a user runs them, in a subprocess, on a machine
whose hub is offline (the tests' HF_HUB_OFFLINE=1) with an empty Hugging Face
cache, so that anything not in the local mirror has to be fetched.
"""

import os
import pathlib
import subprocess
import sys
import unittest.mock

import pytest

from configs import demo
from oodjax import config_checks, usage_errors
from oodjax.config_checks import check_config
from oodjax.data import load_testset, load_tokenizer
from oodjax.usage_errors import ConfigError, NotFetchedError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(module, *args, tmp_path, data_dir=None):
    """`python -m module args` offline, with an empty Hugging Face cache, and no testset mirror unless given."""
    env = {key: value for key, value in os.environ.items() if key != "OODJAX_DATA_DIR"}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if data_dir is not None:
        env["OODJAX_DATA_DIR"] = str(data_dir)
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def _one_line(result, program):
    assert result.returncode == usage_errors.EXIT_STATUS, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: "), result.stderr[-3000:]
    return lines[0]


def test_a_config_error_of_training_is_one_line(tmp_path):
    """The in-domain testset left out of data.testsets: the check's line, nothing else."""
    result = _run("oodjax.main", "--config=configs/demo.py", "--config.data.testsets=rte,wnli", tmp_path=tmp_path)
    line = _one_line(result, "python -m oodjax.main")
    assert "data.train_set 'mnli' must also be in data.testsets" in line


def test_a_testset_not_fetched_names_it_and_the_fetch_command(tmp_path):
    """No mirror, hub offline: the demo's first testset is missing, and the line says how to fetch it."""
    result = _run(
        "oodjax.main",
        "--config=configs/demo.py",
        "--config.data.data_dir=",
        f"--config.output_dir={tmp_path}",
        tmp_path=tmp_path,
    )
    line = _one_line(result, "python -m oodjax.main")
    assert "testset 'snli'" in line and "is not in its cache" in line
    assert "`python -m launch.fetch configs/demo.py`" in line


def test_the_preflight_without_the_tokenizer_is_one_line(tmp_path):
    """A study config names a hub tokenizer; offline and not fetched, the preflight says so in one line."""
    result = _run(
        "launch.preflight",
        "--config=configs/opt2.7_mnli.py",
        "--layers=1",
        "--devices=8",
        tmp_path=tmp_path,
        data_dir=ROOT.parent / "shared" / "data" / "hf",
    )
    line = _one_line(result, "python -m launch.preflight")
    assert "tokenizer 'facebook/opt-2.7b' is not a local folder" in line
    assert "`python -m launch.fetch configs/opt2.7_mnli.py`" in line


def test_config_errors_found_by_the_checks_are_config_errors(tmp_path):
    """Each check's error is a ConfigError (one line at the entry points), still a ValueError for callers."""
    config = demo.get_config()
    config.output_dir = str(tmp_path)
    config.train.steps = 2  # fewer than the default warm-up
    with pytest.raises(ConfigError, match=r"train.warmup_steps must be in \[0, train.steps=2\], got 5"):
        check_config(config)
    config.train.steps = 50
    config.data.testsets = ("mnli", "nope")
    with pytest.raises(ConfigError, match=r"data.testsets: unknown testset 'nope'; known testsets: snli, mnli"):
        check_config(config)


def test_a_tokenizer_larger_than_the_model_is_refused_before_loading(tmp_path):
    """GPT-2's 50257 tokens for a model that embeds 50000: ids past 49999 would read no embedding row."""
    config = demo.get_config()
    config.output_dir = str(tmp_path)
    config.model.hf_config.vocab_size = 50000
    with pytest.raises(
        ConfigError,
        match=r"tokenizer '.*gpt2' has 50257 tokens \(ids 0..50256\), but model.hf_config "
        r"embeds only 50000 \(vocab_size\)",
    ):
        config_checks.check_config(config)
    config.model.hf_config.vocab_size = 50257
    config_checks.check_config(config)


def test_an_unwritable_output_dir_is_refused_before_loading(tmp_path):
    (tmp_path / "a_file").write_text("")
    config = demo.get_config()
    config.output_dir = str(tmp_path / "a_file" / "results")
    with pytest.raises(ConfigError, match=r"output_dir '.*a_file/results' cannot be created: .*a_file is a file"):
        config_checks.check_config(config)
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    config.output_dir = str(read_only / "results")
    with unittest.mock.patch("tempfile.TemporaryFile", side_effect=OSError(30, "Read-only file system")):
        with pytest.raises(ConfigError, match=r"cannot be written: Read-only file system in .*read_only$"):
            config_checks.check_config(config)
    assert not (read_only / "results").exists()


def test_loaders_say_what_was_not_fetched(tmp_path, monkeypatch):
    """Offline, a split outside the mirror and a hub tokenizer outside the cache are NotFetchedErrors."""
    with pytest.raises(NotFetchedError, match=r"no local file for nyu-mll/glue/rte split 'validation'.*offline"):
        load_testset("rte", split="validation", data_dir=tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(NotFetchedError, match=r"tokenizer 'facebook/opt-125m' is not a local folder"):
        load_tokenizer("facebook/opt-125m")


def test_reported_turns_only_usage_errors_into_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        with usage_errors.reported("prog", config_spec="configs/x.py"):
            raise NotFetchedError("testset 'rte': split\n'train' missing")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "prog: error: testset 'rte': split 'train' missing; on a machine online (a cluster's login node) run "
        "`python -m launch.fetch configs/x.py`, then retry\n"
    )
    with pytest.raises(KeyError):  # a bug is not the user's to fix: its traceback stays
        with usage_errors.reported("prog"):
            raise KeyError("a bug")


def test_ctrl_c_outside_training_is_one_line_and_status_130(capsys):
    """Ctrl-C while a config loads, an evaluation runs or a download goes: the user's stop, not a traceback."""
    with pytest.raises(SystemExit) as exit_, usage_errors.reported("python -m oodjax.evaluate"):
        raise KeyboardInterrupt
    assert exit_.value.code == usage_errors.INTERRUPTED_EXIT_STATUS == 130
    assert capsys.readouterr().err == "python -m oodjax.evaluate: interrupted\n"
