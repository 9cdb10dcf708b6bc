"""The three sizes a benchmark run comes in: full (the published figures), quick, and smoke (CI).

Every size measures the same cases with the same contenders; only the model
shape, the number of examples and the repetitions change. Ratios are of each
contender's fastest repetition (``benchmarks.harness`` says why). Smoke mode
only shows that every case's code runs (CI).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypedDict

# HuggingFaceTB/SmolLM2-135M's config.json (the architecture; weights are random).
SMOLLM2_135M: dict[str, Any] = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=0,
    eos_token_id=0,
)

# The GPT-2 tokenizer's vocabulary: the grid runs the engine end to end, which
# tokenises with it, so its model must hold all 50257 ids.
GPT2_VOCAB = 50257


def smollm2_shape(**changes: Any) -> dict[str, Any]:
    """SmolLM2-135M's config with some fields changed (a smaller shape of the same family)."""
    unknown = sorted(set(changes) - set(SMOLLM2_135M))
    if unknown:
        raise KeyError(f"not SmolLM2 config fields: {unknown}")
    return {**SMOLLM2_135M, **changes}


# The smoke modes' width: every case's code runs, in seconds.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)

# Every prompt is truncated (inside its premise) to this; the original approach pads to it. oodjax's training
# micro-batches run at the loop's default bucket lengths below it (``oodjax.data.bucket_lengths``).
MAX_LENGTH = 128


@dataclasses.dataclass(frozen=True)
class Mode:
    """How big one benchmark run is.

    ``grid_model`` is the 9-run grid's, smaller than ``model`` since the grid runs whole training jobs.
    """

    name: str
    model: dict[str, Any]
    eval_per_testset: int  # real examples drawn from each of the eight testsets
    eval_batch_size: int
    original_eval_examples: int  # the padded-to-128 approach costs the same per example whatever it is
    train_shots: int  # the MNLI few-shot set the training case steps through
    train_steps_per_repeat: int
    repeats: int
    loading_repeats: int
    grid_model: dict[str, Any]
    grid_seeds: tuple[int, ...]
    grid_shots: tuple[int, ...]
    grid_steps: int
    grid_eval_cap: int  # examples per testset at each of the grid's two evaluations (step 0 and grid_steps)
    grid_repeats: int
    warmup: int = 1  # untimed calls of each contender before its repetitions (the first compiles)
    matmul_size: int = 2048


TRAIN_BATCH = 16
# oodjax's micro-batches per step, with train.pack on (one device): two halve a micro-batch's working set
# (this machine's cores are shared with PyTorch's contenders) yet keep the matmuls larger than eight would.
TRAIN_GRAD_ACCUM = 2


class LoraSettings(TypedDict):
    """The adapters every contender trains (peft's LoraConfig and oodjax's LoRAConfig from the same values)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


LORA = LoraSettings(rank=8, alpha=32.0, dropout=0.1, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0


# The study evaluates 21 times in 500 steps: one evaluation about every 24 steps, as many as the full grid
# trains between its two evaluations.
GRID_STEPS_PER_EVALUATION = 24


def warmup_steps(total_steps: int) -> int:
    """Linear warm-up over the first tenth of training (at least one step), for both engines alike."""
    return min(total_steps, max(1, total_steps // 10))


MODES: dict[str, Mode] = {
    "full": Mode(
        name="full",
        model=SMOLLM2_135M,
        eval_per_testset=6,
        eval_batch_size=32,
        original_eval_examples=16,
        train_shots=128,
        train_steps_per_repeat=2,
        repeats=7,
        loading_repeats=15,  # a load takes 0.3 s: the fastest of 5 moved by 24% between runs, of 15 by 5%
        grid_model=smollm2_shape(num_hidden_layers=2, vocab_size=GPT2_VOCAB),
        grid_seeds=(0, 42, 99),  # the study's seeds and shot counts
        grid_shots=(32, 64, 128),
        grid_steps=GRID_STEPS_PER_EVALUATION,
        grid_eval_cap=4,
        grid_repeats=3,
    ),
    "quick": Mode(
        name="quick",
        model=smollm2_shape(
            hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
        ),
        eval_per_testset=8,
        eval_batch_size=32,
        original_eval_examples=32,
        train_shots=64,
        train_steps_per_repeat=1,
        repeats=5,
        loading_repeats=3,
        grid_model=smollm2_shape(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=GPT2_VOCAB,
        ),
        grid_seeds=(0, 42),
        grid_shots=(32,),
        grid_steps=2,
        grid_eval_cap=8,
        grid_repeats=1,
    ),
    "smoke": Mode(
        name="smoke",
        # a small vocabulary (it still holds " Yes" 3363 and " No" 1400) keeps the full-logits contender quick
        model=smollm2_shape(**TINY, vocab_size=4096),
        eval_per_testset=2,
        eval_batch_size=8,
        original_eval_examples=8,
        train_shots=32,
        train_steps_per_repeat=1,
        repeats=1,
        loading_repeats=1,
        grid_model=smollm2_shape(**{**TINY, "num_hidden_layers": 1}, vocab_size=GPT2_VOCAB),
        grid_seeds=(0,),
        grid_shots=(8,),
        grid_steps=1,
        grid_eval_cap=2,
        grid_repeats=1,
        matmul_size=512,
    ),
}


@dataclasses.dataclass(frozen=True)
class DeviceMode:
    """How big a ``--device gpu`` run is (``benchmarks.case_device``): ``runs`` runs of SmolLM3-3B's shape with
    ``changes``, each repetition ``steps`` training steps and one evaluation."""

    name: str
    needs_gpu: bool  # smoke runs the same code tiny on any backend
    runs: int
    steps: int
    repeats: int
    eval_per_testset: int
    eval_batch_rows: int
    train_shots: int = 128
    # configs/smol3_*.py's one micro-batch, but not its remat policy (none, with rows over 8 devices): all 9
    # runs' rows on one device without remat need more than JAX takes of a GPU, so the benchmark keeps save_dots.
    remat: str = "save_dots"
    grad_accum: int = 1
    changes: tuple[tuple[str, Any], ...] = ()

    @property
    def model(self) -> dict[str, Any]:
        """The study's SmolLM3-3B config.json numbers (configs/models.py's "smol3", imported here: it imports JAX,
        which ``benchmarks.environment`` must configure first), head width spelled out, with ``changes``."""
        from configs.models import MODELS

        return {**MODELS["smol3"].architecture, "head_dim": 128, **dict(self.changes)}


DEVICE_MODES: dict[str, DeviceMode] = {
    # The study's 9 runs and its steps between evaluations (24).
    "gpu": DeviceMode(
        name="gpu",
        needs_gpu=True,
        runs=9,
        steps=GRID_STEPS_PER_EVALUATION,
        repeats=3,
        eval_per_testset=64,
        eval_batch_rows=64,
    ),
    "gpu-smoke": DeviceMode(
        name="gpu-smoke",
        needs_gpu=False,
        runs=2,
        steps=1,
        repeats=1,
        eval_per_testset=2,
        eval_batch_rows=8,
        train_shots=32,
        changes=(*TINY.items(), ("vocab_size", 4096), ("pad_token_id", 0)),
    ),
}
