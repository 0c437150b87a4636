"""The frozen dataclass configs' machinery, shared by edge and cloud: fields that carry their default,
help and bounds (`setting`, `check_fields`), configs made of sections (`Sections`: each
section a frozen dataclass that one component receives whole), and strict loading from the defaults, a
YAML file and flags (`load_config`). A setting's name is unique across its config's sections, so a flag
(cli/flags.py makes one per setting) and a flat YAML key name it alone; YAML may also nest it under its
section (`policy: {max_draft: 4}`)."""
from __future__ import annotations

import dataclasses
import enum
import functools
import re
import typing
from collections.abc import Mapping
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
            le: float | None = None, choices: tuple[str, ...] | None = None,
            pattern: tuple[str, str] | None = None) -> Any:
    """A config field: its default, the help its flag shows, and the bounds (or, for a string field,
    the allowed values, or a (regular expression, what it allows in words) pair) that `check_fields`
    enforces. The one place a setting's default and rules live."""
    rules = {"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices, "pattern": pattern}
    return dataclasses.field(default=default, metadata=rules)


DEVICE_AUTO = "auto"  # a CUDA GPU when there is one, else the CPU (common/models/loading.py pick_device)


def device_setting(help: str) -> Any:
    """Where a model computes: not an enum, since cuda:N names any GPU, but a pattern `check_fields` enforces."""
    return setting(DEVICE_AUTO, f"{help}: auto, cpu, cuda or cuda:N",
                   pattern=(r"auto|cpu|cuda(:[0-9]+)?", "auto, cpu, cuda or cuda:N"))


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
        pattern = f.metadata.get("pattern")
        if pattern is not None and not (isinstance(value, str) and re.fullmatch(pattern[0], value)):
            raise ValueError(f"{f.name} must be {pattern[1]}, got {value!r}")
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


S = TypeVar("S", bound="Sections")


class Sections:
    """A config whose fields are sections: frozen dataclasses, each holding the settings of one concern
    and handed whole to the component that uses it. Built from flat keys (`of`), which `settings_of`
    routes to their sections."""

    @classmethod
    def of(cls: type[S], **values: Any) -> S:
        """The config with these settings (flat names, or a section's name and a mapping), every other
        at its default; ConfigError for an unknown name, the sections' own errors for a bad value."""
        return cls(**_build_sections(cls, route(cls, values)))

    def updated(self: S, **values: Any) -> S:
        """This config with these settings (flat names, as `of` takes them) changed."""
        changed = {name: dataclasses.replace(getattr(self, name), **part)
                   for name, part in route(type(self), values).items()}
        return dataclasses.replace(self, **changed)


@functools.cache
def sections_of(cls: type) -> dict[str, type]:
    """Section name -> section type for a config made of sections; {} for a flat config."""
    if not (isinstance(cls, type) and issubclass(cls, Sections)):
        return {}
    types = field_types(cls)
    return {f.name: types[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def settings_of(cls: type) -> dict[str, tuple[str | None, dataclasses.Field, Any]]:
    """Every setting of a config by its (flat) name: the section holding it (None in a flat config),
    its field and its type. A name twice is a bug: one flag and one flat key could not say which."""
    found: dict[str, tuple[str | None, dataclasses.Field, Any]] = {}
    parts = sections_of(cls) or {None: cls}
    for section, kind in parts.items():
        types = field_types(kind)
        for f in dataclasses.fields(kind):
            if f.name in found or f.name in parts:
                raise TypeError(f"{cls.__name__}: setting {f.name} is named twice")
            found[f.name] = (section, f, types[f.name])
    return found


def route(cls: type, values: Mapping[str, Any]) -> dict[str | None, dict[str, Any]]:
    """Section -> {setting: value} from flat keys and section mappings (`policy: {max_draft: 4}`);
    ConfigError naming any key that is no setting of `cls`, or a setting under another section."""
    settings, parts = settings_of(cls), sections_of(cls)
    routed: dict[str | None, dict[str, Any]] = {}
    unknown = []
    for key, value in values.items():
        if key in parts:
            if value is None:  # a section whose keys are all commented out
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"invalid {cls.__name__}: section {key} must be a mapping of its settings, "
                                  f"got {value!r}")
            for name, inner in value.items():
                if settings.get(name, (None,))[0] != key:
                    unknown.append(f"{key}.{name}")
                else:
                    routed.setdefault(key, {})[name] = inner
        elif key in settings:
            routed.setdefault(settings[key][0], {})[key] = value
        else:
            unknown.append(str(key))
    if unknown:
        where = f" (or nested under their sections: {', '.join(parts)})" if parts else ""
        raise ConfigError(f"unknown config key(s) for {cls.__name__}: {', '.join(sorted(unknown))}; "
                          f"known: {', '.join(sorted(settings))}{where}")
    return routed


def flat_settings(config: Any) -> dict[str, Any]:
    """Every setting of a config and its value, by flat name (as flags and flat YAML keys name them)."""
    return {name: getattr(getattr(config, section) if section else config, name)
            for name, (section, _, _) in settings_of(type(config)).items()}


def _build_sections(cls: type, routed: dict[str | None, dict[str, Any]]) -> dict[str, Any]:
    """The keyword arguments of `cls`: each section built from its routed settings, or the settings
    themselves for a flat config."""
    parts = sections_of(cls)
    if not parts:
        return routed.get(None, {})
    return {name: kind(**routed.get(name, {})) for name, kind in parts.items()}


def load_config(cls: type[T], path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Build `cls` from defaults, then the YAML file at `path` (flat keys or sections), then
    `overrides` (flat keys; None values skipped).

    Unknown keys and values the dataclass rejects raise ConfigError naming the key.
    """
    routed = route(cls, read_mapping(path) if path is not None else {})
    for section, values in route(cls, {k: v for k, v in (overrides or {}).items() if v is not None}).items():
        routed.setdefault(section, {}).update(values)
    settings = settings_of(cls)
    for values in routed.values():
        for key, value in values.items():
            values[key] = _typed(cls.__name__, key, value, settings[key][2])
    try:
        return cls(**_build_sections(cls, routed))
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
