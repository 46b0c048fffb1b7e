"""``python -m rollpool.broker`` is ``rollpool broker`` (with its monitoring flags)."""

from __future__ import annotations

import sys

from rollpool.cli import main

if __name__ == "__main__":
    sys.exit(main(["broker", *sys.argv[1:]]))
