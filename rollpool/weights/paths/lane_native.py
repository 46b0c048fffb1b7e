"""The bulk lane's send loop in C, without the interpreter lock: a connection's chunks of one bucket served in one call.

In the trainer's process the lane's connection threads share the interpreter lock with the trainer's own Python, and
each socket call gives the lock up and waits for it again, up to the switch interval (5 ms) behind a busy thread: one
pure-Python thread beside the publisher held the lane at 1.0 GB/s against 2.8 idle (`bench/lane_probe.py`, the
2-core VM, session 24). Once a connection has looked a bucket up (on the event loop, as every first chunk is) and
holds its bytes as one contiguous buffer, `serve` answers the requests for that bucket in C: it parses each request,
sends the reply's header and the chunk's bytes in one ``sendmsg``, and reads the requests that came since, returning
to Python only when a request is not for that bucket (another bucket, a malformed one: Python answers it as today),
when the version store changed (`WeightServer.served_changes`: Python checks `still_serves` again, so a dropped
version is never sent from), when no request has come for `IDLE_MS` (Python tells the loop what went out, then waits
in its own ``recv``), or on a socket error or the peer's close.

Built with `rollpool.weights.native` at first use and checked against the Python path's bytes on a socket pair
(`_self_check`); off for the process (logged once, the Python path serves) where that fails, no compiler is found,
or ``ROLLPOOL_LANE_NATIVE=0``. The wire is the lane's own (`rollpool.weights.paths.bulk`): nothing changes for a peer.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

from rollpool.weights import native

__all__ = ["IDLE_MS", "PENDING_CAP", "Served", "enabled", "serve", "switch_off"]

_log = logging.getLogger("rollpool.weights.paths.lane_native")

IDLE_MS = 50
"""How long the loop waits for the next request before it returns to Python (which tells the loop what went out)."""
PENDING_CAP = 1 << 16
"""Request bytes a connection keeps unanswered (a request is 28 or 36 bytes)."""

NOT_OURS, CLOSED, CHANGED, IDLE = 0, 1, 2, 3
"""Why `serve` returned (a negative value: ``-errno`` of a failed socket call)."""

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <poll.h>
#include <sys/types.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define REQ 28   /* "<4sQIQI": magic, version, bucket, offset, nbytes */
#define BASE 8   /* "<q": an RPBD request's delta base */
#define PIECE (1u << 20)

static uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* Answer the requests in pending[0, *npending) for bucket `bucket` of `version` (delta base `delta_base`, -1: none)
   from `base` (`size` bytes), reading more as they come. `head` (nhead bytes) is the reply's header and checksum
   text, nbytes patched at byte 5. Returns 0: the first pending request is not one this call answers; 1: the peer
   closed; 2: *changes != changes0 before a send; 3: nothing pending and nothing came for idle_ms; -errno: a socket
   call failed (EAGAIN: the kernel's timeout). Little-endian hosts only (the caller checks). */
int64_t rollpool_lane_serve(int fd, const unsigned char *base, uint64_t size, uint64_t version, uint32_t bucket,
                            int64_t delta_base, unsigned char *head, uint32_t nhead, unsigned char *pending,
                            uint32_t *npending, uint32_t cap, const volatile int64_t *changes, int64_t changes0,
                            uint32_t max_chunk, int idle_ms, uint64_t *served_bytes, uint64_t *served_chunks) {
    for (;;) {
        while (*npending >= REQ) {
            const unsigned char *r = pending;
            int delta = memcmp(r, "RPBD", 4) == 0;
            if (!delta && memcmp(r, "RPBQ", 4) != 0) return 0;
            uint32_t need = REQ + (delta ? BASE : 0);
            if (*npending < need) break;
            uint64_t v = rd64(r + 4), off = rd64(r + 16);
            uint32_t b = rd32(r + 12), n = rd32(r + 24);
            int64_t db = delta ? (int64_t)rd64(r + REQ) : -1;
            if (v != version || b != bucket || db != delta_base || n == 0 || n > max_chunk || off > size || n > size - off)
                return 0;
            if (*changes != changes0) return 2;
            memcpy(head + 5, &n, 4);
            struct iovec iov[2];
            iov[0].iov_base = head; iov[0].iov_len = nhead;
            iov[1].iov_base = (void *)(base + off); iov[1].iov_len = n;
            struct msghdr msg;
            memset(&msg, 0, sizeof msg);
            msg.msg_iov = iov; msg.msg_iovlen = 2;
            while (msg.msg_iovlen) {
                /* at most PIECE bytes a call: the receiver then reads bytes this thread wrote just before, still in
                   cache (one 8 MiB call ran the lane at 2.0 GB/s on the 2-core VM, 1 MiB calls at 2.4) */
                struct iovec *last = &msg.msg_iov[msg.msg_iovlen - 1];
                size_t over = last->iov_len > PIECE ? last->iov_len - PIECE : 0;
                last->iov_len -= over;
                ssize_t s = sendmsg(fd, &msg, MSG_NOSIGNAL);
                last->iov_len += over;
                if (s < 0) { if (errno == EINTR) continue; return -errno; }
                if (s == 0) return -EPIPE;
                while (s > 0 && msg.msg_iovlen) {
                    if ((size_t)s >= msg.msg_iov->iov_len) { s -= msg.msg_iov->iov_len; msg.msg_iov++; msg.msg_iovlen--; }
                    else { msg.msg_iov->iov_base = (char *)msg.msg_iov->iov_base + s; msg.msg_iov->iov_len -= s; s = 0; }
                }
            }
            memmove(pending, pending + need, *npending - need);
            *npending -= need;
            *served_bytes += n;
            *served_chunks += 1;
        }
        if (*npending >= cap) return 0;
        if (*npending == 0) {
            struct pollfd p = {fd, POLLIN, 0};
            int k = poll(&p, 1, idle_ms);
            if (k < 0) { if (errno == EINTR) continue; return -errno; }
            if (k == 0) return 3;
        }
        ssize_t got = recv(fd, pending + *npending, cap - *npending, 0);
        if (got < 0) { if (errno == EINTR) continue; return -errno; }
        if (got == 0) return 1;
        *npending += (uint32_t)got;
    }
}
"""

