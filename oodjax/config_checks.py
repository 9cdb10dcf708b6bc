"""Checks of a config that must fail fast: before data is tokenised or anything is compiled.

A sweep job that dies after twenty minutes of loading on a misspelt path
wastes a cluster slot; these checks look only at the config, the file system,
the caches and (online) the hub and W&B.

Where every check of a config lives, in the order a job meets them: the
command line (``oodjax.config_cli``); ``oodjax.config_read.read``, every rule
on values, in the ``__post_init__`` of each piece of the job as it is built
(``Job``'s for rules across pieces); here, ``check_job``, the sources the job
names and what they hold (files, hub, logins, the tokenizer's vocabulary);
``oodjax.engine.geometry.batch_geometry``, once the mesh and few-shot sets
exist; ``oodjax.models.loading``, the checkpoint as it loads.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
from collections.abc import Sequence
from typing import Any

import datasets
import huggingface_hub
from absl import logging
from datasets.naming import camelcase_to_snakecase
from flax import nnx
from ml_collections import config_dict

from oodjax.config_read import MIN_FIXED_EVALUATIONS, Job, read
from oodjax.data import answer_token_ids, few_shot, load_testset, load_tokenizer, training_pool
from oodjax.data.testsets import (
    HUB_ID,
    Neutral,
    TestsetSpec,
    default_data_dir,
    hub_offline,
    local_path,
    pool_split,
    testset_spec,
)
from oodjax.engine.events import TrackerSettings, installed, setup_wandb
from oodjax.engine.run_data import DataSettings
from oodjax.models.hf_checkpoint import read_json
from oodjax.models.loading import ModelSettings, abstract_model, verify_checkpoint
from oodjax.models.lora import LoRAConfig, lora_from_peft, read_peft
from oodjax.usage_errors import ConfigError, DamagedInputError, MissingInputError, NotFetchedError, UsageError


def check_config(config: config_dict.ConfigDict, *, evaluation: bool = False) -> Job:
    """``config`` read into a ``Job``, then its sources checked; raises a ``usage_errors.UsageError`` naming the
    first wrong field or missing input."""
    job = read(config)
    check_job(job, evaluation=evaluation)
    return job


def check_job(job: Job, *, evaluation: bool = False) -> None:
    """The sources ``job`` reads (files, hubs, logins) and what they hold; ``evaluation``: the job is
    ``oodjax.evaluate``'s, not training's."""
    if job.in_context and not evaluation:  # the in-context baseline trains nothing
        raise ConfigError(
            "eval.in_context=True is for evaluation without training: run `python -m oodjax.evaluate` "
            "(oodjax-evaluate), not oodjax.main"
        )
    if job.model.path:  # a checkpoint named by model.path is there and whole
        _check_source("model.path", job.model.path, "config.json")
        if pathlib.Path(job.model.path).expanduser().is_dir():
            _check_checkpoint(pathlib.Path(job.model.path).expanduser())
    _check_adapters(job.model, job.adapters)
    _check_source("tokenizer", job.model.tokenizer, "tokenizer_config.json")
    _check_data(job.data, job.runs.shots, needs_pool=not evaluation or job.in_context)
    _check_trackers(job.trackers, evaluation)
    if job.export.hub_repo and hub_offline():  # a push that cannot happen, refused before the runs train
        raise ConfigError(
            f"export.hub_repo={job.export.hub_repo!r} pushes adapters to the Hugging Face hub, but HF_HUB_OFFLINE is "
            "set; unset it, or leave export.hub_repo empty and upload <run_dir>/adapter/ later"
        )
    _check_vocabulary(job.model, job.data.answers)
    _check_output_dir(str(job.runs.output_dir))
    if not evaluation and (warning := few_evaluations_warning(job)):
        logging.warning("%s", warning)


def few_evaluations_warning(job: Job) -> str:
    """One line naming the run lengths evaluated fewer than MIN_FIXED_EVALUATIONS times (step 0 counted), as
    train.epochs makes the runs of few shots short, a small eval.points or a run of a few steps does (a fixed
    eval.every that does is refused by ``read``): their partial correlations rest on few steps. Empty when
    every run has enough."""
    short = [
        f"{group.total_steps} steps ({'/'.join(map(str, sorted({run.shots for run in group.runs})))} shots): "
        f"{len(group.cadence.evaluated_steps())} evaluations"
        for group in job.groups
        if len(group.cadence.evaluated_steps()) < MIN_FIXED_EVALUATIONS
    ]
    if not short:
        return ""
    return (
        f"runs evaluated fewer than {MIN_FIXED_EVALUATIONS} times, so their partial correlations rest on few steps: "
        f"{'; '.join(short)} (raise eval.points, train.steps or train.epochs)"
    )


def _check_trackers(trackers: TrackerSettings, evaluation: bool) -> None:
    """The trackers that are on are installed, and W&B online has a login (evaluation tracks nothing)."""
    if trackers.wandb is not None and not installed("wandb"):
        raise ConfigError("wandb.enabled is True but wandb is not installed (pip install wandb)")
    if trackers.tensorboard and not installed("tensorboardX"):
        raise ConfigError("tensorboard.enabled is True but tensorboardX is not installed (pip install tensorboardX)")
    if trackers.wandb is not None and not evaluation:
        _check_wandb_login(trackers.wandb.mode or "")


def _check_wandb_login(mode: str) -> None:
    """W&B online needs a login, which ``wandb.init`` would find missing only once the model and data have
    loaded; asked of wandb itself, without a prompt. Every process asks, so all stop together."""
    import wandb

    if setup_wandb(mode) in ("offline", "dryrun", "disabled"):
        return
    fix = "run `wandb login` or set WANDB_API_KEY, or record offline: --config.wandb.mode=offline, then `wandb sync`"
    try:
        logged_in = wandb.login(prompt=False, verify=True)
    except wandb.errors.AuthenticationError as error:
        raise ConfigError(f"wandb.enabled: W&B online could not verify this machine's login ({error}); {fix}") from None
    if not logged_in:
        raise ConfigError(f"wandb.enabled: W&B online needs a login and this machine has none; {fix}")


def _check_checkpoint(directory: pathlib.Path) -> None:
    """A local checkpoint's files are all there, whole, and fit its config.json, read from their headers
    (``verify_checkpoint``): a missing or truncated weights file is named now, not after minutes of loading."""
    try:
        verify_checkpoint(directory)
    except UsageError:  # a file missing, truncated or not fitting: the message names it
        raise
    except ValueError as error:  # config.json's model_type or a field its family reads
        raise ConfigError(f"model.path: {error}") from None


def _check_adapters(model: ModelSettings, adapters: Sequence[pathlib.Path]) -> None:
    """Each folder of model.adapters is a readable PEFT LoRA adapter that fits the model, checked on the
    model's shapes alone (``abstract_model``): a wrong folder is one line before anything loads."""
    if not adapters:
        return
    hf_config = _model_config(model)
    abstract: dict[LoRAConfig, nnx.State[Any, Any]] = {}
    for folder in adapters:
        cfg, tensors = read_peft(folder)
        if cfg not in abstract:
            abstract[cfg] = nnx.state(abstract_model(hf_config, dtype="float32", lora=cfg), nnx.LoRAParam)
        try:
            lora_from_peft(abstract[cfg], tensors, source=str(folder))
        except ConfigError as error:
            raise ConfigError(f"model.adapters: {error}") from None


