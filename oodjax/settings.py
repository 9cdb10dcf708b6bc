"""A setting declared once, on the field of the piece (a settings dataclass) that uses it: its type (the
annotation), its default, its config path, whether a resumed run may change it, and its meaning (the comment
lines right above the field, which `--help` shows). `oodjax.config_fields` derives the config, the help and the
list item types from these declarations, and `oodjax.config_read` the pieces.
"""

from __future__ import annotations

import dataclasses
import pathlib
import types
import typing
from typing import Any

_KEY = "oodjax.setting"


def setting(default: Any, *, path: str, resumable: bool = False) -> Any:
    """A dataclass field declared as the config's setting ``path``. ``resumable``: a resumed run may change it, as
    it changes nothing a run computes (its log, its trackers), or what it changes is compared resolved (a run's
    steps, warm-up and evaluated steps). A dict default is copied for each piece."""
    metadata = {_KEY: {"path": path, "resumable": resumable}}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Declared:
    """One declared setting, as its piece declares it."""

    piece: type
    name: str  # the piece's field
    path: str  # the config's field
    resumable: bool
    default: Any  # the piece's
    kind: Any  # the field's type, resolved

    @property
    def item_type(self) -> type | None:
        """A list's item type (``tuple[int, ...]``: int; a path is written as text); None: not a list."""
        for kind in self._kinds():
            if typing.get_origin(kind) is tuple:
                item = typing.get_args(kind)[0]
                return str if item is pathlib.Path else item
        return None

    @property
    def config_default(self) -> Any:
        return self.config_value(self.default)

    def config_value(self, value: Any) -> Any:
        """A piece's value as the config holds it: None as its type's empty value ("" or ()), a path as text."""
        if value is None:
            return () if self.item_type is not None else ""
        return str(value) if isinstance(value, pathlib.PurePath) else value

    def piece_value(self, value: Any) -> Any:
        """A config's value as the piece holds it: a list as a tuple, an empty value as None where the default is
        None (model.path "" is no checkpoint), a path's text as a path."""
        if isinstance(value, (list, tuple)):
            value = tuple(value)
        if self.default is None and not value:
            return None
        return pathlib.Path(value) if pathlib.Path in self._kinds() and isinstance(value, str) else value

    def _kinds(self) -> tuple[Any, ...]:
        return typing.get_args(self.kind) if isinstance(self.kind, types.UnionType) else (self.kind,)


def declared(piece: type) -> list[Declared]:
    """The fields of ``piece`` (a dataclass) declared as settings, in its order."""
    hints = typing.get_type_hints(piece)
    return [
        Declared(piece, field.name, **field.metadata[_KEY], default=_default(field), kind=hints[field.name])
        for field in dataclasses.fields(piece)
        if _KEY in field.metadata
    ]


def _default(field: dataclasses.Field[Any]) -> Any:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
