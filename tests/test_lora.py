"""LoRA adapters: a fresh adapter changes nothing, the init is peft's, targets are checked,
and an exported adapter loaded by peft onto the PyTorch model reproduces our logits."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_models_parity import LAYOUTS, padded_batches, save, tiny_hf_model

from oodjax.models import from_config, load_pretrained
from oodjax.models.layers import run_layers, stacked_layers
from oodjax.models.lora import (
    AdapterTokens,
    LoRA,
    LoRAConfig,
    LoRADropout,
    adapter_tokens,
    apply_lora,
    dropout_keep_mask,
    dropout_threshold,
    export_peft,
    find_targets,
)

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=1)
HF_CONFIGS = {
    "opt": dict(model_type="opt", ffn_dim=64, max_position_embeddings=32, **TINY),
    "olmo2": dict(model_type="olmo2", intermediate_size=48, num_key_value_heads=2, **TINY),
    "llama": dict(model_type="llama", intermediate_size=48, num_key_value_heads=2, tie_word_embeddings=True, **TINY),
    "qwen2": dict(model_type="qwen2", intermediate_size=48, num_key_value_heads=2, **TINY),
    "qwen3": dict(model_type="qwen3", intermediate_size=48, num_key_value_heads=2, head_dim=16, **TINY),
    "phi3": dict(model_type="phi3", intermediate_size=48, num_key_value_heads=2, **TINY),
    "gemma3_text": dict(model_type="gemma3_text", intermediate_size=48, num_key_value_heads=2, head_dim=16, **TINY),
}
ATTENTION = {
    "opt": "q_proj k_proj v_proj out_proj",
    "olmo2": "q_proj k_proj v_proj o_proj",
    "llama": "q_proj k_proj v_proj o_proj",
    "qwen2": "q_proj k_proj v_proj o_proj",
    "qwen3": "q_proj k_proj v_proj o_proj",
    "phi3": "qkv_proj o_proj",  # q/k/v fused: one adapter, as peft puts on Phi-3
    "gemma3_text": "q_proj k_proj v_proj o_proj",
}
LOGITS_TOL = 1e-4


def logits(model, ids, mask) -> np.ndarray:
    """The forward pass jitted over the split state (one compile beats op-by-op eager dispatch)."""
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda state: nnx.merge(graphdef, state)(ids, mask))(state))


def adapted_layer_names(model) -> set[str]:
    return {".".join(map(str, path)) for path, m in nnx.iter_modules(model) if isinstance(m, LoRA)}


def token_identities(runs, *, examples=None, positions=None, run_keys=None) -> dict[str, jax.Array]:
    """``AdapterTokens.set``'s arguments for tokens of ``runs`` (any shape): by default example = the token's
    row, position = its column (the last axis), and run r's key [r, r + 1000] (distinct)."""
    runs = np.asarray(runs)
    grid = np.indices(runs.shape) if runs.ndim else np.zeros((1,), np.int64)
    examples = grid[0] if examples is None else np.asarray(examples)
    positions = grid[-1] if positions is None else np.asarray(positions)
    if run_keys is None:
        num_runs = int(runs.max()) + 1
        run_keys = np.stack([np.arange(num_runs), np.arange(num_runs) + 1000], axis=-1)
    return dict(
        runs=jnp.asarray(runs, jnp.int32),
        examples=jnp.asarray(examples, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        run_keys=jnp.asarray(run_keys, jnp.uint32),
    )


def tokens_set(runs, **identities) -> AdapterTokens:
    """A fresh ``AdapterTokens`` (its stream at its first draw) with ``token_identities(runs, ...)`` set."""
    tokens = AdapterTokens()
    tokens.set(**token_identities(runs, **identities))
    return tokens


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_fresh_adapter_leaves_logits_unchanged(family):
    """B = 0, so the default q/k/v/o adapters add exactly zero. Each adapter's delta is checked bitwise; the
    logits to float32 rounding, since XLA may fuse the added zero into a differently rounded kernel (it does on
    AVX-512 CPUs)."""
    model = from_config(HF_CONFIGS[family], seed=3)
    ids, mask = padded_batches(96)["right"]
    before = logits(model, ids, mask)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=0.0), rngs=nnx.Rngs(0))
    after = logits(model, ids, mask)
    adapted = adapted_layer_names(model)
    prefix = "model.decoder.layers" if family == "opt" else "model.layers"  # stacked: one adapter per projection
    assert adapted == {f"{prefix}.self_attn.{name}.lora" for name in ATTENTION[family].split()}
    # Outside the scan a stacked adapter's leading (layers) axis reads as runs: the tokens of row i are given
    # run i, so layer i's input meets layer i's adapter.
    layers = HF_CONFIGS[family]["num_hidden_layers"]
    adapter_tokens(model).set(**token_identities(np.repeat(np.arange(layers)[:, None], 3, axis=1)))
    for _, linear in find_targets(model, None):
        layers, fan_in, fan_out = linear.kernel.shape
        x = jax.random.normal(jax.random.key(1), (layers, 3, fan_in))
        np.testing.assert_array_equal(linear.lora(x), np.zeros((layers, 3, fan_out), np.float32))
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-6)


