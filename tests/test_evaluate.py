"""oodjax.evaluate: evaluation without training. The base model alone gives the margins a training job computes
at step 0 (its adapters start at zero), the adapters a job exported give that job's margins at its last step,
and both are written as metrics.npz files the analysis lists."""

import numpy as np
import pytest

from analysis import runs as analysis_runs
from analysis import schema
from oodjax import evaluate
from oodjax.engine import loop
from tests.engine_configs import tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, gpt2_tokenizer_dir, hf_data_dir):
    """The tiny two-run job, trained once with its adapters exported."""
    root = tmp_path_factory.mktemp("evaluate")
    config = tiny_config(root / "train", gpt2_tokenizer_dir, hf_data_dir, root / "cache")
    config.export.peft = True
    return config, loop.train(config), root


def evaluation_config(trained_config, output_dir, adapters=()):
    config = trained_config.copy_and_resolve_references()
    config.unlock()
    config.output_dir = str(output_dir)
    config.export.peft = False
    config.model.adapters = tuple(str(a) for a in adapters)
    config.data.testsets = ("mnli", "hans", "rte")  # two OOD testsets, as the analysis needs
    config.lock()
    return config


def margins(path):
    with np.load(path) as stored:
        return stored[schema.STEP].tolist(), {
            str(name): stored[schema.margin_key(str(name))][-1].astype(np.float32) for name in stored[schema.TESTSETS]
        }


def test_adapters_give_their_jobs_final_margins_and_the_base_its_step_0(trained):
    config, runs, root = trained
    adapters = [run.directory / loop.ADAPTER_DIR for run in runs]
    evaluated = evaluate.evaluate_config(evaluation_config(config, root / "eval", adapters))
    assert [run.name for run in evaluated] == [run.name for run in runs]  # named as the runs they came from
    for run, trained_run in zip(evaluated, runs, strict=True):
        steps, ours = margins(run.directory / schema.METRICS_FILENAME)
        _, theirs = margins(trained_run.directory / schema.METRICS_FILENAME)
        assert steps == [0] and set(ours) == {"mnli", "hans", "rte"}
        for name in ("mnli", "hans"):  # theirs has "train" too, the run's own few-shot set
            np.testing.assert_allclose(ours[name], theirs[name], atol=2e-3, err_msg=name)  # float16 storage

    (base,) = evaluate.evaluate_config(evaluation_config(config, root / "base"))
    assert base.name == "opt-tiny_mnli_base" and base.adapter is None
    with np.load(runs[0].directory / schema.METRICS_FILENAME) as stored:
        step0 = {name: stored[schema.margin_key(name)][0].astype(np.float32) for name in ("mnli", "hans")}
    _, ours = margins(base.directory / schema.METRICS_FILENAME)
    for name in step0:
        np.testing.assert_allclose(ours[name], step0[name], atol=2e-3, err_msg=name)
    assert np.abs(ours["mnli"] - theirs["mnli"]).max() > 1e-2  # training moved the margins: the test can tell

    listed = analysis_runs.runs_overview(analysis_runs.find_runs(root / "eval"))
    assert sorted(listed["seed"]) == [0, 1] and set(listed["last_step"]) == {0}


def test_a_second_call_skips_what_is_written_and_mismatched_adapters_are_refused(trained, tmp_path):
    config, runs, root = trained
    output = root / "eval"  # written by the test above, or now
    adapters = [run.directory / loop.ADAPTER_DIR for run in runs]
    before = {p: p.read_bytes() for p in output.glob(f"*/{schema.METRICS_FILENAME}")}
    evaluate.evaluate_config(evaluation_config(config, output, adapters))
    assert {p: p.read_bytes() for p in output.glob(f"*/{schema.METRICS_FILENAME}")} == before

    other = tmp_path / "other" / loop.ADAPTER_DIR
    other.mkdir(parents=True)
    (other / "adapter_model.safetensors").write_bytes((adapters[0] / "adapter_model.safetensors").read_bytes())
    settings = (adapters[0] / "adapter_config.json").read_text().replace('"r": 8', '"r": 2')
    (other / "adapter_config.json").write_text(settings)
    with pytest.raises(ValueError, match=r"model.adapters: .*other/adapter has rank 2.* must agree"):
        evaluate.evaluate_config(evaluation_config(config, tmp_path / "out", [adapters[0], other]))
