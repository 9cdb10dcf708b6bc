"""`python -m launch.fetch 'configs/*_[ms]nli.py' [--data_dir DIR]` (`oodjax-fetch`).

Downloads and verifies everything the configs' jobs read, on a machine that
reaches the Hugging Face hub (a cluster's login node), so that compute nodes
without network run them (docs/clusters.md). Checkpoints and tokenizers go to
the huggingface_hub cache, where an offline ``from_pretrained(hub_id)`` finds
them; testset splits go whole or not at all to the parquet mirror
``local_path`` reads. Each item is verified as the jobs load it. Exit status
0 when every item is verified, 1 when one is not, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import os
import pathlib
import shlex
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence

import datasets
import httpx2
import huggingface_hub
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HfHubHTTPError

from launch.config_files import experiment_config_paths, load_config
from oodjax.config_read import Job, read
from oodjax.data import answer_token_ids, load_testset, load_tokenizer, training_pool
from oodjax.data.testsets import (
    HUB_ID,
    TestsetSpec,
    default_data_dir,
    hub_offline,
    hub_split,
    local_path,
    mirror_folder,
    pool_split,
    testset_spec,
)
from oodjax.models.hf_checkpoint import files_to_download
from oodjax.models.loading import verify_checkpoint
from oodjax.storage import write_atomic
from oodjax.usage_errors import FETCH_COMMAND, ConfigError, MissingInputError, UsageError, reported

# A repo's top-level files AutoTokenizer may read; config.json names the class where tokenizer_config.json does not.
TOKENIZER_FILES = (
    "tokenizer.json tokenizer_config.json special_tokens_map.json added_tokens.json vocab.json vocab.txt merges.txt "
    "tokenizer.model spiece.model *.tiktoken chat_template.jinja chat_template.json config.json"
).split()
Configs = Sequence[tuple[str, Job]]  # (config file, its config read into a job)
UNREACHABLE = "could not reach the hub"


@dataclasses.dataclass(frozen=True)
class Look:
    """What ``look_up`` found; ``size`` in bytes, None where unknown."""

    here: bool
    what: str
    size: int | None


class Checkpoint:
    """A model's weights: config.json and the weight files the loader reads, verified from their headers."""

    kind = "model"

    def choose(self, names: list[str]) -> list[str]:
        return files_to_download(names)

    def verify(self, folder: pathlib.Path) -> str:
        return f"its {verify_checkpoint(folder)} tensors fit its config.json"


@dataclasses.dataclass
class Tokenizer:
    """A tokenizer's files, verified by loading them and encoding every config's answer words."""

    answers: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (yes, no) of each config
    kind = "tokenizer"

    def choose(self, names: list[str]) -> list[str]:
        chosen = [name for name in names if any(fnmatch.fnmatchcase(name, pattern) for pattern in TOKENIZER_FILES)]
        if chosen in ([], ["config.json"]):
            raise FileNotFoundError(f"no tokenizer files among the repo's {sorted(names)}")
        return chosen

    def verify(self, folder: pathlib.Path) -> str:
        tokenizer = load_tokenizer(folder)
        ids = [answer_token_ids(tokenizer, answers) for answers in self.answers]
        return "; ".join(f"answers {list(a)} are tokens {list(i)}" for a, i in zip(self.answers, ids, strict=True))


@dataclasses.dataclass(eq=False)
class RepoFiles:
    """An item: a checkpoint or a tokenizer (``what``) from a hub repo, or from a local folder (only verified).

    Files go one by one through ``hf_hub_download``, which writes a file under
    its final name only once complete, so a run cut short keeps what finished.
    """

    what: Checkpoint | Tokenizer
    source: str  # a hub id or a local folder
    files: list[str] = dataclasses.field(default_factory=list)  # chosen by look_up

    @property
    def label(self) -> str:
        return f"{self.what.kind} {self.source}"

    @property
    def local(self) -> pathlib.Path | None:
        folder = pathlib.Path(self.source).expanduser()
        return folder if folder.is_dir() else None

    def look_up(self) -> Look:
        if self.local is not None:
            return Look(True, "a local folder, verified where it is", 0)
        info = huggingface_hub.HfApi().model_info(self.source, files_metadata=True)
        sizes = {sibling.rfilename: sibling.size for sibling in info.siblings or ()}
        self.files = self.what.choose(list(sizes))
        cached = [huggingface_hub.try_to_load_from_cache(self.source, name, revision=info.sha) for name in self.files]
        missing = [name for name, path in zip(self.files, cached) if not isinstance(path, str)]
        return Look(not missing, _names(missing or self.files), _total(sizes[name] for name in missing))

    def download(self) -> None:
        for name in self.files:
            huggingface_hub.hf_hub_download(self.source, name)

    def verify(self) -> str:
        folder = self.local or pathlib.Path(
            huggingface_hub.snapshot_download(self.source, allow_patterns=self.files, local_files_only=True)
        )
        absent = [name for name in self.files if not (folder / name).is_file()]
        if absent:
            raise FileNotFoundError(f"{folder} lacks {absent}, which an offline load of {self.source} reads")
        return self.what.verify(folder)


