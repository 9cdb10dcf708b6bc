"""configs/original/ and configs/llmft/: each preset is its study config with exactly its source's choices.

The expected values are written here from the sources, not read from the
presets: ilboglions/DL2024 at commit d382ab19319db65acce2cf678638905a78fc825f
for configs/original, uds-lsv/llmft at commit
3acc3894fa4111d9155190a98a147e3e664ff3da for configs/llmft (the file of each
is beside it); docs/protocol.md has the whole comparison.
"""

import json
import pathlib

import datasets
import huggingface_hub
import numpy as np
import pytest

from configs import base, llmft, original
from configs.models import MODELS, TRAIN_SETS, model_config
from oodjax import config_checks
from oodjax.config_cli import apply_overrides, load_config_file
from oodjax.config_read import read
from oodjax.data import testsets
from oodjax.models.lora import ATTENTION_PROJECTIONS
from oodjax.usage_errors import NotFetchedError

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESETS = ROOT / "configs" / "original"

# The fields the original presets change, and the predecessor's value of each.
CHANGED = {
    # configs/opt.toml, configs/olmo.toml: prompt='{premise}Question: {hypothesis} Yes or No?'
    "data.template": "{premise}Question: {hypothesis} Yes or No?",
    # configs/opt.toml, configs/olmo.toml: [dataset.train] dataset_split='train'
    "data.pool_split": "train",
    # src/data/NLIDataset.py, SciTailDataset: fmt = 'dgem_format'
    "data.extra_testsets": {"scitail": {"config": "dgem_format"}},
    # configs/opt.toml, configs/olmo.toml, [model.training]
    "train.learning_rate": 1e-5,
    "train.weight_decay": 0.01,
    "train.batch_size": 32,  # per_device_train_batch_size
    "train.epochs": 40.0,  # num_train_epochs=40 (over the whole training split: a placeholder here)
}
# Where the predecessor agrees with oodjax's defaults: the presets keep them.
AGREED = {
    "train.warmup_ratio": 0.1,  # warmup_ratio=0.1, lr_scheduler_type left at the Trainer's "linear"
    "train.schedule": "linear",
    "data.answers": (" Yes", " No"),  # configs/*.toml: answer_tokens=[' Yes', ' No']
    "lora.rank": 8,  # [model.LoRA] r=8
    "lora.alpha": 32.0,  # lora_alpha=32
    "lora.dropout": 0.1,  # lora_dropout=0.1
    "lora.targets": (),  # oodjax's default: the attention projections, as target_modules below
    "data.neutral": "drop",  # src/data/NLIDataset.py: SNLI and ANLI filter out label 1
    "data.eval_cap": 0,  # the whole test splits
}
TARGET_MODULES = {  # [model.LoRA] target_modules
    "opt": ("k_proj", "v_proj", "q_proj", "out_proj"),  # configs/opt.toml
    "olmo": ("q_proj", "k_proj", "v_proj", "o_proj"),  # configs/olmo.toml
}
# configs/*.toml, [[dataset.test]] dataset_name/dataset_split, and src/data/NLIDataset.py's hub ids and configs
# (SNLI, HANS and ANLI are loaded naming no config: each has one, plain_text).
EVALUATED = {
    "snli": ("stanfordnlp/snli", "plain_text", "test"),
    "mnli": ("nyu-mll/glue", "mnli", "validation_matched"),
    "scitail": ("allenai/scitail", "dgem_format", "test"),
    "wnli": ("nyu-mll/glue", "wnli", "train"),
    "rte": ("nyu-mll/glue", "rte", "train"),
    "paws": ("google-research-datasets/paws", "labeled_final", "test"),
    "hans": ("jhu-cogsci/hans", "plain_text", "validation"),
    "anli": ("facebook/anli", "plain_text", "test_r3"),
}
# Offline stand-ins for the splits the presets read that the shared mirror lacks: a file of the same columns and
# label values, so that the checks find a file (real runs fetch the real splits with oodjax-fetch).
STAND_INS = {
    "nyu-mll/glue/mnli/train.jsonl": "nyu-mll/glue/mnli/validation_mismatched.jsonl",
    "stanfordnlp/snli/plain_text/train.jsonl": "stanfordnlp/snli/plain_text/validation.jsonl",
    "allenai/scitail/dgem_format/test.jsonl": "allenai/scitail/tsv_format/test.jsonl",
}

