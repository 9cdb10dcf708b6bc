"""Checks of a config that must fail fast: before data is tokenised or anything is compiled.

A sweep job that dies after twenty minutes of loading on a misspelt path
wastes a cluster slot; these checks look only at the config and the file
system (and the local Hugging Face cache for hub ids when offline, or the hub
for the hub id of a declared testset missing from the local mirror, and
W&B's server for a login when the runs record online).

Where every check of a config lives, in the order a job meets them:

- the command line (``oodjax.config_cli``): unknown fields, values that do
  not parse, list items of the wrong type;
- here, ``check_config`` (``oodjax.job.resolve`` runs it first): each
  path's existence, the fields with no piece of the job to hold them, and
  the facts other modules own, asked of them: a declared testset's fields
  (``oodjax.data.testsets.testset_table``), the LoRA config
  (``oodjax.models.lora.LoRAConfig``), the remat policy
  (``oodjax.models.layers.check_remat``), the handling of neutral
  examples (``oodjax.data.testsets.check_neutral``), the template
  (``oodjax.data.prompts.check_template``), a local checkpoint's
  files from their headers (``oodjax.models.loading.verify_checkpoint``),
  each adapter folder on the model's shapes (``oodjax.models.lora.read_peft``,
  ``lora_from_peft``), the few-shot pool's size per label
  (``oodjax.data.few_shot``) and a declared testset file's rows; and W&B's
  login, asked of wandb, when a training job records online;
- the pieces of the job, as ``oodjax.job.read`` builds them: each checks
  the ranges of the fields it holds (``loading.ModelSettings`` the
  attention kernel, ``results.RunPlan`` the runs, ``cadence.Cadence`` steps
  and intervals, ``steps.OptimizerSettings`` the schedule and warm-up,
  ``sharding.MeshShape`` the mesh sizes);
- ``oodjax.engine.geometry.batch_geometry``: whether the batch sizes,
  micro-batches and mesh fit together (it needs the mesh and the few-shot
  sets, so it runs once those exist, still before anything compiles);
- ``oodjax.models.loading``: the checkpoint itself (every tensor accounted
  for) as it loads, for a hub id checked only then.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
from collections.abc import Sequence

import datasets
import huggingface_hub
from datasets.naming import camelcase_to_snakecase
from flax import nnx
from ml_collections import config_dict

from analysis import schema
from oodjax.config_fields import LIST_ITEM_TYPES
from oodjax.data import answer_token_ids, check_neutral, few_shot, load_testset, load_tokenizer, training_pool
from oodjax.data.prompts import check_template
from oodjax.data.testsets import (
    HUB_ID,
    TestsetSpec,
    default_data_dir,
    hub_offline,
    local_path,
    pool_split,
    testset_spec,
    testset_table,
    training_sets,
)
from oodjax.engine.events import WANDB_MODES, installed, setup_wandb
from oodjax.models.hf_checkpoint import read_json
from oodjax.models.layers import check_remat
from oodjax.models.loading import abstract_model, verify_checkpoint
from oodjax.models.lora import LoRAConfig, lora_from_peft, read_peft
from oodjax.usage_errors import ConfigError, DamagedInputError, MissingInputError, NotFetchedError, UsageError

DTYPES = ("float32", "bfloat16", "float16")


def check_config(config: config_dict.ConfigDict, *, evaluation: bool = False) -> None:
    """Raises a ``ConfigError`` naming the first wrong field and its allowed values, a ``MissingInputError``
    naming a path that does not exist, or a ``NotFetchedError`` naming what the offline hub cannot give
    (``oodjax.usage_errors``: the entry points print each as one line); ``evaluation``: the config is
    ``oodjax.evaluate``'s, not training's."""
    _check_command(config, evaluation)
    _check_lists(config)
    _check_model(config.model)
    _check_lora(config)
    _check_adapters(config.model)
    _check_train(config.train)
    _check_source("tokenizer", config.tokenizer or config.model.path, "tokenizer_config.json")
    _check_data(config.data, config.runs.shots, needs_pool=not evaluation or config.eval.in_context)
    _check_trackers(config, evaluation)
    _check_export(config.export)
    _check_vocabulary(config)
    _check_output_dir(config.output_dir)


def _check_command(config: config_dict.ConfigDict, evaluation: bool) -> None:
    """The in-context baseline trains nothing, and uses no adapters: each run is the base model, prompted."""
    if not config.eval.in_context:
        return
    if not evaluation:
        raise ConfigError(
            "eval.in_context=True is for evaluation without training: run `python -m oodjax.evaluate` "
            "(oodjax-evaluate), not oodjax.main"
        )
    if config.model.adapters:
        raise ConfigError(
            "eval.in_context=True evaluates the base model in context, so model.adapters must be empty; "
            "evaluate the adapters in a call of their own"
        )


def _check_lists(config: config_dict.ConfigDict) -> None:
    """List fields hold items of their declared type: a config file's runs.seeds=("0",) is not seed 0."""
    for field, item_type in LIST_ITEM_TYPES.items():
        section, _, key = field.rpartition(".")
        value = config[section][key]
        if not isinstance(value, (tuple, list)) or not all(
            isinstance(item, item_type) and not isinstance(item, bool) for item in value
        ):
            raise ConfigError(f"{field} must be a list of {item_type.__name__}, got {value!r}")


