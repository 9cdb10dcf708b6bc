"""The jitted train and eval steps on a tiny random OPT.

What is checked: the loss is the answer-position cross-entropy of the full
model; gradients reach only the adapters; dtypes (bf16 base, fp32 adapters and
optimizer state); R runs trained together equal each run trained alone; remat
and mixed precision leave training (nearly) unchanged; the eval margins are the
full model's logit(Yes) - logit(No); the eval step compiles once per shape; the
schedule is transformers'.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.special
import torch
import transformers
from flax import nnx

from oodjax.data import TRAIN_KEYS, StepLayout, TokenizedSet, train_steps
from oodjax.engine import steps
from oodjax.engine.geometry import BatchGeometry, BatchSettings, EvalGeometry, micro_batch_lengths
from oodjax.engine.optimizer import SCHEDULES, OptimizerSettings
from oodjax.engine.results import KEY_SOURCES, RunPlan
from oodjax.models import from_config
from oodjax.models.lora import LoRAConfig

OPT = dict(
    model_type="opt",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_dim=64,
    max_position_embeddings=32,
    pad_token_id=1,
)
YES, NO = 5, 6
SEEDS = (0, 42, 99)
ACCUM, MICRO, SEQ = 2, 4, 12
STEPS = 3
LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.1)
# R runs together vs alone differ only in how XLA batches the same float32 arithmetic:
# losses agree to float32 rounding; adapters to that rounding amplified by Adam's
# g / (sqrt(v) + eps) where a gradient is near eps = 1e-8: a float32 difference of 6e-11 in
# a gradient of 1.3e-8 moves that element's update by up to lr * dg / (4 eps) ~ 5e-5 per step
# (seen: 2.9e-5 at step 2 with the 16-bit dropout masks, lora.dropout_keep_mask).
TOGETHER_LOSS_TOL = 1e-6
TOGETHER_ADAPTER_TOL = 1e-4
# bf16 keeps 8 significant bits; over two layers the loss (about ln 64 = 4.2) moves by ~1e-3.
BF16_LOSS_TOL = 2e-2


def make_optimizer():
    return steps.make_optimizer(5e-2, total_steps=10, warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0)


def make_batches(
    num_steps: int, runs: int, seed: int = 0, accum: int = ACCUM, micro: int = MICRO, seq: int = SEQ
) -> list[dict]:
    """Right-padded prompts of random lengths, per run: [runs, accum, micro, seq], a few rows invalid
    (``as_step`` lays them out as the train step takes them)."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(num_steps):
        shape = (runs, accum, micro)
        lengths = rng.integers(3, seq + 1, size=shape)
        ids = rng.integers(2, OPT["vocab_size"], size=(*shape, seq)).astype(np.int32)
        mask = (np.arange(seq) < lengths[..., None]).astype(np.int32)
        ids = np.where(mask == 1, ids, OPT["pad_token_id"]).astype(np.int32)
        valid = np.ones(shape, bool)
        valid[..., -1, -1] = False  # a padding row: must not count
        batches.append(
            dict(
                input_ids=ids,
                segment_ids=mask,
                answer_pos=(lengths - 1).astype(np.int32),
                label=rng.integers(0, 2, size=shape).astype(np.int32),
                valid=valid,
            )
        )
    return batches


def geometry(runs: int, *, accum: int = ACCUM, micro: int = MICRO, seq: int = SEQ, **fields) -> BatchGeometry:
    """The geometry of ``make_batches``' batches, one prompt a row (``as_step``); ``fields`` set the rest."""
    return BatchGeometry(runs=runs, batch_size=accum * micro, grad_accum=accum, seq_len=seq, **fields)


def as_step(batch: dict) -> dict:
    """Per-run batches [R, accum, micro, ...] as one training step [accum, R * micro, ...], one prompt a row:
    micro-batch i holds each run's micro-batch i, run after run; each prompt gets its run and its place in its
    run's batch (i * micro + j), and a prompt-slot axis."""
    runs, accum, micro = batch["answer_pos"].shape
    step = {k: np.moveaxis(np.asarray(v), 0, 1).reshape(accum, runs * micro, *v.shape[3:]) for k, v in batch.items()}
    for key in ("answer_pos", "label", "valid"):
        step[key] = step[key][..., None]
    step["run"] = np.broadcast_to(np.repeat(np.arange(runs), micro)[None, :, None], (accum, runs * micro, 1))
    step["example"] = np.broadcast_to(
        (np.arange(accum)[:, None] * micro + np.tile(np.arange(micro), runs)[None, :])[..., None], step["run"].shape
    )
    return {k: np.ascontiguousarray(v, dtype=np.bool_ if k == "valid" else np.int32) for k, v in step.items()}