# configs/llmft: experiments/pattern_verbalizer_ft/lora.sh runs scripts/pattern_verbalizer_ft/mnli/lora.sh with
# "mnli 32 80 0.25 4 8 2e-4 facebook/opt-30b 8 -1": the fields the llmft presets change, and llmft's value of each.
LLMFT_CHANGED = {
    "train.learning_rate": 2e-4,  # learning_rate=2e-4
    "train.batch_size": 32,  # bsz=4 per device x num_gpus=8, gradient_accumulation_steps 1
    "train.epochs": 80.0,  # epochs=80
    "train.warmup_ratio": 0.25,  # warmup_ratio=0.25
    "lora.alpha": 8.0,  # lora_alpha=-1: a trainable scale starting at 1 (models/opt_wrapper.py): alpha / rank = 1
    "eval.points": 80,  # --evaluation_strategy epoch: one evaluation per epoch
}
LLMFT_AGREED = {
    "lora.rank": 8,  # adapter_dim=8
    "train.weight_decay": 0.0,  # --weight_decay 0.0
    "train.schedule": "linear",  # lr_scheduler_type left at the Trainer's "linear"
}
# Each family: its module, the fields it changes and those it keeps as its source has them, and each shot count's
# steps (epochs x shots / 32), warm-up (the ratio of them, rounded up) and evaluations after step 0.
FAMILIES = {
    "original": (original, CHANGED, AGREED, {32: 40, 64: 80, 128: 160}, {32: 4, 64: 8, 128: 16}, 20),
    "llmft": (llmft, LLMFT_CHANGED, LLMFT_AGREED, {32: 80, 64: 160, 128: 320}, {32: 20, 64: 40, 128: 80}, 80),
}

GRID = [(model, train_set) for model in MODELS for train_set in TRAIN_SETS]
IDS = [f"{model}_{train_set}" for model, train_set in GRID]
FAMILY_GRID = [(family, model, train_set) for family in FAMILIES for model, train_set in GRID]
FAMILY_IDS = [f"{family}/{model}_{train_set}" for family, model, train_set in FAMILY_GRID]


def flat(config) -> dict:
    """Every field of a config as {"section.field": value}, lists as tuples, declared testsets as one dict."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict) and prefix not in ("data.extra_testsets", "model.hf_config"):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        else:
            out[prefix] = tuple(value) if isinstance(value, list) else value

    walk("", config.to_dict())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_model_and_training_set_has_a_preset_file_and_nothing_else(family):
    expected = {f"{model}_{train_set}.py" for model, train_set in GRID} | {"__init__.py"}
    assert {path.name for path in (ROOT / "configs" / family).glob("*.py")} == expected


@pytest.mark.parametrize(("family", "model", "train_set"), FAMILY_GRID, ids=FAMILY_IDS)
def test_a_preset_changes_exactly_its_source_s_fields_to_its_values(family, model, train_set):
    module, changed, agreed, steps, warmups, points = FAMILIES[family]
    loaded = load_config_file(str(ROOT / "configs" / family / f"{model}_{train_set}.py"))  # `--config FILE`'s
    assert loaded.to_dict() == module.preset(model, train_set).to_dict()
    got, study, defaults = flat(loaded), flat(model_config(model, train_set)), flat(base.get_config())
    for field, value in {**changed, **agreed}.items():
        assert got[field] == value, field
    for field, value in changed.items():
        assert defaults[field] != value, f"{field} is oodjax's default already: not a change"
    differing = {field for field in got if got[field] != study[field]}
    assert differing <= set(changed), sorted(differing - set(changed))
    job = read(loaded)
    lengths = {run.shots: group for group in job.groups for run in group.runs}
    assert {shots: run.optimizer.total_steps for shots, run in lengths.items()} == steps
    assert {shots: run.optimizer.warmup_steps for shots, run in lengths.items()} == warmups
    for shots, run in lengths.items():  # step 0 and P more, floor(k T / P), the last at the run's end
        assert run.cadence.evaluated_steps() == [k * steps[shots] // points for k in range(points + 1)]
        # Linear warm-up over W steps, linear decay to 0 at T: the rates of steps 0..T-1 sum to peak x T / 2.
        schedule = run.optimizer.learning_rate_schedule
        summed = sum(float(schedule(step)) for step in range(steps[shots]))
        np.testing.assert_allclose(summed, got["train.learning_rate"] * steps[shots] / 2, rtol=1e-5)
    if family == "llmft":
        return  # its template, testsets and adapter targets are the study config's, checked above
    table = testsets.testset_table(loaded.data.extra_testsets.to_dict())
    assert set(loaded.data.testsets) == set(EVALUATED)
    for name, (source, config, split) in EVALUATED.items():
        spec = table[name]
        assert (spec.source, spec.config, spec.split) == (source, config, split), name
    family = "opt" if MODELS[model].architecture["model_type"] == "opt" else "olmo"
    if model != "smol3":  # the predecessor had no SmolLM
        assert set(TARGET_MODULES[family]) <= set(ATTENTION_PROJECTIONS)


def test_overrides_apply_to_a_preset_as_to_any_config():
    config = load_config_file(str(PRESETS / "opt2.7_mnli.py"))
    apply_overrides(config, ["--config.train.batch_size=16", "--config.data.template={premise} Q: {hypothesis}"])
    assert (config.train.batch_size, config.data.template) == (16, "{premise} Q: {hypothesis}")


@pytest.fixture
def offline_caches(tmp_path, monkeypatch):
    """Neither `datasets` nor huggingface_hub has cached anything: only the mirror can give a split; and a
    model folder needs no weights."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    # `checkable`'s model folders hold config.json alone, no weights: the checks of a checkpoint's files have
    # their own tests (test_user_errors.py); these are about the presets' fields and the splits they read.
    monkeypatch.setattr(config_checks, "_check_checkpoint", lambda directory: None)


