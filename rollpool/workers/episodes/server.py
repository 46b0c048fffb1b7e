"""The OpenAI-compatible HTTP endpoint: one aiohttp server per worker, a path and a key per episode.

Routes, under ``/episodes/{token}/v1`` (``token`` names one running episode):

- ``POST /chat/completions`` and ``POST /completions``, streamed (server-sent events, as the
  OpenAI API sends them) or not; the engine returns a turn whole, so a stream carries it in one
  content chunk, then the finish chunk, the usage chunk when ``stream_options.include_usage`` is
  set, and ``[DONE]``;
- ``POST /responses``: the OpenAI Responses API, translated onto chat completions by `responses`
  (same recording, same segment rule); streamed as the Responses events (``event:`` lines, no
  ``[DONE]``);
- ``GET /models`` and ``GET /models/{id}``: the one model;
- prime-rl's token-in-token-out routes (vLLM's shapes): ``POST /chat/completions/tokens`` (a chat
  request whose ``tokens`` are the prompt's ids), ``POST /tokenize`` (also at ``/episodes/{token}/tokenize``,
  where its client calls it), and ``return_token_ids`` on chat completions.

Any other path or method gets a 404 / 405 in the OpenAI error shape that lists these routes, so a
client library reports the route, not a missing model.

Every request needs ``Authorization: Bearer <the episode's key>``: a wrong or missing key gets 401
and records nothing; an unknown or finished episode gets 404 / 410. A malformed request gets an
OpenAI-style error body (``{"error": {"message", "type", "param", "code"}}``) with a 4xx status, and
the episode goes on. That holds for what fails before a handler too: a body over the limit gets 413
(``request_too_large``; the key is checked before the body is read), JSON that is not JSON or is
nested too deeply 400, an unknown path 404, a wrong method 405. Client errors log no traceback; a
500 (``server_error``) means the endpoint itself failed. The server binds loopback only.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from rollpool.protocol.errors import ConfigError, RequestRefusedError
from rollpool.workers.episodes import responses
from rollpool.workers.episodes.chat import EndpointError
from rollpool.workers.episodes.episode import ContextLengthExceededError, Episode, EpisodeClosedError

__all__ = ["EpisodeServer"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 32 * 1024 * 1024
ROUTES = ("POST /v1/chat/completions", "POST /v1/chat/completions/tokens", "POST /v1/completions", "POST /v1/responses",
          "POST /tokenize", "GET /v1/models", "GET /v1/models/{model}")
"""What the endpoint serves, under ``/episodes/{token}`` (named in the error for any other route)."""


def _web() -> Any:
    try:
        from aiohttp import web
    except ImportError as exc:
        raise ImportError("the episode endpoint needs aiohttp: pip install 'rollpool[episodes]'") from exc
    return web


def _dumps(body: Any) -> bytes:
    try:
        import orjson
    except ImportError:
        return json.dumps(body).encode()
    return bytes(orjson.dumps(body))


def _loads(raw: bytes) -> Any:
    """The request's JSON: orjson where it is installed (a turn's whole history, every turn: the stdlib decoder was a
    visible part of the endpoint's cost), the stdlib's for what orjson refuses and it takes (NaN, big integers, lone
    surrogates), so what is accepted and its error messages stay the stdlib's."""
    try:
        import orjson
    except ImportError:
        return json.loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


_JSON_HEADERS: Any = None
"""``Content-Type: application/json`` as a header map, made once (aiohttp copies it into each response; its
``content_type`` argument parses the type and builds the header each time)."""


def _json(body: Any, status: int = 200) -> Any:
    global _JSON_HEADERS
    if _JSON_HEADERS is None:
        from multidict import CIMultiDict

        _JSON_HEADERS = CIMultiDict({"Content-Type": "application/json"})
    return _web().Response(body=_dumps(body), status=status, headers=_JSON_HEADERS)


