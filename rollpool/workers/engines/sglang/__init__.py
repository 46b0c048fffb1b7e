"""The `sglang` engine: one module per process.

- `engine` (the worker side: `SGLangEngine`, ``ENGINE_FACTORY``), `http` (aiohttp client and
  server, the per-launch token), `tensors` (device copy and CUDA-IPC payloads; torch lazily),
  `wire` (request bodies and response parsing, pure);
- `server`: the child process (``python -m rollpool.workers.engines.sglang.server``), the only
  module of rollpool that imports sglang.

Names are loaded on first use, so the child does not import the worker side and vice versa.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SGLangEngine", "SGLangOptions", "ENGINE_FACTORY"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rollpool.workers.engines.sglang import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
