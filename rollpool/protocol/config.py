"""Loading a process's frozen config dataclass from flags, environment and TOML.

Precedence, lowest first: the dataclass defaults, a TOML file (its table named
after the process kind, e.g. ``[broker]``), environment variables
``ROLLPOOL_<FIELD>`` (``ROLLPOOL_HEARTBEAT_INTERVAL_S=2``), command-line flags
(``--heartbeat-interval-s 2``). Validation stays in each config's
``__post_init__``, which names the field and the allowed range.

Help text for a flag comes from ``field(metadata={"help": ...})``.

A field whose type is itself a config dataclass (``LocalLaunchConfig.worker``,
``.restart``) is nested: on the command line and in the environment its fields
stay flat (``--engine``, ``--restart-backoff-s``; a nested field's
``metadata["flag"]`` or the outer field's ``metadata["prefix"]`` names them),
in TOML they are a sub-table (``[launch.worker]``, ``[launch.restart]``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar, Union

from rollpool.protocol.errors import ConfigError

__all__ = ["add_config_arguments", "help_", "load_config", "parse_value"]

C = TypeVar("C")

log = logging.getLogger(__name__)

_SKIP = "cli"  # field(metadata={"cli": False}) keeps a field off the command line


def help_(text: str) -> dict[str, Any]:
    """Field metadata with a flag's help text (what `add_config_arguments` shows for the field)."""
    return {"help": text}


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


@dataclasses.dataclass(frozen=True, slots=True)
class _Leaf:
    """One flag: its flat name (``--flag``, ``ROLLPOOL_<FLAG>``), where it lives (``group.name`` or ``name``)."""

    flat: str
    group: str | None
    name: str
    tp: Any
    help: str
    default: Any