def test_init_is_peft_kaiming_uniform_and_zero_b_in_float32_on_bf16_base():
    model = from_config(HF_CONFIGS["llama"], dtype="bfloat16")
    apply_lora(model, LoRAConfig(rank=8, alpha=32.0, dropout=0.1, targets=("q_proj", "down_proj")), rngs=nnx.Rngs(1))
    for path, linear in find_targets(model, ("q_proj", "down_proj")):
        a, b = linear.lora.lora_a[...], linear.lora.lora_b[...]
        layers, fan_in, fan_out = linear.kernel.shape  # stacked layers: every layer's adapter drawn alike
        assert linear.kernel.dtype == jnp.bfloat16 and a.dtype == b.dtype == jnp.float32, path
        assert a.shape == (layers, fan_in, 8) and b.shape == (layers, 8, fan_out)
        assert not np.array_equal(a[0], a[1])  # each layer its own draw
        assert isinstance(linear.lora.lora_a, nnx.LoRAParam) and isinstance(linear.lora.lora_a, nnx.Param)
        # kaiming_uniform_(a=sqrt(5)) on torch's [r, in] weight: U(-1/sqrt(in), 1/sqrt(in))
        bound = 1 / np.sqrt(fan_in)
        assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound
        assert abs(float(np.std(a)) - bound / np.sqrt(3)) < 0.25 * bound / np.sqrt(3)
        np.testing.assert_array_equal(b, 0)
    assert linear.lora.scale == 4.0
    # the same seed gives the same adapters
    again = from_config(HF_CONFIGS["llama"], dtype="bfloat16")
    apply_lora(again, LoRAConfig(targets=("q_proj", "down_proj")), rngs=nnx.Rngs(1))
    for (_, x), (_, y) in zip(
        nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)),
        nnx.to_flat_state(nnx.state(again, nnx.LoRAParam)),
        strict=True,
    ):
        np.testing.assert_array_equal(x[...], y[...])


def test_adapters_inherit_the_kernels_logical_axes():
    model = from_config(HF_CONFIGS["olmo2"])
    apply_lora(model, LoRAConfig(), rngs=nnx.Rngs(0))
    attn = model.model.layers.self_attn  # stacked: [layers, in, out]
    q_axes = attn.q_proj.kernel.get_metadata()["out_sharding"]
    o_axes = attn.o_proj.kernel.get_metadata()["out_sharding"]
    assert q_axes == ("layers", "embed", "heads")
    assert attn.q_proj.lora.lora_a.get_metadata()["out_sharding"] == ("layers", q_axes[1], None)
    assert attn.q_proj.lora.lora_b.get_metadata()["out_sharding"] == ("layers", None, q_axes[2])
    assert attn.o_proj.lora.lora_b.get_metadata()["out_sharding"] == ("layers", None, o_axes[2])
    assert attn.q_proj.lora.lora_a.shape == (HF_CONFIGS["olmo2"]["num_hidden_layers"], 32, 8)


