"""README.md and docs/*.md against the code: what they quote must exist, and the defaults they state must hold.

A renamed config field, flag, module, make target or file leaves a doc that
still reads well and is wrong; a user who copies the command gets an error,
or a default that is not the one stated. These checks read every doc and
test each claim that can be read mechanically, naming the doc, the line and
the claim that fails. What is read, and how a doc must write it to be read:

- config fields: `section.field` (`train.steps`), `config.field`
  (`config.tokenizer`) and `--config.field=value` in code spans and blocks
  must be fields of configs/base.py (any key under a dict field empty there,
  `model.hf_config` or `data.extra_testsets`); a value given to a field must
  parse as the command line parses it (`oodjax.config_cli`);
- defaults, written as `` `field` (default `value`) ``, `` `field`, default
  `value` ``, `` `field` (`value`, the default ``, `` `field=value` (default) ``
  or, for a boolean, `` `field` (the default) ``, for config fields and for
  the flags of the entry points; and docs/protocol.md's "oodjax default"
  column, whose `field=value` entries must be the value of every study config;
- commands: `python -m MODULE` must be importable (a package: with a
  `__main__`), `oodjax-NAME` a command of pyproject.toml, and every `--flag`
  given to one must be a flag of that entry point (its argparse parser, or
  `--config`, its absl flags and the config fields for the entry points of
  `oodjax.config_cli`), with a value among the flag's choices where it has
  some; a `--flag` quoted on its own must be a flag of some entry point, of
  a launch script or of the tools in ``OTHER_TOOLS_FLAGS``; the table of
  commands in docs/install.md must pair each command with the module that has
  its flags;
- `make TARGET` must be a target of the Makefile; repository paths
  (configs/..., launch/..., docs/..., ../shared/...; globs must match a file)
  must exist; links must reach a file and, with `#anchor`, one of its headings;
- environment variables (every `OODJAX_*`, and those a quoted command sets or
  reads) must be named somewhere in the code; dotted names of our code
  (`oodjax.data.load_testset`, `sharding.make_mesh`) must resolve, and a
  quoted call must name its parameters, with the defaults in a signature
  excerpt, `` `load_testset(..., neutral="drop")` ``;
- names the docs say are gone (``ABSENT_FIELDS``: `runs.chunk`) must stay gone.
- the README stays a front page, at most ``README_MAX_LINES`` lines, that links every page of docs/.

Placeholders are not checked: words in capitals (`configs/X.py`, `--seeds N`),
`<...>`, and `...`. The entry points' flags are read without running them:
each is started as `python -m` would start it, with argparse's parsing, the
absl flag definitions and `oodjax.config_cli.run` intercepted, so nothing is
parsed, loaded or compiled.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import fnmatch
import functools
import glob
import importlib
import importlib.util
import inspect
import itertools
import pathlib
import re
import runpy
import shlex
import tomllib
import unittest.mock
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from absl import flags
from ml_collections import config_dict

from configs import base
from launch.config_files import experiment_config_paths, load_config
from oodjax import config_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
REPO_PACKAGES = ("oodjax", "analysis", "launch", "configs", "benchmarks")
# Flags of other programs the docs quote on their own (a span that starts with one of OTHER_TOOLS is not checked).
OTHER_TOOLS_FLAGS = {"--export": "sbatch's", "--fp16": "llmft's training script's (docs/protocol.md)"}
OTHER_TOOLS = ("pip", "sbatch", "srun", "tensorboard", "wandb", "hf", "gcloud", "scontrol")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*[*]?|\.\.\.|.*<[^>]*>.*)$")  # X, NAME, DIR, N, ..., <run_dir>
PATH_PREFIXES = ("configs/", "launch/", "docs/", "oodjax/", "analysis/", "benchmarks/", "tests/", "../shared/")
ROOT_FILES = re.compile(r"(?<![\w/.-])(Makefile|pyproject\.toml|requirements(?:-[\w-]+)?\.txt)(?![\w.-])")
CODE_FILES = ("oodjax/**/*.py", "launch/*", "configs/**/*.py", "analysis/*.py", "benchmarks/*.py", "Makefile")


# --- reading the docs ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Quote:
    """Code a doc quotes: an inline span, or one logical line of a fenced block (`\\` continuations joined)."""

    doc: str  # path relative to the repository
    line: int
    text: str
    fence: str | None  # the block's language ("" when none), None for an inline span


@dataclasses.dataclass(frozen=True)
class Doc:
    path: pathlib.Path
    name: str  # relative to the repository, as problems name it
    prose: str  # the text with fenced blocks blanked out (line numbers kept)
    quotes: tuple[Quote, ...]

    def line_of(self, offset: int) -> int:
        return self.prose.count("\n", 0, offset) + 1


FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w-]*)")
SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.DOTALL)


def read_doc(path: pathlib.Path) -> Doc:
    """The doc's prose and every code quote in it, each with its line number."""
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    lines = path.read_text().splitlines()
    prose, quotes, fence, fence_language, pending = [], [], None, "", None
    for number, line in enumerate(lines, start=1):
        opening = FENCE.match(line)
        if fence is not None:
            prose.append("")
            if opening and opening.group(1).startswith(fence) and not opening.group(2):
                fence = None
                continue
            if pending is not None:
                pending = (pending[0], f"{pending[1]} {line.strip()}")
            else:
                pending = (number, line.strip())
            if pending[1].endswith("\\"):
                pending = (pending[0], pending[1][:-1].rstrip())
            else:
                quotes.append(Quote(name, pending[0], pending[1], fence_language))
                pending = None
            continue
        if opening:
            fence, fence_language = opening.group(1), opening.group(2)
            prose.append("")
            continue
        prose.append(line)
    text = "\n".join(prose)
    for match in SPAN.finditer(text):
        span = " ".join(match.group(2).split())
        quotes.append(Quote(name, text.count("\n", 0, match.start()) + 1, span, None))
    quotes.sort(key=lambda quote: quote.line)
    return Doc(path, name, text, tuple(quotes))


