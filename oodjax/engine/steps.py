"""The jitted train and eval steps for R runs that share one frozen base.

A "run" is one (seed, shots) fine-tuning job. All runs of a process share the
base model's state; each has its own adapters, optimizer state and dropout
key, stacked on a leading run axis (``RunsState``). Both steps ``vmap`` one
run's computation over that axis, so R runs cost one pass over the base
weights per layer and give exactly what each run would give alone.

Only the answer position matters: the loss and the margins come from the
final hidden state at ``answer_pos`` (the last prompt token), so the output
head runs on one position per example, and evaluation multiplies it by just
the two answer-token columns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from oodjax.engine import sharding
from oodjax.models.lora import LoRAConfig, apply_lora
from oodjax.models.partitioning import param_shardings

Batch = Mapping[str, Any]

SCHEDULES = ("linear", "cosine", "constant")

_SEQUENCE_KEYS = ("input_ids", "attention_mask")  # [..., S]; a batch's other leaves have no sequence axis


@flax.struct.dataclass
class RunsState:
    """Everything that differs between runs, each leaf with a leading run axis [R, ...].

    ``rng`` holds raw uint32 key data [R, 2] (not typed keys) so checkpoints can
    store it as a plain array; ``step`` counts optimizer steps taken (shared).
    """

    lora: nnx.State
    opt_state: optax.OptState
    rng: jax.Array
    step: jax.Array

    @property
    def num_runs(self) -> int:
        return self.rng.shape[0]


def select_run(tree: Any, index: int) -> Any:
    """Run ``index``'s slice of a run-stacked pytree (e.g. ``runs.lora`` for ``export_peft``)."""
    return jax.tree.map(lambda x: x[index], tree)


def make_schedule(
    learning_rate: float, total_steps: int, warmup_steps: int, schedule: str = "linear"
) -> optax.Schedule:
    """The learning rate per optimizer step, as transformers' schedules give it.

    It rises linearly from 0 over ``warmup_steps`` (so, as in a Trainer, the
    first update uses rate 0 when there is warm-up), then ``linear`` decays to
    0 at ``total_steps``, ``cosine`` follows a half cosine to 0 and
    ``constant`` stays at the peak (get_{linear,cosine,constant}_schedule_with_warmup).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {SCHEDULES}")
    if total_steps <= 0 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"need total_steps > 0 and 0 <= warmup_steps <= total_steps; got total_steps={total_steps}, "
            f"warmup_steps={warmup_steps}"
        )
    decay_steps = max(total_steps - warmup_steps, 1)
    if schedule == "linear":
        decay = optax.linear_schedule(learning_rate, 0.0, decay_steps)
    elif schedule == "cosine":
        decay = optax.cosine_decay_schedule(learning_rate, decay_steps)
    else:
        decay = optax.constant_schedule(learning_rate)
    if not warmup_steps:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps), decay], [warmup_steps])


def make_optimizer(
    learning_rate: float,
    total_steps: int,
    warmup_steps: int,
    weight_decay: float,
    max_grad_norm: float | None,
    schedule: str = "linear",
) -> optax.GradientTransformation:
    """torch's AdamW (b1 0.9, b2 0.999, eps 1e-8, decoupled weight decay) after global-norm
    clipping (none when ``max_grad_norm`` is None or 0), on ``make_schedule``'s learning rate."""
    lr = make_schedule(learning_rate, total_steps, warmup_steps, schedule)
    adamw = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
    if not max_grad_norm:
        return adamw
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


