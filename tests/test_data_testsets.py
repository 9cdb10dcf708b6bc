"""The eight testsets against their own source files, hand-checked label directions, bad input."""

import collections
import json
import re

import datasets
import pandas as pd
import pytest

from oodjax.data import TESTSETS, load_testset, training_pool

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
        ("The bhakti movement of the Tamils", "The Tamils' bhakti movement froze the previously warm ritual of Hinduism.", 1),
    ],
    "scitail": [
        ("A polyploid is simply an organism", "A(n) polyploid is an individual with more than the correct number of chromosome sets.", 0),
        ("Chapter 11 Gas and Kinetic Theory", "The behavior of ideal gases is explained by kinetic molecular theory.", 1),
    ],
    "rte": [
        ("A place of sorrow, after Pope John Paul II died", "Pope Benedict XVI is the new leader of the Roman Catholic Church.", 0),
        ("No Weapons of Mass Destruction Found in Iraq Yet.", "Weapons of Mass Destruction Found in Iraq.", 1),
    ],
    "wnli": [
        ("I stuck a pin through a carrot.", "The carrot had a hole.", 0),
        ("John couldn't see the stage with Billy in front of him", "John is so short.", 0),
        ("The table won't fit through the doorway because it is too narrow.", "The table is too narrow.", 1),
        ("George got free tickets to the play, but he gave them to Eric, because", "George was particularly eager to see it.", 1),
        ("George got free tickets to the play, but he gave them to Eric, even though", "George was particularly eager to see it.", 0),
    ],
    "paws": [
        ("The Sunset Sunset Road comes from right", "Sunset Road comes in from the right and becomes Briscoe Mountain Road .", 0),
        ("It was chosen as the 19th best movie at the 7th Yokohama", "It was chosen as the 7th best film at the 19th Yokohama Film Festival .", 1),
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
    with pytest.raises(KeyError, match="unknown testset 'mnli_m'; known testsets: snli, mnli, scitail, rte, wnli, paws, hans, anli"):
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
