"""Sharded training on 8 host CPU devices gives the single-device results.

Meshes (data, fsdp, tensor) = (8,1,1), (2,4,1) and (2,2,2): the base is
placed by the logical axis rules, adapters and optimizer moments like the
projection they adapt, batches split over data x fsdp. Losses (and margins)
must equal one device's to float32 reduction-order noise.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_steps import LORA, NO, OPT, YES, as_step, geometry, make_batches, make_optimizer

from oodjax.data import TokenizedSet, eval_batches
from oodjax.engine import sharding, steps
from oodjax.models import from_config

SEEDS = (0, 1)
MICRO = 8  # divisible by data x fsdp on every mesh
NUM_STEPS = 2
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]
# Sharded matmuls sum in a different order; fp32 losses of ~4 then differ by a few ulps.
LOSS_TOL = 1e-5


def train(batches, mesh=None):
    model = from_config(OPT, seed=0)
    optimizer = make_optimizer()
    graphdef, base, runs = steps.attach_runs(model, SEEDS, LORA, optimizer, mesh=mesh)
    train_step = steps.make_train_step(
        graphdef, optimizer, YES, NO, geometry(len(SEEDS), accum=2, micro=MICRO), mesh=mesh, base_state=base, state=runs
    )
    losses = []
    for batch in batches:
        batch = as_step(batch)
        if mesh is not None:
            batch = sharding.shard_batch(batch, mesh, batch_axis=1)
        runs, metrics = train_step(base, runs, batch)
        losses.append(np.asarray(metrics["loss"]))
    assert train_step._cache_size() == 1  # outputs keep the input shardings: no recompilation
    return np.stack(losses), graphdef, base, runs


@pytest.fixture(scope="module")
def batches():
    return make_batches(NUM_STEPS, len(SEEDS), micro=MICRO)


@pytest.fixture(scope="module")
def single_device(batches):
    return train(batches)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_training_equals_one_device(shape, batches, single_device):
    mesh = sharding.make_mesh(*shape)
    losses, graphdef, base, runs = train(batches, mesh)
    print(shape, "max |loss diff| vs one device", np.abs(losses - single_device[0]).max())
    np.testing.assert_allclose(losses, single_device[0], rtol=0, atol=LOSS_TOL)

    # q_proj is (layers, embed, heads) -> (-, fsdp, tensor); adapters follow it behind a replicated run axis
    attn = lambda tree: tree["model"]["decoder"]["layers"]["self_attn"]  # noqa: E731
    assert attn(base)["q_proj"]["kernel"].sharding.spec == P(None, "fsdp", "tensor")
    assert attn(runs.lora)["q_proj"]["lora"]["lora_a"].sharding.spec == P(None, None, "fsdp", None)
    assert attn(runs.lora)["out_proj"]["lora"]["lora_b"].sharding.spec == P(None, None, None, "fsdp")
    mu = runs.opt_state[1][0].mu  # chain(clip, adamw): adamw's ScaleByAdamState
    assert attn(mu)["q_proj"]["lora"]["lora_b"].sharding.spec == P(None, None, None, "tensor")

    if shape == (2, 2, 2):  # eval on a mesh gives the one-device margins
        batch = {k: v[0, 0] for k, v in batches[0].items()}
        _, one_graphdef, one_base, one_runs = single_device
        expected = steps.make_eval_step(one_graphdef, YES, NO)(one_base, one_runs.lora, batch)
        eval_step = steps.make_eval_step(graphdef, YES, NO, mesh=mesh)
        margins = eval_step(base, runs.lora, sharding.shard_batch(batch, mesh))
        np.testing.assert_allclose(margins, expected, rtol=0, atol=LOSS_TOL)
        # Packed rows (several prompts a row, answers gathered per row) split over the devices too.
        (packed,) = eval_batches(prompts([3, 7, 2, 9, 4, 5, 6, 8, 3, 2, 7, 5]), batch_tokens=96, row_multiple=4)
        assert packed["input_ids"].shape == (8, 12) and packed["valid"].sum() == 12
        expected = steps.make_eval_step(one_graphdef, YES, NO)(one_base, one_runs.lora, packed)
        margins = eval_step(base, runs.lora, sharding.shard_batch(packed, mesh))
        np.testing.assert_allclose(margins, expected, rtol=0, atol=LOSS_TOL)


def prompts(lengths, max_length=12):
    """A TokenizedSet of random prompts of the given lengths."""
    rng = np.random.default_rng(0)
    return TokenizedSet(
        token_ids=rng.integers(2, OPT["vocab_size"], sum(lengths)).astype(np.int32),
        starts=np.concatenate([[0], np.cumsum(lengths)]),
        labels=(np.arange(len(lengths)) % 2).astype(np.int32),
        truncated=np.zeros(len(lengths), dtype=bool),
        max_length=max_length,
    )


def test_make_mesh_sizes():
    assert sharding.make_mesh(2, -1, 2).shape == {"data": 2, "fsdp": 2, "tensor": 2}
    assert sharding.make_mesh(-1).shape == {"data": 8, "fsdp": 1, "tensor": 1}
    assert sharding.make_mesh(devices=jax.devices()[:1]).shape == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match=r"\(2, 2, 1\) need 4 devices; there are 8"):
        sharding.make_mesh(2, 2, 1)
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.make_mesh(-1, -1, 1)
    with pytest.raises(ValueError, match="not divisible by 3"):
        sharding.make_mesh(3, -1, 1)


def test_shard_batch_splits_examples_and_rejects_uneven_batches():
    mesh = sharding.make_mesh(2, 2, 2)
    batch = {k: v[0, 0] for k, v in make_batches(1, 1, micro=8)[0].items()}
    placed = sharding.shard_batch(batch, mesh)
    assert placed["input_ids"].sharding.spec == P(("data", "fsdp"))
    assert placed["input_ids"].addressable_shards[0].data.shape == (2, batch["input_ids"].shape[1])
    np.testing.assert_array_equal(placed["input_ids"], batch["input_ids"])
    with pytest.raises(ValueError, match=r"batch\['input_ids'\] has shape \(6, 12\).*divisible by 4"):
        sharding.shard_batch({"input_ids": batch["input_ids"][:6]}, mesh)


def test_one_process_holds_every_row_and_its_process_batch_is_the_batch():
    """In one process `process_batch_rows` is every row; the 2-process case runs in test_launch_multiprocess."""
    mesh = sharding.make_mesh(2, 2, 2)
    np.testing.assert_array_equal(sharding.process_batch_rows(mesh, 8), np.arange(8))
    batch = as_step(make_batches(1, 2, micro=2)[0])  # [A, 2 runs x 2, ...]: 1 row per shard
    placed = sharding.shard_process_batch(batch, mesh, batch_axis=1, num_rows=4)
    expected = sharding.shard_batch(batch, mesh, batch_axis=1)
    for key, value in placed.items():
        assert value.sharding == expected[key].sharding
        np.testing.assert_array_equal(value, batch[key])
    with pytest.raises(ValueError, match="a batch of 6 rows cannot be split evenly over 4 devices"):
        sharding.process_batch_rows(mesh, 6)
    with pytest.raises(
        ValueError,
        match=r"local batch\['label'\] has shape \(2, 4, 1\): axis 1 must hold this "
        r"process's 8 of 8 rows \(process 0 of 1\)",
    ):
        sharding.shard_process_batch({"label": batch["label"]}, mesh, batch_axis=1, num_rows=8)


def test_place_moves_values_keeps_placed_arrays_and_carries_typed_keys():
    mesh = sharding.make_mesh(2, 2, 2)
    split = NamedSharding(mesh, P("fsdp", "tensor"))
    on_mesh = jax.device_put(np.ones((4, 4), np.float32), split)
    host = np.arange(16, dtype=np.float32).reshape(4, 4)
    key = jax.random.key(3)
    placed = sharding.place(
        {"host": host, "on_mesh": on_mesh, "key": key},
        {"host": split, "on_mesh": split, "key": sharding.replicated(mesh)},
    )
    assert placed["on_mesh"] is on_mesh  # already where it belongs: not copied
    assert placed["host"].sharding == split
    np.testing.assert_array_equal(placed["host"], host)
    assert placed["key"].dtype == key.dtype and placed["key"].sharding == sharding.replicated(mesh)
    np.testing.assert_array_equal(jax.random.key_data(placed["key"]), jax.random.key_data(key))


def test_lora_state_carries_no_stale_run_axis_metadata():
    """Stacked adapters keep their unstacked logical names; runs_shardings adds the run axis."""
    model = from_config(OPT, seed=0)
    _, _, runs = steps.attach_runs(model, SEEDS, LORA, make_optimizer())
    mesh = sharding.make_mesh(1, 4, 2)
    shardings = sharding.runs_shardings(runs, mesh)
    v_proj = lambda tree: tree["model"]["decoder"]["layers"]["self_attn"]["v_proj"]["lora"]  # noqa: E731
    assert isinstance(v_proj(runs.lora)["lora_a"], nnx.LoRAParam)
    assert v_proj(runs.lora)["lora_a"].get_metadata()["out_sharding"] == ("layers", "embed", None)  # no run axis
    assert v_proj(shardings.lora)["lora_a"].get_value().spec == P(None, None, "fsdp", None)
    assert v_proj(shardings.lora)["lora_b"].get_value().spec == P(None, None, None, "tensor")
    assert shardings.rng.spec == P() and shardings.step.spec == P()
