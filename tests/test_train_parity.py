"""Training parity with the stack researchers use today: transformers + peft + torch AdamW.

Same tiny OPT weights (saved by transformers, loaded by ``load_pretrained``),
the same initial adapters (ours copied into peft's), the same batches, no
dropout, the same clipping, AdamW and warm-up/decay schedule
(``get_linear_schedule_with_warmup``, a LambdaLR): the losses of 10 steps
must agree within 1e-4.
"""

import numpy as np
import peft
import torch
import transformers
from test_models_parity import save, tiny_hf_model
from test_steps import as_step

from oodjax.engine import steps
from oodjax.engine.geometry import BatchGeometry
from oodjax.models import load_pretrained
from oodjax.models.lora import LoRAConfig, peft_tensors

STEPS, WARMUP = 10, 2
LR, WEIGHT_DECAY = 1e-2, 0.01
MAX_GRAD_NORM = 0.05  # small enough that clipping happens (checked below)
ACCUM, MICRO, SEQ, VOCAB = 2, 4, 10, 64
YES, NO = 7, 9
LOSS_TOL = 1e-4


def parity_batches(seed: int = 0) -> list[dict]:
    """[1 run, ACCUM, MICRO, SEQ] right-padded prompts of random lengths, one batch per step."""
    rng = np.random.default_rng(seed)
    shape = (1, ACCUM, MICRO)
    out = []
    for _ in range(STEPS):
        lengths = rng.integers(3, SEQ + 1, size=shape)
        mask = (np.arange(SEQ) < lengths[..., None]).astype(np.int32)
        ids = np.where(mask == 1, rng.integers(2, VOCAB, size=(*shape, SEQ)), 1).astype(np.int32)
        out.append(
            dict(
                input_ids=ids,
                segment_ids=mask,
                answer_pos=(lengths - 1).astype(np.int32),
                label=rng.integers(0, 2, size=shape).astype(np.int32),
                valid=np.ones(shape, bool),
            )
        )
    return out


def torch_losses(peft_model, batches) -> tuple[list[float], list[float]]:
    """What a PyTorch researcher's loop computes: full forward, CE at answer_pos, clip, AdamW, LambdaLR."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)
    losses, norms = [], []
    for batch in batches:
        ids = torch.tensor(batch["input_ids"].reshape(-1, SEQ), dtype=torch.long)
        mask = torch.tensor(batch["segment_ids"].reshape(-1, SEQ), dtype=torch.long)
        logits = peft_model(input_ids=ids, attention_mask=mask).logits
        at_answer = logits[torch.arange(len(ids)), torch.tensor(batch["answer_pos"].reshape(-1), dtype=torch.long)]
        targets = torch.tensor(np.where(batch["label"].reshape(-1) == 0, YES, NO), dtype=torch.long)
        loss = torch.nn.functional.cross_entropy(at_answer, targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def test_ten_adamw_steps_match_transformers_and_peft(tmp_path):
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=32,
        pad_token_id=1,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    hf_model = tiny_hf_model(config)
    model = load_pretrained(save(hf_model, tmp_path))
    lora_cfg = LoRAConfig(rank=4, alpha=16.0, dropout=0.0)
    optimizer = steps.make_optimizer(LR, STEPS, WARMUP, WEIGHT_DECAY, MAX_GRAD_NORM)
    graphdef, base, runs = steps.attach_runs(model, [0], lora_cfg, optimizer)

    targets = ["q_proj", "k_proj", "v_proj", "out_proj"]
    peft_model = peft.get_peft_model(
        hf_model, peft.LoraConfig(r=4, lora_alpha=16.0, lora_dropout=0.0, target_modules=targets)
    )
    initial = {k: torch.from_numpy(v) for k, v in peft_tensors(steps.select_run(runs.lora, 0)).items()}
    result = peft.set_peft_model_state_dict(peft_model, initial)
    assert not result.unexpected_keys and len(initial) == 16
    assert not [k for k in result.missing_keys if "lora_" in k]

    batches = parity_batches()
    geometry = BatchGeometry(runs=1, batch_size=ACCUM * MICRO, grad_accum=ACCUM, seq_len=SEQ)
    train_step = steps.make_train_step(graphdef, optimizer, YES, NO, geometry)
    ours = []
    for batch in batches:
        runs, metrics = train_step(base, runs, as_step(batch))
        ours.append(float(metrics["loss"][0]))
    theirs, norms = torch_losses(peft_model, batches)

    assert max(norms) > MAX_GRAD_NORM  # clipping was exercised
    assert ours[-1] < ours[0] - 0.05  # the adapters learned something
    diffs = np.abs(np.array(ours) - np.array(theirs))
    final = peft_tensors(steps.select_run(runs.lora, 0))
    state = peft.get_peft_model_state_dict(peft_model)
    adapter_diff = max(float(np.abs(final[k] - state[k].detach().numpy()).max()) for k in final)
    print(f"loss diffs per step: {diffs.max():.2e} max; final adapters max |diff| {adapter_diff:.2e}")
    assert diffs.max() < LOSS_TOL, list(zip(ours, theirs, strict=True))
