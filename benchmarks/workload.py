"""The real NLI prompts every contender processes: the eight testsets and an MNLI few-shot set.

Prompts are tokenised once, by oodjax's data layer with the GPT-2 tokenizer
(truncated inside the premise to MAX_LENGTH), and every contender reads the
same token ids. The models are random, so token ids above a shape's
vocabulary (SmolLM2's 49152 < GPT-2's 50257) are folded into it: the cost of
a prompt depends on its length only.
"""

from __future__ import annotations

import dataclasses
import pathlib

import datasets
import numpy as np
from transformers import AutoTokenizer

from benchmarks import settings
from benchmarks.settings import DeviceMode, Mode
from oodjax.data import (
    TESTSETS,
    TokenizedSet,
    answer_token_ids,
    few_shot,
    load_testset,
    stratified_subset,
    tokenize_testset,
    training_pool,
)

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"
GPT2_TOKENIZER = SHARED_DATA / "tokenizers" / "gpt2"
DATA_DIR = SHARED_DATA / "hf"
SEED = 0


@dataclasses.dataclass(frozen=True)
class Workload:
    """The tokenised evaluation and training prompts, and the answer-token ids read at the answer position."""

    eval_set: TokenizedSet
    train_set: TokenizedSet
    yes_id: int
    no_id: int

    def describe(self) -> dict[str, float | int]:
        lengths = self.eval_set.lengths
        return {
            "eval_examples": len(self.eval_set),
            "eval_mean_tokens": float(lengths.mean()),
            "eval_max_tokens": int(lengths.max()),
            "eval_truncated": self.eval_set.num_truncated,
            "train_examples": len(self.train_set),
            "train_mean_tokens": float(self.train_set.lengths.mean()),
            "train_max_tokens": int(self.train_set.lengths.max()),
        }


def tokenizer_dir() -> pathlib.Path:
    if not GPT2_TOKENIZER.is_dir():
        raise FileNotFoundError(f"the benchmarks need the GPT-2 tokenizer of the shared data at {GPT2_TOKENIZER}")
    return GPT2_TOKENIZER


def fold_vocabulary(tokenized: TokenizedSet, vocab_size: int) -> TokenizedSet:
    """The same prompts with ids >= vocab_size wrapped into range (random models: only lengths matter)."""
    return dataclasses.replace(tokenized, token_ids=tokenized.token_ids % vocab_size)


def mode_workload(mode: Mode | DeviceMode) -> Workload:
    """The prompts at ``mode``'s sizes, what each process of the evaluation and training cases, or of
    ``--device gpu``, loads: ``mode.eval_per_testset`` examples from each of the eight testsets (stratified,
    seed 0) and an MNLI few-shot set of ``mode.train_shots``."""
    vocab_size = mode.model["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    yes_id, no_id = answer_token_ids(tokenizer)
    if max(yes_id, no_id) >= vocab_size:
        raise ValueError(f"answer ids {yes_id}, {no_id} do not fit a vocabulary of {vocab_size}")
    parts = [
        stratified_subset(load_testset(name, data_dir=DATA_DIR), mode.eval_per_testset, seed=SEED) for name in TESTSETS
    ]
    eval_rows = datasets.concatenate_datasets(parts)
    train_rows = few_shot(training_pool("mnli", data_dir=DATA_DIR), mode.train_shots, seed=SEED)
    eval_set, train_set = (
        fold_vocabulary(tokenize_testset(rows, tokenizer, max_length=settings.MAX_LENGTH), vocab_size)
        for rows in (eval_rows, train_rows)
    )
    return Workload(eval_set=eval_set, train_set=train_set, yes_id=yes_id, no_id=no_id)


def run_orders(num_examples: int, seeds: list[int], steps: int, batch_size: int) -> list[list[np.ndarray]]:
    """Each step's batches of runs seeded ``seeds`` (``training_order`` each): [step][run] row indices."""
    orders = [training_order(num_examples, steps, batch_size, seed=seed) for seed in seeds]
    return [[order[step] for order in orders] for step in range(steps)]


def training_order(num_examples: int, steps: int, batch_size: int, seed: int = SEED) -> list[np.ndarray]:
    """Row indices of ``steps`` training batches: shuffled epochs, one fixed order for every contender."""
    rng = np.random.default_rng(seed)
    epochs = -(-steps * batch_size // num_examples)
    order = np.concatenate([rng.permutation(num_examples) for _ in range(epochs)])
    return [order[i * batch_size : (i + 1) * batch_size] for i in range(steps)]
