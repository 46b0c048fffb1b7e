"""``python -m rollpool.demo`` is ``rollpool demo``."""

from __future__ import annotations

import argparse
import sys

from rollpool.demo import cli
from rollpool.protocol.logs import add_logging_arguments, configure_logging_from_args

parser = argparse.ArgumentParser(prog="python -m rollpool.demo", description=cli.HELP)
add_logging_arguments(parser)
cli.add_arguments(parser)
args = parser.parse_args()
configure_logging_from_args(args)
try:
    sys.exit(cli.run(args))
except KeyboardInterrupt:  # Ctrl-C or SIGTERM: children are already stopped by the runner
    sys.exit(130)
