"""``python -m rollpool`` is the `rollpool` console script."""

from __future__ import annotations

import sys

from rollpool.cli import main

sys.exit(main())
