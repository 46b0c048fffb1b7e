"""The bulk lane's loops in C, without the interpreter lock: a connection's chunks of one bucket sent (`serve`) or
received (`ChunkFetch`) in one call.

In the trainer's process the lane's connection threads share the interpreter lock with the trainer's own Python, and
each socket call gives the lock up and waits for it again, up to the switch interval (5 ms) behind a busy thread: one
pure-Python thread beside the publisher held the Python send path at 1.0 GB/s against 2.8 idle (`bench/lane_probe.py`,
the 2-core VM). Once a connection has looked a bucket up (on the event loop, as every first chunk is) and
holds its bytes as one contiguous buffer, `serve` answers the requests for that bucket in C: it parses each request,
sends the reply's header and the chunk's bytes with ``sendmsg`` (at most 1 MiB a call), and reads the requests that came since, returning
to Python only when a request is not for that bucket (another bucket, a malformed one: Python answers it as today),
when the version store changed (`WeightServer.served_changes`: Python checks `still_serves` again, so a dropped
version is never sent from), when no request has come for `IDLE_MS` (Python tells the loop what went out, then waits
in its own ``recv``), or on a socket error or the peer's close.

The subscriber's end is the same in reverse (`ChunkFetch`: the worker's engine runs Python beside its fetch): a
stream's requests for a bucket go out half a window at a time and each reply's header, checksum text and bytes are read
into the bucket, back in Python every `batch_bytes` (the caller folds what landed into the bucket's checksum), at a
reply whose text differs from the last one's, at an error reply, or on a socket error.

Built with `rollpool.weights.native` at first use and checked against the Python path's bytes on a socket pair
and the receiving end against the sending end (`_self_check`); both off for the process (logged once, the Python
paths serve) where that fails, no compiler is found, or ``ROLLPOOL_LANE_NATIVE=0``. The wire is the lane's own
(`rollpool.weights.paths.bulk`): nothing changes for a peer.
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

__all__ = ["IDLE_MS", "PENDING_CAP", "ChunkFetch", "Served", "enabled", "serve", "switch_off"]

_log = logging.getLogger("rollpool.weights.paths.lane_native")

IDLE_MS = 50
"""How long the loop waits for the next request before it returns to Python (which tells the loop what went out)."""
PENDING_CAP = 1 << 16
"""Request bytes a connection keeps unanswered (a request is 28 or 36 bytes)."""

NOT_OURS, CLOSED, CHANGED, IDLE = 0, 1, 2, 3
"""Why `serve` returned (a negative value: ``-errno`` of a failed socket call)."""
ALL_LANDED, BATCH, BAD_STATUS, NEW_TEXT, NOT_LANE = 0, 4, 5, 6, 7
"""Why `ChunkFetch.run` returned (and `CLOSED`, or ``-errno``)."""
TEXT_CAP = 4096

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
   from `base` (`size` bytes), reading more as they come: "RPBQ", "RPBE" and "RPBD" requests, or with early_only
   "RPBE" ones alone (the bucket's checksum is pending: `base` then ends before the bucket's last chunk). `head` (nhead bytes) is the reply's header and checksum
   text, nbytes patched at byte 5. Returns 0: the first pending request is not one this call answers; 1: the peer
   closed; 2: *changes != changes0 before a send; 3: nothing pending and nothing came for idle_ms; -errno: a socket
   call failed (EAGAIN: the kernel's timeout). Little-endian hosts only (the caller checks). */
int64_t rollpool_lane_serve(int fd, const unsigned char *base, uint64_t size, uint64_t version, uint32_t bucket,
                            int64_t delta_base, unsigned char *head, uint32_t nhead, unsigned char *pending,
                            uint32_t *npending, uint32_t cap, const volatile int64_t *changes, int64_t changes0,
                            uint32_t max_chunk, int idle_ms, uint64_t *served_bytes, uint64_t *served_chunks,
                            int early_only) {
    for (;;) {
        while (*npending >= REQ) {
            const unsigned char *r = pending;
            int delta = memcmp(r, "RPBD", 4) == 0, early = memcmp(r, "RPBE", 4) == 0;
            if (early_only ? !early : !delta && !early && memcmp(r, "RPBQ", 4) != 0) return 0;
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

static int64_t recv_all(int fd, unsigned char *p, uint64_t n) {
    while (n) {
        ssize_t got = recv(fd, p, n, MSG_WAITALL);
        if (got < 0) { if (errno == EINTR) continue; return -errno; }
        if (got == 0) return 1;
        p += got; n -= (uint64_t)got;
    }
    return 0;
}

/* The subscriber's end: chunks [*done, n) of one bucket (offsets offs, sizes lens) into dst. Requests (the template
   `req`, nreq bytes, its offset and nbytes patched) go out half a window at a time, at most `window` unanswered; each
   reply's header (11 bytes: "RPBA", status, nbytes, n), checksum text and bytes are read in turn. Returns 0: every chunk
   landed; 4: chunks landed since the call reached stop_bytes (the caller folds); 6: the last chunk landed carried a text
   other than `expected` (in `text`, *ntext bytes); 5: a reply's status is not 0 or its size not the request's (its header
   in hdr, its text not read); 7: a reply that is not the lane's; 1: the peer closed; -errno: a socket call failed
   (EAGAIN: the kernel's timeout). *done and *sent move as chunks land and requests go out. */
int64_t rollpool_lane_fetch(int fd, unsigned char *dst, const uint64_t *offs, const uint32_t *lens, uint32_t n,
                            uint32_t *done, uint32_t *sent, uint32_t window, unsigned char *req, uint32_t nreq,
                            const unsigned char *expected, uint32_t nexpected, unsigned char *text, uint32_t textcap,
                            uint32_t *ntext, unsigned char *hdr, uint64_t stop_bytes) {
    uint64_t landed = 0;
    uint32_t half = window / 2 ? window / 2 : 1, win = window ? window : 1;
    while (*done < n) {
        if (*sent < n && (*sent == *done || *sent - (*done + 1) < half)) {
            uint32_t upto = *done + 1 + win;
            if (*sent == *done) upto = *done + win;
            if (upto > n) upto = n;
            while (*sent < upto) {
                memcpy(req + 16, &offs[*sent], 8);
                memcpy(req + 24, &lens[*sent], 4);
                uint32_t left = nreq;
                while (left) {
                    ssize_t s = send(fd, req + (nreq - left), left, MSG_NOSIGNAL);
                    if (s < 0) { if (errno == EINTR) continue; return -errno; }
                    left -= (uint32_t)s;
                }
                *sent += 1;
            }
        }
        int64_t r = recv_all(fd, hdr, 11);
        if (r) return r;
        if (memcmp(hdr, "RPBA", 4) != 0) return 7;
        uint32_t size; uint16_t nt;
        memcpy(&size, hdr + 5, 4);
        memcpy(&nt, hdr + 9, 2);
        if (hdr[4] != 0 || size != lens[*done]) return 5;
        if (nt > textcap) return 7;
        r = recv_all(fd, text, nt);
        if (r) return r;
        *ntext = nt;
        r = recv_all(fd, dst + offs[*done], size);
        if (r) return r;
        *done += 1;
        landed += size;
        if (nt != nexpected || memcmp(text, expected, nt) != 0) return 6;
        if (landed >= stop_bytes && *done < n) return 4;
    }
    return 0;
}
"""