def project_docs() -> list[Doc]:
    return [read_doc(path) for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]


def is_placeholder(text: str) -> bool:
    return bool(PLACEHOLDER.match(text.strip("'\"[]()"))) or "..." in text


def shell_words(text: str) -> list[str]:
    """The words of a command as the shell splits them (quotes removed); by spaces where quoting is unbalanced."""
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return text.split()


# --- the config --------------------------------------------------------------------------------------------


@functools.cache
def base_config() -> config_dict.ConfigDict:
    return base.get_config()


def config_sections() -> list[str]:
    return [key for key, value in base_config().items() if isinstance(value, config_dict.ConfigDict)]


OPEN = object()  # the value of a key under a dict field that configs/base.py leaves empty: any


def config_value(path: str) -> tuple[bool, Any]:
    """(whether configs/base.py has the field, its default); any path under a dict field empty there exists,
    its default then ``OPEN``."""
    node: Any = base_config()
    for name in path.split("."):
        if isinstance(node, config_dict.ConfigDict) and not node.keys():
            return True, OPEN  # an open dict: hf_config, extra_testsets
        if not isinstance(node, config_dict.ConfigDict) or name not in node:
            return False, None
        node = node[name]
    return True, node


def override_problem(argument: str) -> str | None:
    """Why `--config.field=value` would be refused by the command line, or None."""
    match = re.fullmatch(r"--(?:no)?config\.([\w.]+)(?:=(.*))?", argument, re.DOTALL)
    if match is None or is_placeholder(match.group(1)) or match.group(1) in ("section.field", "field"):
        return None
    exists, default = config_value(match.group(1))
    if not exists:
        return f"{match.group(1)} is not a field of configs/base.py"
    if default is OPEN:
        return None  # a key the config declares (data.extra_testsets.NAME.split): its type is not known here
    value = match.group(2)
    if value is None or is_placeholder(value) or any(is_placeholder(item) for item in value.split(",")):
        return None
    try:
        config_cli.apply_overrides(base.get_config(), [argument])
    except config_cli.CommandLineError as error:
        return str(error).removeprefix(f"{argument}: ")
    return None


def same_value(written: str, actual: Any) -> bool:
    """Whether a value as a doc writes it (a Python literal, or a bare word for a string) is `actual`."""
    try:
        parsed = ast.literal_eval(written)
    except (ValueError, SyntaxError):
        parsed = written
    if isinstance(actual, (list, tuple)) and isinstance(parsed, (list, tuple)):
        return tuple(parsed) == tuple(actual)
    return parsed == actual or (isinstance(actual, str) and written == actual)


# --- entry points -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Flag:
    default: Any = None
    choices: tuple[str, ...] | None = None
    takes_value: bool = True  # False: a switch (argparse's store_true)


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    flags: dict[str, Flag]
    takes_config: bool  # oodjax.config_cli's: --config FILE and --config.<field>=<value>


class _Intercepted(Exception):
    def __init__(self, entry_point: EntryPoint):
        super().__init__()
        self.entry_point = entry_point


