"""load_pretrained's checks and conventions, from_config, and placement on a device mesh."""

import json

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from safetensors.torch import load_file, save_file

from oodjax.models import from_config, load_pretrained, logical_to_spec
from oodjax.models.loading import hf_parameter_name
from test_models_parity import LAYOUTS, assert_matches_hf, jitted, padded_batches, save, tiny_hf_model


@pytest.fixture(scope="module")
def opt_checkpoint(tmp_path_factory):
    """A tiny pre-LN OPT checkpoint and its transformers model, shared by the error tests."""
    hf_model = tiny_hf_model(LAYOUTS["opt_pre_ln"]())
    return save(hf_model, tmp_path_factory.mktemp("opt")), hf_model


def copy_checkpoint(source, target, *, edit_tensors=None, edit_config=None):
    """``source`` copied to ``target`` with its tensors and/or config.json changed."""
    target.mkdir(exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    tensors = load_file(source / "model.safetensors")
    save_file(edit_tensors(tensors) if edit_tensors else tensors, target / "model.safetensors")
    return target


# ----------------------------------------------------------------------------- errors


def test_unknown_model_type_is_refused(opt_checkpoint, tmp_path):
    folder = copy_checkpoint(opt_checkpoint[0], tmp_path, edit_config=lambda c: {**c, "model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"unknown model_type 'gpt2'.*\['llama', 'olmo2', 'opt', 'smollm3'\]"):
        load_pretrained(folder)


def test_missing_tensor_is_named(opt_checkpoint, tmp_path):
    name = "model.decoder.layers.1.fc2.bias"

    def drop(tensors):
        del tensors[name]
        return tensors

    with pytest.raises(ValueError, match=rf"missing tensors: \['{name}'\]"):
        load_pretrained(copy_checkpoint(opt_checkpoint[0], tmp_path, edit_tensors=drop))


def test_unexpected_tensor_is_named(opt_checkpoint, tmp_path):
    name = "model.decoder.layers.0.self_attn.rotary.weight"
    folder = copy_checkpoint(opt_checkpoint[0], tmp_path, edit_tensors=lambda t: {**t, name: torch.zeros(3)})
    with pytest.raises(ValueError, match=rf"unexpected tensors .*\['{name}'\]"):
        load_pretrained(folder)


def test_wrong_shape_is_named_with_both_shapes(opt_checkpoint, tmp_path):
    name = "model.decoder.layers.0.fc1.weight"  # [ffn_dim, hidden] = [64, 32]
    folder = copy_checkpoint(opt_checkpoint[0], tmp_path, edit_tensors=lambda t: {**t, name: torch.zeros(32, 64)})
    with pytest.raises(ValueError, match=rf"'{name}' in model.safetensors has shape \(32, 64\), expected \(64, 32\)"):
        load_pretrained(folder)


def test_config_that_does_not_match_the_tensors_is_refused(opt_checkpoint, tmp_path):
    folder = copy_checkpoint(opt_checkpoint[0], tmp_path, edit_config=lambda c: {**c, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match=r"missing tensors: \[.*'model.decoder.layers.2.self_attn.k_proj.weight'"):
        load_pretrained(folder)


def test_folder_without_weights_is_refused(opt_checkpoint, tmp_path):
    (tmp_path / "config.json").write_text((opt_checkpoint[0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"has no weights: expected model.safetensors"):
        load_pretrained(tmp_path)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no config.json"):
        load_pretrained(tmp_path)


def test_pickled_weights_need_allow_pickle(opt_checkpoint, tmp_path):
    source, hf_model = opt_checkpoint
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    torch.save(load_file(source / "model.safetensors"), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin holds pickled PyTorch weights.*allow_pickle=True"):
        load_pretrained(tmp_path)
    assert_matches_hf(load_pretrained(tmp_path, allow_pickle=True), hf_model, 96)


def test_hub_id_offline_fails_clearly():
    with pytest.raises(OSError, match=r"'oodjax-tests/not-a-model' is not a local folder.*HF_HUB_OFFLINE"):
        load_pretrained("oodjax-tests/not-a-model")


def test_non_float_dtype_is_refused(opt_checkpoint):
    with pytest.raises(ValueError, match=r"dtype must be a floating type.*int32"):
        load_pretrained(opt_checkpoint[0], dtype="int32")


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type 'dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, r"'llama3' needs 'low_freq_factor'"),
        ({"hidden_act": "gelu_pytorch_tanh"}, r"activation 'gelu_pytorch_tanh' is not supported"),
    ],
)
def test_unsupported_llama_configs_are_refused(edit, message):
    config = {**LAYOUTS["smollm2_tied_gqa"]().to_dict(), **edit}
    with pytest.raises(ValueError, match=message):
        from_config(config)


def test_smollm3_sliding_window_is_refused():
    config = {**LAYOUTS["smollm3_nope"]().to_dict(), "use_sliding_window": True, "sliding_window": 4}
    config.pop("layer_types")
    with pytest.raises(ValueError, match=r"sliding-window attention"):
        from_config(config)


# ----------------------------------------------------------------------------- conventions


def test_checkpoint_of_the_bare_model_with_a_stored_tied_head_loads(opt_checkpoint, tmp_path):
    """Hub OPT checkpoints name tensors without the "model." prefix and may store the tied lm_head."""
    source, hf_model = opt_checkpoint

    def hub_style(tensors):
        renamed = {name.removeprefix("model."): value for name, value in tensors.items()}
        renamed["lm_head.weight"] = tensors["model.decoder.embed_tokens.weight"].clone()
        return renamed

    assert_matches_hf(load_pretrained(copy_checkpoint(source, tmp_path, edit_tensors=hub_style)), hf_model, 96)


def test_from_config_has_exactly_transformers_parameters():
    """Same names and shapes as the transformers model (tied heads are not separate parameters)."""
    hf_model = tiny_hf_model(LAYOUTS["opt_350m_layout"]())
    expected = {name: tuple(p.shape) for name, p in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        del expected["lm_head.weight"]
    model = from_config(hf_model.config.to_dict(), dtype="bfloat16", seed=3)
    ours = {}
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param):
            assert variable.dtype == jax.numpy.bfloat16
            name, transposed = hf_parameter_name(path)
            ours[name] = tuple(variable.shape[::-1] if transposed else variable.shape)
    assert ours == expected


def test_remat_changes_neither_logits_nor_gradients():
    config = LAYOUTS["opt_350m_layout"]().to_dict()
    plain, remat = from_config(config, seed=1), from_config(config, seed=1, remat=True)
    assert remat.config.remat and not plain.config.remat
    ids, mask = padded_batches(96)["left"]

    def jaxpr(model):
        return str(jax.make_jaxpr(lambda m: m(ids, mask))(model))

    assert "remat" in jaxpr(remat) and "remat" not in jaxpr(plain)
    (plain_def, plain_state), (remat_def, remat_state) = nnx.split(plain), nnx.split(remat)

    @jax.jit  # both in one program: compiling dominates this test's time
    def losses_and_grads(plain_state, remat_state):
        def loss(graphdef, state):
            return nnx.merge(graphdef, state)(ids, mask)[:, -1].sum()

        return (
            jax.value_and_grad(lambda s: loss(plain_def, s))(plain_state),
            jax.value_and_grad(lambda s: loss(remat_def, s))(remat_state),
        )

    (loss_plain, grad_plain), (loss_remat, grad_remat) = losses_and_grads(plain_state, remat_state)
    # Rematerialising lets XLA fuse differently, so agreement is to float32 rounding, not bitwise.
    np.testing.assert_allclose(loss_remat, loss_plain, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grad_remat, grad_plain)


# ----------------------------------------------------------------------------- sharding


def auto_mesh():
    return jax.make_mesh((1, 4, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def test_explicit_mesh_axes_are_refused(opt_checkpoint):
    mesh = jax.make_mesh((1, 4, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)
    with pytest.raises(ValueError, match=r"mesh axes \['data', 'fsdp', 'tensor'\] are not AxisType.Auto"):
        load_pretrained(opt_checkpoint[0], mesh=mesh)


def test_load_onto_a_mesh_shards_parameters_and_keeps_logits(tmp_path):
    hf_model = tiny_hf_model(LAYOUTS["smollm2_tied_gqa"]())
    save(hf_model, tmp_path)
    mesh = auto_mesh()
    model = load_pretrained(tmp_path, mesh=mesh)
    layer = model.model.layers[1]
    expected = {
        "embed [vocab, embed]": (model.model.embed_tokens.embedding, P("tensor", "fsdp")),
        "q_proj [embed, heads]": (layer.self_attn.q_proj.kernel, P("fsdp", "tensor")),
        "k_proj [embed, kv_heads]": (layer.self_attn.k_proj.kernel, P("fsdp", "tensor")),
        "o_proj [heads, embed]": (layer.self_attn.o_proj.kernel, P("tensor", "fsdp")),
        "down_proj [mlp, embed]": (layer.mlp.down_proj.kernel, P("tensor", "fsdp")),
        "norm": (layer.input_layernorm.scale, P(None)),
    }
    for what, (variable, spec) in expected.items():
        sharding = variable[...].sharding
        assert sharding.mesh.shape == mesh.shape and sharding.spec == spec, (what, sharding)
    assert_matches_hf(model, hf_model, 96)


def test_logical_axes_map_through_the_rules_and_fall_back_to_replication():
    mesh = auto_mesh()
    assert logical_to_spec(("vocab", "embed"), (128, 64), mesh) == P("tensor", "fsdp")
    assert logical_to_spec(("batch", None), (8, 3), mesh) == P(("data", "fsdp"), None)
    # 50257 is not divisible by the tensor axis (2): that dimension stays whole.
    assert logical_to_spec(("vocab", "embed"), (50257, 64), mesh) == P(None, "fsdp")
    with pytest.raises(ValueError, match=r"logical axis 'experts' has no rule"):
        logical_to_spec(("experts",), (8,), mesh)


def test_jitted_forward_runs_on_the_mesh_shardings(tmp_path):
    """The engine's path: param_shardings of the state feed jax.jit and the output matches unsharded."""
    from oodjax.models import param_shardings

    hf_model = tiny_hf_model(LAYOUTS["opt_pre_ln"]())
    model = load_pretrained(save(hf_model, tmp_path))
    mesh = auto_mesh()
    graphdef, state = nnx.split(model)
    shardings = param_shardings(state, mesh)
    sharded_state = jax.device_put(state, shardings)
    assert sharded_state["model"]["decoder"]["layers"][0]["fc1"]["kernel"][...].sharding.spec == P("fsdp", "tensor")
    ids, mask = padded_batches(96)["right"]
    logits = jax.jit(lambda s: nnx.merge(graphdef, s)(ids, mask))(sharded_state)
    np.testing.assert_allclose(logits, jitted(model)(ids, mask)[0], atol=1e-5)
