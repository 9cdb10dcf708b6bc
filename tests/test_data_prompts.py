"""Prompts and tokenisation: exact token ids, premise-only truncation, BOS handling, the disk cache."""

import re
import shutil

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from oodjax.data import DEFAULT_TEMPLATE, answer_token_ids, format_prompt, load_testset, prompts, tokenize_testset
from oodjax.data.prompts import load_tokenizer

LONG_PREMISE = "word" + " word" * 299  # 300 GPT-2 tokens
HYPOTHESIS = "The cat sat."


@pytest.fixture(scope="module")
def gpt2(gpt2_tokenizer_dir):
    return AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)


@pytest.fixture(scope="module")
def gpt2_with_bos(gpt2_tokenizer_dir):
    """GPT-2's BPE set up the way OPT's tokenizer is: a BOS before every prompt."""
    return AutoTokenizer.from_pretrained(gpt2_tokenizer_dir, add_bos_token=True)


def nli(rows):
    return datasets.Dataset.from_dict(
        {"premise": [r[0] for r in rows], "hypothesis": [r[1] for r in rows], "label": [r[2] for r in rows]}
    )


def ids(tokenizer, text, special=False):
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def test_default_prompt():
    assert format_prompt("A man sleeps.", "A person rests.") == "A man sleeps. Question: A person rests. Yes or No?"
    assert DEFAULT_TEMPLATE == "{premise} Question: {hypothesis} Yes or No?"


def test_answer_tokens_of_gpt2(gpt2):
    """GPT-2's ids, read off its vocab.json: the leading space is part of the word."""
    assert answer_token_ids(gpt2) == (3363, 1400)
    assert answer_token_ids(gpt2, (" yes", " no")) == (3763, 645)
    assert answer_token_ids(gpt2, ("Yes", "No")) == (5297, 2949)
    assert answer_token_ids(gpt2, (" True", " False")) == (6407, 10352)


@pytest.mark.parametrize(
    "answers, message",
    [
        (
            (" Yes please", " No"),
            r"answer ' Yes please' \(data.answers\) is 2 tokens \['ĠYes', 'Ġplease'\] \(ids \[3363, 3387\]\)",
        ),
        ((" Yes", " entailment"), r"answer ' entailment' \(data.answers\) is 2 tokens \['Ġentail', 'ment'\]"),
        ((" Yes", " Yes"), r"answers \[' Yes', ' Yes'\] \(data.answers\) are the same token 3363"),
        ((" Yes",), r"data.answers must be two words \(yes, no\), got \[' Yes'\]"),
    ],
)
def test_bad_answers_are_errors_naming_the_word_and_its_tokens(gpt2, answers, message):
    with pytest.raises(ValueError, match=message):
        answer_token_ids(gpt2, answers)


def test_untruncated_prompts_are_the_tokenizers_own_ids(gpt2, hf_data_dir, tmp_path):
    ds = load_testset("wnli", data_dir=hf_data_dir)
    tokenized = tokenize_testset(ds, gpt2, cache_dir=tmp_path)
    assert tokenized.num_truncated == 0 and len(tokenized) == len(ds)
    expected = ids(gpt2, [format_prompt(p, h) for p, h in zip(ds["premise"][:], ds["hypothesis"][:])], special=True)
    assert [tokenized.prompt(i).tolist() for i in range(len(ds))] == expected
    np.testing.assert_array_equal(tokenized.labels, ds["label"][:])
    assert tokenized.token_ids.dtype == np.int32


def test_truncation_cuts_the_end_of_the_premise_and_keeps_the_question(gpt2, tmp_path):
    ds = nli([(LONG_PREMISE, HYPOTHESIS, 0), ("A short one.", HYPOTHESIS, 1), (LONG_PREMISE, "Birds fly.", 1)])
    tokenized = tokenize_testset(ds, gpt2, max_length=64, cache_dir=tmp_path)
    premise = ids(gpt2, LONG_PREMISE)
    assert len(premise) == 300
    for i, hypothesis in ((0, HYPOTHESIS), (2, "Birds fly.")):
        suffix = ids(gpt2, f" Question: {hypothesis} Yes or No?")
        assert tokenized.prompt(i).tolist() == premise[: 64 - len(suffix)] + suffix
    assert tokenized.prompt(1).tolist() == ids(gpt2, format_prompt("A short one.", HYPOTHESIS))
    assert tokenized.truncated.tolist() == [True, False, True]
    assert tokenized.num_truncated == 2
    assert tokenized.lengths.tolist() == [64, len(tokenized.prompt(1)), 64]


