"""CLI flags made from the config dataclasses: one `--setting-name` per setting (of every section, for a
config made of sections: the flags stay flat), whose help, type, choices and default are read from the
field (common/config.py `setting`), so a setting is written down once.

A flag defaults to None, "not given": the --config file or the dataclass default then applies
(`load_config`), and the dataclass checks every value, whether it came from a flag or a file.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable
from typing import Any

from ..common.config import Choice, settings_of


def add_config_flags(parser: argparse.ArgumentParser | Any, cls: type, exclude: Iterable[str] = ()) -> None:
    """Add `--setting-name` to `parser` (or an argument group) for every setting of the config `cls`
    but those in `exclude`."""
    for name, (_, f, hint) in settings_of(cls).items():
        if name not in exclude:
            parser.add_argument("--" + name.replace("_", "-"), default=None, help=_help(f),
                                **_flag_kind(hint, f.metadata.get("choices")))


def config_overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """What the command line gave for `cls`'s settings (flat names); one it did not give is left out."""
    values = {name: getattr(args, name, None) for name in settings_of(cls)}
    return {name: tuple(value) if isinstance(value, list) else value  # a repeated flag: its field's tuple
            for name, value in values.items() if value is not None}


def _flag_kind(hint: Any, choices: Iterable[str] | None) -> dict[str, Any]:
    """How argparse reads a value of a field of type `hint`."""
    if isinstance(hint, type) and issubclass(hint, Choice):
        return {"choices": [member.value for member in hint]}
    if choices is not None:  # a string field whose values another enum names
        return {"choices": [c for c in choices if c]}  # "" (decide for me) is the flag left out
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is tuple:
        return {"action": "append"}  # repeatable
    number = next((t for t in (int, float) if t is hint or t in typing.get_args(hint)), None)
    return {"type": number} if number is not None else {}


def _help(f: dataclasses.Field) -> str:
    """The field's help with its default (argparse formats help with %: escape it)."""
    default = _shown(f.default)
    return (f.metadata.get("help", "") + (f" (default: {default})" if default else "")).replace("%", "%%")


def _shown(value: Any) -> str:
    """A default as a flag or a YAML file spells it; "" for one not worth showing."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "" if value in ("", None, ()) else str(value)
