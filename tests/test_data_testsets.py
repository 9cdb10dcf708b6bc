"""The eight testsets against their own source files, hand-checked label directions, bad input."""

import collections
import json
import logging
import pathlib
import re

import datasets
import huggingface_hub
import pandas as pd
import pytest

from oodjax.data import TESTSETS, load_testset, training_pool
from oodjax.data.testsets import local_path
from oodjax.data.testsets import testset_table as table_with  # a name starting with test_ would be collected

# Written out from each dataset's own documentation, independently of TESTSETS:
# (file under hf/, premise column, hypothesis column, entailment values, not-entailment values).
SOURCES = {
    "snli": ("stanfordnlp/snli/plain_text/test.jsonl", "premise", "hypothesis", {0}, {2}),
    "mnli": ("nyu-mll/glue/mnli/validation_matched.jsonl", "premise", "hypothesis", {0}, {2}),
    "scitail": ("allenai/scitail/tsv_format/test.jsonl", "premise", "hypothesis", {"entails"}, {"neutral"}),
    "rte": ("nyu-mll/glue/rte/train.jsonl", "sentence1", "sentence2", {0}, {1}),
    "wnli": ("nyu-mll/glue/wnli/train.jsonl", "sentence1", "sentence2", {1}, {0}),
    "paws": ("google-research-datasets/paws/labeled_final/test.jsonl", "sentence1", "sentence2", {1}, {0}),
    "hans": ("jhu-cogsci/hans/plain_text/validation.jsonl", "premise", "hypothesis", {0}, {1}),
    "anli": ("facebook/anli/plain_text/test_r3.jsonl", "premise", "hypothesis", {0}, {2}),
}

# Rows read by hand in the source files: (premise start, hypothesis, binary label).
HAND_CHECKED = {
    "snli": [
        ("This church choir sings to the masses", "The church is filled with song.", 0),
        ("This church choir sings to the masses", "A choir singing at a baseball game.", 1),
    ],
    "mnli": [
        ("i'm not sure what the overnight low was", "I don't know how cold it got last night.", 0),
        (
            "The bhakti movement of the Tamils",
            "The Tamils' bhakti movement froze the previously warm ritual of Hinduism.",
            1,
        ),
    ],
    "scitail": [
        (
            "A polyploid is simply an organism",
            "A(n) polyploid is an individual with more than the correct number of chromosome sets.",
            0,
        ),
        (
            "Chapter 11 Gas and Kinetic Theory",
            "The behavior of ideal gases is explained by kinetic molecular theory.",
            1,
        ),
    ],
    "rte": [
        (
            "A place of sorrow, after Pope John Paul II died",
            "Pope Benedict XVI is the new leader of the Roman Catholic Church.",
            0,
        ),
        ("No Weapons of Mass Destruction Found in Iraq Yet.", "Weapons of Mass Destruction Found in Iraq.", 1),
    ],
    "wnli": [
        ("I stuck a pin through a carrot.", "The carrot had a hole.", 0),
        ("John couldn't see the stage with Billy in front of him", "John is so short.", 0),
        ("The table won't fit through the doorway because it is too narrow.", "The table is too narrow.", 1),
        (
            "George got free tickets to the play, but he gave them to Eric, because",
            "George was particularly eager to see it.",
            1,
        ),
        (
            "George got free tickets to the play, but he gave them to Eric, even though",
            "George was particularly eager to see it.",
            0,
        ),
    ],
    "paws": [
        (
            "The Sunset Sunset Road comes from right",
            "Sunset Road comes in from the right and becomes Briscoe Mountain Road .",
            0,
        ),
        (
            "It was chosen as the 19th best movie at the 7th Yokohama",
            "It was chosen as the 7th best film at the 19th Yokohama Film Festival .",
            1,
        ),
    ],
    "hans": [
        ("Obviously the secretary encouraged the senator .", "The secretary encouraged the senator .", 0),
        ("Supposedly the judge avoided the banker .", "The judge avoided the banker .", 1),
    ],
    "anli": [
        ("Lost in the woods<br>Ann was driving down a dark road.", "Ann did not keep on driving.", 0),
        ("Lebanon is in a period of mourning", "Rafik Hariri was from Lebanon.", 0),
        ("Wrong Can<br>Tim was working on his car.", "Tim's car runs on soda.", 1),
        ("David Millar retained his Tour de France", "David Millar has the initials DN.", 1),
    ],
}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def testsets(hf_data_dir):
    return {name: load_testset(name, data_dir=hf_data_dir) for name in TESTSETS}


