"""The engine learns: a task decided by one word of the premise goes from chance to > 95% accuracy.

A random tiny OPT with a frozen base can only succeed if gradients reach the
adapters, the loss targets the right answer token at the right position, and
evaluation reads the margins back in the examples' order.
"""

import json

import numpy as np

from analysis import schema
from oodjax.config_checks import check_config
from oodjax.engine import loop
from tests.engine_configs import tiny_config

FILLER = "the a old new small big red blue green cat dog bird man woman car house tree river city song book".split()
KEYWORDS = {0: "open", 2: "closed"}  # MNLI label ids: 0 entailment, 2 contradiction


def _write_synthetic_mnli(root, rng):
    """MNLI-shaped files whose label is set by one word ("open"/"closed") in a random premise."""
    folder = root / "nyu-mll" / "glue" / "mnli"
    folder.mkdir(parents=True)
    for split, rows in (("validation_mismatched", 400), ("validation_matched", 200)):
        with (folder / f"{split}.jsonl").open("w") as f:
            for idx in range(rows):
                label = int(rng.choice([0, 2]))
                words = list(rng.choice(FILLER, size=int(rng.integers(4, 10))))
                words.insert(int(rng.integers(0, len(words) + 1)), KEYWORDS[label])
                premise = " ".join(words).capitalize() + "."
                row = {"premise": premise, "hypothesis": "The door is open.", "label": label, "idx": idx}
                f.write(json.dumps(row) + "\n")


def test_accuracy_goes_from_chance_to_above_95_percent(tmp_path, gpt2_tokenizer_dir):
    _write_synthetic_mnli(tmp_path / "data", np.random.default_rng(0))
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, tmp_path / "data", tmp_path / "cache")
    config.data.testsets = ("mnli",)
    config.data.eval_cap = 0  # all 200 held-out examples
    config.runs.shots = (256,)
    config.train.steps = 300
    config.train.learning_rate = 5e-3
    config.train.warmup_steps = 20
    config.lora.dropout = 0.0
    config.eval.every = 50
    config.checkpoint_every = 300
    config.log_every = 50
    for run in loop.train(check_config(config)):  # seeds 0 and 1
        with np.load(run.directory / schema.METRICS_FILENAME) as npz:
            mnli = npz[schema.TESTSETS].tolist().index("mnli")
            accuracy = npz[schema.ACCURACY][:, mnli]
        print(run.name, "held-out accuracy by evaluation:", accuracy.round(3).tolist())
        assert 0.3 <= accuracy[0] <= 0.7  # chance before training
        assert accuracy[-1] > 0.95
