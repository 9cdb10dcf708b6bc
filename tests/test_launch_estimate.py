"""The cost estimator: exact parameter counts against transformers' models, published counts, closed-form FLOPs,
per-device weight shards against real placement, saved activations against the VJP's own residuals, and the
memory total against the compiler's."""

import dataclasses
import functools
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import peft
import pyarrow
import pyarrow.json
import pyarrow.parquet
import pytest
import torch
import transformers
from flax import nnx

from configs.models import MODELS
from launch import compiled, costs, devices, estimate
from launch import prompts as launch_prompts
from launch.config_files import load_config
from oodjax import models, usage_errors
from oodjax.config_read import read
from oodjax.data import EVAL_KEYS, TRAIN_KEYS
from oodjax.engine import run_data, sharding, steps
from oodjax.engine.cadence import Cadence
from oodjax.engine.geometry import BatchGeometry, batch_geometry
from oodjax.engine.sharding import MeshShape
from oodjax.models.layers import REMAT_POLICIES
from oodjax.models.lora import LoRAConfig, apply_lora

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The demo (a tiny random OPT, the GPT-2 tokenizer, the shared testsets) cut to two capped testsets and two runs.
SMALL_CONFIG = """from configs import demo

def get_config():
    config = demo.get_config()
    config.data.testsets = ("mnli", "rte")
    config.data.eval_cap = 60
    config.runs.shots = (16,)
    config.train.steps = 10
    config.eval.every = 5
{extra}    return config
"""