def _check_trackers(config: config_dict.ConfigDict, evaluation: bool) -> None:
    """The trackers that are on are installed, and W&B online has a login (evaluation tracks nothing)."""
    if config.wandb.enabled and not installed("wandb"):
        raise ConfigError("wandb.enabled is True but wandb is not installed (pip install wandb)")
    if config.wandb.mode and config.wandb.mode not in WANDB_MODES:
        raise ConfigError(
            f"wandb.mode must be empty (wandb's default) or one of {WANDB_MODES}, got {config.wandb.mode!r}"
        )
    if config.tensorboard.enabled and not installed("tensorboardX"):
        raise ConfigError("tensorboard.enabled is True but tensorboardX is not installed (pip install tensorboardX)")
    if config.wandb.enabled and not evaluation:
        _check_wandb_login(config.wandb.mode)


def _check_wandb_login(mode: str) -> None:
    """W&B online needs a login, which ``wandb.init`` would find missing (or rejected) only once the model and
    data have loaded. Asked here of wandb itself, set up (quiet) in the mode the runs will have
    (``events.setup_wandb``): ``wandb.login`` without a prompt finds the login (WANDB_API_KEY, ~/.netrc, wandb's
    settings) and verifies it with the server. Offline and disabled need none. Every process asks, so all stop
    together."""
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


def _check_model(model: config_dict.ConfigDict) -> None:
    has_path, has_hf_config = bool(model.path), bool(model.hf_config.to_dict())
    if has_path == has_hf_config:
        raise ConfigError(
            "set exactly one of model.path (a checkpoint) and model.hf_config (a random model); "
            f"got path={model.path!r} and {'a' if has_hf_config else 'no'} hf_config"
        )
    if has_hf_config and "model_type" not in model.hf_config:
        raise ConfigError("model.hf_config needs a model_type (e.g. 'opt')")
    if has_path:
        _check_source("model.path", model.path, "config.json")
        if pathlib.Path(model.path).expanduser().is_dir():
            _check_checkpoint(pathlib.Path(model.path).expanduser())
    for field in ("dtype", "compute_dtype"):
        value = model[field]
        if value and value not in DTYPES:
            raise ConfigError(f"model.{field} must be one of {DTYPES}, got {value!r}")
    try:
        check_remat(model.remat)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _check_checkpoint(directory: pathlib.Path) -> None:
    """A local checkpoint's files are all there, whole, and fit its config.json, read from their headers
    (``verify_checkpoint``): a missing or truncated weights file is named now, not after minutes of loading."""
    try:
        verify_checkpoint(directory)
    except UsageError:  # a file missing, truncated or not fitting: the message names it
        raise
    except ValueError as error:  # config.json's model_type or a field its family reads
        raise ConfigError(f"model.path: {error}") from None


