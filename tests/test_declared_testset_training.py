"""End to end: a testset declared in the config (a CSV written here) and other answer words, trained, stored and
analysed as the built-in testsets are.

Needs the engine to read `data.extra_testsets` (oodjax/engine/run_data.py) and `data.answers`
(oodjax/engine/loop.py).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from analysis import schema
from analysis.cli import main as analyse
from analysis.outputs import CSV_NAME
from analysis.runs import load_run
from oodjax import models
from oodjax.config_checks import check_config
from oodjax.engine import loop
from tests.engine_configs import TINY_OPT, tiny_config

TEMPLATE = "{premise} Question: {hypothesis} True or False?"
ANSWERS = (" True", " False")  # GPT-2 ids 6407 and 10352
ANIMALS = ("cat", "dog", "horse", "bird", "fish", "mouse")
# 12 entailed, 12 contradicted and 6 neutral (dropped) pairs, as the gold words of a made-up testset.
ROWS = [
    (f"The {animal} sleeps in the {place}.", hypothesis, gold)
    for animal in ANIMALS
    for place in ("barn", "garden")
    for hypothesis, gold in (
        (f"A {animal} is asleep.", "entailed"),
        (f"The {animal} runs in the {place}.", "contradicted"),
        *([(f"The {animal} is hungry.", "unknown")] if place == "barn" else []),
    )
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, gpt2_tokenizer_dir, hf_data_dir):
    """Two runs of the tiny engine config evaluating mnli, hans and the declared `farm`, with True/False answers."""
    folder = tmp_path_factory.mktemp("declared")
    source = folder / "farm.csv"
    source.write_text("sentence,claim,gold\n" + "".join(f'"{p}","{h}",{g}\n' for p, h, g in ROWS))
    config = tiny_config(folder / "out", gpt2_tokenizer_dir, hf_data_dir, folder / "cache")
    config.data.extra_testsets = {
        "farm": {
            "source": str(source),
            "premise": "sentence",
            "hypothesis": "claim",
            "label": "gold",
            "entailment": ["entailed"],
            "not_entailment": ["contradicted"],
            "neutral": ["unknown"],
            "cap": 0,
        },  # every row, whatever data.eval_cap (16) says
    }
    config.data.testsets = ("mnli", "hans", "farm")
    config.data.template = TEMPLATE
    config.data.answers = ANSWERS
    runs = loop.train(check_config(config))
    return config, runs, folder


def read_npz(run):
    with np.load(run.directory / schema.METRICS_FILENAME, allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def test_the_declared_testset_is_evaluated_and_stored_under_its_name(trained):
    config, runs, _ = trained
    expected_labels = [0 if gold == "entailed" else 1 for _, _, gold in ROWS if gold != "unknown"]
    assert len(expected_labels) == 24
    for run in runs:
        stored = read_npz(run)
        assert stored[schema.TESTSETS].tolist() == ["mnli", "hans", "farm", schema.TRAIN_TESTSET]
        assert stored[schema.label_key("farm")].tolist() == expected_labels  # all 24, not eval_cap's 16
        margins = stored[schema.margin_key("farm")]
        assert margins.shape == (len(stored[schema.STEP]), 24)
        accuracy = ((margins > 0) == (np.array(expected_labels) == 0)).mean(axis=1)
        np.testing.assert_allclose(stored[schema.ACCURACY][:, 2], accuracy)
        assert len(stored[schema.label_key("hans")]) == 16


def test_margins_are_read_at_the_declared_answer_words(trained, gpt2_tokenizer_dir):
    """Step 0 (LoRA's B is zero): each stored margin is logit(" True") - logit(" False") of the initial model."""
    config, runs, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    true_id, false_id = (tokenizer.encode(word) for word in ANSWERS)
    assert (true_id, false_id) == ([6407], [10352])
    model = models.from_config(TINY_OPT, dtype="float32", seed=config.model.init_seed)
    logits = []
    for premise, hypothesis, gold in ROWS:
        if gold != "unknown":
            ids = jnp.asarray([tokenizer(TEMPLATE.format(premise=premise, hypothesis=hypothesis))["input_ids"]])
            logits.append(np.asarray(model(ids, jnp.ones_like(ids))[0, -1]))
    logits = np.stack(logits)
    expected = logits[:, 6407] - logits[:, 10352]
    default_words = logits[:, 3363] - logits[:, 1400]  # " Yes" - " No"
    stored = read_npz(runs[0])[schema.margin_key("farm")][0].astype(np.float32)
    np.testing.assert_allclose(stored, expected, rtol=2e-3, atol=2e-3 * np.abs(expected).max())
    assert np.abs(stored - default_words).max() > 20 * 2e-3 * np.abs(expected).max()


def test_the_analysis_reads_the_declared_testset_as_an_ood_testset(trained):
    _, runs, folder = trained
    run = load_run(runs[0].directory / schema.METRICS_FILENAME)
    assert run.ood_testsets == ["hans", "farm"]
    assert analyse([str(folder / "out"), "--out", str(folder / "analysis")]) == 0
    csv = (folder / "analysis" / CSV_NAME).read_text()
    assert ",hans,farm," in csv
