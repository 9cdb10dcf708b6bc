"""The config command line (`oodjax.config_cli`), parsed in process as absl parses argv: overrides, errors, --help."""

import pathlib
import re

import pytest
from absl import flags
from ml_collections import config_dict

from configs import base
from oodjax import config_checks, config_cli, config_fields
from oodjax.config_checks import check_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.py"  # runs.seeds (0, 42), runs.shots (32,)


def fresh_flags() -> flags.FlagValues:
    flag_values = flags.FlagValues()
    config_cli.define_config_flag(flag_values)
    return flag_values


def parse(*arguments, config=DEMO):
    return config_cli.parse_command_line(["oodjax.main", f"--config={config}", *arguments], fresh_flags())


def test_a_list_override_replaces_the_list():
    assert parse("--config.runs.shots=128").runs.shots == (128,)


def test_a_repeated_list_override_takes_the_last_value():
    """A sweep's overrides followed by the user's: ml_collections trained (32, 128)."""
    assert parse("--config.runs.shots=(32,)", "--config.runs.shots=128").runs.shots == (128,)
    assert parse("--config.train.steps=3", "--config.train.steps=5").train.steps == 5


@pytest.mark.parametrize(
    "argument, field, value",
    [
        ("--config.data.testsets=snli,hans", "testsets", ("snli", "hans")),  # was one name, 'snli,hans'
        ("--config.data.testsets=snli, hans", "testsets", ("snli", "hans")),
        ("--config.data.testsets=('snli', 'hans')", "testsets", ("snli", "hans")),
        ("--config.data.testsets=['snli']", "testsets", ("snli",)),
        ("--config.data.testsets=hans", "testsets", ("hans",)),
        ("--config.runs.seeds=0,42", "seeds", (0, 42)),
        ("--config.runs.seeds=(0,42,)", "seeds", (0, 42)),  # the form launch.sweep writes
        ("--config.runs.seeds=7", "seeds", (7,)),
        ("--config.runs.seeds=", "seeds", ()),  # was ('',), which failed deep inside data loading
        ("--config.runs.seeds=()", "seeds", ()),
        ("--config.data.buckets=64,128", "buckets", (64, 128)),
    ],
)
def test_lists_in_the_comma_form_and_as_literals(argument, field, value):
    config = parse(argument)
    section = config.data if field in ("testsets", "buckets") else config.runs
    assert section[field] == value
    assert all(type(item) is type(expected) for item, expected in zip(section[field], value))


@pytest.mark.parametrize(
    "argument, answers",
    [
        ("--config.data.answers= yes, no", (" yes", " no")),  # the shell's view of --config.data.answers=" yes"," no"
        ("--config.data.answers=Yes,No", ("Yes", "No")),
        ("--config.data.answers=(' True', ' False')", (" True", " False")),
        ("--config.data.answers= (' True', ' False') ", (" True", " False")),
    ],
)
def test_answer_words_keep_their_spaces(argument, answers):
    """A leading space makes an answer another token (GPT-2's " yes" is 3763, "yes" 8505): never stripped."""
    assert parse(argument).data.answers == answers


def test_testsets_declared_on_the_command_line():
    declaration = "{'rte_val': {'source': 'nyu-mll/glue', 'config': 'rte', 'split': 'validation', 'entailment': [0]}}"
    config = parse(
        f"--config.data.extra_testsets={declaration}",
        "--config.data.extra_testsets.rte_val.split=train",
        "--config.data.extra_testsets_file=sets.yaml",
    )
    assert config.data.extra_testsets.to_dict() == {
        "rte_val": {"source": "nyu-mll/glue", "config": "rte", "split": "train", "entailment": [0]}
    }
    assert config.data.extra_testsets_file == "sets.yaml"
    with pytest.raises(config_cli.CommandLineError, match=r"data.extra_testsets takes a dict literal"):
        parse("--config.data.extra_testsets=sets.yaml")


def test_an_empty_list_that_must_not_be_empty_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match=r"runs.seeds must be a non-empty list without repeats, got \[\]"):
        check_config(parse("--config.runs.seeds="))
    with pytest.raises(ValueError, match=r"data.testsets is empty"):
        config_checks.check_config(parse("--config.data.testsets="))