def _check_adapters(model: config_dict.ConfigDict) -> None:
    """Each folder of model.adapters is a readable PEFT LoRA adapter that fits the model, checked on the
    model's shapes alone (``abstract_model``): a wrong folder is one line before anything loads."""
    if not model.adapters:
        return
    hf_config = _model_config(model)
    abstract: dict[LoRAConfig, nnx.State] = {}
    for folder in model.adapters:
        cfg, tensors = read_peft(pathlib.Path(folder).expanduser())
        if cfg not in abstract:
            abstract[cfg] = nnx.state(abstract_model(hf_config, dtype="float32", lora=cfg), nnx.LoRAParam)
        try:
            lora_from_peft(abstract[cfg], tensors, source=folder)
        except ConfigError as error:
            raise ConfigError(f"model.adapters: {error}") from None


def _check_train(train: config_dict.ConfigDict) -> None:
    """A learning rate that trains: a negative one climbs the loss (and zero trains nothing)."""
    if not train.learning_rate > 0:
        raise ConfigError(f"train.learning_rate must be positive, got {train.learning_rate}")


def _check_lora(config: config_dict.ConfigDict) -> None:
    try:
        LoRAConfig.from_config(config.lora)
    except ValueError as error:
        raise ConfigError(f"lora: {error}") from error


def _check_source(field: str, source: str, marker_file: str) -> None:
    """A local directory holding `marker_file` (a JSON file, read), or a hub id (cached locally when offline)."""
    if not source:
        raise ConfigError(f"{field} is empty: name a local directory or a hub id")
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


def _check_export(export: config_dict.ConfigDict) -> None:
    """A push to the hub that cannot happen is refused now, not after the runs have trained."""
    if (export.every_checkpoint or export.hub_repo) and not export.peft:
        raise ConfigError("export.every_checkpoint and export.hub_repo need export.peft=True")
    if not export.hub_repo:
        return
    if not HUB_ID.fullmatch(export.hub_repo):
        raise ConfigError(f"export.hub_repo {export.hub_repo!r} is not a hub repo id (user/name)")
    if hub_offline():
        raise ConfigError(
            f"export.hub_repo={export.hub_repo!r} pushes adapters to the Hugging Face hub, but HF_HUB_OFFLINE is "
            "set; unset it, or leave export.hub_repo empty and upload <run_dir>/adapter/ later"
        )


def _check_data(data: config_dict.ConfigDict, shots: Sequence[int], *, needs_pool: bool) -> None:
    """``needs_pool``: the job draws few-shot sets of ``shots`` examples (training, the in-context baseline) from
    data.train_set's pool, which must hold enough of each label."""
    if data.data_dir and not pathlib.Path(data.data_dir).expanduser().is_dir():
        raise MissingInputError(f"data.data_dir {data.data_dir!r} is not a directory")
    if not data.testsets:
        raise ConfigError("data.testsets is empty: name the testsets to evaluate (at least data.train_set)")
    table = declared_testsets(data)
    for name in data.testsets:
        try:
            testset_spec(name, table)
        except KeyError as error:  # an unknown name: the message lists the known ones
            raise ConfigError(f"data.testsets: {error.args[0]}") from None
    if len(set(data.testsets)) != len(data.testsets):
        raise ConfigError(f"data.testsets lists a testset twice: {list(data.testsets)}")
    if data.train_set not in training_sets():
        raise ConfigError(
            f"data.train_set {data.train_set!r} is not a training set; few-shot pools exist for: "
            f"{', '.join(training_sets())}"
        )
    if data.train_set not in data.testsets:
        raise ConfigError(
            f"data.train_set {data.train_set!r} must also be in data.testsets: it is the in-domain testset"
        )
    if data.eval_cap < 0:
        raise ConfigError(f"data.eval_cap must be >= 0 (0 = no cap), got {data.eval_cap}")
    try:
        check_neutral(data.neutral)
    except ValueError as error:
        raise ConfigError(f"data.{error}") from None
    try:
        check_template(data.template)
    except ValueError as error:
        raise ConfigError(f"data.template: {error}") from None
    answers = list(data.answers)
    if len(answers) != 2 or len(set(answers)) != 2 or not all(answers):
        raise ConfigError(f"data.answers must be two different non-empty words (yes, no), got {answers}")
    root = pathlib.Path(data.data_dir).expanduser() if data.data_dir else default_data_dir()
    for name in data.testsets:
        _check_available(name, table[name], root, data.neutral)
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


