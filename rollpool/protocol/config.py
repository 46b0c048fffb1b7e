"""Loading a process's frozen config dataclass from flags, environment and TOML.

Precedence, lowest first: the dataclass defaults, a TOML file (its table named
after the process kind, e.g. ``[broker]``), environment variables
``ROLLPOOL_<FIELD>`` (``ROLLPOOL_HEARTBEAT_INTERVAL_S=2``), command-line flags
(``--heartbeat-interval-s 2``). Validation stays in each config's
``__post_init__``, which names the field and the allowed range.

Help text for a flag comes from ``field(metadata={"help": ...})``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar, Union

from rollpool.protocol.errors import ConfigError

__all__ = ["add_config_arguments", "load_config", "parse_value"]

C = TypeVar("C")

_SKIP = "cli"  # field(metadata={"cli": False}) keeps a field off the command line


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the type without Optional, whether None is allowed)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def parse_value(tp: Any, text: str, name: str) -> Any:
    """Parse one string (flag or environment value) as field type `tp`."""
    base, optional = _base_type(tp)
    if optional and text.strip().lower() in ("", "none", "null"):
        return None
    try:
        if base is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if base is str:
            return text
        origin = typing.get_origin(base)
        if origin in (tuple, list):
            (item, *_rest) = typing.get_args(base)
            parts = [p.strip() for p in text.split(",") if p.strip()]
            return tuple(parse_value(item, p, name) for p in parts)
    except ValueError as exc:
        raise ConfigError(f"{name}: cannot parse {text!r} as {getattr(base, '__name__', base)}") from exc
    raise ConfigError(f"{name}: unsupported config type {tp!r}")


def _parser_for(tp: Any, name: str) -> Any:
    def parse(text: str) -> Any:
        return parse_value(tp, text, name)

    return parse


def add_config_arguments(parser: argparse.ArgumentParser, cls: type[Any], *, exclude: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field of `cls`; unset flags stay out of the namespace."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude or f.metadata.get(_SKIP) is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None and f.default is not dataclasses.MISSING:
            help_text = f"{help_text} (default {default!r})".strip()
        base, _ = _base_type(hints[f.name])
        if base is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(base) in (tuple, list):  # repeatable; each value may also be a comma list
            parser.add_argument(
                flag,
                dest=f.name,
                default=argparse.SUPPRESS,
                action="extend",
                type=_parser_for(hints[f.name], f.name),
                help=f"{help_text} (repeatable)".strip(),
                metavar=f.name.upper(),
            )
        else:
            parser.add_argument(
                flag,
                dest=f.name,
                default=argparse.SUPPRESS,
                type=_parser_for(hints[f.name], f.name),
                help=help_text,
                metavar=f.name.upper(),
            )


def load_config(
    cls: type[C],
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    *,
    toml_path: str | None = None,
    section: str | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> C:
    """Build `cls` from defaults < TOML < environment < flags < overrides."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    path = toml_path or env.get("ROLLPOOL_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
        table = doc.get(section, {}) if section else doc
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: [{section}] must be a table")
        for key, value in table.items():
            key = key.replace("-", "_")
            if key not in names:
                raise ConfigError(f"config file {path}: unknown key {key!r} in [{section}]")
            base, _ = _base_type(hints[key])
            if typing.get_origin(base) in (tuple, list) and isinstance(value, list):
                value = tuple(value)
            values[key] = value
    for name in names:
        raw = env.get("ROLLPOOL_" + name.upper())
        if raw is not None:
            values[name] = parse_value(hints[name], raw, "ROLLPOOL_" + name.upper())
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    for name, value in given.items():
        if name in names:
            if isinstance(value, list) and typing.get_origin(_base_type(hints[name])[0]) is tuple:
                value = tuple(value)
            values[name] = value
    values.update({k: v for k, v in overrides.items() if k in names})
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from exc
