"""Engines by name: ``get_engine(name)(**options) -> Engine``.

Built-in engines are registered lazily by module path, so importing the
registry imports neither torch nor sglang; an engine's module is imported the
first time its name is asked for. A new engine plugs in either by a line in
`_BUILTIN` (``sglang`` -> ``rollpool.workers.engines.sglang.engine``, whose
module defines ``ENGINE_FACTORY``) or at run time with `register_engine`.

`check_engine_and_model` is the start-up check of a command line (``rollpool
worker``, ``rollpool launch local``): an unknown engine name, or a model
directory that does not exist for an engine that loads one, is a `ConfigError`
(one line, exit 2) before anything heavy is imported or started.
"""

from __future__ import annotations

import importlib
import pathlib
from collections.abc import Callable
from typing import Any

from rollpool.protocol.errors import ConfigError
from rollpool.workers.engines.base import Engine

__all__ = ["EngineFactory", "register_engine", "get_engine", "engine_names", "check_engine_and_model"]

EngineFactory = Callable[..., Engine]

_BUILTIN: dict[str, str] = {
    "sim": "rollpool.workers.engines.sim",
    "hf": "rollpool.workers.engines.hf",
    "sglang": "rollpool.workers.engines.sglang.engine",
}
_FACTORIES: dict[str, EngineFactory] = {}

_EXTRAS = {"hf": "rollpool[hf]", "sglang": "rollpool[sglang]"}
_LOADS_MODEL_DIR = ("hf", "sglang")  # built-in engines whose --model is a local directory


def register_engine(name: str, factory: EngineFactory) -> None:
    """Make `factory(**options)` available as ``--engine name`` (replaces an earlier one)."""
    _FACTORIES[name] = factory


def engine_names() -> tuple[str, ...]:
    return tuple(sorted(set(_BUILTIN) | set(_FACTORIES)))


def get_engine(name: str) -> EngineFactory:
    """The factory for engine `name`; `KeyError` names the known engines, `ImportError` the extra to install."""
    factory = _FACTORIES.get(name)
    if factory is not None:
        return factory
    module_name = _BUILTIN.get(name)
    if module_name is None:
        raise KeyError(f"unknown engine {name!r}; known: {', '.join(engine_names())}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = _EXTRAS.get(name)
        hint = f" (install {extra})" if extra else ""
        raise ImportError(f"engine {name!r} is not available{hint}: {exc}") from exc
    found: Any = getattr(module, "ENGINE_FACTORY", None)
    if found is None:
        raise ImportError(f"{module_name} defines no ENGINE_FACTORY")
    _FACTORIES[name] = found
    return found  # type: ignore[no-any-return]


def check_engine_and_model(engine: str, model: str | None) -> None:
    """Refuse an unknown engine, and a missing model directory for an engine that loads one (`ConfigError`)."""
    if engine not in _BUILTIN and engine not in _FACTORIES:
        raise ConfigError(f"unknown engine {engine!r}; known: {', '.join(engine_names())} "
                          "(another one plugs in with register_engine: docs/development.md)")
    if engine in _LOADS_MODEL_DIR and engine not in _FACTORIES:
        if not model:
            raise ConfigError(f"engine {engine!r} needs --model, a local model directory")
        path = pathlib.Path(model).expanduser()
        if not path.is_dir():
            what = "is not a directory" if path.exists() else "does not exist"
            raise ConfigError(f"model directory {model!r} {what} (engine {engine!r} loads a local model directory; "
                              f"`rollpool make-tiny-model DIR` writes a tiny one)")
