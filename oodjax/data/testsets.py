"""NLI testsets: where they live and how their labels map to binary NLI (``testset_rows`` reads them).

`TESTSETS` is the one place a built-in testset's hub id, config, split,
columns and label ids are written; a config may declare more, or override a
built-in, and `testset_table` applies the declarations (docs/data.md).

Labels become 0 = entailment (" Yes") and 1 = not entailment (" No"). A
three-way set's neutral class is dropped by default (the study's protocol)
or mapped to 1 on request; SciTail's "neutral" is its only negative class,
so it is an ordinary not-entailment label there. Rows without a gold label
are always dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import itertools
import json
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any, Literal, get_args

import datasets
import huggingface_hub
import yaml

from oodjax.usage_errors import NotFetchedError

ENTAILMENT, NOT_ENTAILMENT = 0, 1
_BINARY = (("entailment", ENTAILMENT), ("not_entailment", NOT_ENTAILMENT))  # a declaration's field of each label
DATA_DIR_ENV = "OODJAX_DATA_DIR"
LOCAL_FORMATS = ("jsonl", "parquet")  # of the local mirror of the hub
SOURCE_FILE_FORMATS = ("jsonl", "parquet", "csv")  # of a declared testset's own file
# A hub id ("owner/name" or "name"), as the hub accepts them.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# Testset names become results keys (`margin/<name>`), event tags and items of
# comma-separated lists on the command line: no slashes, commas or spaces.
TESTSET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# The fields of a testset declaration, and those a new (not built-in) testset must have.
_STRING_FIELDS = ("source", "config", "split", "premise", "hypothesis", "label")
_LABEL_FIELDS = ("entailment", "not_entailment", "neutral", "unlabelled")
DECLARATION_FIELDS = (*_STRING_FIELDS, *_LABEL_FIELDS, "cap")
REQUIRED_FIELDS = ("source", "premise", "hypothesis", "label", "entailment", "not_entailment")
Neutral = Literal["drop", "not_entailment"]  # what to do with a three-way set's neutral class (``load_testset``)


@dataclasses.dataclass(frozen=True)
class TestsetSpec:
    """One testset: where it is, its columns and label values.

    `source` is a hub id or a local file (then the whole testset, `split`
    its name). `split_groups` names splits that concatenate several source
    splits (ANLI's rounds). `hub_rows` are the rows of the hub's splits, so
    that a local sample is known as one and the estimate counts the split a
    job reads. `origin` says where a testset was declared ("" for built-ins).
    """

    __test__ = False  # a dataclass named Test* is not a pytest test class

    source: str
    config: str
    split: str
    premise: str
    hypothesis: str
    labels: Mapping[int | str, int]
    neutral: tuple[int | str, ...] = ()
    unlabelled: tuple[int | str, ...] = ()
    split_groups: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    pool_split: str | None = None
    hub_data_files: str | None = None
    label: str = "label"
    cap: int | None = None
    hub_rows: Mapping[str, int] = dataclasses.field(default_factory=dict)
    origin: str = ""

    @property
    def is_local_file(self) -> bool:
        return is_source_file(self.source)

    def eval_cap(self, default: int) -> int:
        """The cap of this testset's evaluation subset: its own `cap` if declared, else `default` (0 = none)."""
        return default if self.cap is None else self.cap


# The label ids of SNLI, MNLI and ANLI: entailment, neutral, contradiction; -1 where no gold label was agreed.
_THREE_WAY: dict[str, Any] = dict(labels={0: ENTAILMENT, 2: NOT_ENTAILMENT}, neutral=(1,), unlabelled=(-1,))
# Each built-in: (source, config, split, premise column, hypothesis column), then its labels and sizes.
TESTSETS: Mapping[str, TestsetSpec] = {
    "snli": TestsetSpec(
        *("stanfordnlp/snli", "plain_text", "test", "premise", "hypothesis"),
        **_THREE_WAY,
        pool_split="validation",
        hub_rows={"test": 10_000, "validation": 10_000},
    ),
    "mnli": TestsetSpec(
        *("nyu-mll/glue", "mnli", "validation_matched", "premise", "hypothesis"),
        **_THREE_WAY,
        pool_split="validation_mismatched",
        hub_rows={"validation_matched": 9_815, "validation_mismatched": 9_832},
    ),
    "scitail": TestsetSpec(
        *("allenai/scitail", "tsv_format", "test", "premise", "hypothesis"),
        labels={"entails": ENTAILMENT, "neutral": NOT_ENTAILMENT},
        hub_rows={"test": 2_126},
    ),
    "rte": TestsetSpec(
        *("nyu-mll/glue", "rte", "train", "sentence1", "sentence2"),
        labels={0: ENTAILMENT, 1: NOT_ENTAILMENT},
        unlabelled=(-1,),
        hub_rows={"train": 2_490, "validation": 277},
    ),
    "wnli": TestsetSpec(
        *("nyu-mll/glue", "wnli", "train", "sentence1", "sentence2"),
        labels={1: ENTAILMENT, 0: NOT_ENTAILMENT},
        unlabelled=(-1,),
        hub_rows={"train": 635, "validation": 71},
    ),
    "paws": TestsetSpec(
        *("google-research-datasets/paws", "labeled_final", "test", "sentence1", "sentence2"),
        labels={1: ENTAILMENT, 0: NOT_ENTAILMENT},
        hub_rows={"test": 8_000},
    ),
    "hans": TestsetSpec(
        *("jhu-cogsci/hans", "plain_text", "validation", "premise", "hypothesis"),
        labels={0: ENTAILMENT, 1: NOT_ENTAILMENT},
        # The hub repo only has a loading script, which current `datasets` refuses
        # to run; the hub's own parquet export of it holds the same rows.
        hub_data_files="hf://datasets/jhu-cogsci/hans@refs%2Fconvert%2Fparquet/plain_text/{split}/*.parquet",
        hub_rows={"validation": 30_000},
    ),
    "anli": TestsetSpec(
        *("facebook/anli", "plain_text", "test_r3", "premise", "hypothesis"),
        **_THREE_WAY,
        split_groups={"test_all": ("test_r1", "test_r2", "test_r3")},
        hub_rows={"test_r1": 1_000, "test_r2": 1_000, "test_r3": 1_200},
    ),
}


def is_source_file(source: str) -> bool:
    """Whether a declared `source` names a local file (by its extension) rather than a hub id."""
    return source.lower().endswith(tuple(f".{fmt}" for fmt in SOURCE_FILE_FORMATS))


def testset_table(
    declared: Mapping[str, Mapping[str, Any]] | None = None, declared_file: str | os.PathLike[str] | None = None
) -> dict[str, TestsetSpec]:
    """The built-in table with the declared testsets added or overriding built-ins (docs/data.md).

    `declared_file` is a JSON or YAML file of declarations, its relative
    sources relative to its folder. An override of a built-in names only the
    fields it changes; one that gives a `source` takes none of the
    built-in's location. Errors are ValueErrors naming the declaration and
    the field.
    """
    origin = "data.extra_testsets"
    declarations: list[tuple[str, Mapping[str, Any], str, pathlib.Path | None]] = [
        (name, fields, f"{origin}[{name!r}]", None) for name, fields in (declared or {}).items()
    ]
    if declared_file is not None:
        path = pathlib.Path(declared_file).expanduser()
        in_file = read_declarations(path)
        twice = sorted(set(in_file) & set(declared or {}))
        if twice:
            raise ValueError(f"testsets {twice} are declared both in {origin} and in {path}; declare each once")
        declarations += [(name, fields, f"testset {name!r} in {path}", path.parent) for name, fields in in_file.items()]
    table = dict(TESTSETS)
    for name, fields, where, base_dir in declarations:
        table[name] = declared_testset(name, fields, where=where, base_dir=base_dir)
    return table


def declared_testset(
    name: str, fields: Mapping[str, Any], *, where: str, base_dir: pathlib.Path | None = None
) -> TestsetSpec:
    """The spec of one declaration; `where` names it in errors."""
    if not isinstance(name, str) or not TESTSET_NAME.fullmatch(name):
        raise ValueError(
            f"{where}: {name!r} is not a testset name: letters, digits, '_', '.' and '-', starting with a letter "
            "or digit"
        )
    if not isinstance(fields, Mapping):
        raise ValueError(f"{where}: a declaration is a mapping of fields to values, got {fields!r}")
    unknown = [field for field in fields if field not in DECLARATION_FIELDS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), DECLARATION_FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{where}: unknown field {unknown[0]!r}{hint}; a declaration's fields are {', '.join(DECLARATION_FIELDS)}"
        )
    built_in = TESTSETS.get(name)
    inherited = _declaration_of(built_in) if built_in is not None else {}
    if "source" in fields:  # a new location: none of the built-in's config or split
        inherited = {field: value for field, value in inherited.items() if field not in ("config", "split")}
    merged = inherited | dict(fields)
    missing = [field for field in REQUIRED_FIELDS if merged.get(field) is None]
    if missing:
        raise ValueError(
            f"{where}: missing fields {missing}; a new testset needs {', '.join(REQUIRED_FIELDS)} (and split for a "
            "hub source)"
        )

    def problem(field: str, text: str) -> ValueError:
        return ValueError(f"{where}, field {field!r}: {text}")

    strings = {field: merged.get(field) for field in _STRING_FIELDS}
    for field, value in strings.items():
        if value is not None and not isinstance(value, str):
            raise problem(field, f"must be a string, got {value!r} ({type(value).__name__})")
    source, config, split = _location(strings, set(fields), base_dir, problem)
    columns = {field: strings[field] or "" for field in ("premise", "hypothesis", "label")}
    for field, column in columns.items():
        if not column:
            raise problem(field, "must name a column, got an empty string")
    if len(set(columns.values())) < 3:
        raise problem("label", f"premise, hypothesis and label must be three different columns, got {columns}")
    values = {field: _label_values(merged.get(field), field, problem) for field in _LABEL_FIELDS}
    for field in ("entailment", "not_entailment"):
        if not values[field]:
            raise problem(field, "must list at least one label value")
    _check_label_classes(values, problem)
    cap = merged.get("cap")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
        raise problem("cap", f"must be an integer >= 0 (0 = the full testset), got {cap!r}")
    same_location = built_in is not None and (source, config) == (built_in.source, built_in.config)
    hub_facts = ("split_groups", "hub_data_files", "hub_rows")  # the built-in's, where the location is its own
    return TestsetSpec(
        source,
        config,
        split,
        columns["premise"],
        columns["hypothesis"],
        labels={value: label for name, label in _BINARY for value in values[name]},
        neutral=values["neutral"],
        unlabelled=values["unlabelled"],
        **({field: getattr(built_in, field) for field in hub_facts} if same_location else {}),
        label=columns["label"],
        cap=cap,
        origin=where,
    )


