"""``python -m rollpool.chaos ARGS``: the rollpool CLI with the chaos fakes installed.

The chaos run starts its workers this way when a fault needs the fake engine
at the worker's edge (``--engine sim-chaos``, `rollpool.chaos.faulty_engine`):
poison versions and hung applies. Everything else is ``rollpool ARGS``.
"""

from __future__ import annotations

import sys

from rollpool.chaos.faulty_engine import install
from rollpool.cli import main

if __name__ == "__main__":
    install()
    sys.exit(main())
