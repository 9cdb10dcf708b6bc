"""The in-context-learning baseline: `oodjax.data.tokenize_in_context` (demonstrations nearest the test prompt
kept, whole, exactly as the tokenizer tokenises the full string) and `python -m oodjax.evaluate` with
eval.in_context (one run per (seed, shots) of the base model, its margins those of a plain forward pass), on a
small mirror of MNLI, HANS and RTE the tests write."""

import json

import datasets
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from analysis import runs as analysis_runs
from analysis import schema
from oodjax import evaluate, models
from oodjax.config_checks import check_config
from oodjax.config_read import read
from oodjax.data import (
    DEFAULT_TEMPLATE,
    few_shot,
    format_prompt,
    load_testset,
    stratified_subset,
    tokenize_in_context,
    tokenize_testset,
    training_pool,
)
from oodjax.engine import loop, results, run_data
from tests.engine_configs import TINY_OPT, tiny_config

ANSWERS = (" Yes", " No")
SEPARATOR = "\n\n"  # lm-eval's default fewshot delimiter
WORDS = "the cat dog bird sees chases a small red house near river quickly".split()


def sentence(rng, words):
    return " ".join(rng.choice(WORDS, size=words)).capitalize() + "."


def nli_rows(seed, n, labels, *, words=(3, 30), long_every=0):
    """Rows of premises of `words` words (every `long_every`-th one of 300), labels cycling."""
    rng = np.random.default_rng(seed)
    return [
        {
            "premise": sentence(rng, 300 if long_every and i % long_every == long_every - 1 else rng.integers(*words)),
            "hypothesis": sentence(rng, rng.integers(3, 8)),
            "label": labels[i % len(labels)],
        }
        for i in range(n)
    ]


