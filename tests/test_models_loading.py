"""load_pretrained's checks and conventions, from_config, and placement on a device mesh."""

import contextlib
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_models_parity import LAYOUTS, assert_matches_hf, jitted, padded_batches, save, tiny_hf_model

from oodjax.models import config_from_dict, from_config, load_pretrained, logical_to_spec
from oodjax.models.hf_checkpoint import TensorFile, open_checkpoint
from oodjax.models.loading import hf_parameter_names
from oodjax.usage_errors import MissingInputError, NotFetchedError


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
    known = r"\['gemma2', 'gemma3_text', 'llama', 'mistral', 'olmo2', 'opt', 'phi3', 'qwen2', 'qwen3', 'smollm3'\]"
    with pytest.raises(ValueError, match=r"unknown model_type 'gpt2'.*" + known):
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


def _cut_data(path):
    """Drop the file's last 100 bytes: the tensor stored last (by offset) is cut short."""
    with safe_open(path, framework="numpy") as handle:
        last = handle.offset_keys()[-1]
    path.write_bytes(path.read_bytes()[:-100])
    where = rf"'{re.escape(last)}' in {re.escape(str(path))}"
    return rf"{where} ends at byte \d+, but the file has \d+ bytes: the file is truncated"


def _cut_header(path):
    path.write_bytes(path.read_bytes()[:20])
    return rf"{re.escape(str(path))} is truncated or not a safetensors file: its header would end at byte"


def _scramble_header(path):
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))
    return rf"{re.escape(str(path))} has a corrupt safetensors header"


def _empty(path):
    path.write_bytes(b"")
    return rf"{re.escape(str(path))} ends inside its header length: the file is truncated"


@pytest.mark.parametrize("damage", [_cut_data, _cut_header, _scramble_header, _empty])
def test_truncated_or_corrupt_safetensors_is_an_error_naming_the_file(opt_checkpoint, tmp_path, damage):
    folder = copy_checkpoint(opt_checkpoint[0], tmp_path)
    message = damage(folder / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_pretrained(folder)


def test_index_naming_a_tensor_its_shard_lacks_is_an_error(tmp_path):
    save(tiny_hf_model(LAYOUTS["olmo2_gqa"]()), tmp_path, sharded=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first_shard = min(index["weight_map"].values())
    name = next(name for name, shard in index["weight_map"].items() if shard != first_shard)
    index["weight_map"][name] = first_shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=rf"puts '{re.escape(name)}' in {re.escape(first_shard)}, which does not hold it"
    ):
        load_pretrained(tmp_path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda text: text[: len(text) // 2], "is not valid JSON"),  # cut short, as an interrupted copy leaves it
        (lambda text: json.dumps({"metadata": {}}), 'has no "weight_map" object'),
    ],
)
def test_an_unreadable_shard_index_is_an_error_naming_it(tmp_path, damage, message):
    save(tiny_hf_model(LAYOUTS["olmo2_gqa"]()), tmp_path, sharded=True)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(damage(index.read_text()))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(index))} {message}"):
        load_pretrained(tmp_path)


def test_a_truncated_config_json_is_an_error_naming_it(tmp_path):
    save(tiny_hf_model(LAYOUTS["olmo2_gqa"]()), tmp_path)
    config = tmp_path / "config.json"
    config.write_text(config.read_text()[:40])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(config))} is not valid JSON"):
        load_pretrained(tmp_path)


def test_hub_id_offline_fails_clearly():
    with pytest.raises(NotFetchedError, match=r"^'oodjax-tests/not-a-model' is not a local folder.*HF_HUB_OFFLINE"):
        load_pretrained("oodjax-tests/not-a-model")


def test_a_path_that_is_neither_a_folder_nor_a_hub_id_is_named(tmp_path):
    with pytest.raises(MissingInputError, match=r"'.*/no/such/folder' is neither a local folder nor a hub id"):
        load_pretrained(tmp_path / "no" / "such" / "folder")


