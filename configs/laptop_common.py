"""The study at laptop scale: a real small checkpoint, a 3x3 grid of runs, on a CPU without a GPU.

`configs/laptop_{opt125m,smol135m,olmo1b}.py` each take `laptop_config` for one
of the three families' smallest checkpoints. The protocol is the study's
(LoRA r=8 on q/k/v/o, AdamW with warm-up and linear
decay, three seeds x 32/64/128 shots, the eight testsets plus the training
set); what shrinks is what costs CPU time:
- the eight testsets are capped at 100 examples each (stratified, seeded): an
  accuracy's standard error is about 0.05, enough for the partial
  correlations' point estimates to mean something, not for tight intervals;
- 100 optimizer steps of 8 examples at a higher learning rate (3e-4), so that
  few-shot accuracies move within them;
- an evaluation every 10 steps: 11 points per run, each run's partial
  correlations then having 11 - 3 = 8 degrees of freedom;
- float32 weights (CPUs are rarely faster in bfloat16), prompts cut to 128
  tokens (MNLI's and SNLI's fit; longer premises are truncated inside).
The checkpoints come from the hub on first use (`HF_HOME` caches them).

Cost: an OPT-125m-sized model trained ~3 examples/s and evaluated ~1,600
tokens/s on one busy core of a 2-core CPU, so its grid (7,200 training
examples, 11 evaluations of ~0.5M tokens) takes ~1.5-2 h there and, scaled by
cores, well under an hour on a laptop of 4-8 cores (an extrapolation, not a
laptop measurement); SmolLM2-135M costs about the same. OLMo-2-0425-1B
computes ~10x more per token: a few hours on a laptop CPU, minutes on a GPU.
"""

from ml_collections import config_dict

from configs import base


def laptop_config(hub_id: str, name: str) -> config_dict.ConfigDict:
    """base.py's config for the checkpoint `hub_id` (run names start with `name`) at laptop scale."""
    config = base.get_config()
    config.model.path = hub_id
    config.model.name = name
    config.model.dtype = "float32"
    config.data.train_set = "mnli"  # --config.data.train_set=snli for the other half of the study
    config.data.eval_cap = 100
    # MNLI too (about 6,000 rows whole), for a CPU's time: its partial correlations are biased upward.
    config.data.cap_in_domain = True
    config.data.max_length = 128
    config.data.buckets = (64, 128)
    config.runs.seeds = (0, 42, 99)
    config.runs.shots = (32, 64, 128)
    config.train.steps = 100
    config.train.batch_size = 8
    config.train.learning_rate = 3e-4
    config.train.warmup_steps = 10
    config.eval.every = 10
    config.eval.batch_size = 32
    config.output_dir = f"results/laptop/{name}"
    config.checkpoint_every = 50
    config.log_every = 5
    return config
