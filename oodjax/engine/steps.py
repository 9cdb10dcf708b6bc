"""The jitted train and eval steps for R runs that share one frozen base.

A "run" is one (seed, shots) fine-tuning job; runs share one copy of the base
weights and stack their adapters, optimizer state and dropout key on a leading
run axis (``TrainState``). Each token goes through its own run's adapters and
each prompt's loss is weighted within its run, so packing all runs' prompts
into one batch wastes little on padding while every run gets exactly the
update it would get alone.

Only the answer position (the last prompt token) matters, so the output head
runs on one position per example.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.typing import DTypeLike

from oodjax.data import SEQUENCE_KEYS, TRAIN_ONLY_KEYS
from oodjax.engine import sharding
from oodjax.engine.geometry import BatchGeometry
from oodjax.engine.optimizer import Optimizer
from oodjax.engine.optimizer import make_optimizer as make_optimizer  # the benchmarks' name for it
from oodjax.models.layers import STACKED, CausalLM, segment_positions
from oodjax.models.lora import LoRAConfig, adapter_tokens, apply_lora
from oodjax.models.partitioning import param_shardings

Batch = Mapping[str, Any]


class TrainState(flax.struct.PyTreeNode):
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


def attach_runs(
    model: nnx.Module,
    seeds: Sequence[int],
    lora_cfg: LoRAConfig,
    optimizer: optax.GradientTransformation,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[nnx.GraphDef, nnx.State, TrainState]:
    """Attaches the runs' adapters to ``model`` in place: (graphdef, frozen base state, the runs' ``TrainState``).

    Run r's adapters and dropout key come from ``nnx.Rngs(seeds[r])`` alone, so
    they equal a single run's with that seed; every process of a mesh builds the
    same values and places its own blocks.
    """
    if not seeds:
        raise ValueError("attach_runs needs at least one seed")
    loras, keys = [], []
    for seed in seeds:
        rngs = nnx.Rngs(seed)
        apply_lora(model, lora_cfg, rngs=rngs)
        loras.append(nnx.state(model, nnx.LoRAParam))
        keys.append(jax.random.key_data(rngs.dropout()))
    graphdef, _, *rest = nnx.split(model, nnx.LoRAParam, ...)
    (base_state,) = rest  # the state of ``...``: all but the adapters
    lora = jax.tree.map(lambda *xs: jnp.stack(xs), *loras)
    state = TrainState(
        lora=lora, opt_state=jax.vmap(optimizer.init)(lora), rng=jnp.stack(keys), step=jnp.zeros((), jnp.int32)
    )
    if mesh is not None:
        base_state = sharding.place(base_state, param_shardings(base_state, mesh))
        state = sharding.place(state, sharding.runs_shardings(state, mesh))
    else:
        # Committed, as the train step's outputs are: an uncommitted first input
        # would give the first call a compilation of its own.
        state = jax.device_put(state, jax.local_devices()[0])
    return graphdef, base_state, state


def abstract_attach_runs(
    make_model: Callable[[], nnx.Module],
    seeds: Sequence[int],
    lora_cfg: LoRAConfig,
    optimizer: optax.GradientTransformation,
) -> tuple[nnx.GraphDef, nnx.State, TrainState]:
    """``attach_runs`` as shapes only, so the preflight can compile a large model's steps on any machine."""
    graphdefs = []

    def shapes() -> tuple[nnx.State, TrainState]:
        graphdef, base_state, state = attach_runs(make_model(), seeds, lora_cfg, optimizer)
        graphdefs.append(graphdef)  # static: it leaves the trace as it is
        return base_state, state

    base_state, state = jax.eval_shape(shapes)
    return graphdefs[0], base_state, state


