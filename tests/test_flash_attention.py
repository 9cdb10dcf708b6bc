"""The fused attention kernels (Pallas GPU flash, TPU splash), run here in Pallas' interpret mode, give the XLA
path's outputs and gradients on packed, left- and right-padded rows with grouped-query heads, also per device
under the engine's mesh; and ``auto`` means XLA on CPU, cuDNN on GPU.

cuDNN cannot run here: its path runs with JAX's XLA implementation standing in for the kernel (the same
call, mask and padding), and is lowered for CUDA with an H100's cuDNN version and compute capability
standing in for the ones JAX reads as it traces. Under ``save_dots`` the backward pass keeps the fused
kernel's output and statistics, so the lowered backward pass holds one fused forward, not two."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oodjax import models
from oodjax.engine import sharding
from oodjax.models import flash_attention, layers
from oodjax.models.flash_attention import attention
from tests.test_lowering_accelerators import on_h100  # noqa: F401  (a fixture)

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
    [
        ("pallas_gpu", 40, (64, 64)),
        ("pallas_gpu", 160, (64, 192)),
        ("pallas_gpu", 896, (128, 896)),
        ("splash", 100, (128, 128)),
        ("splash", 640, (128, 640)),
        ("splash", 1536, (512, 1536)),
    ],
)
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


def assert_matches_xla(kernel, q, k, v, segments):
    """``kernel``'s outputs at real tokens and its gradients equal XLA's attention's."""
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


@pytest.mark.parametrize("kernel", ["pallas_gpu", "splash"])
def test_kernels_match_xla_outputs_and_gradients(kernel):
    q, k, v = qkv()
    segments = jnp.asarray(rows())
    assert_matches_xla(kernel, q, k, v, segments)


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
    assert flash_attention.resolve("auto", "gpu") == "cudnn"
    assert flash_attention.resolve("auto", "cuda") == "cudnn"
    assert flash_attention.resolve("pallas_gpu", "gpu") == "pallas_gpu"  # by name only (logged as a warning)
    with flash_attention.target_platform("tpu"):
        assert flash_attention.resolve("auto") == "splash"
    assert flash_attention.resolve("auto", "tpu") == "splash"
    assert flash_attention.resolve("auto", "cpu") == "xla"
    assert flash_attention.resolve("splash", "cpu") == "splash"  # named: interpret mode on CPU


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