def test_truncation_keeps_the_bos_token(gpt2_with_bos, tmp_path):
    bos = gpt2_with_bos.bos_token_id
    ds = nli([(LONG_PREMISE, HYPOTHESIS, 0), ("A short one.", HYPOTHESIS, 1)])
    tokenized = tokenize_testset(ds, gpt2_with_bos, max_length=64, cache_dir=tmp_path)
    suffix = ids(gpt2_with_bos, f" Question: {HYPOTHESIS} Yes or No?")
    premise = ids(gpt2_with_bos, LONG_PREMISE)
    assert tokenized.prompt(0).tolist() == [bos] + premise[: 63 - len(suffix)] + suffix
    short = format_prompt("A short one.", HYPOTHESIS)
    assert tokenized.prompt(1).tolist() == [bos] + ids(gpt2_with_bos, short)


def test_truncation_with_the_premise_in_the_middle_of_the_template(gpt2, tmp_path):
    template = "Hypothesis: {hypothesis} Premise: {premise}. True?"
    tokenized = tokenize_testset(
        nli([(LONG_PREMISE, HYPOTHESIS, 0)]), gpt2, template=template, max_length=40, cache_dir=tmp_path
    )
    prefix, body, suffix = (
        ids(gpt2, f"Hypothesis: {HYPOTHESIS} Premise:"),
        ids(gpt2, " " + LONG_PREMISE),
        ids(gpt2, ". True?"),
    )
    assert ids(gpt2, template.format(premise=LONG_PREMISE, hypothesis=HYPOTHESIS)) == prefix + body + suffix
    assert tokenized.prompt(0).tolist() == prefix + body[: 40 - len(prefix) - len(suffix)] + suffix


def test_a_prompt_that_cannot_fit_by_cutting_the_premise_is_an_error(gpt2, tmp_path):
    long_hypothesis = "A hypothesis far too long to fit " * 3
    ds = nli([("Hi.", HYPOTHESIS, 0), ("Some premise.", long_hypothesis, 1)])
    with pytest.raises(
        ValueError,
        match=rf"^dataset example 1 \(hypothesis '{re.escape(long_hypothesis[:77])}\.\.\.'\): "
        r"prompt is \d+ tokens and its premise only 3; max_length=20",
    ):
        tokenize_testset(ds, gpt2, max_length=20, cache_dir=tmp_path)


def test_a_prompt_of_a_testset_that_cannot_fit_names_the_testset_and_the_example(gpt2, hf_data_dir, tmp_path):
    """A capped testset (a `select` of its rows), as the engine tokenises it."""
    ds = load_testset("wnli", data_dir=hf_data_dir).select([5, 9])
    hypothesis = ds["hypothesis"][0]
    message = rf"^wnli split 'train' example 0 \(hypothesis '{re.escape(hypothesis)}'\): prompt is"
    with pytest.raises(ValueError, match=message):
        tokenize_testset(ds, gpt2, max_length=8, cache_dir=tmp_path)


def test_a_tokenizer_appending_eos_is_refused(gpt2_tokenizer_dir, tmp_path):
    with_eos = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir, add_eos_token=True)
    with pytest.raises(ValueError, match="appends special token 50256 to prompts"):
        tokenize_testset(nli([("p", "h", 0)]), with_eos, cache_dir=tmp_path)


@pytest.mark.parametrize(
    "template, fields",
    [
        ("{premise} Question: Yes or No?", "['premise']"),
        ("{premise} {hypothesis} {premise}", "['premise', 'hypothesis', 'premise']"),
        ("{premise} {hypothesis} {answer}", "['premise', 'hypothesis', 'answer']"),
    ],
)
def test_bad_templates_are_errors(template, fields, gpt2, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"must contain \{premise\} and \{hypothesis\} once each.*has fields "
        + fields.replace("[", r"\[").replace("]", r"\]"),
    ):
        tokenize_testset(nli([("p", "h", 0)]), gpt2, template=template, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="must contain"):
        format_prompt("p", "h", template)


def test_bad_max_length(gpt2, tmp_path):
    with pytest.raises(ValueError, match="max_length must be positive, got 0"):
        tokenize_testset(nli([("p", "h", 0)]), gpt2, max_length=0, cache_dir=tmp_path)


def cache_files(root):
    return sorted(p.name for p in (root / "tokenized").iterdir())