def _nested(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _leaves(cls: type[Any]) -> list[_Leaf]:
    """Every flag of `cls`: its own fields, and the fields of a nested config field, flattened.

    A nested field (its type a dataclass, e.g. ``worker: LaunchWorker``) contributes one flag per field
    of its own, named ``metadata["flag"]`` of that field, else ``metadata["prefix"]`` of the nested field
    plus the field name; its defaults are those of the nested field's default instance.
    """
    hints = typing.get_type_hints(cls)
    out: list[_Leaf] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get(_SKIP) is False:
            continue
        default = _default_of(f)
        if _nested(hints[f.name]):
            sub_hints = typing.get_type_hints(hints[f.name])
            prefix = f.metadata.get("prefix", "")
            for g in dataclasses.fields(hints[f.name]):
                flat = g.metadata.get("flag", prefix + g.name)
                sub_default = getattr(default, g.name) if default is not dataclasses.MISSING else dataclasses.MISSING
                out.append(_Leaf(flat, f.name, g.name, sub_hints[g.name], g.metadata.get("help", ""), sub_default))
            continue
        out.append(_Leaf(f.name, None, f.name, hints[f.name], f.metadata.get("help", ""), default))
    return out


def add_config_arguments(parser: argparse.ArgumentParser, cls: type[Any], *, exclude: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field of `cls` (nested config fields flattened, see `_leaves`); unset flags stay out of the namespace."""
    for leaf in _leaves(cls):
        if leaf.flat in exclude:
            continue
        flag = "--" + leaf.flat.replace("_", "-")
        help_text = leaf.help
        if leaf.default is not None and leaf.default is not dataclasses.MISSING:
            help_text = f"{help_text} (default {leaf.default!r})".strip()
        base, _ = _base_type(leaf.tp)
        if base is bool:
            parser.add_argument(flag, dest=leaf.flat, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(base) in (tuple, list):  # repeatable; each value may also be a comma list
            parser.add_argument(
                flag,
                dest=leaf.flat,
                default=argparse.SUPPRESS,
                action="extend",
                type=_parser_for(leaf.tp, leaf.flat),
                help=f"{help_text} (repeatable)".strip(),
                metavar=leaf.flat.upper(),
            )
        else:
            parser.add_argument(
                flag,
                dest=leaf.flat,
                default=argparse.SUPPRESS,
                type=_parser_for(leaf.tp, leaf.flat),
                help=help_text,
                metavar=leaf.flat.upper(),
            )


def _toml_table(path: str, section: str | None) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    table = doc.get(section, {}) if section else doc
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [{section}] must be a table")
    return table


def _toml_value(leaf: _Leaf, value: Any) -> Any:
    base, _ = _base_type(leaf.tp)
    if typing.get_origin(base) in (tuple, list) and isinstance(value, list):
        return tuple(value)
    return value


def _from_toml(path: str, section: str | None, leaves: list[_Leaf]) -> dict[str, Any]:
    """Flat name -> value, from the TOML table and its sub-tables (``[launch.worker]``).

    A nested field's key written flat in the table (``[launch] engine = ...``, the layout before the
    configs were nested) is still read, with a deprecation warning that names its new place.
    """
    table = _toml_table(path, section)
    by_flat = {leaf.flat: leaf for leaf in leaves}
    by_place = {(leaf.group, leaf.name): leaf for leaf in leaves}
    groups = {leaf.group for leaf in leaves if leaf.group}
    where = f"[{section}]" if section else "the top level"
    values: dict[str, Any] = {}

    def put(leaf: _Leaf, value: Any, spelled: str) -> None:
        if leaf.flat in values:
            raise ConfigError(f"config file {path}: {spelled} is given twice (flat and in [{section}.{leaf.group}])")
        values[leaf.flat] = _toml_value(leaf, value)

    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        if key in groups and isinstance(value, dict):
            for raw_sub, sub_value in value.items():
                leaf = by_place.get((key, raw_sub.replace("-", "_")))
                if leaf is None:
                    raise ConfigError(f"config file {path}: unknown key {raw_sub!r} in [{section}.{key}]")
                put(leaf, sub_value, f"{key}.{leaf.name}")
            continue
        leaf = by_flat.get(key)
        if leaf is None:
            raise ConfigError(f"config file {path}: unknown key {key!r} in {where}")
        if leaf.group is not None:
            log.warning("config file %s: key %r in %s is deprecated (read for now): write it as %s = ... in [%s.%s]",
                        path, raw_key, where, leaf.name, section, leaf.group)
        put(leaf, value, key)
    return values


def load_config(
    cls: type[C],
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    *,
    toml_path: str | None = None,
    section: str | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> C:
    """Build `cls` from defaults < TOML < environment < flags < overrides.

    Flags, environment variables and overrides use the flat names (``engine``, ``restart_backoff_s``);
    the TOML file nests (``[launch.worker] engine``, ``[launch.restart] backoff_s``).
    """
    env = os.environ if environ is None else environ
    leaves = _leaves(cls)
    by_flat = {leaf.flat: leaf for leaf in leaves}
    values: dict[str, Any] = {}
    path = toml_path or env.get("ROLLPOOL_CONFIG")
    if path:
        values.update(_from_toml(path, section, leaves))
    for leaf in leaves:
        raw = env.get("ROLLPOOL_" + leaf.flat.upper())
        if raw is not None:
            values[leaf.flat] = parse_value(leaf.tp, raw, "ROLLPOOL_" + leaf.flat.upper())
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    for name, value in given.items():
        if name in by_flat:
            if isinstance(value, list) and typing.get_origin(_base_type(by_flat[name].tp)[0]) is tuple:
                value = tuple(value)
            values[name] = value
    values.update({k: v for k, v in overrides.items() if k in by_flat})
    return _build(cls, leaves, values, overrides)


def _build(cls: type[C], leaves: list[_Leaf], values: dict[str, Any], overrides: Mapping[str, Any]) -> C:
    """`cls` from flat values: a nested field is its default instance with the given fields replaced."""
    kwargs: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for leaf in leaves:
        if leaf.flat not in values:
            continue
        if leaf.group is None:
            kwargs[leaf.name] = values[leaf.flat]
        else:
            nested.setdefault(leaf.group, {})[leaf.name] = values[leaf.flat]
    try:
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in overrides:  # a whole nested config (or a plain field) given by the caller
                kwargs[f.name] = overrides[f.name]
            if f.name in nested:
                base = kwargs.get(f.name, _default_of(f))
                kwargs[f.name] = dataclasses.replace(base, **nested[f.name])
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from exc
