"""``python -m rollpool.weights`` is ``rollpool relay`` (one weight relay, with its monitoring flags)."""

from __future__ import annotations

import sys

from rollpool.cli import main

if __name__ == "__main__":
    sys.exit(main(["relay", *sys.argv[1:]]))
