"""Process layout detection for multi-host runs: SLURM, TPU pods and explicit values, set here in the environment."""

import os
import pathlib
import shutil
import socket
import subprocess
import sys

import jax
import pytest

from launch import sweep
from oodjax.engine import distributed
from oodjax.engine.distributed import LayoutError, ProcessLayout, detect_layout, expand_nodelist, parse_nodelist


def slurm_env(**changes):
    """Task 11 of a 2-node job with 8 tasks per node (node 1, local task 3)."""
    env = dict(
        SLURM_JOB_ID="4242",
        SLURM_STEP_NODELIST="gpu[07-08]",
        SLURM_JOB_NODELIST="gpu[07-08]",
        SLURM_NTASKS="16",
        SLURM_PROCID="11",
        SLURM_LOCALID="3",
        SLURM_NODEID="1",
        SLURM_STEP_TASKS_PER_NODE="8(x2)",
        SLURM_GPUS_ON_NODE="8",
    )
    env.update(changes)
    return {key: value for key, value in env.items() if value is not None}


def test_slurm_one_process_per_gpu():
    layout = detect_layout(slurm_env(), processes_per="per_device")
    # Port: 61440 + 4242 % 4096 = 61586; coordinator is the first host of the step.
    assert layout == ProcessLayout("gpu07:61586", 16, 11, (3,), "slurm")


def test_slurm_per_device_when_slurm_binds_one_gpu_per_task():
    layout = detect_layout(slurm_env(CUDA_VISIBLE_DEVICES="3"), processes_per="per_device")
    assert layout.local_device_ids is None  # the single visible GPU is this task's


def test_slurm_one_process_per_node_sees_all_gpus():
    env = slurm_env(SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="1(x2)")
    layout = detect_layout(env, processes_per="per_node")
    assert layout == ProcessLayout("gpu07:61586", 2, 1, None, "slurm")


def test_slurm_choice_read_from_environment_variable():
    layout = detect_layout(slurm_env(OODJAX_PROCESSES_PER="per_device"))
    assert layout.local_device_ids == (3,)


def test_slurm_without_a_stated_choice_is_an_error():
    with pytest.raises(LayoutError, match="set OODJAX_PROCESSES_PER"):
        detect_layout(slurm_env())


def test_slurm_per_node_with_several_tasks_on_the_node_is_an_error():
    with pytest.raises(LayoutError, match="started 8 tasks on this node"):
        detect_layout(slurm_env(), processes_per="per_node")


def test_slurm_per_device_with_one_task_per_node_of_8_gpus_is_an_error():
    # The silent trap of JAX's own detection: one task per node would use GPU 0 only.
    env = slurm_env(SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="1(x2)")
    with pytest.raises(LayoutError, match="1 task\\(s\\) for 8 visible GPUs"):
        detect_layout(env, processes_per="per_device")


def test_slurm_single_task_starts_nothing():
    env = slurm_env(SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="1")
    assert detect_layout(env) is None


# The last of 5 tasks placed 2, 2 and 1 on three nodes.
UNEVEN_TASKS = dict(
    SLURM_NTASKS="5",
    SLURM_PROCID="4",
    SLURM_NODEID="2",
    SLURM_STEP_TASKS_PER_NODE="2(x2),1",
    SLURM_STEP_NODELIST="a[1-3]",
    SLURM_GPUS_ON_NODE=None,
)


def test_slurm_uneven_task_counts_are_read_per_node():
    env = slurm_env(**UNEVEN_TASKS)
    assert detect_layout(env, processes_per="per_node").coordinator_address == "a1:61586"


def test_slurm_falls_back_to_job_nodelist_and_job_tasks_per_node():
    env = slurm_env(SLURM_STEP_NODELIST=None, SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE="8(x2)")
    assert detect_layout(env, processes_per="per_device").coordinator_address == "gpu07:61586"


def test_slurm_procid_outside_the_job_is_an_error():
    with pytest.raises(LayoutError, match="SLURM_PROCID=16 is outside 0..15"):
        detect_layout(slurm_env(SLURM_PROCID="16"), processes_per="per_device")


def test_tpu_pod_from_worker_variables():
    env = {"TPU_WORKER_HOSTNAMES": "t1v-n-0,t1v-n-1,t1v-n-2,t1v-n-3", "TPU_WORKER_ID": "2"}
    assert detect_layout(env) == ProcessLayout("t1v-n-0:8476", 4, 2, None, "tpu")
    assert detect_layout(env, processes_per="per_node").process_id == 2


