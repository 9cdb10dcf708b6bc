"""`python -m oodjax.main --config configs/X.py [--config.train.steps=100 --config.runs.seeds=0,42 ...]`.

Trains the config's runs (its seeds x shot counts) and writes their results
under `config.output_dir`; rerunning with the same output directory resumes
from the latest checkpoint. The config is locked: a key that does not exist,
in the file or on the command line, is an error. How overrides are read
(lists as `0,42` or `snli,hans`, the last of a repeated field winning) is in
`oodjax.config_cli`; `--help` lists every field, its default and meaning.

On a cluster, start one such process per node (or per GPU) as launch/ does:
the processes find each other from SLURM, TPU-pod or OODJAX_* variables
(`oodjax.engine.distributed`) and train the same runs together on one mesh.

What it prints is described in `oodjax.engine.console`: the config it runs,
bars on a terminal, short plain lines in a log file, compilations announced
and timed, losses and a closing summary of every run's final accuracies
labelled by run.
"""

from oodjax.engine import preemption

if __name__ == "__main__":  # `python -m oodjax.main`, as the launchers start it (`run` for the oodjax-train command)
    preemption.hold_stop_signals()  # before the imports below, which take seconds: a warning then is noted

import os  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
from absl import logging  # noqa: E402
from ml_collections import config_dict  # noqa: E402

from oodjax import config_cli, storage  # noqa: E402
from oodjax.config_checks import check_config  # noqa: E402
from oodjax.config_read import Job  # noqa: E402
from oodjax.engine import distributed, loop, results  # noqa: E402
from oodjax.engine.setup import start_process  # noqa: E402


def main(config: config_dict.ConfigDict) -> None:
    """Trains `config` (the command line's, its overrides applied) on this process's share of the devices.

    A stop signal exits with ``preemption.PREEMPTED_EXIT_CODE`` (launch/slurm.sbatch
    requeues on it), or with 128 + the signal's number when it came before a step was trained;
    a full disk with one line naming the file, status 1, unless
    every run's results are complete already (the final checkpoint failed): then
    with a warning, status 0, as a rerun would have nothing to do. A collective
    that lost another host's process: one line naming the host and the step, status 1, at once.
    """
    start_process()
    job = check_config(config)
    try:
        loop.train(job)
    except preemption.Preempted as stopped:
        logging.warning("%s", stopped)
        if not stopped.trained:
            logging.warning(
                "no step was trained before %s: exit status %d, not %d, so that a scheduler does not requeue a job "
                "that cannot progress (a time-limit warning sooner than loading and compiling take: give the job "
                "more time, or its warning less lead)",
                stopped.signal_name,
                stopped.exit_code,
                preemption.PREEMPTED_EXIT_CODE,
            )
        sys.exit(stopped.exit_code)
    except jax.errors.JaxRuntimeError as error:
        host = distributed.lost_peer(error)
        if host is None:
            raise
        step = preemption.last_step()
        logging.error(
            "lost the process on %s %s (a collective's connection to it broke); this process stops too, its run "
            "locks released: rerun the same command (or the sweep) to resume from the last checkpoint",
            host,
            "before training" if step is None else f"at step {step}",
        )
        logging.flush()
        os._exit(distributed.LOST_PEER_EXIT_CODE)  # not JAX's shutdown at exit, which waits for the lost process
    except storage.NoSpaceError as full:
        if not _results_complete(job):
            logging.error("%s", full)
            sys.exit(1)
        logging.warning(
            "the disk filled up while writing %s, a final checkpoint; every run's results are complete (each "
            "metrics.npz holds its last step), so the job is done",
            full.path,
        )


def _results_complete(job: Job) -> bool:
    """Whether every run of ``job`` has its final evaluation in its metrics.npz (and, with export.peft, its
    adapter): all a finished run leaves, its checkpoints aside."""
    for group in job.groups:
        for run in group.runs:
            try:
                progress = results.read_progress(run.directory)
            except results.UnreadableResultsError:
                return False
            if progress is None or not progress.finished(group.total_steps):
                return False
            if job.export.peft and not (run.directory / results.ADAPTER_DIR).is_dir():
                return False
    return True


def run() -> None:
    """Entry point of `python -m oodjax.main` and the `oodjax-train` command; parses sys.argv."""
    preemption.hold_stop_signals()
    config_cli.run(main, __doc__)


if __name__ == "__main__":
    run()