TINY_ARCHITECTURES = {
    "opt": dict(
        model_type="opt",
        vocab_size=97,
        hidden_size=16,
        word_embed_proj_dim=16,
        ffn_dim=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
    ),
    # OPT-350m's layout: embeddings narrower than the layers, with projections in and out.
    "opt-projected": dict(
        model_type="opt",
        vocab_size=97,
        hidden_size=16,
        word_embed_proj_dim=8,
        ffn_dim=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        do_layer_norm_before=False,
    ),
    "opt-no-bias": dict(
        model_type="opt",
        vocab_size=97,
        hidden_size=16,
        word_embed_proj_dim=16,
        ffn_dim=40,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=32,
        enable_bias=False,
    ),
    "olmo2-gqa": dict(
        model_type="olmo2",
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "smollm3-tied": dict(
        model_type="smollm3",
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=0,
    ),
    "llama-biases": dict(
        model_type="llama",
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    ),
    "mistral": dict(
        model_type="mistral",
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        tie_word_embeddings=False,
    ),
    "gemma2": dict(
        model_type="gemma2",
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    ),
    "phi3": dict(
        model_type="phi3",
        vocab_size=101,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        pad_token_id=0,
    ),
}


def torch_model(architecture, device="cpu"):
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(costs.full_config(architecture))


@pytest.mark.parametrize("name", sorted(TINY_ARCHITECTURES))
def test_parameter_count_equals_tiny_transformers_model(name):
    model = torch_model(TINY_ARCHITECTURES[name])
    assert costs.parameter_count(TINY_ARCHITECTURES[name]) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model", sorted(MODELS))
def test_parameter_count_of_listed_checkpoints(model):
    architecture, hub_id = MODELS[model].architecture, MODELS[model].hub_id
    count = costs.parameter_count(architecture)
    # The real architecture built by transformers without allocating its weights.
    reference = torch_model(architecture, device="meta")
    assert count == sum(p.numel() for p in reference.parameters())
    published = MODELS[model].published_parameters
    assert abs(count / published - 1) < 0.02, (hub_id, count, published)


@pytest.mark.parametrize("name", ["opt", "olmo2-gqa", "smollm3-tied", "gemma2", "phi3"])
def test_lora_parameter_count_equals_peft(name):
    architecture = TINY_ARCHITECTURES[name]
    attention = {"opt": ["q_proj", "k_proj", "v_proj", "out_proj"], "phi3": ["qkv_proj", "o_proj"]}
    targets = attention.get(name, ["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(torch_model(architecture), peft.LoraConfig(r=4, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert costs.lora_parameter_count(architecture, 4) == trainable  # default targets: attention projections
    assert costs.lora_parameter_count(architecture, 4, targets) == trainable
    mlp = {"opt": ["fc1"], "phi3": ["gate_up_proj"]}.get(name, ["up_proj"])
    peft_mlp = peft.get_peft_model(torch_model(architecture), peft.LoraConfig(r=4, target_modules=mlp))
    assert costs.lora_parameter_count(architecture, 4, mlp) == sum(
        p.numel() for p in peft_mlp.parameters() if p.requires_grad
    )


def test_unknown_lora_target_is_an_error():
    with pytest.raises(ValueError, match="LoRA targets \\['qkv'\\] match no linear layer"):
        costs.lora_parameter_count(TINY_ARCHITECTURES["opt"], 8, ["qkv"])


def test_forward_flops_closed_form():
    # OPT, H=16, F=40, 2 layers, sequence 32: per layer 4*16*16 + 2*16*40 = 2304 weights;
    # per token 2*2*2304 matmul FLOPs + 4*2*32*16 attention FLOPs = 9216 + 4096.
    dims = costs.dimensions(TINY_ARCHITECTURES["opt"])
    assert costs.forward_flops(dims, tokens=1, attention_pairs=32).total == 13312

    # Train step, 6 rows of 32 tokens holding 2 runs x 3 prompts, no adapters, no remat: 3 x matmuls
    # + 3 x attention per token, and 2*H*V*2 per prompt for the head.
    def step(remat, runs=2, lora_parameters=0):
        return costs.train_step_flops(
            dims, runs=runs, rows=6, seq_len=32, prompts=6, lora_parameters=lora_parameters, remat=remat
        )

    assert step("none") == 6 * 32 * (2 * 9216 + 3 * 4096) + 6 * 4 * 16 * 97
    # What each policy recomputes, per token: the whole forward; the attention scores and their
    # product with the values (4 * 32 * 16 per layer); those and the MLP (2 * 2 * 16 * 40 per layer).
    assert step("full") - step("none") == 6 * 32 * 13312
    assert step("save_dots") - step("none") == 6 * 32 * 2 * 4 * 32 * 16
    assert step("save_dots_except_mlp") - step("save_dots") == 6 * 32 * 2 * 2 * 2 * 16 * 40
    # Every token goes through all runs' adapters (runs x rank columns): 2 FLOPs per adapter weight and run
    # forward, twice that backward, and the forward again, recomputed in the backward pass.
    assert step("none", runs=3, lora_parameters=10) - step("none", runs=3) == 6 * 32 * (2 + 4 + 2) * 3 * 10
    assert step("none", runs=6, lora_parameters=10) - step("none", runs=6) == 2 * 6 * 32 * 8 * 3 * 10
    with pytest.raises(ValueError, match="unknown remat policy 'minimal'"):
        step("minimal")


def test_xlas_flop_count_of_the_real_steps_checks_the_formulas():
    """XLA's count (``cost_analysis``) of the engine's own train and eval steps, compiled for a one-layer model
    (XLA counts a loop's body once, so deeper models would be undercounted) of 2 runs' adapters on 4 rows of 64
    tokens. The formulas leave out norms, activations and softmax. The eval step's forward is counted within 2%
    (measured 0.9% over). The train step's formula is an upper bound, XLA's count 0.80-1.00 of it (measured
    0.86): it counts every token through all runs' adapters, their recomputation, and the input gradients of
    the first layer's projections, which no adapter needs (XLA drops them: here the one layer's)."""
    arch = dict(
        model_type="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    runs, rows, seq_len, optimizer = 2, 4, 64, optax.adamw(1e-3)
    graphdef, base, state = steps.abstract_attach_runs(
        functools.partial(costs.architecture_model, arch), range(runs), LoRAConfig(rank=8), optimizer
    )
    geometry = BatchGeometry(runs=runs, batch_size=rows // runs, grad_accum=1, seq_len=seq_len)
    train_batch = costs.abstract_batch((1, rows, seq_len), (1, rows, 1), TRAIN_KEYS)
    eval_batch = costs.abstract_batch((rows, seq_len), (rows,), EVAL_KEYS)

    def counted(step, *args):
        analysis = step.lower(*args).compile().cost_analysis()
        return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

    dims, lora = costs.dimensions(arch), costs.lora_parameter_count(arch, 8)
    train = counted(steps.make_train_step(graphdef, optimizer, 0, 1, geometry), base, state, train_batch)
    formula = costs.train_step_flops(
        dims, runs=runs, rows=rows, seq_len=seq_len, prompts=rows, lora_parameters=lora, remat="none"
    )
    assert 0.8 <= train / formula <= 1.0, (train, formula)
    evaluation = counted(steps.make_eval_step(graphdef, 0, 1), base, state.lora, eval_batch)
    formula = costs.eval_flops(dims, {seq_len: runs * rows}, runs * lora)
    assert evaluation == pytest.approx(formula, rel=0.02)


def test_what_each_remat_policy_recomputes_is_said_for_every_policy_of_the_layers():
    assert set(costs.RECOMPUTED) == set(REMAT_POLICIES)
    fields = {field.name for field in dataclasses.fields(costs.ForwardFlops)}
    assert all(set(parts) <= fields for parts in costs.RECOMPUTED.values())


@pytest.mark.parametrize("mesh", [dict(data=8, fsdp=1, tensor=1), dict(data=1, fsdp=4, tensor=2)])
def test_bytes_per_device_equal_a_placed_models_shards(mesh):
    architecture = TINY_ARCHITECTURES["olmo2-gqa"]
    model = models.from_config(costs.full_config(architecture).to_dict(), dtype="bfloat16")
    apply_lora(model, LoRAConfig(rank=4), rngs=nnx.Rngs(0))
    real_mesh = sharding.make_mesh(mesh["data"], mesh["fsdp"], mesh["tensor"])
    devices = costs.abstract_mesh(mesh)
    for kind in (nnx.LoRAParam, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))):
        state = nnx.state(model, kind)
        placed = sharding.place(state, models.param_shardings(state, real_mesh))
        on_first_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(placed))
        assert costs.bytes_per_device(state, devices) == on_first_device
        assert costs.bytes_per_device(state, devices, leading=3) == 3 * on_first_device


@pytest.mark.parametrize("remat", ["none", "full"])
def test_saved_activations_equal_the_vjps_residuals(remat):
    """The estimator's measure (traced, abstract) against the arrays a concrete VJP of the step's loss keeps:
    one micro-batch of packed rows, each token through the adapters of its own of the 3 runs."""
    architecture = TINY_ARCHITECTURES["olmo2-gqa"]
    model = models.from_config(costs.full_config(architecture).to_dict(), remat=remat)
    apply_lora(model, LoRAConfig(rank=4), rngs=nnx.Rngs(0))
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    runs, rows, slots, seq_len = 3, 2, 2, 8
    lora = steps.runs_inside_layers(jax.tree.map(lambda x: jnp.stack([x] * runs), lora))
    segments = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 2, 2, 0, 0]], jnp.int32)
    per_slot = jnp.array([[0, 1], [2, 0]], jnp.int32)  # each row's prompts' runs (and examples, and labels)
    micro = dict(
        input_ids=jnp.ones((rows, seq_len), jnp.int32),
        segment_ids=segments,
        answer_pos=jnp.array([[2, 6], [3, 5]], jnp.int32),
        label=per_slot,
        valid=jnp.ones((rows, slots), bool),
        run=per_slot,
        example=per_slot,
    )
    run_keys = jax.random.key_data(jax.random.split(jax.random.key(0), runs))
    run_weights = jnp.full((runs,), 0.5)
    loss = functools.partial(steps.micro_batch_loss, graphdef=graphdef, yes_id=0, no_id=1, compute_dtype=None)
    _, vjp = jax.vjp(lambda lora: loss(lora, base, micro, run_keys, run_weights)[0], lora)
    # vjp's leaves are what it keeps; the step's own arguments (base, adapters, batch) are not activations.
    arguments = {id(leaf) for leaf in jax.tree.leaves((lora, base, micro, run_keys, run_weights))}
    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp) if id(leaf) not in arguments)
    make = functools.partial(costs.architecture_model, architecture, remat=remat)
    measured = costs.saved_activation_bytes(
        make, LoRAConfig(rank=4), runs=runs, rows=rows, seq_len=seq_len, prompts_per_row=slots
    )
    assert measured == pytest.approx(kept, rel=1e-3)  # up to scalar literals, which the trace does not count


