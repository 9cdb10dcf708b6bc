"""Runs the previous format stored (its config as the record, no resolved plan) still resume and analyse.

tests/data/stored_runs_v0/ holds two runs of ``tiny_config`` (and RTE) as commit 882f398 wrote them, its tokenizer, data
and cache named relative to the checkout: seed 1 trained to its last step (its checkpoints left out), seed 0
stopped by SIGUSR1 after step 2 (its checkpoint at 2, its evaluations at 0 and 2). The script that wrote them:
that commit's ``loop.train`` on seed 1, then on seed 0 with ``make_train_step`` signalling at step 2.
"""

import logging
import shutil

import numpy as np

from analysis import runs as analysis_runs
from analysis import schema
from oodjax.config_checks import check_config
from oodjax.engine import loop
from tests.conftest import ROOT
from tests.engine_configs import tiny_config

STORED = ROOT / "tests" / "data" / "stored_runs_v0"


def _config(output_dir):
    config = tiny_config(output_dir, "../shared/data/tokenizers/gpt2", "../shared/data/hf", ".cache/stored_runs_v0")
    config.data.testsets = ("mnli", "hans", "rte")  # two OOD testsets: a pair the analysis reads
    return config


def test_runs_the_previous_format_stored_resume_and_analyse_as_if_never_stopped(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(ROOT)  # the stored config's relative paths
    shutil.copytree(STORED, tmp_path / "stored")
    with caplog.at_level(logging.INFO):
        loop.train(check_config(_config(tmp_path / "stored")))
    assert "seed0_shots8 resumes from its checkpoint at step 2, seed1_shots8 finished (step 4), skipped" in caplog.text
    for seed in (0, 1):  # each as the stored runs trained: alone (a row's runs share its sums)
        reference = _config(tmp_path / "reference")
        reference.runs.seeds = (seed,)
        loop.train(check_config(reference))
    for name in ("opt-tiny_mnli_seed0_shots8", "opt-tiny_mnli_seed1_shots8"):
        with np.load(tmp_path / "reference" / name / schema.METRICS_FILENAME) as expected:
            with np.load(tmp_path / "stored" / name / schema.METRICS_FILENAME) as got:
                assert expected.keys() == got.keys() and got[schema.STEP].tolist() == [0, 2, 4]
                for key in expected.keys() - {schema.CONFIG}:
                    np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{name}: {key}")
    for seed in (0, 1):
        record = analysis_runs.load_run(tmp_path / "stored" / f"opt-tiny_mnli_seed{seed}_shots8" / "metrics.npz")
        assert record.seed == seed and record.finished and record.steps.tolist() == [0, 2, 4]