def _error(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> Any:
    return _json({"error": {"message": message, "type": type, "param": param, "code": code}}, status=status)


def _openai_errors() -> Any:
    """Middleware: aiohttp's own HTTP errors (no such route, wrong method, body over the limit) in the OpenAI error shape."""
    web = _web()

    @web.middleware  # type: ignore[untyped-decorator]
    async def middleware(request: Any, handler: Any) -> Any:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if exc.status in (404, 405):
                what = "is not served" if exc.status == 404 else "is not allowed"
                message = (f"{request.method} {request.path} {what}: the episode endpoint serves "
                           f"{', '.join(ROUTES)} under /episodes/<token> (ctx.openai_base_url ends in /v1)")
                return _error(exc.status, message, code="not_found" if exc.status == 404 else "method_not_allowed")
            code = "request_too_large" if exc.status == 413 else None
            return _error(exc.status, exc.text or exc.reason, code=code)

    return middleware


class EpisodeServer:
    """Serves every running episode of one worker (see the module docstring)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(f"the episode endpoint binds loopback only, got host {host!r}")
        if max_request_bytes < 1:
            raise ConfigError(f"the episode endpoint's max_request_bytes must be >= 1, got {max_request_bytes}")
        self.host = host
        self.port = port
        self.max_request_bytes = max_request_bytes
        self._episodes: dict[str, tuple[Episode, str]] = {}
        self._finished: set[str] = set()
        self._runner: Any = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        web = _web()
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[_openai_errors()])
        app.router.add_post("/episodes/{token}/v1/chat/completions", self._chat)
        app.router.add_post("/episodes/{token}/v1/chat/completions/tokens", self._chat_tokens)
        app.router.add_post("/episodes/{token}/tokenize", self._tokenize)
        app.router.add_post("/episodes/{token}/v1/tokenize", self._tokenize)
        app.router.add_post("/episodes/{token}/v1/completions", self._completions)
        app.router.add_post("/episodes/{token}/v1/responses", self._responses)
        app.router.add_get("/episodes/{token}/v1/models", self._models)
        app.router.add_get("/episodes/{token}/v1/models/{model:.+}", self._model)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []  # the bound port when port=0
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("episode endpoint on %s", self.base_url)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def register(self, episode: Episode) -> tuple[str, str]:
        """Serve `episode`: returns (its base url, its api key)."""
        token = secrets.token_urlsafe(12)
        key = f"rp-{secrets.token_urlsafe(24)}"
        self._episodes[token] = (episode, key)
        return f"{self.base_url}/episodes/{token}/v1", key

    def unregister(self, base_url: str) -> None:
        token = base_url.rstrip("/").split("/")[-2]
        if self._episodes.pop(token, None) is not None:
            self._finished.add(token)
            if len(self._finished) > 100_000:
                self._finished.clear()

    # -- handlers

    def _episode(self, request: Any) -> Episode | Any:
        token = request.match_info["token"]
        entry = self._episodes.get(token)
        if entry is None:
            if token in self._finished:
                return _error(410, "this episode is over", code="episode_over")
            return _error(404, "no such episode", code="not_found")
        episode, key = entry
        auth = request.headers.get("Authorization", "")
        given = auth[7:] if auth.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            return _error(401, "invalid api key for this episode", type="authentication_error", code="invalid_api_key")
        return episode

    async def _body(self, request: Any) -> dict[str, Any]:
        try:
            body = _loads(await request.read())
        except _web().HTTPRequestEntityTooLarge as exc:
            raise EndpointError(413, f"the request body is over this endpoint's limit of {self.max_request_bytes} bytes",
                                code="request_too_large") from exc
        except RecursionError as exc:
            raise EndpointError(400, "the request body's JSON is nested too deeply") from exc
        except ValueError as exc:
            raise EndpointError(400, f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise EndpointError(400, "the request body must be a JSON object")
        return body

    async def _serve(self, request: Any, call: Callable[[Episode, dict[str, Any]], Awaitable[dict[str, Any]]],
                     stream_chunks: Callable[[dict[str, Any], bool], list[dict[str, Any]]], *, events: bool = False) -> Any:
        """One request: `call` answers it whole; a stream sends `stream_chunks` of that answer (`events`: each
        chunk as a named server-sent event, the Responses way, with no ``[DONE]``)."""
        found = self._episode(request)
        if not isinstance(found, Episode):
            return found
        episode = found
        try:
            body = await self._body(request)
            stream = bool(body.get("stream"))
            opts = body.get("stream_options") or {}
            include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
            result = await call(episode, body)
        except EndpointError as exc:
            return _json(exc.body(), status=exc.status)
        except ContextLengthExceededError as exc:
            return _error(400, str(exc), param="messages", code="context_length_exceeded")
        except EpisodeClosedError as exc:
            return _error(410, str(exc), code="episode_over")
        except (ValueError, RequestRefusedError) as exc:  # the engine refused the request (its own checks)
            return _error(400, f"the engine refused the request: {exc}")
        except Exception as exc:
            log.exception("episode endpoint failed on %s", request.path)
            return _error(500, f"{type(exc).__name__}: {exc}", type="server_error")
        if not stream:
            return _json(result)
        response = _web().StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in stream_chunks(result, include_usage):
            name = f"event: {chunk['type']}\n" if events else ""
            await response.write(f"{name}data: {json.dumps(chunk)}\n\n".encode())
        if not events:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _chat(self, request: Any) -> Any:
        return await self._serve(request, lambda e, b: e.chat(b), _chat_chunks)

    async def _completions(self, request: Any) -> Any:
        return await self._serve(request, lambda e, b: e.completion(b), _completion_chunks)

    async def _chat_tokens(self, request: Any) -> Any:
        return await self._serve(request, lambda e, b: e.chat(b, token_prompt=True), _chat_chunks)

    async def _tokenize(self, request: Any) -> Any:
        return await self._serve(request, lambda e, b: e.tokenize(b), lambda r, _usage: [r])

    async def _responses(self, request: Any) -> Any:
        async def call(episode: Episode, body: dict[str, Any]) -> dict[str, Any]:
            chat_body, conversation = responses.to_chat_body(body, episode.responses)
            return responses.from_chat(await episode.chat(chat_body), body, episode.responses, conversation)

        return await self._serve(request, call, lambda r, _usage: list(responses.stream_events(r)), events=True)

    async def _models(self, request: Any) -> Any:
        found = self._episode(request)
        if not isinstance(found, Episode):
            return found
        return _json({"object": "list", "data": [_model_card(found.model_name)]})

    async def _model(self, request: Any) -> Any:
        found = self._episode(request)
        if not isinstance(found, Episode):
            return found
        name = request.match_info["model"]
        if name != found.model_name:
            return _error(404, f"the model {name!r} is not served here; this episode serves {found.model_name!r}",
                          param="model", code="model_not_found")
        return _json(_model_card(found.model_name))


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "rollpool"}


def _chat_chunks(result: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    head = {k: result[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    choice = result["choices"][0]
    msg = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
    if msg.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(msg["tool_calls"])]
    chunks = [
        {**head, "choices": [{"index": 0, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]},
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": result["usage"]})
    return chunks


def _completion_chunks(result: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    head = {k: result[k] for k in ("id", "created", "model")}
    head["object"] = "text_completion"
    choice = result["choices"][0]
    chunks = [
        {**head, "choices": [{"index": 0, "text": choice["text"], "logprobs": choice.get("logprobs"), "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}]},
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": result["usage"]})
    return chunks
