"""Real multi-controller runs: two processes on 127.0.0.1, 4 CPU devices each, gloo collectives.

The first test checks the runtime itself: each process contributes its own
rows to one global array over the 8 devices, and a jitted reduction sees all
of them. The second trains the demo config (shrunk on the command line) with
`python -m oodjax.main` in two processes, each feeding its own rows of every
training batch, and checks the metrics equal those of one process driving 8
devices with the same mesh: the same examples reach the same devices, so only
the order of float32 reductions may differ. The third signals one of two
processes stepping in lockstep and finds both stop at the same step, having
agreed only at the steps they wait for anyway.
"""

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from analysis import schema
from tests.engine_configs import SHRUNK_DEMO_ARGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

WORKER = textwrap.dedent("""
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from oodjax.engine import distributed, sharding
    layout = distributed.initialize()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rank = jax.process_index()
    local = np.arange(4, dtype=np.float32) + 4 * rank  # this process's rows of 0..7
    rows = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("data")), local)
    total = jax.jit(lambda x: (x.sum(), (x * x).sum()), out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
    print(layout.source, layout.num_processes, layout.process_id, jax.device_count(), jax.local_device_count(),
          rows.shape[0], float(total[0]), float(total[1]), distributed.is_primary(), flush=True)
    # A micro-batch of 8 rows: this process's positions in it.
    print(*sharding.process_batch_rows(sharding.make_mesh(8, 1, 1), 8), flush=True)
    jax.distributed.shutdown()
""")

# Two processes step in lockstep (each step needs both processes' devices), process 1 a little behind; every
# SYNC_EVERY-th step waits for its result, as the loop waits for a logged step's losses. Process 0 sends itself
# SIGTERM after step argv[1]. Each prints the step it stopped at (or that it ran to the end), the signal it
# received, and how many times the stop flag was all-gathered.
STOP_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    import jax, numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from oodjax.engine import distributed, preemption
    distributed.initialize()
    gathers = []
    def counted(*args, **kwargs):
        gathers.append(1)
        return all_gather(*args, **kwargs)
    all_gather, multihost_utils.process_allgather = multihost_utils.process_allgather, counted
    placed = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    step_fn = jax.jit(lambda x: x + x.sum(), out_shardings=placed)
    x = jax.make_array_from_process_local_data(placed, np.zeros(4, np.float32))
    signalled, sync_every, rank = int(sys.argv[1]), int(sys.argv[2]), jax.process_index()
    with preemption.StopSignals() as stop:
        for step in range(1, 41):
            x = step_fn(x)
            if rank == 0 and step == signalled:
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.02 * rank)
            synced = step % sync_every == 0
            if synced:
                jax.block_until_ready(x)
            if stop.agreed(synced=synced):
                print("stopped", step, stop.received, len(gathers), flush=True)
                break
        else:
            print("ran to the end", flush=True)
    jax.distributed.shutdown()
""")

# The demo shrunk to the shapes of test_main's end-to-end run, with a second bucket: at step 3
# one process's rows all fit 56 tokens and the other's need 64, so the processes must agree
# on the global batch's bucket.
DEMO_ARGS = (*SHRUNK_DEMO_ARGS, "--config.data.buckets=(56, 64)")
RUNS = ("opt-tiny-random_mnli_seed0_shots32", "opt-tiny-random_mnli_seed42_shots32")
# Gloo's all-reduce sums the 8 devices' partial results in another order than
# XLA's in-process reduction: float32 losses of ~10.7 then differ by a few ulps.
LOSS_ATOL = 1e-5
# metrics.npz stores margins as float16: float32 margins a few ulps apart may
# round to neighbouring float16 values (2**-10 apart relative; near zero, where
# float16 is subnormal, the float32 noise itself, as for the losses).
MARGIN_RTOL, MARGIN_ATOL = 2.0**-10, LOSS_ATOL


def assert_equal_but_for_reduction_order(one, two) -> None:
    """Two runs' metrics, one computed across processes: accuracies and labels equal, losses and margins within
    the float32 reduction-order bounds above."""
    np.testing.assert_array_equal(two[schema.ACCURACY], one[schema.ACCURACY])
    np.testing.assert_allclose(two[schema.TRAIN_LOSS], one[schema.TRAIN_LOSS], rtol=0, atol=LOSS_ATOL)
    for name in one[schema.TESTSETS]:
        np.testing.assert_array_equal(two[schema.label_key(name)], one[schema.label_key(name)])
        np.testing.assert_allclose(
            two[schema.margin_key(name)].astype(np.float32),
            one[schema.margin_key(name)].astype(np.float32),
            rtol=MARGIN_RTOL,
            atol=MARGIN_ATOL,
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_process_env() -> list[dict[str, str]]:
    """The environment of process 0 and 1: explicit layout, 4 CPU devices each, gloo."""
    base = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        OODJAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
        OODJAX_NUM_PROCESSES="2",
        PYTHONPATH=str(ROOT),
    )
    return [dict(base, OODJAX_PROCESS_ID=str(index)) for index in range(2)]


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process: subprocess.Popen, timeout: float = TIMEOUT_S) -> tuple[str, str]:
    """Waits for `process`; its (stdout, stderr), after asserting it succeeded."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr[-3000:]
    return stdout, stderr


