"""The per-sample hop between the worker's `SGLangEngine` and its child, on one ZeroMQ socket pair (both ends).

Every turn of every sample is a ``/generate`` call, and over HTTP each one paid for a request's
setup on both sides (aiohttp's client and server: headers, a connection from the pool, a task, a
parser) and for its prompt as JSON text (the whole sequence, thousands of ids, every turn). Here the
worker holds one DEALER connected to the child's ROUTER for the engine's life, and a call is one
multipart message each way: the prompt's ids travel as one int32 frame, the rest as JSON.

Guarantees:

- The same routes answer as over HTTP (`serve_hop` takes the child's route table; the same body
  reaches the same function, the ids as a list of ints), with the same statuses: a status >= 300
  raises `HttpError` at the caller, a route's `BadRequest` is a 400, anything else it raises a 500
  (logged with its traceback). The sglang engine sends only ``/generate`` and ``/abort_request``
  this way; the weight routes and the rest stay on HTTP.
- Every request carries the per-launch token (`http.TOKEN_ENV`), compared in constant time; a
  request without it is answered 401 and never reaches a route. The socket is ``ipc://`` in a
  directory only the worker's user can enter (loopback, like the HTTP port).
- A call waits at most its timeout (`TimeoutError`); a socket closed under a call fails it with
  `ConnectionError`. The engine watches the child's process as it does for HTTP, so a dead child
  fails every pending call at once (`SGLangEngine._post`).
- Frames: request ``[token, request id (8 bytes, then one options byte), path, JSON body without input_ids, input_ids as
  little-endian int32 (empty when the body has none), then one frame per image]``; answer
  ``[request id, status (ASCII), JSON answer]`` (the ROUTER's identity frame in front on the
  child's side). A body's ``image_data`` given as bytes (the encoded image files) travels as those
  image frames, not in the JSON, and reaches the route as a list of bytes (SGLang's ``image_data``
  takes bytes as it takes data URIs: ``sglang.srt.utils.load_image``); given as strings it stays in
  the JSON. An answer whose ``meta_info.output_token_logprobs`` is exactly two columns (every entry
  ``[finite float, int32 id, None]``: what SGLang answers a ``/generate`` with ``return_logprob``) carries
  them as two more frames, the logprobs as little-endian float64 and the ids as int32, with ``null`` in
  the JSON at their place; the caller gets them back as a `wire.LogprobTriples` (a sequence of the same
  ``[logprob, id, None]`` entries), the same values as the JSON would give (JSON writes a non-finite
  logprob as ``null``, so those answers stay JSON). The child does so only for a request whose options
  byte has `COLUMNS` set. Worker and child are one checkout (the worker launches the child), but the
  options byte keeps a worker and a child of different checkouts talking (``bench/episodes.py --sim-tree``
  runs older trees' workers against one child): a request id of 8 bytes asks nothing, and a child that
  knows no options echoes the 9 bytes and answers JSON alone, which the client takes too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import math
import struct
from collections.abc import Mapping
from typing import Any

from rollpool.workers.engines.sglang.http import HttpError, Route, answer_route, dumps, loads
from rollpool.workers.engines.sglang.wire import LogprobTriples

__all__ = ["HOP_PATHS", "HopClient", "serve_hop"]

log = logging.getLogger(__name__)

HOP_PATHS = frozenset({"/generate", "/abort_request"})
"""The routes the sglang engine sends over the hop (every other one goes over HTTP)."""

COLUMNS = 1
"""A request's options bit: its answer may carry the logprob columns as frames (module docstring)."""

_MAX_MSG_BYTES = 1 << 30  # a prompt of a very long context, with room to spare: the hop carries no weights


def _pack_ids(ids: Any) -> bytes:
    import numpy as np

    arr = np.asarray(ids)
    if arr.dtype == np.dtype("<i4") and arr.ndim == 1:  # int32 already (the engine's, checked against the vocabulary)
        return arr.tobytes()
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError("input_ids must be a flat list of token ids")
    if arr.size and (int(arr.min()) < -(1 << 31) or int(arr.max()) >= 1 << 31):
        raise ValueError("input_ids must fit int32")
    return arr.astype("<i4", copy=False).tobytes()


