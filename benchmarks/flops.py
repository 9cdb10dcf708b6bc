"""Model FLOPs: the arithmetic a case needs, counted on real tokens only.

Padding, full-vocabulary logits nobody reads and other overheads are work a
contender chooses to do, not work the task needs; so every contender of a
case is credited with the same model FLOPs, and model FLOP/s divided by the
machine's measured matmul peak says how close each gets to the hardware.
The FLOP model is the estimator's (``launch.costs``), applied to each
prompt's own tokens and causal (query, key) pairs, through one run's
adapters, with nothing recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from launch import costs


def _forward(dims: costs.Dimensions, length: int, adapter_parameters: int) -> costs.ForwardFlops:
    """One prompt's forward FLOPs through the decoder layers: position t sees t + 1 keys."""
    pairs = length * (length + 1) // 2
    return costs.forward_flops(dims, tokens=length, attention_pairs=pairs, adapter_parameters=adapter_parameters)


def eval_flops(config: Mapping[str, Any], lengths: Iterable[int], *, lora_rank: int) -> float:
    """Scoring prompts: the forward pass, then the two answer columns of the head at one position."""
    dims, adapters = costs.dimensions(config), costs.lora_parameter_count(config, lora_rank)
    head = costs.head_flops(dims, 2)
    return sum(_forward(dims, n, adapters).total + head for n in lengths)


def train_flops(config: Mapping[str, Any], lengths: Iterable[int], *, lora_rank: int) -> float:
    """One LoRA training pass: forward, then backward to the activations and to the adapters only
    (``costs.ForwardFlops.backward``). The loss needs the full-vocabulary head at the answer position,
    forward and backward."""
    dims, adapters = costs.dimensions(config), costs.lora_parameter_count(config, lora_rank)
    head = costs.head_flops(dims, dims.vocab_size)
    return sum(f.total + f.backward + 2 * head for f in (_forward(dims, n, adapters) for n in lengths))
