"""Engines by name: ``get_engine(name)(**options) -> Engine``.

Built-in engines are registered lazily by module path, so importing the
registry imports neither torch nor sglang; an engine's module is imported the
first time its name is asked for. A new engine plugs in either by a line in
`_BUILTIN` (``sglang`` -> ``rollpool.workers.engines.sglang.engine``, whose
module defines ``ENGINE_FACTORY``) or at run time with `register_engine`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rollpool.workers.engines.base import Engine

__all__ = ["EngineFactory", "register_engine", "get_engine", "engine_names"]

EngineFactory = Callable[..., Engine]

_BUILTIN: dict[str, str] = {
    "sim": "rollpool.workers.engines.sim",
    "hf": "rollpool.workers.engines.hf",
    "sglang": "rollpool.workers.engines.sglang.engine",
}
_FACTORIES: dict[str, EngineFactory] = {}

_EXTRAS = {"hf": "rollpool[hf]", "sglang": "rollpool[sglang]"}


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
