"""Flags and error reporting shared by the monitoring subcommands (status, top, exporter)."""

from __future__ import annotations

import argparse
import sys

from rollpool.monitor.sink import REDIS_URL_ENV, add_redis_arguments, pool_from, redis_url_from

__all__ = ["add_reader_arguments", "reader_target"]


def add_reader_arguments(parser: argparse.ArgumentParser) -> None:
    add_redis_arguments(parser, pool=True)


def reader_target(args: argparse.Namespace) -> tuple[str, str] | None:
    """(url, pool), or None after telling the user that no URL was given."""
    url = redis_url_from(args)
    if not url:
        print(f"rollpool: no Redis URL: pass --redis-url or set {REDIS_URL_ENV}", file=sys.stderr)
        return None
    return url, pool_from(args)