def _entry_point(start: Callable[[], object]) -> EntryPoint:
    """The flags of the command that `start` starts, read where it would parse them: argparse's parsing and
    `oodjax.config_cli.run` raise instead, so nothing else runs; absl flags it defines are recorded."""
    absl_flags: dict[str, Flag] = {}

    def record(name: str, default: Any = None, *args: Any, **kwargs: Any) -> None:
        absl_flags[f"--{name}"] = Flag(default)

    def argparse_parsed(parser, *args: Any, **kwargs: Any) -> None:
        found = {  # argparse lists its actions nowhere public
            option: Flag(action.default, tuple(action.choices) if action.choices else None, action.nargs != 0)
            for action in parser._actions
            for option in action.option_strings
        }
        raise _Intercepted(EntryPoint(found, takes_config=False))

    def config_cli_run(*args: Any, **kwargs: Any) -> None:
        own = {"--help": Flag(), f"--{config_cli.CONFIG_FLAG}": Flag()}
        raise _Intercepted(EntryPoint({**own, **absl_flags}, takes_config=True))

    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)  # runpy, of a module imported
        for name in dir(flags):
            if name.startswith("DEFINE_") and name != "DEFINE_flag":
                stack.enter_context(unittest.mock.patch.object(flags, name, record))
        stack.enter_context(unittest.mock.patch("argparse.ArgumentParser.parse_known_args", argparse_parsed))
        stack.enter_context(unittest.mock.patch.object(config_cli, "run", config_cli_run))
        try:
            start()
        except _Intercepted as intercepted:
            return intercepted.entry_point
    raise AssertionError(f"{start} returned without parsing a command line")


def is_repo_module(module: str) -> bool:
    return module.split(".")[0] in REPO_PACKAGES


def module_problem(module: str) -> str | None:
    """Why `python -m module` would not start, or None."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"no module {module}"
    if spec.submodule_search_locations is not None and importlib.util.find_spec(f"{module}.__main__") is None:
        return f"{module} is a package without __main__"
    return None


@functools.cache
def module_entry_point(module: str) -> EntryPoint:
    """What `python -m module` parses."""
    return _entry_point(lambda: runpy.run_module(module, run_name="__main__", alter_sys=False))


@functools.cache
def console_scripts() -> dict[str, str]:
    """pyproject.toml's commands: name -> "module:function"."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@functools.cache
def script_entry_point(script: str) -> EntryPoint:
    module, function = console_scripts()[script].split(":")
    return _entry_point(getattr(importlib.import_module(module), function))


# --- commands in the docs -----------------------------------------------------------------------------------

COMMAND = re.compile(
    r"(?:(?<![\w-])python3?\s+-m\s+(?P<module>[A-Za-z_][\w.]*[\w])"
    r"|(?:(?<=\s)|^|(?<=bin/))(?P<script>oodjax-[a-z]+)(?![\w-]))(?P<rest>.*)"
)
OPTION = re.compile(r"^--[A-Za-z][\w-]*")


@dataclasses.dataclass(frozen=True)
class Command:
    quote: Quote
    program: str  # "python -m MODULE" or the command's name
    entry_point: EntryPoint | None  # None: not one of ours
    words: list[str]  # what follows the program, up to a comment or another command


def commands(doc: Doc, problems: list[str]) -> Iterator[Command]:
    """Every `python -m MODULE ...` and `oodjax-NAME ...` the doc quotes; a module or command that does not
    exist goes to `problems`."""
    for quote in doc.quotes:
        if quote.fence == "python":
            continue
        for match in COMMAND.finditer(quote.text):
            rest = match.group("rest")
            if match.group("module"):
                module = match.group("module")
                program = f"python -m {module}"
                problem = module_problem(module)
                if problem:
                    problems.append(f"{quote.doc}:{quote.line}: `{program}`: {problem}")
                    continue
                entry_point = module_entry_point(module) if is_repo_module(module) else None
            else:
                program = match.group("script")
                if program not in console_scripts():
                    problems.append(
                        f"{quote.doc}:{quote.line}: `{program}` is not a command of pyproject.toml "
                        f"(its commands: {', '.join(console_scripts())})"
                    )
                    continue
                entry_point = script_entry_point(program)
            if rest.startswith(":"):  # an error line it printed, not a command
                yield Command(quote, program, entry_point, [])
                continue
            rest = re.split(r"\s(?:#|\|\s|&&|;|&\s*$)|\s&(?:\s|$)|\s+python3?\s+-m\s|\soodjax-[a-z]+", rest)[0]
            yield Command(quote, program, entry_point, shell_words(rest))


def command_problems(command: Command) -> list[str]:
    """The flags given to `command` that its entry point does not take, or values not among a flag's choices."""
    if command.entry_point is None:
        return []
    where = f"{command.quote.doc}:{command.quote.line}: `{command.program}`"
    problems = []
    words = [word.strip("[]") for word in command.words]
    for index, word in enumerate(words):
        option = OPTION.match(word)
        if option is None or word == "--":
            continue
        name = option.group(0)
        if re.match(r"--(?:no)?config\.", word):
            if not command.entry_point.takes_config:
                problems.append(f"{where} takes no --config overrides: {word}")
            elif problem := override_problem(word):
                problems.append(f"{where}: {word}: {problem}")
            continue
        flag = command.entry_point.flags.get(name)
        if flag is None:
            known = ", ".join(sorted(command.entry_point.flags))
            problems.append(f"{where} has no flag {name} (its flags: {known})")
            continue
        if flag.choices:
            value = word.split("=", 1)[1] if "=" in word else (words[index + 1] if index + 1 < len(words) else "")
            for choice in value.split("|"):
                if choice and not is_placeholder(choice) and not choice.startswith("-") and choice not in flag.choices:
                    problems.append(f"{where} {name}: {choice!r} is not one of {list(flag.choices)}")
    return problems