def _cast_floats(tree: Any, dtype: DTypeLike | None) -> Any:
    """Casts the floating-point leaves of ``tree`` (not keys or integers) to ``dtype``; None keeps them."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def answer_hidden(model: CausalLM, batch: Batch) -> jax.Array:
    """The final hidden state at each prompt's answer position: [B, H'] or [B, P, H'] (P packed prompt slots).

    The gather stays within each row, so a batch split over devices by rows gathers on each device alone.
    """
    hidden = model.hidden_states(batch["input_ids"], batch["segment_ids"])
    positions = batch["answer_pos"]
    per_row = positions.reshape(positions.shape[0], -1, 1)
    picked = jnp.take_along_axis(hidden, per_row, axis=1)
    return picked.reshape(*positions.shape, hidden.shape[-1])


def answer_losses(model: CausalLM, batch: Batch, yes_id: int, no_id: int) -> jax.Array:
    """Each prompt's full-vocabulary cross-entropy (target " Yes" for label 0, " No" otherwise), unmasked."""
    logits = model.head_logits(answer_hidden(model, batch), model.head_kernel())
    targets = jnp.where(batch["label"] == 0, yes_id, no_id)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def eval_margins(model: CausalLM, batch: Batch, yes_id: int, no_id: int) -> jax.Array:
    """logit(Yes) - logit(No) at the answer positions, from the two head columns only."""
    head = jnp.take(model.head_kernel(), np.asarray([yes_id, no_id], np.int32), axis=1)
    logits = model.head_logits(answer_hidden(model, batch), head)
    return logits[..., 0] - logits[..., 1]


def runs_inside_layers(lora: nnx.State) -> nnx.State:
    """[R, layers, ...] -> [layers, R, ...], so each scanned layer sees its R adapters."""
    return _move_run_axis(lora, 0, 1)


def _move_run_axis(lora: nnx.State, source: int, destination: int) -> nnx.State:
    def move(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        stacked = any(getattr(key, "key", None) == STACKED for key in path)
        return jnp.moveaxis(x, source, destination) if stacked else x

    return jax.tree_util.tree_map_with_path(move, lora)


def micro_batch_loss(
    lora: nnx.State,
    base_state: nnx.State,
    micro: Batch,
    run_keys: jax.Array,
    run_weights: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    yes_id: int,
    no_id: int,
    compute_dtype: DTypeLike | None,
) -> tuple[jax.Array, jax.Array]:
    """The function differentiated: the runs' answer losses weighted by ``run_weights`` [R], summed; and each
    run's unweighted sum [R].

    Each token's dropout is keyed by its run, example and position (``AdapterTokens``), so a run's result
    does not depend on where its prompts sit or what trains beside it.
    """
    # copy: fresh Variables at this trace level, so the adapters' tokens may be set on them.
    model = nnx.merge(graphdef, base_state, _cast_floats(lora, compute_dtype), copy=True)
    segments = micro["segment_ids"]
    slot = jnp.maximum(segments - 1, 0)  # each token's prompt slot in its row (padding: slot 0's, unused)
    adapter_tokens(model).set(
        runs=jnp.take_along_axis(micro["run"], slot, axis=1),
        examples=jnp.take_along_axis(micro["example"], slot, axis=1),
        positions=segment_positions(segments),
        run_keys=run_keys,
    )
    losses = answer_losses(model, micro, yes_id, no_id) * micro["valid"]
    per_run = jnp.zeros(run_weights.shape, jnp.float32).at[micro["run"]].add(losses)
    return jnp.sum(losses * run_weights[micro["run"]]), per_run


def micro_batch_grads(
    lora: nnx.State, base_state: nnx.State, micro: Batch, *rest: jax.Array, length: int, loss: Callable[..., Any]
) -> tuple[tuple[jax.Array, jax.Array], nnx.State]:
    """``loss``'s value and gradients on ``micro`` cut to ``length`` tokens (rows fill from the left, so the
    cut drops only padding)."""
    cut = {k: v[..., :length] if k in SEQUENCE_KEYS else v for k, v in micro.items()}
    return jax.value_and_grad(loss, has_aux=True)(lora, base_state, cut, *rest)


def skip_micro_batch(
    lora: nnx.State, base_state: nnx.State, micro: Batch, run_keys: jax.Array, run_weights: jax.Array
) -> tuple[tuple[jax.Array, jax.Array], nnx.State]:
    """``micro_batch_grads``'s result for a micro-batch without a prompt: zeros, at no cost."""
    zero = jnp.zeros((), jnp.float32)
    return (zero, jnp.zeros(run_weights.shape, jnp.float32)), jax.tree.map(jnp.zeros_like, lora)


def micro_batch_branches(batch: Batch, geometry: BatchGeometry) -> jax.Array:
    """Per micro-batch, the ``lax.switch`` branch: 0 skips it (no valid prompt), b >= 1 runs it at
    ``geometry.micro_batch_lengths[b - 1]``. Taken over all rows, so every device takes the same branch."""
    longest = jnp.max(jnp.sum(batch["segment_ids"] != 0, axis=-1), axis=-1)
    branch = 1 + jnp.searchsorted(jnp.asarray(geometry.micro_batch_lengths), longest)
    return jnp.where(jnp.any(batch["valid"], axis=(1, 2)), branch, 0)


def step_loss(
    base_state: nnx.State,
    state: TrainState,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    yes_id: int,
    no_id: int,
    compute_dtype: DTypeLike | None,
) -> tuple[Callable[..., tuple[jax.Array, jax.Array]], tuple[Any, ...]]:
    """What ``train_step`` differentiates on each micro-batch, and its arguments but the micro-batch: (loss,
    (adapters [layers, R, ...], base in ``compute_dtype``, run keys, run weights)). ``launch.costs`` traces the
    same for the activations the backward pass keeps."""
    valid = batch["valid"].astype(jnp.float32)
    counts = jnp.zeros(state.num_runs, jnp.float32).at[batch["run"]].add(valid)
    run_weights = 1.0 / jnp.maximum(counts, 1.0)
    # Each run's dropout key for this step: fold_in(run key, step), a function of the run alone.
    run_keys = jax.vmap(lambda rng: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(rng), state.step)))(
        state.rng
    )
    loss = functools.partial(
        micro_batch_loss, graphdef=graphdef, yes_id=yes_id, no_id=no_id, compute_dtype=compute_dtype
    )
    return loss, (runs_inside_layers(state.lora), _cast_floats(base_state, compute_dtype), run_keys, run_weights)