def test_table_covers_the_eight_testsets():
    assert sorted(TESTSETS) == sorted(SOURCES)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_rows_and_labels_match_the_source_file(name, testsets, hf_data_dir):
    file, p, h, yes, no = SOURCES[name]
    raw = read_jsonl(hf_data_dir / file)
    expected = [(r[p], r[h], 0 if r["label"] in yes else 1) for r in raw if r["label"] in yes | no]
    ds = testsets[name]
    assert ds.column_names == ["premise", "hypothesis", "label"]
    assert list(zip(ds["premise"][:], ds["hypothesis"][:], ds["label"][:])) == expected
    counts = collections.Counter(r["label"] for r in raw)
    assert collections.Counter(ds["label"][:]) == {0: sum(counts[v] for v in yes), 1: sum(counts[v] for v in no)}


def test_snli_and_mnli_row_counts_after_dropping_neutral_and_unlabelled(testsets):
    assert len(testsets["snli"]) == 6605
    assert len(testsets["mnli"]) == 6692


@pytest.mark.parametrize("name", sorted(HAND_CHECKED))
def test_hand_checked_rows_map_to_the_right_side(name, testsets):
    ds = testsets[name]
    rows = list(zip(ds["premise"][:], ds["hypothesis"][:], ds["label"][:]))
    for premise_start, hypothesis, label in HAND_CHECKED[name]:
        found = [lab for p, h, lab in rows if p.startswith(premise_start) and h.strip() == hypothesis]
        assert found == [label], (premise_start, hypothesis)


def test_anli_rounds_and_all_rounds_together(hf_data_dir):
    rounds = [load_testset("anli", split=f"test_r{r}", data_dir=hf_data_dir) for r in (1, 2, 3)]
    together = load_testset("anli", split="test_all", data_dir=hf_data_dir)
    assert [len(r) for r in rounds] == [667, 667, 798]
    assert together["hypothesis"][:] == sum((r["hypothesis"][:] for r in rounds), [])
    assert together["label"][:] == sum((r["label"][:] for r in rounds), [])


def test_neutral_can_map_to_not_entailment(hf_data_dir):
    raw = read_jsonl(hf_data_dir / "facebook/anli/plain_text/test_r3.jsonl")
    ds = load_testset("anli", data_dir=hf_data_dir, neutral="not_entailment")
    assert ds["label"][:] == [0 if r["label"] == 0 else 1 for r in raw]
    neutral_hypotheses = {r["hypothesis"] for r in raw if r["label"] == 1}
    assert not neutral_hypotheses & set(load_testset("anli", data_dir=hf_data_dir)["hypothesis"][:])


def test_training_pools_default_to_the_offline_splits(hf_data_dir):
    mnli = training_pool("mnli", data_dir=hf_data_dir)
    snli = training_pool("snli", data_dir=hf_data_dir)
    vm = read_jsonl(hf_data_dir / "nyu-mll/glue/mnli/validation_mismatched.jsonl")
    val = read_jsonl(hf_data_dir / "stanfordnlp/snli/plain_text/validation.jsonl")
    assert mnli["hypothesis"][:] == [r["hypothesis"] for r in vm if r["label"] in (0, 2)]
    assert snli["hypothesis"][:] == [r["hypothesis"] for r in val if r["label"] in (0, 2)]
    with pytest.raises(ValueError, match="hans is not a training set; training pools exist for: snli, mnli"):
        training_pool("hans", data_dir=hf_data_dir)