def test_bad_targets_and_configs_are_clear_errors():
    model = from_config(HF_CONFIGS["opt"])
    with pytest.raises(ValueError, match=r"\['o_proj'\] match no linear layer.*out_proj"):
        apply_lora(model, LoRAConfig(targets=("q_proj", "o_proj")), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="dropout must be in"):
        LoRAConfig(dropout=1.0)
    with pytest.raises(ValueError, match=r"dropout rate 1e-06 is realised as 0 / 2\*\*16"):  # masks draw 16 bits
        LoRAConfig(dropout=1e-6)
    with pytest.raises(ValueError, match=r"is realised as 65536 / 2\*\*16"):
        LoRAConfig(dropout=1 - 1e-6)
    assert LoRAConfig(dropout=2**-16).dropout == 2**-16
    with pytest.raises(ValueError, match="targets must be a non-empty sequence"):
        LoRAConfig(targets="q_proj")


def test_dropout_masks_differ_between_projections_and_calls():
    """One shared stream: every adapter of the model shares one AdapterTokens, q and k (same input) get
    different masks, and each call a new one (test_models_layers checks that each scanned layer draws its own)."""
    model = from_config(HF_CONFIGS["opt"])
    apply_lora(model, LoRAConfig(rank=4, alpha=4.0, dropout=0.5, targets=("q_proj", "k_proj")), rngs=nnx.Rngs(0))
    layers = model.model.decoder.layers
    attn = layers.self_attn
    assert attn.q_proj.lora.tokens is attn.k_proj.lora.tokens is adapter_tokens(model)
    for proj in (attn.q_proj, attn.k_proj):  # A the identity on the first 4 features, B = I
        proj.lora.lora_a[...] = jnp.broadcast_to(jnp.eye(32, 4), (2, 32, 4))
        proj.lora.lora_b[...] = jnp.broadcast_to(jnp.eye(4, 32), (2, 4, 32))
    x = jnp.ones((2, 3, 32))  # outside the scan the 2 stacked layers read as runs: row i is run i's
    adapter_tokens(model).set(**token_identities(np.repeat(np.arange(2)[:, None], 3, axis=1)))
    q1, k1, q2 = attn.q_proj.lora(x), attn.k_proj.lora(x), attn.q_proj.lora(x)
    kept = lambda y: tuple(np.asarray(y[..., :4] != 0).ravel())  # noqa: E731
    assert {float(v) for v in np.asarray(q1[..., :4]).ravel()} <= {0.0, 2.0}  # kept inputs scaled by 1/(1-0.5)
    assert len({kept(q1), kept(k1), kept(q2)}) == 3


class _TwoAdapterMasks(nnx.Module):
    """A layer whose output encodes the masks of two adapters' dropouts drawn from one shared AdapterTokens (the
    first mask plus twice the second, each scaled by 1 / keep), whatever its input: what run_layers feeds q and k."""

    def __init__(self, rate: float, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones(()))  # a stacked parameter, as run_layers expects
        self.q, self.k = LoRADropout(rate), LoRADropout(rate)
        self.tokens = nnx.data(None)  # shared (not stacked): set after stacking, as apply_lora shares one

    def __call__(self, hidden):
        ones = jnp.ones_like(hidden)
        return (self.q(ones, tokens=self.tokens) + 2 * self.k(ones, tokens=self.tokens)) * self.scale[...]


def within_sigmas(fraction: float, p: float, n: int, sigmas: float = 5.0) -> bool:
    """A binomial fraction of n draws agrees with probability p to ``sigmas`` standard errors."""
    return abs(fraction - p) < sigmas * math.sqrt(p * (1 - p) / n)