def init_runs(
    model: nnx.Module,
    seeds: Sequence[int],
    lora_cfg: LoRAConfig,
    optimizer: optax.GradientTransformation,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[nnx.GraphDef, nnx.State, RunsState]:
    """Attaches adapters to ``model`` and returns (graphdef, frozen base state, stacked runs).

    Run r's adapters and dropout key come from ``nnx.Rngs(seeds[r])`` alone, so
    they are identical to those of a single run with that seed. The base
    state also holds the adapters' shared dropout stream, which the train step
    reseeds per run, step and micro-batch. With ``mesh``, base and runs are
    placed on their shardings (in every process of a multi-process mesh:
    each builds the same values from the same seeds and places its blocks).
    """
    if not seeds:
        raise ValueError("init_runs needs at least one seed")
    loras, keys = [], []
    for seed in seeds:
        rngs = nnx.Rngs(seed)
        apply_lora(model, lora_cfg, rngs=rngs)
        loras.append(nnx.state(model, nnx.LoRAParam))
        keys.append(jax.random.key_data(rngs.dropout()))
    graphdef, _, base_state = nnx.split(model, nnx.LoRAParam, ...)
    lora = jax.tree.map(lambda *xs: jnp.stack(xs), *loras)
    runs = RunsState(
        lora=lora,
        opt_state=jax.vmap(optimizer.init)(lora),
        rng=jnp.stack(keys),
        step=jnp.zeros((), jnp.int32),
    )
    if mesh is not None:
        base_state = sharding.place(base_state, param_shardings(base_state, mesh))
        runs = sharding.place(runs, sharding.runs_shardings(runs, mesh))
    else:
        # Committed, as the train step's outputs are: an uncommitted first input
        # would give the first call a compilation of its own.
        runs = jax.device_put(runs, jax.local_devices()[0])
    return graphdef, base_state, runs


def _cast_floats(tree: Any, dtype: jnp.dtype | None) -> Any:
    """Casts the floating-point leaves of ``tree`` (not keys or integers) to ``dtype``; None keeps them."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _answer_hidden(model: nnx.Module, batch: Batch) -> jax.Array:
    """The final hidden state at each prompt's answer position (its last token): [B, H'] or [B, P, H'].

    ``answer_pos`` is [B] (one prompt per row) or [B, P] (P prompt slots of a
    packed row); the gather stays within each row, so a batch split over
    devices by rows gathers on each device alone.
    """
    hidden = model.hidden_states(batch["input_ids"], batch["attention_mask"])
    positions = batch["answer_pos"]
    per_row = positions.reshape(positions.shape[0], -1, 1)
    picked = jnp.take_along_axis(hidden, per_row, axis=1)
    return picked.reshape(*positions.shape, hidden.shape[-1])


def micro_batch_lengths(buckets: Sequence[int] | None, seq_len: int) -> tuple[int, ...]:
    """The lengths a micro-batch of a ``seq_len`` batch may run at: the buckets below it, then ``seq_len``."""
    return tuple(int(b) for b in sorted(buckets or ()) if b < seq_len) + (seq_len,)


def _check_batch(batch: Batch, layout: str, leading: tuple[int, ...]) -> None:
    """Trace-time shape check (shapes are static), so a malformed batch fails once and clearly.

    Per-prompt leaves (answer_pos, label, valid) have the rows' shape, with
    a trailing prompt-slot axis when rows are packed.
    """
    for key in ("input_ids", "attention_mask", "answer_pos", "label"):
        if key not in batch:
            raise ValueError(f"batch is missing {key!r}; it has {sorted(batch)}")
    ids = batch["input_ids"]
    if ids.ndim != len(leading) + 2 or tuple(ids.shape[: len(leading)]) != leading:
        raise ValueError(f"batch['input_ids'] has shape {tuple(ids.shape)}; expected {layout}")
    mask = tuple(batch["attention_mask"].shape)
    if mask != tuple(ids.shape):
        raise ValueError(f"batch['attention_mask'] has shape {mask}; expected {tuple(ids.shape)}")
    answers = tuple(batch["answer_pos"].shape)
    if answers[: ids.ndim - 1] != tuple(ids.shape[:-1]) or len(answers) > ids.ndim:
        raise ValueError(
            f"batch['answer_pos'] has shape {answers}; expected {tuple(ids.shape[:-1])} "
            "(+ a prompt-slot axis if packed)"
        )
    for key in ("label",) + (("valid",) if "valid" in batch else ()):
        if tuple(batch[key].shape) != answers:
            raise ValueError(f"batch[{key!r}] has shape {tuple(batch[key].shape)}; expected {answers} (answer_pos's)")


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    yes_id: int,
    no_id: int,
    *,
    grad_accum: int,
    buckets: Sequence[int] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    runs: RunsState | None = None,
    compute_dtype: jnp.dtype | None = None,
) -> Callable[[nnx.State, RunsState, Batch], tuple[RunsState, jax.Array]]:
    """One jitted optimizer step for all runs: ``train_step(base_state, runs, batch) -> (runs, loss [R])``.

    ``batch`` leaves are [R, grad_accum, micro_batch, seq] ([R, grad_accum,
    micro_batch] for answer_pos, label, valid): each run its own examples. The
    loss is the mean cross-entropy over the full vocabulary at the answer
    position (target " Yes" for label 0, " No" otherwise) over the valid
    examples of all micro-batches; gradients are summed over micro-batches and
    divided by the valid count, so accumulation is exact, not an average of
    averages. ``runs`` is donated.

    Rows may hold one prompt each (``make_batch``) or several (packed by
    ``train_batches``; per-prompt leaves then have a prompt-slot axis).
    ``buckets`` are sequence lengths a micro-batch may be cut to: each runs at
    the smallest that holds its longest row over all runs (rows are filled
    from the left, so the cut drops only padding), and a micro-batch with no
    valid prompt in any run is skipped. The choice is made inside the step
    (``lax.switch``), so the step compiles once for the batch's full length,
    every device of every process takes the same branch, and packed batches
    (fullest rows first, empty rows last) compute little padding. None runs
    every non-empty micro-batch at the batch's length.

    ``compute_dtype`` (e.g. bfloat16) casts the base and the adapters for the
    forward/backward pass only; the adapters and optimizer state stay float32.

    With a ``mesh``, pass the ``runs`` from ``init_runs`` too: the step pins
    its outputs to their shardings, so each call's output is exactly the next
    call's input layout (XLA may otherwise spell an equivalent sharding
    differently, which would recompile every step).
    """
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    if mesh is not None and runs is None:
        raise ValueError("make_train_step with a mesh needs runs= (the RunsState from init_runs) to fix its shardings")

    def micro_loss(lora, base_state, micro, key):
        # copy: fresh Variables at this trace level, so reseeding may mutate them.
        model = nnx.merge(graphdef, base_state, _cast_floats(lora, compute_dtype), copy=True)
        nnx.reseed(model, dropout=key)
        hidden = _answer_hidden(model, micro)
        logits = jnp.matmul(hidden, model.head_kernel(), preferred_element_type=jnp.float32)
        targets = jnp.where(micro["label"] == 0, yes_id, no_id)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        valid = micro["valid"].astype(jnp.float32) if "valid" in micro else jnp.ones_like(losses)
        return jnp.sum(losses * valid), jnp.sum(valid)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def grad_at(length):
        def cut_grad(lora, base_state, micro, key):
            cut = {k: v[..., :length] if k in _SEQUENCE_KEYS else v for k, v in micro.items()}
            return grad_fn(lora, base_state, cut, key)

        return cut_grad

    def one_run(lora, opt_state, rng, batch, branch, base_state, step, branches):
        run_key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)

        def accumulate(carry, xs):
            grads, loss_sum, count = carry
            micro, index, micro_branch = xs
            key = jax.random.fold_in(run_key, index)
            (loss, n), g = jax.lax.switch(micro_branch, branches, lora, base_state, micro, key)
            return (jax.tree.map(jnp.add, grads, g), loss_sum + loss, count + n), None

        zeros = jax.tree.map(jnp.zeros_like, lora)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (grads, loss_sum, count), _ = jax.lax.scan(accumulate, init, (batch, jnp.arange(grad_accum), branch))
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss_sum / count

    def skip(lora, base_state, micro, key):
        return (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)), jax.tree.map(jnp.zeros_like, lora)

    def train_step(base_state: nnx.State, runs: RunsState, batch: Batch) -> tuple[RunsState, jax.Array]:
        _check_batch(batch, f"[runs={runs.num_runs}, grad_accum={grad_accum}, batch, seq]", (runs.num_runs, grad_accum))
        lengths = micro_batch_lengths(buckets, batch["input_ids"].shape[-1])
        # Each micro-batch's longest row over all runs (and devices) picks its branch; rows are
        # filled from the left, so a row's used length is its count of non-padding tokens.
        longest = jnp.max(jnp.sum(batch["attention_mask"] != 0, axis=-1), axis=(0, 2))
        branch = 1 + jnp.searchsorted(jnp.asarray(lengths), longest)
        if "valid" in batch:  # branch 0 skips micro-batches that hold no prompt in any run
            per_micro = jnp.moveaxis(batch["valid"], 1, 0).reshape(grad_accum, -1)
            branch = jnp.where(jnp.any(per_micro, axis=1), branch, 0)
        base = _cast_floats(base_state, compute_dtype)
        lora, opt_state, loss = jax.vmap(
            functools.partial(one_run, branches=[skip] + [grad_at(length) for length in lengths]),
            in_axes=(0, 0, 0, 0, None, None, None),
        )(runs.lora, runs.opt_state, runs.rng, dict(batch), branch, base, runs.step)
        return runs.replace(lora=lora, opt_state=opt_state, step=runs.step + 1), loss

    if mesh is None:
        return jax.jit(train_step, donate_argnums=1)
    out_shardings = (sharding.runs_shardings(runs, mesh), sharding.replicated(mesh))
    return jax.jit(train_step, donate_argnums=1, out_shardings=out_shardings)


def make_eval_step(
    graphdef: nnx.GraphDef,
    yes_id: int,
    no_id: int,
    *,
    mesh: jax.sharding.Mesh | None = None,
    compute_dtype: jnp.dtype | None = None,
) -> Callable[[nnx.State, nnx.State, Batch], jax.Array]:
    """Jitted ``eval_step(base_state, lora, batch) -> margins [R, B(, P)]`` (float32), dropout off.

    ``lora`` is ``runs.lora`` (stacked); ``batch`` leaves are [B, S] ([B] for
    answer_pos etc., or [B, P] for rows packed with P prompt slots, as
    ``eval_batches`` makes them), shared by all runs, or [R, B, ...]: run r
    scores its own examples ``batch[...][r]``. Margins have answer_pos's
    shape behind the run axis. The margin is logit(Yes) - logit(No) at the
    answer position, computed from the two head columns only. It compiles
    once per batch shape; ``eval_step._cache_size()`` counts them.
    """
    columns = np.asarray([yes_id, no_id], np.int32)

    def one_run(lora, base_state, batch):
        model = nnx.merge(graphdef, base_state, _cast_floats(lora, compute_dtype))
        model = nnx.view(model, only=nnx.Dropout, deterministic=True)
        hidden = _answer_hidden(model, batch)
        head = jnp.take(model.head_kernel(), columns, axis=1)
        logits = jnp.matmul(hidden, head, preferred_element_type=jnp.float32)
        return logits[..., 0] - logits[..., 1]

    def eval_step(base_state: nnx.State, lora: nnx.State, batch: Batch) -> jax.Array:
        num_runs = jax.tree.leaves(lora)[0].shape[0]
        per_run = "input_ids" in batch and batch["input_ids"].ndim == 3
        _check_batch(batch, f"[batch, seq] or [runs={num_runs}, batch, seq]", (num_runs,) if per_run else ())
        batch_axis = 0 if per_run else None
        return jax.vmap(one_run, in_axes=(0, None, batch_axis))(
            lora, _cast_floats(base_state, compute_dtype), dict(batch)
        )

    return jax.jit(eval_step, out_shardings=None if mesh is None else sharding.replicated(mesh))
