"""`--config oodjax:NAME[:ARG]`: the configs installed with the package, named from any directory; `FILE[:ARG]`
unchanged (the installed copy's own test is in test_install.py)."""

import pathlib

import pytest
from absl import flags

from launch import config_files
from oodjax import config_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse(spec, *arguments):
    flag_values = flags.FlagValues()
    config_cli.define_config_flag(flag_values)
    return config_cli.parse_command_line(["oodjax.main", f"--config={spec}", *arguments], flag_values)


@pytest.mark.parametrize("spec", ["oodjax:opt2.7_mnli", "oodjax:opt2.7_mnli.py"])
def test_a_packaged_name_loads_the_packaged_file_from_any_directory(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    config = parse(spec, "--config.train.steps=7")
    assert config.model.path == "facebook/opt-2.7b" and config.train.steps == 7
    assert config.to_dict() == config_cli.load_config_file(str(ROOT / "configs" / "opt2.7_mnli.py")).to_dict() | {
        "train": config.train.to_dict()
    }


def test_a_packaged_config_of_a_sub_folder_and_config_files(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert parse("oodjax:original/opt30_mnli").model.path == "facebook/opt-30b"
    assert parse("oodjax:llmft/olmo7_snli").train.learning_rate == 2e-4
    assert config_files.load_config("oodjax:opt30_snli").data.train_set == "snli"
    assert config_files.expand_config_paths(["oodjax:opt30_*", "oodjax:original/opt30_m*"]) == [
        "oodjax:opt30_mnli",
        "oodjax:opt30_snli",
        "oodjax:original/opt30_mnli",
    ]
    assert config_files.config_stem("oodjax:original/opt30_mnli") == "opt30_mnli"
    assert config_files.config_stem("configs/opt2.7_mnli.py") == "opt2.7_mnli"


def test_the_argument_after_a_packaged_name_goes_to_get_config(monkeypatch):
    """`oodjax:NAME:ARG` as `FILE:ARG`: the prefix's colon is not the argument's."""
    assert config_cli.split_config_spec("oodjax:demo:fast") == ("oodjax:demo", ["fast"])
    assert config_cli.split_config_spec("oodjax:demo") == ("oodjax:demo", [])
    assert config_cli.split_config_spec("configs/demo.py:fast") == ("configs/demo.py", ["fast"])
    received = []
    monkeypatch.setattr(
        config_cli,
        "config_module",
        lambda path: type(
            "M",
            (),
            {
                "get_config": staticmethod(
                    lambda *args: received.append((path.name, args)) or config_cli.config_fields.get_config()
                )
            },
        ),
    )
    parse("oodjax:demo:fast")
    parse(f"{ROOT / 'configs' / 'demo.py'}:slow")
    assert received == [("demo.py", ("fast",)), ("demo.py", ("slow",))]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("oodjax:nothing", "there is no packaged config 'nothing' (in "),
        ("oodjax:../pyproject", "there is no packaged config '../pyproject'"),
        ("oodjax:", "there is no packaged config ''"),
    ],
)
def test_an_unknown_packaged_name_lists_the_names(spec, message):
    with pytest.raises(config_cli.CommandLineError) as error:
        parse(spec)
    assert message in str(error.value) and "oodjax:NAME takes one of" in str(error.value)
    assert "opt30_mnli" in str(error.value)


def test_a_missing_file_names_the_packaged_config_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        config_cli.CommandLineError,
        match=r"there is no file configs/opt30_mnli.py; "
        r"oodjax:opt30_mnli names the packaged opt30_mnli.py",
    ):
        parse("configs/opt30_mnli.py")
    with pytest.raises(config_cli.CommandLineError, match=r"there is no file configs/nothing.py$"):
        parse("configs/nothing.py")
