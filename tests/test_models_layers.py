"""The shared blocks against their transformers counterparts, beyond what short parity batches can see."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from oodjax.models import from_config
from oodjax.models.layers import (
    LayerNorm,
    Linear,
    RMSNorm,
    attention,
    run_layers,
    segment_positions,
    stacked_layers,
)
from oodjax.models.lora import AdapterTokens, LoRAConfig, LoRADropout, adapter_tokens, apply_lora
from oodjax.models.rope import RopeConfig, rope_cos_sin, rope_frequencies

# Real-size head dims and contexts, so every band of the scaled RoPE variants is populated.
ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn_untruncated_mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_tables_match_transformers(case):
    hf_config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=32768, rope_parameters=dict(ROPE_CASES[case])
    )
    reference = LlamaRotaryEmbedding(hf_config)
    rope = RopeConfig.from_hf(hf_config.to_dict(), default_theta=10000.0)
    inv_freq, scale = rope_frequencies(rope, head_dim=128)
    np.testing.assert_allclose(inv_freq, reference.inv_freq.numpy(), rtol=1e-6)
    assert scale == pytest.approx(reference.attention_scaling, rel=1e-7)

    positions = np.array([[0, 1, 7, 100, 4095, 20000]])
    cos, sin = rope_cos_sin(jnp.asarray(positions), rope, head_dim=128)
    ref_cos, ref_sin = reference(torch.zeros(1, dtype=torch.float32), torch.tensor(positions))
    # Angles reach 2e4 rad, where one float32 ulp of the angle is ~2e-3; both sides round the same product.
    np.testing.assert_allclose(cos, ref_cos.numpy(), atol=1e-5)
    np.testing.assert_allclose(sin, ref_sin.numpy(), atol=1e-5)


def test_legacy_rope_scaling_keys_read_like_rope_parameters():
    legacy = {
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    current = {"max_position_embeddings": 131072, "rope_parameters": {**ROPE_CASES["llama3"]}}
    assert RopeConfig.from_hf(legacy, default_theta=1.0) == RopeConfig.from_hf(current, default_theta=1.0)


@pytest.mark.parametrize("length", [4096, 4097])
def test_longrope_tables_match_transformers_within_and_beyond_the_original_context(length):
    """Phi-3.5-mini's longrope shape (head_dim 96, original context 4096, 131072 positions): the short
    factors up to 4096 tokens, the long ones (and the same attention factor) beyond, as transformers picks
    them from the row's length."""
    rng = np.random.default_rng(0)
    factors = {name: [float(f) for f in 1 + rng.uniform(0, 40, size=48).cumsum() / 48] for name in ("short", "long")}
    hf_config = transformers.Phi3Config(
        hidden_size=3072,
        num_attention_heads=32,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": factors["short"],
            "long_factor": factors["long"],
        },
    )
    reference = Phi3RotaryEmbedding(hf_config)
    rope = RopeConfig.from_hf(hf_config.to_dict(), default_theta=10000.0)
    positions = np.arange(length)[None]
    ref_cos, ref_sin = reference(torch.zeros(1, dtype=torch.float32), torch.tensor(positions))
    cos, sin = rope_cos_sin(jnp.asarray(positions), rope, head_dim=96)
    np.testing.assert_allclose(cos, ref_cos.numpy(), atol=1e-5)
    np.testing.assert_allclose(sin, ref_sin.numpy(), atol=1e-5)
    assert reference.attention_scaling > 1.1  # sqrt(1 + ln 32 / ln 4096): the factor is applied


def test_longrope_factors_of_another_head_dim_are_refused():
    rope = RopeConfig(
        rope_type="longrope",
        factor=4.0,
        original_max_position_embeddings=8,
        short_factor=(1.0,) * 4,
        long_factor=(2.0,) * 4,
    )
    assert len(rope_frequencies(rope, head_dim=8)[0]) == 4
    with pytest.raises(ValueError, match=r"longrope has 4 factors, not head_dim / 2 = 8"):
        rope_frequencies(rope, head_dim=16)