def test_tpu_pod_per_device_is_an_error():
    env = {"TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "0"}
    with pytest.raises(LayoutError, match="one process per host"):
        detect_layout(env, processes_per="per_device")


def test_tpu_worker_id_missing_is_an_error():
    with pytest.raises(LayoutError, match="TPU_WORKER_ID is not set"):
        detect_layout({"TPU_WORKER_HOSTNAMES": "h0,h1"})


def test_explicit_values_win_over_slurm():
    env = slurm_env(OODJAX_COORDINATOR_ADDRESS="10.0.0.1:1234", OODJAX_NUM_PROCESSES="2", OODJAX_PROCESS_ID="1")
    assert detect_layout(env) == ProcessLayout("10.0.0.1:1234", 2, 1, None, "explicit")
    layout = detect_layout({}, coordinator_address="127.0.0.1:5000", num_processes=3, process_id=0)
    assert layout == ProcessLayout("127.0.0.1:5000", 3, 0, None, "explicit")


@pytest.mark.parametrize(
    "env, message",
    [
        ({"OODJAX_COORDINATOR_ADDRESS": "h:1", "OODJAX_NUM_PROCESSES": "2"}, "missing \\['OODJAX_PROCESS_ID'\\]"),
        ({"OODJAX_COORDINATOR_ADDRESS": "h", "OODJAX_NUM_PROCESSES": "2", "OODJAX_PROCESS_ID": "0"}, "host:port"),
        (
            {"OODJAX_COORDINATOR_ADDRESS": "h:1", "OODJAX_NUM_PROCESSES": "two", "OODJAX_PROCESS_ID": "0"},
            "OODJAX_NUM_PROCESSES must be an integer",
        ),
        (
            {"OODJAX_COORDINATOR_ADDRESS": "h:1", "OODJAX_NUM_PROCESSES": "2", "OODJAX_PROCESS_ID": "2"},
            "OODJAX_PROCESS_ID=2 is outside 0..1",
        ),
        ({"OODJAX_PROCESSES_PER": "per_gpu"}, "must be one of"),
    ],
)
def test_bad_explicit_values_are_errors(env, message):
    with pytest.raises(LayoutError, match=message):
        detect_layout(env)


def test_no_cluster_means_a_single_process():
    assert detect_layout({}) is None


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node001", ["node001"]),
        ("node001,host2", ["node001", "host2"]),
        ("gpu[01-03,07],login2", ["gpu01", "gpu02", "gpu03", "gpu07", "login2"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),  # a suffix after the brackets
        ("r[1-2]n[01,03]", ["r1n01", "r1n03", "r2n01", "r2n03"]),
        ("a[1]-ib,b", ["a1-ib", "b"]),
    ],
)
def test_nodelist_expansion(nodelist, hosts, monkeypatch):
    assert parse_nodelist(nodelist) == hosts
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the parser's answer
    assert expand_nodelist(nodelist) == hosts
    if _scontrol:  # the scheduler's own answer, where it is installed, agrees
        monkeypatch.setenv("PATH", str(pathlib.Path(_scontrol).parent))
        assert expand_nodelist(nodelist) == hosts


_scontrol = shutil.which("scontrol")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_host_list_is_the_schedulers_where_scontrol_answers(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && printf "%s\\n" first-ib second-ib\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert expand_nodelist("anything[1-2]") == ["first-ib", "second-ib"]


@pytest.mark.parametrize("nodelist", ["gpu[a-c]", "gpu[1-2", "gpu]1["])
def test_unparseable_nodelist_is_an_error(nodelist):
    with pytest.raises(LayoutError, match="cannot parse SLURM node list"):
        parse_nodelist(nodelist)


def test_jax_is_started_without_its_own_sigterm_handler(monkeypatch):
    """JAX's preemption service (on by default) would take SIGTERM before the loop's handlers exist, and
    swallow it."""
    started = {}
    monkeypatch.setattr(
        jax.distributed,
        "initialize",
        lambda **arguments: started.update(arguments, service=jax.config.jax_enable_preemption_service),
    )
    before = jax.config.jax_enable_preemption_service
    jax.config.update("jax_enable_preemption_service", True)
    try:
        distributed.initialize({}, coordinator_address="127.0.0.1:5000", num_processes=2, process_id=1)
    finally:
        jax.config.update("jax_enable_preemption_service", before)
    assert started["num_processes"] == 2 and started["service"] is False


def two_hosts(**changes):
    """Task 0 of a 2-node job, one task per node."""
    return slurm_env(
        SLURM_NTASKS="2",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
        SLURM_GPUS_ON_NODE=None,
        **changes,
    )


def resolving(monkeypatch, name, address):
    monkeypatch.setattr(distributed.socket, "gethostname", lambda: name)
    monkeypatch.setattr(distributed.socket, "gethostbyname", lambda host: {name: address}[host])


def test_a_host_name_resolving_to_loopback_stops_a_cpu_job_across_hosts_before_jax_starts(monkeypatch):
    """Debian maps the host name to 127.0.1.1: gloo would give the other node that address (issue 49)."""
    resolving(monkeypatch, "gpu07", "127.0.1.1")
    started = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **arguments: started.append(arguments))
    with pytest.raises(LayoutError) as raised:
        distributed.initialize(two_hosts(JAX_PLATFORMS="cpu"), processes_per="per_node")
    assert str(raised.value) == (
        "this host's name gpu07 resolves to 127.0.1.1, a loopback address: JAX's CPU collectives (gloo) would "
        "give the other hosts of the job that address; map gpu07 to the address they reach it at in /etc/hosts "
        "(Debian maps the host name to 127.0.1.1) or DNS"
    )
    assert started == []


