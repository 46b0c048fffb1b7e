"""``python -m rollpool.workers`` is ``rollpool worker`` (with its monitoring flags)."""

from __future__ import annotations

import sys

from rollpool.cli import main

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