def test_memory_follows_remat_runs_platform_and_mesh():
    architecture = dict(TINY_ARCHITECTURES["olmo2-gqa"], num_hidden_layers=4)
    common = dict(dtype="bfloat16", mesh=dict(data=2, fsdp=1, tensor=1), rows=4, seq_len=32)
    memory = {
        remat: costs.train_memory_per_device(architecture, LoRAConfig(), remat=remat, runs=2, **common)
        for remat in ("none", "save_dots", "full")
    }
    assert memory["full"].activations < memory["save_dots"].activations < memory["none"].activations
    # A remat'd layer is recomputed whole before its gradient, beside the same gradient temporaries.
    temporaries = costs.BACKWARD_TEMPORARIES
    assert memory["full"].layer_transients == pytest.approx(
        memory["none"].layer_transients * (1 + temporaries) / temporaries
    )
    assert memory["none"].frozen_weights == 2 * costs.parameter_count(architecture)  # bf16, replicated
    # More runs share the same rows: each holds its own adapters, gradients and moments (float32), but the
    # micro-batch's activations grow only by what marks each token's run.
    more_runs = costs.train_memory_per_device(architecture, LoRAConfig(), remat="none", runs=4, **common)
    adapters = costs.lora_parameter_count(architecture, 8)
    assert more_runs.adapters == more_runs.gradients == 2 * memory["none"].adapters == 4 * 4 * adapters
    assert more_runs.optimizer_state == 2 * more_runs.adapters
    assert memory["none"].activations < more_runs.activations < 1.01 * memory["none"].activations
    more_rows = costs.train_memory_per_device(architecture, LoRAConfig(), remat="none", runs=2, **dict(common, rows=8))
    assert more_rows.activations > 1.9 * memory["none"].activations
    assert memory["none"].upcast_weights == 0  # GPU: the weights are multiplied as stored
    on_cpu = costs.train_memory_per_device(architecture, LoRAConfig(), remat="none", runs=2, platform="cpu", **common)
    assert on_cpu.activations > 1.2 * memory["none"].activations  # bf16 residuals kept as float32
    one_layer = costs.parameter_count(dict(architecture, num_hidden_layers=2)) - costs.parameter_count(
        dict(architecture, num_hidden_layers=1)
    )
    assert on_cpu.upcast_weights == 4 * 4 * one_layer  # a float32 copy of the 4 layers' weights
    fsdp = costs.train_memory_per_device(
        architecture, LoRAConfig(), remat="none", runs=2, **dict(common, mesh=dict(data=1, fsdp=2, tensor=1))
    )
    # The rows are split over data x fsdp either way (an untied head: nothing gathered is kept).
    assert fsdp.activations == pytest.approx(memory["none"].activations, rel=1e-3)
    assert fsdp.frozen_weights < memory["none"].frozen_weights
    assert fsdp.layer_transients > memory["none"].layer_transients  # a layer gathered whole from its shards
    assert fsdp.head_transients > memory["none"].head_transients == 0
    with pytest.raises(ValueError, match="a micro-batch of 3 rows does not split over data x fsdp = 2 devices"):
        costs.train_memory_per_device(architecture, LoRAConfig(), remat="none", runs=2, **dict(common, rows=3))


