"""HTTP on loopback between the worker's `SGLangEngine` and its child, on aiohttp (client and server).

aiohttp (a C-accelerated HTTP/1.1 parser, keep-alive pooling, asyncio native;
SGLang itself depends on it) replaces the two hand-written HTTP/1.1 stacks.

Guarantees:

- Every request carries ``Authorization: Bearer <token>``; the child's front
  (`serve_routes`) answers 401 to any request without the per-launch token,
  compared in constant time. The same header is what SGLang's own server
  checks for ``--api-key``, so the client also speaks to a server started
  elsewhere with an API key.
- `HttpClient.request` returns the decoded JSON (or text, or None for an empty
  body); a status >= 300 raises `HttpError` (an `EngineError`, with the status
  and body); a broken connection raises `ConnectionError`; the timeout is
  `TimeoutError`. Callers never see aiohttp's own exception types.
- The front answers 400 only when a route raises `BadRequest` (an explicit
  check of the request body); any other exception is the server's own fault:
  500, logged with its traceback. A 400 therefore never hides a bug.
- JSON is encoded with orjson where it is installed (SGLang depends on it):
  aborting a full batch sends every partial output back at once, and the
  stdlib encoder made that a visible part of the pause.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from rollpool.protocol.errors import EngineError

__all__ = ["BadRequest", "HttpClient", "HttpError", "Route", "TOKEN_ENV", "answer_route", "dumps", "loads", "serve_routes"]

log = logging.getLogger(__name__)

TOKEN_ENV = "ROLLPOOL_SGLANG_TOKEN"
"""The child reads its per-launch token from this environment variable (never from argv, which other users can read)."""

Route = Callable[[dict[str, Any]], Awaitable[tuple[int, Any]]]
"""``route(json_body) -> (status, json_answer)``."""


class HttpError(EngineError):
    """The server answered with a status >= 300."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status
        self.body = body


class BadRequest(Exception):
    """Raised by a route for a request body that fails an explicit check: the front answers 400."""


def dumps(payload: Any) -> bytes:
    try:
        import orjson
    except ImportError:
        return json.dumps(payload, default=_json_default).encode()
    return bytes(orjson.dumps(payload, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY))


def loads(data: bytes) -> Any:
    try:
        import orjson
    except ImportError:
        return json.loads(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)  # NaN / Infinity, which only the stdlib encoder writes


def _json_default(o: Any) -> Any:
    if isinstance(o, tuple | set):
        return list(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


class HttpClient:
    """A keep-alive JSON client for one server (`aiohttp.ClientSession`; create and close it inside a running loop)."""

    def __init__(self, host: str, port: int, *, token: str = "", keepalive_s: float = 4.0) -> None:
        self.host, self.port = host, port
        self._base = f"http://{host}:{port}"
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # no connection limit (every running sample holds one); idle connections are closed after keepalive_s,
        # shorter than uvicorn's 5 s, so a server started elsewhere never closes one under a request
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent",),
        )

    async def request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else dumps(body)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._session.request(method, self._base + path, data=data, timeout=timeout) as resp:
                payload = await resp.read()
                status = resp.status
        except aiohttp.ClientConnectionError as exc:
            raise ConnectionError(f"{method} {path}: {exc!r}") from exc
        except aiohttp.ClientError as exc:  # a malformed answer: the server is not what we think it is
            raise ConnectionError(f"{method} {path}: {exc!r}") from exc
        except TimeoutError as exc:
            raise TimeoutError(f"{method} {path}: no answer within {timeout_s} s") from exc
        if status >= 300:
            raise HttpError(status, payload)
        if not payload:
            return None
        try:
            return loads(payload)
        except ValueError:
            return payload.decode(errors="replace")

    async def close(self) -> None:
        await self._session.close()


async def answer_route(routes: Mapping[str, Route], path: str, body: Any) -> tuple[int, Any]:
    """``(status, answer)`` of the route at `path` for `body` (a decoded JSON body, or the `ValueError` that decoding
    raised): 404 for no such route, 400 for a body that is not an object or that the route refuses with `BadRequest`,
    500 (logged with its traceback) for anything else the route raises. The HTTP front and the hop (`hop`) both answer
    through it."""
    route = routes.get(path)
    if route is None:
        return 404, {"error": {"message": f"no route {path}"}}
    try:
        if not isinstance(body, dict):
            raise BadRequest(f"the body must be a JSON object: {body}")
        return await route(body)
    except BadRequest as exc:
        return 400, {"error": {"message": str(exc)}}
    except Exception as exc:  # the server's own fault: 500, logged, and the server keeps serving
        log.exception("route %s failed", path)
        return 500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}


def _app(routes: Mapping[str, Route], token: str) -> web.Application:
    expected = f"Bearer {token}".encode()

    async def handle(request: web.Request) -> web.StreamResponse:
        got = request.headers.get("Authorization", "").encode()
        if token and not hmac.compare_digest(got, expected):
            return web.Response(status=401, body=dumps({"error": {"message": "missing or wrong token"}}), content_type="application/json")
        if request.path not in routes:
            return web.Response(status=404, body=dumps({"error": {"message": f"no route {request.path}"}}), content_type="application/json")
        raw = await request.read()
        body: Any
        try:
            body = loads(raw) if raw else {}
        except ValueError as exc:
            body = exc
        status, answer = await answer_route(routes, request.path, body)
        return web.Response(status=status, body=dumps(answer), content_type="application/json")

    app = web.Application(client_max_size=1 << 31)  # weight payloads pickled by value (CPU) can be large
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def serve_routes(routes: Mapping[str, Route], host: str, port: int, token: str) -> web.AppRunner:
    """Serve `routes` on ``host:port`` (token required when non-empty); returns the runner (``await runner.cleanup()``)."""
    runner = web.AppRunner(_app(routes, token), access_log=None, keepalive_timeout=3600.0, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    return runner