def step_run_key(step: int) -> np.ndarray:
    """One run's dropout key [2] at ``step``, as the train step derives it (fold_in(run key, step))."""
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(5), step)))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.03])
def test_dropout_masks_have_the_configured_rate_and_are_independent(rate):
    """Over 2**20 draws per mask, each adapter's mask keeps its elements with probability 1 - rate (within five
    standard errors: 0.0015 at rate 0.1), kept ones scaled by 1 / (1 - realised rate) (2**-16 steps, so within
    2**-16 of torch's 1 / (1 - rate)); masks of two adapters (one stream), of two layers (run_layers folds the
    index in) and of two steps (another run key, as the train step folds the step into each run's key) are
    independent: both keep an element with probability (1 - rate)^2, as do neighbouring elements of one mask
    (which share a hash) and the same element of neighbouring tokens (consecutive counters)."""
    keep = 1.0 - rate
    realised_keep = 1.0 - dropout_threshold(rate) / 2**16
    assert abs(realised_keep - keep) <= 2**-17
    layers = stacked_layers(lambda rngs: _TwoAdapterMasks(rate, rngs), 2, nnx.Rngs(0))
    hidden = jnp.zeros((4, 256, 1024))
    masks = []
    for step in range(2):
        layers.tokens = tokens_set(np.zeros((4, 256)), run_keys=step_run_key(step)[None])  # a fresh stream each step
        out, inputs = run_layers(layers, hidden, remat="none", all_layers=True)
        for encoded in (inputs[1], out):  # layer 0's output, layer 1's output
            levels = np.asarray(encoded) * np.float32(realised_keep)
            np.testing.assert_allclose(levels, np.round(levels), atol=1e-5)  # 0, 1, 2 or 3 times 1 / keep
            levels = np.round(levels).astype(np.int32)
            masks += [levels % 2 == 1, levels // 2 == 1]  # q's, k's
    n = masks[0].size
    assert n == 2**20 and len(masks) == 8
    for mask in masks:
        assert within_sigmas(mask.mean(), keep, n), (mask.mean(), keep)
        both_neighbours = (mask[..., 1:] & mask[..., :-1]).mean()
        assert within_sigmas(both_neighbours, keep**2, n), both_neighbours
        both_next_tokens = (mask[:, 1:] & mask[:, :-1]).mean()  # positions p and p + 1 of one example
        assert within_sigmas(both_next_tokens, keep**2, n), both_next_tokens
    for i, first in enumerate(masks):
        for second in masks[i + 1 :]:
            both = (first & second).mean()
            assert within_sigmas(both, keep**2, n), (i, both, keep**2)


def test_a_tokens_mask_depends_only_on_its_runs_key_its_counter_and_the_draw():
    """The tokens of three runs (4 examples of 8 positions each), placed in two layouts (rows, order and row
    length all differ, and so does the run's index in one of them), draw the same mask per token, draw by
    draw; so does one run's tokens alone (its key the only one, its index 0). Each token's mask is its own
    (the counters differ), and a second draw of the stream differs from the first."""
    rate, width, draws = 0.5, 64, 2
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(11), 3)))  # [3, 2]
    run, example, position = (g.ravel() for g in np.indices((3, 4, 8)))  # the 96 tokens, in canonical order

    def masks_by_token(order, shape, *, renumber=(0, 1, 2)):
        """Each draw's [96, width] masks of the tokens placed in ``order`` over rows of ``shape``, by token; run r
        given the index ``renumber[r]`` (its key moved alike)."""
        renumber = np.asarray(renumber)
        run_keys = np.zeros_like(keys)
        run_keys[renumber] = keys
        tokens = tokens_set(
            renumber[run[order]].reshape(shape),
            examples=example[order].reshape(shape),
            positions=position[order].reshape(shape),
            run_keys=run_keys,
        )
        by_token = []
        for _ in range(draws):
            placed = np.asarray(tokens.keep_mask((*shape, width), rate)).reshape(len(order), width)
            canonical = np.zeros((run.size, width), bool)
            canonical[order] = placed
            by_token.append(canonical)
        return by_token

    rng = np.random.default_rng(0)
    first = masks_by_token(rng.permutation(96), (4, 24))
    second = masks_by_token(rng.permutation(96), (8, 12))
    for draw in range(draws):
        np.testing.assert_array_equal(second[draw], first[draw], err_msg=f"draw {draw}")
    renumbered = masks_by_token(rng.permutation(96), (6, 16), renumber=np.array([1, 2, 0]))
    for draw in range(draws):
        np.testing.assert_array_equal(renumbered[draw], first[draw], err_msg=f"renumbered, draw {draw}")
    # run 1's tokens alone: its key the only one, its index 0
    own = np.flatnonzero(run == 1)
    alone_order = rng.permutation(own)
    tokens = tokens_set(
        np.zeros((4, 8)),
        examples=example[alone_order].reshape(4, 8),
        positions=position[alone_order].reshape(4, 8),
        run_keys=keys[1:2],
    )
    for draw in range(draws):
        alone = np.asarray(tokens.keep_mask((4, 8, width), rate)).reshape(own.size, width)
        np.testing.assert_array_equal(alone, first[draw][alone_order], err_msg=f"alone, draw {draw}")
    for masks in first:
        assert len({row.tobytes() for row in masks}) == run.size  # every token its own mask
    assert not np.array_equal(first[0], first[1])


