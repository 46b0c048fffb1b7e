"""``python -m rollpool.broker``: the same as ``rollpool broker``."""

from __future__ import annotations

import argparse
import sys

from rollpool.broker import cli
from rollpool.protocol.logs import add_logging_arguments, configure_logging_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollpool.broker", description=cli.HELP)
    add_logging_arguments(parser)
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
