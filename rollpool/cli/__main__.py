"""``python -m rollpool.cli ARGS`` is ``rollpool ARGS`` (the chaos run and the soak bench start children this way)."""

from __future__ import annotations

import sys

from rollpool.cli import main

if __name__ == "__main__":
    sys.exit(main())
