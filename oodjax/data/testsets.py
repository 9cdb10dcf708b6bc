"""The eight NLI testsets: where they live and how their labels map to binary NLI.

`TESTSETS` is the single source of truth for every fact about a testset (hub id,
config, default split, column names, label ids). Everything else in oodjax reads
it; nothing else spells out a hub id or a label id.

Labels become 0 = entailment (" Yes") and 1 = not entailment (" No"). Three-way
sets have a neutral class, which is dropped by default (the study's protocol) or
mapped to 1 on request. SciTail's "neutral" is its only negative class, so it
is an ordinary not-entailment label there, not a neutral to drop. Rows without a
gold label (SNLI's -1, hidden test labels) are always dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Literal

import datasets
import numpy as np
import pyarrow
import pyarrow.parquet

ENTAILMENT, NOT_ENTAILMENT = 0, 1
LABEL_FEATURE = datasets.ClassLabel(names=["entailment", "not_entailment"])
FEATURES = datasets.Features(
    {"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"), "label": LABEL_FEATURE}
)
DATA_DIR_ENV = "OODJAX_DATA_DIR"
LOCAL_FORMATS = ("jsonl", "parquet")
Neutral = Literal["drop", "not_entailment"]


@dataclasses.dataclass(frozen=True)
class TestsetSpec:
    """One testset: its hub location, columns and label ids.

    `labels` maps the source's gold label values to ENTAILMENT / NOT_ENTAILMENT;
    `neutral` is the source value of a three-way set's neutral class (None for
    two-way sets); `unlabelled` are values meaning "no gold label".
    `split_groups` names splits that are the concatenation of several source
    splits (ANLI's three rounds). `pool_split` is the split few-shot training
    sets are drawn from, for the two training sets only. `hub_data_files`, when
    set, is read from the hub instead of the repo's own loader (HANS).
    """

    __test__ = False  # a dataclass named Test* is not a pytest test class

    hub_id: str
    config: str
    split: str
    premise: str
    hypothesis: str
    labels: Mapping[int | str, int]
    neutral: int | str | None = None
    unlabelled: tuple[int | str, ...] = ()
    split_groups: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    pool_split: str | None = None
    hub_data_files: str | None = None


TESTSETS: Mapping[str, TestsetSpec] = {
    "snli": TestsetSpec(
        "stanfordnlp/snli", "plain_text", "test", "premise", "hypothesis",
        labels={0: ENTAILMENT, 2: NOT_ENTAILMENT}, neutral=1, unlabelled=(-1,),
        pool_split="validation",
    ),
    "mnli": TestsetSpec(
        "nyu-mll/glue", "mnli", "validation_matched", "premise", "hypothesis",
        labels={0: ENTAILMENT, 2: NOT_ENTAILMENT}, neutral=1, unlabelled=(-1,),
        pool_split="validation_mismatched",
    ),
    "scitail": TestsetSpec(
        "allenai/scitail", "tsv_format", "test", "premise", "hypothesis",
        labels={"entails": ENTAILMENT, "neutral": NOT_ENTAILMENT},
    ),
    "rte": TestsetSpec(
        "nyu-mll/glue", "rte", "train", "sentence1", "sentence2",
        labels={0: ENTAILMENT, 1: NOT_ENTAILMENT}, unlabelled=(-1,),
    ),
    "wnli": TestsetSpec(
        "nyu-mll/glue", "wnli", "train", "sentence1", "sentence2",
        labels={1: ENTAILMENT, 0: NOT_ENTAILMENT}, unlabelled=(-1,),
    ),
    "paws": TestsetSpec(
        "google-research-datasets/paws", "labeled_final", "test", "sentence1", "sentence2",
        labels={1: ENTAILMENT, 0: NOT_ENTAILMENT},
    ),
    "hans": TestsetSpec(
        "jhu-cogsci/hans", "plain_text", "validation", "premise", "hypothesis",
        labels={0: ENTAILMENT, 1: NOT_ENTAILMENT},
        # The hub repo only has a loading script, which current `datasets` refuses
        # to run; the hub's own parquet export of it holds the same rows.
        hub_data_files="hf://datasets/jhu-cogsci/hans@refs%2Fconvert%2Fparquet/plain_text/{split}/*.parquet",
    ),
    "anli": TestsetSpec(
        "facebook/anli", "plain_text", "test_r3", "premise", "hypothesis",
        labels={0: ENTAILMENT, 2: NOT_ENTAILMENT}, neutral=1, unlabelled=(-1,),
        split_groups={"test_all": ("test_r1", "test_r2", "test_r3")},
    ),
}


def testset_spec(name: str) -> TestsetSpec:
    """The table row for `name`, or an error listing the known testsets."""
    try:
        return TESTSETS[name]
    except KeyError:
        raise KeyError(f"unknown testset {name!r}; known testsets: {', '.join(TESTSETS)}") from None


def default_data_dir() -> pathlib.Path | None:
    """The local mirror named by OODJAX_DATA_DIR, or None to use the hub."""
    value = os.environ.get(DATA_DIR_ENV)
    return pathlib.Path(value) if value else None


def load_testset(
    name: str,
    *,
    split: str | None = None,
    data_dir: str | os.PathLike | None = None,
    neutral: Neutral = "drop",
) -> datasets.Dataset:
    """Load a testset as binary NLI: columns premise, hypothesis, label (0 = entailment).

    `split` defaults to the table's evaluation split; a split group (ANLI's
    "test_all") concatenates its splits in order. `data_dir` is a local root
    laid out as `<hub_id>/<config>/<split>.jsonl|parquet`; it defaults to
    $OODJAX_DATA_DIR, and without either the Hugging Face hub is used. Row order
    follows the source, so row i is the same example on every machine.

    Every row is checked as it is read: an empty file, a line that is not a
    JSON object (a truncated file), a missing or null column, or a value of
    the wrong type is an error naming the file, the line (or row) and the
    column. The returned Dataset's `info.dataset_name` and `split` name the
    testset, for later errors about its examples.
    """
    spec = testset_spec(name)
    if neutral not in ("drop", "not_entailment"):
        raise ValueError(f"neutral must be 'drop' or 'not_entailment', got {neutral!r}")
    split = split or spec.split
    root = pathlib.Path(data_dir) if data_dir is not None else default_data_dir()
    parts = [
        _to_binary(spec, _load_raw(spec, part, root), neutral, name, part)
        for part in spec.split_groups.get(split, (split,))
    ]
    table = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts, split=split)
    if len(table) == 0:
        raise ValueError(f"{name} split {split!r} has no rows with a gold label (hidden test labels?)")
    return table


def training_pool(
    name: str,
    *,
    split: str | None = None,
    data_dir: str | os.PathLike | None = None,
) -> datasets.Dataset:
    """The pool few-shot training sets of `name` are drawn from.

    Defaults to the table's `pool_split` (MNLI validation_mismatched, SNLI
    validation): available offline and disjoint from the evaluation splits. Pass
    split="train" to draw from the hub's full training split instead.
    """
    spec = testset_spec(name)
    if spec.pool_split is None:
        pools = [n for n, s in TESTSETS.items() if s.pool_split]
        raise ValueError(f"{name} is not a training set; training pools exist for: {', '.join(pools)}")
    return load_testset(name, split=split or spec.pool_split, data_dir=data_dir)


def local_path(spec: TestsetSpec, split: str, root: pathlib.Path) -> pathlib.Path:
    """The local file holding `split`, or an error naming the paths looked for."""
    folder = root / spec.hub_id / spec.config
    candidates = [folder / f"{split}.{fmt}" for fmt in LOCAL_FORMATS]
    for path in candidates:
        if path.is_file():
            return path
    present = sorted({p.stem for fmt in LOCAL_FORMATS for p in folder.glob(f"*.{fmt}")})
    raise FileNotFoundError(
        f"no local file for {spec.hub_id}/{spec.config} split {split!r}: looked for "
        f"{' and '.join(map(str, candidates))}; splits present there: {present or 'none'}"
    )


@dataclasses.dataclass(frozen=True)
class _RawSplit:
    """One source split's premise, hypothesis and label columns, and where each row came from.

    `lines[i]` is the line of row i in a JSON-lines file (blank lines are
    skipped, so rows and lines can differ); None for sources read as tables,
    whose rows are numbered from 0.
    """

    source: str
    columns: dict[str, list]
    lines: list[int] | None = None

    def locate(self, row: int) -> str:
        """Where row `row` is, for an error message: the file and line, or the source and row."""
        return f"{self.source} line {self.lines[row]}" if self.lines is not None else f"{self.source} row {row}"


def _load_raw(spec: TestsetSpec, split: str, root: pathlib.Path | None) -> _RawSplit:
    columns = (spec.premise, spec.hypothesis, "label")
    if root is not None:
        path = local_path(spec, split, root)
        raw = _read_jsonl(path, columns) if path.suffix == ".jsonl" else _read_parquet(path, columns)
    else:
        if spec.hub_data_files is not None:
            source = spec.hub_data_files.format(split=split)
            table = datasets.load_dataset("parquet", data_files=source, split="train")
        else:
            source = f"hub {spec.hub_id}/{spec.config} split {split!r}"
            table = datasets.load_dataset(spec.hub_id, spec.config, split=split)
        _check_columns(source, columns, table.column_names)
        raw = _RawSplit(source, table.select_columns(list(columns)).to_dict())
    if not raw.columns["label"]:
        raise ValueError(f"{raw.source} has no rows: an empty or truncated file?")
    _check_types(spec, raw)
    return raw


def _read_jsonl(path: pathlib.Path, columns: tuple[str, ...]) -> _RawSplit:
    """Every row of a JSON-lines file, each checked to be an object holding `columns`.

    Read line by line rather than through `datasets`, whose errors name neither
    the line nor, for an empty file, the file, and which reads a missing
    column as null.
    """
    values: dict[str, list] = {column: [] for column in columns}
    lines = []
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
                detail = f"{error.msg} (column {error.colno})" if isinstance(error, json.JSONDecodeError) else error
                cut = "" if line.endswith(b"\n") else " (the file ends inside this line: is it truncated?)"
                raise ValueError(f"{path} line {number} is not valid JSON{cut}: {detail}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {number} is a JSON {type(row).__name__}, not an object")
            missing = [column for column in columns if column not in row]
            if missing:
                raise ValueError(f"{path} line {number} lacks columns {missing}; it has {list(row)}")
            for column in columns:
                values[column].append(row[column])
            lines.append(number)
    return _RawSplit(str(path), values, lines)


def _read_parquet(path: pathlib.Path, columns: tuple[str, ...]) -> _RawSplit:
    try:
        table = pyarrow.parquet.read_table(path)
    except (pyarrow.ArrowException, OSError) as error:
        raise ValueError(f"{path} is not a readable parquet file (truncated?): {error}") from None
    _check_columns(str(path), columns, table.column_names)
    return _RawSplit(str(path), {column: table.column(column).to_pylist() for column in columns})


def _check_columns(source: str, columns: tuple[str, ...], present: list[str]) -> None:
    missing = [column for column in columns if column not in present]
    if missing:
        raise ValueError(f"{source} lacks columns {missing}; it has {present}")


def _check_types(spec: TestsetSpec, raw: _RawSplit) -> None:
    """Texts must be strings and labels of the table's label type: a null hypothesis is not the text "None"."""
    label_type = type(next(iter(spec.labels)))
    expected = {spec.premise: str, spec.hypothesis: str, "label": label_type}
    for column, values in raw.columns.items():
        wanted = expected[column]
        for row, value in enumerate(values):
            # bool is an int to isinstance, but a true/false label is a mistake, not class 1/0.
            if not isinstance(value, wanted) or isinstance(value, bool):
                found = "null" if value is None else f"{value!r} ({type(value).__name__})"
                raise ValueError(
                    f"{raw.locate(row)}: column {column!r} is {found}; expected "
                    f"{'an integer' if wanted is int else 'a string'}"
                )