def _check_source(field: str, source: str, marker_file: str) -> None:
    """A local directory holding `marker_file` (a JSON file, read), or a hub id (cached locally when offline)."""
    path = pathlib.Path(source).expanduser()
    if path.is_dir():
        if not (path / marker_file).is_file():
            raise MissingInputError(f"{field}: directory {path} has no {marker_file}")
        try:
            read_json(path / marker_file)
        except ValueError as error:
            raise ConfigError(f"{field}: {error}") from None
        return
    if not HUB_ID.fullmatch(source):
        raise MissingInputError(f"{field}: {source!r} does not exist (and is not a hub id)")
    if hub_offline() and not isinstance(huggingface_hub.try_to_load_from_cache(source, marker_file), str):
        raise NotFetchedError(
            f"{field}: {source!r} is not a local directory, and with HF_HUB_OFFLINE set the hub id "
            "is not in the local cache either"
        )


def _check_data(data: DataSettings, shots: Sequence[int], *, needs_pool: bool) -> None:
    """The testsets can be read; with ``needs_pool``, data.train_set's pool holds enough of each label for
    ``shots``."""
    if data.data_dir and not pathlib.Path(data.data_dir).expanduser().is_dir():
        raise MissingInputError(f"data.data_dir {data.data_dir!r} is not a directory")
    root = pathlib.Path(data.data_dir).expanduser() if data.data_dir else default_data_dir()
    for name in data.testsets:
        _check_available(name, data.table[name], root, data.neutral)
    if needs_pool:
        split = pool_split(data.train_set, data.pool_split)
        _check_available(data.train_set, dataclasses.replace(testset_spec(data.train_set), split=split), root)
        if shots and min(shots) > 0:  # RunPlan names a non-positive count
            try:
                pool = training_pool(data.train_set, split=split, data_dir=root)
            except NotFetchedError:  # offline, the caches hold less than they seemed to: the job names what
                return
            try:
                few_shot(pool, max(shots), seed=0)  # what it needs of each label does not depend on the seed
            except ValueError as error:
                raise ConfigError(f"runs.shots: {error} (data.train_set {data.train_set!r}, split {split!r})") from None


