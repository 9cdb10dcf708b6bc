"""A model whose outputs are not finite is not scored: a testset with a NaN or infinite margin has accuracy NaN,
said in one line per run and testset, and the analysis reads it as missing; a checkpoint with a NaN weight
stops training, `oodjax.evaluate` and the in-context baseline with one line naming the model, nothing recorded.
"""

import logging

import numpy as np
import pytest

from analysis import runs as analysis_runs
from analysis import schema
from oodjax import evaluate, usage_errors
from oodjax.config_checks import check_config
from oodjax.config_read import read
from oodjax.engine import loop, results
from oodjax.engine.evaluation import NonFiniteModelError
from tests.engine_configs import TINY_OPT, tiny_config


def test_a_non_finite_margin_makes_its_testsets_accuracy_nan_and_says_so(tmp_path, caplog):
    labels = {
        "mnli": np.array([0, 1, 1, 0]),
        "hans": np.array([1, 0, 1]),
        "rte": np.array([0, 1]),
        "train": np.array([0, 1]),
    }
    config = {"run": {"model": "opt-tiny", "seed": 0, "shots": 2}}
    run = results.RunResults(
        tmp_path / "opt-tiny_mnli_seed0_shots2", labels=labels, dataset_index=labels, in_domain="mnli", config=config
    )  # indices: any array of the shape
    margins = {
        "mnli": [1.0, -1.0, -1.0, 1.0],
        "hans": [-1.0, np.nan, -1.0],
        "rte": [np.inf, -1.0],
        "train": [1.0, -1.0],
    }
    with caplog.at_level(logging.WARNING):
        accuracies = run.add(0, margins, float("nan"))
    assert accuracies["mnli"] == 1.0 and accuracies["train"] == 1.0
    assert np.isnan(accuracies["hans"]) and np.isnan(accuracies["rte"])  # a NaN margin used to count as " No"
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "opt-tiny_mnli_seed0_shots2, step 0, hans: 1 of 3 margins are NaN or infinite; its accuracy is recorded as NaN",
        "opt-tiny_mnli_seed0_shots2, step 0, rte: 1 of 2 margins are NaN or infinite; its accuracy is recorded as NaN",
    ]
    run.write()
    record = analysis_runs.load_run(run.path)
    assert record.accuracy.loc[0, "mnli"] == 1.0 and record.accuracy.loc[0, ["hans", "rte"]].isna().all()


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory):
    """The engine tests' tiny OPT saved as a Hugging Face checkpoint, one weight NaN (a final layer norm scale)."""
    import torch
    import transformers

    torch.manual_seed(0)
    settings = {key: value for key, value in TINY_OPT.items() if key != "model_type"}
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**settings))
    with torch.no_grad():
        model.model.decoder.final_layer_norm.weight[0] = float("nan")
    path = tmp_path_factory.mktemp("checkpoints") / "opt-nan"
    model.save_pretrained(path)
    return path


def test_a_checkpoint_with_a_nan_weight_stops_every_evaluation_naming_it(
    nan_checkpoint, tmp_path, gpt2_tokenizer_dir, hf_data_dir, caplog, capsys
):
    config = tiny_config(tmp_path / "train", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.model.path, config.model.hf_config, config.model.name = str(nan_checkpoint), {}, ""
    message = rf"^model {nan_checkpoint}: its outputs are not finite: in its first evaluation every run \(2\) has "
    with caplog.at_level(logging.WARNING), pytest.raises(NonFiniteModelError, match=message):
        loop.train(check_config(config))
    for run in read(config).runs.runs():
        assert not (run.directory / schema.METRICS_FILENAME).exists()
        for testset, size in (("mnli", 16), ("hans", 16), ("train", 8)):  # one line per run and testset
            assert f"{run.name}, step 0, {testset}: {size} of {size} margins are NaN or infinite" in caplog.text

    config.output_dir = str(tmp_path / "evaluate")
    with pytest.raises(SystemExit) as exited, usage_errors.reported("python -m oodjax.evaluate"):
        evaluate.evaluate_job(check_config(config, evaluation=True))  # the base model
    assert exited.value.code == usage_errors.EXIT_STATUS
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"python -m oodjax.evaluate: error: model {nan_checkpoint}: its outputs are not finite")
    config.eval.in_context = True
    with pytest.raises(NonFiniteModelError, match=message):
        evaluate.evaluate_job(check_config(config, evaluation=True))
    assert not list((tmp_path / "evaluate").rglob(schema.METRICS_FILENAME))
