"""Code run by Triton's interpreter on the CPU: a child process with ``TRITON_INTERPRET=1`` (Triton reads it when a
kernel is made, so it must be set before the kernel module builds), from the checkout's root."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def interpreted(code: str, **env: str) -> str:
    """`code` (dedented) run so, with `env` added to the environment; its stdout (the child must exit 0)."""
    full = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), **env}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                         timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