@pytest.mark.parametrize("ours_in_float32, reference", [(False, LlamaRMSNorm), (True, Olmo2RMSNorm)])
def test_rms_norms_round_like_transformers_in_bf16(ours_in_float32, reference):
    """Llama casts before applying the weight, OLMo2 after: in bf16 the two differ, and each must match."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    weight = (1 + 0.3 * rng.normal(size=64)).astype(np.float32)
    torch_norm = reference(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        torch_norm.weight.copy_(torch.tensor(weight))
        expected = torch_norm(torch.tensor(x).bfloat16()).float().numpy()
    norm = RMSNorm(64, eps=1e-6, dtype=jnp.bfloat16, scale_in_float32=ours_in_float32)
    norm.scale[...] = jnp.asarray(weight, jnp.bfloat16)
    out = norm(jnp.asarray(x, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expected)


def test_gemma_rms_norm_applies_one_plus_weight_in_float32_like_transformers_in_bf16():
    """Gemma stores the weight as an offset from one and multiplies by 1 + weight in float32 before casting."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    weight = (0.3 * rng.normal(size=64)).astype(np.float32)
    torch_norm = Gemma2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        torch_norm.weight.copy_(torch.tensor(weight))
        expected = torch_norm(torch.tensor(x).bfloat16()).float().numpy()
    norm = RMSNorm(64, eps=1e-6, dtype=jnp.bfloat16, unit_offset=True)
    np.testing.assert_array_equal(norm.scale[...], 0)  # transformers' init: zeros, the identity scale
    norm.scale[...] = jnp.asarray(weight, jnp.bfloat16)
    out = norm(jnp.asarray(x, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expected)


def test_soft_capped_attention_is_the_fused_path_when_the_cap_is_out_of_reach():
    """The explicit path Gemma 2's cap needs masks, groups heads and handles padded rows as
    dot_product_attention does: packed prompts, a sliding window and fully padded query rows included."""
    rng = np.random.default_rng(3)
    query, key, value = (jnp.asarray(rng.normal(size=(2, 10, heads, 8)), jnp.float32) for heads in (4, 2, 2))
    segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    common = dict(scale=0.3, window=3, positions=segment_positions(segments))
    fused = attention(query, key, value, segments, **common)
    capped = attention(query, key, value, segments, softcap=1e6, **common)
    np.testing.assert_allclose(capped, fused, rtol=0, atol=1e-6)
    assert np.abs(np.asarray(attention(query, key, value, segments, softcap=0.1, **common)) - fused).max() > 1e-2


def test_layer_norm_matches_torch_in_bf16():
    rng = np.random.default_rng(1)
    x = rng.normal(loc=0.5, size=(4, 64)).astype(np.float32)
    torch_norm = torch.nn.LayerNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        torch_norm.weight.normal_(1.0, 0.3)
        torch_norm.bias.normal_(0.0, 0.3)
        expected = torch_norm(torch.tensor(x).bfloat16()).float().numpy()
    norm = LayerNorm(64, eps=1e-5, elementwise_affine=True, dtype=jnp.bfloat16)
    norm.scale[...] = jnp.asarray(torch_norm.weight.detach().float().numpy(), jnp.bfloat16)
    norm.bias[...] = jnp.asarray(torch_norm.bias.detach().float().numpy(), jnp.bfloat16)
    out = np.asarray(norm(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    # torch's bf16 kernel applies the affine in float32 too; at most one bf16 rounding step apart.
    np.testing.assert_allclose(out, expected, rtol=2**-8, atol=2**-8)


class Delta(nnx.Module):
    """A stand-in adapter: a fixed float32 delta, as an fp32 LoRA on a bf16 base would produce."""

    def __init__(self, delta):
        self.delta = nnx.Param(delta)

    def __call__(self, x):
        return jnp.broadcast_to(self.delta[...], (*x.shape[:-1], self.delta.shape[-1]))


def test_linear_adds_its_adapter_in_the_base_dtype():
    layer = Linear(8, 4, use_bias=True, axes=("embed", "heads"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 8), jnp.bfloat16)
    base = layer(x)
    delta = jnp.asarray([0.5, -1.0, 2.0, 0.25], jnp.float32)
    layer.lora = Delta(delta)
    out = layer(x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, base + delta.astype(jnp.bfloat16))
    assert "lora" in nnx.state(layer, nnx.Param)


class _MaskLayer(nnx.Module):
    """Outputs its dropout mask (scaled), whatever its input: what run_layers feeds each layer's dropout."""

    def __init__(self, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones(()))
        self.dropout = LoRADropout(0.5)
        self.tokens = nnx.data(None)  # shared (not stacked): set after stacking, as apply_lora shares one

    def __call__(self, hidden):
        return self.dropout(jnp.ones_like(hidden), tokens=self.tokens) * self.scale[...]


def _one_run_tokens(num_tokens: int, run_key: tuple[int, int]) -> AdapterTokens:
    """A fresh AdapterTokens: ``num_tokens`` tokens of one run (one example, positions 0, 1, ...) under ``run_key``."""
    tokens = AdapterTokens()
    tokens.set(
        runs=jnp.zeros(num_tokens, jnp.int32),
        examples=jnp.zeros(num_tokens, jnp.int32),
        positions=jnp.arange(num_tokens),
        run_keys=jnp.asarray([run_key], jnp.uint32),
    )
    return tokens


def test_scanned_layers_draw_their_own_dropout_masks_from_one_stream():
    layers = stacked_layers(_MaskLayer, 3, nnx.Rngs(0))
    layers.tokens = _one_run_tokens(4, (7, 0))  # shared, like the LoRA adapters' AdapterTokens
    hidden = jnp.zeros((4, 64))

    def masks(remat):
        out, inputs = run_layers(layers, hidden, remat=remat, all_layers=True)
        return [np.asarray(h) != 0 for h in (*inputs[1:], out)]

    first = masks("none")
    assert len(first) == 3 and all(0.3 < m.mean() < 0.7 for m in first)
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])
    for again, mask in zip(masks("full"), first, strict=True):  # a function of the stream's and run's keys alone
        np.testing.assert_array_equal(again, mask)
    layers.tokens = _one_run_tokens(4, (7, 1))  # another step: another run key, the same stream
    assert not np.array_equal(masks("none")[0], first[0])
    layers.tokens = _one_run_tokens(4, (7, 0))
    nnx.reseed(layers.tokens, dropout=8)  # another stream key, the same run key
    assert not np.array_equal(masks("none")[0], first[0])


def _norm_cases(dtype):
    """Each norm variant with a non-trivial weight (and bias), by name."""
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(2), (64,))
    cases = {}
    for name, kwargs in {"llama": {}, "olmo2": dict(scale_in_float32=True), "gemma": dict(unit_offset=True)}.items():
        norm = RMSNorm(64, eps=1e-6, dtype=dtype, **kwargs)
        norm.scale[...] = scale.astype(dtype)
        cases[f"rms_{name}"] = norm
    layer_norm = LayerNorm(64, eps=1e-5, elementwise_affine=True, dtype=dtype)
    layer_norm.scale[...], layer_norm.bias[...] = scale.astype(dtype), (scale - 1).astype(dtype)
    cases["layer_norm"] = layer_norm
    return cases


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_norms_recomputed_in_backward_give_autodiffs_gradients(dtype):
    """A norm's backward pass recomputes its float32 working from its input (``recomputed_in_backward``); its
    gradients, for the input and the weights, are those of differentiating the same computation directly."""
    x = jax.random.normal(jax.random.key(0), (3, 5, 64)).astype(dtype)
    cotangent = jax.random.normal(jax.random.key(1), (3, 5, 64)).astype(dtype)
    for name, norm in _norm_cases(dtype).items():
        graphdef, params = nnx.split(norm)

        def loss(x, params, through):
            norm = nnx.merge(graphdef, params)
            affine = [v[...] for v in (norm.scale, getattr(norm, "bias", None)) if v is not None]
            out = norm(x) if through == "module" else norm._normalise(x, *affine)
            return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

        ours = jax.grad(loss, argnums=(0, 1))(x, params, "module")
        direct = jax.grad(loss, argnums=(0, 1))(x, params, "direct")
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(direct), strict=True):
            assert a.dtype == b.dtype and np.abs(np.asarray(a, np.float32)).max() > 0, name
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=1)
RESIDUAL_FAMILIES = {
    "opt": dict(model_type="opt", ffn_dim=64, max_position_embeddings=32, **TINY),
    "olmo2": dict(model_type="olmo2", intermediate_size=48, num_key_value_heads=2, **TINY),
    "qwen3": dict(model_type="qwen3", intermediate_size=48, num_key_value_heads=2, head_dim=16, **TINY),
    "gemma2": dict(model_type="gemma2", intermediate_size=48, num_key_value_heads=2, head_dim=16, **TINY),
}