_lock = threading.Lock()
_fn: Any = None
_fetch_fn: Any = None
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
    """Whether the compiled loops run here (built, loaded and checked on first call; False for good after a failure)."""
    return _off is None and _load() is not None


def switch_off(reason: str) -> None:
    """The Python paths send and receive every chunk from now on in this process."""
    global _off
    if _off is None:
        _off = reason
        _log.warning("the bulk lane's compiled loops are off, Python sends and receives every chunk from now on: %s", reason)


def serve(sock: socket.socket, bucket_bytes: Any, version: int, bucket: int, delta_base: int, head: bytes, pending: bytes,
          changes: ctypes.c_int64, changes0: int, max_chunk: int, idle_ms: int | None = None, *, early_only: bool = False) -> Served:
    """Answer `pending` (request bytes) and the requests that follow for one bucket, from `bucket_bytes` (the whole
    bucket: a numpy uint8 array), in C with the interpreter lock released; see the module's text for when it returns.
    `head`: the reply's header (status ok) and checksum text; `changes`: the store's counter, `changes0` its value when
    the caller last checked that the version is served. `early_only`: answer ``RPBE`` requests alone (the bucket's
    checksum is pending: `head` carries no text and `bucket_bytes` ends before the bucket's last chunk). Raises where
    not `enabled`."""
    fn = _load()
    if fn is None:
        raise RuntimeError(f"the bulk lane's compiled loops are off: {_off}")
    return _call(fn, sock, bucket_bytes, version, bucket, delta_base, head, pending, changes, changes0, max_chunk,
                 IDLE_MS if idle_ms is None else idle_ms, early_only)


