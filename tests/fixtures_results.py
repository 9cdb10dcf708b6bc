"""Synthetic results roots in the engine's metrics.npz schema, so analysis tests need no engine.

Accuracies follow a learning curve in-domain; every OOD testset is a smooth
function of in-domain accuracy plus residuals that share one correlation
across testsets. Margins and labels have the schema's shapes and dtypes
(margins are random: the analysis never reads them).
"""

import json
import pathlib

import numpy as np

from analysis import schema

# The eight testsets as the engine names them, plus accuracy on the training set.
TESTSETS = (
    "snli", "mnli", "scitail", "rte", "wnli", "paws", "hans", "anli_r3", schema.TRAIN_TESTSET
)
EXAMPLES_PER_TESTSET = 16


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
) -> pathlib.Path:
    """Write one run's metrics.npz exactly as analysis/schema.py describes it."""
    rng = np.random.default_rng(seed)
    arrays = {
        schema.STEP: np.asarray(steps, dtype=np.int64),
        schema.TESTSETS: np.asarray(testsets, dtype=str),
        schema.ACCURACY: np.asarray(accuracy, dtype=np.float32),
        schema.TRAIN_LOSS: np.linspace(0.7, 0.2, len(steps)).astype(np.float32),
        schema.IN_DOMAIN: np.asarray(in_domain, dtype=str),
        schema.CONFIG: np.asarray(
            json.dumps(
                {
                    schema.RUN_SECTION: {
                        schema.RUN_MODEL: model,
                        schema.RUN_SEED: seed,
                        schema.RUN_SHOTS: shots,
                    },
                    "train": {"steps": int(steps[-1])},
                }
            ),
            dtype=str,
        ),
    }
    for name in testsets:
        arrays[schema.margin_key(name)] = rng.normal(
            size=(len(steps), EXAMPLES_PER_TESTSET)
        ).astype(np.float16)
        arrays[schema.label_key(name)] = rng.integers(0, 2, EXAMPLES_PER_TESTSET)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / schema.METRICS_FILENAME
    np.savez(path, **arrays)
    return path


def residual_correlations(model_index: int, count: int) -> np.ndarray:
    """A model's true correlation matrix of OOD residuals: two factors, mixed signs."""
    loadings = np.random.default_rng(1000 + model_index).uniform(-1.0, 1.0, (count, 2))
    loadings *= 0.85 / np.linalg.norm(loadings, axis=1, keepdims=True)
    return loadings @ loadings.T + np.diag(1.0 - np.sum(loadings**2, axis=1))


def synthetic_accuracies(
    rng: np.random.Generator, steps: np.ndarray, testsets: list[str], in_domain: str, *,
    correlations: np.ndarray,
) -> np.ndarray:
    """[steps, testsets] accuracies: OOD = tanh-shaped function of in-domain + correlated noise."""
    progress = 1.0 - np.exp(-steps / (0.3 * steps[-1] + 1.0))
    in_domain_accuracy = 0.5 + 0.35 * progress + rng.normal(0.0, 0.015, len(steps))
    ood = [t for t in testsets if t != in_domain]
    residuals = 0.02 * rng.multivariate_normal(np.zeros(len(ood)), correlations, len(steps))
    accuracy = np.empty((len(steps), len(testsets)))
    for j, name in enumerate(testsets):
        if name == in_domain:
            accuracy[:, j] = in_domain_accuracy
        else:
            slope = 0.05 + 0.02 * ood.index(name)
            accuracy[:, j] = (
                0.55
                + slope * np.tanh(8.0 * (in_domain_accuracy - 0.65))
                + residuals[:, ood.index(name)]
            )
    return np.clip(accuracy, 0.0, 1.0)


def write_results_root(
    root: pathlib.Path,
    *,
    models: tuple[str, ...] = ("opt-125m", "SmolLM2-135M"),
    train_sets: tuple[str, ...] = ("mnli", "snli"),
    seeds: tuple[int, ...] = (0, 42, 99),
    shots: tuple[int, ...] = (32, 64),
    steps: np.ndarray = np.arange(0, 301, 25),
    testsets: tuple[str, ...] = TESTSETS,
) -> list[pathlib.Path]:
    """One run directory per (model, training set, seed, shots), as the engine lays them out."""
    paths = []
    for model_index, model in enumerate(models):
        for train_index, train_set in enumerate(train_sets):
            for seed in seeds:
                for shot in shots:
                    rng = np.random.default_rng([seed, shot, model_index, train_index])
                    paths.append(
                        write_run(
                            root / f"{model}_{train_set}_seed{seed}_shots{shot}",
                            steps=steps,
                            testsets=list(testsets),
                            accuracy=synthetic_accuracies(
                                rng,
                                steps,
                                list(testsets),
                                train_set,
                                correlations=residual_correlations(
                                    model_index, len(testsets) - 1
                                ),
                            ),
                            in_domain=train_set,
                            model=model,
                            seed=seed,
                            shots=shot,
                        )
                    )
    return paths
