"""PEFT adapters in: an adapter that peft itself created and saved loads onto our model with peft's logits,
and an adapter that does not fit (another rank, a layer too many, DoRA) is an error naming the folder."""

import json

import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
from flax import nnx
from test_lora import logits
from test_models_parity import LAYOUTS, padded_batches, save, tiny_hf_model

from oodjax.models import load_pretrained
from oodjax.models.lora import LoRAConfig, apply_lora, lora_from_peft, read_peft

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    """A tiny Qwen2 (biases, tied) with a peft adapter of random A and B, saved by peft's save_pretrained."""
    folder = tmp_path_factory.mktemp("peft")
    hf_model = tiny_hf_model(LAYOUTS["qwen2_bias_tied"]())
    base = save(hf_model, folder / "base")
    config = peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.1, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(0)
    peft_model = peft.get_peft_model(hf_model, config).eval()
    peft_model.save_pretrained(folder / "adapter")
    return base, folder / "adapter", peft_model


def adapted_model(base, cfg: LoRAConfig, tensors, source="adapter"):
    model = load_pretrained(base)
    apply_lora(model, cfg, rngs=nnx.Rngs(0))
    nnx.update(model, lora_from_peft(nnx.state(model, nnx.LoRAParam), tensors, source=source))
    return model


def test_an_adapter_peft_saved_gives_peft_logits(peft_adapter):
    base, folder, peft_model = peft_adapter
    cfg, tensors = read_peft(folder)
    assert (cfg.rank, cfg.alpha, sorted(cfg.targets)) == (4, 12.0, sorted(TARGETS))
    model = adapted_model(base, cfg, tensors)
    base_logits = logits(load_pretrained(base), *padded_batches(96)["right"])
    for side, (ids, mask) in padded_batches(96).items():
        ours = logits(nnx.view(model, deterministic=True), ids, mask)
        with torch.no_grad():
            theirs = peft_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        at_tokens = mask.astype(bool)
        if side == "right":
            assert np.abs(ours - base_logits)[at_tokens].max() > 1e-2  # the adapter matters
        np.testing.assert_allclose(ours[at_tokens], theirs[at_tokens], atol=1e-4, err_msg=side)


def test_adapters_that_do_not_fit_are_errors_naming_the_folder(peft_adapter, tmp_path):
    base, folder, _ = peft_adapter
    cfg, tensors = read_peft(folder)
    model = load_pretrained(base)
    apply_lora(model, cfg, rngs=nnx.Rngs(0))
    like = nnx.state(model, nnx.LoRAParam)
    name = next(iter(tensors))
    with pytest.raises(ValueError, match=rf"here: adapter tensor {name.replace('.', '[.]')} is missing"):
        lora_from_peft(like, {k: v for k, v in tensors.items() if k != name}, source="here")
    extra = dict(tensors, **{name.replace("layers.0", "layers.7"): tensors[name]})
    with pytest.raises(ValueError, match=r"here: 1 tensors match no adapter.*layers\.7"):
        lora_from_peft(like, extra, source="here")
    wider = {k: np.concatenate([v, v], axis=0 if "lora_A" in k else 1) for k, v in tensors.items()}
    shapes = r"model.layers.mlp.down_proj.lora.lora_a has shape \(2, 48, 8\) in the file, \(2, 48, 4\) in the model"
    with pytest.raises(ValueError, match=f"here: {shapes}"):
        lora_from_peft(like, wider, source="here")

    dora = tmp_path / "dora"
    dora.mkdir()
    safetensors.numpy.save_file(tensors, str(dora / "adapter_model.safetensors"))
    settings = json.loads((folder / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(dict(settings, use_dora=True)))
    with pytest.raises(ValueError, match=r"dora/adapter_config.json: use_dora=True is not supported"):
        read_peft(dora)
    (dora / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4,')
    with pytest.raises(ValueError, match=r"dora/adapter_config.json: not valid JSON"):
        read_peft(dora)
    with pytest.raises(FileNotFoundError, match=r"has no adapter_config.json \(not a PEFT adapter\)"):
        read_peft(tmp_path)