def _call(fn: Any, sock: socket.socket, bucket_bytes: Any, version: int, bucket: int, delta_base: int, head: bytes,
          pending: bytes, changes: ctypes.c_int64, changes0: int, max_chunk: int, idle_ms: int, early_only: bool = False) -> Served:
    cap = max(PENDING_CAP, len(pending))  # (Python reads up to 64 KiB onto a part of a request)
    buf = ctypes.create_string_buffer(pending, cap)
    n = ctypes.c_uint32(len(pending))
    hbuf = ctypes.create_string_buffer(head, len(head))
    sent_bytes, sent_chunks = ctypes.c_uint64(0), ctypes.c_uint64(0)
    why = fn(sock.fileno(), native.address(bucket_bytes), int(bucket_bytes.nbytes), version, bucket, delta_base, hbuf, len(head),
             buf, ctypes.byref(n), cap, ctypes.byref(changes), changes0, max_chunk, idle_ms,
             ctypes.byref(sent_bytes), ctypes.byref(sent_chunks), int(early_only))
    return Served(int(why), int(sent_chunks.value), int(sent_bytes.value), buf.raw[: n.value])


class ChunkFetch:
    """The subscriber's end: one stream's chunks of one bucket received into the bucket's buffer by the compiled loop
    (`rollpool_lane_fetch`), with the interpreter lock released: requests half a window at a time, each reply's header,
    checksum text and bytes read in turn. `run` returns after `batch_bytes` landed (the caller folds and tells what
    landed), when a chunk's text differs from the previous one's, at an error reply (its header in `header`, its text
    left on the socket) or a socket error; `done` chunks have landed (the job resumes where it stopped)."""

    def __init__(self, chunks: list[tuple[int, int]], magic: bytes, version: int, bucket: int, delta_base: int, window: int,
                 dst: Any) -> None:
        n = len(chunks)
        self.dst = dst
        """The bucket's buffer (a numpy array or a writable buffer), held while this job lives."""
        self._address = native.address(dst)
        self.n = n
        self.offs = (ctypes.c_uint64 * max(1, n))(*[o for o, _ in chunks])
        self.lens = (ctypes.c_uint32 * max(1, n))(*[k for _, k in chunks])
        self._done, self._sent = ctypes.c_uint32(0), ctypes.c_uint32(0)
        req = struct.pack("<4sQIQI", magic, version, bucket, 0, 0) + (struct.pack("<q", delta_base) if delta_base >= 0 else b"")
        self._req = ctypes.create_string_buffer(req, len(req))
        self._text = ctypes.create_string_buffer(TEXT_CAP)
        self._ntext = ctypes.c_uint32(0)
        self._hdr = ctypes.create_string_buffer(11)
        self.window = window

    @property
    def done(self) -> int:
        return int(self._done.value)

    @property
    def text(self) -> bytes:
        """The text the last chunk landed carried."""
        return self._text.raw[: self._ntext.value]

    @property
    def header(self) -> bytes:
        return self._hdr.raw

    def run(self, sock: socket.socket, expected: bytes, batch_bytes: int) -> int:
        fn = _load_fetch()
        if fn is None:
            raise RuntimeError(f"the bulk lane's compiled loops are off: {_off}")
        return self.run_with(fn, sock, expected, batch_bytes)

    def run_with(self, fn: Any, sock: socket.socket, expected: bytes, batch_bytes: int) -> int:
        return int(fn(sock.fileno(), self._address, self.offs, self.lens, self.n, ctypes.byref(self._done), ctypes.byref(self._sent),
                      self.window, self._req, len(self._req), expected, len(expected), self._text, TEXT_CAP,
                      ctypes.byref(self._ntext), self._hdr, batch_bytes))