def test_tied_heads_transposed_embedding_is_kept_only_when_gathered_from_fsdp_shards():
    architecture = TINY_ARCHITECTURES["smollm3-tied"]
    common = dict(dtype="bfloat16", remat="none", runs=2, rows=4, seq_len=16)
    replicated, sharded = (
        costs.train_memory_per_device(architecture, LoRAConfig(), mesh=mesh, **common)
        for mesh in (dict(data=2, fsdp=1, tensor=1), dict(data=1, fsdp=2, tensor=1))
    )
    embedding = 101 * 16 * 2  # vocab x hidden, bf16
    assert sharded.activations - replicated.activations == pytest.approx(embedding, rel=0.05)
    assert sharded.head_transients == embedding / 2  # the other shard, gathered


@pytest.mark.parametrize(
    "pack, grad_accum, buckets, prompt_len, expected",
    [
        # demo: 2 runs x batch 8 on 8 devices, data.max_length 128: 2 prompts a device a micro-batch (1 with
        # grad_accum 2), in the fewest rows of at most 128 tokens; the default ladder is 64, 80, 96, 112, 128.
        (True, 1, (), 100, (2, 1, 112)),  # one 100-token prompt a row: two rows
        (True, 1, (), 60, (1, 2, 128)),  # both in one row of 120 tokens
        (True, 1, (), 40, (1, 2, 80)),
        (True, 2, (), 100, (1, 1, 112)),
        (True, 1, (64, 128), 30, (1, 2, 64)),
        (False, 1, (), 100, (1, 1, 112)),  # one prompt a row: the bucket holding it
        (False, 1, (), 60, (1, 1, 64)),
        (False, 1, (64, 128), 100, (1, 1, 128)),
    ],
)
def test_train_row_length(pack, grad_accum, buckets, prompt_len, expected):
    config = load_config("configs/demo.py")
    config.train.pack, config.train.grad_accum, config.data.buckets = pack, grad_accum, buckets
    job = read(config)
    geometry = launch_prompts.assumed_geometry(job, 8, prompt_len)
    rows, prompts = (geometry.packed_rows_per_device, geometry.prompts_per_row) if pack else (1, 1)
    assert (rows, prompts, geometry.seq_len) == expected
    with pytest.raises(ValueError, match="prompt length 129 must be in"):
        launch_prompts.assumed_geometry(job, 8, 129)


def test_estimate_within_a_quarter_of_the_compiled_train_step():
    """OLMo-2 7B cut to 2 layers, its 9 runs' prompts packed in 384-token rows (MNLI's, of about 80 tokens a
    prompt): the estimate for XLA's CPU backend against the memory the compiler allocates for the engine's own
    train step on the 8 host devices (what the preflight reports; built here from the config alone, as the
    preflight needs the checkpoint's tokenizer)."""
    config = load_config("configs/olmo7_mnli.py")
    config.train.grad_accum, config.model.remat = 2, "save_dots"  # the layout the geometry below is worked out for
    job = read(config)
    seq_len, layers = 384, 2
    mesh = job.mesh.make()
    architecture = costs.architecture_of(job.model, layers)
    graphdef, base, runs = steps.abstract_attach_runs(
        lambda: models.abstract_model(architecture, dtype=config.model.dtype, remat=config.model.remat),
        [run.seed for run in job.runs.runs()],
        job.lora,
        job.groups[0].optimizer.transformation,
    )
    # What batch_geometry makes of it: 2 micro-batches of 9 x 16 / (2 x 8) = 9 prompts a device, in two rows of
    # at most data.max_length (512) each, 5 slots for the fuller.
    geometry = BatchGeometry(
        runs=runs.num_runs,
        batch_size=config.train.batch_size,
        grad_accum=config.train.grad_accum,
        seq_len=seq_len,
        packed=True,
        packed_rows_per_device=2,
        prompts_per_row=5,
        batch_shards=sharding.batch_shards(mesh),
    )
    assert (config.train.pack, config.data.max_length) == (True, 512)
    train_step = steps.make_train_step(
        graphdef, job.groups[0].optimizer.transformation, 1, 2, geometry, mesh=mesh, base_state=base, state=runs
    )
    memory = train_step.lower(base, runs, compiled.train_batch(geometry, mesh)).compile().memory_analysis()
    compiled_bytes = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    estimated = estimate.estimate(
        "olmo7",
        job,
        launch_prompts.AssumedPrompts(80, eval_examples=0),
        estimate.Target(8, devices.DEVICES["h100"], 0.4, platform="cpu"),
        layers=layers,
        seq_len=seq_len,
    )
    assert (estimated.geometry.rows, estimated.geometry.prompts_per_row) == (geometry.rows, geometry.prompts_per_row)
    estimated = estimated.memory.total
    assert 0.75 < estimated / compiled_bytes < 1.25, (estimated, compiled_bytes)