def test_data_dir_defaults_to_the_environment(monkeypatch, hf_data_dir, tmp_path):
    monkeypatch.setenv("OODJAX_DATA_DIR", str(hf_data_dir))
    assert len(load_testset("wnli")) == 635
    monkeypatch.setenv("OODJAX_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_testset("wnli")


def test_a_local_parquet_file_is_read_like_jsonl(tmp_path):
    folder = tmp_path / "nyu-mll/glue/rte"
    folder.mkdir(parents=True)
    pd.DataFrame({"sentence1": ["a", "b", "c"], "sentence2": ["x", "y", "z"], "label": [1, 0, -1]}).to_parquet(
        folder / "validation.parquet"
    )
    ds = load_testset("rte", split="validation", data_dir=tmp_path)
    assert ds.to_dict() == {"premise": ["a", "b"], "hypothesis": ["x", "y"], "label": [1, 0]}


def write_jsonl(root, hub_path, rows):
    path = root / hub_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_unknown_testset_lists_the_known_ones():
    with pytest.raises(
        KeyError, match="unknown testset 'mnli_m'; known testsets: snli, mnli, scitail, rte, wnli, paws, hans, anli"
    ):
        load_testset("mnli_m")


def test_missing_split_names_the_paths_looked_for(hf_data_dir):
    expected = str(hf_data_dir / "nyu-mll/glue/mnli/test_matched.jsonl")
    with pytest.raises(FileNotFoundError) as error:
        load_testset("mnli", split="test_matched", data_dir=hf_data_dir)
    message = str(error.value)
    assert expected in message and expected.replace(".jsonl", ".parquet") in message
    assert "validation_matched" in message and "validation_mismatched" in message


def test_label_outside_the_map_names_the_values_and_the_line(tmp_path):
    rows = [{"premise": "p", "hypothesis": "h", "label": v} for v in ("entails", "neutral", "contradiction")]
    write_jsonl(tmp_path, "allenai/scitail/tsv_format/test.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=r"scitail split 'test': label values \['contradiction'\] are not in .*first at .*/test.jsonl line 3\)",
    ):
        load_testset("scitail", data_dir=tmp_path)


WNLI_FILE = "nyu-mll/glue/wnli/train.jsonl"
GOOD_ROW = {"sentence1": "p", "sentence2": "h", "label": 1}


def test_missing_columns_are_named_with_their_line(tmp_path):
    write_jsonl(tmp_path, WNLI_FILE, [GOOD_ROW, GOOD_ROW, {"sentence1": "p", "label": 1}])
    with pytest.raises(
        ValueError, match=r"wnli/train.jsonl line 3 lacks columns \['sentence2'\]; it has \['sentence1', 'label'\]"
    ):
        load_testset("wnli", data_dir=tmp_path)


@pytest.mark.parametrize(
    "column, value, found, expected",
    [
        ("sentence2", None, "null", "a string"),  # read by `datasets` as the text "None" before
        ("sentence1", 3, r"3 \(int\)", "a string"),
        ("label", 1.0, r"1.0 \(float\)", "an integer"),
        ("label", True, r"True \(bool\)", "an integer"),
        ("label", "1", r"'1' \(str\)", "an integer"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_file_line_and_column(tmp_path, column, value, found, expected):
    write_jsonl(tmp_path, WNLI_FILE, [GOOD_ROW, {**GOOD_ROW, column: value}])
    message = rf"wnli/train.jsonl line 2: column '{column}' is {found}; expected {expected}"
    with pytest.raises(ValueError, match=message):
        load_testset("wnli", data_dir=tmp_path)


def test_string_labels_must_be_strings_where_the_table_has_them(tmp_path):
    write_jsonl(tmp_path, "allenai/scitail/tsv_format/test.jsonl", [{"premise": "p", "hypothesis": "h", "label": 0}])
    with pytest.raises(ValueError, match=r"test.jsonl line 1: column 'label' is 0 \(int\); expected a string"):
        load_testset("scitail", data_dir=tmp_path)


def test_a_truncated_jsonl_names_the_file_and_its_last_line(tmp_path, hf_data_dir):
    """The real WNLI file cut in the middle of its last line, as an interrupted copy leaves it."""
    text = (hf_data_dir / WNLI_FILE).read_bytes()
    target = tmp_path / WNLI_FILE
    target.parent.mkdir(parents=True)
    target.write_bytes(text[:-40])
    lines = text.count(b"\n")
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(target))} line {lines} is not valid JSON "
        r"\(the file ends inside this line: is it truncated\?\)",
    ):
        load_testset("wnli", data_dir=tmp_path)


def test_a_line_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / WNLI_FILE).parent.mkdir(parents=True)
    (tmp_path / WNLI_FILE).write_text(json.dumps(GOOD_ROW) + "\n\n" + json.dumps(["p", "h", 1]) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl line 3 is a JSON list, not an object"):
        load_testset("wnli", data_dir=tmp_path)


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_an_empty_jsonl_is_an_error_naming_it(tmp_path, text):
    (tmp_path / WNLI_FILE).parent.mkdir(parents=True)
    (tmp_path / WNLI_FILE).write_text(text)
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / WNLI_FILE))} has no rows"):
        load_testset("wnli", data_dir=tmp_path)


