"""``python -m rollpool.demo`` is ``rollpool demo``."""

from __future__ import annotations

import sys

from rollpool.cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