def declared_testsets(data: config_dict.ConfigDict) -> dict[str, TestsetSpec]:
    """The built-in and declared testsets of a data section (``testset_table``); a bad declaration is a
    ``ConfigError`` naming it and its field, a missing file a ``MissingInputError``."""
    if not isinstance(data.extra_testsets, config_dict.ConfigDict):
        raise ConfigError(f"data.extra_testsets must be a dict of testset declarations, got {data.extra_testsets!r}")
    if data.extra_testsets_file and not pathlib.Path(data.extra_testsets_file).expanduser().is_file():
        raise MissingInputError(f"data.extra_testsets_file {data.extra_testsets_file!r} is not a file")
    try:
        table = testset_table(data.extra_testsets.to_dict(), data.extra_testsets_file or None)
    except ValueError as error:  # the message names the declaration and its field
        raise ConfigError(str(error)) from error
    if schema.TRAIN_TESTSET in table:
        raise ConfigError(
            f"{table[schema.TRAIN_TESTSET].origin}: {schema.TRAIN_TESTSET!r} is the results' name for each run's "
            "own training set; name the testset otherwise"
        )
    return table


def _check_available(name: str, spec: TestsetSpec, root: pathlib.Path | None, neutral: str = "drop") -> None:
    """The testset's data can be read: its file exists and reads (every row, its labels among those declared:
    a declared testset's own file is small), or each split is in the local mirror, or the hub has it.

    Offline, a split missing from the mirror must be in the `datasets` or hub
    cache (whether its split is there is left to loading). Online, a declared
    hub source is looked up on the hub, so a misspelt id fails now; the
    built-in ones are not.
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


def _check_vocabulary(config: config_dict.ConfigDict) -> None:
    """Every id the tokenizer can give, the answer words' among them, has a row in the model's embedding.

    An id past the embedding is not an error inside jit: XLA clamps or
    fills an out-of-bounds gather, so a tokenizer larger than the model
    (another model's, or one with added tokens) would train into NaN or
    score the wrong rows. Checked here, before the model loads.
    """
    source = config.tokenizer or config.model.path
    tokenizer = load_tokenizer(source)
    try:
        answer_token_ids(tokenizer, config.data.answers)
    except ValueError as error:  # a word of several tokens, or two words of one token: the message says which
        raise ConfigError(str(error)) from None
    vocab_size = _model_config(config.model).get("vocab_size")
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        model = config.model.path or "model.hf_config"
        raise ConfigError(
            f"tokenizer {source!r} has {len(tokenizer)} tokens (ids 0..{len(tokenizer) - 1}), but {model} embeds "
            f"only {vocab_size} (vocab_size): its ids past {vocab_size - 1} have no embedding; use the model's own "
            "tokenizer (config.tokenizer empty reads model.path's)"
        )


def _model_config(model: config_dict.ConfigDict) -> dict:
    """The model's config.json as a dict: model.hf_config, or the checkpoint's file (local, cached or from the hub)."""
    if model.hf_config.to_dict():
        return model.hf_config.to_dict()
    path = pathlib.Path(model.path).expanduser()
    if path.is_dir():
        return read_json(path / "config.json")
    return read_json(pathlib.Path(huggingface_hub.hf_hub_download(model.path, "config.json")))


def _check_output_dir(output_dir: str) -> None:
    """output_dir can be created and written to, now rather than after the model has loaded and trained.

    Its nearest existing folder (itself, or the parent it would be created
    in) is probed with a file that is deleted at once: a read-only file
    system or a missing permission shows only when writing. Nothing is left
    behind, so a job refused later has written nothing.
    """
    if not output_dir:
        raise ConfigError("output_dir is empty")
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
