"""The results schema of one run: the single place its key names live.

The engine (oodjax/engine/results.py) writes `<output_dir>/<run_name>/metrics.npz`
with these keys and the analysis reads them, so both import the names from
here; `finished` is the one definition of a finished run. This module must
stay free of any import beyond the standard library: the analysis runs on a
laptop without JAX.

Layout of metrics.npz (S evaluation steps, K testsets, N_t examples of testset t):

    step         int   [S]        optimizer step of each evaluation, increasing
    testsets     str   [K]        testset names; columns of `accuracy`
    accuracy     float [S, K]     accuracy in [0, 1] per step and testset
    train_loss   float [S]        training loss at each evaluation step
    in_domain    str   []         name of the in-domain testset (one of `testsets`)
    config       str   []         JSON of the run's config; its RUN_SECTION
                                  identifies the run (see below)
    margin/<t>   float16 [S, N_t] logit(" Yes") - logit(" No") per example
    label/<t>    int   [N_t]      0 = entailment, 1 = not entailment
    index/<t>    int   [N_t]      each example's row in its dataset as loaded
                                  (a testset: `load_testset`'s split, before
                                  any cap; `train`: the training pool): the
                                  key to join margins back to the data

Strings are numpy unicode arrays (never object arrays), so `np.load(path,
allow_pickle=False)` reads every key. `index/<t>` came later than the other
keys: a file without it is still a run's results (readers must not require
it), as a reader must ignore keys it does not know.

Beside metrics.npz, `results.json` (RESULTS_FILENAME) summarises the run for
a reader without numpy, in the spirit of lm-evaluation-harness's results
file; it is rewritten with metrics.npz and holds, under these fields:

    run        the config's run section (below), and `name`: the directory
    in_domain  as in metrics.npz
    steps      the evaluated steps
    results    per testset: `examples`, `final` and `best`, each an object
               {`step`, `accuracy`} (`final`: the last evaluation so far;
               `best`: the highest accuracy, its earliest step); NaN is null
    timings    `train_seconds` and `evaluation_seconds` in total, and per
               evaluation (`evaluations`: {`step`, `train_seconds`,
               `evaluation_seconds`}); null where not measured
    versions   python, oodjax, jax, flax and the rest of the stack, as the
               writing process had them (null: not installed), and
               `oodjax_commit`, the git commit of a checkout
    devices    the writing process's `platform` (JAX backend), device `kind`,
               device `count` and `processes`
    config     the run's config, as in metrics.npz

metrics.npz stays the record the analysis reads; results.json is derived
from it (plus the timings, versions and devices), one evaluation behind at
most if a job dies between the two writes.
"""

from collections.abc import Mapping, Sequence
from typing import Any

STEP = "step"
TESTSETS = "testsets"
ACCURACY = "accuracy"
TRAIN_LOSS = "train_loss"
IN_DOMAIN = "in_domain"
CONFIG = "config"
MARGIN_PREFIX = "margin/"
LABEL_PREFIX = "label/"
INDEX_PREFIX = "index/"

REQUIRED_KEYS = (STEP, TESTSETS, ACCURACY, TRAIN_LOSS, IN_DOMAIN, CONFIG)

METRICS_FILENAME = "metrics.npz"
RESULTS_FILENAME = "results.json"

# results.json's fields (layout above).
RESULTS_RUN = "run"
RESULTS_NAME = "name"  # in RESULTS_RUN, beside the run section's fields
RESULTS_IN_DOMAIN = "in_domain"
RESULTS_STEPS = "steps"
RESULTS_PER_TESTSET = "results"
RESULTS_EXAMPLES = "examples"
RESULTS_FINAL = "final"
RESULTS_BEST = "best"
RESULTS_STEP = "step"
RESULTS_ACCURACY = "accuracy"
RESULTS_TIMINGS = "timings"
RESULTS_TRAIN_SECONDS = "train_seconds"
RESULTS_EVALUATION_SECONDS = "evaluation_seconds"
RESULTS_EVALUATIONS = "evaluations"
RESULTS_VERSIONS = "versions"
RESULTS_DEVICES = "devices"
RESULTS_CONFIG = "config"

# Name under which accuracy on the run's own few-shot training set is stored
# in `testsets`, if it is stored there: it is neither in-domain nor OOD, so the
# analysis leaves it out of the correlations.
TRAIN_TESTSET = "train"

# The run's identity inside the config JSON: config[RUN_SECTION] is an object
# {RUN_MODEL: short model name (e.g. "opt-2.7b"), RUN_SEED: int, RUN_SHOTS: int,
# RUN_STEPS: int, the run's own total steps (train.steps, or from train.epochs;
# absent from runs written before it and from oodjax.evaluate's), RUN_WARMUP_STEPS
# and RUN_EVALUATED_STEPS: its warm-up and the steps it is evaluated at, as its
# length resolves them (absent from runs written before them)}.
# The training set is `in_domain`.
RUN_SECTION = "run"
RUN_MODEL = "model"
RUN_SEED = "seed"
RUN_SHOTS = "shots"
RUN_STEPS = "steps"
RUN_WARMUP_STEPS = "warmup_steps"
RUN_EVALUATED_STEPS = "evaluated_steps"
RUN_PLAN = (RUN_STEPS, RUN_WARMUP_STEPS, RUN_EVALUATED_STEPS)  # what a resumed run is compared by
# Runs written by `python -m oodjax.evaluate` (one evaluation, at step 0, no
# training) say so in their run section: RUN_EVALUATED is one of
# EVALUATED_KINDS. A trained run has no such field. (Files written before the
# field existed are told apart by `analysis.runs` from their config.)
RUN_EVALUATED = "evaluated"
EVALUATED_BASE = "base"  # the base model alone
EVALUATED_ADAPTER = "adapter"  # the base model with one adapter of model.adapters
EVALUATED_IN_CONTEXT = "in_context"  # the base model prompted with the run's few-shot set
EVALUATED_KINDS = (EVALUATED_BASE, EVALUATED_ADAPTER, EVALUATED_IN_CONTEXT)
TRAIN_SECTION = "train"
TRAIN_STEPS = "steps"


def planned_steps(config: Mapping[str, Any], evaluated: str | None) -> int | None:
    """The step a trained run ends at: its run section's RUN_STEPS, else the config's train.steps;
    None when the config says neither or nothing was trained (`evaluated` is one of EVALUATED_KINDS)."""
    if evaluated is not None:
        return None
    steps = (config.get(RUN_SECTION) or {}).get(RUN_STEPS)
    if steps is None:
        steps = (config.get(TRAIN_SECTION) or {}).get(TRAIN_STEPS)
    return None if steps is None else int(steps)


def finished(steps: Sequence[int], config: Mapping[str, Any], evaluated: str | None) -> bool:
    """What "finished" means, for every reader of results (analysis.runs and python -m analysis):
    a trained run whose last evaluated step is its `planned_steps`; an evaluation-only run
    (`evaluated` set) that has its evaluation."""
    if evaluated is not None:
        return len(steps) > 0
    planned = planned_steps(config, evaluated)
    return planned is not None and len(steps) > 0 and int(steps[-1]) == planned


def margin_key(testset: str) -> str:
    return MARGIN_PREFIX + testset


def label_key(testset: str) -> str:
    return LABEL_PREFIX + testset


def index_key(testset: str) -> str:
    return INDEX_PREFIX + testset
