"""The study's configs trained by llmft's few-shot LoRA recipe: one preset per model and training set, a sensitivity.

`configs/llmft/{model}_{mnli,snli}.py` each return `preset(model, train_set)`:
the study config of `configs.models.model_config` with only the training
length, learning rate, warm-up and batch below changed, to the recipe of
uds-lsv/llmft (Mosbach et al. 2023, "Few-shot Fine-tuning vs. In-context
Learning", few-shot fine-tuning code by two of the study's authors) at
commit 3acc3894fa4111d9155190a98a147e3e664ff3da: its LoRA example,
`experiments/pattern_verbalizer_ft/lora.sh`, runs
`scripts/pattern_verbalizer_ft/mnli/lora.sh mnli 32 80 0.25 4 8 2e-4
facebook/opt-30b 8 -1`: 32 MNLI examples, 80 epochs, warm-up ratio 0.25,
batch 4 on each of 8 GPUs, learning rate 2e-4, adapter dimension 8.

    python -m oodjax.main --config configs/llmft/opt2.7_mnli.py --config.output_dir=results/llmft

A sensitivity, not the study's protocol (which no source gives: docs/protocol.md):
a trajectory long and fast enough to train, against which the original presets'
(configs/original/) can be judged. llmft's adapter is not oodjax's LoRA (a ReLU
between its two matrices, biases, on the query and value projections only) and
is not reproduced, but its effective scale is: lora.sh's lora_alpha=-1 makes
its output scale a trainable parameter starting at 1 (models/opt_wrapper.py,
LoRAAdapter), so the presets set lora.alpha to the rank (alpha / rank = 1, the
study configs' 4), a fixed scale since oodjax's has no trainable one. They
evaluate every epoch as llmft does (`--evaluation_strategy epoch`: eval.points
= epochs). llmft fixes the model seed (`--seed 0`: every run's adapter starts
alike) and varies the data seed; the presets keep oodjax's runs.seeds, which
draw each run's few-shot set and its keys together, because with one model
seed every run would start alike and the analysis would count runs that share
their start as independent seeds. They keep the study configs' template,
answer words, weight decay (0.0, as llmft's) and rank (8, as llmft's
dimension). As the original presets, they keep the study configs' run names
and resources: train them into their own results root, and run the
preflight, since batch 32 puts twice the study configs' prompts in each step
(raise `train.grad_accum` if it does not fit).
"""

from __future__ import annotations

from ml_collections import config_dict

from configs.models import model_config


def preset(model: str, train_set: str) -> config_dict.ConfigDict:
    """`configs.models.model_config(model, train_set)` trained by llmft's few-shot LoRA recipe."""
    config = model_config(model, train_set)
    # experiments/pattern_verbalizer_ft/lora.sh: learning_rate=2e-4 (lora.sh's 7th argument).
    config.train.learning_rate = 2e-4
    # bsz=4 per device on num_gpus=8 (scripts/pattern_verbalizer_ft/mnli/lora.sh: --per_device_train_batch_size,
    # --include localhost:0,...,7, --gradient_accumulation_steps 1): 32 examples an optimizer step.
    config.train.batch_size = 32
    # epochs=80 (`--num_train_epochs`): 80, 160 and 320 steps of 32, 64 and 128 shots at batch 32.
    config.train.epochs = 80.0
    # warmup_ratio=0.25 (`--warmup_ratio`), the Trainer's linear schedule: a quarter of each run's steps.
    config.train.warmup_ratio = 0.25
    # lora_alpha=-1 (lora.sh's 10th argument): LoRAAdapter's output scale, a parameter initialised to 1.
    config.lora.alpha = float(config.lora.rank)
    # --evaluation_strategy epoch: eval.points spreads one evaluation per epoch over each run's own steps.
    config.eval.points = int(config.train.epochs)
    return config