def _to_binary(spec: TestsetSpec, raw: _RawSplit, neutral: Neutral, name: str, split: str) -> datasets.Dataset:
    """Map gold labels through the table; drop unlabelled rows and (by default) neutral."""
    premises, hypotheses, labels = (raw.columns[column] for column in (spec.premise, spec.hypothesis, "label"))
    mapping = dict(spec.labels)
    if spec.neutral is not None and neutral == "not_entailment":
        mapping[spec.neutral] = NOT_ENTAILMENT
    ignored = set(spec.unlabelled) | ({spec.neutral} if spec.neutral is not None else set())
    unknown = sorted({v for v in labels if v not in mapping and v not in ignored}, key=repr)
    if unknown:
        first = next(row for row, v in enumerate(labels) if v == unknown[0])
        raise ValueError(
            f"{name} split {split!r}: label values {unknown} are not in the label map {sorted(mapping, key=repr)} "
            f"(values found: {sorted(set(labels), key=repr)}; {unknown[0]!r} first at {raw.locate(first)})"
        )
    keep = np.flatnonzero([v in mapping for v in labels])
    return _named_dataset(
        {
            "premise": [premises[i] for i in keep],
            "hypothesis": [hypotheses[i] for i in keep],
            "label": [mapping[labels[i]] for i in keep],
        },
        name,
        split,
    )


def _named_dataset(columns: dict[str, list], name: str, split: str) -> datasets.Dataset:
    """The rows as a Dataset that knows its testset and split (kept by `select`), so later errors can name them."""
    info = datasets.DatasetInfo(dataset_name=name, features=FEATURES)
    return datasets.Dataset.from_dict(columns, features=FEATURES, info=info, split=split)