def test_a_truncated_parquet_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "nyu-mll/glue/rte/validation.parquet"
    path.parent.mkdir(parents=True)
    pd.DataFrame({"sentence1": ["a", "b"], "sentence2": ["x", "y"], "label": [1, 0]}).to_parquet(path)
    path.write_bytes(path.read_bytes()[:-30])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not a readable parquet file"):
        load_testset("rte", split="validation", data_dir=tmp_path)


def test_a_null_in_a_parquet_file_names_its_row(tmp_path):
    path = tmp_path / "nyu-mll/glue/rte/validation.parquet"
    path.parent.mkdir(parents=True)
    pd.DataFrame({"sentence1": ["a", "b"], "sentence2": ["x", None], "label": [1, 0]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"validation.parquet row 1: column 'sentence2' is null; expected a string"):
        load_testset("rte", split="validation", data_dir=tmp_path)


def test_loaded_testsets_know_their_name_and_split(testsets, hf_data_dir):
    """What a later error about one of their examples (a prompt too long to fit) names."""
    assert (testsets["wnli"].info.dataset_name, testsets["wnli"].split) == ("wnli", "train")
    anli = load_testset("anli", split="test_all", data_dir=hf_data_dir)
    assert (anli.info.dataset_name, anli.split) == ("anli", "test_all")
    assert (anli.select([3]).info.dataset_name, anli.select([3]).split) == ("anli", "test_all")


def test_hidden_test_labels_are_an_error(tmp_path):
    write_jsonl(tmp_path, "nyu-mll/glue/rte/test.jsonl", [{"sentence1": "p", "sentence2": "h", "label": -1}])
    with pytest.raises(ValueError, match="rte split 'test' has no rows with a gold label"):
        load_testset("rte", split="test", data_dir=tmp_path)


def test_bad_neutral_option(hf_data_dir):
    with pytest.raises(ValueError, match="neutral must be 'drop' or 'not_entailment', got 'keep'"):
        load_testset("snli", data_dir=hf_data_dir, neutral="keep")


def test_without_a_local_root_the_hub_is_asked_for_the_tables_split(monkeypatch):
    """Offline, only the request can be checked: hub id, config and split, and HANS's parquet export."""
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"premise": ["p"], "hypothesis": ["h"], "label": [0]})

    monkeypatch.delenv("OODJAX_DATA_DIR", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    load_testset("snli")
    load_testset("anli", split="test_r1")
    load_testset("hans")
    assert calls == [
        (("stanfordnlp/snli", "plain_text"), {"split": "test"}),
        (("facebook/anli", "plain_text"), {"split": "test_r1"}),
        (
            ("parquet",),
            {
                "data_files": "hf://datasets/jhu-cogsci/hans@refs%2Fconvert%2Fparquet/plain_text/validation/*.parquet",
                "split": "train",
            },
        ),
    ]


def test_a_null_from_the_hub_names_the_source_and_row(monkeypatch):
    rows = {"premise": ["p", "q"], "hypothesis": ["h", None], "label": [0, 2]}
    monkeypatch.delenv("OODJAX_DATA_DIR", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: datasets.Dataset.from_dict(rows))
    message = r"hub stanfordnlp/snli/plain_text split 'test' row 1: column 'hypothesis' is null"
    with pytest.raises(ValueError, match=message):
        load_testset("snli")


# Declared testsets: `testset_table` over config declarations and JSON/YAML files.

RTE_VALIDATION = "nyu-mll/glue/rte/validation.jsonl"
RTE_COLUMNS = {"premise": "sentence1", "hypothesis": "sentence2", "label": "label"}


def rows_of(ds):
    return list(zip(ds["premise"][:], ds["hypothesis"][:], ds["label"][:]))


def write_rte_copy(hf_data_dir, path):
    """RTE validation (277 rows, labels 0 entailment / 1 not) rewritten in the format `path`'s extension names."""
    frame = pd.DataFrame(read_jsonl(hf_data_dir / RTE_VALIDATION))
    path.parent.mkdir(parents=True, exist_ok=True)
    {
        ".csv": lambda: frame.to_csv(path, index=False),
        ".parquet": lambda: frame.to_parquet(path),
        ".jsonl": lambda: frame.to_json(path, orient="records", lines=True),
    }[path.suffix]()
    return frame


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_a_declared_file_loads_as_the_built_in_testset_does(hf_data_dir, tmp_path, suffix):
    path = tmp_path / f"my rte{suffix}"
    frame = write_rte_copy(hf_data_dir, path)
    table = table_with({"myrte": {"source": str(path), **RTE_COLUMNS, "entailment": [0], "not_entailment": [1]}})
    declared = load_testset("myrte", table=table)
    built_in = load_testset("rte", split="validation", data_dir=hf_data_dir)
    assert rows_of(declared) == rows_of(built_in)
    assert rows_of(declared) == list(zip(frame["sentence1"], frame["sentence2"], frame["label"]))
    assert declared.features == built_in.features
    assert (declared.info.dataset_name, declared.split) == ("myrte", path.name)


def test_declared_string_labels_entailment_on_either_side(tmp_path):
    """Labels as words, the not-entailment class listing two of them."""
    path = tmp_path / "words.csv"
    path.write_text("p,h,gold\nA,B,entails\nC,D,contradicts\nE,F,unrelated\nG,H,entails\n")
    table = table_with(
        {
            "words": {
                "source": str(path),
                "premise": "p",
                "hypothesis": "h",
                "label": "gold",
                "entailment": ["entails"],
                "not_entailment": ["contradicts", "unrelated"],
            }
        }
    )
    assert load_testset("words", table=table).to_dict() == {
        "premise": ["A", "C", "E", "G"],
        "hypothesis": ["B", "D", "F", "H"],
        "label": [0, 1, 1, 0],
    }


def test_a_declared_three_way_set_handles_neutral_and_unlabelled_as_the_built_in(hf_data_dir):
    """SNLI's own test file declared as a local file: its -1 rows dropped, its neutral rows dropped or kept as 1."""
    declaration = {
        "source": str(hf_data_dir / "stanfordnlp/snli/plain_text/test.jsonl"),
        "premise": "premise",
        "hypothesis": "hypothesis",
        "label": "label",
        "entailment": [0],
        "not_entailment": [2],
        "neutral": [1],
        "unlabelled": [-1],
    }
    table = table_with({"snli_file": declaration})
    raw = read_jsonl(hf_data_dir / "stanfordnlp/snli/plain_text/test.jsonl")
    kept = {"drop": {0: 0, 2: 1}, "not_entailment": {0: 0, 1: 1, 2: 1}}
    for neutral, binary in kept.items():
        declared = load_testset("snli_file", table=table, neutral=neutral)
        expected = [(r["premise"], r["hypothesis"], binary[r["label"]]) for r in raw if r["label"] in binary]
        assert rows_of(declared) == expected
        assert rows_of(declared) == rows_of(load_testset("snli", data_dir=hf_data_dir, neutral=neutral))
    assert len(load_testset("snli_file", table=table)) == 6605


def test_a_declared_hub_source_is_read_from_the_local_mirror(hf_data_dir):
    table = table_with(
        {
            "rte_val": {
                "source": "nyu-mll/glue",
                "config": "rte",
                "split": "validation",
                **RTE_COLUMNS,
                "entailment": [0],
                "not_entailment": [1],
                "unlabelled": [-1],
            }
        }
    )
    declared = load_testset("rte_val", table=table, data_dir=hf_data_dir)
    assert rows_of(declared) == rows_of(load_testset("rte", split="validation", data_dir=hf_data_dir))
    assert (declared.info.dataset_name, declared.split) == ("rte_val", "validation")


@pytest.mark.parametrize("split", ["test_r1", "test_all"])
def test_a_built_in_overridden_by_its_split(hf_data_dir, split):
    table = table_with({"anli": {"split": split}})
    assert table["anli"].split == split and table["snli"] == TESTSETS["snli"]
    overridden = load_testset("anli", table=table, data_dir=hf_data_dir)
    assert rows_of(overridden) == rows_of(load_testset("anli", split=split, data_dir=hf_data_dir))
    assert len(overridden) == {"test_r1": 667, "test_all": 2132}[split]


def test_a_built_in_overridden_by_a_file_keeps_its_columns_and_labels(hf_data_dir, tmp_path):
    path = tmp_path / "rte.csv"
    write_rte_copy(hf_data_dir, path)
    table = table_with({"rte": {"source": str(path)}})
    assert (table["rte"].config, table["rte"].split, table["rte"].premise) == ("", "rte.csv", "sentence1")
    assert rows_of(load_testset("rte", table=table)) == rows_of(
        load_testset("rte", split="validation", data_dir=hf_data_dir)
    )


def test_a_declared_cap_replaces_the_configs_eval_cap():
    table = table_with({"snli": {"cap": 500}, "anli": {"cap": 0}})
    assert (table["snli"].eval_cap(16), table["anli"].eval_cap(16), table["mnli"].eval_cap(16)) == (500, 0, 16)


DECLARATIONS_JSON = """{
  "rte_val": {"source": "rte.csv", "premise": "sentence1", "hypothesis": "sentence2", "label": "label",
              "entailment": [0], "not_entailment": [1]},
  "anli": {"split": "test_r2"}
}
"""
DECLARATIONS_YAML = """\
rte_val:
  source: rte.csv   # relative to this file's folder
  premise: sentence1
  hypothesis: sentence2
  label: label
  entailment: [0]
  not_entailment: [1]
anli:
  split: test_r2
"""


@pytest.mark.parametrize("name, text", [("sets.json", DECLARATIONS_JSON), ("sets.yaml", DECLARATIONS_YAML)])
def test_declarations_from_a_json_or_yaml_file(hf_data_dir, tmp_path, monkeypatch, name, text):
    folder = tmp_path / "declarations"
    write_rte_copy(hf_data_dir, folder / "rte.csv")
    (folder / name).write_text(text)
    monkeypatch.chdir(tmp_path)  # the source is found beside the file, not in the working directory
    table = table_with(None, pathlib.Path("declarations") / name)
    assert table["rte_val"].source == str(pathlib.Path("declarations") / "rte.csv")
    assert table["rte_val"].origin == f"testset 'rte_val' in {pathlib.Path('declarations') / name}"
    assert rows_of(load_testset("rte_val", table=table)) == rows_of(
        load_testset("rte", split="validation", data_dir=hf_data_dir)
    )
    assert table["anli"].split == "test_r2"


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("d.json", '{"a": {"split": "x"}, "a": {"split": "y"}}', r"d.json: \['a'\] given twice in one object"),
        ("d.yaml", "anli:\n  split: test_r1\n  split: test_r2\n", r"d.yaml line 3: 'split' given twice"),
        ("d.json", '{"anli": {"split": "test_r1"},}', r"d.json line 1 is not valid JSON"),
        ("d.yaml", "anli: [split", r"d.yaml is not valid YAML"),
        ("d.yaml", "- anli\n", r"d.yaml must hold a mapping of testset names to their fields, got list"),
        ("d.toml", "[anli]\n", r"d.toml must end in .json, .yaml or .yml"),
        ("d.yaml", "anli:\n  entailment: [yes]\n", r"'entailment': .*True is a bool \(YAML reads unquoted yes/no"),
    ],
)
def test_a_bad_declarations_file_is_an_error_naming_it(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        table_with(None, tmp_path / name)


def test_a_testset_declared_in_the_config_and_in_the_file_is_an_error(tmp_path):
    (tmp_path / "d.json").write_text('{"anli": {"split": "test_r1"}}')
    with pytest.raises(ValueError, match=r"testsets \['anli'\] are declared both in data.extra_testsets and in"):
        table_with({"anli": {"split": "test_r2"}}, tmp_path / "d.json")


GOOD_DECLARATION = {
    "source": "owner/name",
    "split": "test",
    "premise": "p",
    "hypothesis": "h",
    "label": "y",
    "entailment": [0],
    "not_entailment": [1],
}


@pytest.mark.parametrize(
    "name, fields, message",
    [
        (
            "mine",
            {**GOOD_DECLARATION, "premis": "p"},
            r"\['mine'\]: unknown field 'premis' \(did you mean 'premise'\?\)",
        ),
        ("mine", {"source": "owner/name", "split": "test"}, r"\['mine'\]: missing fields \['premise', 'hypothesis'"),
        ("mine", {**GOOD_DECLARATION, "split": None}, r"\['mine'\], field 'split': a hub source \(owner/name\) needs"),
        (
            "mine",
            {**GOOD_DECLARATION, "source": "my.csv"},
            r"\['mine'\], field 'split': a local file \(my.csv\) is one split",
        ),
        (
            "mine",
            {**GOOD_DECLARATION, "source": "/data/my.txt"},
            r"\['mine'\], field 'source': '/data/my.txt' is neither a hub id",
        ),
        ("mine", {**GOOD_DECLARATION, "split": 3}, r"\['mine'\], field 'split': must be a string, got 3 \(int\)"),
        (
            "mine",
            {**GOOD_DECLARATION, "entailment": 0},
            r"\['mine'\], field 'entailment': must be a list of label values, e.g. \[0\]",
        ),
        (
            "mine",
            {**GOOD_DECLARATION, "entailment": []},
            r"\['mine'\], field 'entailment': must list at least one label value",
        ),
        (
            "mine",
            {**GOOD_DECLARATION, "neutral": [1.5]},
            r"\['mine'\], field 'neutral': label values are integers or strings; 1.5",
        ),
        (
            "mine",
            {**GOOD_DECLARATION, "not_entailment": ["1"]},
            r"\['mine'\], field 'entailment': label values must be all integers or all strings",
        ),
        (
            "mine",
            {**GOOD_DECLARATION, "neutral": [2, 0]},
            r"\['mine'\], field 'neutral': label values \[0\] are also in 'entailment'",
        ),
        ("mine", {**GOOD_DECLARATION, "cap": -1}, r"\['mine'\], field 'cap': must be an integer >= 0"),
        (
            "mine",
            {**GOOD_DECLARATION, "hypothesis": "p"},
            r"\['mine'\], field 'label': premise, hypothesis and label must be three",
        ),
        ("mine", {**GOOD_DECLARATION, "label": ""}, r"\['mine'\], field 'label': must name a column"),
        ("mine", "owner/name", r"\['mine'\]: a declaration is a mapping of fields to values"),
        ("my set", GOOD_DECLARATION, r"\['my set'\]: 'my set' is not a testset name"),
        ("anli", {"splt": "test_r1"}, r"\['anli'\]: unknown field 'splt' \(did you mean 'split'\?\)"),
        ("anli", {"entailment": [1]}, r"\['anli'\], field 'neutral': label values \[1\] are also in 'entailment'"),
        ("anli", {"source": "owner/name"}, r"\['anli'\], field 'split': a hub source \(owner/name\) needs"),
    ],
)
def test_a_bad_declaration_is_an_error_naming_the_testset_and_the_field(name, fields, message):
    with pytest.raises(ValueError, match=r"^data\.extra_testsets" + message):
        table_with({name: fields})


def test_a_local_file_of_another_format_is_not_taken_for_a_hub_id(tmp_path):
    (tmp_path / "sets").mkdir()
    (tmp_path / "sets" / "my.tsv").write_text("p\th\ty\n")
    (tmp_path / "d.json").write_text(json.dumps({"mine": {**GOOD_DECLARATION, "source": "sets/my.tsv"}}))
    with pytest.raises(ValueError, match=r"'mine' in .*d.json, field 'source': 'sets/my.tsv' is a local file, but"):
        table_with(None, tmp_path / "d.json")


def test_unknown_testsets_list_the_declared_ones_too(tmp_path):
    table = table_with({"mine": {**GOOD_DECLARATION}})
    with pytest.raises(KeyError, match="unknown testset 'mien'; known testsets: snli, .*, anli, mine"):
        load_testset("mien", table=table)


def test_a_file_testset_has_no_other_split(tmp_path):
    table = table_with({"mine": {**GOOD_DECLARATION, "source": str(tmp_path / "m.csv"), "split": None}})
    with pytest.raises(ValueError, match=r"mine is the file .*m.csv, one split: it has no split 'test'"):
        load_testset("mine", split="test", table=table)
    with pytest.raises(FileNotFoundError, match=r"data.extra_testsets\['mine'\]: its source file .*m.csv does not"):
        load_testset("mine", table=table)


CSV_DECLARATION = {"premise": "p", "hypothesis": "h", "label": "y", "entailment": [0], "not_entailment": [1]}


def test_csv_texts_are_read_verbatim(tmp_path):
    """What pandas would turn into missing values or numbers stays text; a quoted field may hold commas and lines."""
    path = tmp_path / "t.csv"
    path.write_text('p,h,y\nNA,null,0\n"two\nlines, one field",007,1\n\n"""quoted""",,0\n')
    table = table_with({"t": {"source": str(path), **CSV_DECLARATION}})
    assert load_testset("t", table=table).to_dict() == {
        "premise": ["NA", "two\nlines, one field", '"quoted"'],
        "hypothesis": ["null", "007", ""],
        "label": [0, 1, 0],
    }


@pytest.mark.parametrize(
    "text, message",
    [
        ("p,h,y\na,b,0\nc,d,0,extra\n", r"t.csv line 3 has 4 fields, the header 3"),
        ('p,h,y\na,b,0\n"two\nlines",d,yes\n', r"t.csv line 3: column 'y' is 'yes'; expected an integer"),
        ("p,h,y\na,b,1.0\n", r"t.csv line 2: column 'y' is '1.0'; expected an integer"),
        ("p,hyp,y\na,b,0\n", r"t.csv \(its header line\) lacks columns \['h'\]; it has \['p', 'hyp', 'y'\]"),
        ("", r"t.csv has no rows"),
        ("p,h,y\n", r"t.csv has no rows"),
        ("p,h,y\na,b,2\n", r"t split 't.csv': label values \[2\] are not in the label map .* line 2\); a declared"),
    ],
)
def test_a_bad_csv_row_is_an_error_naming_the_file_and_line(tmp_path, text, message):
    (tmp_path / "t.csv").write_text(text)
    table = table_with({"t": {"source": str(tmp_path / "t.csv"), **CSV_DECLARATION}})
    with pytest.raises(ValueError, match=message):
        load_testset("t", table=table)


def test_a_split_missing_from_the_mirror_comes_from_the_hub_when_online(tmp_path, monkeypatch, caplog):
    write_jsonl(tmp_path, "nyu-mll/glue/rte/validation.jsonl", [{"sentence1": "local", "sentence2": "h", "label": 0}])
    hub_rows = {"sentence1": ["from the hub"], "sentence2": ["h"], "label": [1]}
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict(hub_rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert load_testset("rte", split="validation", data_dir=tmp_path)["premise"][:] == ["local"]
    assert calls == []
    with caplog.at_level(logging.INFO):
        assert load_testset("rte", data_dir=tmp_path)["premise"][:] == ["from the hub"]
    assert calls == [(("nyu-mll/glue", "rte"), {"split": "train"})]
    assert "no local file for nyu-mll/glue/rte split 'train'" in caplog.text
    assert "reading it from the hub" in caplog.text
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"split 'train': looked for .*; the hub is offline"):
        load_testset("rte", data_dir=tmp_path)
    assert len(calls) == 1


def test_a_declared_hub_source_without_a_config_is_asked_for_without_one(monkeypatch):
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"p": ["a"], "h": ["b"], "y": [1]})

    monkeypatch.delenv("OODJAX_DATA_DIR", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_testset("mine", table=table_with({"mine": GOOD_DECLARATION}))["label"][:] == [1]
    assert calls == [(("owner/name",), {"split": "test"})]


def test_the_table_records_each_hub_splits_rows_and_the_shared_hans_is_a_sample(hf_data_dir):
    """Every file of the shared mirror is a split whose size on the hub the table records; all hold the hub's rows
    but HANS, 3,000 of its 30,000 (../shared/data/README.md), which the cost estimate must scale."""
    files = {path.relative_to(hf_data_dir) for path in hf_data_dir.rglob("*.jsonl")}
    assert len(files) == 14
    recorded, samples = set(), {}
    for name, spec in TESTSETS.items():
        for split, hub in spec.hub_rows.items():
            path = local_path(spec, split, hf_data_dir)
            recorded.add(path.relative_to(hf_data_dir))
            local = sum(1 for line in path.open() if line.strip())
            assert local <= hub, (name, split)
            if local < hub:
                samples[name, split] = (local, hub)
    assert recorded == files
    assert samples == {("hans", "validation"): (3_000, 30_000)}
    # The hub's rows of each default evaluation split, as its dataset viewer lists them.
    hub_rows = dict(snli=10_000, mnli=9_815, scitail=2_126, rte=2_490, wnli=635, paws=8_000, hans=30_000, anli=1_200)
    assert {name: spec.hub_rows[spec.split] for name, spec in TESTSETS.items()} == hub_rows
