"""oodjax.evaluate: evaluation without training. The base model alone gives the margins a training job computes
at step 0 (its adapters start at zero), the adapters a job exported give that job's margins at its last step,
and both are written as metrics.npz files (with results.json) the analysis lists as evaluation-only runs. Also
what the job itself wrote: its results.json, and dataset indices that join its margins back to the data."""

import json

import jax
import numpy as np
import pytest
import safetensors.numpy

from analysis import runs as analysis_runs
from analysis import schema
from oodjax import evaluate
from oodjax.config_checks import check_config
from oodjax.data import few_shot, load_testset, stratified_subset, training_pool
from oodjax.engine import loop, results
from tests.engine_configs import tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, gpt2_tokenizer_dir, hf_data_dir):
    """The tiny two-run job, trained once with its adapters exported."""
    root = tmp_path_factory.mktemp("evaluate")
    config = tiny_config(root / "train", gpt2_tokenizer_dir, hf_data_dir, root / "cache")
    config.export.peft = True
    return config, loop.train(check_config(config)), root


def evaluation_config(trained_config, output_dir, adapters=()):
    config = trained_config.copy_and_resolve_references()
    config.unlock()
    config.output_dir = str(output_dir)
    config.export.peft = False
    config.model.adapters = tuple(str(a) for a in adapters)
    config.data.testsets = ("mnli", "hans", "rte")  # two OOD testsets, as the analysis needs
    config.lock()
    return config


def per_testset(path, prefix):
    """{testset: array} of one per-testset key (schema.index_key, ...) of a metrics.npz."""
    with np.load(path) as npz:
        return {str(name): npz[prefix + str(name)] for name in npz[schema.TESTSETS]}


def results_json(run_dir):
    return json.loads((run_dir / schema.RESULTS_FILENAME).read_text())


def pairs(dataset):
    return [(row["premise"], row["hypothesis"], row["label"]) for row in dataset]


def test_the_jobs_dataset_indices_join_its_margins_back_to_the_data(trained, hf_data_dir):
    """index/<testset> are the rows of the uncapped split that the eval_cap subset holds, index/train the pool rows
    of the run's few-shot draw, in the order of the margins; rebuilt here from the data functions alone."""
    config, runs, _ = trained
    pool = training_pool("mnli", data_dir=hf_data_dir)
    for run in runs:
        index = per_testset(run.directory / schema.METRICS_FILENAME, schema.INDEX_PREFIX)
        labels = per_testset(run.directory / schema.METRICS_FILENAME, schema.LABEL_PREFIX)
        for name in ("mnli", "hans"):
            split = load_testset(name, data_dir=hf_data_dir)
            assert len(index[name]) == 16 < len(split)  # capped: the rows are not simply 0..15
            assert pairs(split.select(index[name])) == pairs(stratified_subset(split, 16, seed=config.data.eval_seed))
            np.testing.assert_array_equal(split.select(index[name])["label"][:], labels[name])
        drawn = few_shot(pool, 8, run.seed)
        assert pairs(pool.select(index["train"])) == pairs(drawn)  # in the draw's order
        np.testing.assert_array_equal(drawn["label"][:], labels["train"])


def test_the_jobs_results_json_has_its_accuracies_and_timings(trained):
    _, runs, _ = trained
    for run in runs:
        summary = results_json(run.directory)
        with np.load(run.directory / schema.METRICS_FILENAME) as npz:
            steps, testsets, accuracy = npz[schema.STEP].tolist(), npz[schema.TESTSETS].tolist(), npz[schema.ACCURACY]
        assert summary[schema.RESULTS_RUN] == {
            "name": run.name,
            "model": "opt-tiny",
            "seed": run.seed,
            "shots": 8,
            "steps": 4,
            "warmup_steps": 1,  # the plan its length resolves to
            "evaluated_steps": [0, 2, 4],
        }
        assert summary[schema.RESULTS_STEPS] == steps == [0, 2, 4]
        for column, name in enumerate(testsets):
            final, best = (summary[schema.RESULTS_PER_TESTSET][name][key] for key in ("final", "best"))
            assert final == {"step": 4, "accuracy": accuracy[-1, column]}
            assert best["accuracy"] == accuracy[:, column].max()
            assert best["step"] == steps[int(np.argmax(accuracy[:, column]))]
        timings = summary[schema.RESULTS_TIMINGS]
        per_step = [(e["step"], e["train_seconds"]) for e in timings["evaluations"]]
        assert per_step[0] == (0, 0.0) and all(seconds > 0 for _, seconds in per_step[1:])  # trained between
        assert timings["train_seconds"] == pytest.approx(sum(seconds for _, seconds in per_step))
        assert all(e["evaluation_seconds"] > 0 for e in timings["evaluations"])
        assert summary[schema.RESULTS_VERSIONS]["jax"] == jax.__version__


