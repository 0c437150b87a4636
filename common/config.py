"""The frozen dataclass configs' machinery, shared by edge and cloud: fields that carry their default,
help and bounds (`setting`, `like`, `check_fields`), and strict loading from the defaults, a YAML file
and flags (`load_config`). The CLI makes one flag per field from the same fields (cli/flags.py)."""
from __future__ import annotations

import dataclasses
import enum
import functools
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


class DType(Choice):
    """The weights' type, on either side: auto = float32 on a CPU, bfloat16 on a GPU."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


def setting(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A config field: its default, the help its flag shows, and the bounds (or, for a string field,
    the allowed values) that `check_fields` enforces. The one place a setting's default and rules live."""
    rules = {"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices}
    return dataclasses.field(default=default, metadata=rules)


def like(cls: type, name: str) -> Any:
    """A field with the default, help and bounds of `cls`'s field `name`: for a flat config (the serve
    configs) that passes the setting on to the spec that owns it."""
    source = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=source.default, metadata=source.metadata)


def check_fields(config: Any) -> None:
    """Make choice fields their enum members and check every field's bounds (from `setting`);
    ValueError naming the field. The first line of a config's `__post_init__`."""
    types = field_types(type(config))
    for f in dataclasses.fields(config):
        value, kind = getattr(config, f.name), types[f.name]
        if isinstance(kind, type) and issubclass(kind, Choice):
            value = choice(kind, value, f.name)
            object.__setattr__(config, f.name, value)
        allowed = f.metadata.get("choices")
        if allowed is not None and value not in allowed:
            raise ValueError(f"{f.name} must be one of {', '.join(c for c in allowed if c)}, got {value!r}")
        ge, gt, le = (f.metadata.get(k) for k in ("ge", "gt", "le"))
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if ge is not None and le is not None and not ge <= value <= le:
            raise ValueError(f"{f.name} must be in [{ge}, {le}], got {value}")
        if ge is not None and value < ge:
            raise ValueError(f"{f.name} must be >= {ge}, got {value}")
        if gt is not None and not value > gt:
            raise ValueError(f"{f.name} must be > {gt}, got {value}")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of each field of a dataclass."""
    return typing.get_type_hints(cls)


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
    types = field_types(cls)
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
