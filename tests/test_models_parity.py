"""Logits and per-layer hidden states of the NNX ports against transformers' PyTorch models.

Each layout is a tiny random transformers model (every parameter perturbed, so
biases and norm weights are not their trivial init), saved as safetensors and
loaded with ``load_pretrained``; both see the same right- and left-padded batches.
"""

import copy
import json

import jax
import numpy as np
import pytest
import scipy.special
import torch
import transformers
from flax import nnx

from oodjax.engine import steps
from oodjax.models import load_pretrained

LOGITS_TOL = 1e-4
HIDDEN_TOL = 1e-5
LENGTHS = (9, 6, 3)  # unequal lengths, so both batches hold padding
PAD_ID = 1

LAYOUTS = {
    "opt_pre_ln": lambda: transformers.OPTConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=32,
        pad_token_id=PAD_ID,
    ),
    "opt_350m_layout": lambda: transformers.OPTConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=32,
        pad_token_id=PAD_ID,
        do_layer_norm_before=False,
        word_embed_proj_dim=16,
    ),
    "olmo2_gqa": lambda: transformers.Olmo2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=PAD_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "smollm2_tied_gqa": lambda: transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "smollm3_nope": lambda: transformers.SmolLM3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        no_rope_layers=[1, 0, 1],
        pad_token_id=PAD_ID,
    ),
    # head_dim 16: the eight frequencies fall in all three llama3 bands (kept, smoothed, divided).
    "llama_llama3_rope": lambda: transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=PAD_ID,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_yarn_rope": lambda: transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        pad_token_id=PAD_ID,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Qwen2: q/k/v biases without an o bias, tied like Qwen2.5-0.5B.
    "qwen2_bias_tied": lambda **extra: transformers.Qwen2Config(
        **extra,
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # Qwen3: per-head q/k RMSNorms; head_dim 16 is not hidden / heads (8).
    "qwen3_qk_norm": lambda: transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=PAD_ID,
    ),
    # Sliding windows of 3 tokens, shorter than the 9- and 6-token prompts: every layer (Mistral), the
    # layers from max_window_layers on (Qwen2), the NoPE layers (SmolLM3).
    "mistral_sliding": lambda: transformers.MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=3,
        pad_token_id=PAD_ID,
    ),
    "qwen2_sliding": lambda: transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,
        pad_token_id=PAD_ID,
    ),
    "smollm3_sliding": lambda: transformers.SmolLM3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        no_rope_layers=[1, 0, 1],
        use_sliding_window=True,
        sliding_window=3,
        pad_token_id=PAD_ID,
    ),
    # Gemma 2: layer 0 slides (3 tokens), layer 1 is full; caps small enough to bite on these weights
    # (transformers' defaults, 50 and 30, would leave the random scores and logits almost as they are);
    # query_pre_attn_scalar 24, neither head_dim (16) nor hidden / heads (8).
    "gemma2_softcap_sliding": lambda: transformers.Gemma2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=3,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=2.0,
        pad_token_id=PAD_ID,
    ),
    # Gemma 3: per-head q/k norms; the sliding layer 0 rotates with a local base of 100, the full layer 1
    # with the global RoPE, linearly scaled.
    "gemma3_local_rope": lambda: transformers.Gemma3TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=3,
        sliding_window_pattern=2,
        pad_token_id=PAD_ID,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    ),
    # Phi-3: fused qkv_proj (GQA: q, k, v of different widths) and gate_up_proj; a window on every layer.
    "phi3_fused_sliding": lambda: transformers.Phi3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=3,
        pad_token_id=PAD_ID,
    ),
    # Longrope with an original context of 8: the 9-token rows take the long factors (and the attention factor).
    "phi3_longrope": lambda: transformers.Phi3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=PAD_ID,
        max_position_embeddings=32,
        original_max_position_embeddings=8,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 4.0, 8.0, 16.0],
        },
    ),
}

# Saved sharded, so the index file path is exercised.
SHARDED = {"opt_350m_layout", "olmo2_gqa"}


def tiny_hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """A seeded fp32 model whose every parameter (norm weights and biases too) is random."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def save(model: transformers.PreTrainedModel, directory, *, sharded: bool = False):
    model.save_pretrained(directory, max_shard_size="20KB" if sharded else "50GB")
    assert (directory / "model.safetensors.index.json").exists() == sharded
    return directory


def padded_batches(vocab_size: int, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The same sequences right- and left-padded: name -> (input_ids, attention_mask)."""
    rng = np.random.default_rng(seed)
    width = max(LENGTHS)
    sequences = [rng.integers(2, vocab_size, size=n) for n in LENGTHS]
    batches = {}
    for side in ("right", "left"):
        ids = np.full((len(LENGTHS), width), PAD_ID, np.int64)
        mask = np.zeros((len(LENGTHS), width), np.int64)
        for row, seq in enumerate(sequences):
            span = slice(0, len(seq)) if side == "right" else slice(width - len(seq), width)
            ids[row, span], mask[row, span] = seq, 1
        batches[side] = (ids, mask)
    return batches