def _location(
    strings: dict[str, str | None], given: set[str], base_dir: pathlib.Path | None, problem: Any
) -> tuple[str, str, str]:
    """(source, config, split) of a declaration; `given` are the fields it sets itself (not inherited)."""
    source = strings["source"]
    assert source is not None  # a required field (declared_testset checked)
    formats = ", ".join("." + fmt for fmt in SOURCE_FILE_FORMATS)
    path = pathlib.Path(source).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if is_source_file(source):
        for field in ("config", "split"):
            if strings[field] is not None and field in given:
                raise problem(field, f"a local file ({source}) is one split already: leave {field!r} out")
        return str(path), "", path.name
    if path.is_file():  # "data/my.tsv" is a valid hub id too
        raise problem("source", f"{source!r} is a local file, but a testset's file must end in {formats}")
    if not HUB_ID.fullmatch(source):
        raise problem("source", f"{source!r} is neither a hub id (owner/name) nor a file ending in {formats}")
    if not strings["split"]:
        raise problem("split", f"a hub source ({source}) needs the split to evaluate, e.g. 'test'")
    return source, strings["config"] or "", strings["split"]


def read_declarations(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The testset declarations in a JSON or YAML file; a key given twice is an error, which both parsers
    would silently resolve to the last."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"testset declarations file {path} does not exist")
    suffix = path.suffix.lower()
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            content = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, path))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {error.lineno} is not valid JSON: {error.msg}") from None
    elif suffix in (".yaml", ".yml"):
        try:
            content = yaml.load(text, Loader=_unique_key_loader(path))
        except yaml.YAMLError as error:
            raise ValueError(f"{path} is not valid YAML: {error}") from None
    else:
        raise ValueError(f"testset declarations file {path} must end in .json, .yaml or .yml")
    if not isinstance(content, dict):
        raise ValueError(f"{path} must hold a mapping of testset names to their fields, got {type(content).__name__}")
    return content


