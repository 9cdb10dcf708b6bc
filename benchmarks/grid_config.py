"""The 9-run grid as an oodjax config: `--config=benchmarks/grid_config.py:MODE[,SEED,SHOTS]`.

MODE (full, quick, smoke) sets the model and the sizes; with SEED and SHOTS
the config holds that one run only (the grid run as separate processes).
The PyTorch grid (benchmarks.torch_grid) reads the same config, so both
sides train and evaluate the same runs on the same data.
"""

from __future__ import annotations

from ml_collections import config_dict

from benchmarks import settings
from benchmarks.workload import DATA_DIR, tokenizer_dir
from configs import base


def get_config(spec: str = "quick") -> config_dict.ConfigDict:
    name, *run = spec.split(",")
    if name not in settings.MODES or len(run) not in (0, 2):
        raise ValueError(f"grid config {spec!r}: expected MODE or MODE,SEED,SHOTS with MODE in {list(settings.MODES)}")
    mode = settings.MODES[name]
    seeds, shots = ((int(run[0]),), (int(run[1]),)) if run else (mode.grid_seeds, mode.grid_shots)
    config = engine_config(seeds=seeds, shots=shots, steps=mode.grid_steps)
    with config.unlocked():
        config.model.hf_config = config_dict.ConfigDict(mode.grid_model)
    config.model.name = f"bench-{name}"
    config.model.dtype = "float32"
    config.data.data_dir = str(DATA_DIR)
    config.data.max_length = settings.MAX_LENGTH
    config.data.eval_cap = mode.grid_eval_cap
    config.data.cap_in_domain = True  # every testset alike, as the PyTorch grid caps them
    config.eval.every = mode.grid_steps  # evaluations at step 0 and at the end: two
    config.eval.batch_size = mode.eval_batch_size
    config.checkpoint_every = mode.grid_steps
    config.log_every = mode.grid_steps
    return config


def engine_config(*, seeds: tuple[int, ...], shots: tuple[int, ...], steps: int) -> config_dict.ConfigDict:
    """What every oodjax side of the benchmarks trains with (the grid's and the cases' contenders): the runs
    of ``seeds`` x ``shots``, ``steps`` steps of ``settings``' batches and optimizer, on one device's mesh."""
    config = base.get_config()
    config.tokenizer = str(tokenizer_dir())
    config.runs.seeds, config.runs.shots = seeds, shots
    config.train.steps = steps
    config.train.batch_size = settings.TRAIN_BATCH
    config.train.grad_accum = settings.TRAIN_GRAD_ACCUM
    config.train.pack = True
    config.train.learning_rate = settings.LEARNING_RATE
    config.train.warmup_steps = settings.warmup_steps(steps)
    config.train.max_grad_norm = settings.MAX_GRAD_NORM
    config.mesh.data = 1
    return config