def _unpack_ids(frame: bytes) -> list[int]:
    import numpy as np

    if len(frame) % 4:
        raise ValueError("the input_ids frame is not whole int32 values")
    return list(np.frombuffer(frame, dtype="<i4").tolist())


def _answer_frames(answer: Any) -> list[Any]:
    """An answer's frames after its status: its JSON, then its logprob columns where they travel as frames (module
    docstring); a body of any other shape is its JSON alone."""
    if answer is None:
        return [b""]
    meta: Any = answer.get("meta_info") if type(answer) is dict else None
    entries = meta.get("output_token_logprobs") if type(meta) is dict else None
    if type(entries) is not list or not entries:
        return [dumps(answer)]
    try:
        values, ids, nones = zip(*entries, strict=True)
    except (TypeError, ValueError):  # an entry that is not a triple
        return [dumps(answer)]
    # each check a loop in C (the child builds these for every turn of every sample): the entries lists or tuples,
    # the logprobs floats and finite (their sum is not finite when one is not; a sum past the float range only sends
    # JSON), the ids ints (of int32: struct refuses any other), the thirds None
    if (set(map(type, values)) != {float} or set(map(type, ids)) != {int} or nones.count(None) != len(nones)
            or not set(map(type, entries)) <= {list, tuple} or not math.isfinite(sum(values))):
        return [dumps(answer)]
    n = len(values)
    try:
        columns = [struct.pack(f"<{n}d", *values), struct.pack(f"<{n}i", *ids)]
    except struct.error:  # an id past int32
        return [dumps(answer)]
    return [dumps({**answer, "meta_info": {**meta, "output_token_logprobs": None}}), *columns]