@pytest.mark.parametrize("family", sorted(RESIDUAL_FAMILIES))
def test_bf16_backward_keeps_no_float32_copy_of_a_hidden_wide_activation(family):
    """Norms and LoRA adapters compute in float32 from bf16 activations, as transformers and peft do; the backward
    pass keeps their bf16 inputs and recomputes the float32 working, so with every layer keeping everything
    (remat "none") no residual of the loss's VJP is a float32 activation as wide as the hidden state (the narrow
    float32 ones left: RoPE tables, softmax statistics; the head, applied by the engine at the answer position
    alone, is left out)."""
    batch, seq, hidden = 3, 7, TINY["hidden_size"]
    model = from_config(RESIDUAL_FAMILIES[family], dtype="bfloat16", seed=1)
    apply_lora(model, LoRAConfig(rank=4, dropout=0.1), rngs=nnx.Rngs(0))
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    ids, mask = jnp.ones((batch, seq), jnp.int32), jnp.ones((batch, seq), jnp.int32)

    def loss(lora):
        model = nnx.merge(graphdef, lora, rest, copy=True)
        adapter_tokens(model).set(  # one run's tokens, as the train step sets them: dropout on
            runs=jnp.zeros((batch, seq), jnp.int32),
            examples=jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq)),
            positions=jnp.broadcast_to(jnp.arange(seq), (batch, seq)),
            run_keys=jnp.asarray([[1, 2]], jnp.uint32),
        )
        hidden_states = model.hidden_states(ids, mask)  # the final norm's output
        return hidden_states[:, -1].astype(jnp.float32).sum()

    residuals = jax.eval_shape(lambda lora: jax.tree.leaves(jax.vjp(loss, lora)[1]), lora)

    def per_token_width(shape):
        """Elements per token of an activation ([layers,] batch, seq, ...); None for anything else."""
        for at in range(len(shape) - 1):
            if shape[at : at + 2] == (batch, seq):
                return int(np.prod(shape[at + 2 :]))
        return None

    wide_f32 = [r.shape for r in residuals if r.dtype == jnp.float32 and (per_token_width(r.shape) or 0) >= hidden]
    assert not wide_f32, wide_f32
    kept_bf16 = [r.shape for r in residuals if r.dtype == jnp.bfloat16 and (per_token_width(r.shape) or 0) >= hidden]
    assert len(kept_bf16) >= 4, kept_bf16  # what the backward pass keeps instead (the test sees activations)
