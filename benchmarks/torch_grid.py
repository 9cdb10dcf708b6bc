"""`python -m benchmarks.torch_grid MODE {original,tuned} OUTPUT_DIR`: the grid's runs in PyTorch, one by one.

The PyTorch counterpart of `python -m oodjax.main --config
benchmarks/grid_config.py:MODE`: the same runs, sets, steps and evaluations,
with either approach of benchmarks.torch_contenders. Kinder to PyTorch than
the study was: one process, the model built once, a fresh peft adapter per
run, where the study started a job per run.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import numpy as np
import torch
from ml_collections import config_dict

from benchmarks import grid_config, machine, settings, torch_contenders
from benchmarks.workload import training_order
from oodjax.config_read import read
from oodjax.data import TokenizedSet, answer_token_ids, load_tokenizer
from oodjax.engine import run_data


@dataclasses.dataclass(frozen=True)
class GridData:
    """Everything the grid's runs read, as the oodjax loop loads it (``oodjax.engine.run_data``'s testsets and
    few-shot sets, its tokenisation cache); no train step geometry, which would start JAX beside torch."""

    testsets: dict[str, TokenizedSet]
    train_sets: dict[tuple[int, int], TokenizedSet]  # (seed, shots) -> few-shot set
    yes_id: int
    no_id: int


def grid_data(config: config_dict.ConfigDict) -> GridData:
    job = read(config)
    tokenizer = load_tokenizer(job.model.tokenizer)
    runs = [(run.seed, run.shots) for run in job.runs.runs()]
    train_sets = dict(zip(runs, run_data.few_shot_sets(job.data, tokenizer, runs), strict=True))
    testsets = run_data.load_testsets(job.data, tokenizer)
    return GridData(testsets, train_sets, *answer_token_ids(tokenizer, job.data.answers))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.torch_grid", description="the grid's runs in PyTorch, one after another"
    )
    parser.add_argument("mode", choices=list(settings.MODES), help="the benchmark size (grid_config.py's MODE)")
    parser.add_argument(
        "approach",
        choices=["original", "tuned"],
        help="original: padded to MAX_LENGTH, full logits; tuned: dynamic padding, head at the answer",
    )
    parser.add_argument("output", type=pathlib.Path, help="where each run's adapter and metrics.npz go")
    args = parser.parse_args(argv)
    torch.set_num_threads(machine.usable_cores())
    config = grid_config.get_config(args.mode)
    tuned = args.approach == "tuned"
    margins_of = torch_contenders.margins_tuned if tuned else torch_contenders.margins_original
    grid = grid_data(config)
    answers = dict(yes_id=grid.yes_id, no_id=grid.no_id)
    scoring = dict(answers, batch_size=config.eval.batch_size)
    model = torch_contenders.build_model(config.model.hf_config.to_dict(), seed=config.model.init_seed)
    steps = config.train.steps
    for (seed, shots), train_set in grid.train_sets.items():
        peft_model = torch_contenders.attach_lora(model, seed=seed)
        trainer = torch_contenders.Trainer(peft_model, tuned=tuned, total_steps=steps, **answers)

        def evaluate() -> dict[str, np.ndarray]:
            sets = {**grid.testsets, "train": train_set}
            return {name: margins_of(peft_model, t, np.arange(len(t)), **scoring) for name, t in sets.items()}

        margins = {0: evaluate()}
        losses = [
            trainer.step(train_set, rows)
            for rows in training_order(len(train_set), steps, config.train.batch_size, seed)
        ]
        margins[steps] = evaluate()
        run_dir = args.output / f"torch_seed{seed}_shots{shots}"
        peft_model.save_pretrained(run_dir)
        np.savez(
            run_dir / "metrics.npz",
            train_loss=np.asarray(losses),
            **{f"margin/{step}/{name}": m for step, per_set in margins.items() for name, m in per_set.items()},
        )
        model = peft_model.unload()


if __name__ == "__main__":
    main(sys.argv[1:])