@functools.cache
def launch_script_text() -> str:
    """The launch scripts, CI's cluster script and the Makefile: their own flags (sbatch's, srun's, the
    cluster's) are documented from them."""
    scripts = [*ROOT.glob("launch/*.sh"), *ROOT.glob("launch/*.sbatch"), *ROOT.glob(".ci/*.sh"), ROOT / "Makefile"]
    return "\n".join(path.read_text() for path in scripts)


def all_entry_points(docs: list[Doc]) -> dict[str, EntryPoint]:
    """Every entry point of this repository the docs run, and every command of pyproject.toml."""
    found = {script: script_entry_point(script) for script in console_scripts()}
    for doc in docs:
        for command in commands(doc, []):
            if command.entry_point is not None:
                found[command.program] = command.entry_point
    return found


# --- the checks: each returns its problems, "doc:line: what is wrong" -----------------------------------------

FILE_SUFFIXES = {
    "py",
    "md",
    "json",
    "jsonl",
    "toml",
    "yaml",
    "csv",
    "sh",
    "sbatch",
    "txt",
    "safetensors",
    "bin",
    "npz",
    "parquet",
    "tex",
    "pdf",
    "png",
    "ipynb",
    "msgpack",
    "h5",
}
# Paths in the docs' form that are not files of this repository (shell patterns).
NOT_REPOSITORY_PATHS = {
    "benchmarks/results-*": "what `python -m benchmarks` writes (--out, --device gpu)",
    "configs/*.toml": "DL2024's configs (docs/protocol.md)",
}
# Spans that read as `section.field` but name something else.
NOT_CONFIG_FIELDS = {"model.model.layers.self_attn.q_proj.kernel": "a parameter's path in a loaded model"}
# Fields the docs say are gone or do not exist: they must stay out of configs/base.py, or the docs are wrong.
ABSENT_FIELDS = {"runs.chunk"}


def config_field_problems(docs: list[Doc]) -> list[str]:
    """Config fields the docs name, and values they give them, that configs/base.py and the command line refuse."""
    sections = "|".join(config_sections())
    not_after = r"(?<![\w.$/\[(-])"  # not a module's attribute, a path, a TOML table or a call's argument
    field = re.compile(rf"{not_after}(?P<path>(?:{sections})\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![\w(/-])")
    top_level = re.compile(rf"{not_after}config\.(?P<path>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![\w(])")
    problems = []
    for doc in docs:
        for quote in doc.quotes:
            where = f"{quote.doc}:{quote.line}"
            for word in shell_words(quote.text):
                if re.match(r"--(?:no)?config\.", word) and (problem := override_problem(word)):
                    problems.append(f"{where}: {word}: {problem}")
            text = re.sub(r"--(?:no)?config\.\S*", " ", quote.text)  # checked above, value included
            for match in itertools.chain(field.finditer(text), top_level.finditer(text)):
                path = match.group("path")
                if path.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                    continue  # a file: model.safetensors, config.json
                exists = config_value(path)[0]
                if path in ABSENT_FIELDS and exists:
                    problems.append(
                        f"{where}: `{match.group(0)}` is a field of configs/base.py, which the doc says is not"
                    )
                elif not exists and path not in ABSENT_FIELDS and path not in NOT_CONFIG_FIELDS:
                    problems.append(f"{where}: `{match.group(0)}` is not a field of configs/base.py")
            assignment = re.fullmatch(r"(?P<path>[\w.]+)=(?P<value>.+)", quote.text)
            if assignment and quote.fence is None and config_value(assignment.group("path"))[0]:
                if problem := override_problem(f"--config.{quote.text}"):
                    problems.append(f"{where}: `{quote.text}`: {problem}")
    return problems


NAME = r"`(?P<name>[^`\s=]+)`"
VALUE = r"`(?P<value>[^`]+)`"
DEFAULT_CLAIMS = (  # the ways a doc states a default (the module's docstring)
    re.compile(rf"{NAME}\s*(?:\(|,)\s*(?:the\s+)?default:?\s+{VALUE}"),  # `field` (default `value`)
    re.compile(rf"{NAME}\s*\({VALUE},\s+the\s+default\b"),  # `field` (`value`, the default
    re.compile(r"`(?P<name>[^`=\s]+)=(?P<value>[^`]+)`\s*\((?:the\s+)?default\)"),  # `field=value` (default)
    re.compile(rf"{NAME}\s*\((?:the\s+)?default\)"),  # `boolean_field` (the default): True
)