_lock = threading.Lock()
_fn: Any = None
_off: str | None = None if os.environ.get("ROLLPOOL_LANE_NATIVE", "1") != "0" else "ROLLPOOL_LANE_NATIVE=0"
if struct.pack("=I", 1) != struct.pack("<I", 1):
    _off = "not a little-endian host"


@dataclass(slots=True)
class Served:
    """What one `serve` call did: why it returned (`NOT_OURS`, `CLOSED`, `CHANGED`, `IDLE`, or ``-errno``), the
    chunks and bytes it sent, and the request bytes left unanswered (the first of them not this call's)."""

    why: int
    chunks: int
    nbytes: int
    left: bytes


def enabled() -> bool:
    """Whether the compiled send loop serves here (built, loaded and checked on first call; False for good after a failure)."""
    return _off is None and _load() is not None


def switch_off(reason: str) -> None:
    """The Python path serves every chunk from now on in this process."""
    global _off
    if _off is None:
        _off = reason
        _log.warning("the bulk lane's compiled send loop is off, Python sends every chunk from now on: %s", reason)


def serve(sock: socket.socket, bucket_bytes: Any, version: int, bucket: int, delta_base: int, head: bytes, pending: bytes,
          changes: ctypes.c_int64, changes0: int, max_chunk: int, idle_ms: int | None = None) -> Served:
    """Answer `pending` (request bytes) and the requests that follow for one bucket, from `bucket_bytes` (the whole
    bucket: a numpy uint8 array), in C with the interpreter lock released; see the module's text for when it returns.
    `head`: the reply's header (status ok) and checksum text; `changes`: the store's counter, `changes0` its value when
    the caller last checked that the version is served. Raises where not `enabled`."""
    fn = _load()
    if fn is None:
        raise RuntimeError(f"the bulk lane's compiled send loop is off: {_off}")
    return _call(fn, sock, bucket_bytes, version, bucket, delta_base, head, pending, changes, changes0, max_chunk,
                 IDLE_MS if idle_ms is None else idle_ms)


