"""runs.chunk: the train step computes the runs a chunk at a time (a loop over chunks) with the same results.

Three runs of the tiny random OPT of test_steps, trained for three steps one
run at a time (chunk 1), two then one (chunk 2, a loop step and a remainder)
and all at once (chunk 0): adapters, optimizer state and losses agree to the
tolerances of test_steps' together-vs-alone comparison, and chunk 1 really is
a loop over the runs in the compiled program.
"""

import re

import jax
import numpy as np
import pytest
from test_steps import (
    LORA,
    NO,
    OPT,
    SEEDS,
    STEPS,
    TOGETHER_ADAPTER_TOL,
    TOGETHER_LOSS_TOL,
    YES,
    flat,
    geometry,
    make_batches,
    make_optimizer,
)

from oodjax.engine import steps
from oodjax.models import from_config


def train(chunk: int, batches: list[dict]):
    """Trains the three runs with ``runs.chunk = chunk``; returns (losses [steps, R], runs, train_step, base)."""
    optimizer = make_optimizer()
    graphdef, base, runs = steps.init_runs(from_config(OPT, seed=0), SEEDS, LORA, optimizer)
    train_step = steps.make_train_step(graphdef, optimizer, YES, NO, geometry(len(SEEDS), run_chunk=chunk))
    losses = []
    for batch in batches:
        runs, loss = train_step(base, runs, batch)
        losses.append(np.asarray(loss))
    return np.stack(losses), runs, train_step, base


@pytest.fixture(scope="module")
def batches():
    return make_batches(STEPS, len(SEEDS))


@pytest.fixture(scope="module")
def all_at_once(batches):
    return train(0, batches)


@pytest.mark.parametrize("chunk", [1, 2])
def test_chunked_runs_update_like_all_runs_at_once(chunk, batches, all_at_once):
    losses, runs, _, _ = train(chunk, batches)
    expected_losses, expected, _, _ = all_at_once
    assert losses[-1].mean() < losses[0].mean()  # they trained
    np.testing.assert_allclose(losses, expected_losses, rtol=0, atol=TOGETHER_LOSS_TOL)
    ours, theirs = flat(runs.lora), flat(expected.lora)
    assert ours.keys() == theirs.keys()
    for path, value in theirs.items():
        np.testing.assert_allclose(ours[path], value, rtol=0, atol=TOGETHER_ADAPTER_TOL, err_msg=str(path))
    for mine, reference in zip(jax.tree.leaves(runs.opt_state), jax.tree.leaves(expected.opt_state), strict=True):
        np.testing.assert_allclose(mine, reference, rtol=0, atol=TOGETHER_ADAPTER_TOL)
    np.testing.assert_array_equal(runs.rng, expected.rng)
    assert int(runs.step) == int(expected.step) == STEPS


def _loop_trip_counts(train_step, base, runs, batch) -> list[int]:
    """The known trip counts of the while loops in the compiled train step (lowering donates nothing)."""
    text = train_step.lower(base, runs, batch).compile().as_text()
    return [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', text)]


def test_one_run_at_a_time_is_a_loop_over_the_runs(batches, all_at_once):
    """Chunk 1 compiles to a while loop of R = 3 iterations; all at once has no loop over the runs (its
    loops are over the 2 micro-batches and the 2 layers)."""
    _, runs, all_step, base = all_at_once
    _, _, one_step, _ = train(1, batches[:1])
    assert len(SEEDS) in _loop_trip_counts(one_step, base, runs, batches[0])
    assert len(SEEDS) not in _loop_trip_counts(all_step, base, runs, batches[0])
