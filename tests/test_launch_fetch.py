"""`oodjax-fetch` (launch/fetch.py) against a fake hub, offline.

The fake answers huggingface_hub's own HTTP client (through its transport):
a tiny random OPT repository as the hub publishes OPT (pickled
`pytorch_model-*.bin` shards and their index, the GPT-2 tokenizer's files,
and flax and TF weights that must not be fetched), so listing, sizes,
downloads, the cache layout and its offline resolution are huggingface_hub's
real code. Testset splits come through `datasets.load_dataset`, replaced by a
reader of the hub-schema copies in ../shared/data/hf. Each test has its own
HF_HOME and mirror.
"""

import hashlib
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import datasets
import httpx2
import huggingface_hub
import pyarrow.parquet
import pytest
import torch
from huggingface_hub.utils import _http
from transformers import OPTConfig, OPTForCausalLM

from launch import fetch
from launch.config_files import load_config
from oodjax.config_read import read
from oodjax.data import load_testset

ROOT = pathlib.Path(__file__).resolve().parents[1]
REPO = "facebook/opt-tiny-fetch"
TINY_OPT = dict(
    vocab_size=50272,
    hidden_size=16,
    word_embed_proj_dim=16,
    ffn_dim=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=64,
)
WEIGHTS = ["pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
TOKENIZER = ["merges.txt", "special_tokens_map.json", "tokenizer_config.json", "vocab.json"]
NOT_READ = ["flax_model.msgpack", "tf_model.h5", "README.md", "generation_config.json"]
# What the test config reads: MNLI (its evaluation split and its few-shot pool), HANS (through the hub's
# parquet export) and ANLI's three rounds (the split group test_all, declared as an override).
SPLITS = [
    ("nyu-mll/glue/mnli", "validation_matched"),
    ("jhu-cogsci/hans/plain_text", "validation"),
    ("facebook/anli/plain_text", "test_r1"),
    ("facebook/anli/plain_text", "test_r2"),
    ("facebook/anli/plain_text", "test_r3"),
    ("nyu-mll/glue/mnli", "validation_mismatched"),
]
ITEMS = 2 + len(SPLITS)  # the checkpoint, the tokenizer, the splits
# How a job of that config reads them, by testset and split.
READS = [
    ("mnli", "validation_matched"),
    ("mnli", "validation_mismatched"),
    ("hans", "validation"),
    ("anli", "test_all"),
]
CONFIG = f"""
from configs import base

def get_config():
    config = base.get_config()
    config.model.path = {REPO!r}
    config.model.dtype = "float32"
    config.data.train_set = "mnli"
    config.data.testsets = ("mnli", "hans", "anli")
    config.data.extra_testsets = {{"anli": {{"split": "test_all"}}}}
    return config
"""
# The metadata of GLUE's dataset card, as the hub serves it: MNLI's evaluation split has a size, nothing else has.
GLUE_CARD = {
    "dataset_info": [{"config_name": "mnli", "splits": [{"name": "validation_matched", "num_bytes": 2_100_000}]}]
}


def opt_repository(drop: str = "") -> dict[str, bytes]:
    """A tiny random OPT as the hub publishes OPT: two pickled shards without the `model.` prefix or the tied
    lm_head, their index, the GPT-2 tokenizer, and files the loader does not read; `drop` leaves a tensor out."""
    config = OPTConfig(**TINY_OPT)
    torch.manual_seed(0)
    state = {name.removeprefix("model."): tensor for name, tensor in OPTForCausalLM(config).state_dict().items()}
    del state["lm_head.weight"]
    state.pop(drop, None)
    files = {"config.json": config.to_json_string().encode()}
    weight_map = {}
    for number, embeddings in enumerate((True, False), start=1):
        shard = {name: tensor for name, tensor in state.items() if ("embed" in name) == embeddings}
        buffer = io.BytesIO()
        torch.save(shard, buffer)
        files[WEIGHTS[number]] = buffer.getvalue()
        weight_map |= dict.fromkeys(shard, WEIGHTS[number])
    files[WEIGHTS[0]] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    gpt2 = ROOT.parent / "shared" / "data" / "tokenizers" / "gpt2"
    files |= {name: (gpt2 / name).read_bytes() for name in TOKENIZER}
    files |= {"flax_model.msgpack": b"\0" * 4096, "tf_model.h5": b"\0" * 4096, "README.md": b"# tiny OPT\n"}
    files["generation_config.json"] = b"{}"
    return files


def not_found() -> httpx2.Response:
    return httpx2.Response(404, headers={"X-Error-Code": "RepoNotFound"}, json={"error": "Repository not found"})


class FakeHub:
    """The hub's answers to huggingface_hub for model repos (listing with sizes, file metadata, downloads) and
    dataset cards. It records each download; a file named in `cut` breaks off half-way, as a lost connection."""

    def __init__(self, repos: dict[str, dict[str, bytes]], cards: dict[str, dict]):
        self.repos, self.cards = repos, cards
        self.downloads: list[str] = []
        self.cut: set[str] = set()

    def sha(self, repo: str) -> str:
        return hashlib.sha1(b"".join(self.repos[repo].values())).hexdigest()

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
            repo = match.group(1)
            if repo not in self.repos:
                return not_found()
            siblings = [{"rfilename": name, "size": len(data)} for name, data in self.repos[repo].items()]
            return httpx2.Response(200, json={"id": repo, "sha": self.sha(repo), "siblings": siblings})
        if match := re.fullmatch(r"/api/datasets/([^/]+/[^/]+)", path):
            repo = match.group(1)
            if repo not in self.cards:
                return not_found()
            return httpx2.Response(200, json={"id": repo, "sha": "0" * 40, "cardData": self.cards[repo]})
        if match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path):
            repo, name = match.groups()
            data = self.repos[repo][name]
            headers = {
                "X-Repo-Commit": self.sha(repo),
                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                "Content-Length": str(len(data)),
            }
            if request.method == "HEAD":
                return httpx2.Response(200, headers=headers)
            self.downloads.append(name)
            return httpx2.Response(200, headers=headers, content=self._cut(data) if name in self.cut else data)
        return httpx2.Response(404, json={"error": f"the fake hub has no {path}"})

    @staticmethod
    def _cut(data: bytes):
        yield data[: len(data) // 2]
        raise httpx2.ReadError("connection reset by peer")


def read_shared_split(hf_data_dir: pathlib.Path):
    """`datasets.load_dataset` as the data layer calls it, answered from the hub-schema copies of the testsets,
    and the list of its calls."""
    calls = []

    def load_dataset(path, name=None, *, split, data_files=None):
        source = path
        if path == "parquet":  # a table's hub_data_files: hf://datasets/<id>@<revision>/<config>/<split>/*.parquet
            where = re.fullmatch(r"hf://datasets/(.+)@[^/]+/([^/]+)/([^/]+)/\*\.parquet", data_files)
            source, name, split = where.groups()
        elif source == "jhu-cogsci/hans":
            raise RuntimeError("the hub's HANS repo holds a loading script, which datasets no longer runs")
        calls.append((source, name, split))
        with (hf_data_dir / source / name / f"{split}.jsonl").open() as f:
            return datasets.Dataset.from_list([json.loads(line) for line in f])

    return load_dataset, calls


@pytest.fixture
def hub(tmp_path, monkeypatch, hf_data_dir):
    """A fake hub with the tiny OPT and GLUE's card, reached by huggingface_hub's client; a fresh HF_HOME, the
    hub switched on (the suite keeps it off) and `datasets.load_dataset` reading ../shared/data/hf."""
    fake = FakeHub({REPO: opt_repository()}, {"nyu-mll/glue": GLUE_CARD})
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "OODJAX_DATA_DIR"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(home))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    load_dataset, fake.dataset_calls = read_shared_split(hf_data_dir)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    transport = httpx2.MockTransport(fake.handle)
    hooks = {"request": [_http.hf_request_event_hook]}
    _http.set_client_factory(lambda: httpx2.Client(transport=transport, event_hooks=hooks, follow_redirects=True))
    yield fake
    _http.set_client_factory(_http.default_client_factory)


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "fetch_config.py"
    path.write_text(CONFIG)
    return str(path)