def test_non_float_dtype_is_refused(opt_checkpoint):
    with pytest.raises(ValueError, match=r"dtype must be a floating type.*int32"):
        load_pretrained(opt_checkpoint[0], dtype="int32")


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type 'dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, r"'llama3' needs 'low_freq_factor'"),
        ({"hidden_act": "gelu_new"}, r"activation 'gelu_new' is not supported"),
    ],
)
def test_unsupported_llama_configs_are_refused(edit, message):
    config = {**LAYOUTS["smollm2_tied_gqa"]().to_dict(), **edit}
    with pytest.raises(ValueError, match=message):
        from_config(config)


@pytest.mark.parametrize("layout", ["qwen2_sliding", "smollm3_sliding", "mistral_sliding", "qwen3_qk_norm"])
def test_sliding_windows_are_the_layers_transformers_slides(layout):
    """Our per-layer windows against transformers' own config: its layer_types where it has them (Mistral
    slides every layer by sliding_window), and the same when an older config.json lacks the list."""
    hf_config = LAYOUTS[layout]()
    if layout == "mistral_sliding":
        expected = (hf_config.sliding_window,) * hf_config.num_hidden_layers
    else:
        expected = tuple(
            hf_config.sliding_window if kind == "sliding_attention" else None for kind in hf_config.layer_types
        )
    raw = hf_config.to_dict()
    assert from_config(raw).config.layer_windows == expected
    raw.pop("layer_types", None)
    assert from_config(raw).config.layer_windows == expected
    assert any(expected) == (layout != "qwen3_qk_norm")


GEMMA_TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=3,
)


@pytest.mark.parametrize(
    "hf_config",
    [
        transformers.Gemma2Config(num_hidden_layers=5, **GEMMA_TINY),
        transformers.Gemma3TextConfig(num_hidden_layers=7, **GEMMA_TINY),
        transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window_pattern=3, **GEMMA_TINY),
    ],
    ids=["gemma2", "gemma3", "gemma3_pattern3"],
)
def test_gemma_layers_slide_as_transformers_decides(hf_config):
    """Gemma 2 slides every other layer from the first, Gemma 3 all but every sliding_window_pattern-th: from
    transformers' own layer_types, and the same when an older config.json lacks the list."""
    window = hf_config.sliding_window
    expected = tuple(window if kind == "sliding_attention" else None for kind in hf_config.layer_types)
    raw = hf_config.to_dict()
    assert config_from_dict(raw).layer_windows == expected
    raw.pop("layer_types")
    assert config_from_dict(raw).layer_windows == expected
    assert None in expected and 3 in expected