def nli(rows):
    return datasets.Dataset.from_list([{k: row[k] for k in ("premise", "hypothesis", "label")} for row in rows])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A local mirror of the MNLI evaluation split, its few-shot pool, HANS and RTE (labels as the hub's)."""
    root = tmp_path_factory.mktemp("hf")
    files = {
        "nyu-mll/glue/mnli/validation_matched.jsonl": nli_rows(0, 20, [0, 2, 1], long_every=7),
        "nyu-mll/glue/mnli/validation_mismatched.jsonl": nli_rows(1, 24, [0, 2]),
        "jhu-cogsci/hans/plain_text/validation.jsonl": nli_rows(2, 12, [0, 1], long_every=5),
        "nyu-mll/glue/rte/train.jsonl": [
            {"sentence1": row["premise"], "sentence2": row["hypothesis"], "label": row["label"]}
            for row in nli_rows(5, 10, [1, 0])
        ],
    }
    for path, rows in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


@pytest.fixture(scope="module", params=[False, True], ids=["gpt2", "gpt2-with-bos"])
def tokenizer(request, gpt2_tokenizer_dir):
    """GPT-2's tokenizer, and the same set up as OPT's is, with a BOS before every prompt."""
    return AutoTokenizer.from_pretrained(gpt2_tokenizer_dir, add_bos_token=request.param)


def demonstration_texts(demonstrations):
    return [format_prompt(row["premise"], row["hypothesis"]) + ANSWERS[row["label"]] for row in demonstrations]


def expected_prompt(tokenizer, test_row, texts, kept):
    """The test prompt after the last `kept` demonstrations, tokenised whole."""
    shown = texts[len(texts) - kept :]
    return tokenizer(SEPARATOR.join([*shown, format_prompt(test_row["premise"], test_row["hypothesis"])]))["input_ids"]


def most_that_fit(tokenizer, test_row, texts, max_length):
    """How many demonstrations fit before the (untruncated) test prompt, tried one by one."""
    fits = [len(expected_prompt(tokenizer, test_row, texts, k)) <= max_length for k in range(len(texts) + 1)]
    return max(k for k, fit in enumerate(fits) if fit)


def in_context(tests, demonstrations, tokenizer, max_length, **options):
    zero_shot = tokenize_testset(tests, tokenizer, max_length=max_length, use_cache=False)
    icl = tokenize_in_context(
        tests,
        demonstrations,
        tokenizer,
        template=DEFAULT_TEMPLATE,
        answers=ANSWERS,
        max_length=max_length,
        zero_shot=zero_shot,
        **{"use_cache": False, **options},
    )
    return icl, zero_shot


TESTS = nli(nli_rows(3, 24, [0, 1], words=(3, 120), long_every=8))
DEMONSTRATIONS = nli(nli_rows(4, 8, [0, 1, 1, 0]))


def test_each_prompt_holds_the_most_demonstrations_nearest_it_that_fit(tokenizer):
    max_length = 160
    icl, zero_shot = in_context(TESTS, DEMONSTRATIONS, tokenizer, max_length)
    texts = demonstration_texts(DEMONSTRATIONS)
    np.testing.assert_array_equal(icl.labels, zero_shot.labels)
    np.testing.assert_array_equal(icl.truncated, zero_shot.truncated)
    assert 0 < icl.num_truncated < len(icl)
    for i, row in enumerate(TESTS):
        kept = int(icl.demonstrations[i])
        prompt = icl.prompt(i).tolist()
        assert len(prompt) <= max_length
        if kept:
            assert prompt == expected_prompt(tokenizer, row, texts, kept), i  # the last `kept`, in order
        else:
            assert prompt == zero_shot.prompt(i).tolist(), i
        if kept < len(texts) and not zero_shot.truncated[i]:  # one more would not fit
            assert len(expected_prompt(tokenizer, row, texts, kept + 1)) > max_length, i
        text = tokenizer.decode(prompt, skip_special_tokens=True)
        assert text.endswith(tokenizer.decode(zero_shot.prompt(i), skip_special_tokens=True)), i
        assert prompt.count(tokenizer.bos_token_id) == zero_shot.prompt(i).tolist().count(tokenizer.bos_token_id)
    kept = set(icl.demonstrations[~zero_shot.truncated].tolist())
    assert 0 in kept and len(kept & set(range(1, len(texts)))) > 1  # none, and several partial counts


def test_all_demonstrations_are_shown_when_they_fit(tokenizer):
    icl, zero_shot = in_context(TESTS, DEMONSTRATIONS, tokenizer, 1024)
    assert not zero_shot.num_truncated
    assert icl.demonstrations.tolist() == [len(DEMONSTRATIONS)] * len(TESTS)
    texts = demonstration_texts(DEMONSTRATIONS)
    assert icl.prompt(0).tolist() == expected_prompt(tokenizer, TESTS[0], texts, len(texts))


def test_a_prompt_without_room_for_a_demonstration_is_its_zero_shot_tokens(tokenizer):
    """Below the shortest prompt and demonstration together nothing is shown; truncated prompts keep their cut."""
    _, zero_shot = in_context(TESTS, DEMONSTRATIONS, tokenizer, 1024)
    alone = tokenizer([text + SEPARATOR for text in demonstration_texts(DEMONSTRATIONS)], add_special_tokens=False)
    max_length = int(zero_shot.lengths.min()) + min(map(len, alone["input_ids"])) - 1
    icl, zero_shot = in_context(TESTS, DEMONSTRATIONS, tokenizer, max_length)
    assert 0 < zero_shot.num_truncated < len(zero_shot) and not icl.demonstrations.any()
    for key in ("token_ids", "starts", "labels", "truncated"):
        np.testing.assert_array_equal(getattr(icl, key), getattr(zero_shot, key), err_msg=key)


def test_in_context_prompts_are_cached_by_what_they_depend_on(gpt2_tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    first, _ = in_context(TESTS, DEMONSTRATIONS, tokenizer, 160, cache_dir=tmp_path, use_cache=True)
    again, _ = in_context(TESTS, DEMONSTRATIONS, tokenizer, 160, cache_dir=tmp_path, use_cache=True)
    np.testing.assert_array_equal(again.token_ids, first.token_ids)
    np.testing.assert_array_equal(again.demonstrations, first.demonstrations)
    assert len(list((tmp_path / "in_context").glob("*.npz"))) == 1
    other = nli([{**row, "label": 1 - row["label"]} for row in DEMONSTRATIONS])  # other answers shown
    changed, _ = in_context(TESTS, other, tokenizer, 160, cache_dir=tmp_path, use_cache=True)
    assert len(list((tmp_path / "in_context").glob("*.npz"))) == 2
    assert not np.array_equal(changed.token_ids, first.token_ids)


@pytest.fixture(scope="module")
def icl_config(tmp_path_factory, gpt2_tokenizer_dir, data_dir):
    """The tiny engine config evaluated in context: two seeds x two shot counts, rows of 128 tokens."""
    root = tmp_path_factory.mktemp("icl")
    config = tiny_config(root / "out", gpt2_tokenizer_dir, data_dir, root / "cache")
    config.runs.shots = (2, 4)
    config.data.testsets = ("mnli", "hans", "rte")  # two OOD testsets, as the analysis needs
    config.data.max_length = 128
    config.eval.row_lengths = (128,)
    config.eval.in_context = True
    return config


def test_a_runs_demonstrations_are_the_few_shot_set_training_would_draw(icl_config, data_dir, gpt2_tokenizer_dir):
    runs = [(0, 2), (1, 2), (0, 4), (1, 4)]
    pool = training_pool("mnli", data_dir=data_dir)
    drawn = run_data.few_shot_datasets(read(icl_config).data, runs)
    for (seed, shots), demonstrations in zip(runs, drawn, strict=True):
        assert demonstrations.remove_columns(run_data.DATASET_INDEX).to_list() == few_shot(pool, shots, seed).to_list()
        assert sorted(demonstrations["label"]) == [0] * (shots // 2) + [1] * (shots // 2)
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    trained_on = run_data.few_shot_sets(read(icl_config).data, tokenizer, runs)
    for demonstrations, tokenized in zip(drawn, trained_on, strict=True):
        expected = tokenize_testset(demonstrations, tokenizer, max_length=128, use_cache=False)
        np.testing.assert_array_equal(tokenized.token_ids, expected.token_ids)


@pytest.fixture(scope="module")
def evaluated(icl_config):
    return evaluate.evaluate_job(check_config(icl_config, evaluation=True))


def test_in_context_runs_are_named_and_written_as_trained_runs_of_model_icl(icl_config, evaluated):
    expected = [(seed, shots) for seed in (0, 1) for shots in (2, 4)]  # seeds outermost, as training
    assert [(run.seed, run.shots) for run in evaluated] == expected
    for run in evaluated:
        assert run.name == results.run_name("opt-tiny-icl", "mnli", run.seed, run.shots) and run.adapter is None
        progress = results.read_progress(run.directory)
        assert progress.steps == (0,)
        section = progress.config[schema.RUN_SECTION]
        assert section == {
            schema.RUN_MODEL: "opt-tiny-icl",
            schema.RUN_SEED: run.seed,
            schema.RUN_SHOTS: run.shots,
            schema.RUN_EVALUATED: schema.EVALUATED_IN_CONTEXT,
        }
        with np.load(run.directory / schema.METRICS_FILENAME) as stored:
            assert stored[schema.TESTSETS].tolist() == ["mnli", "hans", "rte"]
            assert stored[schema.margin_key("hans")].shape == (1, 12)
    listed = analysis_runs.runs_overview(analysis_runs.find_runs(icl_config.output_dir))
    assert set(listed["model"]) == {"opt-tiny-icl"} and len(listed) == 4


def test_in_context_margins_are_the_base_models_on_the_full_prompt(icl_config, evaluated, data_dir, gpt2_tokenizer_dir):
    """Rebuilt independently: the run's few-shot draw, the most demonstrations that fit, a plain forward pass."""
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    model = models.from_config(TINY_OPT, dtype="float32", seed=icl_config.model.init_seed)
    pool = training_pool("mnli", data_dir=data_dir)
    max_length = icl_config.data.max_length

    def margin(ids):
        logits = model(jnp.asarray([ids]), jnp.ones((1, len(ids)), jnp.int32))[0, -1]
        return float(logits[3363] - logits[1400])  # " Yes", " No"

    shown_counts = set()
    for run in evaluated:
        texts = demonstration_texts(few_shot(pool, run.shots, run.seed))
        for name in ("mnli", "hans"):
            tests = stratified_subset(load_testset(name, data_dir=data_dir), 16, seed=0)
            with np.load(run.directory / schema.METRICS_FILENAME) as stored:
                ours = stored[schema.margin_key(name)][0].astype(np.float32)
            theirs, zero_shot = [], []
            for row in tests.select(range(4)):
                shown = most_that_fit(tokenizer, row, texts, max_length)
                shown_counts.add((run.shots, shown))
                theirs.append(margin(expected_prompt(tokenizer, row, texts, shown)))
                zero_shot.append(margin(expected_prompt(tokenizer, row, texts, 0)))
            np.testing.assert_allclose(ours[:4], theirs, atol=2e-3, err_msg=f"{run.name} {name}")  # float16 storage
            assert np.abs(np.asarray(theirs) - zero_shot).max() > 1e-2  # the demonstrations change the margins
    assert {(2, 1), (2, 2), (4, 3)} <= shown_counts  # every demonstration shown, and the farthest dropped


def test_training_and_adapters_refuse_in_context(icl_config, tmp_path):
    config = icl_config.copy_and_resolve_references()
    config.output_dir = str(tmp_path / "train")
    with pytest.raises(ValueError, match=r"^eval.in_context=True is for evaluation without training: run `python -m "):
        loop.train(check_config(config))
    config.output_dir = str(tmp_path / "eval")
    config.model.adapters = (str(tmp_path),)
    with pytest.raises(ValueError, match=r"eval.in_context=True .* model.adapters must be empty"):
        evaluate.evaluate_job(check_config(config, evaluation=True))
    assert not (tmp_path / "train").exists() and not (tmp_path / "eval").exists()