def test_runs_with_different_keys_draw_independent_masks():
    """The same 2**10 tokens (counters) of two runs: with different keys their masks keep an element together
    with probability (1 - rate)^2 over 2**20 elements (within five standard errors), each at 1 - rate; with
    the same key they are the same (the run's index does not enter)."""
    rate, keep, width = 0.1, 0.9, 1024
    runs = np.repeat(np.arange(2)[:, None], 1024, axis=1)
    examples, positions = np.divmod(np.tile(np.arange(1024), (2, 1)), 32)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(12), 2)))
    masks = np.asarray(
        tokens_set(runs, examples=examples, positions=positions, run_keys=keys).keep_mask((2, 1024, width), rate)
    )
    n = masks[0].size
    assert n == 2**20
    for mask in masks:
        assert within_sigmas(mask.mean(), keep, n), mask.mean()
    both = (masks[0] & masks[1]).mean()
    assert within_sigmas(both, keep**2, n), both
    same_key = np.asarray(
        tokens_set(runs, examples=examples, positions=positions, run_keys=keys[[0, 0]]).keep_mask(
            (2, 1024, width), rate
        )
    )
    np.testing.assert_array_equal(same_key[0], same_key[1])
    np.testing.assert_array_equal(same_key[0], masks[0])


def lora_module(a: np.ndarray, b: np.ndarray, *, scale: float, rate: float, tokens: AdapterTokens) -> LoRA:
    """A LoRA with the given factors: a [in, rank] / b [rank, out] (one run's) or [R, in, rank] / [R, rank, out]."""
    lora = LoRA(
        (*a.shape[:-1], b.shape[-1]),
        rank=a.shape[-1],
        scale=scale,
        dropout=rate,
        tokens=tokens,
        kernel_axes=None,
        rngs=nnx.Rngs(0),
    )
    lora.lora_a[...], lora.lora_b[...] = jnp.asarray(a), jnp.asarray(b)
    return lora