def default_problems(docs: list[Doc]) -> list[str]:
    """Defaults the docs state, against configs/base.py and the entry points' flags."""
    flag_defaults = collections.defaultdict(list)  # --flag -> [(program, default)]
    for program, entry_point in all_entry_points(docs).items():
        for name, flag in entry_point.flags.items():
            flag_defaults[name].append((program, flag.default))
    problems = []
    for doc in docs:
        for pattern in DEFAULT_CLAIMS:
            for match in pattern.finditer(doc.prose):
                name = match.group("name").removeprefix("--config.")
                written = match.groupdict().get("value") or "True"
                claim = f"{doc.name}:{doc.line_of(match.start())}: {' '.join(match.group(0).split())!r}"
                if name.startswith("--"):
                    wrong = [
                        (program, default)
                        for program, default in flag_defaults.get(name, [])
                        if not same_value(written, default)
                    ]
                    problems += [f"{claim}: {program} {name} defaults to {default!r}" for program, default in wrong[:1]]
                    continue
                exists, default = config_value(name)
                if exists and not same_value(written, default):
                    problems.append(f"{claim}: configs/base.py's {name} is {default!r}")
    return problems


def protocol_default_problems(doc: Doc) -> list[str]:
    """docs/protocol.md's "oodjax default" column: each `field=value` is the value in every study config."""
    study = {path: load_config(path) for path in experiment_config_paths(["configs/*_[ms]nli.py"])}
    problems, column = [], None
    for number, line in enumerate(doc.prose.splitlines(), start=1):
        if not line.startswith("|"):
            column = None
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if column is None:
            column = next((i for i, cell in enumerate(cells) if cell.startswith("oodjax default")), -1)
            continue
        if column < 0 or column >= len(cells):
            continue
        spans = tuple(Quote(doc.name, number, span.group(2), None) for span in SPAN.finditer(cells[column]))
        for command in commands(dataclasses.replace(doc, quotes=spans), problems):
            words = [word.strip("[]") for word in command.words]
            for name, value in zip(words, words[1:] + [""]):
                flag = command.entry_point.flags.get(name) if command.entry_point else None
                if flag is not None and flag.takes_value and not same_value(value, flag.default):
                    problems.append(
                        f"{doc.name}:{number}: `{command.quote.text}` as the default: {command.program} "
                        f"{name} defaults to {flag.default!r}"
                    )
        for match in re.finditer(r"`(?P<path>[\w.]+)=(?P<value>[^`]+)`", cells[column]):
            path, written = match.group("path"), match.group("value")
            if not config_value(path)[0]:
                continue  # reported by the field check
            for config_path, config in study.items():
                actual = functools.reduce(lambda node, key: node[key], path.split("."), config)
                if not same_value(written, actual):
                    problems.append(f"{doc.name}:{number}: `{match.group(0)[1:-1]}`: {config_path} has {actual!r}")
                    break
    return problems


def command_line_problems(docs: list[Doc]) -> list[str]:
    """Modules and commands that do not exist, flags their entry points do not take, and `--flag`s quoted on
    their own that no entry point, launch script or listed tool takes."""
    problems: list[str] = []
    for doc in docs:
        for command in commands(doc, problems):
            problems += command_problems(command)
    known = {name for entry_point in all_entry_points(docs).values() for name in entry_point.flags}
    for doc in docs:
        for quote in doc.quotes:
            first_word = quote.text.split()[0] if quote.text.split() else ""
            if COMMAND.search(quote.text) or quote.fence == "python" or first_word in OTHER_TOOLS:
                continue
            for word in shell_words(quote.text):
                option = OPTION.match(word.strip("[]"))
                if option is None or re.match(r"--(?:no)?config\.", word):
                    continue
                name = option.group(0)
                in_scripts = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", launch_script_text())
                if name not in known and name not in OTHER_TOOLS_FLAGS and not in_scripts:
                    problems.append(
                        f"{quote.doc}:{quote.line}: {name} is a flag of no entry point, launch script "
                        "or listed tool (OTHER_TOOLS_FLAGS in tests/test_docs.py)"
                    )
    return problems


def make_targets() -> set[str]:
    """The Makefile's targets, read from its rules (`name:`, not `NAME :=`)."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set()
    for match in re.finditer(r"^(?P<targets>[\w.-]+(?:[ \t]+[\w.-]+)*)[ \t]*:(?!=)", makefile, re.MULTILINE):
        targets.update(match.group("targets").split())
    return targets


def make_problems(docs: list[Doc]) -> list[str]:
    """`make TARGET` commands whose target the Makefile does not have."""
    targets = make_targets()
    return [
        f"{quote.doc}:{quote.line}: `make {match.group(1)}`: the Makefile has no target {match.group(1)} "
        f"(its targets: {', '.join(sorted(targets))})"
        for doc in docs
        for quote in doc.quotes
        for match in re.finditer(r"(?<![\w$(-])make\s+([a-z][\w-]*)(?![\w=])", quote.text)
        if match.group(1) not in targets
    ]


def expand_braces(pattern: str) -> list[str]:
    """`a{b,c}d` -> [abd, acd]; a brace of one word is a placeholder (`{model}`), any name."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    options = match.group(1).split(",") if "," in match.group(1) else ["*"]
    return [
        expanded
        for option in options
        for expanded in expand_braces(pattern[: match.start()] + option + pattern[match.end() :])
    ]