def test_cudnn_path_with_xla_standing_in_for_the_kernel_matches(monkeypatch):
    """The cuDNN path's call (grouped K/V as they are, the segments as a bias, padding, its residuals kept)
    with JAX's XLA implementation in the kernel's place gives the XLA path's outputs and gradients."""
    dot_product_attention = jax.nn.dot_product_attention

    def standing_in(*args, implementation=None, **kwargs):
        if implementation == "cudnn":
            assert args[1].shape[2] == K  # K/V heads not repeated
        return dot_product_attention(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", standing_in)
    q, k, v = qkv()
    segments = jnp.asarray(rows()[:, :95])  # an odd length: padded to cuDNN's even one
    q, k, v = q[:, :95], k[:, :95], v[:, :95]
    assert_matches_xla("cudnn", q, k, v, segments)


FMHA_FORWARD = re.compile(r"custom_call @__cudnn\$fmhaScaleBiasSoftmax\(")
FMHA_BACKWARD = re.compile(r"custom_call @__cudnn\$fmhaScaleBiasSoftmaxBackward\(")


@pytest.mark.parametrize("head_dim, kv_heads", [(80, 4), (128, 2)])  # OPT's head size; SmolLM3's, GQA
def test_cudnn_lowers_for_cuda_with_grouped_heads_differentiated(on_h100, head_dim, kv_heads):  # noqa: F811
    """cuDNN's forward and backward custom calls take the K/V heads as they are."""
    q = jax.ShapeDtypeStruct((6, 96, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((6, 96, kv_heads, head_dim), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((6, 96), jnp.int32)

    def fused(q, k, v, s):
        return attention(q, k, v, s, scale=SCALE, implementation="auto")

    def grads(q, k, v, s):
        return jax.grad(lambda *x: fused(*x, s).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    with flash_attention.target_platform("cuda"):
        text = jax.jit(grads).trace(q, kv, kv, segments).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if FMHA_FORWARD.search(line) or FMHA_BACKWARD.search(line)]
    assert len(calls) == 2, calls
    # K/V with their own heads: [6, 96, kv_heads, head_dim].
    assert all(f"tensor<6x96x{kv_heads}x{head_dim}xbf16>" in line for line in calls), calls


def test_cudnn_where_it_does_not_apply(on_h100):  # noqa: F811
    """``auto`` takes XLA's path for float32 or a head size cuDNN refuses; ``cudnn`` by name refuses them."""
    segments = jnp.ones((1, 32), jnp.int32)
    for dtype, head_dim in ((jnp.float32, 16), (jnp.bfloat16, 12), (jnp.bfloat16, 512)):
        x = jnp.ones((1, 32, 2, head_dim), dtype)
        assert flash_attention.cudnn_unsupported(x, x)
        with flash_attention.target_platform("cuda"):
            text = jax.jit(lambda x: attention(x, x, x, segments, scale=0.1, implementation="auto")).lower(x).as_text()
            assert "__cudnn" not in text
            with pytest.raises(ValueError, match="model.attention=cudnn"):
                attention(x, x, x, segments, scale=0.1, implementation="cudnn")
    assert flash_attention.cudnn_unsupported(*[jnp.ones((1, 32, 2, 128), jnp.bfloat16)] * 2) is None


def test_cudnn_bias_is_what_jax_makes_of_a_mask():
    """The segments' bias holds the large negative number JAX's cuDNN path puts where a boolean mask is False."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    for dtype in (jnp.bfloat16, jnp.float16):
        bias = flash_attention._mask_input("cudnn", jnp.asarray([[1, 2]]), dtype)
        assert bias.dtype == dtype and bias[0, 0, 0, 0] == 0, dtype
        assert bias[0, 0, 0, 1] == cudnn_attention.get_large_negative_number(dtype), dtype


def remat_model(remat: str, attention: str):
    config = dict(
        model_type="olmo2",
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        pad_token_id=1,
    )
    dtype = "bfloat16" if attention == "cudnn" else "float32"
    return nnx.split(models.from_config(config, seed=1, dtype=dtype, remat=remat, attention=attention))


def remat_loss(graphdef):
    segments = jnp.asarray(rows())
    ids = (jnp.arange(B * T).reshape(B, T) % 90 + 2).astype(jnp.int32)
    return lambda state: nnx.merge(graphdef, state)(ids, segments).sum()


@pytest.mark.parametrize("remat, forwards", [("save_dots", 1), ("save_dots_except_mlp", 1), ("full", 2)])
def test_save_dots_keeps_cudnns_output_and_runs_its_forward_once(on_h100, remat, forwards):  # noqa: F811
    """The lowered gradient of a model under the policy: one cuDNN forward in the layers' scan (the
    backward scan reads the kept output and statistics), two when the policy keeps nothing."""
    graphdef, state = remat_model(remat, "cudnn")
    with flash_attention.target_platform("cuda"):
        lowered = jax.jit(jax.grad(remat_loss(graphdef))).trace(state).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert len(FMHA_FORWARD.findall(text)) == forwards
    assert len(FMHA_BACKWARD.findall(text)) == 1


@pytest.mark.parametrize("kernel", ["xla", "splash"])
def test_save_dots_keeps_the_attention_output(kernel, monkeypatch):
    """Under ``save_dots`` the backward pass keeps, per layer, the attention's output (splash's, padded to its
    block and heads first, with its softmax statistics; nothing else of the kernel, not its transposed
    inputs): what it keeps beyond the same policy without the name ``attention_output``."""
    from jax._src.ad_checkpoint import saved_residuals

    def kept():
        graphdef, state = remat_model("save_dots", kernel)
        return [tuple(aval.shape) for aval, _ in saved_residuals(remat_loss(graphdef), state)]

    with_name = kept()
    without = jax.checkpoint_policies.save_only_these_names(layers.ATTENTION_PROJECTION, layers.MLP_PROJECTION)
    monkeypatch.setitem(layers.REMAT_POLICIES, "save_dots", without)
    extra = list(with_name)
    for shape in kept():
        extra.remove(shape)
    padded = flash_attention.block_and_length("splash", T)[1]
    expected = [(2, B, T, N, 16)] if kernel == "xla" else [(2, B, N, padded, 16), (2, B, N, padded)]
    assert sorted(extra) == sorted(expected)
