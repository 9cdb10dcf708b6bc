"""Model FLOPs: the arithmetic a case needs, counted on real tokens only.

Padding, full-vocabulary logits nobody reads and other overheads are work a
contender chooses to do, not work the task needs; so every contender of a
case is credited with the same model FLOPs, and model FLOP/s divided by the
machine's measured matmul peak says how close each gets to the hardware.
Multiply-adds count 2; norms, activations and softmax are left out (well
under 1% here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def _layer_linear_weights(config: Mapping[str, Any]) -> int:
    """Weights one Llama decoder layer multiplies every token by (attention projections and MLP)."""
    hidden = config["hidden_size"]
    q_width = config["num_attention_heads"] * config["head_dim"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    return hidden * q_width * 2 + hidden * kv_width * 2 + 3 * hidden * config["intermediate_size"]


def _layer_lora_weights(config: Mapping[str, Any], rank: int) -> int:
    """Adapter weights on q, k, v and o of one layer: rank * (in + out) each."""
    hidden = config["hidden_size"]
    q_width = config["num_attention_heads"] * config["head_dim"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    return rank * ((hidden + q_width) * 2 + (hidden + kv_width) * 2)


def _attention_pairs(length: int) -> int:
    """Causal (query, key) pairs of a prompt: position t sees t + 1 keys."""
    return length * (length + 1) // 2


def forward_parts(config: Mapping[str, Any], length: int, *, lora_rank: int) -> dict[str, float]:
    """One prompt's forward FLOPs by kind: frozen linear layers, adapters, attention."""
    layers = config["num_hidden_layers"]
    attention_width = config["num_attention_heads"] * config["head_dim"]
    return {
        "linear": 2.0 * _layer_linear_weights(config) * length * layers,
        "lora": 2.0 * _layer_lora_weights(config, lora_rank) * length * layers,
        # scores (q.k) and the weighted sum of values, each a multiply-add per pair and head dim
        "attention": 4.0 * attention_width * _attention_pairs(length) * layers,
    }


def eval_flops(config: Mapping[str, Any], lengths: Iterable[int], *, lora_rank: int) -> float:
    """Scoring prompts: the forward pass, then the two answer columns of the head at one position."""
    head = 2.0 * config["hidden_size"] * 2
    return sum(sum(forward_parts(config, n, lora_rank=lora_rank).values()) + head for n in lengths)


def train_flops(config: Mapping[str, Any], lengths: Iterable[int], *, lora_rank: int) -> float:
    """One LoRA training pass: forward, then backward to the activations and to the adapters only.

    The frozen weights get no gradient, so their backward is one product (to
    the input), the same as their forward; adapters need two (input and
    weight); attention's backward is twice its forward. The loss needs the
    full-vocabulary head at the answer position, forward and backward.
    """
    head = 2.0 * config["hidden_size"] * config["vocab_size"]
    total = 0.0
    for n in lengths:
        parts = forward_parts(config, n, lora_rank=lora_rank)
        total += 2 * parts["linear"] + 3 * parts["lora"] + 3 * parts["attention"] + 2 * head
    return total
