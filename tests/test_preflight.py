"""The preflight compiles a config's real steps on abstract inputs and reports memory, times and collectives.

The CLI on the demo writes the JSON report; OLMo-2 13B cut to 2 layers
compiles on 8 fake devices with an fsdp mesh (its config's is data parallel),
and a tensor-parallel variant too, without reading a weight; their train
steps' HLO gathers the sharded weights and all-reduces nothing larger than one
weight matrix (with fsdp alone, nothing of an activation's size: only the
adapters' gradients). The communication model counts a known HLO's
collectives as closed forms give them.
"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import pytest

from configs.models import architecture
from launch import compiled, costs, devices, estimate, hlo, preflight
from launch import prompts as launch_prompts
from launch.config_files import load_config
from oodjax.config_read import read
from oodjax.engine import run_data
from tests.engine_configs import SHRUNK_DEMO_ARGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEP_KEYS = {"compile_s", "lower_s", "memory_bytes", "collectives"}
DATA_FIGURES = (
    "train_real_token_share",
    "host_batch_ms",
    "eval_real_token_share",
    "eval_attention_waste",
    "replayed_steps",
)
MEMORY_KEYS = {"argument", "output", "temp", "total"}
OLMO13 = "allenai/OLMo-2-1124-13B"


def test_cli_on_the_demo_writes_every_key(tmp_path):
    out = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.preflight",
            *SHRUNK_DEMO_ARGS,
            "--devices=8",
            f"--json={out}",
            f"--hlo={tmp_path / 'hlo'}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(out.read_text())
    assert {
        "train",
        "eval",
        "estimate_bytes",
        "device_estimate_bytes",
        "train_step_flops",
        "estimate_step_s",
        "devices",
        "layers",
        "memory_limit",
        "interconnect",
        "eval_step_flops",
        "estimate_eval_step_s",
    } <= set(report)
    assert report["train_step_flops"] > 0 and report["estimate_step_s"] > 0
    assert report["eval_step_flops"] > 0 and report["estimate_eval_step_s"] > 0
    h100 = devices.DEVICES[preflight.ESTIMATE_DEVICE]
    assert report["interconnect"]["bytes_per_s"] == h100.interconnect_bytes_per_s
    assert report["devices"] == 8 and report["layers"] == 2 and report["estimate_bytes"] > 0
    assert 0 < report["train_real_token_share"] <= 1 and 0 < report["eval_real_token_share"] <= 1
    assert report["eval_attention_waste"] >= 1 and report["host_batch_ms"] > 0
    for step in ("train", "eval"):
        assert STEP_KEYS <= set(report[step])
        memory = report[step]["memory_bytes"]
        assert MEMORY_KEYS <= set(memory) and memory["total"] > 0
        assert memory["total"] == memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
        assert set(report[step]["collectives"]) == set(hlo.COLLECTIVES)
        assert all({"count", "max_bytes"} == set(c) for c in report[step]["collectives"].values())
        moved = report[step]["communication"]
        assert set(moved) == {"bytes", "by_op", "loops_without_trip_count", "seconds"}
        assert moved["bytes"] == sum(moved["by_op"].values()) and moved["loops_without_trip_count"] == 0
        assert moved["seconds"] == moved["bytes"] / report["interconnect"]["bytes_per_s"]
        assert (tmp_path / "hlo" / f"{step}_step.hlo.txt").is_file()


def olmo13(gpt2_tokenizer_dir, mesh=None):
    config = load_config(ROOT / "configs" / "olmo13_mnli.py")
    config.tokenizer = str(gpt2_tokenizer_dir)  # the checkpoint's own tokenizer is not available offline
    config.data.pool_split = "validation_mismatched"  # nor is MNLI's train split: the offline pool stands in
    if mesh is not None:
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
    return read(config)


@pytest.fixture(scope="module")
def fsdp_report(gpt2_tokenizer_dir):
    return preflight.preflight(olmo13(gpt2_tokenizer_dir, mesh=(1, -1, 1)), devices=8, layers=2)


@pytest.fixture(scope="module")
def tensor_report(gpt2_tokenizer_dir):
    return preflight.preflight(olmo13(gpt2_tokenizer_dir, mesh=(1, 4, 2)), devices=8, layers=2)


def test_olmo13_at_two_layers_compiles_on_an_fsdp_mesh(fsdp_report):
    assert fsdp_report.layers == 2 and fsdp_report.devices == 8
    geometry = fsdp_report.geometry
    # Packed: the config's one micro-batch is two rows per device holding prompts of all 9 runs.
    assert (geometry.runs, geometry.grad_accum, geometry.rows, geometry.packed) == (9, 1, 16, True)
    for step in (fsdp_report.train, fsdp_report.eval):
        assert step.memory_bytes.argument > 0
    print(preflight.describe(fsdp_report))


def test_olmo13_real_data_figures(fsdp_report):
    """The config's real streams and evaluation pool (GPT-2 tokens): training rows packed with prompts of all
    runs compute at least 80% prompt tokens (one prompt a row computed 31.8%: every micro-batch at the bucket
    of the longest of 72 rows; rows of one run each, 59.2%), the evaluation pool (HANS's short prompts at the
    hub's 30,000) at least 94% and at most twice
    the causal attention its prompts need (rows of 512 packed as full as possible: 99.2% and 8.8x), and one
    step's batches take a few milliseconds of host time at most (a shuffle per example took about 45)."""
    print({key: getattr(fsdp_report, key) for key in DATA_FIGURES})
    assert fsdp_report.train_real_token_share >= 0.80
    assert fsdp_report.eval_real_token_share >= 0.94 and fsdp_report.eval_attention_waste <= 2
    assert fsdp_report.host_batch_ms <= 10


def test_a_job_of_fewer_steps_than_the_replay_replays_its_own(tmp_path):
    """The replay draws no step the job does not take: its layout is made for the job's steps, and a later one
    need not fit it. The benchmark grid's 9 runs of 24 steps crashed the preflight at step 25 ("144 prompts of
    6634 tokens (longest 128) do not fit 54 rows of 128 tokens")."""
    from benchmarks import grid_config

    config = grid_config.get_config("full")
    config.data.cache_dir = str(tmp_path)
    report = preflight.preflight(read(config), devices=1, layers=1)
    assert report.replayed_steps == config.train.steps == 24
    assert "(24 steps of the runs' streams)" in preflight.describe(report)


def test_the_fit_is_tested_against_the_memory_jax_can_use(fsdp_report):
    """The fit is of the estimate device's memory times JAX's memory fraction (``launch.devices.usable_memory``),
    not the whole device. Compiled on that device's platform, each step's compiled total is judged; compiled on
    a CPU (2.5-3.4x a GPU's allocation, measured), the train step's estimate costed for a GPU is."""
    h100 = devices.DEVICES[preflight.ESTIMATE_DEVICE]
    usable, source = devices.usable_memory(h100)
    assert dataclasses.asdict(fsdp_report.memory_limit) == {
        "device": "h100",
        "device_bytes": 80_000_000_000,
        "usable_bytes": int(usable),
        "source": source,
    }
    assert fsdp_report.platform == "cpu"
    # the CPU keeps float32 copies of the bf16 weights it multiplies: the GPU's estimate is well below the CPU's
    assert 0 < fsdp_report.device_estimate_bytes < 0.8 * fsdp_report.estimate_bytes
    text = preflight.describe(fsdp_report)
    for name in ("train", "eval"):
        memory_line = text.split(f"{name} step:")[1].splitlines()[1]
        assert memory_line.endswith("as the cpu backend allocates it, not the H100 SXM (the fit is below)")
    device_estimate = fsdp_report.device_estimate_bytes
    assert (
        f"on the H100 SXM: the train step needs {device_estimate / 1e9:.2f} GB per device by the estimate for a GPU "
        f"(0.97-0.99x a GPU's compiled total where measured); {devices.fit_text(device_estimate, h100, usable, source)}"
    ) in text

    on_gpu = dataclasses.replace(fsdp_report, platform="gpu")
    text = preflight.describe(on_gpu)
    for name in ("train", "eval"):
        total = getattr(fsdp_report, name).memory_bytes.total
        assert f"; {devices.fit_text(total, h100, usable, source)}\n" in text.split(f"{name} step:")[1]
    assert "on the H100 SXM: the train step needs" not in text  # the full model's line (a cut compile) stays
    # 75 GB on an H100 at the launcher's default fraction (0.9) does not fit, though 80 GB would hold it: compiled
    # on a GPU, or estimated for one from a CPU's compile.
    default_limit = dataclasses.replace(
        fsdp_report.memory_limit,
        usable_bytes=int(devices.usable_memory(h100, {})[0]),
        source=devices.memory_fraction({})[1],
    )
    over_on_gpu = dataclasses.replace(
        on_gpu,
        memory_limit=default_limit,
        train=dataclasses.replace(
            on_gpu.train, memory_bytes=dataclasses.replace(on_gpu.train.memory_bytes, total=75_000_000_000)
        ),
    )
    over_on_cpu = dataclasses.replace(fsdp_report, memory_limit=default_limit, device_estimate_bytes=75_000_000_000)
    refused = (
        "DOES NOT FIT in 72 GB of the H100 SXM's 80 GB (XLA_CLIENT_MEM_FRACTION=0.9, launch/slurm.sbatch's default)"
    )
    assert f"total 75.00; {refused}" in preflight.describe(over_on_gpu)
    assert (
        f"75.00 GB per device by the estimate for a GPU (0.97-0.99x a GPU's compiled total where measured); {refused}"
        in (preflight.describe(over_on_cpu))
    )


def _weight_matrix_bytes() -> int:
    """One bf16 MLP projection of OLMo-2 13B (hidden x intermediate), its largest per-layer weight."""
    arch = architecture(OLMO13)
    return arch["hidden_size"] * arch["intermediate_size"] * 2


def test_fsdp_train_step_gathers_weights_and_all_reduces_only_adapter_gradients(fsdp_report):
    found = fsdp_report.train.collectives
    assert found["all-gather"]["count"] > 0
    # Each of the step's micro-batches gathers every layer's weights at least once (7/8 of them come from the
    # other devices; bf16 or wider), which the communication model counts through the micro-batch and layer loops.
    layer_weights = costs.dimensions(architecture(OLMO13)).layer_matmul_parameters * fsdp_report.layers
    gathered = fsdp_report.train.communication.by_op["all-gather"]
    assert gathered >= fsdp_report.geometry.grad_accum * layer_weights * 2 * 7 / 8
    # One layer's activations on one device: its row of the micro-batch x 5120 (bf16).
    geometry = fsdp_report.geometry
    activation = geometry.rows // 8 * geometry.seq_len * 5120 * 2
    assert found["all-reduce"]["max_bytes"] < min(activation, _weight_matrix_bytes()), found


def test_tensor_parallel_train_step_all_reduces_nothing_larger_than_a_weight_matrix(tensor_report):
    found = tensor_report.train.collectives
    assert found["all-gather"]["count"] > 0
    assert found["all-reduce"]["max_bytes"] <= _weight_matrix_bytes(), found


def test_collectives_are_read_from_hlo_text():
    text = """
  %p = bf16[4,8]{1,0} parameter(0)
  %ag = bf16[32,8]{1,0} all-gather(%p), dimensions={0}
  %x = f32[16]{0} fusion(%p), kind=kLoop
  %ar = (f32[16]{0}, bf16[4,8]{1,0}) all-reduce(%x, %p), to_apply=%sum
  %ars = f32[2,3]{1,0} all-reduce-start(f32[2,3]{1,0} %y), to_apply=%sum
  %ard = f32[2,3]{1,0} all-reduce-done(%ars)
  ROOT %t = (f32[16]{0}) get-tuple-element(%ar), index=0
"""
    found = hlo.collectives(text)
    assert found["all-gather"] == {"count": 1, "max_bytes": 64}
    assert found["all-reduce"] == {"count": 2, "max_bytes": 64}
    assert found["reduce-scatter"] == {"count": 0, "max_bytes": 0}


# A module of 8 partitions exercising each collective, group notation and control flow the communication model
# reads: an all-gather in a loop of 5 trips, a conditional of two branches, a loop without a trip count, and an
# all-reduce wrapped in an async start and done (both name its computation).
KNOWN_HLO = """HloModule jit_step, is_scheduled=true, num_partitions=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %shard = f32[64]{0} get-tuple-element(%p), index=1
  %gathered = f32[256]{0} all-gather(%shard), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %back = f32[64]{0} slice(%gathered), slice={[0:64]}
  ROOT %next = (s32[], f32[64]{0}) tuple(%i, %back)
}

%cond (p.1: (s32[], f32[64])) -> pred[] {
  %p.1 = (s32[], f32[64]{0}) parameter(0)
  ROOT %go = pred[] constant(true)
}

%small (s: f32[16]) -> f32[16] {
  %s = f32[16]{0} parameter(0)
  ROOT %small_sum = f32[16]{0} all-reduce(%s), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
}

%large (l: f32[1024]) -> f32[1024] {
  %l = f32[1024]{0} parameter(0)
  ROOT %large_sum = f32[1024]{0} all-reduce-start(%l), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%sum
}

%wrapped (w: f32[32]) -> f32[32] {
  %w = f32[32]{0} parameter(0)
  ROOT %w_sum = f32[32]{0} all-reduce(%w), channel_id=7, replica_groups=[4,2]<=[8], to_apply=%sum
}

%loose (p.2: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p.2 = (s32[], f32[64]{0}) parameter(0)
  %j = s32[] get-tuple-element(%p.2), index=0
  %q = f32[64]{0} get-tuple-element(%p.2), index=1
  %moved = f32[64]{0} collective-permute(%q), channel_id=4, source_target_pairs={{0,1},{1,0}}
  ROOT %out = (s32[], f32[64]{0}) tuple(%j, %moved)
}

ENTRY %main (init: (s32[], f32[64]), which: s32[], s: f32[16], l: f32[1024], y: f32[64], h: bf16[8], t: f32[32]) -> f32[8] {
  %init = (s32[], f32[64]{0}) parameter(0)
  %which = s32[] parameter(1)
  %s = f32[16]{0} parameter(2)
  %l = f32[1024]{0} parameter(3)
  %y = f32[64]{0} parameter(4)
  %h = bf16[8]{0} parameter(5)
  %t = f32[32]{0} parameter(6)
  %start = ((f32[32]{0}), f32[32]{0}) async-start(%t), calls=%wrapped
  %done = f32[32]{0} async-done(%start), calls=%wrapped
  %loop = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %unknown = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%loose
  %branch = f32[16]{0} conditional(%which, %s, %l), branch_computations={%small, %large}
  %exchanged = (bf16[8]{0}, bf16[8]{0}) all-to-all(%h, %h), channel_id=5, replica_groups=mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'y'}
  ROOT %scattered = f32[8]{0} reduce-scatter(%y), channel_id=6, replica_groups={}, dimensions={0}, to_apply=%sum
}
"""


def test_communication_counts_each_collective_as_a_ring_moves_it_as_often_as_it_runs():
    """Closed forms per device: an all-gather of 64 f32 shards in groups of 4 moves 3 shards (768 B), 5 trips;
    of the conditional's branches the larger all-reduce (1024 f32 in pairs: 2 x 1/2 x 4096 B); the async one
    once (32 f32 in pairs: 2 x 1/2 x 128 B); the loop without a trip count once (its permute, 256 B); an
    all-to-all of two bf16[8] over the mesh axis of 4 (3/4 x 32 B); a reduce-scatter of 64 f32 over all 8
    partitions (7/8 x 256 B)."""
    moved = hlo.communication(KNOWN_HLO)
    expected = {
        "all-gather": 5 * 3 * 64 * 4,
        "all-reduce": 4096 + 128,
        "collective-permute": 64 * 4,
        "all-to-all": 24,
        "reduce-scatter": 224,
    }
    assert moved["by_op"] == expected
    assert moved["bytes"] == sum(expected.values())
    assert moved["loops_without_trip_count"] == 1
    # The instructions as written: the loop's all-gather once, both branches' all-reduces.
    assert {op: c["count"] for op, c in hlo.collectives(KNOWN_HLO).items()} == {
        "all-gather": 1,
        "all-reduce": 3,
        "reduce-scatter": 1,
        "all-to-all": 1,
        "collective-permute": 1,
    }


@pytest.fixture(scope="module")
def demo_job():
    """The demo shrunk as SHRUNK_DEMO_ARGS shrinks it: a tiny 2-layer OPT, data parallel over every device."""
    config = load_config(ROOT / "configs" / "demo.py")
    config.data.testsets, config.data.eval_cap = ("mnli", "hans", "rte"), 16
    config.data.max_length, config.data.buckets = 64, (64,)
    config.train.steps, config.train.warmup_steps, config.eval.every, config.eval.batch_size = 4, 1, 2, 8
    return read(config)


def test_a_cut_models_verdict_names_the_full_models_estimate(demo_job, fsdp_report):
    """`--layers 2` on OLMo2-32B said "needs 3.49 GB per device ... fits", the 2-layer cut's figure; the full
    model's is 44.55 GB. A cut compile says the full model's estimate too: the one a compile at full depth gives."""
    cut = preflight.preflight(demo_job, devices=8, layers=1)
    whole = preflight.preflight(demo_job, devices=8)
    assert whole.full_model is None and "the full model" not in preflight.describe(whole)
    assert dataclasses.asdict(cut.full_model) == {"layers": 2, "device_estimate_bytes": whole.device_estimate_bytes}
    assert cut.device_estimate_bytes < whole.device_estimate_bytes

    full = fsdp_report.full_model
    assert full.layers == 40 and full.device_estimate_bytes > 5 * fsdp_report.device_estimate_bytes
    h100 = devices.DEVICES[preflight.ESTIMATE_DEVICE]
    usable, source = devices.usable_memory(h100)
    assert (
        f"the full model, 40 layers (this compile 2): the train step needs {full.device_estimate_bytes / 1e9:.2f} "
        f"GB per device by the estimate for a GPU; {devices.fit_text(full.device_estimate_bytes, h100, usable, source)}"
    ) in preflight.describe(fsdp_report)


def test_data_parallel_over_two_nodes_is_warned_of_where_one_node_is_faster(demo_job, gpt2_tokenizer_dir):
    """The demo over 2 nodes of 4 devices: its tiny steps' compute is far less than their collectives over the
    network between nodes, so one node, over NVLink, is faster: a warning. A step whose compute outweighs its
    communication is faster over nodes: no warning; an fsdp mesh is not compared; one node, nothing said."""
    report = preflight.preflight(demo_job, devices=8, node_devices=4)
    h100 = devices.DEVICES[preflight.ESTIMATE_DEVICE]
    nodes = report.nodes
    assert {key: getattr(nodes, key) for key in ("count", "devices_per_node", "data_parallel")} == {
        "count": 2,
        "devices_per_node": 4,
        "data_parallel": True,
    }
    train, evaluation = (step.communication.bytes for step in (report.train, report.eval))
    assert train > 0
    # 4 train steps; evaluations at steps 2 and 4 and at step 0 (each example once for all runs), computing what
    # the estimate prices for the same prompts, each batch moving what the largest one's collectives move.
    counted = launch_prompts.PromptCounter()(demo_job, demo_job.mesh.sizes(8))
    priced = estimate.estimate("demo", demo_job, counted, estimate.Target(8, h100, 0.4))
    data = compiled.abstract_steps(demo_job, devices=jax.devices()[:8], layers=None).data
    speed = 8 * h100.peak_flops * 0.4
    parts = [
        (4, report.estimate_step_s, train),
        (2, priced.eval_flops / speed, evaluation * len(data.eval_pool.batches)),
        (1, priced.first_eval_flops / speed, evaluation * len(data.first_eval_pool.batches)),
    ]
    over = sum(n * (compute + moved / 50e9) for n, compute, moved in parts)
    one = sum(n * (2 * compute + moved / 450e9) for n, compute, moved in parts)
    assert nodes.job_s == pytest.approx({"over_nodes": over, "one_node": one}) and over > one
    text = preflight.describe(report)
    assert "WARNING: data parallel over 8 devices on 2 nodes of 4 is slower than one node: " in text
    assert "over InfiniBand NDR at 50 GB/s a device" in text and text.count("WARNING") == 1

    # 100 steps of one second of compute and 1 GB of collectives: 0.5 s + 0.02 s over 2 nodes against 1 s + 2 ms.
    steps = [(100, 0.5, 10**9)]
    faster = preflight.over_nodes(demo_job, h100, 16, 8, steps)
    assert faster.job_s == pytest.approx({"over_nodes": 100 * 0.52, "one_node": 100 * (1 + 1e9 / 450e9)})
    assert "WARNING" not in preflight._nodes_text(dataclasses.replace(report, devices=16, nodes=faster))
    fsdp = olmo13(gpt2_tokenizer_dir, mesh=(1, -1, 1))
    assert preflight.over_nodes(fsdp, h100, 16, 8, steps).data_parallel is False
    assert preflight.over_nodes(demo_job, h100, 8, 8, steps) is None
    tpu = devices.DEVICES["v5p"]
    assert preflight.over_nodes(demo_job, tpu, 16, tpu.node_devices, steps) is None


def test_the_preflight_evaluates_a_local_sample_at_the_hub_splits_size():
    """The shared HANS is 3,000 rows of the hub's 30,000: the pool the preflight replays and counts evaluation
    batches by holds every run's 30,000 HANS prompts, as a job reading the hub's split does (beside the in-domain
    MNLI's)."""
    config = load_config(ROOT / "configs" / "demo.py")
    config.data.testsets, config.data.eval_cap = ("mnli", "hans"), 0
    job = read(config)
    pool = compiled.abstract_steps(job, devices=jax.devices()[:8], layers=None).data.eval_pool
    runs, mnli = job.runs.runs(), len(run_data.capped_testsets(job.data)["mnli"])
    assert sum(int(batch["valid"].sum()) for batch in pool.batches) == len(runs) * (30_000 + mnli) + sum(
        run.shots for run in runs
    )


def test_a_sites_own_network_between_nodes_is_what_the_comparison_uses(demo_job, tmp_path):
    """`--network_gb_s`: on a network 20,000 times NVLink's the demo over 2 nodes of 4 is faster than on one node
    (no warning), where on the H100 table's InfiniBand it is slower; a rate that is not positive is one line."""
    report = preflight.preflight(demo_job, devices=8, node_devices=4, network_gb_s=9e6)
    nodes = report.nodes
    assert nodes.network_bytes_per_s == 9e15 and nodes.network == "the network given"
    assert nodes.job_s["over_nodes"] < nodes.job_s["one_node"]
    assert "WARNING" not in preflight.describe(report)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.preflight",
            *SHRUNK_DEMO_ARGS,
            "--devices=8",
            "--node_devices=4",
            "--network_gb_s=0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert "Traceback" not in result.stderr
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
        "--network_gb_s must be > 0, got 0.0"
    )