def _unique_keys(pairs: list[tuple[str, Any]], path: pathlib.Path) -> dict[str, Any]:
    twice = sorted(key for key, count in collections.Counter(key for key, _ in pairs).items() if count > 1)
    if twice:
        raise ValueError(f"{path}: {twice} given twice in one object")
    return dict(pairs)


def _unique_key_loader(path: pathlib.Path) -> type[yaml.SafeLoader]:

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise ValueError(f"{path} line {key_node.start_mark.line + 1}: {key!r} given twice in one mapping")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


def _declaration_of(spec: TestsetSpec) -> dict[str, Any]:
    labels = {name: [value for value, binary in spec.labels.items() if binary == label] for name, label in _BINARY}
    return {field: getattr(spec, field) for field in (*_STRING_FIELDS, "neutral", "unlabelled", "cap")} | labels


def _label_values(value: Any, field: str, problem: Any) -> tuple[int | str, ...]:
    """A list of label values, each an integer or a string (a YAML `yes` is a boolean: refused, not class 1)."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise problem(field, f"must be a list of label values, e.g. [{value!r}], got {value!r}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            note = " (YAML reads unquoted yes/no/true/false as booleans: quote it)" if isinstance(item, bool) else ""
            raise problem(field, f"label values are integers or strings; {item!r} is a {type(item).__name__}{note}")
    return tuple(dict.fromkeys(value))


def _check_label_classes(values: dict[str, tuple[int | str, ...]], problem: Any) -> None:
    """Label values of one type (a file's labels are), each in one class only."""
    everything = [value for field in _LABEL_FIELDS for value in values[field]]
    if len({type(value) for value in everything}) > 1:
        raise problem("entailment", f"label values must be all integers or all strings, got {values}")
    for first, second in itertools.combinations(_LABEL_FIELDS, 2):
        shared = [value for value in values[first] if value in values[second]]
        if shared:
            raise problem(second, f"label values {shared} are also in {first!r}; each value is in one class")


def testset_spec(name: str, table: Mapping[str, TestsetSpec] = TESTSETS) -> TestsetSpec:
    """The row for `name` in `table` (default: the built-in one), or an error listing the known testsets."""
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown testset {name!r}; known testsets: {', '.join(table)}") from None


def default_data_dir() -> pathlib.Path | None:
    value = os.environ.get(DATA_DIR_ENV)
    return pathlib.Path(value) if value else None


def hub_offline() -> bool:
    """Whether the hub may not be asked; read now, since huggingface_hub reads HF_HUB_OFFLINE at import only."""
    set_now = any(
        os.environ.get(variable, "").upper() in ("1", "ON", "YES", "TRUE")
        for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )
    return huggingface_hub.constants.HF_HUB_OFFLINE or set_now


def check_neutral(neutral: str) -> None:
    """Raises ValueError unless ``neutral`` is one of ``Neutral``'s values (the config checks ask before loading)."""
    if neutral not in get_args(Neutral):
        raise ValueError(f"neutral must be {' or '.join(map(repr, get_args(Neutral)))}, got {neutral!r}")


def pool_split(name: str, split: str | None = None) -> str:
    """`split` (data.pool_split), else the table's pool split of training set `name`."""
    spec = testset_spec(name)
    if spec.pool_split is None:
        raise ValueError(f"{name} is not a training set; training pools exist for: {', '.join(training_sets())}")
    return split or spec.pool_split


def training_sets() -> list[str]:
    return [name for name, spec in TESTSETS.items() if spec.pool_split]


def hub_source_name(spec: TestsetSpec, split: str) -> str:
    """How errors name a split read from the hub."""
    if spec.hub_data_files is not None:
        return spec.hub_data_files.format(split=split)
    where = f"{spec.source}/{spec.config}" if spec.config else spec.source
    return f"hub {where} split {split!r}"


def hub_split(spec: TestsetSpec, split: str) -> datasets.Dataset:
    """One source split of a hub testset, every column, as the hub publishes it (and ``launch.fetch`` mirrors)."""
    if spec.hub_data_files is None:
        arguments, keywords = (spec.source, *([spec.config] if spec.config else [])), {"split": split}
    else:
        arguments, keywords = ("parquet",), {"data_files": spec.hub_data_files.format(split=split), "split": "train"}
    try:
        return datasets.load_dataset(*arguments, **keywords)
    except ConnectionError as error:  # datasets' word for an unreachable or offline hub
        raise NotFetchedError(
            f"{hub_source_name(spec, split)} is not in a local mirror (data.data_dir, $OODJAX_DATA_DIR) and the hub "
            f"cannot be reached: {error}"
        ) from error


def mirror_folder(spec: TestsetSpec, root: pathlib.Path) -> pathlib.Path:
    """``<root>/<hub_id>/<config>``: where the mirror holds a hub source's splits."""
    return root / spec.source / spec.config if spec.config else root / spec.source


def local_path(spec: TestsetSpec, split: str, root: pathlib.Path) -> pathlib.Path:
    """The mirror's file holding `split` of a hub source, or a FileNotFoundError naming the paths looked for."""
    folder = mirror_folder(spec, root)
    candidates = [folder / f"{split}.{fmt}" for fmt in LOCAL_FORMATS]
    if found := next((path for path in candidates if path.is_file()), None):
        return found
    present = sorted({p.stem for fmt in LOCAL_FORMATS for p in folder.glob(f"*.{fmt}")})
    where = f"{spec.source}/{spec.config}" if spec.config else spec.source
    raise FileNotFoundError(
        f"no local file for {where} split {split!r}: looked for "
        f"{' and '.join(map(str, candidates))}; splits present there: {present or 'none'}"
    )
