"""Synthetic results roots in the engine's metrics.npz schema, so analysis tests need no engine;
and the real BERTs-of-a-feather table the analysis tests check statistics on.

Accuracies follow a learning curve in-domain; every OOD testset is a smooth
function of in-domain accuracy plus residuals that share one correlation
across testsets. Margins and labels have the schema's shapes and dtypes
(margins are random: the analysis never reads them); a testset's labels are
the same in every run, as the engine evaluates the same examples in each, and
mostly unbalanced, so that its majority class is no 50% (the chance lines).
"""

import importlib.util
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis import schema
from analysis.null_rates import ar1_noise

# The eight testsets as the engine names them, plus accuracy on the training set.
TESTSETS = ("snli", "mnli", "scitail", "rte", "wnli", "paws", "hans", "anli_r3", schema.TRAIN_TESTSET)
EXAMPLES_PER_TESTSET = 16
# The in-domain testset's examples: its binomial noise sets the runs' in-domain reliability (and so which
# runs are flat, and the measurement-error correction); the curves' in-domain noise (sd 0.015) is about
# the binomial sd of 1,000 examples.
IN_DOMAIN_EXAMPLES = 1000
# The study's config files, one per model and training set ("opt2.7_mnli.py"; not the laptop configs).
SHIPPED_CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*_[ms]nli.py"))
assert len(SHIPPED_CONFIGS) == 16, SHIPPED_CONFIGS
# Model names as runs carry them, and the hub ids their configs load.
MODELS = {"opt-125m": "facebook/opt-125m", "SmolLM2-135M": "HuggingFaceTB/SmolLM2-135M"}
# McCoy et al. (2020): MNLI dev accuracy and HANS accuracies of 100 BERT runs, under the
# shared data root; its last rows summarise the runs (min, max, mean, sd) and are no runs.
BERTS = "reference/berts_of_a_feather_accuracies_by_run.csv"
BERTS_SUMMARY_ROWS = ["Minimum", "Maximum", "Mean", "Standard deviation"]
BERTS_IN_DOMAIN = "MNLI dev acc."


def berts_of_a_feather(shared_data: pathlib.Path) -> pd.DataFrame:
    """The table as the file has it, less its summary rows (its empty rows stay)."""
    table = pd.read_csv(shared_data / BERTS)
    return table[~table["Run"].isin(BERTS_SUMMARY_ROWS)]


def write_run(
    run_dir: pathlib.Path,
    *,
    steps: np.ndarray,
    testsets: list[str],
    accuracy: np.ndarray,
    in_domain: str,
    model: str,
    seed: int,
    shots: int,
    config: Mapping[str, Any] | None = None,
) -> pathlib.Path:
    """Write one run's metrics.npz exactly as analysis/schema.py describes it.

    `config` is the rest of the run's config (e.g. a shipped config's JSON);
    by default a model section loading `model` from the hub and train.steps
    equal to the last step. The run section is always set from the
    arguments, as the engine sets it.
    """
    if config is None:
        config = {"model": {"path": model, "hf_config": {}}, "train": {"steps": int(steps[-1])}}
    rng = np.random.default_rng(seed)
    arrays = {
        schema.STEP: np.asarray(steps, dtype=np.int64),
        schema.TESTSETS: np.asarray(testsets, dtype=str),
        schema.ACCURACY: np.asarray(accuracy, dtype=np.float32),
        schema.TRAIN_LOSS: np.linspace(0.7, 0.2, len(steps)).astype(np.float32),
        schema.IN_DOMAIN: np.asarray(in_domain, dtype=str),
        schema.CONFIG: np.asarray(
            json.dumps(
                dict(config)
                | {
                    schema.RUN_SECTION: {
                        schema.RUN_MODEL: model,
                        schema.RUN_SEED: seed,
                        schema.RUN_SHOTS: shots,
                    },
                }
            ),
            dtype=str,
        ),
    }
    for name in testsets:
        examples = IN_DOMAIN_EXAMPLES if name == in_domain else EXAMPLES_PER_TESTSET
        arrays[schema.margin_key(name)] = rng.normal(size=(len(steps), examples)).astype(np.float16)
        arrays[schema.label_key(name)] = np.random.default_rng(list(name.encode())).integers(0, 2, examples)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / schema.METRICS_FILENAME
    np.savez(path, **arrays)
    return path