def test_scalars_booleans_and_dicts():
    config = parse(
        "--config.train.steps=7",
        "--config.train.learning_rate=1",
        "--config.model.name=",
        "--config.train.pack",
        "--config.export.peft=true",
        "--config.model.hf_config.hidden_size=96",
    )
    assert (config.train.steps, config.train.learning_rate, config.model.name) == (7, 1.0, "")
    assert type(config.train.learning_rate) is float
    assert config.train.pack is True and config.export.peft is True
    assert config.model.hf_config.hidden_size == 96
    assert parse("--config.train.pack", "--noconfig.train.pack").train.pack is False
    emptied = parse("--config.model.path=facebook/opt-125m", "--config.model.hf_config={}")
    assert emptied.model.hf_config.to_dict() == {} and emptied.model.path == "facebook/opt-125m"


@pytest.mark.parametrize(
    "argument, message",
    [
        ("--config.runs.seeds=0,,42", r"an empty item in '0,,42'; write --config.runs.seeds=0,42"),
        ("--config.runs.seeds=0,", r"an empty item in '0,'"),
        ("--config.runs.seeds=a", r"runs.seeds is a list of integers; 'a' is not an integer"),
        ("--config.runs.seeds=1.5", r"runs.seeds is a list of integers; '1.5' is not an integer"),
        ("--config.runs.seeds=(0,'a')", r"runs.seeds is a list of integers; 'a' is not one"),
        ("--config.runs.seeds=(True,)", r"runs.seeds is a list of integers; True is not one"),
        ("--config.runs.seeds=(0,42", r"'\(0,42' is not a Python tuple or list literal"),
        (
            "--config.data.testsets=(snli,hans)",
            r"'\(snli,hans\)' is not a Python tuple or list literal \(strings quoted\); or write the items "
            r"comma-separated: --config.data.testsets=snli,hans",
        ),
        ("--config.data.testsets=(1,2)", r"data.testsets is a list of strings; 1 is not one"),
        ("--config.train.steps=1.5", r"train.steps takes an integer, got '1.5'"),
        ("--config.train.steps=", r"train.steps takes an integer, got ''"),
        ("--config.train.learning_rate=fast", r"train.learning_rate takes a number, got 'fast'"),
        ("--config.train.learning_rate=nan", r"train.learning_rate takes a finite number, got 'nan'"),
        ("--config.train.pack=yes", r"train.pack takes True or False, got 'yes'"),
        ("--config.train.steps", r"train.steps takes a value: write --config.train.steps=<value>"),
        ("--noconfig.train.steps", r"train.steps takes a value"),
        ("--config.train.stepz=3", r"train has no field 'stepz'; did you mean train.steps\? \(its fields: .*steps"),
        ("--config.trian.steps=3", r"the config has no field 'trian'; did you mean train\?"),
        ("--config.train.steps.max=3", r"train.steps is a value, not a section with fields"),
        ("--config.train={}", r"train takes no value: it is a section; set its fields one by one"),
        ("--config.model.hf_config=[1]", r"model.hf_config takes a dict literal such as \{\}"),
    ],
)
def test_malformed_overrides_are_errors_naming_the_argument(argument, message):
    with pytest.raises(config_cli.CommandLineError, match=rf"^{re.escape(argument)}: {message}"):
        parse(argument)


def test_a_config_file_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(config_cli.CommandLineError, match=rf"--config={tmp_path}/none.py: there is no file"):
        parse(config=tmp_path / "none.py")


def test_a_config_file_argument_and_a_flagfile(tmp_path):
    """`FILE:ARG` reaches get_config(ARG); overrides in a --flagfile apply like those on the command line."""
    config_file = tmp_path / "steps.py"
    config_file.write_text(
        "from configs import base\n\n\ndef get_config(steps):\n"
        "    config = base.get_config()\n    config.train.steps = int(steps)\n    return config\n"
    )
    assert parse(config=f"{config_file}:12").train.steps == 12
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text("--config.runs.seeds=5,6\n")
    assert parse(f"--flagfile={flagfile}", config=f"{config_file}:12").runs.seeds == (5, 6)


def test_positional_arguments_are_refused():
    with pytest.raises(config_cli.CommandLineError, match=r"unexpected arguments \['3'\]"):
        parse("3")


