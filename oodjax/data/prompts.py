"""Prompts: the template, the answer tokens, and tokenisation with premise-only truncation.

A prompt is tokenised whole with the tokenizer's own special tokens (OPT's
`</s>` BOS, Llama's `<s>`). A prompt longer than `max_length` loses tokens
from the end of the premise only, so the hypothesis and the question, whose
last token scores the answer, are never cut; the kept tokens are the whole
prompt's own (located by character offsets). A tokenizer that appends a
special token (an EOS) is refused: the answer is scored at the last token.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import string
from collections.abc import Sequence

import datasets
import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from oodjax.data.cache import cached_arrays
from oodjax.usage_errors import NotFetchedError

DEFAULT_TEMPLATE = "{premise} Question: {hypothesis} Yes or No?"
# The words whose next-token logits are read, (yes, no): entailment is the first.
DEFAULT_ANSWERS = (" Yes", " No")
DEFAULT_MAX_LENGTH = 512
# Part of every cache key: bump it whenever tokenisation changes what it produces.
TOKENIZATION_VERSION = "1"


@dataclasses.dataclass(frozen=True)
class TokenizedSet:
    """A tokenised testset: ragged prompts stored flat, so it caches as one npz."""

    token_ids: np.ndarray  # [total tokens] int32
    starts: np.ndarray  # [N + 1] int64
    labels: np.ndarray  # [N] int32
    truncated: np.ndarray  # [N] bool
    max_length: int

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    @property
    def num_truncated(self) -> int:
        return int(self.truncated.sum())

    def prompt(self, i: int) -> np.ndarray:
        return self.token_ids[self.starts[i] : self.starts[i + 1]]


def check_template(template: str) -> None:
    """A template must name {premise} and {hypothesis} exactly once each, and nothing else."""
    fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    if sorted(fields) != ["hypothesis", "premise"]:
        raise ValueError(
            f"prompt template must contain {{premise}} and {{hypothesis}} once each and no other "
            f"fields; {template!r} has fields {fields}"
        )


def format_prompt(premise: str, hypothesis: str, template: str = DEFAULT_TEMPLATE) -> str:
    check_template(template)
    return template.format(premise=premise, hypothesis=hypothesis)


def load_tokenizer(source: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer in a local directory or under a hub id; transformers' errors for a damaged one name no file."""
    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as error:  # `tokenizers` raises a plain Exception for a corrupt vocabulary
        if isinstance(error, OSError) and not pathlib.Path(source).expanduser().is_dir():
            # A hub id neither cached nor reachable (offline, or a compute node without network).
            raise NotFetchedError(
                f"tokenizer {str(source)!r} is not a local folder and the Hugging Face hub could not give it: {error}"
            ) from error
        raise ValueError(
            f"tokenizer {str(source)!r} cannot be loaded (are its files complete?): {type(error).__name__}: {error}"
        ) from error


def answer_token_ids(tokenizer: PreTrainedTokenizerBase, answers: Sequence[str] = DEFAULT_ANSWERS) -> tuple[int, int]:
    """The token ids of the (yes, no) answer words: one token each, as written (" Yes" is not "Yes"), and
    different, since the loss targets one token and the margin compares two logits."""
    if len(answers) != 2:
        raise ValueError(f"data.answers must be two words (yes, no), got {list(answers)}")
    ids = []
    for answer in answers:
        tokens = tokenizer.encode(answer, add_special_tokens=False)
        if len(tokens) != 1:
            raise ValueError(
                f"answer {answer!r} (data.answers) is {len(tokens)} tokens {tokenizer.convert_ids_to_tokens(tokens)} "
                f"(ids {tokens}) for tokenizer {tokenizer.name_or_path!r}; each answer must be exactly one token"
            )
        ids.append(tokens[0])
    if ids[0] == ids[1]:
        raise ValueError(
            f"answers {list(answers)} (data.answers) are the same token {ids[0]} for tokenizer "
            f"{tokenizer.name_or_path!r}; yes and no must differ"
        )
    return ids[0], ids[1]