def test_a_packed_step_holds_all_runs_prompts_in_the_fewest_rows_per_device():
    """As oodjax.engine.geometry lays a step out: with train.pack each of train.grad_accum micro-batches holds
    a device's share of all runs' prompts in the fewest rows of at most data.max_length tokens; without it,
    one prompt a row."""
    config = load_config("configs/smol3_mnli.py")  # 9 runs x batch 16, grad_accum 1, 8 devices, no remat
    assert (config.train.pack, config.train.grad_accum, config.model.remat) == (True, 1, "none")
    config.model.remat = "save_dots"  # the policy whose recomputation the FLOPs below count

    def costed(config):
        return estimate.estimate(
            "smol3",
            read(config),
            launch_prompts.AssumedPrompts(160, eval_examples=0),
            estimate.Target(8, devices.DEVICES["h100"], 0.4),
            layers=2,
        )

    def shape(result):
        g = result.geometry
        return g.grad_accum, g.rows, g.rows_per_device, g.prompts_per_row, g.seq_len

    # 144 prompts of 160 tokens, 18 a device: rows of 512 hold 3 (480 tokens, in the bucket of 512), so 6 rows a
    # device.
    packed = costed(config)
    assert shape(packed) == (1, 48, 6, 3, 512)
    config.train.grad_accum = 2  # 9 a device a micro-batch: 3 rows of 3
    halved = costed(config)
    assert shape(halved) == (2, 24, 3, 3, 512)
    assert halved.memory.activations < 0.6 * packed.memory.activations
    config.train.pack = False  # 72 rows of 160 tokens a micro-batch, 9 a device
    unpacked = costed(config)
    assert shape(unpacked) == (2, 72, 9, 1, 160)
    # Per token computed: the layers' matmuls forward and backward (2 + 2 per weight); all 9 runs' adapters
    # (2 + 4 + 2 recomputed per weight and run); attention over the row forward, backward and recomputed
    # (4 + 8 + 4 per position and query feature, per layer). The head at each of the 144 prompts, forward and back.
    arch = costs.architecture_of(read(config).model, 2)
    dims, lora = costs.dimensions(arch), costs.lora_parameter_count(arch, config.lora.rank)

    def flops(tokens, seq_len):
        per_token = 4 * 2 * dims.layer_matmul_parameters + 8 * 9 * lora + 16 * 2 * seq_len * dims.q_dim
        return tokens * per_token + 2 * 2 * dims.hidden_size * dims.vocab_size * 144

    assert packed.train_step_flops == pytest.approx(flops(48 * 512, 512))
    assert halved.train_step_flops == pytest.approx(flops(2 * 24 * 512, 512))
    assert unpacked.train_step_flops == pytest.approx(flops(144 * 160, 160))


@pytest.mark.parametrize(
    "mesh, devices, expected",
    [
        (dict(data=-1, fsdp=1, tensor=1), 8, dict(data=8, fsdp=1, tensor=1)),
        (dict(data=1, fsdp=-1, tensor=2), 8, dict(data=1, fsdp=4, tensor=2)),
        (dict(data=2, fsdp=2, tensor=2), 8, dict(data=2, fsdp=2, tensor=2)),
    ],
)
def test_resolve_mesh(mesh, devices, expected):
    """The estimate sizes a config's mesh for devices this machine may not have, with the engine's rule."""
    assert MeshShape(**mesh).sizes(devices) == expected


@pytest.mark.parametrize(
    "mesh, message",
    [
        (dict(data=-1, fsdp=-1, tensor=1), "at most one -1"),
        (dict(data=3, fsdp=-1, tensor=1), "8 devices are not divisible by 3"),
        (dict(data=2, fsdp=2, tensor=1), "need 4 devices; there are 8"),
    ],
)
def test_resolve_mesh_errors(mesh, message):
    with pytest.raises(ValueError, match=message):
        MeshShape(**mesh).sizes(8)


def beside_mnli(config, testsets):
    """The examples ``config`` counts of ``testsets``: a job evaluates its training set (MNLI) too, counted alone
    and taken off."""
    config.data.testsets = ("mnli",)
    mnli = estimate.count_eval_examples(read(config).data)
    config.data.testsets = ("mnli", *testsets)
    return estimate.count_eval_examples(read(config).data) - mnli


def test_eval_examples_counted_from_the_testsets():
    # RTE train (2490 rows) and WNLI train (635 rows) are two-way: nothing dropped.
    config = load_config("configs/demo.py")
    config.data.neutral, config.data.eval_cap = "drop", 0
    assert beside_mnli(config, ("rte", "wnli")) == 2490 + 635
    config.data.eval_cap = 500
    assert beside_mnli(config, ("rte", "wnli")) == 1000


def test_evaluation_steps():
    """What the estimate counts evaluations by: the loop's own schedule."""
    assert len(Cadence(total_steps=500, eval_every=25).evaluated_steps()) == 21
    assert len(Cadence(total_steps=110, eval_every=25).evaluated_steps()) == 6  # 0, 25, 50, 75, 100 and the last step