def margins(path):
    with np.load(path) as stored:
        return stored[schema.STEP].tolist(), {
            str(name): stored[schema.margin_key(str(name))][-1].astype(np.float32) for name in stored[schema.TESTSETS]
        }


def test_adapters_give_their_jobs_final_margins_and_the_base_its_step_0(trained):
    config, runs, root = trained
    adapters = [run.directory / results.ADAPTER_DIR for run in runs]
    evaluated = evaluate.evaluate_job(check_config(evaluation_config(config, root / "eval", adapters), evaluation=True))
    assert [run.name for run in evaluated] == [run.name for run in runs]  # named as the runs they came from
    for run, trained_run in zip(evaluated, runs, strict=True):
        steps, ours = margins(run.directory / schema.METRICS_FILENAME)
        _, theirs = margins(trained_run.directory / schema.METRICS_FILENAME)
        assert steps == [0] and set(ours) == {"mnli", "hans", "rte"}
        for name in ("mnli", "hans"):  # theirs has "train" too, the run's own few-shot set
            np.testing.assert_allclose(ours[name], theirs[name], atol=2e-3, err_msg=name)  # float16 storage
        our_index = per_testset(run.directory / schema.METRICS_FILENAME, schema.INDEX_PREFIX)
        their_index = per_testset(trained_run.directory / schema.METRICS_FILENAME, schema.INDEX_PREFIX)
        for name in ("mnli", "hans"):  # the same examples, the same rows
            np.testing.assert_array_equal(our_index[name], their_index[name])
        summary = results_json(run.directory)
        assert summary[schema.RESULTS_RUN][schema.RUN_EVALUATED] == schema.EVALUATED_ADAPTER
        (evaluation,) = summary[schema.RESULTS_TIMINGS]["evaluations"]
        assert evaluation["train_seconds"] is None and evaluation["evaluation_seconds"] > 0  # nothing trained here

    (base,) = evaluate.evaluate_job(check_config(evaluation_config(config, root / "base"), evaluation=True))
    assert base.name == "opt-tiny_mnli_base" and base.adapter is None
    assert results_json(base.directory)[schema.RESULTS_RUN][schema.RUN_EVALUATED] == schema.EVALUATED_BASE
    with np.load(runs[0].directory / schema.METRICS_FILENAME) as stored:
        step0 = {name: stored[schema.margin_key(name)][0].astype(np.float32) for name in ("mnli", "hans")}
    _, ours = margins(base.directory / schema.METRICS_FILENAME)
    for name in step0:
        np.testing.assert_allclose(ours[name], step0[name], atol=2e-3, err_msg=name)
    assert np.abs(ours["mnli"] - theirs["mnli"]).max() > 1e-2  # training moved the margins: the test can tell

    listed = analysis_runs.runs_overview(analysis_runs.find_runs(root / "eval"))
    assert sorted(listed["seed"]) == [0, 1] and set(listed["last_step"]) == {0}
    assert set(listed["kind"]) == {"evaluated (adapter)"} and listed["finished"].all()  # not "step 0 of 4"
    (listed,) = analysis_runs.runs_overview(analysis_runs.find_runs(root / "base")).itertuples()
    assert (listed.kind, listed.finished) == ("evaluated (base model)", True)


def test_a_second_call_skips_what_is_written_and_mismatched_adapters_are_refused(trained, tmp_path):
    config, runs, root = trained
    output = root / "eval"  # written by the test above, or now
    adapters = [run.directory / results.ADAPTER_DIR for run in runs]
    before = {p: p.read_bytes() for p in output.glob(f"*/{schema.METRICS_FILENAME}")}
    evaluate.evaluate_job(check_config(evaluation_config(config, output, adapters), evaluation=True))
    assert {p: p.read_bytes() for p in output.glob(f"*/{schema.METRICS_FILENAME}")} == before

    other = tmp_path / "other" / results.ADAPTER_DIR  # an adapter of rank 2: good alone, not beside one of rank 8
    other.mkdir(parents=True)
    tensors = safetensors.numpy.load_file(str(adapters[0] / "adapter_model.safetensors"))
    rank2 = {k: np.ascontiguousarray(v[:2] if ".lora_A." in k else v[:, :2]) for k, v in tensors.items()}
    safetensors.numpy.save_file(rank2, str(other / "adapter_model.safetensors"))
    settings = (adapters[0] / "adapter_config.json").read_text().replace('"r": 8', '"r": 2')
    (other / "adapter_config.json").write_text(settings)
    with pytest.raises(ValueError, match=r"model.adapters: .*other/adapter has rank 2.* must agree"):
        evaluate.evaluate_job(
            check_config(evaluation_config(config, tmp_path / "out", [adapters[0], other]), evaluation=True)
        )