def test_run_stacked_adapters_adapt_each_token_with_its_own_runs():
    """Adapters stacked over 3 runs give each token x @ A_r @ B_r * scale of its own run r (numpy, float64), as
    one run's adapter gives every token its own; with dropout on, one run's adapter with that run's tokens set
    (R = 1, its key the only one) gives its tokens what the stacked adapters give them among the others."""
    num_runs, fan_in, fan_out, rank, scale = 3, 16, 12, 4, 2.5
    rng = np.random.default_rng(1)
    a = rng.normal(size=(num_runs, fan_in, rank)).astype(np.float32)
    b = rng.normal(size=(num_runs, rank, fan_out)).astype(np.float32)
    x = rng.normal(size=(4, 6, fan_in)).astype(np.float32)
    runs = rng.permutation(np.repeat(np.arange(num_runs), 8)).reshape(4, 6)  # 8 tokens each, mixed in the rows
    a64, b64, x64 = a.astype(np.float64), b.astype(np.float64), x.astype(np.float64)
    expected = np.einsum("bsi,bsik,bsko->bso", x64, a64[runs], b64[runs]) * scale
    stacked = lora_module(a, b, scale=scale, rate=0.0, tokens=tokens_set(runs))
    np.testing.assert_allclose(np.asarray(stacked(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-5)
    for r in range(num_runs):  # one run's adapter, no tokens set (evaluation): every token goes through it
        alone = lora_module(a[r], b[r], scale=scale, rate=0.0, tokens=AdapterTokens())
        np.testing.assert_allclose(
            np.asarray(alone(jnp.asarray(x))), x64 @ a64[r] @ b64[r] * scale, rtol=1e-5, atol=1e-5
        )

    identities = dict(examples=rng.integers(0, 50, size=runs.shape), positions=rng.integers(0, 500, size=runs.shape))
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(13), num_runs)))
    stacked = lora_module(a, b, scale=scale, rate=0.5, tokens=tokens_set(runs, run_keys=keys, **identities))
    dropped = np.asarray(stacked(jnp.asarray(x)))
    assert np.abs(dropped - expected).max() > 0.1  # dropout on
    for r in range(num_runs):
        own = runs == r
        tokens = tokens_set(
            np.zeros(own.sum()),
            examples=identities["examples"][own],
            positions=identities["positions"][own],
            run_keys=keys[r : r + 1],
        )
        alone = np.asarray(lora_module(a[r], b[r], scale=scale, rate=0.5, tokens=tokens)(jnp.asarray(x[own])))
        np.testing.assert_allclose(alone, dropped[own], rtol=1e-6, atol=1e-6, err_msg=f"run {r}")


def test_dropout_without_the_tokens_set_is_an_error_naming_adapter_tokens_set():
    """Dropout on needs each token's run and identity; a model whose adapters drop out, run without the train
    step's ``AdapterTokens.set``, says so (as do run-stacked adapters with dropout off); dropout off does not."""
    lora = lora_module(
        np.ones((8, 2), np.float32), np.ones((2, 4), np.float32), scale=1.0, rate=0.1, tokens=AdapterTokens()
    )
    x = jnp.ones((2, 3, 8))
    with pytest.raises(ValueError, match=r"LoRA dropout needs .*AdapterTokens\.set"):
        lora(x)
    np.testing.assert_array_equal(nnx.view(lora, deterministic=True)(x), 16.0)  # off: one run's, no tokens needed
    stacked = lora_module(
        np.ones((2, 8, 2), np.float32), np.ones((2, 2, 4), np.float32), scale=1.0, rate=0.0, tokens=AdapterTokens()
    )
    with pytest.raises(ValueError, match=r"adapters of 2 runs need .*AdapterTokens\.set"):
        stacked(x)
    model = from_config(HF_CONFIGS["opt"])
    apply_lora(model, LoRAConfig(rank=4, dropout=0.1), rngs=nnx.Rngs(0))
    ids, mask = padded_batches(96)["right"]
    with pytest.raises(ValueError, match=r"AdapterTokens\.set"):
        model(ids, mask)


