"""An `openai.AsyncOpenAI` bound to one episode, all of a process's episodes over one HTTP client (``ctx.openai_client()``).

An agent written the usual way makes ``openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)`` per
episode. Each such client builds its own `httpx.AsyncClient`, and with it a TLS context (``ssl.create_default_context``
loads certifi's bundle: tens of milliseconds of CPU, though the endpoint is plain HTTP) and a connection pool of its
own, so every episode also opens a new connection. Measured on an H100 with 8 agent processes
(`bench/results/h100-episodes-ap8-profile/profile-agent.txt`): 60% of an agent process's samples were in
``create_default_context``.

`episode_client` gives the episode a client of its own (its own base URL and key, so its requests record into it)
over the one `httpx.AsyncClient` of the running event loop: one TLS context and one pool of kept-alive connections per
process. The SDK's behaviour is unchanged otherwise (retries, timeouts: the SDK's defaults, or `options`). Closing the
episode's client (``await client.close()``, ``async with client``, a library that closes what it is given) leaves the
shared HTTP client open: it belongs to the process and lives until whoever runs the episodes closes it
(`close_shared_http_client`: the `EpisodeRunner`'s close, an agent process's end).
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from typing import Any

__all__ = ["episode_client", "close_shared_http_client"]

_MAX_CONNECTIONS = 1000
"""The openai SDK's own default pool limit (``DEFAULT_CONNECTION_LIMITS``): a worker runs up to ``--max-episodes`` at once."""

_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()


@functools.cache
def _process_client_class() -> Any:
    import httpx

    class ProcessHttpClient(httpx.AsyncClient):
        """Shared by every episode of the loop: an episode's client closing it must not close it for the others."""

        async def aclose(self) -> None:
            return None

    return ProcessHttpClient


def _shared_http_client() -> Any:
    """The running event loop's one HTTP client (made on first use)."""
    import httpx

    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None:
        limits = httpx.Limits(max_connections=_MAX_CONNECTIONS, max_keepalive_connections=_MAX_CONNECTIONS)
        client = _CLIENTS[loop] = _process_client_class()(limits=limits, follow_redirects=True)
    return client


def episode_client(base_url: str, api_key: str, **options: Any) -> Any:
    """An ``openai.AsyncOpenAI`` for this episode's endpoint over the loop's shared HTTP client (see the module
    docstring); `options` go to ``AsyncOpenAI`` (``max_retries``, ``timeout``, ...), except ``http_client``.
    Call it from the episode's event loop (an ``async def`` episode function)."""
    import openai

    if "http_client" in options:
        raise TypeError("episode_client shares the process's HTTP client: pass no http_client (or make the client yourself)")
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=_shared_http_client(), **options)


async def close_shared_http_client() -> None:
    """Close the running loop's shared HTTP client, if one was made (its kept-alive connections with it); a later
    `episode_client` makes a new one."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        import httpx

        await httpx.AsyncClient.aclose(client)
