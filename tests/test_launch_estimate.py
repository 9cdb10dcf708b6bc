"""The cost estimator: exact parameter counts against transformers' models, published counts, closed-form FLOPs."""

import peft
import pytest
import torch
import transformers

from launch import architectures, costs, estimate

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
}


def torch_model(architecture, device="cpu"):
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(costs.full_config(architecture))


@pytest.mark.parametrize("name", sorted(TINY_ARCHITECTURES))
def test_parameter_count_equals_tiny_transformers_model(name):
    model = torch_model(TINY_ARCHITECTURES[name])
    assert costs.parameter_count(TINY_ARCHITECTURES[name]) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("hub_id", sorted(architectures.ARCHITECTURES))
def test_parameter_count_of_listed_checkpoints(hub_id):
    architecture = architectures.ARCHITECTURES[hub_id]
    count = costs.parameter_count(architecture)
    # The real architecture built by transformers without allocating its weights.
    model = torch_model(architecture, device="meta")
    assert count == sum(p.numel() for p in model.parameters())
    published = architectures.PUBLISHED_PARAMETERS[hub_id]
    assert abs(count / published - 1) < 0.02, (hub_id, count, published)


@pytest.mark.parametrize("name", ["opt", "olmo2-gqa", "smollm3-tied"])
def test_lora_parameter_count_equals_peft(name):
    architecture = TINY_ARCHITECTURES[name]
    targets = ["q_proj", "k_proj", "v_proj", "out_proj" if name == "opt" else "o_proj"]
    model = peft.get_peft_model(torch_model(architecture), peft.LoraConfig(r=4, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dims = costs.dimensions(architecture)
    assert costs.lora_parameter_count(dims, 4) == trainable  # default targets: attention projections
    assert costs.lora_parameter_count(dims, 4, targets) == trainable


def test_unknown_lora_target_is_an_error():
    with pytest.raises(ValueError, match="unknown LoRA targets \\['qkv'\\]"):
        costs.lora_parameter_count(costs.dimensions(TINY_ARCHITECTURES["opt"]), 8, ["qkv"])


def test_forward_flops_closed_form():
    # OPT, H=16, F=40, 2 layers, sequence 32: per layer 4*16*16 + 2*16*40 = 2304 weights;
    # per token 2*2*2304 matmul FLOPs + 4*2*32*16 attention FLOPs = 9216 + 4096.
    dims = costs.dimensions(TINY_ARCHITECTURES["opt"])
    assert costs.forward_flops_per_token(dims, 32) == 13312
    # Train step, 2 runs x 3 examples, no remat: 3 x matmuls + 3 x attention + 2*H*V*2 per example for the head.
    step = costs.train_step_flops(dims, runs=2, batch_size=3, seq_len=32, lora_parameters=0, remat=False)
    assert step == 6 * 32 * (2 * 9216 + 3 * 4096) + 6 * 4 * 16 * 97
    with_remat = costs.train_step_flops(dims, runs=2, batch_size=3, seq_len=32, lora_parameters=0, remat=True)
    assert with_remat - step == 6 * 32 * 13312


def test_memory_frozen_weights_split_over_fsdp_and_tensor():
    dims = costs.dimensions(TINY_ARCHITECTURES["opt"])
    common = dict(parameters=1000, dtype="bfloat16", runs=2, micro_batch=8, seq_len=32, lora_parameters=10, remat=True)
    replicated = costs.train_memory_per_device(dims, mesh=dict(data=4, fsdp=1, tensor=1), **common)
    sharded = costs.train_memory_per_device(dims, mesh=dict(data=1, fsdp=4, tensor=1), **common)
    assert replicated.frozen_weights == 2000 and sharded.frozen_weights == 500
    assert replicated.adapters == 2 * 10 * 4 and replicated.optimizer_state == 2 * replicated.adapters
    assert replicated.activations == sharded.activations  # the batch is split over data x fsdp either way


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
    assert "mesh data=1 fsdp=8 tensor=1; 9 runs x batch 16" in out
    for figure in ("frozen weights 7.49", "adapters", "optimizer state", "activations", "per train step",
                   "per full evaluation", "H100 SXM-hours at 50% utilisation"):
        assert figure in out
    assert out.strip().splitlines()[-1].startswith("total: 18 runs in 2 configs")


def test_cli_unknown_checkpoint_is_an_error(tmp_path):
    config = tmp_path / "other.py"
    config.write_text("from configs import base\n\ndef get_config():\n    c = base.get_config()\n"
                      "    c.model.path = 'someone/model-1b'\n    return c\n")
    with pytest.raises(KeyError, match="no architecture numbers for 'someone/model-1b'"):
        estimate.main([str(config), "--eval_examples", "10"])