def _with_logprobs(answer: Any, values: bytes, ids: bytes) -> Any:
    """The answer of `_answer_frames`'s three frames, its logprob columns back in place."""
    import numpy as np

    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if (not isinstance(meta, dict) or meta.get("output_token_logprobs", 0) is not None or len(values) % 8 or len(ids) % 4
            or len(values) // 8 != len(ids) // 4):
        raise ConnectionError("sglang hop: a malformed answer (its logprob frames do not match its JSON)")
    meta["output_token_logprobs"] = LogprobTriples(np.frombuffer(values, dtype="<f8").tolist(),
                                                   np.frombuffer(ids, dtype="<i4").tolist())
    return answer


class HopClient:
    """The worker's end: one DEALER, calls matched to answers by request id (create and close it in a running loop).

    The DEALER is a plain (blocking-API) ZeroMQ socket driven from the event loop: a call is one non-blocking send,
    and answers are drained by a reader on the socket's file descriptor, without a future per send and per receive
    (what ``zmq.asyncio`` makes: about a tenth of the worker's CPU per episode turn went to it). ZeroMQ's descriptor
    signals edges, so the socket's events are read again once after the sends of each pass of the loop (an answer that
    arrived meanwhile would otherwise wait for the next edge). A send that ZeroMQ cannot queue now (its high-water mark)
    waits for the socket to become writable, within the call's timeout.

    The socket is driven through pyzmq's compiled socket methods with plain integer flags and options: its Python
    layer (``send_multipart``, ``recv_multipart``) checks every frame and combines its flag enums in Python, which cost
    about three times the sends themselves (5.5 against 1.6 us for a request's five frames, measured alone).

    Timeouts: one timer for the whole client, at the soonest deadline of the calls pending (those past it fail with
    `TimeoutError`; it is then set again for the next), instead of ``asyncio.timeout`` around each call (an object, a
    timer handle in the loop's heap, its cancel and the heap's clean-up, each call).
    """

    def __init__(self, endpoint: str, *, token: str) -> None:
        import zmq

        from rollpool.protocol.sockets import SocketFactory

        self.endpoint = endpoint
        self._token = token.encode()
        self._zmq = zmq
        self._context = zmq.Context()
        self._sock = SocketFactory(self._context).dealer(endpoint, max_msg_bytes=_MAX_MSG_BYTES)
        self._ids = itertools.count(1)
        self._pending: dict[bytes, asyncio.Future[tuple[int, list[bytes]]]] = {}
        self._deadlines: dict[bytes, float] = {}
        """Loop time past which each pending call with a timeout fails (`_expire`)."""
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._writable: list[asyncio.Future[None]] = []
        self._drain_soon = False
        """`_drain_after_sends` is scheduled (once a pass, however many calls were sent in it)."""
        self._closed = False
        self._failed: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._fd = self._sock.getsockopt(zmq.FD)
        base = zmq.backend.Socket  # the compiled methods (module docstring); the socket is one of its subclasses
        assert isinstance(self._sock, base)
        self._raw_send: Any = base.send
        self._raw_recv: Any = base.recv
        self._raw_get: Any = base.get
        self._EVENTS = int(zmq.EVENTS)
        self._POLLIN, self._POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
        self._NOBLOCK, self._MORE = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
        self._loop.add_reader(self._fd, self._on_events)

    def _on_events(self) -> None:
        """Drain every answer ZeroMQ holds; wake sends waiting for room."""
        zmq, sock, get, recv = self._zmq, self._sock, self._raw_get, self._raw_recv
        try:
            while not self._closed:
                events = get(sock, self._EVENTS)
                if events & self._POLLOUT and self._writable:
                    waiting, self._writable = self._writable, []
                    for w in waiting:
                        if not w.done():
                            w.set_result(None)
                if not events & self._POLLIN:
                    return
                # recv_multipart's loop (a message's parts arrive together), each part's "more" read from its frame:
                # the socket's RCVMORE option goes through pyzmq's option enum in Python, a part at a time
                frame = recv(sock, self._NOBLOCK, copy=False)
                frames = [frame.bytes]
                while frame.more:
                    frame = recv(sock, self._NOBLOCK, copy=False)
                    frames.append(frame.bytes)
                self._answer(frames)
        except zmq.Again:
            return
        except zmq.ZMQError as exc:  # the socket failed: every call waiting on it fails with it
            self._failed = ConnectionError(f"sglang hop: {exc!r}")
            self._fail_pending(self._failed)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 and len(frames) != 5:
            log.warning("sglang hop: an answer of %d frames dropped", len(frames))
            return
        fut = self._pending.pop(frames[0], None)
        if fut is None or fut.done():
            return
        try:
            status = int(frames[1])
        except ValueError:
            fut.set_exception(ConnectionError(f"sglang hop: a malformed status {frames[1][:20]!r}"))
            return
        fut.set_result((status, frames[2:]))

    def _watch(self, deadline: float) -> None:
        """Have the timer fire by `deadline`."""
        if self._timer is None or deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self._loop.call_at(deadline, self._expire), deadline

    def _expire(self) -> None:
        """Fail the calls past their deadline; set the timer for the soonest other one."""
        self._timer = None
        now = self._loop.time()
        soonest: float | None = None
        for rid, deadline in list(self._deadlines.items()):
            if deadline <= now:
                del self._deadlines[rid]
                fut = self._pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_exception(TimeoutError())
            elif soonest is None or deadline < soonest:
                soonest = deadline
        if soonest is not None:
            self._watch(soonest)

    def _fail_pending(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        waiting, self._writable = self._writable, []
        for w in waiting:
            if not w.done():
                w.set_exception(exc)

    async def _send(self, frames: list[Any], deadline: float | None) -> None:
        zmq = self._zmq
        while True:
            if self._closed or self._failed is not None:
                raise self._failed or ConnectionError("sglang hop closed")
            try:
                self._send_frames(frames)
                break
            except zmq.Again:  # no room now: wait until the socket is writable again, within the call's deadline
                room: asyncio.Future[None] = self._loop.create_future()
                self._writable.append(room)
                self._loop.call_soon(self._on_events)  # it may be writable already (an edge that went unseen)
                async with asyncio.timeout_at(deadline):
                    await room
        if not self._drain_soon:  # a send may take the descriptor's edge: read the events once after this pass's sends
            self._drain_soon = True
            self._loop.call_soon(self._drain_after_sends)

    def _drain_after_sends(self) -> None:
        """`_on_events` once after a pass of the loop that sent (the sends of one pass each read the socket's events
        before, every read going through pyzmq's option enum in Python)."""
        self._drain_soon = False
        self._on_events()

    def _send_frames(self, frames: list[Any]) -> None:
        """``send_multipart(frames, NOBLOCK, copy=False)``: `zmq.Again` when the first frame cannot be queued (ZeroMQ
        takes the rest of a message once its first part is in), every frame a buffer."""
        send, sock, more = self._raw_send, self._sock, self._MORE
        for frame in frames[:-1]:
            send(sock, frame, more, copy=False)
        send(sock, frames[-1], self._NOBLOCK, copy=False)

    async def request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        """One call: the route's JSON answer (None for an empty one); `HttpError` for a status >= 300."""
        if self._closed:
            raise ConnectionError(f"sglang hop: {path} on a closed hop")
        body = dict(body or {})
        ids = body.pop("input_ids", None)
        images = body.get("image_data")
        raw: list[Any] = []
        if isinstance(images, list | tuple) and images and all(isinstance(b, bytes | bytearray | memoryview) for b in images):
            raw = list(body.pop("image_data"))
        rid = struct.pack("<QB", next(self._ids), COLUMNS)
        fut: asyncio.Future[tuple[int, list[bytes]]] = self._loop.create_future()
        self._pending[rid] = fut
        deadline = None
        if timeout_s is not None:
            deadline = self._deadlines[rid] = self._loop.time() + timeout_s
            self._watch(deadline)
        try:
            await self._send([self._token, rid, path.encode(), dumps(body), b"" if ids is None else _pack_ids(ids), *raw], deadline)
            status, answer = await fut
        except TimeoutError as exc:
            raise TimeoutError(f"{method} {path}: no answer within {timeout_s} s") from exc
        finally:
            self._pending.pop(rid, None)
            self._deadlines.pop(rid, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: a call cancelled after its answer or its timeout leaves no "never retrieved"
        payload = answer[0]
        if status >= 300:
            raise HttpError(status, payload)
        if len(answer) == 3:
            return _with_logprobs(loads(payload), answer[1], answer[2])
        return loads(payload) if payload else None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        self._fail_pending(ConnectionError("sglang hop closed"))
        self._sock.close(linger=0)
        self._context.term()


async def serve_hop(routes: Mapping[str, Route], endpoint: str, token: str) -> None:
    """The child's end: answer every request on a ROUTER bound at `endpoint` until cancelled (one task per request)."""
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory

    context = zmq.asyncio.Context()
    sock = SocketFactory(context).router(endpoint, max_msg_bytes=_MAX_MSG_BYTES)
    expected = token.encode()
    tasks: set[asyncio.Task[None]] = set()

    async def handle(identity: bytes, rid: bytes, path: str, header: bytes, ids: bytes, images: list[bytes]) -> None:
        status, answer = await answer_route(routes, path, _body(header, ids, images))
        try:
            frames = _answer_frames(answer) if len(rid) == 9 and rid[8] & COLUMNS else [dumps(answer) if answer is not None else b""]
            await sock.send_multipart([identity, rid, str(status).encode(), *frames], copy=False)
        except Exception as exc:  # noqa: BLE001 - the worker is gone (ROUTER_MANDATORY) or slow: its call times out
            log.warning("sglang hop: an answer to %s could not be sent: %r", path, exc)

    def _body(header: bytes, ids: bytes, images: list[bytes]) -> Any:
        try:
            body = loads(header) if header else {}
            if ids and isinstance(body, dict):
                body["input_ids"] = _unpack_ids(ids)
            if images and isinstance(body, dict):
                if "image_data" in body:
                    raise ValueError("image_data both in the JSON and as frames")
                body["image_data"] = images
        except ValueError as exc:
            return exc
        return body

    try:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) < 6:
                log.warning("sglang hop: a request of %d frames dropped", len(frames))
                continue
            identity, given, rid, path, header, ids, *images = frames
            if token and not hmac.compare_digest(given, expected):
                with contextlib.suppress(Exception):
                    await sock.send_multipart([identity, rid, b"401", dumps({"error": {"message": "missing or wrong token"}})])
                continue
            task = asyncio.create_task(handle(identity, rid, path.decode(errors="replace"), header, ids, images))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        for task in tasks:
            task.cancel()
        sock.close(linger=0)
        context.term()