def test_gemma3_older_rope_keys_mean_what_transformers_reads():
    """Hub config.json files of Gemma 3 spell its two RoPEs as rope_theta + rope_scaling (the full layers')
    and rope_local_base_freq (the sliding layers'); transformers 5 saves rope_parameters per layer type."""
    legacy = dict(rope_theta=500000.0, rope_local_base_freq=1000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    current = transformers.Gemma3TextConfig(num_hidden_layers=2, **GEMMA_TINY, **legacy).to_dict()
    assert set(current["rope_parameters"]) == {"sliding_attention", "full_attention"}
    older = {key: value for key, value in current.items() if key != "rope_parameters"} | legacy
    ours = [config_from_dict(raw) for raw in (current, older)]
    assert ours[0].rope == ours[1].rope and ours[0].local_rope == ours[1].local_rope
    assert (ours[1].rope.rope_type, ours[1].rope.factor, ours[1].rope.theta) == ("linear", 8.0, 500000.0)
    assert (ours[1].local_rope.rope_type, ours[1].local_rope.theta) == ("default", 1000.0)


@pytest.mark.parametrize(
    "layout, edit, message",
    [
        ("gemma3_local_rope", {"use_bidirectional_attention": True}, r"use_bidirectional_attention is not supported"),
        ("gemma2_softcap_sliding", {"sliding_window": None}, r"sliding_attention layers but sliding_window is null"),
        (
            "phi3_fused_sliding",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            r"phi3 rope_type 'linear' is not supported",
        ),
        (
            "phi3_fused_sliding",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
            r"partial_rotary_factor != 1 is not supported",
        ),  # Phi-4-mini's
    ],
)
def test_unsupported_gemma_and_phi3_configs_are_refused(layout, edit, message):
    config = {**LAYOUTS[layout]().to_dict(), **edit}
    with pytest.raises(ValueError, match=message):
        config_from_dict(config)


def test_gemma2_null_soft_caps_turn_them_off_as_in_transformers():
    """A soft cap written as null means no cap (not the default of 50 / 30), as transformers reads it."""
    raw = LAYOUTS["gemma2_softcap_sliding"]().to_dict()

    def caps(raw):
        config = config_from_dict(raw)
        return config.attn_logit_softcapping, config.final_logit_softcapping

    assert caps(raw) == (0.5, 2.0)
    assert caps({**raw, "attn_logit_softcapping": None, "final_logit_softcapping": None}) == (None, None)
    del raw["attn_logit_softcapping"], raw["final_logit_softcapping"]
    assert caps(raw) == (50.0, 30.0)


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
            names, transposed = hf_parameter_names(path, hf_model.config.num_hidden_layers)
            shape = tuple(variable.shape[1:] if len(names) > 1 else variable.shape)  # stacked: [layers, ...]
            ours.update(dict.fromkeys(names, shape[::-1] if transposed else shape))
    assert ours == expected


@pytest.mark.parametrize("policy", ["full", "save_dots", "save_dots_except_mlp"])
def test_remat_policies_change_neither_logits_nor_gradients(policy):
    config = LAYOUTS["opt_350m_layout"]().to_dict()
    plain, remat = from_config(config, seed=1), from_config(config, seed=1, remat=policy)
    assert remat.config.remat == policy and plain.config.remat == "none"
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


def test_remat_policies_keep_what_they_name():
    """What one layer keeps for the backward pass: everything, nothing but its input, or the projections' outputs."""
    config = LAYOUTS["olmo2_gqa"]().to_dict()
    ids, mask = padded_batches(96)["right"]

    def saved(policy):
        model = from_config(config, seed=1, remat=policy)
        graphdef, state = nnx.split(model)
        # The residuals a backward pass needs are the leaves of the VJP's closure; the scan stacks a
        # layer's saved activations to [layers, batch, seq, ...] (weights have at most 3 axes).
        _, backward = jax.vjp(lambda s: nnx.merge(graphdef, s).hidden_states(ids, mask).sum(), state)
        return sum(np.prod(r.shape) for r in jax.tree.leaves(backward) if np.ndim(r) >= 4)

    sizes = {policy: saved(policy) for policy in ("none", "save_dots", "save_dots_except_mlp", "full")}
    assert sizes["none"] > sizes["save_dots"] > sizes["save_dots_except_mlp"] > sizes["full"] > 0, sizes
    with pytest.raises(ValueError, match=r"remat policy 'minimal' is not one of"):
        from_config(config, remat="minimal")


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
    layers = model.model.layers  # stacked: a leading, replicated layer axis
    expected = {
        "embed [vocab, embed]": (model.model.embed_tokens.embedding, P("tensor", "fsdp")),
        "q_proj [layers, embed, heads]": (layers.self_attn.q_proj.kernel, P(None, "fsdp", "tensor")),
        "k_proj [layers, embed, kv_heads]": (layers.self_attn.k_proj.kernel, P(None, "fsdp", "tensor")),
        "o_proj [layers, heads, embed]": (layers.self_attn.o_proj.kernel, P(None, "tensor", "fsdp")),
        "down_proj [layers, mlp, embed]": (layers.mlp.down_proj.kernel, P(None, "tensor", "fsdp")),
        "norm [layers, norm]": (layers.input_layernorm.scale, P(None, None)),
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
    assert sharded_state["model"]["decoder"]["layers"]["fc1"]["kernel"][...].sharding.spec == P(None, "fsdp", "tensor")
    ids, mask = padded_batches(96)["right"]
    logits = jax.jit(lambda s: nnx.merge(graphdef, s)(ids, mask))(sharded_state)
    np.testing.assert_allclose(logits, jitted(model)(ids, mask)[0], atol=1e-5)


# ----------------------------------------------------------------------------- reading slices


# The three ways a tensor file can be written: safetensors, torch.save's zip format and its legacy format.
WRITERS = {
    "safetensors": lambda tensors, folder: save_file(tensors, folder / "model.safetensors"),
    "pickle-zip": lambda tensors, folder: torch.save(tensors, folder / "pytorch_model.bin"),
    "pickle-legacy": lambda tensors, folder: torch.save(
        tensors, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False
    ),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize(
    "dtype, numpy_dtype", [(torch.float32, np.float32), (torch.float16, np.float16), (torch.bfloat16, jnp.bfloat16)]
)
def test_slices_read_only_their_rows_and_equal_the_full_tensor(tmp_path, writer, dtype, numpy_dtype, monkeypatch):
    """Each slice equals numpy's slice of the whole tensor, in the stored dtype, from reading only its rows."""
    torch.manual_seed(0)
    tensors = {"a.first": torch.randn(5, dtype=dtype), "b.matrix": torch.randn(13, 6, dtype=dtype)}
    WRITERS[writer](tensors, tmp_path)
    full = tensors["b.matrix"].float().numpy()  # exact: float32 holds every float16 and bfloat16
    row_bytes = 6 * tensors["b.matrix"].element_size()
    read_sizes, read_into = [], TensorFile._read_into

    def counted_read_into(self, buffer, offset, what):
        read_sizes.append(len(memoryview(buffer)))
        read_into(self, buffer, offset, what)

    monkeypatch.setattr(TensorFile, "_read_into", counted_read_into)
    with contextlib.ExitStack() as stack:
        checkpoint = open_checkpoint(tmp_path, stack=stack)
        for index, rows_read in [
            ((slice(3, 7), slice(None)), 4),
            ((slice(None), slice(2, 5)), 13),
            ((slice(12, 13), slice(1, 6)), 1),
            ((slice(None, None, -2), slice(None)), 13),
            ((slice(4, 4), slice(None)), 0),
        ]:
            read_sizes.clear()
            block = checkpoint.read("b.matrix", index)
            assert block.dtype == numpy_dtype
            np.testing.assert_array_equal(block.astype(np.float32), full[index])
            assert read_sizes == [rows_read * row_bytes], index
        np.testing.assert_array_equal(
            checkpoint.read("a.first", (slice(1, 4),)).astype(np.float32), tensors["a.first"].float().numpy()[1:4]
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sharded_half_precision_checkpoint_fills_every_device_block_exactly(tmp_path, dtype):
    """On a mesh each device's block is read from its rows alone; all blocks equal the stored tensor's."""
    hf_model = tiny_hf_model(LAYOUTS["olmo2_gqa"]()).to(dtype)
    save(hf_model, tmp_path, sharded=True)
    stored = hf_model.state_dict()
    model = load_pretrained(tmp_path, mesh=auto_mesh(), dtype="float32")
    sharded = 0
    for path, variable in nnx.iter_graph(model):
        if not isinstance(variable, nnx.Param):
            continue
        names, transposed = hf_parameter_names(path, hf_model.config.num_hidden_layers)
        expected = np.stack([stored[name].float().numpy() for name in names])
        expected = np.swapaxes(expected, -1, -2) if transposed else expected
        expected = expected if len(names) > 1 else expected[0]  # stacked layers: [layers, ...]
        name = names[0]
        array = variable[...]
        sharded += not array.sharding.is_fully_replicated
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index], err_msg=name)
    assert sharded > 0


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (1, 1, 8), (2, 2, 2)])
def test_each_tensor_is_read_once_whatever_the_mesh(tmp_path, mesh_shape):
    """Bytes this process reads while loading (the kernel's count, /proc/self/io) are at most the checkpoint's.

    Reading per device block would read an fsdp-sharded tensor once per device (8x here).
    """
    hf_model = tiny_hf_model(LAYOUTS["olmo2_gqa"]())
    save(hf_model, tmp_path, sharded=True)
    checkpoint_bytes = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    mesh = jax.make_mesh(mesh_shape, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)

    def bytes_read():
        return int(re.search(r"rchar: (\d+)", pathlib.Path("/proc/self/io").read_text()).group(1))

    load_pretrained(tmp_path, mesh=mesh)  # warm-up: imports and compilations read files too
    before = bytes_read()
    model = load_pretrained(tmp_path, mesh=mesh)
    read = bytes_read() - before
    assert read <= 1.05 * checkpoint_bytes, (read, checkpoint_bytes)
    assert_matches_hf(model, hf_model, 96)
