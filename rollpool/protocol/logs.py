"""Logging conventions: structured records, one setup for every process.

Every line that concerns a pool, worker, prompt or trajectory carries those ids
as fields (``extra={"prompt_id": ...}``, or a `log_fields` context for all the
lines of a process or task). Text lines append them as ``key=value``; with
``--log-json`` every line is one JSON object. The level comes from
``--log-level`` or ``ROLLPOOL_LOG_LEVEL`` (default INFO).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "STRUCTURED_FIELDS",
    "configure_logging",
    "add_logging_arguments",
    "configure_logging_from_args",
    "log_fields",
    "set_log_fields",
    "RateLimitedLog",
]

STRUCTURED_FIELDS = ("pool", "worker_id", "client_id", "prompt_id", "task_id", "trajectory_id", "version", "peer")

_NO_FIELDS: dict[str, Any] = {}
_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("rollpool_log_fields", default=_NO_FIELDS)


def set_log_fields(**fields: Any) -> None:
    """Set fields on every later record of this context (e.g. pool, worker_id)."""
    _context.set({**_context.get(), **fields})


@contextlib.contextmanager
def log_fields(**fields: Any) -> Iterator[None]:
    token = _context.set({**_context.get(), **fields})
    try:
        yield
    finally:
        _context.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def _fields_of(record: logging.LogRecord) -> dict[str, Any]:
    return {k: getattr(record, k) for k in STRUCTURED_FIELDS if getattr(record, k, None) is not None}


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields_of(record)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **_fields_of(record),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


PER_REQUEST_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2")
"""Libraries that log each HTTP request at INFO: kept at WARNING unless the level is DEBUG."""


def configure_logging(level: str | None = None, json_lines: bool = False, stream: Any = None) -> None:
    """Install one handler on the root logger (idempotent)."""
    level_name = (level or os.environ.get("ROLLPOOL_LOG_LEVEL") or "INFO").upper()
    if level_name not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown log level {level_name!r}; use DEBUG, INFO, WARNING or ERROR")
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_rollpool", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._rollpool = True  # type: ignore[attr-defined]
    handler.addFilter(_ContextFilter())
    if json_lines or os.environ.get("ROLLPOOL_LOG_JSON") == "1":
        handler.setFormatter(_JsonFormatter())
    else:
        fmt = _TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root.addHandler(handler)
    root.setLevel(level_name)
    # an HTTP client logs every request at INFO (httpx: one line per chat turn of every episode's SDK agent)
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if level_name == "DEBUG" else logging.WARNING)


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING, ERROR (env ROLLPOOL_LOG_LEVEL)")
    parser.add_argument("--log-json", action="store_true", default=False, help="one JSON object per log line")


def configure_logging_from_args(args: argparse.Namespace) -> None:
    configure_logging(getattr(args, "log_level", None), getattr(args, "log_json", False))


class RateLimitedLog:
    """Logs a message at most once per `period_s` per key (e.g. per peer per minute)."""

    def __init__(self, logger: logging.Logger, period_s: float = 60.0, max_keys: int = 10_000) -> None:
        self.logger = logger
        self.period_s = period_s
        self.max_keys = max_keys
        self._last: dict[str, float] = {}

    def warning(self, key: str, msg: str, *args: Any, now: float | None = None, **kwargs: Any) -> bool:
        t = time.monotonic() if now is None else now
        last = self._last.get(key)
        if last is not None and t - last < self.period_s:
            return False
        if len(self._last) >= self.max_keys:
            self._last.clear()
        self._last[key] = t
        self.logger.warning(msg, *args, **kwargs)
        return True