def run(capsys, *args: str) -> tuple[int, str]:
    status = fetch.main(list(args))
    return status, capsys.readouterr().out


def snapshot(home: pathlib.Path, fake: FakeHub) -> pathlib.Path:
    return home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / fake.sha(REPO)


def summary(out: str) -> dict[str, str]:
    """The last lines' outcome of each item ("fetched: why"), by the item's label."""
    lines = re.findall(r"^(fetched|already here|failed) +(\w+ [^\s:]+(?: [^\s:]+)?): (.*)$", out, re.MULTILINE)
    return {label: f"{outcome}: {why}" for outcome, label, why in lines}


def test_fetch_brings_exactly_what_the_config_reads_and_offline_nodes_load_it(
    hub, config_file, tmp_path, capsys, hf_data_dir
):
    mirror = tmp_path / "mirror"
    status, out = run(capsys, config_file, "--data_dir", str(mirror))
    assert status == 0, out

    assert sorted(hub.downloads) == sorted(["config.json", *WEIGHTS, *TOKENIZER]), "config.json once: then cached"
    files = {path.name for path in snapshot(tmp_path / "hf_home", hub).iterdir()}
    assert files == {"config.json", *WEIGHTS, *TOKENIZER}, f"nothing of {NOT_READ}"
    weights = fetch._bytes(sum(len(hub.repos[REPO][name]) for name in ["config.json", *WEIGHTS]))
    assert f"to fetch  model {REPO}: config.json, {', '.join(WEIGHTS)} ({weights})\n" in out
    assert re.search(r"to fetch  testset nyu-mll/glue/mnli validation_matched: to .+ \(2\.1 MB\)\n", out)
    assert re.search(r"to fetch  testset facebook/anli/plain_text test_r1: to .+ \(size unknown\)\n", out)
    outcomes = summary(out)
    assert len(outcomes) == ITEMS and all(line.startswith("fetched") for line in outcomes.values()), outcomes
    assert "tensors fit its config.json" in outcomes[f"model {REPO}"]
    assert "answers [' Yes', ' No'] are tokens [3363, 1400]" in outcomes[f"tokenizer {REPO}"]
    rows = len(load_testset("anli", split="test_r1", data_dir=hf_data_dir))  # neutral dropped, as the job does
    assert f"anli reads {rows} rows" in outcomes["testset facebook/anli/plain_text test_r1"]

    for folder, split in SPLITS:  # every column of the hub's split
        written = pyarrow.parquet.read_table(mirror / folder / f"{split}.parquet")
        with (hf_data_dir / folder / f"{split}.jsonl").open() as f:
            first = json.loads(f.readline())
        assert written.column_names == list(first) and written.slice(0, 1).to_pylist() == [first]
    assert not list(mirror.rglob(".*.tmp"))

    # A compute node: the environment the fetch printed, the hub out of reach (offline, and no fake).
    exports = dict(line.split()[1].split("=", 1) for line in out.splitlines() if line.startswith("  export "))
    assert exports.keys() == {"HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "OODJAX_DATA_DIR"}
    environment = {**os.environ, **{name: shlex.split(value)[0] for name, value in exports.items()}}
    code = f"""
import json
from oodjax import models
from oodjax.data import answer_token_ids, load_testset, load_tokenizer
model = models.load_pretrained({REPO!r})
tokenizer = load_tokenizer({REPO!r})
rows = {{split: len(load_testset(name, split=split)) for name, split in {READS!r}}}
print(json.dumps({{"layers": model.config.num_hidden_layers, "answers": answer_token_ids(tokenizer), "rows": rows}}))
"""
    completed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    offline = json.loads(completed.stdout.splitlines()[-1])
    assert offline["layers"] == 2 and offline["answers"] == [3363, 1400]
    expected = {split: len(load_testset(name, split=split, data_dir=hf_data_dir)) for name, split in READS}
    assert offline["rows"] == expected


def test_a_second_run_downloads_nothing_and_says_so(hub, config_file, tmp_path, capsys):
    mirror = str(tmp_path / "mirror")
    assert run(capsys, config_file, "--data_dir", mirror)[0] == 0
    hub.downloads.clear()
    hub.dataset_calls.clear()

    status, out = run(capsys, config_file, "--data_dir", mirror)
    assert status == 0, out
    assert hub.downloads == [] and hub.dataset_calls == []
    assert f"nothing to download: all {ITEMS} items are here\n" in out
    outcomes = summary(out)
    assert len(outcomes) == ITEMS and all(line.startswith("already here") for line in outcomes.values()), outcomes


def test_an_interrupted_download_completes_on_the_next_run(hub, config_file, tmp_path, capsys):
    """The connection drops half-way through the checkpoint's second shard: that item fails (exit status 1), the
    others are fetched; the next run downloads only that shard."""
    mirror = str(tmp_path / "mirror")
    hub.cut = {WEIGHTS[2]}
    status, out = run(capsys, config_file, "--data_dir", mirror)
    assert status == 1
    outcomes = summary(out)
    assert outcomes[f"model {REPO}"] == "failed: ReadError: connection reset by peer", outcomes
    assert sum(line.startswith("fetched") for line in outcomes.values()) == ITEMS - 1
    assert f"1 of {ITEMS} items failed" in out
    assert "On the compute nodes" not in out  # nothing to set there before every item is here
    assert not (snapshot(tmp_path / "hf_home", hub) / WEIGHTS[2]).exists()

    hub.cut = set()
    hub.downloads.clear()
    status, out = run(capsys, config_file, "--data_dir", mirror)
    assert status == 0, out
    assert hub.downloads == [WEIGHTS[2]]
    assert f"to fetch  model {REPO}: {WEIGHTS[2]} ({fetch._bytes(len(hub.repos[REPO][WEIGHTS[2]]))})\n" in out
    assert summary(out)[f"model {REPO}"].startswith("fetched")


def test_a_run_stopped_while_writing_a_split_leaves_no_file_where_jobs_look(
    hub, config_file, tmp_path, capsys, monkeypatch
):
    mirror = tmp_path / "mirror"
    to_parquet = datasets.Dataset.to_parquet

    def write_then_stop(self, path, *args, **kwargs):
        to_parquet(self, path, *args, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C (or a kill) between writing and the rename

    monkeypatch.setattr(datasets.Dataset, "to_parquet", write_then_stop)
    with pytest.raises(SystemExit) as exit_:
        fetch.main([config_file, "--data_dir", str(mirror)])
    assert exit_.value.code == 130 and capsys.readouterr().err.endswith("oodjax-fetch: interrupted\n")
    assert not [path for path in mirror.rglob("*") if path.is_file()]

    monkeypatch.setattr(datasets.Dataset, "to_parquet", to_parquet)
    status, out = run(capsys, config_file, "--data_dir", str(mirror))
    assert status == 0, out
    assert all((mirror / folder / f"{split}.parquet").is_file() for folder, split in SPLITS)


def test_a_checkpoint_missing_a_tensor_fails_naming_it(hub, config_file, tmp_path, capsys):
    missing = "decoder.layers.1.fc2.weight"
    hub.repos[REPO] = opt_repository(drop=missing)
    status, out = run(capsys, config_file, "--data_dir", str(tmp_path / "mirror"))
    assert status == 1
    outcomes = summary(out)
    assert outcomes[f"model {REPO}"].startswith("failed") and missing in outcomes[f"model {REPO}"], outcomes
    assert outcomes[f"tokenizer {REPO}"].startswith("fetched")


def test_a_repo_the_hub_does_not_have_fails_before_downloading(hub, config_file, tmp_path, capsys):
    pathlib.Path(config_file).write_text(CONFIG.replace(REPO, "facebook/opt-nowhere"))
    status, out = run(capsys, config_file, "--data_dir", str(tmp_path / "mirror"))
    assert status == 1
    outcomes = summary(out)
    for kind in ("model", "tokenizer"):
        assert outcomes[f"{kind} facebook/opt-nowhere"].startswith("failed: RepositoryNotFoundError"), outcomes
    assert "; 2 items could not be looked up; each failed line below says why\n" in out
    assert out.count("RepositoryNotFoundError") == 2  # each item's failure said once, in its closing line
    assert hub.downloads == []


def test_offline_every_item_fails_once_naming_the_hub_it_could_not_reach(hub, config_file, tmp_path, capsys):
    """No network: no look-up connects. The summary does not call that "here", each item's failure is one line,
    and that line and the summary name the address the fetch could not reach."""

    def refuse(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("[Errno 101] Network is unreachable", request=request)

    _http.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(refuse)))  # `hub` restores it
    status, out = run(capsys, config_file, "--data_dir", str(tmp_path / "mirror"))
    assert status == 1
    unreachable = f"could not reach the hub at {huggingface_hub.constants.ENDPOINT}"
    assert (
        f"nothing looked up; {ITEMS} items could not be looked up, {ITEMS} because the fetch {unreachable} (is this "
        "machine online? $HF_ENDPOINT names another address); each failed line below says why\n"
    ) in out
    assert "here" not in out.split("nothing looked up")[0]
    outcomes = summary(out)
    assert len(outcomes) == ITEMS, out
    for label, outcome in outcomes.items():
        assert outcome == f"failed: {unreachable}: ConnectError: [Errno 101] Network is unreachable", outcome
        assert out.count(label) == 1, (label, out)  # its closing line only
    assert f"{ITEMS} of {ITEMS} items failed" in out
    assert hub.downloads == [] and hub.dataset_calls == []


def test_a_pattern_matching_no_config_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        fetch.main(["configs/nothing_*.py", "--data_dir", "mirror"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "oodjax-fetch: error: no config file matches 'configs/nothing_*.py'\n"


def test_no_testset_mirror_is_one_line_and_status_2(config_file, capsys, monkeypatch):
    monkeypatch.delenv("OODJAX_DATA_DIR")
    with pytest.raises(SystemExit) as exit_:
        fetch.main([config_file])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pass --data_dir DIR or set OODJAX_DATA_DIR" in error


def test_with_the_hub_switched_off_it_is_one_line_and_status_2(config_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # the suite sets HF_HUB_OFFLINE
        fetch.main([config_file, "--data_dir", str(tmp_path / "mirror")])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) is set" in error


def test_the_study_reads_each_model_tokenizer_and_split_once(tmp_path):
    configs = [(str(path), read(load_config(path))) for path in sorted(ROOT.glob("configs/*_[ms]nli.py"))]
    models = list(dict.fromkeys(config.model.path for _, config in configs))
    assert len(configs) == 16 and len(models) == 8
    items = fetch.plan(configs, tmp_path)
    assert [item.label for item in items[:16]] == [f"model {model}" for model in models] + [
        f"tokenizer {model}" for model in models
    ]
    assert {item.label for item in items[16:]} == {
        "testset stanfordnlp/snli/plain_text test",
        "testset nyu-mll/glue/mnli validation_matched",
        "testset allenai/scitail/tsv_format test",
        "testset nyu-mll/glue/rte train",
        "testset nyu-mll/glue/wnli train",
        "testset google-research-datasets/paws/labeled_final test",
        "testset jhu-cogsci/hans/plain_text validation",
        "testset facebook/anli/plain_text test_r3",
        "testset nyu-mll/glue/mnli train",
        "testset stanfordnlp/snli/plain_text train",
    }
    pools = [item.label for item in items[16:] if "the mnli pool" in item.checks or "the snli pool" in item.checks]
    assert pools == ["testset nyu-mll/glue/mnli train", "testset stanfordnlp/snli/plain_text train"]

    path = str(ROOT / "configs" / "opt2.7_mnli.py")
    config = load_config(path)
    config.data.pool_split = ""  # the pool's split is the config's, else the table's
    labels = [item.label for item in fetch.plan([(path, read(config))], tmp_path)]
    assert (
        "testset nyu-mll/glue/mnli validation_mismatched" in labels and "testset nyu-mll/glue/mnli train" not in labels
    )
