"""Tiny configs for the engine-loop tests: the demo's random OPT, capped testsets, 8-way data parallel.

Every engine-loop test (in process, or the demo config shrunk to the same
shapes through `python -m oodjax.main`) runs the same compiled programs.
"""

from configs import base, demo

# 64 wide, 2 layers, 4 heads: narrower random models barely learn (their
# final LayerNorm caps the answer logits), see test_learning.py.
TINY_OPT = demo.get_config().model.hf_config.to_dict()

# The demo config shrunk on the command line to the shapes of `tiny_config`.
SHRUNK_DEMO_ARGS = (
    "--config=configs/demo.py",
    "--config.data.testsets=('mnli', 'hans', 'rte')",
    "--config.data.eval_cap=16",
    "--config.data.max_length=64",
    "--config.data.buckets=(64,)",
    "--config.train.steps=4",
    "--config.train.warmup_steps=1",
    "--config.eval.every=2",
    "--config.eval.batch_size=8",
)


def checkpoint_config():
    """The defaults with a checkpoint named, which ``read`` does not open: a config that names no model is
    refused."""
    config = base.get_config()
    config.model.path = "facebook/opt-125m"
    return config


def tiny_config(output_dir, tokenizer_dir, data_dir, cache_dir):
    """Two runs (seeds 0 and 1, 8 shots), two testsets of 16 examples, 4 steps, fp32, data parallel on all devices."""
    config = base.get_config()
    config.model.hf_config = TINY_OPT
    config.model.name = "opt-tiny"
    config.model.dtype = "float32"
    config.tokenizer = str(tokenizer_dir)
    config.data.data_dir = str(data_dir)
    config.data.cache_dir = str(cache_dir)
    config.data.testsets = ("mnli", "hans")
    config.data.eval_cap = 16
    config.data.cap_in_domain = True  # MNLI too: the engine tests' shapes stay small
    config.data.max_length = 64  # one bucket: one eval-step compilation
    config.data.buckets = (64,)
    config.runs.seeds = (0, 1)
    config.runs.shots = (8,)
    config.train.steps = 4
    config.train.batch_size = 8
    config.train.learning_rate = 1e-3
    config.train.warmup_steps = 1
    config.eval.every = 2
    config.eval.batch_size = 8
    config.mesh.data = -1
    config.output_dir = str(output_dir)
    config.checkpoint_every = 2
    config.log_every = 1
    return config
