"""The `rollpool` console script: one subcommand per service or application.

Each subcommand ``X`` lives in its own module, ``rollpool/cli/X.py`` (``make-tiny-model``:
``make_tiny_model.py``), which defines ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``; this module only wires them
together with the shared logging flags, and maps a `ConfigError` (a bad flag,
environment variable or TOML value, whenever it is found) to exit status 2 with
one line on stderr, for every subcommand alike. Modules are imported without
their heavy dependencies (torch, sglang, ray load when a command runs).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from rollpool import __version__
from rollpool.protocol.errors import ConfigError
from rollpool.protocol.logs import add_logging_arguments, configure_logging_from_args

__all__ = ["main", "SUBCOMMANDS", "build_parser"]

# services that report to Redis: the CLI adds --redis-url and hands them a MetricsSink
_MONITORED = ("broker", "worker", "relay")

SUBCOMMANDS: tuple[tuple[str, str], ...] = tuple(
    (name, f"rollpool.cli.{name.replace('-', '_')}")
    for name in ("demo", "broker", "worker", "relay", "status", "top", "exporter", "launch", "chaos", "keys", "make-tiny-model")
)


def _add_subcommand_logging(parser: argparse.ArgumentParser) -> None:
    """The logging flags again after a subcommand; SUPPRESS keeps a value given before it (``rollpool --log-level
    DEBUG broker``), which a subparser's ordinary default would overwrite."""
    parser.add_argument("--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING, ERROR (env ROLLPOOL_LOG_LEVEL)")
    parser.add_argument("--log-json", action="store_true", default=argparse.SUPPRESS, help="one JSON object per log line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollpool",
        description="Asynchronous rollout worker pool for RL of language models.",
    )
    parser.add_argument("--version", action="version", version=f"rollpool {__version__}")
    add_logging_arguments(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        _add_subcommand_logging(p)
        module.add_arguments(p)
        if name in _MONITORED:
            from rollpool.monitor.sink import add_redis_arguments

            add_redis_arguments(p, pool=False)
        p.set_defaults(_run=module.run, _monitored=name in _MONITORED)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    configure_logging_from_args(args)
    try:
        if args._monitored:
            from rollpool.monitor.sink import sink_from_args

            return int(args._run(args, metrics=sink_from_args(args)) or 0)
        return int(args._run(args) or 0)
    except ConfigError as exc:
        print(f"rollpool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