@dataclasses.dataclass(eq=False)
class TestsetSplit:
    """An item: one source split of a hub testset; ``checks`` are the ways the configs' jobs load it."""

    __test__ = False  # a dataclass named Test* is not a pytest test class

    spec: TestsetSpec  # the first declaration read from it: its hub source, config and hub path
    split: str
    root: pathlib.Path
    checks: dict[str, Callable[[], datasets.Dataset]] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        where = f"{self.spec.source}/{self.spec.config}" if self.spec.config else self.spec.source
        return f"testset {where} {self.split}"

    @property
    def target(self) -> pathlib.Path:
        return mirror_folder(self.spec, self.root) / f"{self.split}.parquet"

    def look_up(self) -> Look:
        try:
            return Look(True, str(local_path(self.spec, self.split, self.root)), 0)
        except FileNotFoundError:
            return Look(False, f"to {self.target}", _card_bytes(self.spec, self.split))

    def download(self) -> None:
        write_atomic(self.target, hub_split(self.spec, self.split).to_parquet, intact="nothing was written there")

    def verify(self) -> str:
        local_path(self.spec, self.split, self.root)  # the jobs find it (else load_testset would ask the hub)
        return ", ".join(f"{name} reads {len(check())} rows" for name, check in self.checks.items())


Item = RepoFiles | TestsetSplit


def plan(configs: Configs, root: pathlib.Path) -> list[Item]:
    """What the configs' jobs read, each item once, in config order."""
    checkpoints: dict[str, RepoFiles] = {}
    tokenizers: dict[str, RepoFiles] = {}
    answers: dict[str, Tokenizer] = {}
    splits: dict[tuple[str, str, str], TestsetSplit] = {}
    for path, job in configs:
        if job.model.path:
            checkpoints.setdefault(job.model.path, RepoFiles(Checkpoint(), _source(path, "model.path", job.model.path)))
        source = job.model.tokenizer
        if not source:
            raise ConfigError(f"{path}: tokenizer is empty and model.path names no checkpoint to take it from")
        what = answers.setdefault(source, Tokenizer())  # one per tokenizer, every config's answer words
        tokenizers.setdefault(source, RepoFiles(what, _source(path, "tokenizer", source)))
        if job.data.answers not in what.answers:
            what.answers.append(job.data.answers)
        for spec, split, name, check in _testset_reads(job, root):
            item = splits.setdefault((spec.source, spec.config, split), TestsetSplit(spec, split, root))
            item.checks.setdefault(name, check)
    return [*checkpoints.values(), *tokenizers.values(), *splits.values()]


def _source(path: str, field: str, source: str) -> str:
    if not pathlib.Path(source).expanduser().is_dir() and not HUB_ID.fullmatch(source):
        raise MissingInputError(f"{path}: {field} {source!r} is neither a local folder nor a hub id")
    return source


