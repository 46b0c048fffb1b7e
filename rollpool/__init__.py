"""rollpool: an asynchronous rollout worker pool for RL of language models.

Subpackages are the architecture (see docs/architecture.md): `protocol` (pure
messages, codec, staleness arithmetic and seams), `broker`, `weights`,
`workers`, `trainer_client`, `monitor`, and the applications `demo`, `launch`
and `chaos`. Importing `rollpool` imports nothing heavy.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
