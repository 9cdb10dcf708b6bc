"""A testset's rows, read from the mirror, a declared file or the hub, checked and mapped to binary NLI.

Local files are read without ``datasets`` or pandas, so every error names
the file, line and column, and a missing value is never read as null or
the text "NA".
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import datasets
import pyarrow
import pyarrow.parquet
from absl import logging

from oodjax.data.testsets import (
    NOT_ENTAILMENT,
    TESTSETS,
    Neutral,
    TestsetSpec,
    check_neutral,
    default_data_dir,
    hub_offline,
    hub_source_name,
    hub_split,
    local_path,
    pool_split,
    testset_spec,
)
from oodjax.usage_errors import ConfigError, NotFetchedError

FEATURES = datasets.Features(
    premise=datasets.Value("string"),
    hypothesis=datasets.Value("string"),
    label=datasets.ClassLabel(names=["entailment", "not_entailment"]),
)
_Row = dict[str, Any]  # a text file's row by column, as its JSON or CSV reader gives it


def load_testset(
    name: str,
    *,
    split: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    neutral: Neutral = "drop",
    table: Mapping[str, TestsetSpec] = TESTSETS,
) -> datasets.Dataset:
    """Load a testset as binary NLI: columns premise, hypothesis, label (0 = entailment).

    A hub source is read from the mirror `data_dir` (default
    $OODJAX_DATA_DIR) where the split is there, else from the hub. Row order
    follows the source, so row i is the same example on every machine. Every
    row is checked as it is read, an error naming the file, line and column.
    """
    spec = testset_spec(name, table)
    check_neutral(neutral)
    if spec.is_local_file and split not in (None, spec.split):
        raise ValueError(f"{name} is the file {spec.source}, one split: it has no split {split!r}")
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
    name: str, *, split: str | None = None, data_dir: str | os.PathLike[str] | None = None
) -> datasets.Dataset:
    """The pool few-shot training sets of `name` are drawn from, as the built-in table has it: declarations
    change what is evaluated, never what is trained on. The default pool split is disjoint from the
    evaluation splits."""
    return load_testset(name, split=pool_split(name, split), data_dir=data_dir)


@dataclasses.dataclass(frozen=True)
class _RawSplit:
    """One source split's three columns; `lines[i]` is row i's line in a text file (None: a table)."""

    source: str
    columns: dict[str, list[Any]]
    lines: list[int] | None = None

    def locate(self, row: int) -> str:
        return f"{self.source} line {self.lines[row]}" if self.lines is not None else f"{self.source} row {row}"

    @classmethod
    def of_lines(cls, path: pathlib.Path, columns: tuple[str, ...], rows: Iterator[tuple[int, _Row]]) -> _RawSplit:
        """The split of a text file's (line, row) pairs."""
        numbered = list(rows)
        values = {column: [row[column] for _, row in numbered] for column in columns}
        return cls(str(path), values, [line for line, _ in numbered])


def _load_raw(spec: TestsetSpec, split: str, root: pathlib.Path | None) -> _RawSplit:
    columns = (spec.premise, spec.hypothesis, spec.label)
    path = _local_file(spec, split, root)
    if path is not None:
        read = {".jsonl": _read_jsonl, ".csv": _read_csv}.get(path.suffix)
        raw = _RawSplit.of_lines(path, columns, read(path, columns)) if read else _read_parquet(path, columns)
    else:
        source, table = hub_source_name(spec, split), hub_split(spec, split)
        _check_columns(source, columns, table.column_names)
        raw = _RawSplit(source, table.select_columns(list(columns)).to_dict())
    if not raw.columns[spec.label]:
        raise ValueError(f"{raw.source} has no rows: an empty or truncated file?")
    if path is not None and path.suffix == ".csv":
        raw = _csv_labels(spec, raw)
    _check_types(spec, raw)
    return raw