def run_slice(batch: dict, runs: slice) -> dict:
    return {k: v[runs] for k, v in batch.items()}


def train(seeds, batches, *, dtype="float32", remat="none", compute_dtype=None, optimizer=None, train_step=None):
    """Trains ``seeds`` together on ``batches``; returns (losses [steps, R], graphdef, base, runs, train_step).

    Pass the ``train_step`` of an earlier call with the same shapes to reuse its compilation.
    """
    model = from_config(OPT, dtype=dtype, seed=0, remat=remat)
    optimizer = optimizer or make_optimizer()
    graphdef, base, runs = steps.attach_runs(model, seeds, LORA, optimizer)
    train_step = train_step or steps.make_train_step(
        graphdef, optimizer, YES, NO, geometry(len(seeds)), compute_dtype=compute_dtype
    )
    losses = []
    for batch in batches:
        runs, metrics = train_step(base, runs, as_step(batch))
        losses.append(np.asarray(metrics["loss"]))
    return np.stack(losses), graphdef, base, runs, train_step


@pytest.fixture(scope="module")
def batches():
    return make_batches(STEPS, len(SEEDS))


@pytest.fixture(scope="module")
def together(batches):
    return train(SEEDS, batches)


@pytest.fixture(scope="module")
def alone(batches):
    """Each run trained by itself (one compilation shared: every single run has the same shapes)."""
    results, train_step = [], None
    for r, seed in enumerate(SEEDS):
        results.append(train([seed], [run_slice(b, slice(r, r + 1)) for b in batches], train_step=train_step))
        train_step = results[-1][-1]
    return results


def flat(tree):
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(tree)}


def test_first_loss_is_answer_position_cross_entropy_of_full_model(together, batches):
    """Fresh adapters change nothing, so step 0's loss is the base model's CE at answer_pos over valid rows."""
    losses, *_ = together
    model = from_config(OPT, seed=0)
    batch = batches[0]
    for r in range(len(SEEDS)):
        ids = batch["input_ids"][r].reshape(-1, SEQ)
        logits = np.asarray(model(ids, batch["segment_ids"][r].reshape(-1, SEQ)), np.float64)
        at_answer = logits[np.arange(len(ids)), batch["answer_pos"][r].reshape(-1)]
        targets = np.where(batch["label"][r].reshape(-1) == 0, YES, NO)
        ce = scipy.special.logsumexp(at_answer, axis=-1) - at_answer[np.arange(len(ids)), targets]
        valid = batch["valid"][r].reshape(-1)
        np.testing.assert_allclose(losses[0, r], ce[valid].mean(), rtol=1e-5)


def test_runs_trained_together_equal_runs_trained_alone(together, alone):
    losses, _, _, runs, _ = together
    assert len(set(np.round(losses[-1], 6))) == len(SEEDS)  # the runs really differ
    assert losses[-1].mean() < losses[0].mean()
    for r, (alone_losses, _, _, alone_runs, _) in enumerate(alone):
        np.testing.assert_allclose(losses[:, r], alone_losses[:, 0], rtol=0, atol=TOGETHER_LOSS_TOL)
        ours, theirs = flat(steps.select_run(runs.lora, r)), flat(steps.select_run(alone_runs.lora, 0))
        assert ours.keys() == theirs.keys()
        diffs = {path: np.abs(ours[path] - theirs[path]).max() for path in ours}
        print(
            f"run {r}: max |loss diff| {np.abs(losses[:, r] - alone_losses[:, 0]).max():.1e}, "
            f"max |adapter diff| {max(diffs.values()):.1e}"
        )
        assert max(diffs.values()) < TOGETHER_ADAPTER_TOL, diffs
    assert int(runs.step) == STEPS


