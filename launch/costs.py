"""Parameter counts, memory and FLOPs of a decoder LM from its config.json numbers, without building it.

Parameter counts are exact: they follow, tensor by tensor, what transformers
builds for the family (OPT, OLMo2, Llama/SmolLM3), with missing fields taken
from transformers' own config defaults. Memory and FLOPs are estimates; the
assumptions are stated where they are made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import transformers

BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAPTER_BYTES = 4  # LoRA adapters, their gradients and AdamW moments are float32
# Decoder families whose layers are attention + gated MLP with RMSNorms.
LLAMA_LIKE = ("llama", "smollm3", "olmo2")


@dataclasses.dataclass(frozen=True)
class Dimensions:
    """The sizes that decide cost, normalised across families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_dim: int  # num_heads * head_dim
    kv_dim: int  # num_key_value_heads * head_dim
    ffn_dim: int
    mlp_matrices: int  # 2 for OPT's fc1/fc2, 3 for a gated MLP
    embed_dim: int  # OPT's word_embed_proj_dim; hidden_size elsewhere
    tied_head: bool

    @property
    def layer_matmul_parameters(self) -> int:
        """Weights of one decoder layer's matrix multiplies (what costs FLOPs per token)."""
        attention = 2 * self.hidden_size * self.q_dim + 2 * self.hidden_size * self.kv_dim
        return attention + self.mlp_matrices * self.hidden_size * self.ffn_dim


def full_config(architecture: Mapping[str, Any]) -> transformers.PretrainedConfig:
    """The transformers config for these numbers, every unspecified field at its family default."""
    fields = dict(architecture)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"architecture needs a model_type; got fields {sorted(architecture)}")
    return transformers.AutoConfig.for_model(model_type, **fields)


def dimensions(architecture: Mapping[str, Any]) -> Dimensions:
    config = full_config(architecture)
    hidden, heads = config.hidden_size, config.num_attention_heads
    if config.model_type == "opt":
        return Dimensions(
            "opt", config.vocab_size, hidden, config.num_hidden_layers, heads, hidden, hidden,
            config.ffn_dim, 2, config.word_embed_proj_dim, bool(config.tie_word_embeddings),
        )
    if config.model_type in LLAMA_LIKE:
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = config.num_key_value_heads or heads
        return Dimensions(
            config.model_type, config.vocab_size, hidden, config.num_hidden_layers, heads, heads * head_dim,
            kv_heads * head_dim, config.intermediate_size, 3, hidden, bool(config.tie_word_embeddings),
        )
    raise ValueError(f"no cost model for model_type {config.model_type!r}; known: opt, {', '.join(LLAMA_LIKE)}")


def parameter_count(architecture: Mapping[str, Any]) -> int:
    """Exact number of parameters transformers' CausalLM of these numbers holds (tied weights once)."""
    config = full_config(architecture)
    d = dimensions(architecture)
    h, layers = d.hidden_size, d.num_layers
    head = 0 if d.tied_head else d.vocab_size * d.embed_dim
    if d.model_type == "opt":
        bias = bool(config.enable_bias)
        embeddings = d.vocab_size * d.embed_dim + (config.max_position_embeddings + 2) * h
        projections = 2 * d.embed_dim * h if d.embed_dim != h else 0
        norm_size = 2 * h if config.layer_norm_elementwise_affine else 0
        final_norm = norm_size if config.do_layer_norm_before and not config._remove_final_layer_norm else 0
        per_layer = d.layer_matmul_parameters + bias * (4 * h + d.ffn_dim + h) + 2 * norm_size
        return embeddings + projections + layers * per_layer + final_norm + head
    attention_bias = d.q_dim + 2 * d.kv_dim + h if config.attention_bias else 0
    mlp_bias = 2 * d.ffn_dim + h if getattr(config, "mlp_bias", False) else 0
    if d.model_type == "olmo2":
        norms = d.q_dim + d.kv_dim + 2 * h  # q_norm, k_norm, post-attention and post-feedforward norms
    else:
        norms = 2 * h  # input and post-attention norms
    per_layer = d.layer_matmul_parameters + attention_bias + mlp_bias + norms
    return d.vocab_size * h + layers * per_layer + h + head