def _local_file(spec: TestsetSpec, split: str, root: pathlib.Path | None) -> pathlib.Path | None:
    """The local file to read `split` from, or None to ask the hub."""
    if spec.is_local_file:
        path = pathlib.Path(spec.source)
        if not path.is_file():
            raise FileNotFoundError(f"{spec.origin or 'testset'}: its source file {path} does not exist")
        return path
    if root is None:
        return None
    try:
        return local_path(spec, split, root)
    except FileNotFoundError as error:
        if hub_offline():
            raise NotFetchedError(
                f"{error}; the hub is offline (HF_HUB_OFFLINE), so it cannot come from there"
            ) from None
        logging.info("%s; reading it from the hub", error)
        return None


def _read_jsonl(path: pathlib.Path, columns: tuple[str, ...]) -> Iterator[tuple[int, _Row]]:
    """Every row of a JSON-lines file and its line; not through `datasets`, whose errors name no line and which
    reads a missing column as null."""
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
            yield number, row


def _read_csv(path: pathlib.Path, columns: tuple[str, ...]) -> Iterator[tuple[int, _Row]]:
    """Every row of a CSV file with a header line, as text, and its first line; not through pandas, which reads
    a premise "NA" as missing and names no line in its errors."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{path} has no rows: an empty or truncated file?")
            _check_columns(f"{path} (its header line)", columns, header)
            positions = [header.index(column) for column in columns]
            end = reader.line_num
            for row in reader:
                start, end = end + 1, reader.line_num  # the lines a row spans (a quoted text may hold several)
                if not row:  # a blank line
                    continue
                if len(row) != len(header):
                    raise ValueError(
                        f"{path} line {start} has {len(row)} fields, the header {len(header)}: a stray or "
                        "unquoted comma?"
                    )
                yield start, {column: row[position] for column, position in zip(columns, positions)}
    except (UnicodeDecodeError, csv.Error) as error:
        raise ValueError(f"{path} is not a readable UTF-8 CSV file: {error}") from None


def _csv_labels(spec: TestsetSpec, raw: _RawSplit) -> _RawSplit:
    """A CSV file holds text only: its labels become integers where the declared label values are integers."""
    if not isinstance(next(iter(spec.labels)), int):
        return raw
    labels = []
    for row, text in enumerate(raw.columns[spec.label]):
        try:
            labels.append(int(text))
        except ValueError:
            raise ConfigError(
                f"{raw.locate(row)}: column {spec.label!r} is {text!r}; expected an integer (the declared label "
                "values are integers)"
            ) from None
    return dataclasses.replace(raw, columns={**raw.columns, spec.label: labels})


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
    expected = {spec.premise: str, spec.hypothesis: str, spec.label: label_type}
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
    premises, hypotheses, labels = (raw.columns[column] for column in (spec.premise, spec.hypothesis, spec.label))
    mapping = dict(spec.labels)
    if neutral == "not_entailment":
        mapping |= {value: NOT_ENTAILMENT for value in spec.neutral}
    ignored = set(spec.unlabelled) | set(spec.neutral)
    unknown = sorted({v for v in labels if v not in mapping and v not in ignored}, key=repr)
    if unknown:
        first = next(row for row, v in enumerate(labels) if v == unknown[0])
        # A declared testset's label values are the user's to list; the built-in table's are ours.
        raise (ConfigError if spec.origin else ValueError)(
            f"{name} split {split!r}: label values {unknown} are not in the label map {sorted(mapping, key=repr)} "
            f"(values found: {sorted(set(labels), key=repr)}; {unknown[0]!r} first at {raw.locate(first)}); a "
            "declared testset lists each value in entailment, not_entailment, neutral or unlabelled"
        )
    keep = [i for i, v in enumerate(labels) if v in mapping]
    columns = {"premise": [premises[i] for i in keep], "hypothesis": [hypotheses[i] for i in keep]}
    columns["label"] = [mapping[labels[i]] for i in keep]
    # The Dataset knows its testset and split, so that later errors can name them.
    info = datasets.DatasetInfo(dataset_name=name, features=FEATURES)
    return datasets.Dataset.from_dict(columns, features=FEATURES, info=info, split=split)