def test_dropout_is_on_in_training_and_a_function_of_the_run_key(together, batches):
    """Same state and key: the same loss; another key: other masks, so another loss (B != 0 by now)."""
    _, _, base, runs, train_step = together
    fresh = lambda r: jax.tree.map(jnp.array, r)  # noqa: E731  (copies: the step donates its input)
    step = as_step(batches[0])
    first = train_step(base, fresh(runs), step)[1]["loss"]
    again = train_step(base, fresh(runs), step)[1]["loss"]
    other = train_step(base, fresh(runs).replace(rng=runs.rng + 1), step)[1]["loss"]
    np.testing.assert_array_equal(first, again)
    assert np.all(np.asarray(first) != np.asarray(other))


def uses_remat(train_step, base, runs, batch) -> bool:
    return "remat" in str(jax.make_jaxpr(train_step)(base, runs, batch))  # jax.checkpoint's primitive


def test_remat_trains_identically(alone, batches):
    """Rematerialised layers recompute the same activations and draw the same dropout masks."""
    single = [run_slice(b, slice(0, 1)) for b in batches]
    remat_losses, _, base, runs, remat_step = train([SEEDS[0]], single, remat="full")
    _, _, plain_base, plain_runs, plain_step = alone[0]
    assert uses_remat(remat_step, base, runs, as_step(single[0]))
    assert not uses_remat(plain_step, plain_base, plain_runs, as_step(single[0]))
    np.testing.assert_allclose(remat_losses, alone[0][0], rtol=0, atol=1e-6)