def path_problems(docs: list[Doc]) -> list[str]:
    """Repository paths the docs quote; in a Python example a path names a file the user writes, so those are
    left out."""
    prefix = "|".join(re.escape(prefix) for prefix in PATH_PREFIXES)
    path = re.compile(rf"(?<![\w./$-])(?:{prefix})(?:\{{[^{{}}\s]*\}}|[^\s`'\",;:()])*")
    problems = []
    for doc in docs:
        for quote in doc.quotes:
            if quote.fence in ("python", "yaml"):
                continue
            found = [match.group(0).rstrip(".") for match in path.finditer(quote.text)]
            found += [match.group(1) for match in ROOT_FILES.finditer(quote.text)]
            for written in found:
                if any(glob.glob(pattern, root_dir=ROOT) for pattern in expand_braces(written)):
                    continue
                placeholder = any(is_placeholder(part.split(".")[0]) for part in written.split("/"))
                elsewhere = any(fnmatch.fnmatchcase(written, pattern) for pattern in NOT_REPOSITORY_PATHS)
                if not placeholder and not elsewhere:
                    problems.append(f"{quote.doc}:{quote.line}: {written}: no such file in the repository")
    return problems


def heading_anchors(doc: pathlib.Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them (lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered)."""
    anchors, counts = set(), collections.Counter()
    for heading in re.findall(r"^#+\s+(.+?)\s*#*$", read_doc(doc).prose, re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        anchors.add(anchor if not counts[anchor] else f"{anchor}-{counts[anchor]}")
        counts[anchor] += 1
    return anchors


def link_problems(docs: list[Doc]) -> list[str]:
    """Links to a file that does not exist, or to an anchor that is none of its headings'."""
    problems = []
    for doc in docs:
        for match in re.finditer(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)", doc.prose):
            target = match.group("target")
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (doc.path.parent / file).resolve() if file else doc.path
            where = f"{doc.name}:{doc.line_of(match.start())}: link {target}"
            if not linked.exists():
                problems.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                problems.append(f"{where}: {linked.name} has no heading with that anchor")
    return problems


@functools.cache
def code_text() -> str:
    """The code that reads environment variables: the packages, the launch scripts and the Makefile."""
    return "\n".join(path.read_text() for pattern in CODE_FILES for path in ROOT.glob(pattern) if path.is_file())


def environment_variable_problems(docs: list[Doc]) -> list[str]:
    """Environment variables the docs name that no code names (a renamed or removed variable): every `OODJAX_*`
    name, and every variable a quoted command sets (`NAME=value`) or reads (`$NAME`) but ``OTHER_VARIABLES``."""
    code = code_text()
    problems = []
    for doc in docs:
        named = {
            (doc.line_of(match.start()), match.group(0))
            for match in re.finditer(r"(?<![\w$])OODJAX_[A-Z0-9_]*[A-Z0-9]", doc.prose)
        }
        for quote in doc.quotes:
            sets_or_reads = r"(?<![\w$./-])([A-Z][A-Z0-9_]*[A-Z0-9])=|\$\{?([A-Z][A-Z0-9_]*[A-Z0-9])"
            named |= {
                (quote.line, match.group(1) or match.group(2)) for match in re.finditer(sets_or_reads, quote.text)
            }
        problems += [
            f"{doc.name}:{line}: {name} is named nowhere in the code"
            for line, name in sorted(named)
            if name not in OTHER_VARIABLES and re.search(rf"\b{name}\b", code) is None
        ]
    return problems


# Variables the docs set that other programs read.
OTHER_VARIABLES = {"USER": "the shell's", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "JAX's", "GLIBC_TUNABLES": "glibc's"}


@functools.cache
def repo_modules() -> dict[str, list[str]]:
    """The last name of each module of this repository's packages -> the modules' dotted names."""
    index = collections.defaultdict(list)
    for package in REPO_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            index[parts[-1]].append(".".join(parts))
    return index


_UNRESOLVED = object()


def resolve(name: str) -> tuple[Any, str]:
    """(the object `name` names, "") or (_UNRESOLVED, why): `oodjax.data.load_testset`, a name under a module's last
    name (`sharding.make_mesh`), or a bare name that one of ``BARE_NAME_MODULES`` exports (`load_pretrained`)."""
    first, *rest = name.split(".")
    if first in REPO_PACKAGES:
        candidates = [name]
    elif first in repo_modules():
        candidates = [".".join([module, *rest]) for module in repo_modules()[first]]
    else:
        candidates = [f"{module}.{name}" for module in BARE_NAME_MODULES]
    why = f"no module of {', '.join(REPO_PACKAGES)} has it"
    for candidate in candidates:
        parts = candidate.split(".")
        for split in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(parts[:split]))
            except ModuleNotFoundError:
                continue
            try:
                return functools.reduce(getattr, parts[split:], target), ""
            except AttributeError:
                why = f"{'.'.join(parts[:split])} has no {'.'.join(parts[split:])}"
            break
    return _UNRESOLVED, why