def _testset_reads(
    job: Job, root: pathlib.Path
) -> Iterator[tuple[TestsetSpec, str, str, Callable[[], datasets.Dataset]]]:
    """(spec, source split, who reads it, how the job loads it) for every hub split the config reads."""
    data = job.data  # its names are known (``DataSettings`` refuses others)
    for name in data.testsets:
        spec = data.table[name]
        if spec.is_local_file:  # the user's own file: nothing to fetch
            continue
        reader = name if data.neutral == "drop" else f"{name} (neutral {data.neutral})"
        for part in spec.split_groups.get(spec.split, (spec.split,)):
            load = functools.partial(
                load_testset, name, split=part, data_dir=root, neutral=data.neutral, table={name: spec}
            )
            yield spec, part, reader, load
    split = pool_split(data.train_set, data.pool_split)
    load = functools.partial(training_pool, data.train_set, split=split, data_dir=root)
    yield testset_spec(data.train_set), split, f"the {data.train_set} pool", load


def _card_bytes(spec: TestsetSpec, split: str) -> int | None:
    """The split's Arrow bytes from its dataset card (not the download's), or None where the card has none."""
    try:
        card = huggingface_hub.HfApi().dataset_info(spec.source).card_data
    except HfHubHTTPError:  # no such repo page, or no access: the download will say why
        return None
    infos = (card.to_dict() if card is not None else {}).get("dataset_info") or []
    for info in [infos] if isinstance(infos, dict) else infos:
        if info.get("config_name", "default") == (spec.config or "default"):
            for entry in info.get("splits") or []:
                if entry.get("name") == split and isinstance(entry.get("num_bytes"), int):
                    return entry["num_bytes"]
    return None


def mirror_dir(data_dir: str | None, configs: Configs) -> pathlib.Path:
    """The testset mirror: --data_dir, else $OODJAX_DATA_DIR, else the configs' data.data_dir (one for all)."""
    if data_dir:
        return pathlib.Path(data_dir).expanduser()
    if (from_env := default_data_dir()) is not None:
        return from_env
    named = sorted({job.data.data_dir for _, job in configs if job.data.data_dir})
    if len(named) > 1:
        raise ConfigError(f"the configs name different data.data_dir ({', '.join(named)}); pass --data_dir DIR")
    if not named:
        raise MissingInputError(
            "no directory for the testsets: pass --data_dir DIR or set OODJAX_DATA_DIR, on storage the compute "
            "nodes reach (the jobs read it as $OODJAX_DATA_DIR)"
        )
    return pathlib.Path(named[0]).expanduser()