def test_dropout_masks_do_not_depend_on_how_the_mesh_splits_them():
    """A mask is a function of each token's key and counter and each element's index: its tokens and its
    output split over any axes of the mesh, the same (a width not a multiple of 4 cut from the last hash)."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rows, seq = 8, 16
    token_keys = jax.random.bits(jax.random.key(3), (rows, seq, 2), jnp.uint32)
    examples, positions = np.indices((rows, seq), dtype=np.uint32)
    counters = jnp.asarray(examples << 16 | positions)
    for width in (64, 30):
        draw = lambda keys, counters: dropout_keep_mask(keys, counters, width, 0.1)  # noqa: E731
        alone = np.asarray(jax.jit(draw)(token_keys, counters))
        assert alone.shape == (rows, seq, width) and 0.8 < alone.mean() < 0.97
        for spec in (P(("data", "fsdp")), P(None, None, "tensor"), P("data", "fsdp", "tensor"), P(None, "tensor")):
            token_spec = P(*spec[:2])
            sharded = jax.jit(draw, out_shardings=NamedSharding(mesh, spec))(
                jax.device_put(token_keys, NamedSharding(mesh, token_spec)),
                jax.device_put(counters, NamedSharding(mesh, token_spec)),
            )
            assert sharded.sharding.spec == spec
            np.testing.assert_array_equal(np.asarray(sharded), alone, err_msg=f"{spec}, width {width}")


def test_dropout_is_off_when_deterministic_or_at_rate_zero():
    unset = AdapterTokens()  # as in evaluation: dropout off needs no tokens
    x = jnp.arange(1.0, 9.0)[None, None]
    assert LoRADropout(0.0).keep_mask(x.shape, tokens=unset) is None
    np.testing.assert_array_equal(LoRADropout(0.0)(x, tokens=unset), x)
    off = nnx.view(LoRADropout(0.5), deterministic=True)  # what the eval step does
    assert off.keep_mask(x.shape, tokens=unset) is None
    np.testing.assert_array_equal(off(x, tokens=unset), x)
    on = LoRADropout(0.5)(x, tokens=tokens_set(np.zeros((1, 1))))
    assert set(np.asarray(on).ravel().tolist()) <= {0.0, *(2 * np.asarray(x)).ravel().tolist()}
    assert 0 < np.count_nonzero(on) < 8


# A layout of test_models_parity and the adapted layers (attention and one MLP projection).
EXPORT_CASES = {
    "opt_pre_ln": ("q_proj", "v_proj", "out_proj", "fc1"),
    "qwen2_bias_tied": ("q_proj", "v_proj", "o_proj", "up_proj"),
    "qwen3_qk_norm": ("q_proj", "k_proj", "o_proj", "down_proj"),
    "mistral_sliding": ("q_proj", "v_proj", "o_proj", "gate_proj"),
    "gemma2_softcap_sliding": ("q_proj", "v_proj", "o_proj", "up_proj"),
    "gemma3_local_rope": ("q_proj", "k_proj", "o_proj", "down_proj"),
    "phi3_fused_sliding": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}


@pytest.mark.parametrize("layout", sorted(EXPORT_CASES))
def test_peft_loads_our_export_and_reproduces_our_logits(tmp_path, layout):
    """Non-zero B (perturbed) on every adapter; peft on the PyTorch model must give our logits."""
    hf_model = tiny_hf_model(LAYOUTS[layout]())
    model = load_pretrained(save(hf_model, tmp_path / "base"))
    targets = EXPORT_CASES[layout]
    cfg = LoRAConfig(rank=4, alpha=16.0, dropout=0.1, targets=targets)
    apply_lora(model, cfg, rngs=nnx.Rngs(7))
    lora = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(1), 100))
    lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), lora)
    nnx.update(model, lora)
    ours = {
        side: logits(nnx.view(model, deterministic=True), ids, mask) for side, (ids, mask) in padded_batches(96).items()
    }
    base_logits = logits(load_pretrained(tmp_path / "base"), *padded_batches(96)["right"])
    assert np.abs(ours["right"] - base_logits).max() > 1e-2  # the adapters matter

    out = export_peft(lora, cfg, tmp_path / "adapter", base_model_name_or_path=f"tiny-{layout}")
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 16.0 and written["peft_type"] == "LORA"
    assert sorted(written["target_modules"]) == sorted(targets)
    peft_model = peft.PeftModel.from_pretrained(hf_model, out).eval()
    assert len([n for n, _ in peft_model.named_parameters() if "lora_A" in n]) == 8
    diffs = {}
    for side, (ids, mask) in padded_batches(96).items():
        with torch.no_grad():
            theirs = peft_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        diffs[side] = float(np.abs(ours[side] - theirs)[mask.astype(bool)].max())
    print("peft export max |logits diff|", diffs)
    assert max(diffs.values()) < LOGITS_TOL, diffs


def test_export_refuses_run_stacked_adapters(tmp_path):
    model = from_config(HF_CONFIGS["opt"])
    apply_lora(model, LoRAConfig(), rngs=nnx.Rngs(0))
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), nnx.state(model, nnx.LoRAParam))
    with pytest.raises(ValueError, match="export one run at a time"):
        export_peft(stacked, LoRAConfig(), tmp_path, base_model_name_or_path="x")