def test_the_cache_is_hit_for_the_same_inputs_and_missed_for_any_change(gpt2, gpt2_with_bos, tmp_path, monkeypatch):
    ds = nli([(LONG_PREMISE, HYPOTHESIS, 0), ("A short one.", HYPOTHESIS, 1), ("Another.", "Birds fly.", 1)])
    first = tokenize_testset(ds, gpt2, max_length=64, cache_dir=tmp_path)
    assert len(cache_files(tmp_path)) == 1 and cache_files(tmp_path)[0].endswith(".npz")

    def must_not_run(*args, **kwargs):
        raise AssertionError("tokenised again despite a cache entry")

    with monkeypatch.context() as patch:
        patch.setattr(prompts, "_tokenize", must_not_run)
        again = tokenize_testset(ds, gpt2, max_length=64, cache_dir=tmp_path)
    for field in ("token_ids", "starts", "labels", "truncated"):
        np.testing.assert_array_equal(getattr(again, field), getattr(first, field))
    assert again.max_length == 64 and again.num_truncated == 1

    tokenize_testset(ds, gpt2, max_length=65, cache_dir=tmp_path)
    tokenize_testset(ds, gpt2, max_length=64, template="{premise}? {hypothesis}", cache_dir=tmp_path)
    tokenize_testset(ds, gpt2_with_bos, max_length=64, cache_dir=tmp_path)
    tokenize_testset(ds.select([0, 1]), gpt2, max_length=64, cache_dir=tmp_path)
    relabelled = nli([(LONG_PREMISE, HYPOTHESIS, 1), ("A short one.", HYPOTHESIS, 1), ("Another.", "Birds fly.", 1)])
    assert tokenize_testset(relabelled, gpt2, max_length=64, cache_dir=tmp_path).labels.tolist() == [1, 1, 1]
    files = cache_files(tmp_path)
    assert len(files) == 6 and all(f.endswith(".npz") and not f.startswith(".") for f in files)


@pytest.mark.parametrize("keep", [0, 100, -5])
def test_an_unreadable_cache_entry_is_computed_again(gpt2, tmp_path, caplog, keep):
    """A cache file cut short on disk (empty, inside its data, inside its zip directory)."""
    ds = nli([(LONG_PREMISE, HYPOTHESIS, 0), ("A short one.", HYPOTHESIS, 1)])
    first = tokenize_testset(ds, gpt2, max_length=64, cache_dir=tmp_path)
    (entry,) = (tmp_path / "tokenized").iterdir()
    entry.write_bytes(entry.read_bytes()[:keep])
    again = tokenize_testset(ds, gpt2, max_length=64, cache_dir=tmp_path)
    np.testing.assert_array_equal(again.token_ids, first.token_ids)
    assert f"cache entry {entry} is unreadable" in caplog.text
    with np.load(entry) as stored:  # rewritten whole
        np.testing.assert_array_equal(stored["token_ids"], first.token_ids)


def test_the_default_cache_dir_comes_from_the_environment(gpt2, tmp_path, monkeypatch):
    monkeypatch.setenv("OODJAX_CACHE_DIR", str(tmp_path))
    tokenize_testset(nli([("p", "h", 0)]), gpt2)
    assert len(cache_files(tmp_path)) == 1


def test_use_cache_false_writes_nothing(gpt2, tmp_path):
    tokenize_testset(nli([("p", "h", 0)]), gpt2, cache_dir=tmp_path, use_cache=False)
    assert not (tmp_path / "tokenized").exists()


def test_load_tokenizer_loads_a_tokenizer_folder(gpt2_tokenizer_dir):
    assert answer_token_ids(load_tokenizer(gpt2_tokenizer_dir)) == (3363, 1400)


def _truncate_vocab(folder):
    vocab = folder / "vocab.json"
    vocab.write_bytes(vocab.read_bytes()[:1000])


def _junk_config(folder):
    (folder / "tokenizer_config.json").write_text("{not json")


def _binary_files(folder):
    for path in folder.iterdir():
        path.write_bytes(b"\x00\xff" * 10)


def _no_files(folder):
    for path in folder.iterdir():
        path.unlink()


@pytest.mark.parametrize("damage", [_truncate_vocab, _junk_config, _binary_files, _no_files])
def test_a_tokenizer_folder_holding_junk_is_an_error_naming_it(gpt2_tokenizer_dir, tmp_path, damage):
    folder = tmp_path / "tokenizer"
    shutil.copytree(gpt2_tokenizer_dir, folder)
    damage(folder)
    with pytest.raises(ValueError, match=rf"^tokenizer '{re.escape(str(folder))}' cannot be loaded"):
        load_tokenizer(folder)