BARE_NAME_MODULES = ("oodjax.models", "oodjax.data", "analysis")  # the public API DESIGN.md names
DOTTED_NAME = re.compile(r"(?<![\w./$@:<-])(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-])")


def call_problems(text: str) -> list[str]:
    """A span that is a call of one of our functions: its keywords must be parameters; in a signature excerpt,
    `f(..., name=value)`, each value must be the parameter's default."""
    try:
        call = ast.parse(text, mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(call, ast.Call):
        return []
    function, _ = resolve(ast.unparse(call.func))
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # _UNRESOLVED, or no signature
        return []
    excerpt = bool(call.args) and isinstance(call.args[0], ast.Constant) and call.args[0].value is Ellipsis
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    problems = []
    for keyword in call.keywords:
        if keyword.arg is None or (keyword.arg not in parameters and takes_any):
            continue
        if keyword.arg not in parameters:
            problems.append(f"{ast.unparse(call.func)} has no parameter {keyword.arg}")
            continue
        if not excerpt:
            continue
        try:
            written = ast.literal_eval(keyword.value)
        except ValueError:
            constants = getattr(function, "__globals__", {})  # a name the function's module defines: TESTSETS
            written = constants.get(ast.unparse(keyword.value), Ellipsis)
        default = parameters[keyword.arg].default
        if written is not Ellipsis and not (written is default or same_value(repr(written), default)):
            problems.append(f"{ast.unparse(call.func)}'s {keyword.arg} defaults to {default!r}")
    return problems


def python_name_problems(docs: list[Doc]) -> list[str]:
    """Dotted names of this repository's code resolve (`oodjax.data.load_testset`, `sharding.make_mesh`), and the
    calls quoted name their parameters and defaults as the code does."""
    not_modules = {*config_sections(), "config"}  # `data.answers`, `lora.rank`: config fields
    problems = []
    for doc in docs:
        for quote in doc.quotes:
            if quote.fence is not None:
                continue
            for match in DOTTED_NAME.finditer(quote.text):
                name = match.group("name")
                first, last = name.split(".")[0], name.rsplit(".", 1)[-1]
                if first in not_modules or last in FILE_SUFFIXES:
                    continue
                if first in REPO_PACKAGES or first in repo_modules():
                    target, why = resolve(name)
                    if target is _UNRESOLVED:
                        problems.append(f"{quote.doc}:{quote.line}: `{name}`: {why}")
            where = f"{quote.doc}:{quote.line}: `{quote.text}`"
            problems += [f"{where}: {problem}" for problem in call_problems(quote.text)]
    return problems


def command_table_problems(doc: Doc) -> list[str]:
    """docs/install.md's rows `oodjax-NAME ...` | `python -m MODULE`: the two must parse the same flags, and
    every command of pyproject.toml has a row."""
    problems, listed = [], set()
    for number, line in enumerate(doc.prose.splitlines(), start=1):
        row = re.match(r"\|\s*`(?P<script>oodjax-[a-z]+)[^`]*`\s*\|\s*`python -m (?P<module>[\w.]+)`\s*\|", line)
        if row is None:
            continue
        script, module = row.group("script"), row.group("module")
        listed.add(script)
        if script not in console_scripts() or module_problem(module):
            continue  # reported by the command check
        if script_entry_point(script).flags.keys() != module_entry_point(module).flags.keys():
            problems.append(
                f"{doc.name}:{number}: {script} ({console_scripts()[script]}) is not "
                f"`python -m {module}`: they take different flags"
            )
    problems += [
        f"{doc.name}: {script} is missing from the table of commands"
        for script in console_scripts()
        if script not in listed
    ]
    return problems


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return project_docs()


def test_config_fields_exist_and_values_parse(docs):
    problems = config_field_problems(docs)
    assert not problems, "\n".join(problems)


def test_stated_defaults_are_the_code_defaults(docs):
    problems = default_problems(docs) + protocol_default_problems(read_doc(ROOT / "docs" / "protocol.md"))
    assert not problems, "\n".join(problems)


def test_commands_modules_and_flags_exist(docs):
    problems = command_line_problems(docs) + command_table_problems(read_doc(ROOT / "docs" / "install.md"))
    assert not problems, "\n".join(problems)


def test_make_targets_paths_and_links_exist(docs):
    problems = make_problems(docs) + path_problems(docs) + link_problems(docs)
    assert not problems, "\n".join(problems)


def test_environment_variables_and_python_names_exist(docs):
    problems = environment_variable_problems(docs) + python_name_problems(docs)
    assert not problems, "\n".join(problems)


README_MAX_LINES = 250  # a front page (issue 43): what a first-time user needs; the rest lives in docs/


def test_the_readme_is_a_front_page_that_links_every_doc():
    readme = read_doc(ROOT / "README.md")
    lines = len(readme.path.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move the details to the docs/ page of their subject"
    )
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)(?:#[^)]*)?\)", readme.prose))
    unlisted = sorted(path.name for path in (ROOT / "docs").glob("*.md") if path.name not in linked)
    assert not unlisted, f"docs/ pages the README does not link: {unlisted}"


WRONG_DOC = """\
# Wrong claims

Set `train.stepz`, `config.outputdir`, or `--config.train.steps=many`; `lora.rank` (default `-1`);
`train.steps` (`-1`, the default; `--residualiser` (default `nothing`); `runs.chunk` is gone.
`train.steps=-1` (default); `wandb.enabled` (the default).

```bash
python -m oodjax.trainer --config configs/demo.py
python -m launch.sweep --configs 'configs/*_[ms]nli.py' --backend slurmm --bogus
python -m analysis results/ --out paper/ --config.train.steps=1
oodjax-trainer --config configs/demo.py
make testt
```

`--no_such_flag` alone, `configs/no_such.py`, [a heading](#nowhere), [a file](no_such.md), `OODJAX_NO_SUCH`,
`oodjax.data.no_such_function`, `sharding.no_such_function`, `load_testset(..., neutral="not_entailment")`.
`NO_SUCH_VARIABLE=1 python -m oodjax.main --config configs/demo.py`, `ls $OODJAX_NO_SUCH_EITHER`.

| choice | oodjax default (field) |
|---|---|
| learning rate | `train.learning_rate=-1.0` |
| residualiser | `python -m analysis --residualiser nothing` |

| command | same as |
|---|---|
| `oodjax-fetch CONFIG` | `python -m launch.sweep` |
"""


def test_each_check_reports_a_wrong_claim(tmp_path):
    """The checks above pass on the docs; here each is shown a doc that breaks it, and must name the claim."""
    path = tmp_path / "wrong.md"
    path.write_text(WRONG_DOC)
    doc = read_doc(path)
    problems = "\n".join(
        config_field_problems([doc])
        + default_problems([doc])
        + protocol_default_problems(doc)
        + command_line_problems([doc])
        + command_table_problems(doc)
        + make_problems([doc])
        + path_problems([doc])
        + link_problems([doc])
        + environment_variable_problems([doc])
        + python_name_problems([doc])
    )
    expected = [
        "wrong.md:3: `train.stepz` is not a field",
        "wrong.md:3: `config.outputdir` is not a field",
        "wrong.md:3: --config.train.steps=many: train.steps takes an integer",
        "wrong.md:3: '`lora.rank` (default `-1`': configs/base.py's lora.rank is ",
        "wrong.md:4: '`train.steps` (`-1`, the default': configs/base.py's train.steps is ",
        "wrong.md:4: '`--residualiser` (default `nothing`': ",
        "wrong.md:5: '`train.steps=-1` (default)': configs/base.py's train.steps is ",
        "wrong.md:5: '`wandb.enabled` (the default)': configs/base.py's wandb.enabled is False",
        "wrong.md:8: `python -m oodjax.trainer`: no module oodjax.trainer",
        "wrong.md:9: `python -m launch.sweep` --backend: 'slurmm' is not one of",
        "wrong.md:9: `python -m launch.sweep` has no flag --bogus",
        "wrong.md:10: `python -m analysis` takes no --config overrides",
        "wrong.md:11: `oodjax-trainer` is not a command of pyproject.toml",
        "wrong.md:12: `make testt`: the Makefile has no target testt",
        "wrong.md:15: --no_such_flag is a flag of no entry point",
        "wrong.md:15: configs/no_such.py: no such file",
        "wrong.md:15: link #nowhere: wrong.md has no heading with that anchor",
        "wrong.md:15: link no_such.md: no such file",
        "wrong.md:15: OODJAX_NO_SUCH is named nowhere",
        "wrong.md:17: NO_SUCH_VARIABLE is named nowhere",
        "wrong.md:17: OODJAX_NO_SUCH_EITHER is named nowhere",
        "wrong.md:16: `oodjax.data.no_such_function`: oodjax.data has no no_such_function",
        "wrong.md:16: `sharding.no_such_function`: oodjax.engine.sharding has no no_such_function",
        "wrong.md:16: `load_testset(..., neutral=\"not_entailment\")`: load_testset's neutral defaults to 'drop'",
        "wrong.md:21: `train.learning_rate=-1.0`: configs/",
        "wrong.md:22: `python -m analysis --residualiser nothing` as the default: python -m analysis --residualiser "
        "defaults to ",
        "wrong.md:26: oodjax-fetch (launch.fetch:main) is not `python -m launch.sweep`",
        "wrong.md: oodjax-train is missing from the table of commands",
    ]
    missing = [claim for claim in expected if claim not in problems]
    assert not missing, f"not reported: {missing}\nreported:\n{problems}"
