"""rollpool.workers: the rollout worker and its engines (imports `protocol` and `weights`).

``rollpool.workers.EpisodeContext`` is the public name an episode function is typed with; it is
resolved lazily, so importing this package does not import the episode endpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollpool.workers.episodes.episode import EpisodeContext

__all__ = ["EpisodeContext"]


def __getattr__(name: str) -> Any:
    if name == "EpisodeContext":
        from rollpool.workers.episodes.episode import EpisodeContext

        return EpisodeContext
    raise AttributeError(f"module 'rollpool.workers' has no attribute {name!r}")
