"""`check_config` on declared testsets and answer words: each mistake named by its field before anything loads."""

import json
import re

import datasets
import httpx
import huggingface_hub
import pytest
from huggingface_hub.errors import RepositoryNotFoundError

from oodjax import config_checks
from oodjax.usage_errors import ConfigError
from tests.engine_configs import tiny_config

RTE_DECLARATION = {
    "source": "nyu-mll/glue",
    "config": "rte",
    "split": "validation",
    "premise": "sentence1",
    "hypothesis": "sentence2",
    "label": "label",
    "entailment": [0],
    "not_entailment": [1],
}


@pytest.fixture
def config(tmp_path, gpt2_tokenizer_dir, hf_data_dir):
    return tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")


@pytest.fixture
def empty_hub_caches(tmp_path, monkeypatch):
    """Neither `datasets` nor huggingface_hub has cached anything (whatever this machine's caches hold)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    return tmp_path


def declare(config, testsets, **declarations):
    config.data.extra_testsets = declarations
    config.data.testsets = testsets


def test_declared_testsets_and_overrides_pass(config, tmp_path):
    (tmp_path / "mine.csv").write_text("p,h,y\na,b,0\n")
    declare(
        config,
        ("mnli", "rte_val", "mine", "anli"),
        rte_val=RTE_DECLARATION,
        anli={"split": "test_all"},
        mine={
            "source": str(tmp_path / "mine.csv"),
            "premise": "p",
            "hypothesis": "h",
            "label": "y",
            "entailment": [0],
            "not_entailment": [1],
        },
    )
    config_checks.check_config(config)


def test_a_testset_neither_built_in_nor_declared_is_named(config):
    declare(config, ("mnli", "rte_vall"), rte_val=RTE_DECLARATION)
    with pytest.raises(
        ConfigError, match="data.testsets: unknown testset 'rte_vall'; known testsets: snli, .*, anli, rte_val"
    ):
        config_checks.check_config(config)


def test_a_bad_declaration_is_named_with_its_field(config):
    declare(config, ("mnli", "rte_val"), rte_val={**RTE_DECLARATION, "entailment": [0, 1]})
    with pytest.raises(
        ValueError, match=r"^data.extra_testsets\['rte_val'\], field 'not_entailment': label values \[1\] are also"
    ):
        config_checks.check_config(config)


def test_a_declared_file_that_does_not_exist_is_named(config, tmp_path):
    declare(
        config,
        ("mnli", "mine"),
        mine={**RTE_DECLARATION, "source": str(tmp_path / "no.jsonl"), "config": None, "split": None},
    )
    with pytest.raises(
        FileNotFoundError, match=rf"^data.extra_testsets\['mine'\], field 'source': file {tmp_path}/no.jsonl does not"
    ):
        config_checks.check_config(config)


def test_a_split_missing_from_the_mirror_offline_and_uncached_is_named(config, empty_hub_caches):
    declare(config, ("mnli", "rte_test"), rte_test={**RTE_DECLARATION, "split": "test"})
    with pytest.raises(
        FileNotFoundError,
        match=r"^data.extra_testsets\['rte_test'\]: no local file for nyu-mll/glue/rte split 'test': looked for .*; "
        r"the hub is offline \(HF_HUB_OFFLINE\) and 'nyu-mll/glue' is not in its cache",
    ):
        config_checks.check_config(config)
    (empty_hub_caches / "datasets_cache" / "nyu-mll___glue").mkdir(parents=True)
    config_checks.check_config(config)  # cached: loading will say whether the split is there


def test_without_a_mirror_offline_a_built_in_must_be_cached(config, empty_hub_caches, monkeypatch):
    config.data.data_dir = ""
    monkeypatch.delenv("OODJAX_DATA_DIR")
    with pytest.raises(FileNotFoundError, match=r"^testset 'mnli': no local mirror .* 'nyu-mll/glue' is not in its"):
        config_checks.check_config(config)
    (empty_hub_caches / "hub_cache" / "datasets--nyu-mll--glue").mkdir(parents=True)
    (empty_hub_caches / "datasets_cache" / "jhu-cogsci___hans").mkdir(parents=True)
    config_checks.check_config(config)


def test_online_a_declared_hub_id_missing_from_the_mirror_is_looked_up(config, monkeypatch):
    looked_up = []

    def dataset_info(self, repo_id):
        looked_up.append(repo_id)
        if repo_id != "nyu-mll/glue":
            url = f"https://huggingface.co/api/datasets/{repo_id}"
            response = httpx.Response(404, request=httpx.Request("GET", url))
            raise RepositoryNotFoundError(f"404 Client Error: Repository Not Found for url: {url}", response=response)

    monkeypatch.setattr(config_checks, "hub_offline", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    declare(config, ("mnli", "hans", "rte_test"), rte_test={**RTE_DECLARATION, "split": "test"})
    config_checks.check_config(config)
    assert looked_up == ["nyu-mll/glue"]  # not the built-ins, nor the declared split the mirror has
    declare(config, ("mnli", "typo"), typo={**RTE_DECLARATION, "source": "nyu-mll/gleu"})
    with pytest.raises(
        FileNotFoundError,
        match=r"^data.extra_testsets\['typo'\], field 'source': hub dataset 'nyu-mll/gleu' cannot be read: "
        r"RepositoryNotFoundError: 404 Client Error",
    ):
        config_checks.check_config(config)


def test_train_is_not_a_testset_name(config):
    declare(config, ("mnli", "train"), train=RTE_DECLARATION)
    with pytest.raises(ValueError, match=r"^data.extra_testsets\['train'\]: 'train' is the results' name for each"):
        config_checks.check_config(config)


def test_a_declared_testset_is_not_a_training_set(config):
    declare(config, ("mnli", "rte_val"), rte_val=RTE_DECLARATION)
    config.data.train_set = "rte_val"
    with pytest.raises(
        ValueError,
        match=r"data.train_set 'rte_val' is not a training set; few-shot pools exist for: "
        r"snli, mnli",
    ):
        config_checks.check_config(config)


def test_declarations_from_a_file(config, tmp_path):
    path = tmp_path / "sets.json"
    path.write_text(json.dumps({"rte_val": RTE_DECLARATION}))
    config.data.extra_testsets_file = str(path)
    config.data.testsets = ("mnli", "rte_val")
    config_checks.check_config(config)
    path.write_text(json.dumps({"rte_val": {**RTE_DECLARATION, "cap": -5}}))
    with pytest.raises(ValueError, match=rf"^testset 'rte_val' in {re.escape(str(path))}, field 'cap': must be an"):
        config_checks.check_config(config)
    config.data.extra_testsets_file = str(tmp_path / "missing.yaml")
    with pytest.raises(FileNotFoundError, match=r"^data.extra_testsets_file '.*missing.yaml' is not a file"):
        config_checks.check_config(config)


@pytest.mark.parametrize(
    "answers, message",
    [
        ((" Yes",), r"data.answers must be two different non-empty words \(yes, no\), got \[' Yes'\]"),
        ((" Yes", " Yes"), r"data.answers must be two different .*, got \[' Yes', ' Yes'\]"),
        ((" Yes", ""), r"data.answers must be two different .*, got \[' Yes', ''\]"),
        ((" Yes", 0), r"data.answers must be a list of str, got \(' Yes', 0\)"),
    ],
)
def test_bad_answers_are_named(config, answers, message):
    config.data.answers = answers
    with pytest.raises(ValueError, match=message):
        config_checks.check_config(config)