def cut_short(path: pathlib.Path) -> pathlib.Path:
    """Keep the first half of the file's bytes, as a copy or a write killed midway leaves it."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def shipped_config(path: pathlib.Path) -> dict[str, Any]:
    """A config file's config as the engine stores it in metrics.npz (its JSON, parsed)."""
    spec = importlib.util.spec_from_file_location(f"shipped_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return json.loads(module.get_config().to_json())


def residual_correlations(model_index: int, count: int) -> np.ndarray:
    """A model's true correlation matrix of OOD residuals: two factors, mixed signs."""
    loadings = np.random.default_rng(1000 + model_index).uniform(-1.0, 1.0, (count, 2))
    loadings *= 0.85 / np.linalg.norm(loadings, axis=1, keepdims=True)
    return loadings @ loadings.T + np.diag(1.0 - np.sum(loadings**2, axis=1))


def synthetic_accuracies(
    rng: np.random.Generator,
    steps: np.ndarray,
    testsets: list[str],
    in_domain: str,
    *,
    correlations: np.ndarray,
) -> np.ndarray:
    """[steps, testsets] accuracies: OOD = tanh-shaped function of in-domain + correlated noise."""
    progress = 1.0 - np.exp(-steps / (0.3 * steps[-1] + 1.0))
    in_domain_accuracy = 0.5 + 0.35 * progress + rng.normal(0.0, 0.015, len(steps))
    ood = [t for t in testsets if t != in_domain]
    residuals = 0.02 * rng.multivariate_normal(np.zeros(len(ood)), correlations, len(steps))
    return np.clip(_around_in_domain(in_domain_accuracy, testsets, in_domain, residuals), 0.0, 1.0)


def _around_in_domain(
    in_domain_accuracy: np.ndarray, testsets: list[str], in_domain: str, ood_noise: np.ndarray
) -> np.ndarray:
    """[steps, testsets]: in-domain as given, each OOD testset a tanh of it plus its column of `ood_noise`."""
    ood = [t for t in testsets if t != in_domain]
    accuracy = np.empty((len(in_domain_accuracy), len(testsets)))
    for j, name in enumerate(testsets):
        if name == in_domain:
            accuracy[:, j] = in_domain_accuracy
        else:
            slope = 0.05 + 0.02 * ood.index(name)
            accuracy[:, j] = 0.55 + slope * np.tanh(8.0 * (in_domain_accuracy - 0.65)) + ood_noise[:, ood.index(name)]
    return accuracy


def autocorrelated_accuracies(
    rng: np.random.Generator,
    steps: np.ndarray,
    testsets: list[str],
    in_domain: str,
    *,
    coefficient: float,
    shared: float,
) -> np.ndarray:
    """[steps, testsets] accuracies whose every noise is AR(1) with `coefficient` over the steps:
    in-domain a learning curve, each OOD testset a tanh of it plus its own noise, and a share
    `shared` of that noise's variance common to all OOD testsets (0: OOD testsets independent
    given in-domain accuracy; then every partial correlation is truly 0)."""
    progress = 1.0 - np.exp(-steps / (0.3 * steps[-1] + 1.0))
    in_domain_accuracy = 0.5 + 0.35 * progress + 0.015 * ar1_noise(rng, (), len(steps), coefficient)
    ood = [t for t in testsets if t != in_domain]
    own = ar1_noise(rng, (len(ood),), len(steps), coefficient).T
    common = ar1_noise(rng, (1,), len(steps), coefficient).T
    noise = np.sqrt(1.0 - shared) * own + np.sqrt(shared) * common
    return _around_in_domain(in_domain_accuracy, testsets, in_domain, 0.02 * noise)


def write_results_root(
    root: pathlib.Path,
    *,
    models: Mapping[str, str] = MODELS,
    train_sets: tuple[str, ...] = ("mnli", "snli"),
    seeds: tuple[int, ...] = (0, 42, 99),
    shots: tuple[int, ...] = (32, 64),
    steps: Sequence[int] = tuple(range(0, 301, 25)),
    testsets: tuple[str, ...] = TESTSETS,
) -> list[pathlib.Path]:
    """One run directory per (model, training set, seed, shots), as the engine lays them out.

    `models` maps each run's model name to the hub id its config loads.
    """
    steps = np.asarray(steps)
    return [
        _write_synthetic_run(
            root,
            model_index,
            train_index,
            seed,
            shot,
            steps=steps,
            testsets=testsets,
            config={
                "model": {"path": hub_id, "hf_config": {}},
                "train": {"steps": int(steps[-1])},
                "data": {"train_set": train_set},
            },
            model=model,
        )
        for model_index, (model, hub_id) in enumerate(models.items())
        for train_index, train_set in enumerate(train_sets)
        for seed in seeds
        for shot in shots
    ]


def write_shipped_results_root(
    root: pathlib.Path,
    *,
    seeds: tuple[int, ...],
    shots: tuple[int, ...],
    steps: np.ndarray,
    testsets: tuple[str, ...] = TESTSETS,
) -> list[pathlib.Path]:
    """Runs of every shipped config (configs/<model>_<train>.py), each storing that config as
    the engine would, with train.steps set to the last of `steps` (the runs finished)."""
    paths = []
    for index, path in enumerate(SHIPPED_CONFIGS):
        config = shipped_config(path)
        config["train"]["steps"] = int(steps[-1])
        model = config["model"]["name"]
        for seed in seeds:
            for shot in shots:
                paths.append(
                    _write_synthetic_run(
                        root,
                        index // 2,
                        index % 2,
                        seed,
                        shot,
                        steps=steps,
                        testsets=testsets,
                        config=config,
                        model=model,
                    )
                )
    return paths


def _write_synthetic_run(
    root: pathlib.Path,
    model_index: int,
    train_index: int,
    seed: int,
    shot: int,
    *,
    steps: np.ndarray,
    testsets: tuple[str, ...],
    config: dict[str, Any],
    model: str,
) -> pathlib.Path:
    """One run of `synthetic_accuracies`, its randomness fixed by its place in the sweep."""
    train_set = config["data"]["train_set"]
    rng = np.random.default_rng([seed, shot, model_index, train_index])
    accuracy = synthetic_accuracies(
        rng,
        steps,
        list(testsets),
        train_set,
        correlations=residual_correlations(model_index, len(testsets) - 1),
    )
    return write_run(
        root / f"{model.replace('/', '-')}_{train_set}_seed{seed}_shots{shot}",
        steps=steps,
        testsets=list(testsets),
        accuracy=accuracy,
        in_domain=train_set,
        model=model,
        seed=seed,
        shots=shot,
        config=config,
    )