def _load_fetch() -> Any:
    return _fetch_fn if _load() is not None else None


def _load() -> Any:
    global _fn, _fetch_fn
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
                           ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
            fetch = lib.rollpool_lane_fetch
            fetch.restype = ctypes.c_int64
            u32p = ctypes.POINTER(ctypes.c_uint32)
            fetch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, u32p, u32p,
                              ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_char_p,
                              ctypes.c_uint32, u32p, ctypes.c_char_p, ctypes.c_uint64]
        except Exception as e:  # noqa: BLE001 - no compiler, a failed build, a library that does not load
            switch_off(f"{type(e).__name__}: {e}")
            return None
        why = _self_check(fn, fetch)
        if why:
            switch_off(why)
            return None
        _fn, _fetch_fn = fn, fetch
        _log.debug("the bulk lane's compiled send loop is on")
        return _fn


def _self_check(fn: Any, fetch: Any) -> str | None:
    """Why the built loops do not speak the lane's wire (on a socket pair: the sending end's replies to two requests,
    byte for byte, a third for another bucket left pending; then the receiving end fetching three chunks from the
    sending end), or None when they do."""
    import numpy as np

    req = struct.Struct("<4sQIQI")
    data = np.arange(3000, dtype=np.uint8)
    head = struct.pack("<4sBIH", b"RPBA", 0, 0, 3) + b"x:1"
    a, b = socket.socketpair()
    try:
        for end in (a, b):  # blocking, with the kernel's timeouts, as the lane's sockets are (`bulk.kernel_timeouts`)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 5, 0))
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", 5, 0))
        pending = req.pack(b"RPBQ", 7, 2, 0, 1000) + req.pack(b"RPBQ", 7, 2, 1000, 2000) + req.pack(b"RPBQ", 7, 3, 0, 8)
        got = _call(fn, b, data, 7, 2, -1, head, pending, ctypes.c_int64(0), 0, 1 << 20, 0)
        want = b"".join(struct.pack("<4sBIH", b"RPBA", 0, n, 3) + b"x:1" + data[o : o + n].tobytes() for o, n in ((0, 1000), (1000, 2000)))
        out = b""
        while len(out) < len(want):
            out += a.recv(len(want) - len(out))
        if (got.why, got.chunks, got.nbytes, got.left) != (NOT_OURS, 2, 3000, pending[2 * req.size :]) or out != want:
            return f"its replies differ from the lane's wire ({got.why}, {got.chunks}, {got.nbytes})"
        # the receiving end against the sending end: three chunks, a window of two
        server = threading.Thread(target=_call, args=(fn, b, data, 7, 2, -1, head, b"", ctypes.c_int64(0), 0, 1 << 20, 300))
        server.start()
        into = np.zeros(3000, dtype=np.uint8)
        job = ChunkFetch([(0, 1000), (1000, 1000), (2000, 1000)], b"RPBQ", 7, 2, -1, 2, into)
        whys = [job.run_with(fetch, a, b"", 1 << 30), job.run_with(fetch, a, b"x:1", 1 << 30)]
        server.join()
        if whys != [NEW_TEXT, ALL_LANDED] or job.done != 3 or job.text != b"x:1" or not np.array_equal(into, data):
            return f"its receiving end differs from the lane's wire ({whys}, {job.done})"
        return None
    except Exception as e:  # noqa: BLE001 - reported as the reason it is off
        return f"its self-check failed: {type(e).__name__}: {e}"
    finally:
        a.close()
        b.close()
