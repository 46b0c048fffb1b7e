"""``python -m rollpool.workers.episodes``: one agent process of a worker (``--agent-processes``; the worker starts it)."""

from __future__ import annotations

import sys

from rollpool.workers.episodes.processes import main

if __name__ == "__main__":
    sys.exit(main())
