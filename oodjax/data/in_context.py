"""In-context prompts: each test prompt preceded by answered demonstrations, as lm-evaluation-harness lays them out.

Demonstrations (template plus answer word) and then the test prompt are
joined by a blank line, lm-eval's default fewshot delimiter, and tokenised
as an ordinary prompt. A string longer than max_length loses whole
demonstrations from the front, never a token of the test prompt; one with
no room for any is its zero-shot tokenisation exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
from collections.abc import Sequence

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from oodjax.data.cache import cached_arrays
from oodjax.data.prompts import TOKENIZATION_VERSION, TokenizedSet, format_prompt

SEPARATOR = "\n\n"  # between demonstrations, and before the test prompt


@dataclasses.dataclass(frozen=True)
class InContextSet(TokenizedSet):
    """A TokenizedSet whose prompt i is preceded by the last ``demonstrations[i]`` demonstrations."""

    demonstrations: np.ndarray  # [N] int32


def tokenize_in_context(
    test_ds: datasets.Dataset,
    demonstrations_ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    template: str,
    answers: Sequence[str],
    max_length: int,
    zero_shot: TokenizedSet,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
) -> InContextSet:
    """Every prompt of ``test_ds`` preceded by as many of ``demonstrations_ds``'s examples as fit, nearest last.

    ``zero_shot`` is ``test_ds`` tokenised alone at the same max_length.
    """
    if len(zero_shot) != len(test_ds) or zero_shot.max_length != max_length:
        raise ValueError(
            f"zero_shot has {len(zero_shot)} prompts of at most {zero_shot.max_length} tokens; it must be test_ds "
            f"({len(test_ds)} rows) tokenised alone at max_length {max_length}"
        )
    tests = test_ds.select_columns(["premise", "hypothesis", "label"]).to_dict()
    shown = demonstrations_ds.select_columns(["premise", "hypothesis", "label"]).to_dict()
    prompts = [format_prompt(p, h, template) for p, h in zip(tests["premise"], tests["hypothesis"])]
    demonstrations = [
        format_prompt(p, h, template) + answers[label]
        for p, h, label in zip(shown["premise"], shown["hypothesis"], shown["label"])
    ]

    compute = functools.partial(_in_context, prompts, demonstrations, zero_shot, tokenizer)
    key_parts = [
        TOKENIZATION_VERSION,
        "in-context",
        tokenizer.backend_tokenizer.to_str(),
        template,
        json.dumps(list(answers)),
        SEPARATOR,
        str(max_length),
        json.dumps([tests["premise"], tests["hypothesis"], tests["label"]]),
        json.dumps([shown["premise"], shown["hypothesis"], shown["label"]]),
    ]
    arrays = cached_arrays("in_context", key_parts, compute, cache_dir=cache_dir, use_cache=use_cache)
    return InContextSet(max_length=max_length, **arrays)


def _in_context(
    prompts: list[str], demonstrations: list[str], zero_shot: TokenizedSet, tokenizer: PreTrainedTokenizerBase
) -> dict[str, np.ndarray]:
    """Tokenises each prompt with the most demonstrations that fit: estimated from their lengths alone, then
    one fewer for each string that still comes out too long."""
    max_length = zero_shot.max_length
    alone = tokenizer([text + SEPARATOR for text in demonstrations], add_special_tokens=False)["input_ids"]
    nearest_first = np.cumsum([len(ids) for ids in reversed(alone)], dtype=np.int64)  # the last 1, 2, ... together
    # A prompt whose premise was cut is max_length tokens already: no room, its zero-shot tokens.
    kept = np.searchsorted(nearest_first, max_length - zero_shot.lengths, side="right")
    rows = [zero_shot.prompt(i) for i in range(len(prompts))]
    pending = np.flatnonzero(kept)
    while pending.size:
        texts = [SEPARATOR.join([*demonstrations[len(demonstrations) - kept[i] :], prompts[i]]) for i in pending]
        encoded = tokenizer(texts, add_special_tokens=True)["input_ids"]
        fits = np.array([len(ids) <= max_length for ids in encoded], dtype=bool)
        for i, ids in zip(pending[fits], itertools.compress(encoded, fits)):
            rows[i] = ids
        too_long = pending[~fits]
        kept[too_long] -= 1
        pending = too_long[kept[too_long] > 0]
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    return {
        "token_ids": np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(lengths.sum())),
        "starts": np.concatenate([[0], np.cumsum(lengths)]),
        "labels": zero_shot.labels,
        "truncated": zero_shot.truncated,
        "demonstrations": kept.astype(np.int32),
    }
