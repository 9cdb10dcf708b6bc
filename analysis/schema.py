"""The results schema of one run: the single place its key names live.

The engine (oodjax/engine/results.py) writes `<output_dir>/<run_name>/metrics.npz`
with these keys and the analysis reads them, so both import the names from
here. This module must stay free of any import beyond the standard library:
the analysis runs on a laptop without JAX.

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

Strings are numpy unicode arrays (never object arrays), so `np.load(path,
allow_pickle=False)` reads every key.
"""

STEP = "step"
TESTSETS = "testsets"
ACCURACY = "accuracy"
TRAIN_LOSS = "train_loss"
IN_DOMAIN = "in_domain"
CONFIG = "config"
MARGIN_PREFIX = "margin/"
LABEL_PREFIX = "label/"

REQUIRED_KEYS = (STEP, TESTSETS, ACCURACY, TRAIN_LOSS, IN_DOMAIN, CONFIG)

METRICS_FILENAME = "metrics.npz"

# Name under which accuracy on the run's own few-shot training set is stored
# in `testsets`, if it is stored there: it is neither in-domain nor OOD, so the
# analysis leaves it out of the correlations.
TRAIN_TESTSET = "train"

# The run's identity inside the config JSON: config[RUN_SECTION] is an object
# {RUN_MODEL: short model name (e.g. "opt-2.7b"), RUN_SEED: int, RUN_SHOTS: int}.
# The training set is `in_domain`.
RUN_SECTION = "run"
RUN_MODEL = "model"
RUN_SEED = "seed"
RUN_SHOTS = "shots"


def margin_key(testset: str) -> str:
    return MARGIN_PREFIX + testset


def label_key(testset: str) -> str:
    return LABEL_PREFIX + testset