def test_a_loopback_host_name_is_left_alone_on_one_host_or_off_the_cpu(monkeypatch):
    resolving(monkeypatch, "gpu07", "127.0.1.1")
    one_host = ProcessLayout("127.0.0.1:5000", 2, 0, None, "explicit")
    distributed.check_host_address(one_host, "cpu")  # two processes of one host reach each other at loopback
    across = detect_layout(two_hosts(), processes_per="per_node")
    assert across.hosts == ("gpu07", "gpu08")
    distributed.check_host_address(across, "cuda")  # NCCL chooses its own interfaces
    resolving(monkeypatch, "gpu07", "10.1.2.7")
    distributed.check_host_address(across, "cpu")


def test_each_process_is_placed_on_its_host_in_slurms_block_order():
    env = slurm_env(**UNEVEN_TASKS, SLURM_LOCALID="0")
    assert detect_layout(env, processes_per="per_device").hosts == ("a1", "a1", "a2", "a2", "a3")


def test_a_coordinator_not_reached_ends_the_process_with_one_line_naming_it_and_the_time_waited(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        OODJAX_COORDINATOR_ADDRESS=address,
        OODJAX_NUM_PROCESSES="2",
        OODJAX_PROCESS_ID="1",
        OODJAX_COORDINATOR_TIMEOUT="2",
    )
    command = [sys.executable, "-m", "oodjax.main", "--config=configs/demo.py", f"--config.output_dir={tmp_path}"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"oodjax: error: process 1 of 2 waited 2 s for the JAX coordinator at {address} and the other processes: "
        "check that process 0 runs on 127.0.0.1, that this host reaches that address and port, or raise "
        "OODJAX_COORDINATOR_TIMEOUT"
    )
    assert "Traceback" not in done.stderr and "Fatal" not in done.stderr, done.stderr[-3000:]


def test_a_collective_that_lost_its_peer_names_the_peers_host(monkeypatch):
    monkeypatch.setattr(distributed.socket, "gethostbyaddr", lambda address: ("oodjax-n2", [], [address]))
    error = RuntimeError(
        "UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
        "[10.213.0.12]:59552: Connection reset by peer"
    )
    assert distributed.lost_peer(error) == "oodjax-n2 (10.213.0.12)"
    assert distributed.lost_peer(RuntimeError("RESOURCE_EXHAUSTED: out of memory")) is None


def test_a_multi_node_sweep_names_the_stops_it_cannot_survive_before_it_submits(capsys, tmp_path):
    arguments = ["--configs", "configs/demo.py", "--backend", "slurm", "--output_dir", str(tmp_path), "--dry_run"]
    assert sweep.main([*arguments, "--nodes", "2", "--sbatch_arg=--signal=TERM@60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "# 2 nodes: srun answers SIGTERM with SIGKILL, so --signal=TERM@60 and `scancel --signal=TERM --full JOB` "
        "stop these jobs without a checkpoint; `scancel --signal=TERM --batch JOB` (or USR1, which requeues) and "
        "--signal=B:USR1@SECONDS checkpoint"
    )
    assert lines[1].startswith("# sbatch ") and lines[2].startswith("sbatch ")
    assert "--signal=B:TERM@60" not in sweep.multi_node_stop_note(2, ["--signal=B:TERM@60"])
    assert sweep.main([*arguments]) == 0
    assert not any(line.startswith("# 1 nodes") or "SIGKILL" in line for line in capsys.readouterr().out.splitlines())