def tokenize_testset(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    template: str = DEFAULT_TEMPLATE,
    max_length: int = DEFAULT_MAX_LENGTH,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
) -> TokenizedSet:
    """Tokenise every example of a binary NLI dataset, truncating inside premises only; cached, keyed by the
    tokenizer's full definition, the template, max_length and the rows, so a change is never a stale hit."""
    check_template(template)
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"tokenizer {tokenizer.name_or_path!r} must be a fast tokenizer (premise offsets)")
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    columns = ds.select_columns(["premise", "hypothesis", "label"]).to_dict()
    premises, hypotheses, labels = columns["premise"], columns["hypothesis"], columns["label"]

    compute = functools.partial(_tokenize, premises, hypotheses, labels, tokenizer, template, max_length, _describe(ds))
    key_parts = [
        TOKENIZATION_VERSION,
        tokenizer.backend_tokenizer.to_str(),
        template,
        str(max_length),
        json.dumps([premises, hypotheses, labels]),
    ]
    arrays = cached_arrays("tokenized", key_parts, compute, cache_dir=cache_dir, use_cache=use_cache)
    return TokenizedSet(max_length=max_length, **arrays)


def _tokenize(
    premises: list[str],
    hypotheses: list[str],
    labels: list[int],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    max_length: int,
    source: str,
) -> dict[str, np.ndarray]:
    before_premise = template.split("{premise}")[0]
    prompts = [template.format(premise=p, hypothesis=h) for p, h in zip(premises, hypotheses)]
    encoded = tokenizer(prompts, add_special_tokens=True, return_offsets_mapping=True, return_special_tokens_mask=True)
    rows, truncated = [], []
    for i, (ids, offsets, special) in enumerate(
        zip(encoded["input_ids"], encoded["offset_mapping"], encoded["special_tokens_mask"])
    ):
        if special[-1]:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} appends special token {ids[-1]} to prompts; the last "
                "token must be the prompt's own, since the answer is scored at its position"
            )
        start = len(before_premise.format(hypothesis=hypotheses[i]))
        premise_span = (start, start + len(premises[i]))
        where = f"{source} example {i} (hypothesis {_shortened(hypotheses[i])!r})"
        row = _truncate_premise(ids, offsets, special, premise_span, max_length, where=where)
        rows.append(row)
        truncated.append(len(row) < len(ids))
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    return {
        "token_ids": np.array([t for row in rows for t in row], dtype=np.int32),
        "starts": np.concatenate([[0], np.cumsum(lengths)]),
        "labels": np.asarray(labels, dtype=np.int32),
        "truncated": np.array(truncated, dtype=bool),
    }


def _truncate_premise(
    ids: list[int],
    offsets: list[tuple[int, int]],
    special: list[int],
    premise_span: tuple[int, int],
    max_length: int,
    where: str,
) -> list[int]:
    excess = len(ids) - max_length
    if excess <= 0:
        return ids
    lo, hi = premise_span
    in_premise = [i for i, ((a, b), s) in enumerate(zip(offsets, special)) if not s and lo <= a and b <= hi]
    if len(in_premise) < excess:
        raise ValueError(
            f"{where}: prompt is {len(ids)} tokens and its premise only {len(in_premise)}; "
            f"max_length={max_length} cannot be met by cutting the premise (raise data.max_length, or shorten the "
            "template)"
        )
    dropped = set(in_premise[len(in_premise) - excess :])
    return [t for i, t in enumerate(ids) if i not in dropped]


def _describe(ds: datasets.Dataset) -> str:
    """The testset and split `load_testset` recorded on `ds`, for error messages."""
    name = ds.info.dataset_name
    return f"{name} split {str(ds.split)!r}" if name else "dataset"


def _shortened(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