def test_a_bad_override_exits_with_one_line(capsys):
    argv = ["oodjax.main", f"--config={DEMO}", "--config.runs.seeds=a"]
    with pytest.raises(SystemExit) as exit_:
        config_cli._parse_or_exit(argv, "doc", fresh_flags())
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "oodjax.main: error: --config.runs.seeds=a: runs.seeds is a list of integers; 'a' is not an integer "
        "(--help lists the flags and the config fields)\n"
    )


def _base_fields(config, prefix=""):
    """Every field of `config`, sections included, written out here independently of config_cli."""
    for key, value in config.items():
        yield f"{prefix}{key}", value
        if isinstance(value, config_dict.ConfigDict) and value.keys():
            yield from _base_fields(value, f"{prefix}{key}.")


def test_list_item_types_cover_every_list_field_of_the_base_config():
    lists = {path for path, value in _base_fields(base.get_config()) if isinstance(value, tuple)}
    assert lists == set(config_fields.list_item_types())


def test_every_base_field_has_a_description():
    """A field added to configs/base.py without a comment would show in --help without a meaning."""
    descriptions = config_fields.field_descriptions()
    fields = {path for path, value in _base_fields(base.get_config())}
    assert set(descriptions) == fields
    sections = {path for path, value in _base_fields(base.get_config()) if isinstance(value, config_dict.ConfigDict)}
    assert [path for path in fields - sections if not descriptions[path]] == []


def test_help_lists_fields_with_defaults_and_their_comments_in_base():
    text = config_cli.help_text("The entry point's doc.", fresh_flags())
    assert text.startswith("The entry point's doc.\n\nflags:\n")
    assert "--config: Experiment config file" in text
    assert (
        "  runs.seeds = 0,42,99\n      A run's seed draws its few-shot set, its data order, its adapter initialisation"
        in text
    )
    assert "  train.steps = 500\n      optimizer steps per run (unless train.epochs)\n" in text
    assert "  train.warmup_steps = 0\n      A fixed linear warm-up from 0 to the peak, in steps, then" in text
    assert "  eval.points = 20\n      Evaluations after step 0 per run, unless eval.every is set" in text
    assert "  data.testsets = snli,mnli,scitail,rte,wnli,paws,hans,anli\n      Testsets evaluated at step 0" in text
    assert "\n[mesh]\n  Device mesh axis sizes; -1 = all remaining devices." in text
    assert "  model.hf_config = {}\n" in text


def test_help_with_a_config_shows_its_values_and_base_defaults_it_changes(capsys):
    argv = ["oodjax.main", f"--config={DEMO}", "--config.train.steps=7", "--help"]
    with pytest.raises(SystemExit) as exit_:
        config_cli._parse_or_exit(argv, "The entry point's doc.", fresh_flags())
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "shown with --config's values, (base: X) where configs/base.py's default X differs" in text
    assert "  runs.seeds = 0,42  (base: 0,42,99)\n      A run's seed draws its few-shot set" in text
    assert (
        "  train.steps = 7  (base: 500)\n      optimizer steps per run (unless train.epochs)\n" in text
    )  # the override applied
    assert "  lora.rank = 8\n" in text  # as base's: nothing beside it


def test_the_config_a_job_prints_at_start_holds_every_field_by_section():
    lines = config_cli.describe_config(parse("--config.train.steps=7")).splitlines()
    assert "  runs: seeds=0,42  shots=32  key_source='seed'  skip_locked=False" in lines
    assert all(len(line) <= 120 for line in lines if "hf_config=" not in line)  # a dict longer than a line stays whole
    printed, section = {}, ""  # section -> its fields' text; "" the fields outside any section, printed first
    for line in lines:
        if match := re.match(r"  (\w+): (.*)", line):
            section, line = match.groups()
        printed[section] = printed.get(section, "") + " " + line.strip() + " "
    assert list(printed)[:3] == ["", "model", "lora"]
    for path, value in _base_fields(base.get_config()):
        if not (isinstance(value, config_dict.ConfigDict) and value.keys()):  # a field, not a section
            section, _, field = path.rpartition(".")
            assert f" {field}=" in printed[section], path
    assert " steps=7 " in printed["train"]
