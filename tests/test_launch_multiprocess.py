"""A real multi-controller start: two processes on 127.0.0.1, 4 CPU devices each, gloo collectives.

Each process contributes its own rows to one global array over the 8
devices; a jitted reduction must see all of them, and only process 0 is
primary. (Training the demo config across two processes needs the engine to
place batches per process; see the launch report.)
"""

import os
import socket
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from oodjax.engine import distributed
    layout = distributed.initialize()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rank = jax.process_index()
    local = np.arange(4, dtype=np.float32) + 4 * rank  # this process's rows of 0..7
    rows = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("data")), local)
    total = jax.jit(lambda x: (x.sum(), (x * x).sum()), out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
    print(layout.source, layout.num_processes, layout.process_id, jax.device_count(), jax.local_device_count(),
          rows.shape[0], float(total[0]), float(total[1]), distributed.is_primary(), flush=True)
    jax.distributed.shutdown()
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_share_one_eight_device_mesh():
    port = free_port()
    base_env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
        OODJAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", OODJAX_NUM_PROCESSES="2", PYTHONPATH=ROOT,
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", WORKER], env=dict(base_env, OODJAX_PROCESS_ID=str(index)),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for index in range(2)
    ]
    outputs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=240)
        assert process.returncode == 0, stderr[-3000:]
        outputs.append(stdout.strip().splitlines()[-1].split())  # gloo prints its own lines first
    # sum(0..7) = 28, sum of squares = 140: every process sees both processes' rows.
    assert outputs[0] == ["explicit", "2", "0", "8", "4", "8", "28.0", "140.0", "True"]
    assert outputs[1] == ["explicit", "2", "1", "8", "4", "8", "28.0", "140.0", "False"]
