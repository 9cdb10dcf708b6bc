"""The fused attention kernels (Pallas GPU flash, TPU splash), run here in Pallas' interpret mode, give the XLA
path's outputs and gradients on packed, left- and right-padded rows with grouped-query heads, also per device
under the engine's mesh; and ``auto`` means XLA on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oodjax import models
from oodjax.engine import sharding
from oodjax.models import flash_attention
from oodjax.models.layers import attention

B, T, N, K, D = 4, 96, 4, 2, 16  # T not a multiple of the kernels' block: padded inside
SCALE = D**-0.5


def rows() -> np.ndarray:
    """Segment ids: two packed prompts and padding, one prompt right-padded, one left-padded, one full."""
    segments = np.zeros((B, T), np.int32)
    segments[0, :40], segments[0, 40:83] = 1, 2
    segments[1, :57] = 1
    segments[2, 30:] = 1
    segments[3, :] = 1
    return segments


def qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = ((B, T, N, D), (B, T, K, D), (B, T, K, D))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


@pytest.mark.parametrize(
    "kernel, length, expected",
    [("pallas_gpu", 40, (64, 64)), ("pallas_gpu", 160, (64, 192)), ("pallas_gpu", 896, (128, 896)),
     ("splash", 100, (128, 128)), ("splash", 640, (128, 640)), ("splash", 1536, (512, 1536))],
)  # fmt: skip
def test_each_kernel_tiles_the_padded_sequence_in_blocks_that_divide_it(kernel, length, expected):
    """The kernels refuse a block that does not divide the sequence (Pallas GPU's 128 on a 160-token bucket
    padded to 192, splash's 512 on 640): the block is the largest of the kernel's that divides it."""
    block, padded = flash_attention.block_and_length(kernel, length)
    assert (block, padded) == expected and padded % block == 0 and padded >= length
    q = jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32)
    segments = jax.ShapeDtypeStruct((1, length), jnp.int32)
    traced = jax.eval_shape(  # the kernels check their blocks as they are traced
        lambda q, s: flash_attention.flash_attention(q, q, q, s, scale=0.25, kernel=kernel), q, segments
    )
    assert traced.shape == (1, length, 2, 16)


def loss(fn, q, k, v, segments):
    """A loss reading real tokens only (padding outputs differ by design and are never read)."""
    real = (segments != 0)[:, :, None, None]
    return jnp.sum(jnp.where(real, fn(q, k, v, segments), 0.0) * jnp.cos(jnp.arange(D)))


@pytest.mark.parametrize("kernel", ["pallas_gpu", "splash"])
def test_kernels_match_xla_outputs_and_gradients(kernel):
    q, k, v = qkv()
    segments = jnp.asarray(rows())
    fused = lambda q, k, v, s: flash_attention.flash_attention(q, k, v, s, scale=SCALE, kernel=kernel)  # noqa: E731
    reference = lambda q, k, v, s: attention(q, k, v, s, scale=SCALE)  # noqa: E731
    real = np.asarray(segments != 0)
    np.testing.assert_allclose(
        np.asarray(fused(q, k, v, segments))[real], np.asarray(reference(q, k, v, segments))[real], atol=2e-6
    )
    ours = jax.grad(lambda *x: loss(fused, *x, segments), argnums=(0, 1, 2))(q, k, v)
    theirs = jax.grad(lambda *x: loss(reference, *x, segments), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, err_msg=name)


def test_under_the_mesh_each_device_runs_its_rows():
    mesh = sharding.make_mesh(2, 2, 2)
    q, k, v = qkv()
    segments = jnp.asarray(rows())
    fused = jax.jit(lambda q, k, v, s: flash_attention.flash_attention(q, k, v, s, scale=SCALE, kernel="pallas_gpu"))
    with jax.set_mesh(mesh):
        out = fused(q, k, v, segments)
        text = fused.lower(q, k, v, segments).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text
    real = np.asarray(segments != 0)
    np.testing.assert_allclose(
        np.asarray(out)[real], np.asarray(attention(q, k, v, segments, scale=SCALE))[real], atol=2e-6
    )


def test_auto_is_the_platforms_kernel_and_xla_on_cpu():
    assert flash_attention.resolve("auto", "gpu") == "pallas_gpu"
    assert flash_attention.resolve("auto", "tpu") == "splash"
    assert flash_attention.resolve("auto", "cpu") == "xla"
    assert flash_attention.resolve("splash", "cpu") == "splash"  # named: interpret mode on CPU
    with pytest.raises(ValueError, match="model.attention must be one of"):
        flash_attention.resolve("flash")


MODELS = {
    "opt": dict(model_type="opt", ffn_dim=64, max_position_embeddings=128),
    "olmo2": dict(model_type="olmo2", intermediate_size=48, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", intermediate_size=48, num_key_value_heads=2, head_dim=16),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_models_give_the_same_logits_with_each_kernel(family):
    """Whole models on packed rows (the attention mask's prompt ids become the kernels' segment ids)."""
    config = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=1)
    config.update(MODELS[family])
    segments = jnp.asarray(rows())
    ids = jax.random.randint(jax.random.key(2), segments.shape, 2, 96)
    real = np.asarray(segments != 0)
    logits = {}
    for implementation in ("xla", "pallas_gpu", "splash"):
        model = models.from_config(config, seed=1, attention=implementation)
        graphdef, state = nnx.split(model)
        logits[implementation] = np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(ids, segments))(state))[real]
    for kernel in ("pallas_gpu", "splash"):
        np.testing.assert_allclose(logits[kernel], logits["xla"], atol=1e-5, err_msg=kernel)