def mirror_of(hf_data_dir: pathlib.Path, root: pathlib.Path, stand_ins) -> pathlib.Path:
    """The shared mirror, file by file as links, with `stand_ins` (a path -> the shared file it links to) added."""
    for path in hf_data_dir.rglob("*"):
        if path.is_file():
            (root / path.relative_to(hf_data_dir)).parent.mkdir(parents=True, exist_ok=True)
            (root / path.relative_to(hf_data_dir)).symlink_to(path)
    for path, shared in stand_ins.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).symlink_to(hf_data_dir / shared)
    return root


def checkable(config, model: str, tmp_path: pathlib.Path, tokenizer: pathlib.Path, data_dir: pathlib.Path):
    """The preset pointed at offline inputs: a folder holding the checkpoint's config.json numbers (from
    configs/models.py), the GPT-2 tokenizer, a mirror, and folders of its own."""
    folder = tmp_path / "models" / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(MODELS[model].architecture)))
    config.model.path = str(folder)
    config.tokenizer = str(tokenizer)
    config.data.data_dir = str(data_dir)
    config.data.cache_dir = str(tmp_path / "cache")
    config.output_dir = str(tmp_path / "out")
    return config


def test_the_config_checks_accept_every_preset(tmp_path, offline_caches, hf_data_dir, gpt2_tokenizer_dir):
    data_dir = mirror_of(hf_data_dir, tmp_path / "mirror", STAND_INS)
    for family, model, train_set in FAMILY_GRID:
        config = load_config_file(str(ROOT / "configs" / family / f"{model}_{train_set}.py"))
        config_checks.check_config(checkable(config, model, tmp_path, gpt2_tokenizer_dir, data_dir))


def test_the_checks_ask_for_the_splits_the_presets_read(tmp_path, offline_caches, hf_data_dir, gpt2_tokenizer_dir):
    """The shared mirror lacks SciTail's dgem_format and MNLI's training split: the preset's fields are live."""
    config = checkable(
        load_config_file(str(PRESETS / "opt2.7_mnli.py")),
        "opt2.7",
        tmp_path,
        gpt2_tokenizer_dir,
        mirror_of(hf_data_dir, tmp_path / "plain", {}),
    )
    with pytest.raises(NotFetchedError, match=r"no local file for allenai/scitail/dgem_format split 'test'"):
        config_checks.check_config(config)
    dgem = {path: shared for path, shared in STAND_INS.items() if "scitail" in path}
    config.data.data_dir = str(mirror_of(hf_data_dir, tmp_path / "with_dgem", dgem))
    with pytest.raises(NotFetchedError, match=r"no local file for nyu-mll/glue/mnli split 'train'"):
        config_checks.check_config(config)