def _check_batch(batch: Batch, layout: str, expected: tuple[int | None, ...], train_keys: tuple[str, ...] = ()) -> None:
    """Trace-time shape check, so a malformed batch fails once and clearly. ``expected`` is input_ids' shape,
    None where any size goes; label, ``train_keys`` (a training batch's) and valid, if there, are shaped as
    answer_pos, which has a prompt-slot axis if packed, and always in a training batch."""
    per_prompt, slots = ("label", *train_keys), bool(train_keys)
    for key in ("input_ids", "segment_ids", "answer_pos", *per_prompt):
        if key not in batch:
            missing = (
                f"a training batch needs {key!r} per prompt slot" if key in train_keys else f"batch is missing {key!r}"
            )
            raise ValueError(f"{missing}; it has {sorted(batch)}")
    ids = batch["input_ids"]
    if ids.ndim != len(expected) or any(e is not None and e != n for e, n in zip(expected, ids.shape)):
        raise ValueError(f"batch['input_ids'] has shape {tuple(ids.shape)}; expected {layout}")
    mask = tuple(batch["segment_ids"].shape)
    if mask != tuple(ids.shape):
        raise ValueError(f"batch['segment_ids'] has shape {mask}; expected {tuple(ids.shape)}")
    answers = tuple(batch["answer_pos"].shape)
    if answers[: ids.ndim - 1] != tuple(ids.shape[:-1]) or not ids.ndim - 1 + slots <= len(answers) <= ids.ndim:
        slot = "+ a prompt-slot axis" if slots else "(+ a prompt-slot axis if packed)"
        raise ValueError(f"batch['answer_pos'] has shape {answers}; expected {tuple(ids.shape[:-1])} {slot}")
    for key in (*per_prompt, "valid") if "valid" in batch else per_prompt:
        if tuple(batch[key].shape) != answers:
            raise ValueError(f"batch[{key!r}] has shape {tuple(batch[key].shape)}; expected {answers} (answer_pos's)")


