"""export.peft: each run's trained adapters land in <run_dir>/adapter/ as PEFT files that peft loads onto the
transformers model; a push to the hub that cannot happen is refused before anything trains."""

import json
import pathlib

import numpy as np
import peft
import pytest
import safetensors.numpy
import transformers

from oodjax import config_checks
from oodjax.config_checks import check_config
from oodjax.engine import hooks, loop, results, steps
from oodjax.models.lora import peft_tensors
from tests.engine_configs import TINY_OPT, tiny_config


@pytest.fixture
def config(tmp_path, gpt2_tokenizer_dir, hf_data_dir):
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.export.peft = True
    return config


def test_each_run_exports_its_own_final_adapters_which_peft_loads(config, monkeypatch):
    finished = []
    original_run = loop._Loop.run

    def keep_loop(self):
        original_run(self)
        finished.append(self)

    monkeypatch.setattr(loop._Loop, "run", keep_loop)
    exports = []
    original_export = hooks.export_peft
    monkeypatch.setattr(hooks, "export_peft", lambda *a, **k: exports.append(a[2]) or original_export(*a, **k))
    runs = loop.train(check_config(config))
    (trained,) = finished
    assert len(exports) == len(runs)  # at the end only (checkpoints at steps 2 and 4)
    for r, run in enumerate(runs):
        folder = run.directory / results.ADAPTER_DIR
        written = safetensors.numpy.load_file(folder / "adapter_model.safetensors")
        expected = peft_tensors(steps.select_run(trained.state.lora, r))
        assert sorted(written) == sorted(expected)
        for name, value in expected.items():
            np.testing.assert_array_equal(written[name], value, err_msg=name)
        adapter_config = json.loads((folder / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == "opt-tiny"
        assert (adapter_config["r"], adapter_config["lora_alpha"]) == (config.lora.rank, config.lora.alpha)
    first, second = (
        safetensors.numpy.load_file(run.directory / results.ADAPTER_DIR / "adapter_model.safetensors") for run in runs
    )
    assert any(not np.array_equal(first[name], second[name]) for name in first)  # each run its own

    hf_model = transformers.OPTForCausalLM(transformers.OPTConfig(**TINY_OPT)).eval()
    peft_model = peft.PeftModel.from_pretrained(hf_model, runs[0].directory / results.ADAPTER_DIR)
    loaded = {name: param.detach().numpy() for name, param in peft_model.named_parameters() if "lora_" in name}
    assert len(loaded) == len(first) == 2 * 2 * 4  # A and B, 2 layers, q/k/v/out_proj
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, first[name.replace(".default", "")], err_msg=name)


def test_every_checkpoint_exports_and_pushes_each_time_and_a_finished_rerun_exports_again(config, monkeypatch):
    """The hub is faked (online, recording the calls): each export pushes every run's folder under its name."""
    config.export.every_checkpoint = True
    config.export.hub_repo = "someone/adapters"
    monkeypatch.setattr(config_checks, "hub_offline", lambda: False)
    pushes = []
    monkeypatch.setattr(hooks.huggingface_hub, "create_repo", lambda repo_id, exist_ok: None)
    monkeypatch.setattr(hooks.huggingface_hub, "upload_folder", lambda **kwargs: pushes.append(kwargs))
    runs = loop.train(check_config(config))
    names = [run.name for run in runs]
    assert [push["path_in_repo"] for push in pushes] == names * 2  # steps 2 and 4
    assert {push["repo_id"] for push in pushes} == {"someone/adapters"}
    assert [push["folder_path"] for push in pushes[:2]] == [run.directory / results.ADAPTER_DIR for run in runs]
    assert pushes[0]["commit_message"].endswith("step 2") and pushes[-1]["commit_message"].endswith("step 4")
    pushes.clear()
    loop.train(check_config(config))  # finished already: restores step 4 and exports (and pushes) its adapters
    assert [push["path_in_repo"] for push in pushes] == names
    assert pushes[0]["commit_message"].endswith("step 4")


def test_a_hub_push_offline_is_refused_before_training(config):
    config.export.hub_repo = "someone/adapters"
    with pytest.raises(ValueError, match="pushes adapters to the Hugging Face hub, but HF_HUB_OFFLINE is set"):
        loop.train(check_config(config))
    assert not pathlib.Path(config.output_dir).exists()