def lora_parameter_count(d: Dimensions, rank: int, targets: Sequence[str] = ()) -> int:
    """Adapter parameters of one run: A [in, r] and B [r, out] on each targeted linear layer of every layer.

    `targets` are layer names as in config.lora.targets; empty means the
    attention projections q, k, v and the output projection.
    """
    h, f = d.hidden_size, d.ffn_dim
    shapes = {
        "q_proj": (h, d.q_dim), "k_proj": (h, d.kv_dim), "v_proj": (h, d.kv_dim),
        "o_proj": (d.q_dim, h), "out_proj": (d.q_dim, h),
        "fc1": (h, f), "fc2": (f, h), "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h),
    }
    output_projection = "out_proj" if d.model_type == "opt" else "o_proj"
    names = tuple(targets) or ("q_proj", "k_proj", "v_proj", output_projection)
    unknown = sorted(set(names) - set(shapes))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; known: {sorted(shapes)}")
    return d.num_layers * sum(rank * (shapes[name][0] + shapes[name][1]) for name in names)


def forward_flops_per_token(d: Dimensions, seq_len: int, lora_parameters: int = 0) -> float:
    """Forward FLOPs of the decoder layers per token of a sequence padded to `seq_len`.

    2 per weight of every layer matmul and adapter, plus QK^T and AV over the
    full padded length (4 * seq_len * q_dim per layer: the masked half of a
    causal score matrix is computed too). Embedding lookups cost nothing; the
    head is counted separately because it runs at one position per example.
    """
    return 2.0 * (d.num_layers * d.layer_matmul_parameters + lora_parameters) + 4.0 * d.num_layers * seq_len * d.q_dim


def train_step_flops(
    d: Dimensions, *, runs: int, batch_size: int, seq_len: int, lora_parameters: int, remat: bool
) -> float:
    """FLOPs of one optimizer step of all runs trained together.

    Forward F; backward takes gradients only with respect to activations
    through the frozen weights (one more F for the matmuls, twice the
    attention cost) and with respect to the adapters (twice their forward);
    remat recomputes the forward once more. The head (full vocabulary, one
    position per example) is a forward and an input-gradient matmul.
    """
    tokens = runs * batch_size * seq_len
    matmuls = 2.0 * d.num_layers * d.layer_matmul_parameters
    attention = 4.0 * d.num_layers * seq_len * d.q_dim
    adapters = 2.0 * lora_parameters
    forward = matmuls + attention + adapters
    backward = matmuls + 2 * attention + 2 * adapters
    per_token = forward + backward + (forward if remat else 0.0)
    head = 2 * (2.0 * d.hidden_size * d.vocab_size) * runs * batch_size
    return tokens * per_token + head


def eval_flops(d: Dimensions, *, runs: int, examples: int, seq_len: int, lora_parameters: int) -> float:
    """FLOPs of evaluating every run on `examples` examples (the head reads two columns: negligible)."""
    return runs * examples * seq_len * forward_flops_per_token(d, seq_len, lora_parameters)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device during training."""

    frozen_weights: float
    adapters: float
    gradients: float
    optimizer_state: float
    activations: float

    @property
    def total(self) -> float:
        return self.frozen_weights + self.adapters + self.gradients + self.optimizer_state + self.activations


def train_memory_per_device(
    d: Dimensions,
    *,
    parameters: int,
    dtype: str,
    mesh: Mapping[str, int],
    runs: int,
    micro_batch: int,
    seq_len: int,
    lora_parameters: int,
    remat: bool,
) -> Memory:
    """Training memory of one device for a mesh {"data", "fsdp", "tensor"} (sizes already resolved).

    Frozen weights are split over fsdp x tensor and replicated over data.
    Adapters, their gradients and AdamW's two moments are float32 and, being
    small, assumed replicated. Activations are those kept for the backward
    pass of one micro-batch (runs x micro_batch examples split over data x
    fsdp) in the base dtype, with float32 attention probabilities:
    without remat every layer keeps its inputs, q/k/v, attention output, MLP
    intermediates and probabilities; with remat every layer keeps only its
    input and one layer's set is live at a time. XLA's fusion and buffer
    reuse make the real figure lower; treat this one as a planning bound.
    """
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(BYTES_PER_ELEMENT)}")
    width = BYTES_PER_ELEMENT[dtype]
    weight_shards = mesh["fsdp"] * mesh["tensor"]
    examples = runs * micro_batch / (mesh["data"] * mesh["fsdp"])
    tokens = examples * seq_len
    per_token_layer = width * (
        4 * d.hidden_size + 2 * d.q_dim + 2 * d.kv_dim + d.mlp_matrices * d.ffn_dim
    ) / mesh["tensor"] + 4 * d.num_heads * seq_len / mesh["tensor"]
    if remat:
        activations = tokens * (d.num_layers * width * d.hidden_size + per_token_layer)
    else:
        activations = tokens * d.num_layers * per_token_layer
    activations += examples * d.vocab_size * 4  # float32 logits of the head at the answer position
    adapters = runs * lora_parameters * ADAPTER_BYTES
    return Memory(parameters * width / weight_shards, adapters, adapters, 2 * adapters, activations)