def train_step(
    base_state: nnx.State,
    state: TrainState,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    yes_id: int,
    no_id: int,
    geometry: BatchGeometry,
    compute_dtype: DTypeLike | None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step of every run (``make_train_step`` documents it; this is the function it jits)."""
    micro_batches, rows = geometry.train_rows_shape
    layout = f"[grad_accum={micro_batches}, rows={rows}, seq={geometry.seq_len}]"
    _check_batch(batch, layout, (micro_batches, rows, geometry.seq_len), TRAIN_ONLY_KEYS)
    loss, (lora, base_state, run_keys, run_weights) = step_loss(
        base_state, state, batch, graphdef=graphdef, yes_id=yes_id, no_id=no_id, compute_dtype=compute_dtype
    )
    branches = [skip_micro_batch] + [
        functools.partial(micro_batch_grads, length=length, loss=loss) for length in geometry.micro_batch_lengths
    ]

    def accumulate(
        carry: tuple[nnx.State, jax.Array], xs: tuple[Batch, jax.Array]
    ) -> tuple[tuple[nnx.State, jax.Array], None]:
        grads, loss_sums = carry
        micro, branch = xs
        (_, per_run), g = jax.lax.switch(branch, branches, lora, base_state, micro, run_keys, run_weights)
        return (jax.tree.map(jnp.add, grads, g), loss_sums + per_run), None

    init = (jax.tree.map(jnp.zeros_like, lora), jnp.zeros(state.num_runs, jnp.float32))
    (grads, loss_sums), _ = jax.lax.scan(accumulate, init, (dict(batch), micro_batch_branches(batch, geometry)))

    def update(lora: nnx.State, opt_state: optax.OptState, grads: nnx.State) -> tuple[Any, ...]:
        """One run's optimizer step; its gradients' global norm before clipping too."""
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, optax.global_norm(grads)

    # the gradients back from [layers, R, ...] to the run-stacked [R, layers, ...]
    new_lora, opt_state, grad_norms = jax.vmap(update)(state.lora, state.opt_state, _move_run_axis(grads, 1, 0))
    state = state.replace(lora=new_lora, opt_state=opt_state, step=state.step + 1)
    return state, {"loss": loss_sums * run_weights, "grad_norm": grad_norms}


def eval_step(
    base_state: nnx.State,
    lora: nnx.State,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    yes_id: int,
    no_id: int,
    compute_dtype: DTypeLike | None,
) -> jax.Array:
    """Every run's margins on ``batch``, as one batch [B * R, S], row-major so it splits over devices as B does."""
    num_runs = jax.tree.leaves(lora)[0].shape[0]
    per_run = "input_ids" in batch and batch["input_ids"].ndim == 3
    expected = (num_runs, None, None) if per_run else (None, None)
    _check_batch(batch, f"[batch, seq] or [runs={num_runs}, batch, seq]", expected)
    rows = batch["input_ids"].shape[-2]
    by_row = {
        k: (jnp.moveaxis(v, 0, 1) if per_run else jnp.broadcast_to(v[:, None], (rows, num_runs, *v.shape[1:])))
        for k, v in batch.items()
    }
    flat = {k: v.reshape(rows * num_runs, *v.shape[2:]) for k, v in by_row.items()}
    lora = _cast_floats(runs_inside_layers(lora), compute_dtype)
    model = nnx.merge(graphdef, _cast_floats(base_state, compute_dtype), lora, copy=True)
    runs = jnp.broadcast_to(jnp.tile(jnp.arange(num_runs), rows)[:, None], flat["input_ids"].shape)
    zeros = jnp.zeros_like(runs)  # dropout is off: no token needs an identity
    adapter_tokens(model).set(runs=runs, examples=zeros, positions=zeros, run_keys=jnp.zeros((num_runs, 2)))
    margins = eval_margins(nnx.view(model, only=nnx.Dropout, deterministic=True), flat, yes_id, no_id)
    return jnp.moveaxis(margins.reshape(rows, num_runs, *margins.shape[1:]), 1, 0)


@dataclasses.dataclass(frozen=True)
class MeshStep:
    """A jitted step traced, lowered and called under ``jax.set_mesh(mesh)``.

    The models constrain activation shardings only under a mesh, and the jit cache key includes the mesh in
    context: entering it on every call keeps the one compiled program hitting.
    """

    jitted: Any  # the jax.jit-wrapped step
    mesh: jax.sharding.Mesh

    def __call__(self, *args: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.jitted(*args)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jitted.lower`` under the mesh, for ahead-of-time compilation (the preflight)."""
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*args)

    def _cache_size(self) -> int:
        """Compiled programs held by the jitted step (what tests count to see nothing recompiles)."""
        return self.jitted._cache_size()


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    yes_id: int,
    no_id: int,
    geometry: BatchGeometry,
    *,
    mesh: jax.sharding.Mesh | None = None,
    base_state: nnx.State | None = None,
    state: TrainState | None = None,
    compute_dtype: DTypeLike | None = None,
) -> Callable[[nnx.State, TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """One jitted optimizer step for all runs: ``(base_state, state, batch) -> (state, {"loss": [R],
    "grad_norm": [R]})``; ``state`` is donated.

    ``batch`` is laid out by ``oodjax.data.train_steps``: [grad_accum, rows, seq_len] tokens and
    [grad_accum, rows, prompt slots] per-prompt leaves. Each prompt is weighted by 1 / its run's count before
    the gradients are summed over micro-batches, so accumulation is exact, not an average of averages. The
    micro-batch length is chosen inside the step (``lax.switch``), so it compiles once.

    ``compute_dtype`` casts for the forward/backward pass only; adapters and optimizer state stay float32.
    With a ``mesh``, pass ``base_state`` and ``state`` (or their shapes): pinning the shardings in and out
    keeps XLA from spelling an equivalent sharding differently and recompiling every step.
    """
    step = functools.partial(
        train_step,
        graphdef=graphdef,
        optimizer=optimizer,
        yes_id=yes_id,
        no_id=no_id,
        geometry=geometry,
        compute_dtype=compute_dtype,
    )
    if mesh is None:
        return jax.jit(step, donate_argnums=1)
    if base_state is None or state is None:
        raise ValueError(
            "make_train_step with a mesh needs base_state= and state= (from attach_runs) for its shardings"
        )
    state_shardings = sharding.runs_shardings(state, mesh)
    jitted = jax.jit(
        step,
        in_shardings=(param_shardings(base_state, mesh), state_shardings, sharding.batch_sharding(mesh, 1)),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=1,
    )
    return MeshStep(jitted, mesh)


def make_eval_step(
    graphdef: nnx.GraphDef,
    yes_id: int,
    no_id: int,
    *,
    mesh: jax.sharding.Mesh | None = None,
    compute_dtype: DTypeLike | None = None,
) -> Callable[[nnx.State, nnx.State, Batch], jax.Array]:
    """Jitted ``eval_step(base_state, lora, batch) -> margins [R, B(, P)]`` (float32), dropout off.

    ``batch`` leaves are [B, S], shared by all runs, or [R, B, S]: run r scores its own examples. It
    compiles once per batch shape.
    """
    step = functools.partial(eval_step, graphdef=graphdef, yes_id=yes_id, no_id=no_id, compute_dtype=compute_dtype)
    return jax.jit(step) if mesh is None else MeshStep(jax.jit(step, out_shardings=sharding.replicated(mesh)), mesh)


def make_steps(
    optimizer: Optimizer,
    compute_dtype: str | None,
    geometry: BatchGeometry,
    graphdef: nnx.GraphDef,
    base_state: nnx.State,
    state: TrainState,
    yes_id: int,
    no_id: int,
    mesh: jax.sharding.Mesh,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A job's (train_step, eval_step): what the loop runs and ``launch.preflight`` compiles (so ``base_state``
    and ``state`` may be abstract)."""
    train = make_train_step(
        graphdef,
        optimizer.transformation,
        yes_id,
        no_id,
        geometry,
        mesh=mesh,
        base_state=base_state,
        state=state,
        compute_dtype=compute_dtype,
    )
    return train, make_eval_step(graphdef, yes_id, no_id, mesh=mesh, compute_dtype=compute_dtype)