def _check_available(name: str, spec: TestsetSpec, root: pathlib.Path | None, neutral: Neutral = "drop") -> None:
    """The testset's data can be read: its file exists and reads (every row, its labels among those declared:
    a declared testset's own file is small), or each split is in the local mirror, or the hub has it.

    Online, a declared hub source is looked up, so a misspelt id fails now.
    """
    where = spec.origin or f"testset {name!r}"
    if spec.is_local_file:
        if not pathlib.Path(spec.source).is_file():
            raise MissingInputError(f"{where}, field 'source': file {spec.source} does not exist")
        try:
            load_testset(name, table={name: spec}, neutral=neutral)
        except UsageError:
            raise
        except ValueError as error:  # the message names the file, the line and the column
            raise DamagedInputError(str(error)) from None
        return
    missing = []
    if root is not None:
        for split in spec.split_groups.get(spec.split, (spec.split,)):
            try:
                local_path(spec, split, root)
            except FileNotFoundError as error:
                missing.append(str(error))
        if not missing:
            return
    if hub_offline():
        if not _hub_cached(spec.source):
            reason = (
                "; ".join(missing)
                or f"no local mirror (data.data_dir, $OODJAX_DATA_DIR) is set for split {spec.split!r}"
            )
            raise NotFetchedError(
                f"{where}: {reason}; the hub is offline (HF_HUB_OFFLINE) and {spec.source!r} is not in its cache"
            )
        return
    if spec.origin:
        try:
            huggingface_hub.HfApi().dataset_info(spec.source)
        except Exception as error:  # not found, private, or no network: each says why in its message
            raise MissingInputError(
                f"{where}, field 'source': hub dataset {spec.source!r} cannot be read: {type(error).__name__}: {error}"
            ) from error


def _hub_cached(source: str) -> bool:
    """Whether `datasets` (in its own layout, `owner___snake_name`) or huggingface_hub has cached anything of the hub
    dataset `source`."""
    *owner, name = source.split("/")
    arrow_cache = pathlib.Path(datasets.config.HF_DATASETS_CACHE) / "___".join([*owner, camelcase_to_snakecase(name)])
    hub_cache = pathlib.Path(huggingface_hub.constants.HF_HUB_CACHE) / f"datasets--{source.replace('/', '--')}"
    return arrow_cache.is_dir() or hub_cache.is_dir()


def _check_vocabulary(model: ModelSettings, answers: Sequence[str]) -> None:
    """Every id the tokenizer can give, the answer words' among them, has a row in the model's embedding.

    An id past the embedding is no error inside jit (XLA clamps or fills an out-of-bounds gather), so a
    larger tokenizer would train into NaN or score the wrong rows.
    """
    source = model.tokenizer
    tokenizer = load_tokenizer(source)
    try:
        answer_token_ids(tokenizer, answers)
    except ValueError as error:  # a word of several tokens, or two words of one token: the message says which
        raise ConfigError(str(error)) from None
    vocab_size = _model_config(model).get("vocab_size")
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        raise ConfigError(
            f"tokenizer {source!r} has {len(tokenizer)} tokens (ids 0..{len(tokenizer) - 1}), but "
            f"{model.path or 'model.hf_config'} embeds "
            f"only {vocab_size} (vocab_size): its ids past {vocab_size - 1} have no embedding; use the model's own "
            "tokenizer (config.tokenizer empty reads model.path's)"
        )


def _model_config(model: ModelSettings) -> dict[str, Any]:
    """The model's config.json as a dict: model.hf_config, or the checkpoint's file (local, cached or from the hub)."""
    if model.hf_config or model.path is None:  # ModelSettings holds one of the two
        return dict(model.hf_config)
    path = pathlib.Path(model.path).expanduser()
    if path.is_dir():
        return dict(read_json(path / "config.json"))
    return dict(read_json(pathlib.Path(huggingface_hub.hf_hub_download(model.path, "config.json"))))


def _check_output_dir(output_dir: str) -> None:
    """output_dir can be created and written to, now rather than after the model has loaded and trained.

    Its nearest existing folder is probed with a file deleted at once: a read-only file system or a missing
    permission shows only when writing.
    """
    existing = pathlib.Path(output_dir).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir {output_dir!r} cannot be created: {existing} is a file")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(
            f"output_dir {output_dir!r} cannot be written: {error.strerror or error} in {existing}"
        ) from None
