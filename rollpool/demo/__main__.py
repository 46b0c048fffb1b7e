"""``python -m rollpool.demo`` is ``rollpool demo``."""

from __future__ import annotations

import sys

from rollpool.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