def compute_node_environment(root: pathlib.Path) -> list[str]:
    """The variables under which compute nodes read what was fetched here, and nothing from the network."""
    home = os.path.abspath(hub_constants.HF_HOME)
    variables = [("HF_HOME", home)]
    if os.path.abspath(hub_constants.HF_HUB_CACHE) != os.path.join(home, "hub"):
        variables.append(("HF_HUB_CACHE", os.path.abspath(hub_constants.HF_HUB_CACHE)))
    variables += [("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("OODJAX_DATA_DIR", str(root.resolve()))]
    return [f"export {name}={shlex.quote(value)}" for name, value in variables]


def fetch(items: Sequence[Item], configs: Configs, root: pathlib.Path) -> int:
    """Prints the plan, downloads what is missing, verifies everything; returns the exit status."""
    print(f"{FETCH_COMMAND}: {_count(len(items), 'item')} for {_count(len(configs), 'config')}", flush=True)
    looks = {item: _look_up(item) for item in items}
    for path, job in configs:
        if job.data.data_dir and pathlib.Path(job.data.data_dir).expanduser().resolve() != root.resolve():
            print(f"  note: {path} reads its testsets from data.data_dir={job.data.data_dir}, not from {root}")
    print(_download_summary(list(looks.values())), flush=True)
    outcomes = [(item, *_outcome(item, looks[item])) for item in items]

    print()
    for item, outcome, why in outcomes:
        print(f"{outcome:<12}  {item.label}: {why}")
    failed = sum(outcome == "failed" for _, outcome, _ in outcomes)
    if failed:  # the compute nodes' settings only once there is something for them to read
        total = _count(len(items), "item")
        print(f"\n{failed} of {total} failed, each line says why; rerun once fixed: what is here stays")
        return 1
    print("\nOn the compute nodes, set:")
    print("\n".join(f"  {line}" for line in compute_node_environment(root)))
    print(f"all {_count(len(items), 'item')} are here and verified")
    return 0


def _look_up(item: Item) -> Look | str:
    """The item's ``look_up``, printed as its line of the plan, or why the hub did not answer."""
    try:
        look = item.look_up()
    except Exception as error:  # the hub's answer (not found, no access, no network): the item's line says it
        return _why(error)
    print(f"  {'here' if look.here else 'to fetch':<9} {item.label}: {look.what}", end="")
    print("" if look.here else f" ({_bytes(look.size)})", flush=True)
    return look


def _outcome(item: Item, look: Look | str) -> tuple[str, str]:
    """(outcome, what was verified or why not) of one item, downloaded if missing."""
    if isinstance(look, str):
        return "failed", look
    try:
        if not look.here:
            print(f"fetching {item.label}", flush=True)
            item.download()
        return "already here" if look.here else "fetched", item.verify()
    except Exception as error:  # a download or a verification that failed: the item's line says why
        return "failed", _why(error)


def _download_summary(looks: list[Look | str]) -> str:
    """The plan's total line; an unreachable hub is named once, here, not per item."""
    found = [look for look in looks if isinstance(look, Look)]
    missing = [look for look in found if not look.here]
    if missing:
        unknown = sum(look.size is None for look in missing)
        total = _bytes(_total(look.size for look in missing if look.size is not None))
        line = f"to download: {_count(len(missing), 'item')}, {total}"
        if unknown:
            line += f" and {unknown} of unknown size"
    elif len(found) == len(looks):
        line = f"nothing to download: all {_count(len(found), 'item')} are here"
    else:  # what could not be looked up may be missing
        line = f"{len(found)} looked up, all here" if found else "nothing looked up"
    failures = [look for look in looks if isinstance(look, str)]
    if failures:
        unreachable = sum(why.startswith(UNREACHABLE) for why in failures)
        line += f"; {_count(len(failures), 'item')} could not be looked up"
        if unreachable:
            line += (
                f", {unreachable} because the fetch {_unreachable_text()} (is this machine online? $HF_ENDPOINT names "
                "another address)"
            )
        line += "; each failed line below says why"
    return line


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _names(files: list[str]) -> str:
    shown = ", ".join(files[:4])
    return shown if len(files) <= 4 else f"{shown} and {len(files) - 4} more"


def _total(sizes: Iterable[int | None]) -> int | None:
    listed = list(sizes)
    known = [size for size in listed if size is not None]
    return sum(known) if len(known) == len(listed) else None


def _bytes(size: int | None) -> str:
    if size is None:
        return "size unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def _why(error: BaseException) -> str:
    """An error as one line (the hub's messages span several)."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return f"{_unreachable_text()}: {text}" if _cannot_connect(error) else text


def _unreachable_text() -> str:
    """``UNREACHABLE`` with the address asked ($HF_ENDPOINT, else the hub's own)."""
    return f"{UNREACHABLE} at {hub_constants.ENDPOINT}"


def _cannot_connect(error: BaseException | None) -> bool:
    """Whether ``error`` or its cause is a connection that could not be made, rather than an answer of the hub's."""
    while error is not None:
        if isinstance(error, (httpx2.ConnectError, httpx2.ConnectTimeout, ConnectionError)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _read(path: str) -> Job:
    try:
        return read(load_config(path))
    except FileNotFoundError as error:  # data.extra_testsets_file
        raise MissingInputError(f"{path}: {error}") from None
    except (KeyError, ValueError) as error:  # a bad declaration or size, named in the message
        raise ConfigError(f"{path}: {error.args[0]}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=FETCH_COMMAND, description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+", metavar="CONFIG", help="config files or shell patterns (quoted)")
    parser.add_argument(
        "--data_dir", help="the testset mirror the jobs read (default: $OODJAX_DATA_DIR, else data.data_dir)"
    )
    args = parser.parse_args(argv)
    with reported(FETCH_COMMAND):
        configs = [(path, _read(path)) for path in experiment_config_paths(args.configs)]  # files not checked
        root = mirror_dir(args.data_dir, configs)
        if hub_offline():
            raise UsageError(
                "HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) is set, so nothing can be downloaded: unset it on this "
                "machine (keep it set on the compute nodes)"
            )
        items = plan(configs, root)
        root.mkdir(parents=True, exist_ok=True)
        return fetch(items, configs, root)  # Ctrl-C in a download: one line too, and what is here stays


if __name__ == "__main__":
    sys.exit(main())
