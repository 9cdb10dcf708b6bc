"""Each setting is declared once, on its piece's field (oodjax.settings): the config, its list item types and the
pieces `read` builds all come from those declarations."""

import dataclasses

import pytest
from ml_collections import config_dict

from oodjax import config_fields, config_read
from oodjax.engine.results import RunPlan
from oodjax.models.loading import ModelSettings
from oodjax.settings import declared

# What a piece cannot take from the default config: a model (the base config names none), and the fields
# `read` gives a piece from another's (a run plan's model name and training set).
SETTINGS_GIVEN = {ModelSettings: {"hf_config": {"model_type": "opt"}, "tokenizer": "gpt2"}}
OTHERS_GIVEN = {RunPlan: {"model": "opt-random", "train_set": "mnli"}}


@pytest.mark.parametrize("piece", config_fields.PIECES, ids=lambda piece: piece.__name__)
def test_a_piece_built_with_its_declared_defaults_is_the_piece_read_from_the_default_config(piece):
    config = config_fields.get_config()
    paths = {setting.name: setting.path for setting in declared(piece)}
    for name, value in SETTINGS_GIVEN.get(piece, {}).items():
        section, _, key = paths[name].rpartition(".")
        (config[section] if section else config)[key] = (
            config_dict.ConfigDict(value) if isinstance(value, dict) else value
        )
    given = OTHERS_GIVEN.get(piece, {})
    built = piece(**SETTINGS_GIVEN.get(piece, {}), **given)
    read = config_read.piece(piece, config, **given)
    assert dataclasses.asdict(read) == dataclasses.asdict(built)


def test_every_config_field_is_declared_once_on_a_piece():
    paths = [setting.path for piece in config_fields.PIECES for setting in declared(piece)]
    assert len(paths) == len(set(paths))
    assert set(paths) == set(config_fields.settings())


def test_list_item_types_come_from_the_annotations():
    types = config_fields.list_item_types()
    assert types["runs.seeds"] is int and types["data.buckets"] is int and types["wandb.tags"] is str
    assert types["model.adapters"] is str  # paths, written as text
    assert "data.max_length" not in types