def _call(fn: Any, sock: socket.socket, bucket_bytes: Any, version: int, bucket: int, delta_base: int, head: bytes,
          pending: bytes, changes: ctypes.c_int64, changes0: int, max_chunk: int, idle_ms: int) -> Served:
    buf = ctypes.create_string_buffer(pending, PENDING_CAP)
    n = ctypes.c_uint32(len(pending))
    hbuf = ctypes.create_string_buffer(head, len(head))
    sent_bytes, sent_chunks = ctypes.c_uint64(0), ctypes.c_uint64(0)
    why = fn(sock.fileno(), native.address(bucket_bytes), int(bucket_bytes.nbytes), version, bucket, delta_base, hbuf, len(head),
             buf, ctypes.byref(n), PENDING_CAP, ctypes.byref(changes), changes0, max_chunk, idle_ms,
             ctypes.byref(sent_bytes), ctypes.byref(sent_chunks))
    return Served(int(why), int(sent_chunks.value), int(sent_bytes.value), buf.raw[: n.value])


def _load() -> Any:
    global _fn
    if _fn is not None or _off is not None:
        return _fn
    with _lock:
        if _fn is not None or _off is not None:
            return _fn
        try:
            lib = ctypes.CDLL(str(native.build("lane", _SOURCE)))  # CDLL: the lock is released around each call
            fn = lib.rollpool_lane_serve
            fn.restype = ctypes.c_int64
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int64,
                           ctypes.c_char_p, ctypes.c_uint32, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32,
                           ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_uint32, ctypes.c_int,
                           ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
        except Exception as e:  # noqa: BLE001 - no compiler, a failed build, a library that does not load
            switch_off(f"{type(e).__name__}: {e}")
            return None
        why = _self_check(fn)
        if why:
            switch_off(why)
            return None
        _fn = fn
        _log.debug("the bulk lane's compiled send loop is on")
        return _fn


def _self_check(fn: Any) -> str | None:
    """Why the built loop does not answer as the lane's wire says (two requests on a socket pair: the replies' headers
    and bytes, a third request for another bucket left pending), or None when it does."""
    import numpy as np

    req = struct.Struct("<4sQIQI")
    data = np.arange(3000, dtype=np.uint8)
    head = struct.pack("<4sBIH", b"RPBA", 0, 0, 3) + b"x:1"
    a, b = socket.socketpair()
    try:
        a.settimeout(5)
        b.settimeout(5)
        pending = req.pack(b"RPBQ", 7, 2, 0, 1000) + req.pack(b"RPBQ", 7, 2, 1000, 2000) + req.pack(b"RPBQ", 7, 3, 0, 8)
        got = _call(fn, b, data, 7, 2, -1, head, pending, ctypes.c_int64(0), 0, 1 << 20, 0)
        want = b"".join(struct.pack("<4sBIH", b"RPBA", 0, n, 3) + b"x:1" + data[o : o + n].tobytes() for o, n in ((0, 1000), (1000, 2000)))
        out = b""
        while len(out) < len(want):
            out += a.recv(len(want) - len(out))
        if (got.why, got.chunks, got.nbytes, got.left) != (NOT_OURS, 2, 3000, pending[2 * req.size :]) or out != want:
            return f"its replies differ from the lane's wire ({got.why}, {got.chunks}, {got.nbytes})"
        return None
    except Exception as e:  # noqa: BLE001 - reported as the reason it is off
        return f"its self-check failed: {type(e).__name__}: {e}"
    finally:
        a.close()
        b.close()
