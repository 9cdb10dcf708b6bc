"""The PyTorch side: a transformers model with a peft LoRA adapter, evaluated and trained two ways.

"original" is the original study's approach: every example padded to
MAX_LENGTH, the model's full logits [B, S, V], then the answer position's
two columns (evaluation) or its full-vocabulary row (training loss).
"tuned" is what a careful PyTorch user would write: batches of similar
length (evaluation sorts by length), each padded only to its own longest
prompt, and the head applied at the answer position alone (two columns for
evaluation). Both compute the same margins and losses as oodjax's steps.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import peft
import torch
import transformers

from benchmarks import settings
from oodjax.data import TokenizedSet


def build_model(
    hf_config: Mapping[str, Any], *, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> transformers.PreTrainedModel:
    """A randomly initialised transformers model of the config's architecture (SDPA attention), on ``device``."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**hf_config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.to(device)


def load_model(checkpoint: str | pathlib.Path) -> transformers.PreTrainedModel:
    """The float32 model saved at ``checkpoint`` (SDPA attention): the weights every contender of a case reads."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="sdpa"
    )


def attach_lora(model: transformers.PreTrainedModel, *, seed: int) -> peft.PeftModel:
    """peft's LoRA with the study's settings (r 8, alpha 32, dropout 0.1, q/k/v/o), A drawn from ``seed``."""
    torch.manual_seed(seed)
    lora = settings.LORA
    config = peft.LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=list(lora["targets"]),
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def padded(
    tokenized: TokenizedSet, rows: Sequence[int] | np.ndarray, seq_len: int | None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask for ``rows`` (to ``seq_len``, or to the longest row), on ``device``."""
    index = np.asarray(rows)
    lengths = tokenized.lengths[index]
    mask = np.arange(int(lengths.max()) if seq_len is None else seq_len) < lengths[:, None]
    input_ids = np.zeros(mask.shape, dtype=np.int64)
    input_ids[mask] = np.concatenate([tokenized.prompt(i) for i in index])  # row by row, each from its start
    arrays = {
        "input_ids": input_ids,
        "attention_mask": mask.astype(np.int64),
        "answer_pos": lengths - 1,
        "label": tokenized.labels[index].astype(np.int64),
    }
    return {key: torch.from_numpy(value).to(device) for key, value in arrays.items()}


def _answer_hidden(model: peft.PeftModel, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Final hidden states [B, H] at the answer positions, without running the head."""
    base = model.get_base_model()
    hidden = base.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return hidden[torch.arange(hidden.shape[0]), batch["answer_pos"]]


def _full_logits_at_answer(model: peft.PeftModel, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[B, V]: the model's full logits [B, S, V], then the answer position's row (the original approach)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits[torch.arange(logits.shape[0]), batch["answer_pos"]]


def _batches(order: np.ndarray, batch_size: int) -> list[np.ndarray]:
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@torch.inference_mode()
def margins_original(
    model: peft.PeftModel, tokenized: TokenizedSet, rows: np.ndarray, *, yes_id: int, no_id: int, batch_size: int
) -> np.ndarray:
    """logit(Yes) - logit(No) of ``rows``, every batch padded to MAX_LENGTH, full logits computed."""
    model.eval()
    out = []
    for chunk in _batches(rows, batch_size):
        logits = _full_logits_at_answer(model, padded(tokenized, chunk, settings.MAX_LENGTH, model.device))
        out.append((logits[:, yes_id] - logits[:, no_id]).float().cpu().numpy())
    return np.concatenate(out)


@torch.inference_mode()
def margins_tuned(
    model: peft.PeftModel, tokenized: TokenizedSet, rows: np.ndarray, *, yes_id: int, no_id: int, batch_size: int
) -> np.ndarray:
    """The same margins, from length-sorted, dynamically padded batches and the two head rows only."""
    model.eval()
    order = np.argsort(tokenized.lengths[rows], kind="stable")
    head = model.get_base_model().get_output_embeddings().weight[[yes_id, no_id]]  # [2, H]
    margins = np.empty(len(rows), dtype=np.float32)
    for chunk in _batches(order, batch_size):
        logits = _answer_hidden(model, padded(tokenized, rows[chunk], None, model.device)) @ head.T
        margins[chunk] = (logits[:, 0] - logits[:, 1]).float().cpu().numpy()
    return margins


class Trainer:
    """peft + torch AdamW with the engine's settings (linear warm-up/decay, clipping at 1.0)."""

    def __init__(self, model: peft.PeftModel, *, tuned: bool, yes_id: int, no_id: int, total_steps: int):
        self.model, self.tuned = model, tuned
        self.answer_ids = torch.tensor([yes_id, no_id], device=model.device)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=settings.LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
        self.schedule = transformers.get_linear_schedule_with_warmup(
            self.optimizer, num_warmup_steps=settings.warmup_steps(total_steps), num_training_steps=total_steps
        )
        self.params = params

    def step(self, tokenized: TokenizedSet, rows: np.ndarray) -> float:
        """One optimizer step on ``rows``; the loss is cross-entropy at the answer position over the full vocabulary."""
        self.model.train()
        batch = padded(tokenized, rows, None if self.tuned else settings.MAX_LENGTH, self.model.device)
        if self.tuned:
            logits = self.model.get_base_model().lm_head(_answer_hidden(self.model, batch))
        else:
            logits = _full_logits_at_answer(self.model, batch)
        targets = self.answer_ids[(batch["label"] != 0).long()]
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, settings.MAX_GRAD_NORM)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()