def jitted(model):
    """The forward pass as the engine runs it, jax.jit over the split state: (ids, mask) -> (logits, hidden).

    One compiled function returns both, since compiling dominates these tests' time.
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask):
        model = nnx.merge(graphdef, state)
        return model(ids, mask), model.hidden_states(ids, mask, all_layers=True)

    return lambda ids, mask: forward(state, ids, mask)


def max_diff_at_tokens(ours, theirs: torch.Tensor, mask: np.ndarray) -> float:
    return float(np.abs(np.asarray(ours) - theirs.numpy())[mask.astype(bool)].max())


def assert_matches_hf(model, hf_model, vocab_size: int) -> dict[str, float]:
    forward = jitted(model)
    diffs = {}
    for side, (ids, mask) in padded_batches(vocab_size).items():
        with torch.no_grad():
            out = hf_model(torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
        logits, hidden = forward(ids, mask)
        assert logits.dtype == np.float32 and logits.shape == (*ids.shape, vocab_size)
        diffs[f"{side}/logits"] = max_diff_at_tokens(logits, out.logits, mask)
        assert len(hidden) == len(out.hidden_states) == hf_model.config.num_hidden_layers + 1
        for layer, (ours, theirs) in enumerate(zip(hidden, out.hidden_states, strict=True)):
            diffs[f"{side}/hidden{layer}"] = max_diff_at_tokens(ours, theirs, mask)
    bad = {k: v for k, v in diffs.items() if v > (LOGITS_TOL if k.endswith("logits") else HIDDEN_TOL)}
    assert not bad, bad
    return diffs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_and_hidden_states_match_transformers(layout, tmp_path):
    hf_model = tiny_hf_model(LAYOUTS[layout]())
    model = load_pretrained(save(hf_model, tmp_path, sharded=layout in SHARDED))
    diffs = assert_matches_hf(model, hf_model, hf_model.config.vocab_size)
    logits = max(v for k, v in diffs.items() if k.endswith("logits"))
    hidden = max(v for k, v in diffs.items() if not k.endswith("logits"))
    print(f"{layout}: max |diff| logits {logits:.2e}, hidden states {hidden:.2e}")


@pytest.mark.parametrize(
    "layout",
    [
        "opt_350m_layout",
        "olmo2_gqa",
        "smollm3_nope",
        "llama_yarn_rope",
        "qwen3_qk_norm",
        "mistral_sliding",
        "gemma2_softcap_sliding",
        "gemma3_local_rope",
        "phi3_fused_sliding",
    ],
)
def test_packed_prompts_match_each_prompt_alone(layout, tmp_path):
    """Prompts packed into one row (attention mask = prompt ids) give, at every layer, what each gives alone.

    The reference is transformers run on each prompt by itself, so a prompt
    attending across its neighbour or a position counted from the row's
    start (OPT's learned positions) fails at once.
    """
    hf_model = tiny_hf_model(LAYOUTS[layout]())
    model = load_pretrained(save(hf_model, tmp_path))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 96, size=n) for n in (9, 3, 6, 2)]
    rows = [[0, 1], [2, 3]]  # prompt indices packed into each row, in order
    width = 16
    ids = np.full((len(rows), width), PAD_ID, np.int64)
    segments = np.zeros((len(rows), width), np.int64)
    spans = {}
    for row, members in enumerate(rows):
        start = 0
        for segment, prompt in enumerate(members, start=1):
            stop = start + len(prompts[prompt])
            ids[row, start:stop], segments[row, start:stop] = prompts[prompt], segment
            spans[prompt] = (row, slice(start, stop))
            start = stop
    logits, hidden = jitted(model)(ids, segments)
    worst = {"logits": 0.0, "hidden": 0.0}
    for prompt, (row, span) in spans.items():
        with torch.no_grad():
            alone = hf_model(torch.tensor(prompts[prompt][None]), output_hidden_states=True)
        worst["logits"] = max(
            worst["logits"], float(np.abs(np.asarray(logits[row, span]) - alone.logits[0].numpy()).max())
        )
        for ours, theirs in zip(hidden, alone.hidden_states, strict=True):
            worst["hidden"] = max(worst["hidden"], float(np.abs(np.asarray(ours[row, span]) - theirs[0].numpy()).max()))
    print(f"{layout} packed: max |diff| logits {worst['logits']:.2e}, hidden states {worst['hidden']:.2e}")
    assert worst["logits"] <= LOGITS_TOL and worst["hidden"] <= HIDDEN_TOL, worst


def test_head_kernel_is_the_final_projection(tmp_path):
    """hidden_states @ head_kernel() is the logits (what the engine computes at the answer position)."""
    hf_model = tiny_hf_model(LAYOUTS["opt_350m_layout"]())
    model = load_pretrained(save(hf_model, tmp_path))
    ids, mask = padded_batches(96)["left"]
    logits, hidden = jitted(model)(ids, mask)
    head = np.asarray(model.head_kernel())
    assert head.shape == (16, 96)
    np.testing.assert_allclose(np.asarray(hidden[-1]) @ head, logits, atol=1e-5)


def test_engine_answer_logits_are_the_soft_capped_logits_of_the_full_model(tmp_path):
    """The engine applies the head at the answer positions only: answer_losses over the whole vocabulary,
    eval_margins from the two answer columns. Gemma 2 caps every logit, and both must give what
    transformers' capped logits give there (the uncapped ones are checked to differ, so the cap bites)."""
    hf_model = tiny_hf_model(LAYOUTS["gemma2_softcap_sliding"]())
    model = load_pretrained(save(hf_model, tmp_path))
    yes, no = 5, 6
    graphdef, state = nnx.split(model)

    @jax.jit
    def engine(state, batch):
        model = nnx.merge(graphdef, state)
        uncapped = steps.answer_hidden(model, batch) @ model.head_kernel()
        return steps.answer_losses(model, batch, yes, no), steps.eval_margins(model, batch, yes, no), uncapped

    for side, (ids, mask) in padded_batches(96).items():
        answer_pos = mask.sum(1) - 1 if side == "right" else np.full(len(ids), ids.shape[1] - 1)
        label = np.array([0, 1, 0])
        batch = dict(input_ids=ids, segment_ids=mask, answer_pos=answer_pos.astype(np.int32), label=label)
        losses, margins, uncapped = engine(state, batch)
        with torch.no_grad():
            logits = hf_model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        at_answer = logits[np.arange(len(ids)), answer_pos]
        targets = np.where(label == 0, yes, no)
        expected_losses = -scipy.special.log_softmax(at_answer, axis=-1)[np.arange(len(ids)), targets]
        np.testing.assert_allclose(losses, expected_losses, rtol=0, atol=1e-5)
        np.testing.assert_allclose(margins, at_answer[:, yes] - at_answer[:, no], rtol=0, atol=1e-5)
        assert np.abs(np.asarray(uncapped) - at_answer).max() > 0.1


def test_legacy_rope_keys_mean_what_transformers_reads(tmp_path):
    """Older config.json files spell RoPE as rope_theta + rope_scaling {"type": ...}."""
    hf_model = tiny_hf_model(
        transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            pad_token_id=PAD_ID,
            rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 3.0},
        )
    )
    save(hf_model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 3.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reloaded.config.rope_parameters["rope_type"] == "linear"
    assert_matches_hf(load_pretrained(tmp_path), reloaded, 96)


def test_bfloat16_checkpoint_loads_exactly_into_float32(tmp_path):
    """bf16 tensors (which safetensors' numpy reader needs ml_dtypes for) upcast exactly."""
    hf_model = tiny_hf_model(LAYOUTS["smollm3_nope"]())
    with torch.no_grad():
        for param in hf_model.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    # A bf16 copy to save: converting the reference itself would also round its RoPE buffers.
    save(copy.deepcopy(hf_model).to(torch.bfloat16), tmp_path)
    model = load_pretrained(tmp_path, dtype="float32")
    assert_matches_hf(model, hf_model, 96)


def test_gemma_embeddings_scale_by_sqrt_hidden_rounded_to_bf16_as_transformers_does(tmp_path):
    """sqrt(32) = 5.657 is 5.656 in bf16; transformers rounds the multiplier to the weights' dtype first, so
    in bf16 the scaled embeddings (the first hidden states) must equal its own bit for bit."""
    hf_model = tiny_hf_model(LAYOUTS["gemma2_softcap_sliding"]()).to(torch.bfloat16)
    model = load_pretrained(save(hf_model, tmp_path), dtype="bfloat16")
    ids, mask = padded_batches(96)["right"]
    with torch.no_grad():
        out = hf_model(torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
    embedded = jitted(model)(ids, mask)[1][0]
    assert embedded.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(embedded.astype(np.float32)), out.hidden_states[0].float().numpy())


def test_bfloat16_load_keeps_bf16_params_and_stays_close(tmp_path):
    """Parameters are bf16, logits float32 and about as close to the fp32 logits as transformers' own bf16 run.

    bf16 keeps 8 significant bits, so no fixed tolerance is meaningful across
    models; the yardstick is the error of the same checkpoint run in bf16 by
    transformers, with 50% slack for a different order of roundings.
    """
    hf_model = tiny_hf_model(LAYOUTS["olmo2_gqa"]())
    save(hf_model, tmp_path)
    half = load_pretrained(tmp_path, dtype="bfloat16")
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(half, nnx.Param))}
    assert dtypes == {np.dtype(jax.numpy.bfloat16)}
    forward_half = jitted(half)
    hf_half = copy.deepcopy(hf_model).to(torch.bfloat16)
    for ids, mask in padded_batches(96).values():
        keep = mask.astype(bool)
        with torch.no_grad():
            reference = hf_model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
            hf_bf16 = hf_half(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()
        logits = forward_half(ids, mask)[0]
        assert logits.dtype == np.float32
        error = np.abs(np.asarray(logits) - reference)[keep].max()
        hf_error = np.abs(hf_bf16 - reference)[keep].max()
        print(f"bf16 max abs error {error:.4f} (transformers' bf16: {hf_error:.4f})")
        assert 0 < error <= 1.5 * hf_error
