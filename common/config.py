"""YAML and CLI loading for the frozen dataclass configs: thin, strict, and shared by edge and cloud."""
from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .protocol.errors import HybridSpecError

T = TypeVar("T")
E = TypeVar("E", bound="Choice")


class Choice(str, enum.Enum):
    """A setting with a fixed set of values: compares equal to, and prints as, its string value, so
    YAML files, flags and code that compare strings all keep working."""

    def __str__(self) -> str:
        return self.value


def choice(kind: type[E], value: object, name: str) -> E:
    """`value` (a member or its string) as a member of `kind`; ValueError naming the choices."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(m.value for m in kind)}, got {value!r}") from None


class ConfigError(ValueError):
    """A config file or flag that cannot be used; the message names the key."""


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in a file; ConfigError if it is missing, not YAML, or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {p} must hold a mapping of keys to values")
    return loaded


def load_config(cls: type[T], path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Build `cls` from defaults, then the YAML file at `path`, then `overrides` (None values skipped).

    Unknown keys and values the dataclass rejects raise ConfigError naming the key.
    """
    values: dict[str, Any] = read_mapping(path) if path is not None else {}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) for {cls.__name__}: {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    types = typing.get_type_hints(cls)
    for key, value in values.items():
        values[key] = _typed(cls.__name__, key, value, types[key])
    try:
        return cls(**values)
    except (TypeError, ValueError, HybridSpecError) as exc:
        raise ConfigError(f"invalid {cls.__name__}: {exc}") from None


def _typed(owner: str, key: str, value: Any, expected: type) -> Any:
    """`value` as the field's type (an int where a float is wanted is fine, a list where a tuple of
    strings is); ConfigError otherwise."""
    if isinstance(expected, type) and issubclass(expected, Choice):
        try:
            return choice(expected, value, key)
        except ValueError as exc:
            raise ConfigError(f"invalid {owner}: {exc}") from None
    if typing.get_origin(expected) is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"invalid {owner}: {key} must be a list of strings, got {value!r}")
    ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(f"invalid {owner}: {key} must be {_NAMES.get(expected, expected)}, got {value!r}")
    return value


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          int | None: "an integer or null"}