def test_cli_prints_every_figure(capsys, monkeypatch):
    for name in devices.MEMORY_FRACTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert (
        estimate.main(
            [
                "configs/opt30_mnli.py",
                "configs/olmo7_snli.py",
                "--prompt_len",
                "512",
                "--eval_examples",
                "1000",
                "--device",
                "h100",
                "--utilisation",
                "0.5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "configs/opt30_mnli.py: facebook/opt-30b, 29,974,540,288 parameters" in out
    # 9 x 16 prompts, 18 a device in the one micro-batch, of 512 tokens (data.max_length): one a row of 512.
    assert (
        "mesh data=4 fsdp=2 tensor=1; 9 runs x batch 16 in 1 micro-batch of 18 packed rows per device (512 "
        "tokens, 1 prompt slot); bfloat16, remat none"
    ) in out
    # 29.98 GB of 29.97e9 bf16 parameters split 2 ways, plus the norms and biases fsdp leaves whole; the head
    # (tied: the 50272 x 7168 embedding) gathered from 2 shards. The layout is sized for the study's prompts of
    # about 45 tokens (docs/clusters.md, "Sizing"): prompts of 512 do not fit.
    for figure in (
        "frozen weights 29.98",
        "adapters",
        "optimizer state",
        "activations",
        "a layer's backward",
        "the head's 0.36",
        "per train step",
        "per full evaluation",
        "H100 SXM-hours at 50% utilisation",
        "prompts: 512 tokens each (--prompt_len = data.max_length: an upper bound), evaluated one a row",
        "DOES NOT FIT in 72 GB of the H100 SXM's 80 GB (XLA_CLIENT_MEM_FRACTION=0.9, launch/slurm.sbatch's default)",
    ):
        assert figure in out
    assert out.strip().splitlines()[-1].startswith("total: 18 runs in 2 configs")


def fit(total: float, device: devices.Device, environ: dict[str, str]) -> str:
    return devices.fit_text(total, device, *devices.usable_memory(device, environ))


def test_the_fit_is_tested_against_the_memory_jax_can_use(capsys):
    """A GPU's memory times JAX's memory fraction (launch/slurm.sbatch's default unless exported, by either of
    JAX's names), not the whole device; a TPU's whole memory."""
    h100, v5p = devices.DEVICES["h100"], devices.DEVICES["v5p"]
    assert devices.usable_memory(h100, {})[0] == 80e9 * devices.MEMORY_FRACTION_DEFAULT == 72e9
    assert fit(75e9, h100, {}) == (
        "DOES NOT FIT in 72 GB of the H100 SXM's 80 GB (XLA_CLIENT_MEM_FRACTION=0.9, launch/slurm.sbatch's default)"
    )
    assert fit(75e9, h100, {"XLA_CLIENT_MEM_FRACTION": "0.95"}) == (
        "fits in 76 GB of the H100 SXM's 80 GB (XLA_CLIENT_MEM_FRACTION=0.95)"
    )
    deprecated = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}
    assert fit(75e9, h100, deprecated).startswith("DOES NOT FIT in 40 GB")
    assert fit(90e9, v5p, {"XLA_CLIENT_MEM_FRACTION": "0.5"}) == "fits in the 95 GiB of a TPU v5p chip"
    for wrong in (
        {"XLA_CLIENT_MEM_FRACTION": "1.5"},
        {"XLA_CLIENT_MEM_FRACTION": "most"},
        {"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
    ):
        with pytest.raises(usage_errors.ConfigError):
            devices.memory_fraction(wrong)


def test_cli_with_a_wrong_memory_fraction_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "90")
    with pytest.raises(SystemExit) as raised:
        estimate.main(["configs/opt30_mnli.py", "--prompt_len", "64", "--eval_examples", "10"])
    assert raised.value.code == 2
    assert "XLA_CLIENT_MEM_FRACTION=90: must be a fraction in (0, 1]" in capsys.readouterr().err


def _one_line(stderr, status):
    """The single error line the estimate ends with (exit status 2, no traceback)."""
    assert status == usage_errors.EXIT_STATUS, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m launch.estimate: error: "), stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "model, message",
    [
        ("c.model.path = 'someone/model-1b'", "model.path: no architecture numbers for 'someone/model-1b'"),
        (
            "c.model.path = 'facebook/opt-2.7b'\n    c.mesh.data = 3",
            "mesh sizes (data, fsdp, tensor) = (3, 1, 1) need 3 devices; there are 8",
        ),
    ],
)
def test_cli_config_errors_are_one_line(tmp_path, capsys, model, message):
    config = tmp_path / "other.py"
    config.write_text(
        f"from configs import base\n\ndef get_config():\n    c = base.get_config()\n    {model}\n    return c\n"
    )
    with pytest.raises(SystemExit) as raised:
        estimate.main([str(config), "--prompt_len", "64", "--eval_examples", "10"])
    assert message in _one_line(capsys.readouterr().err, raised.value.code)


def test_the_estimate_takes_a_glob_as_the_sweep_does(capsys):
    """Files that are not experiment configs are named and left out, as `launch.sweep --configs` does."""
    assert estimate.main(["configs/b*.py", "configs/olmo7_*.py", "--prompt_len", "128", "--eval_examples", "1000"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "# not experiment configs, skipped: configs/base.py (its config names no model)"
    assert lines[-1].startswith("total: 18 runs in 2 configs")


def _small_config(tmp_path, extra=""):
    path = tmp_path / "small.py"
    path.write_text(SMALL_CONFIG.format(extra=extra))
    return path


def test_the_real_prompts_are_those_the_engine_lays_out(tmp_path, gpt2_tokenizer_dir):
    """The default: the config's real prompts. Their number and tokens against the prompts tokenised here with
    transformers' tokenizer and the template, evaluation FLOPs in closed form over the pool's rows, and the
    train step laid out by the engine's geometry from the runs' few-shot sets."""
    config = load_config(_small_config(tmp_path))
    job = read(config)
    counted = launch_prompts.PromptCounter()(job, job.mesh.sizes(8))
    result = estimate.estimate("small", job, counted, estimate.Target(8, devices.DEVICES["h100"], 0.4))
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    runs = [(run.seed, run.shots) for run in job.runs.runs()]

    def lengths(dataset):  # prompts longer than data.max_length (128) lose premise tokens down to it
        prompts = [
            config.data.template.format(premise=p, hypothesis=h)
            for p, h in zip(dataset["premise"], dataset["hypothesis"])
        ]
        return [min(len(ids), 128) for ids in tokenizer(prompts)["input_ids"]]

    testsets = [lengths(dataset) for dataset in run_data.capped_testsets(job.data).values()]
    own_sets = [lengths(dataset) for dataset in run_data.few_shot_datasets(job.data, runs)]
    assert [len(t) for t in testsets] == [60, 60] and [len(s) for s in own_sets] == [16, 16]
    # Every run scores the testsets and its own few-shot set.
    prompts = 2 * 120 + 32
    tokens = 2 * sum(map(sum, testsets)) + sum(map(sum, own_sets))
    assert (counted.eval_prompts, counted.eval_prompt_tokens) == (prompts, tokens)
    assert counted.mean_length == pytest.approx(tokens / prompts)
    assert 30 < counted.mean_length < 80
    # The pool's rows hold those tokens, and padding.
    computed = sum(length * rows for length, rows in counted.eval_rows.items())
    assert counted.eval_real_token_share == pytest.approx(tokens / computed)
    assert 0.5 < counted.eval_real_token_share <= 1
    # Forward FLOPs of every row: 2 per weight of the 2 layers' matmuls (4 x 64^2 + 2 x 64 x 256) and of both runs'
    # adapters (rank 8 on 4 projections of 64 -> 64 a layer: the step computes every run's on each row), and
    # attention over the row, 4 x length x 64 a layer.
    weights = 2 * (4 * 64 * 64 + 2 * 64 * 256) + 2 * 2 * 4 * 8 * (64 + 64)
    assert result.eval_flops == pytest.approx(
        sum(rows * length * (2 * weights + 4 * 2 * length * 64) for length, rows in counted.eval_rows.items())
    )
    # Step 0 scores each example once for all runs (both are the base model): the testsets' 120 prompts once and
    # each run's own 16, in the rows of step 0's pool, in the same batch shapes (here as many batches: each row
    # length's rows fit one batch either way).
    assert result.first_eval_flops == pytest.approx(
        sum(rows * length * (2 * weights + 4 * 2 * length * 64) for length, rows in counted.first_eval_rows.items())
    )
    once = sum(map(sum, testsets)) + sum(map(sum, own_sets))
    assert once <= sum(length * rows for length, rows in counted.first_eval_rows.items()) <= computed
    (group,) = job.groups
    steps, evaluations = group.total_steps, len(group.cadence.evaluated_steps())
    assert result.total_flops == pytest.approx(
        steps * result.train_step_flops + result.first_eval_flops + (evaluations - 1) * result.eval_flops
    )
    # Training: the engine's own layout of the runs' few-shot sets.
    tokenized = run_data.few_shot_sets(job.data, tokenizer, runs)
    engine = batch_geometry(
        job.batches, sharding.make_mesh(8, 1, 1), tokenized, [seed for seed, _ in runs], group.total_steps
    )
    assert result.geometry == counted.geometry
    assert (engine.rows, engine.seq_len, engine.prompts_per_row) == (
        result.geometry.rows,
        result.geometry.seq_len,
        result.geometry.prompts_per_row,
    )


def test_the_output_names_the_prompts_and_prompt_len_overrides_them(tmp_path, capsys, gpt2_tokenizer_dir):
    config = str(_small_config(tmp_path))
    assert estimate.main([config, "--device", "h100"]) == 0
    real = capsys.readouterr().out
    assert f"prompts: real, counted with its tokenizer {gpt2_tokenizer_dir}: mean " in real
    assert "an evaluation scores 272 prompts" in real
    stand_in = shutil.copytree(gpt2_tokenizer_dir, tmp_path / "stand-in")
    assert estimate.main([config, "--device", "h100", "--tokenizer", str(stand_in)]) == 0
    assert f"counted with the tokenizer {stand_in} standing in for {gpt2_tokenizer_dir}: mean " in (
        capsys.readouterr().out
    )
    # The config's pool is MNLI's train split, which the mirror lacks: refused by name, unless the offline pool
    # stands in.
    (tmp_path / "train_pool").mkdir()
    pool_train = str(_small_config(tmp_path / "train_pool", extra="    config.data.pool_split = 'train'\n"))
    with pytest.raises(SystemExit):
        estimate.main([pool_train, "--device", "h100"])
    assert "mnli split 'train'" in capsys.readouterr().err
    assert estimate.main([pool_train, "--device", "h100", "--offline_pools"]) == 0
    assert "# few-shot sets drawn from the offline pools (--offline_pools)" in capsys.readouterr().out
    assert estimate.main([config, "--device", "h100", "--prompt_len", "64"]) == 0
    assumed = capsys.readouterr().out
    assert "prompts: 64 tokens each (--prompt_len), evaluated one a row" in assumed
    assert "prompts: real" not in assumed
    assert estimate.main([config, "--device", "h100", "--prompt_len", "128"]) == 0
    assert "prompts: 128 tokens each (--prompt_len = data.max_length: an upper bound)" in capsys.readouterr().out

    def eval_flops(out):
        return float(out.split(" per train step, ")[1].split(" per full evaluation")[0])

    def first_eval_flops(out):
        return float(out.split(" per full evaluation (")[1].split(" at step 0")[0])

    # Both runs' 60 + 60 testset examples and each run's own 16, each alone in a row of 64 tokens (weights as in
    # the test above), where the real prompts are packed in rows of their own lengths; at step 0 the testsets'
    # once for both runs.
    weights = 2 * (4 * 64 * 64 + 2 * 64 * 256) + 2 * 2 * 4 * 8 * (64 + 64)
    assert eval_flops(assumed) == pytest.approx((2 * 120 + 32) * 64 * (2 * weights + 4 * 2 * 64 * 64), rel=1e-3)
    assert first_eval_flops(assumed) == pytest.approx((120 + 32) * 64 * (2 * weights + 4 * 2 * 64 * 64), rel=1e-3)
    assert eval_flops(assumed) != pytest.approx(eval_flops(real), rel=1e-2)
    for wrong in (["--eval_examples", "10"], ["--prompt_len", "64", "--tokenizer", "gpt2"]):
        with pytest.raises(SystemExit):
            estimate.main([config, *wrong])


def test_without_the_data_the_estimate_is_one_line_naming_the_fetch_and_prompt_len(tmp_path):
    """No testset mirror (data.data_dir and OODJAX_DATA_DIR empty), the hub offline: one line, exit status 2."""
    config = _small_config(tmp_path, extra="    config.data.data_dir = ''\n")
    env = {key: value for key, value in os.environ.items() if key != "OODJAX_DATA_DIR"}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "launch.estimate", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = _one_line(result.stderr, result.returncode)
    assert "--prompt_len N prices prompts of N tokens" in line
    assert f"`python -m launch.fetch {config}`" in line


def test_a_local_sample_is_counted_at_the_size_of_the_hubs_split(tmp_path, capsys, hf_data_dir, gpt2_tokenizer_dir):
    """The shared HANS is 3,000 rows of the hub's 30,000 (../shared/data/README.md): a job that reads the hub, or
    the fetched split, evaluates 30,000, so the estimate counts as many, the sample's prompts repeated, and says
    so. A mirror holding the whole split is counted as it is."""
    config = load_config("configs/demo.py")
    config.data.testsets, config.data.eval_cap = ("mnli", "rte", "hans"), 0
    assert launch_prompts.study_samples(read(config).data) == {"hans": launch_prompts.Sample(3_000, 30_000, 30_000)}
    assert beside_mnli(config, ("rte", "hans")) == 2_490 + 30_000
    for cap, examples in ((500, 500 + 500), (5_000, 2_490 + 5_000)):  # the cap applies to the split a job reads
        config.data.eval_cap = cap
        assert beside_mnli(config, ("rte", "hans")) == examples

    # The real prompts: both runs score the sample's 3,000 prompts ten times over, MNLI's (in-domain) once, and
    # their own 16.
    path = _small_config(tmp_path, extra="    config.data.testsets = ('mnli', 'hans')\n    config.data.eval_cap = 0\n")
    job = read(load_config(path))
    counted = launch_prompts.PromptCounter()(job, job.mesh.sizes(8))
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)

    def tokens(testset):
        prompts = [
            job.data.template.format(premise=p, hypothesis=h) for p, h in zip(testset["premise"], testset["hypothesis"])
        ]
        return sum(min(len(ids), 128) for ids in tokenizer(prompts)["input_ids"])

    testsets = run_data.capped_testsets(job.data)
    own = run_data.few_shot_sets(job.data, tokenizer, [(run.seed, run.shots) for run in job.runs.runs()])
    prompts = 2 * (30_000 + len(testsets["mnli"])) + 32
    assert counted.eval_prompts == prompts
    assert counted.eval_prompt_tokens == 2 * (10 * tokens(testsets["hans"]) + tokens(testsets["mnli"])) + sum(
        int(s.lengths.sum()) for s in own
    )
    assert estimate.main([str(path), "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert f"an evaluation scores {prompts:,} prompts" in out
    assert (
        "  local samples (a job reads the hub's split, or the split fetched): hans 3,000 of the hub split's 30,000 "
        "rows, counted as 30,000 prompts, the sample's repeated\n"
    ) in out
    assert estimate.main([str(path), "--device", "h100", "--prompt_len", "64"]) == 0
    assert "hans 3,000 of the hub split's 30,000 rows, counted as 30,000 examples\n" in capsys.readouterr().out

    # The whole split fetched (as oodjax-fetch writes it, parquet): no sample, counted as it is.
    sample = pyarrow.json.read_json(hf_data_dir / "jhu-cogsci/hans/plain_text/validation.jsonl")
    mirror = tmp_path / "mirror" / "jhu-cogsci/hans/plain_text"
    mirror.mkdir(parents=True)
    pyarrow.parquet.write_table(pyarrow.concat_tables([sample] * 10), mirror / "validation.parquet")
    (tmp_path / "mirror" / "nyu-mll" / "glue").mkdir(parents=True)
    (tmp_path / "mirror" / "nyu-mll" / "glue" / "mnli").symlink_to(hf_data_dir / "nyu-mll" / "glue" / "mnli")
    config.data.data_dir, config.data.eval_cap = str(tmp_path / "mirror"), 0
    config.data.testsets = ("mnli", "hans")
    assert launch_prompts.study_samples(read(config).data) == {}
    assert beside_mnli(config, ("hans",)) == 30_000
