"""``python -m rollpool.workers``: the same as ``rollpool worker``."""

from __future__ import annotations

import argparse
import sys

from rollpool.protocol.logs import add_logging_arguments, configure_logging_from_args
from rollpool.workers import cli


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m rollpool.workers", description=cli.HELP)
    add_logging_arguments(parser)
    cli.add_arguments(parser)
    args = parser.parse_args()
    configure_logging_from_args(args)
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