def test_grads_only_for_adapters_in_float32_on_a_bf16_base(alone, batches):
    """A spy optimizer sees exactly the gradients the step computes: LoRAParam leaves, float32."""
    seen = {}
    inner = make_optimizer()

    def update(grads, state, params=None):
        seen["grads"] = grads
        return inner.update(grads, state, params)

    spy = optax.GradientTransformation(inner.init, update)
    single = [run_slice(b, slice(0, 1)) for b in batches]
    model = from_config(OPT, dtype="bfloat16", seed=0)
    graphdef, base, runs = steps.attach_runs(model, [SEEDS[0]], LORA, spy)
    base_before = jax.tree.map(np.array, base.filter(nnx.Param))
    lora_before = flat(runs.lora)
    train_step = steps.make_train_step(graphdef, spy, YES, NO, geometry(1))
    losses = []
    for batch in single:
        runs, metrics = train_step(base, runs, as_step(batch))
        losses.append(np.asarray(metrics["loss"]))

    grad_leaves = jax.tree.leaves(seen["grads"], is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert grad_leaves and all(type(v) is nnx.LoRAParam and v.dtype == jnp.float32 for v in grad_leaves)
    assert {p for p, _ in nnx.to_flat_state(seen["grads"])} == set(lora_before)
    assert {x.dtype for x in jax.tree.leaves(base.filter(nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    for tree in (runs.lora, runs.opt_state):
        floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
    jax.tree.map(np.testing.assert_array_equal, base_before, jax.tree.map(np.array, base.filter(nnx.Param)))
    assert any(np.abs(v - lora_before[p]).max() > 0 for p, v in flat(runs.lora).items())
    # mixed precision: a bf16 base trains like the fp32 one, to bf16 accuracy
    np.testing.assert_allclose(np.stack(losses), alone[0][0], rtol=0, atol=BF16_LOSS_TOL)


def test_bf16_compute_dtype_on_fp32_base(alone, batches):
    """compute_dtype=bfloat16 computes in bf16 but keeps fp32 adapters and optimizer state."""
    losses, _, base, runs, _ = train(
        [SEEDS[0]], [run_slice(b, slice(0, 1)) for b in batches], compute_dtype=jnp.bfloat16
    )
    assert {x.dtype for x in jax.tree.leaves(runs.lora)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(base.filter(nnx.Param))} == {jnp.dtype(jnp.float32)}
    diff = np.abs(losses - alone[0][0]).max()
    assert 0 < diff < BF16_LOSS_TOL, diff  # different (bf16 really used) yet close


def test_eval_margins_are_full_model_logit_differences_and_compile_once(together):
    _, graphdef, base, runs, _ = together
    eval_step = steps.make_eval_step(graphdef, YES, NO)
    first, second = (make_batches(1, 1, seed=s, accum=1)[0] for s in (5, 6))
    first, second = ({k: v[0, 0] for k, v in b.items()} for b in (first, second))
    for batch in (first, second):
        margins = np.asarray(eval_step(base, runs.lora, batch))
        assert margins.shape == (len(SEEDS), MICRO) and margins.dtype == np.float32
        for r in range(len(SEEDS)):
            model = nnx.view(nnx.merge(graphdef, base, steps.select_run(runs.lora, r)), deterministic=True)
            logits = np.asarray(model(batch["input_ids"], batch["segment_ids"]))
            at = logits[np.arange(MICRO), batch["answer_pos"]]
            np.testing.assert_allclose(margins[r], at[:, YES] - at[:, NO], rtol=0, atol=1e-5)
    assert eval_step._cache_size() == 1  # same bucket shape: no recompilation
    longer = {k: v[0, 0] for k, v in make_batches(1, 1, seed=7, accum=1, seq=2 * SEQ)[0].items()}
    eval_step(base, runs.lora, longer)
    eval_step(base, runs.lora, longer)
    assert eval_step._cache_size() == 2  # one compile per bucket shape


def test_buckets_run_each_micro_batch_at_its_own_length():
    """With buckets (8, 16), micro-batch 0 (prompts of at most 8 tokens, over both runs) runs at 8 tokens,
    micro-batch 1 (at most 9) at 16, and the result is the uncut step's. Micro-batch 0's padding beyond 8
    holds token ids outside the vocabulary (NaN embeddings): cut off, they change nothing; computed, they
    poison the loss."""
    lengths = np.array([[[3, 5, 4, 2], [9, 6, 7, 3]], [[8, 2, 7, 8], [4, 9, 2, 3]]])  # [runs, accum, micro]
    batch = make_batches(1, 2, seed=3, accum=2, micro=4, seq=16)[0]
    batch["segment_ids"] = (np.arange(16) < lengths[..., None]).astype(np.int32)
    batch["answer_pos"] = (lengths - 1).astype(np.int32)
    poisoned = dict(batch, input_ids=batch["input_ids"].copy())
    poisoned["input_ids"][:, 0, :, 8:] = 10 * OPT["vocab_size"]
    no_dropout = LoRAConfig(rank=4, alpha=8.0, dropout=0.0)

    def step(data, buckets):
        optimizer = make_optimizer()
        graphdef, base, runs = steps.attach_runs(from_config(OPT, seed=0), [0, 42], no_dropout, optimizer)
        train_step = steps.make_train_step(
            graphdef, optimizer, YES, NO, geometry(2, accum=2, micro=4, seq=16, buckets=buckets or ())
        )
        runs, metrics = train_step(base, runs, as_step(data))
        return np.asarray(metrics["loss"]), flat(runs.lora)

    loss, lora = step(batch, None)
    cut_loss, cut_lora = step(poisoned, (8, 16))
    np.testing.assert_allclose(cut_loss, loss, rtol=0, atol=TOGETHER_LOSS_TOL)
    for path, value in lora.items():
        np.testing.assert_allclose(cut_lora[path], value, rtol=0, atol=TOGETHER_ADAPTER_TOL, err_msg=str(path))
    assert np.isnan(step(poisoned, None)[0]).all()
    assert micro_batch_lengths((64, 16, 32), 32) == (16, 32)
    assert micro_batch_lengths(None, 24) == (24,)


def toy_set(lengths: list[int], seed: int) -> TokenizedSet:
    rng = np.random.default_rng(seed)
    return TokenizedSet(
        token_ids=rng.integers(2, OPT["vocab_size"], sum(lengths)).astype(np.int32),
        starts=np.concatenate([[0], np.cumsum(lengths)]),
        labels=rng.integers(0, 2, len(lengths)).astype(np.int32),
        truncated=np.zeros(len(lengths), bool),
        max_length=16,
    )


def test_packed_rows_mixing_runs_train_like_one_prompt_per_row():
    """Three runs' steps packed into rows that mix runs (2 devices' rows x 2 micro-batches), with dropout on,
    give each run the losses and update of the same prompts one a row, each run's own micro-batches: every
    token goes through its own run's adapters, each prompt's loss is weighted within its run, and dropout is
    keyed by run, example and position, not by where a prompt sits. Padding beyond each micro-batch's bucket
    holds token ids outside the vocabulary (NaN embeddings): it must be cut off, or the loss would be NaN."""
    sets = [toy_set([3, 5, 4, 2, 9, 6, 7, 3], 4), toy_set([6, 2, 8, 5, 3, 4], 5), toy_set([7, 7, 2, 3, 5, 8, 4], 6)]
    seeds, batch_size = [0, 42, 99], 4
    one_per_row = StepLayout(micro_batches=2, rows=6, packed=False)
    packed = StepLayout(micro_batches=2, rows=2, packed=True)
    unpacked_steps = train_steps(sets, seeds, batch_size=batch_size, layout=one_per_row, seq_len=16, prefetch=0)
    packed_steps = train_steps(
        sets, seeds, batch_size=batch_size, layout=packed, seq_len=32, prompts_per_row=6, prefetch=0
    )

    def train(stream, shape):
        optimizer = make_optimizer()
        graphdef, base, runs = steps.attach_runs(from_config(OPT, seed=0), seeds, LORA, optimizer)
        train_step = steps.make_train_step(graphdef, optimizer, YES, NO, shape)
        losses, mixed = [], False
        for _ in range(3):  # B is no longer zero after the first: the adapters act on both layouts
            batch = next(stream)
            mixed |= any(
                len(set(row[valid].tolist())) > 1
                for row, valid in zip(
                    batch["run"].reshape(-1, batch["run"].shape[-1]), batch["valid"].reshape(-1, batch["run"].shape[-1])
                )
            )
            longest = (batch["segment_ids"] != 0).sum(-1).max(-1)
            for i, length in enumerate(longest):
                batch["input_ids"][i, :, fitting(shape, length) :] = 10 * OPT["vocab_size"]
            runs, metrics = train_step(base, runs, {key: batch[key] for key in TRAIN_KEYS})
            losses.append(np.asarray(metrics["loss"]))
        return np.stack(losses), flat(runs.lora), mixed

    def fitting(shape, length):
        return next(b for b in shape.micro_batch_lengths if b >= length)

    loss, lora, _ = train(unpacked_steps, BatchGeometry(runs=3, batch_size=4, grad_accum=2, seq_len=16))
    packed_shape = BatchGeometry(
        runs=3,
        batch_size=4,
        grad_accum=2,
        seq_len=32,
        buckets=(16, 24),
        packed=True,
        batch_shards=2,
        prompts_per_row=6,
    )
    packed_loss, packed_lora, mixed = train(packed_steps, packed_shape)
    assert mixed  # rows really hold prompts of several runs
    print("packed vs one per row: max |loss diff|", np.abs(packed_loss - loss).max())
    assert np.isfinite(packed_loss).all() and len(set(np.round(loss[-1], 5))) == 3
    np.testing.assert_allclose(packed_loss, loss, rtol=0, atol=TOGETHER_LOSS_TOL)
    for path, value in lora.items():
        np.testing.assert_allclose(packed_lora[path], value, rtol=0, atol=TOGETHER_ADAPTER_TOL, err_msg=str(path))


def test_malformed_batches_are_clear_errors(together, batches):
    _, graphdef, base, runs, train_step = together
    with pytest.raises(ValueError, match=r"expected \[grad_accum=2, rows=12, seq=12\]"):
        train_step(base, runs, as_step(run_slice(batches[0], slice(0, 2))))
    step = as_step(batches[0])
    with pytest.raises(ValueError, match="batch is missing 'answer_pos'"):
        train_step(base, runs, {k: v for k, v in step.items() if k != "answer_pos"})
    with pytest.raises(ValueError, match="a training batch needs 'run' per prompt slot"):
        train_step(base, runs, {k: v for k, v in step.items() if k != "run"})
    eval_step = steps.make_eval_step(graphdef, YES, NO)
    with pytest.raises(ValueError, match=r"expected \[batch, seq\]"):
        eval_step(base, runs.lora, batches[0])


def test_geometry_errors_name_the_config_field():
    settings = dict(batch_size=8, pack=False, max_length=12, eval_batch_size=4)
    with pytest.raises(ValueError, match="train.grad_accum must be >= 1, got 0"):
        BatchSettings(grad_accum=0, **settings)
    with pytest.raises(ValueError, match="train.batch_size 8 must be a multiple of train.grad_accum 3"):
        BatchSettings(grad_accum=3, **settings)
    with pytest.raises(ValueError, match=r"eval.row_lengths must be positive lengths, got \[0, 12\]"):
        BatchSettings(grad_accum=1, eval_row_lengths=(0, 12), **settings)
    fields = dict(runs=3, batch_size=8, seq_len=12)
    with pytest.raises(
        ValueError,
        match=r"train micro-batch 2 \(train.batch_size / train.grad_accum\) must be a "
        r"multiple of the 4 batch shards \(mesh.data x mesh.fsdp\)",
    ):
        BatchGeometry(grad_accum=4, batch_shards=4, **fields)
    with pytest.raises(ValueError, match="eval.batch_size 6 must be a multiple of the 4 batch shards"):
        EvalGeometry(rows=6, seq_len=12, row_lengths=(12,), batch_shards=4)
    shape = BatchGeometry(grad_accum=2, batch_shards=2, buckets=(4, 8, 16), **fields)
    assert (shape.rows, shape.rows_per_device, shape.micro_batch_lengths) == (12, 6, (4, 8, 12))
    assert shape.train_rows_shape == (2, 12)
    packed = BatchGeometry(grad_accum=4, batch_shards=4, packed=True, **fields)  # any grad_accum when packed
    assert (packed.rows, packed.rows_per_device, packed.train_rows_shape) == (4, 1, (4, 4))
    packed = dataclasses.replace(packed, packed_rows_per_device=3)
    assert (packed.rows, packed.rows_per_device, packed.layout) == (12, 3, StepLayout(4, 12, True))
    with pytest.raises(ValueError, match="packed rows per device must be >= 1, got 0"):
        dataclasses.replace(packed, packed_rows_per_device=0)
    assert EvalGeometry(rows=8, seq_len=12, row_lengths=(12,), batch_shards=2).batch_tokens == 96


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_is_transformers(schedule):
    total, warmup, peak = 12, 3, 1e-3
    torch_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    make = {
        "linear": transformers.get_linear_schedule_with_warmup,
        "cosine": transformers.get_cosine_schedule_with_warmup,
        "constant": lambda o, w, _: transformers.get_constant_schedule_with_warmup(o, w),
    }[schedule]
    scheduler = make(torch_opt, warmup, total)
    theirs = []
    for _ in range(total):
        theirs.append(scheduler.get_last_lr()[0])
        torch_opt.step()
        scheduler.step()
    ours = [
        float(OptimizerSettings(peak, warmup, schedule=schedule).build(total).learning_rate_schedule(i))
        for i in range(total)
    ]
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-12)
    with pytest.raises(ValueError, match="train.schedule must be one of linear, cosine, constant, got 'step'"):
        OptimizerSettings(peak, warmup, schedule="step").build(total)
    with pytest.raises(ValueError, match=r"train.warmup_steps must be in \[0, train.steps="):
        OptimizerSettings(peak, total + 1, schedule=schedule).build(total)


@pytest.mark.parametrize("key_source", KEY_SOURCES)
def test_run_keys_come_from_the_seed_alone_unless_key_source_says_otherwise(tmp_path, key_source):
    """runs.key_source "seed" (the study's): a seed's runs of every shot count and training set get identical
    adapters and dropout keys; "seed_shots_train_set": every run its own, seeds still told apart."""
    plans = [
        RunPlan("m", train_set, (0, 42), (32, 64), tmp_path, key_source=key_source) for train_set in ("mnli", "snli")
    ]
    runs = [(plan, run) for plan in plans for run in plan.runs()]
    _, _, state = steps.attach_runs(
        from_config(OPT, seed=0), [plan.key_seed(run) for plan, run in runs], LORA, make_optimizer()
    )
    adapters = [np.concatenate([leaf[i].ravel() for leaf in jax.tree.leaves(state.lora)]) for i in range(len(runs))]
    dropout = np.asarray(state.rng)
    for (i, (plan_i, run_i)), (j, (plan_j, run_j)) in itertools.combinations(enumerate(runs), 2):
        same = run_i.seed == run_j.seed if key_source == "seed" else i == j
        assert np.array_equal(adapters[i], adapters[j]) == same, (plan_i.train_set, run_i, plan_j.train_set, run_j)
        assert np.array_equal(dropout[i], dropout[j]) == same
