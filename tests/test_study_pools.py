"""The study configs draw their few-shot sets from their training set's `train` split, never from what they score.

The hub's MNLI and SNLI train splits (393k and 550k rows) are not in the
shared data, so small stand-in train files, of text no evaluation split
holds, sit in a copy of the mirror beside the real evaluation splits: every
drawn example must come from the stand-in and from no evaluation split.
"""

import functools
import json
import pathlib

import pytest

from configs import demo
from launch.config_files import experiment_config_paths, load_config
from oodjax.config_read import read
from oodjax.data import load_testset, testsets, training_pool
from oodjax.engine.run_data import few_shot_datasets

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUDY_CONFIGS = experiment_config_paths([str(ROOT / "configs" / "*_[ms]nli.py")])
RUNS = [(0, 32), (42, 64), (99, 128)]


def test_there_are_sixteen_study_configs():
    assert len(STUDY_CONFIGS) == 16


@pytest.fixture(scope="module")
def mirror(tmp_path_factory, hf_data_dir):
    """The shared mirror's splits, linked, plus a stand-in `train` split of MNLI and SNLI: 300 rows each, labels
    as the hub's (0 entailment, 1 neutral, 2 contradiction)."""
    root = tmp_path_factory.mktemp("mirror")
    for path in hf_data_dir.rglob("*.jsonl"):
        target = root / path.relative_to(hf_data_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(path)
    for name in ("mnli", "snli"):
        spec = testsets.testset_spec(name)
        rows = [
            {
                spec.premise: f"{name} stand-in premise {i}",
                spec.hypothesis: f"{name} stand-in hypothesis {i}",
                spec.label: i % 3,
            }
            for i in range(300)
        ]
        train = testsets.mirror_folder(spec, root) / "train.jsonl"
        train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


@pytest.mark.parametrize("path", STUDY_CONFIGS, ids=lambda path: pathlib.Path(path).stem)
def test_a_study_config_draws_from_its_train_split_and_nothing_it_evaluates(path, mirror):
    config = load_config(path)
    assert config.data.pool_split == "train"
    config.data.data_dir = str(mirror)
    train = _pairs(training_pool(config.data.train_set, split="train", data_dir=mirror))
    evaluated = set().union(*(_evaluated(name, mirror, config.data.neutral) for name in config.data.testsets))
    for drawn in few_shot_datasets(read(config).data, RUNS):
        pairs = {(row["premise"], row["hypothesis"]) for row in drawn}
        assert pairs <= train and not pairs & evaluated


def _pairs(dataset):
    return {(row["premise"], row["hypothesis"]) for row in dataset}


@functools.cache
def _evaluated(name, mirror, neutral):
    """(premise, hypothesis) of every row of a testset's evaluation split, read once for all configs."""
    return _pairs(load_testset(name, data_dir=mirror, neutral=neutral))


def test_the_demo_keeps_the_offline_pool():
    """The demo, tests and laptop configs draw from the table's offline pools (docs/data.md)."""
    assert demo.get_config().data.pool_split == ""
