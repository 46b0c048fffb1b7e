"""Episodes: multi-turn, tool-using rollouts recorded token in, token out (DESIGN.md "Episodes").

The worker runs an episode function for every sample of a group through an `EpisodeRunner`; the
function gets an `EpisodeContext` (token-level ``generate``/``append``, and an OpenAI-compatible
endpoint of its own) and returns the reward. See `runner` for the seam the worker calls and
``docs/episodes.md`` for users.

Modules: `recording` (pure: tokens, masks, versions, segments), `chat` (pure: chat rendering and
the token-in-token-out rule), `toolcalls` (parsers by name), `episode` (one episode and its
context), `server` (the aiohttp endpoint), `runner` (groups of episodes on one engine).
"""

from __future__ import annotations

from rollpool.workers.episodes.episode import (
    ContextLengthExceededError,
    EpisodeClosedError,
    EpisodeContext,
    EpisodeStats,
)
from rollpool.workers.episodes.recording import EpisodeRecording, Segment, segment_id
from rollpool.workers.episodes.runner import (
    DEFAULT_EPISODE,
    EpisodeConfig,
    EpisodeFn,
    EpisodeRunner,
    load_episode_function,
    load_episode_functions,
)
from rollpool.workers.episodes.toolcalls import (
    ToolCall,
    ToolCallParser,
    get_tool_call_parser,
    register_tool_call_parser,
)

__all__ = [
    "DEFAULT_EPISODE",
    "ContextLengthExceededError",
    "EpisodeClosedError",
    "EpisodeConfig",
    "EpisodeContext",
    "EpisodeFn",
    "EpisodeRecording",
    "EpisodeRunner",
    "EpisodeStats",
    "Segment",
    "ToolCall",
    "ToolCallParser",
    "get_tool_call_parser",
    "load_episode_function",
    "load_episode_functions",
    "register_tool_call_parser",
    "segment_id",
]