def test_two_processes_share_one_eight_device_mesh():
    outputs = [finish(process)[0] for process in [start(["-c", WORKER], env) for env in two_process_env()]]
    outputs = [stdout.strip().splitlines()[-2:] for stdout in outputs]  # gloo prints its own lines first
    # sum(0..7) = 28, sum of squares = 140: every process sees both processes' rows.
    assert outputs[0][0].split() == ["explicit", "2", "0", "8", "4", "8", "28.0", "140.0", "True"]
    assert outputs[1][0].split() == ["explicit", "2", "1", "8", "4", "8", "28.0", "140.0", "False"]
    # Each process feeds its 4 devices' rows of each micro-batch, not every other row.
    assert outputs[0][1].split() == ["0", "1", "2", "3"]
    assert outputs[1][1].split() == ["4", "5", "6", "7"]


@pytest.mark.parametrize("pack", [False, True], ids=["one_prompt_a_row", "packed"])
def test_two_processes_train_the_demo_like_one(tmp_path, pack):
    def main_args(name: str) -> list[str]:
        return [
            "-m",
            "oodjax.main",
            *DEMO_ARGS,
            f"--config.train.pack={pack}",
            f"--config.output_dir={tmp_path / name}",
            f"--config.data.cache_dir={tmp_path / 'cache'}",
        ]

    one_env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    for name in ("OODJAX_COORDINATOR_ADDRESS", "OODJAX_NUM_PROCESSES", "OODJAX_PROCESS_ID"):
        one_env.pop(name, None)
    processes = [start(main_args("two"), env) for env in two_process_env()]
    reference = start(main_args("one"), one_env)
    logs = [finish(process)[1] for process in [*processes, reference]]
    # Process 0 logs the runs' progress; process 1 only its start.
    assert "step 4, opt-tiny-random_mnli_seed0_shots32: mnli" in logs[0]
    assert "process 1 of 2" in logs[1] and "step 4" not in logs[1]

    for run in RUNS:  # each run's own checkpoint: its state (both processes' shards) and its loop record
        checkpoint = tmp_path / "two" / run / "checkpoints" / "4"
        assert (checkpoint / "runs").is_dir() and (checkpoint / "loop" / "metadata").is_file()
    for run in RUNS:
        with (
            np.load(tmp_path / "one" / run / schema.METRICS_FILENAME) as one,
            np.load(tmp_path / "two" / run / schema.METRICS_FILENAME) as two,
        ):
            assert one[schema.STEP].tolist() == two[schema.STEP].tolist() == [0, 2, 4]
            assert_equal_but_for_reduction_order(one, two)
            margin_diff = max(
                np.abs(two[schema.margin_key(name)].astype(np.float32) - one[schema.margin_key(name)]).max()
                for name in one[schema.TESTSETS]
            )
            loss_diff = np.nanmax(np.abs(two[schema.TRAIN_LOSS] - one[schema.TRAIN_LOSS]))
            print(run, "max |train_loss diff|", loss_diff, "max |margin diff|", margin_diff)
        # Only process 0 writes the event log: one line per evaluation, not two.
        events = (tmp_path / "two" / run / "events.jsonl").read_text().splitlines()
        assert sum('"accuracy/' in line for line in events) == 3


def test_a_signal_to_one_process_stops_both_at_the_same_step_agreed_only_where_they_sync():
    """Process 0 is signalled after step 5 of steps that sync every 4th: both stop at step 8, the first step
    they wait for after it, having all-gathered the stop flag twice (steps 4 and 8), not after every step. A
    process that stopped alone would leave the other waiting in a step for ever (killed at the timeout)."""
    processes = [start(["-c", STOP_WORKER, "5", "4"], env) for env in two_process_env()]
    outputs = [finish(process, timeout=120)[0].strip().splitlines()[-1] for process in processes]
    assert outputs == ["stopped 8 SIGTERM 2", "stopped 8 None 2"]
