"""The command line of the entry points that take an experiment config: `--config` and its overrides.

    python -m oodjax.main --config configs/demo.py --config.runs.seeds=0,42 --config.data.testsets=snli,hans

`--config FILE[:ARG]` names a config file, whose `get_config([ARG])` returns
the locked ConfigDict; `--config oodjax:NAME[:ARG]` names one installed with
the package (`PACKAGED_PREFIX`), from any directory. Each
`--config.<field>=<value>` then sets one field, read by the type the field
has in that config:

- integers, floats and strings as written (`--config.model.path=` is the
  empty string); `True`/`False` for booleans, `--config.train.pack` alone
  meaning True and `--noconfig.train.pack` False;
- lists as comma-separated items (`--config.runs.seeds=0,42`,
  `--config.data.testsets=snli,hans`) or as a Python literal
  (`--config.runs.seeds=(0,42)`, `--config.data.testsets="('snli','hans')"`);
  `--config.runs.seeds=` or `()` is the empty list. The item type of each
  list is its annotation's (`oodjax.config_fields.list_item_types`); items are stripped of spaces,
  except those of `oodjax.config_fields.VERBATIM_LIST_ITEMS` (`--config.data.answers=" yes"," no"`);
- a dict literal for a field that is itself a ConfigDict
  (`--config.model.hf_config={}` empties it;
  `--config.data.extra_testsets="{'anli1': {...}}"` declares testsets), and a
  field inside one (`--config.data.extra_testsets.anli1.split=test_r2`).

Given twice, a field takes the last value, lists too (ml_collections' flags
would append a repeated list override to the first). A bad override is an
error naming the argument, before anything loads; whether a value is allowed
is `oodjax.config_checks.check_config`'s to say.

`--help` lists every field with its default and the comment above its
declaration on its piece (``oodjax.settings``), the one place a field's meaning is written.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import math
import pathlib
import re
import sys
import textwrap
import types
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags
from ml_collections import config_dict

from oodjax import config_fields, usage_errors
from oodjax.engine import console
from oodjax.usage_errors import ConfigError, MissingInputError

CONFIG_FLAG = "config"
# `--config oodjax:NAME` names the packaged config configs/NAME.py, wherever the package is installed.
PACKAGED_PREFIX = "oodjax:"
_OVERRIDE = re.compile(rf"--?(?P<no>no)?{CONFIG_FLAG}\.(?P<field>[^=]*)(?:=(?P<value>.*))?", re.DOTALL)
_HELP_ARGUMENTS = ("-h", "-help", "--help", "-?", "-helpshort", "--helpshort")
_TRUE, _FALSE = ("true", "1"), ("false", "0")
_LINE_WIDTH = 120  # of describe_config's lines, which wrap between fields


class CommandLineError(ConfigError):
    """A `--config` or `--config.<field>` argument that cannot be applied; the message names it."""


def define_config_flag(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder[str]:
    """Defines the required `--config FILE[:ARG]` flag; `run` reads it and applies the overrides."""
    return flags.DEFINE_string(
        CONFIG_FLAG,
        None,
        "Experiment config file (e.g. configs/demo.py), or oodjax:NAME for the packaged configs/NAME.py "
        "(oodjax:opt30_mnli), then --config.<field>=<value> to override a field "
        "(lists: --config.runs.seeds=0,42); the fields are listed below.",
        flag_values=flag_values,
        required=True,
    )


def run(main: Callable[[config_dict.ConfigDict], None], doc: str) -> None:
    """`absl.app.run(main)` for an entry point taking a config: `main` receives the overridden config.

    `doc` (the entry point's docstring) opens `--help`. A bad override or a ``usage_errors.UsageError`` is
    one line and exit status 2; other errors keep their traceback.
    """
    if CONFIG_FLAG not in flags.FLAGS:
        define_config_flag()
    console.use_short_log_lines()

    def reported_main(config: config_dict.ConfigDict) -> None:
        with usage_errors.reported(_program(), config_spec=flags.FLAGS[CONFIG_FLAG].value):
            main(config)

    app.run(reported_main, flags_parser=functools.partial(_parse_or_exit, doc=doc))


def _program(argv0: str | None = None) -> str:
    """How the user called this entry point, for its error lines: `oodjax-train`, or `python -m oodjax.main`
    (``python -m`` puts the module's file in argv[0])."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.origin and pathlib.Path(argv0).resolve() == pathlib.Path(spec.origin).resolve():
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return pathlib.Path(argv0).name


def parse_command_line(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS) -> config_dict.ConfigDict:
    """The config that `argv` (program name first) names, with its `--config.<field>` overrides applied;
    other flags are parsed by `flag_values` as absl would."""
    argv = flag_values.read_flags_from_files(list(argv), force_gnu=False)
    overrides, rest = _split_overrides(argv)
    positional = flag_values(rest)[1:]
    if positional:
        raise CommandLineError(f"unexpected arguments {positional}; settings go in --config.<field>=<value>")
    spec = flag_values[CONFIG_FLAG].value
    assert spec is not None  # a required flag: absl refuses a command line without it
    config = load_config_file(spec)
    apply_overrides(config, overrides)
    return config


def config_module(path: pathlib.Path) -> types.ModuleType:
    """The config file at ``path`` (which exists), executed as a module: by path, since file names such as
    `opt2.7_mnli.py` are not importable module names."""
    module_spec = importlib.util.spec_from_file_location(f"_oodjax_config_{path.stem.replace('.', '_')}", path)
    assert module_spec is not None and module_spec.loader is not None  # a .py file's path always has both
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as an import would: dataclasses look their module up there
    module_spec.loader.exec_module(module)
    return module


def packaged_configs_dir() -> pathlib.Path:
    """The folder of the configs installed with the package (the repository's configs/ in a checkout)."""
    spec = importlib.util.find_spec("configs")  # located, not imported: the library does not depend on it
    if spec is None or not spec.submodule_search_locations:
        raise MissingInputError("the packaged configs (the configs package) are not installed beside oodjax")
    return pathlib.Path(next(iter(spec.submodule_search_locations))).resolve()


def config_file_path(file: str) -> pathlib.Path:
    """The file a config argument's FILE part names: `oodjax:NAME` the packaged configs/NAME.py, else a path."""
    if file.startswith(PACKAGED_PREFIX):
        name = file[len(PACKAGED_PREFIX) :].removesuffix(".py")
        path = packaged_configs_dir() / f"{name}.py"
        outside = name.startswith("/") or "\\" in name or ".." in pathlib.PurePosixPath(name).parts
        if not name or outside or not path.is_file():
            names = sorted(file.stem for file in packaged_configs_dir().glob("*.py") if not file.stem.startswith("_"))
            raise FileNotFoundError(
                f"there is no packaged config {name!r} (in {packaged_configs_dir()}); "
                f"{PACKAGED_PREFIX}NAME takes one of {', '.join(names)}"
            )
        return path
    path = pathlib.Path(file)
    if not path.is_file():
        packaged = packaged_configs_dir() / path.name
        hint = (
            f"; {PACKAGED_PREFIX}{path.stem} names the packaged {path.name}"
            if path.suffix == ".py" and packaged.is_file() and packaged.resolve() != path.resolve()
            else ""
        )
        raise FileNotFoundError(f"there is no file {path}{hint}")
    return path


def split_config_spec(spec: str) -> tuple[str, list[str]]:
    """`FILE[:ARG]` or `oodjax:NAME[:ARG]` -> (the file part, [ARG] or [])."""
    prefix = PACKAGED_PREFIX if spec.startswith(PACKAGED_PREFIX) else ""
    file, *argument = spec[len(prefix) :].split(":", 1)
    return prefix + file, argument


def load_config_file(spec: str) -> config_dict.ConfigDict:
    """`get_config([ARG])` of the file `spec` names (`FILE`, `FILE:ARG`, `oodjax:NAME` or `oodjax:NAME:ARG`),
    locked.

    File names such as `opt2.7_mnli.py` are not importable module names, so the file is loaded by path.
    """
    file, argument = split_config_spec(spec)
    try:
        path = config_file_path(file)
    except FileNotFoundError as error:
        raise CommandLineError(f"--{CONFIG_FLAG}={spec}: {error}") from None
    module = config_module(path)
    if not callable(getattr(module, "get_config", None)):
        raise CommandLineError(f"--{CONFIG_FLAG}={spec}: {path} has no get_config()")
    config = module.get_config(*argument)
    if not isinstance(config, config_dict.ConfigDict):
        raise CommandLineError(
            f"--{CONFIG_FLAG}={spec}: get_config() returned a {type(config).__name__}, not a ConfigDict"
        )
    config.lock()
    return config


def apply_overrides(config: config_dict.ConfigDict, overrides: Sequence[str]) -> None:
    """Sets each `--config.<field>=<value>` of `overrides` on `config`, in order (the last of a field wins)."""
    for argument in overrides:
        match = _OVERRIDE.fullmatch(argument)
        if match is None:
            raise CommandLineError(f"{argument}: not of the form --{CONFIG_FLAG}.<field>=<value>")
        field = match["field"]
        parent, key = _parent_and_key(config, field, argument)
        parent[key] = _parse_value(field, parent[key], match["value"], negated=bool(match["no"]), argument=argument)


def config_fields_help(config: config_dict.ConfigDict | None = None) -> str:
    """Every field of the config with its meaning, section by section, and its value: base's
    default, or ``config``'s (the one `--config` names) with base's default beside each value it changes."""
    defaults = config_fields.get_config()
    if config is None:
        shown = "shown with configs/base.py's defaults, which a config file changes in part"
    else:
        shown = "shown with --config's values, (base: X) where configs/base.py's default X differs"
    lines = [f"config fields (--{CONFIG_FLAG}.<field>=<value> sets one; {shown}):"]
    for path, description in config_fields.field_descriptions().items():
        if path in config_fields.sections():
            lines += ["", f"[{path}]", *_wrapped(description, indent="  ")]
            continue
        if "." not in path:
            lines.append("")  # a field outside any section
        default = _display(config_fields.value_at(defaults, path))
        value = default if config is None else _display(config_fields.value_at(config, path))
        changed = f"  (base: {default})" if value != default else ""
        lines += [f"  {path} = {value}{changed}", *_wrapped(description, indent="      ")]
    return "\n".join(lines)


def describe_config(config: config_dict.ConfigDict) -> str:
    """``config`` as a job prints it at start: a line per section of ``field=value``, each value as
    `--config.<field>=` takes it."""
    sections: dict[str, list[str]] = {"": []}
    for path in config_fields.field_descriptions():
        if path not in config_fields.sections():
            section, _, field = path.rpartition(".")
            sections.setdefault(section, []).append(f"{field}={_display(config_fields.value_at(config, path))}")
    lines = []
    for section, items in sections.items():
        head = f"  {section}: " if section else "  "
        row: list[str] = []
        rows = [row]
        for item in items:
            if row and len(head) + len("  ".join([*row, item])) > _LINE_WIDTH:
                row = []
                rows.append(row)
            row.append(item)
        lines += [(head if i == 0 else " " * len(head)) + "  ".join(row) for i, row in enumerate(rows)]
    return "\n".join(lines)


def _parse_or_exit(argv: list[str], doc: str, flag_values: flags.FlagValues = flags.FLAGS) -> config_dict.ConfigDict:
    """`run`'s flags parser: `--help` prints the help (with the values of the config `--config` names, if it
    names one) and exits 0; a bad argument prints one line and exits 2."""
    before_separator = argv[: argv.index("--")] if "--" in argv else argv
    try:
        if any(argument in _HELP_ARGUMENTS for argument in before_separator[1:]):
            asked = [argument for argument in argv if argument not in _HELP_ARGUMENTS]
            print(help_text(doc, flag_values, _config_for_help(asked, flag_values)))
            sys.exit(0)
        return parse_command_line(argv, flag_values)
    except (CommandLineError, flags.Error) as error:
        print(f"{_program(argv[0])}: error: {error} (--help lists the flags and the config fields)", file=sys.stderr)
        sys.exit(usage_errors.EXIT_STATUS)


def help_text(
    doc: str, flag_values: flags.FlagValues = flags.FLAGS, config: config_dict.ConfigDict | None = None
) -> str:
    """What `--help` prints: the entry point's docstring, its flags, then every config field (with ``config``'s
    values, if given: ``config_fields_help``)."""
    own_flags = [flag_values.module_help(__name__), flag_values.main_module_help()]
    flag_help = "\n".join(text for text in own_flags if text.strip())
    return "\n".join(
        [doc.strip(), "", "flags:", flag_help, "(--helpfull lists absl's flags too)", "", config_fields_help(config)]
    )


def _config_for_help(argv: list[str], flag_values: flags.FlagValues) -> config_dict.ConfigDict | None:
    """The config `argv` (`--help` taken out) names, overrides applied; None where it names none (the help then
    shows base's defaults). A config it names that cannot be loaded is an error, as without `--help`."""
    try:
        return parse_command_line(argv, flag_values)
    except flags.Error:
        if flag_values[CONFIG_FLAG].value is None:
            return None
        raise


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the `--config.<field>` arguments, the rest) of `argv`; arguments after `--` are positional."""
    end = argv.index("--") if "--" in argv else len(argv)
    is_override = [0 < i < end and _OVERRIDE.fullmatch(argument) is not None for i, argument in enumerate(argv)]
    overrides = [argument for argument, override in zip(argv, is_override) if override]
    return overrides, [argument for argument, override in zip(argv, is_override) if not override]


def _parent_and_key(config: config_dict.ConfigDict, field: str, argument: str) -> tuple[config_dict.ConfigDict, str]:
    """The ConfigDict holding `field` ("a.b.c") and its last key, or an error naming the missing part."""
    *parents, key = field.split(".")
    node: Any = config
    walked: list[str] = []
    for name in [*parents, key]:
        if not isinstance(node, config_dict.ConfigDict):
            raise CommandLineError(f"{argument}: {'.'.join(walked)} is a value, not a section with fields")
        if name not in node:
            where = ".".join(walked) or "the config"
            close = difflib.get_close_matches(name, list(node.keys()), n=1)
            hint = f"; did you mean {'.'.join([*walked, close[0]])}?" if close else ""
            raise CommandLineError(
                f"{argument}: {where} has no field {name!r}{hint} (its fields: {', '.join(node.keys())})"
            )
        walked.append(name)
        parent, node = node, node[name]
    return parent, key


def _parse_value(field: str, current: Any, text: str | None, *, negated: bool, argument: str) -> Any:
    """`text` read as the type of the field's `current` value."""

    def error(expected: str) -> CommandLineError:
        return CommandLineError(f"{argument}: {field} takes {expected}")

    if isinstance(current, bool):
        if text is None:
            return not negated
        if negated:
            raise error("no value after --no (write --config.<field>=False)")
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise error(f"True or False, got {text!r}")
    if negated or text is None:
        raise error(f"a value: write --{CONFIG_FLAG}.{field}=<value> (only a boolean may be given alone)")
    if isinstance(current, tuple):
        return _parse_list(field, text, argument)
    if isinstance(current, config_dict.ConfigDict):
        if field in config_fields.sections():
            raise error(f"no value: it is a section; set its fields one by one (--{CONFIG_FLAG}.{field}.<field>=...)")
        value = _literal(text) if text.strip() else {}
        if not isinstance(value, dict):
            raise error(f"a dict literal such as {{}} or {{'key': 1}}, got {text!r}")
        return config_dict.ConfigDict(value)
    if isinstance(current, (int, float, str)):
        return _parse_scalar(type(current), text, lambda expected: error(f"{expected}, got {text!r}"))
    raise error(f"a {type(current).__name__}, which the command line cannot set; set it in the config file")


def _parse_scalar(kind: type, text: str, error: Callable[[str], CommandLineError]) -> int | float | str:
    if kind is str:
        return text
    try:
        value: int | float = kind(text.strip())
    except ValueError:
        raise error("an integer" if kind is int else "a number") from None
    if kind is float and not math.isfinite(value):
        raise error("a finite number")
    return value


def _parse_list(field: str, text: str, argument: str) -> tuple[Any, ...]:
    """`a,b,c` or a Python tuple/list literal, each item of the field's declared item type."""
    if field not in config_fields.list_item_types():
        raise CommandLineError(f"{argument}: {field} is a list no piece declares (a tuple field's annotation)")
    kind = config_fields.list_item_types()[field]
    what = {int: "integers", float: "numbers", str: "strings"}[kind]
    example = {int: "0,42", float: "0.1,0.2", str: "snli,hans"}[kind]
    stripped = text.strip()
    if stripped in ("", "()", "[]"):
        return ()
    if stripped[0] in "([":
        items = _literal(stripped)
        if not isinstance(items, (tuple, list)):
            raise CommandLineError(
                f"{argument}: {stripped!r} is not a Python tuple or list literal (strings quoted); "
                f"or write the items comma-separated: --{CONFIG_FLAG}.{field}={example}"
            )
    else:
        items = [item if field in config_fields.VERBATIM_LIST_ITEMS else item.strip() for item in text.split(",")]
        if "" in items:
            raise CommandLineError(f"{argument}: an empty item in {text!r}; write --{CONFIG_FLAG}.{field}={example}")
        if kind is not str:

            def not_a(expected: str, item: str) -> CommandLineError:
                return CommandLineError(f"{argument}: {field} is a list of {what}; {item!r} is not {expected}")

            items = [_parse_scalar(kind, item, functools.partial(not_a, item=item)) for item in items]
    for item in items:
        if not _is_a(item, kind):
            raise CommandLineError(f"{argument}: {field} is a list of {what}; {item!r} is not one")
    return tuple(kind(item) for item in items)


def _literal(text: str) -> Any:
    """The Python literal ``text`` writes, or None where it writes none."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None


def _is_a(item: Any, kind: type) -> bool:
    """isinstance, except that a bool is not an integer here, and an integer is a float."""
    if isinstance(item, bool):
        return False
    return isinstance(item, (int, float)) if kind is float else isinstance(item, kind)


def _display(value: Any) -> str:
    """A value as it would be written after `--config.<field>=`."""
    if isinstance(value, tuple):
        simple = all(not re.search(r"[\s,'\"()]", str(item)) and not isinstance(item, bool) for item in value)
        return ",".join(map(str, value)) if value and simple else repr(value)
    if isinstance(value, config_dict.ConfigDict):
        return repr(value.to_dict())
    return repr(value) if isinstance(value, str) else str(value)


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, width=100, initial_indent=indent, subsequent_indent=indent)
