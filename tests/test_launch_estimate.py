"""The cost estimator: exact parameter counts against transformers' models, published counts, closed-form FLOPs,
per-device weight shards against real placement, saved activations against the VJP's own residuals, and the
memory total against the compiler's."""

import functools

import jax
import jax.numpy as jnp
import peft
import pytest
import torch
import transformers
from flax import nnx

from configs.models import MODELS
from launch import costs, estimate, preflight
from launch.config_files import load_config
from oodjax import models
from oodjax.engine import loop, results, sharding, steps
from oodjax.engine.geometry import BatchGeometry
from oodjax.models.lora import LoRAConfig, apply_lora

TINY_ARCHITECTURES = {
    "opt": dict(model_type="opt", vocab_size=97, hidden_size=16, word_embed_proj_dim=16, ffn_dim=40,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32),
    # OPT-350m's layout: embeddings narrower than the layers, with projections in and out.
    "opt-projected": dict(model_type="opt", vocab_size=97, hidden_size=16, word_embed_proj_dim=8, ffn_dim=40,
                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                          do_layer_norm_before=False),
    "opt-no-bias": dict(model_type="opt", vocab_size=97, hidden_size=16, word_embed_proj_dim=16, ffn_dim=40,
                        num_hidden_layers=3, num_attention_heads=2, max_position_embeddings=32, enable_bias=False),
    "olmo2-gqa": dict(model_type="olmo2", vocab_size=101, hidden_size=16, intermediate_size=24,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "smollm3-tied": dict(model_type="smollm3", vocab_size=101, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                         pad_token_id=0),
    "llama-biases": dict(model_type="llama", vocab_size=101, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False),
    "gemma2": dict(model_type="gemma2", vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "gemma3_text": dict(model_type="gemma3_text", vocab_size=101, hidden_size=16, intermediate_size=24,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "phi3": dict(model_type="phi3", vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0),
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
    assert costs.forward_flops_per_token(dims, 32) == 13312
    # Train step, 2 runs x 3 examples, no remat: 3 x matmuls + 3 x attention + 2*H*V*2 per example for the head.
    def step(remat):
        return costs.train_step_flops(dims, runs=2, batch_size=3, seq_len=32, lora_parameters=0, remat=remat)

    assert step("none") == 6 * 32 * (2 * 9216 + 3 * 4096) + 6 * 4 * 16 * 97
    # What each policy recomputes, per token: the whole forward; the attention scores and their
    # product with the values (4 * 32 * 16 per layer); those and the MLP (2 * 2 * 16 * 40 per layer).
    assert step("full") - step("none") == 6 * 32 * 13312
    assert step("save_dots") - step("none") == 6 * 32 * 2 * 4 * 32 * 16
    assert step("save_dots_except_mlp") - step("save_dots") == 6 * 32 * 2 * 2 * 2 * 16 * 40
    with pytest.raises(ValueError, match="unknown remat policy 'minimal'"):
        step("minimal")


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
    """The estimator's measure (traced, abstract) against the arrays a concrete VJP of the step's loss keeps."""
    architecture = TINY_ARCHITECTURES["olmo2-gqa"]
    model = models.from_config(costs.full_config(architecture).to_dict(), remat=remat)
    apply_lora(model, LoRAConfig(rank=4), rngs=nnx.Rngs(0))
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    runs, batch, seq_len = 3, 2, 8
    lora = jax.tree.map(lambda x: jnp.stack([x] * runs), lora)
    tokens = jnp.ones((runs, batch, seq_len), jnp.int32)
    micro = dict(input_ids=tokens, segment_ids=tokens, answer_pos=jnp.full((runs, batch), seq_len - 1),
                 label=jnp.zeros((runs, batch), jnp.int32))
    keys = jax.random.split(jax.random.key(0), runs)
    loss = functools.partial(steps.micro_batch_loss, graphdef=graphdef, yes_id=0, no_id=1, compute_dtype=None)
    _, vjp = jax.vjp(lambda lora: jax.vmap(lambda *xs: loss(xs[0], base, *xs[1:])[0])(lora, micro, keys).sum(), lora)
    # vjp's leaves are what it keeps; the step's own arguments (base, adapters, batch) are not activations.
    arguments = {id(leaf) for leaf in jax.tree.leaves((lora, base, micro, keys))}
    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp) if id(leaf) not in arguments)
    abstract = costs.with_adapters(costs.abstract_model(architecture, remat=remat), LoRAConfig(rank=4))
    measured = costs.saved_activation_bytes(abstract, runs=runs, batch=batch, seq_len=seq_len)
    assert measured == pytest.approx(kept, rel=1e-3)  # up to scalar literals, which the trace does not count


def test_memory_follows_remat_runs_platform_and_mesh():
    architecture = dict(TINY_ARCHITECTURES["olmo2-gqa"], num_hidden_layers=4)
    common = dict(dtype="bfloat16", mesh=dict(data=2, fsdp=1, tensor=1), micro_batch=4, seq_len=32)
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
    more_runs = costs.train_memory_per_device(architecture, LoRAConfig(), remat="none", runs=4, **common)
    assert more_runs.activations > 1.9 * memory["none"].activations
    assert more_runs.adapters == 2 * memory["none"].adapters == 2 * 4 * 2 * costs.lora_parameter_count(
        architecture, 8
    )
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
    # The batch is split over data x fsdp either way (an untied head: nothing gathered is kept).
    assert fsdp.activations == pytest.approx(memory["none"].activations, rel=1e-3)
    assert fsdp.frozen_weights < memory["none"].frozen_weights
    assert fsdp.layer_transients > memory["none"].layer_transients  # a layer gathered whole from its shards
    assert fsdp.head_transients > memory["none"].head_transients == 0


def test_tied_heads_transposed_embedding_is_kept_only_when_gathered_from_fsdp_shards():
    architecture = TINY_ARCHITECTURES["smollm3-tied"]
    common = dict(dtype="bfloat16", remat="none", runs=2, micro_batch=4, seq_len=16)
    replicated, sharded = (
        costs.train_memory_per_device(architecture, LoRAConfig(), mesh=mesh, **common)
        for mesh in (dict(data=2, fsdp=1, tensor=1), dict(data=1, fsdp=2, tensor=1))
    )
    embedding = 101 * 16 * 2  # vocab x hidden, bf16
    assert sharded.activations - replicated.activations == pytest.approx(embedding, rel=0.05)
    assert sharded.head_transients == embedding / 2  # the other shard, gathered


@pytest.mark.parametrize("chunk, expected", [(0, 2), (1, 1), (2, 2), (5, 2)])
def test_runs_at_once(chunk, expected):
    config = load_config("configs/demo.py")  # seeds (0, 42) x shots (32,): two runs
    config.runs.chunk = chunk
    assert estimate.runs_at_once(config) == expected


def test_estimate_within_a_quarter_of_the_compiled_train_step():
    """OLMo-2 7B cut to 2 layers, 128-token rows: the estimate for XLA's CPU backend against the memory
    the compiler allocates for the engine's own train step on the 8 host devices (what the preflight
    reports; built here from the config alone, as the preflight needs the checkpoint's tokenizer)."""
    config = load_config("configs/olmo7_mnli.py")
    seq_len, layers = 128, 2
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    architecture = estimate.architecture_of(config, layers)
    graphdef, base, runs = steps.abstract_init_runs(
        lambda: models.abstract_model(architecture, dtype=config.model.dtype, remat=config.model.remat),
        [run.seed for run in results.plan_runs(config)], LoRAConfig.from_config(config.lora), loop.optimizer(config),
    )
    geometry = BatchGeometry(
        runs=runs.num_runs, batch_size=config.train.batch_size, grad_accum=config.train.grad_accum,
        seq_len=seq_len, run_chunk=config.runs.chunk, batch_shards=sharding.batch_shards(mesh),
    )
    train_step = steps.make_train_step(graphdef, loop.optimizer(config), 1, 2, geometry, mesh=mesh, base_state=base,
                                       runs=runs)
    memory = train_step.lower(base, runs, preflight.train_batch(geometry, mesh)).compile().memory_analysis()
    compiled = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
                - memory.alias_size_in_bytes)
    estimated = estimate.estimate(
        "olmo7", config, devices=8, device=estimate.DEVICES["h100"], utilisation=0.4, seq_len=seq_len,
        eval_examples=0, layers=layers, platform="cpu",
    ).memory.total
    assert 0.75 < estimated / compiled < 1.25, (estimated, compiled)


def test_a_packed_config_is_estimated_at_one_row_per_device():
    """With train.pack (the default) a micro-batch is one row per device, whatever train.grad_accum says, as
    oodjax.engine.geometry lays it out: SmolLM3's grad_accum 1 on 8 devices is 2 micro-batches of 8 rows."""

    def memory(config):
        return estimate.estimate(
            "smol3", config, devices=8, device=estimate.DEVICES["h100"], utilisation=0.4, seq_len=160,
            eval_examples=0, layers=2,
        ).memory.total

    config = load_config("configs/smol3_mnli.py")
    assert (config.train.pack, config.train.grad_accum) == (True, 1)
    packed = memory(config)
    config.train.pack = False
    one_micro_batch = memory(config)
    config.train.grad_accum = 2
    assert packed == memory(config) < one_micro_batch


@pytest.mark.parametrize(
    "mesh, devices, expected",
    [
        (dict(data=-1, fsdp=1, tensor=1), 8, dict(data=8, fsdp=1, tensor=1)),
        (dict(data=1, fsdp=-1, tensor=2), 8, dict(data=1, fsdp=4, tensor=2)),
        (dict(data=2, fsdp=2, tensor=2), 8, dict(data=2, fsdp=2, tensor=2)),
    ],
)
def test_resolve_mesh(mesh, devices, expected):
    assert estimate.resolve_mesh(mesh, devices) == expected


@pytest.mark.parametrize(
    "mesh, message",
    [
        (dict(data=-1, fsdp=-1, tensor=1), "at most one mesh axis"),
        (dict(data=3, fsdp=-1, tensor=1), "does not fit 8 devices"),
        (dict(data=2, fsdp=2, tensor=1), "uses 4 devices, not the 8"),
    ],
)
def test_resolve_mesh_errors(mesh, message):
    with pytest.raises(ValueError, match=message):
        estimate.resolve_mesh(mesh, 8)


def test_eval_examples_counted_from_the_testsets():
    # RTE train (2490 rows) and WNLI train (635 rows) are two-way: nothing dropped.
    assert estimate.count_eval_examples(("rte", "wnli"), "", "drop", 0) == 2490 + 635
    assert estimate.count_eval_examples(("rte", "wnli"), "", "drop", 500) == 1000


def test_evaluation_steps():
    assert estimate.evaluation_steps(500, 25) == 21
    assert estimate.evaluation_steps(110, 25) == 6  # 0, 25, 50, 75, 100 and the last step


def test_cli_prints_every_figure(capsys):
    assert estimate.main(["configs/opt30_mnli.py", "configs/olmo7_snli.py", "--eval_examples", "1000",
                          "--device", "h100", "--utilisation", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "configs/opt30_mnli.py: facebook/opt-30b, 29,974,540,288 parameters" in out
    assert (
        "mesh data=1 fsdp=8 tensor=1; 9 runs (9 at once) x batch 16 (2 micro-batches, packed one row per device); "
        "bfloat16, remat save_dots"
    ) in out
    # 7.49 GB of 29.97e9 bf16 parameters split 8 ways, plus the norms and biases fsdp leaves whole; the
    # head (tied: the 50272 x 7168 embedding) gathered from 8 shards.
    for figure in ("frozen weights 7.50", "adapters", "optimizer state", "activations", "a layer's backward",
                   "the head's 0.63", "per train step", "per full evaluation", "H100 SXM-hours at 50% utilisation"):
        assert figure in out
    assert out.strip().splitlines()[-1].startswith("total: 18 runs in 2 configs")


def test_cli_unknown_checkpoint_is_an_error(tmp_path):
    config = tmp_path / "other.py"
    config.write_text("from configs import base\n\ndef get_config():\n    c = base.get_config()\n"
                      "    c.model.path = 'someone/model-1b'\n    return c\n")
    with pytest.raises(KeyError, match="no architecture numbers for 'someone/model-1b'"):
        estimate.main([str(config), "--eval_examples", "10"])


def test_the_estimate_takes_a_glob_as_the_sweep_does(capsys):
    """Files that are not experiment configs are named and left out, as `launch.sweep --configs` does."""
    assert estimate.main(["configs/b*.py", "configs/olmo7_*.py", "--eval_examples", "1000"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "# not experiment configs, skipped: configs/base.py (its config names no model)"
    assert lines[-1].startswith("total: 18 runs in 2 configs")
