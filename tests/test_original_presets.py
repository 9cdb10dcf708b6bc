"""configs/original/: each preset is its study config with exactly the predecessor code's protocol choices.

The expected values are written here from the source, ilboglions/DL2024 at
commit d382ab19319db65acce2cf678638905a78fc825f (the file of each is beside
it), not read from configs/original; docs/protocol.md has the whole
comparison.
"""

import json
import pathlib

import datasets
import huggingface_hub
import pytest

from configs import base
from configs.models import MODELS, TRAIN_SETS, model_config
from configs.original import preset
from oodjax import config_checks
from oodjax.config_cli import apply_overrides, load_config_file
from oodjax.data import testsets
from oodjax.job import read
from oodjax.models.lora import ATTENTION_PROJECTIONS
from oodjax.usage_errors import NotFetchedError

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESETS = ROOT / "configs" / "original"

# The fields the presets change, and the predecessor's value of each.
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
    "train.epochs": 40.0,  # num_train_epochs=40
    "train.warmup_ratio": 0.1,  # warmup_ratio=0.1, lr_scheduler_type left at the Trainer's "linear"
    # Not the predecessor's (it evaluated every 2,000 steps): the study configs' 20 evaluations after step 0.
    "eval.points": 20,
}
# Where the predecessor agrees with oodjax's defaults: the presets keep them.
AGREED = {
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

GRID = [(model, train_set) for model in MODELS for train_set in TRAIN_SETS]
IDS = [f"{model}_{train_set}" for model, train_set in GRID]


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


def test_every_model_and_training_set_has_a_preset_file_and_nothing_else():
    expected = {f"{model}_{train_set}.py" for model, train_set in GRID} | {"__init__.py"}
    assert {path.name for path in PRESETS.glob("*.py")} == expected


@pytest.mark.parametrize(("model", "train_set"), GRID, ids=IDS)
def test_a_preset_changes_exactly_the_protocol_fields_to_the_predecessors_values(model, train_set):
    loaded = load_config_file(str(PRESETS / f"{model}_{train_set}.py"))  # what `--config FILE` returns
    assert loaded.to_dict() == preset(model, train_set).to_dict()
    got, study, defaults = flat(loaded), flat(model_config(model, train_set)), flat(base.get_config())
    for field, value in {**CHANGED, **AGREED}.items():
        assert got[field] == value, field
    for field, value in CHANGED.items():
        assert defaults[field] != value, f"{field} is oodjax's default already: not a change"
    differing = {field for field in got if got[field] != study[field]}
    assert differing <= set(CHANGED), sorted(differing - set(CHANGED))
    job = read(loaded)  # 40 epochs of 32, 64, 128 shots at batch 32; 10% of each, rounded up, to warm up
    lengths = {shots: job.of_length(job.total_steps(shots)) for shots in (32, 64, 128)}
    assert {shots: run.optimizer.total_steps for shots, run in lengths.items()} == {32: 40, 64: 80, 128: 160}
    assert {shots: run.optimizer.warmup_steps for shots, run in lengths.items()} == {32: 4, 64: 8, 128: 16}
    assert lengths[32].cadence.evaluated_steps() == list(range(0, 41, 2))
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
    for model, train_set in GRID:
        config = load_config_file(str(PRESETS / f"{model}_{train_set}.py"))
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
