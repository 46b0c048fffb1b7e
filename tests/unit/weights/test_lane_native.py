"""The bulk lane's compiled send loop (`rollpool.weights.paths.lane_native`) on a real socket pair: the replies are
the lane's wire, byte for byte, and it returns to Python at each point the server relies on (a request not for its
bucket, the store changed, nothing came, the peer closed)."""

from __future__ import annotations

import ctypes
import shutil
import socket
import struct
import threading

import pytest

np = pytest.importorskip("numpy")

from rollpool.weights.paths import lane_native  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here: the Python path serves")

REQ = struct.Struct("<4sQIQI")
HEAD = struct.pack("<4sBIH", b"RPBA", 0, 0, 7) + b"xxh3:ab"
DATA = np.random.default_rng(3).integers(0, 256, size=100_000, dtype=np.uint8)


def reply(offset: int, nbytes: int) -> bytes:
    return struct.pack("<4sBIH", b"RPBA", 0, nbytes, 7) + b"xxh3:ab" + DATA[offset : offset + nbytes].tobytes()


def recv_all(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        assert got, "closed early"
        out += got
    return out


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    assert lane_native.enabled(), lane_native._off
    a, b = socket.socketpair()
    a.settimeout(10)
    yield a, b
    a.close()
    b.close()


def serve(b: socket.socket, pending: bytes, *, changes: ctypes.c_int64 | None = None, idle_ms: int = 0,
          delta_base: int = -1) -> lane_native.Served:
    counter = changes if changes is not None else ctypes.c_int64(0)
    return lane_native.serve(b, DATA, 5, 1, delta_base, HEAD, pending, counter, 0, 1 << 20, idle_ms=idle_ms)


def test_it_answers_its_buckets_requests_in_order_and_stops_at_one_for_another_bucket(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    other = REQ.pack(b"RPBQ", 5, 2, 0, 100)
    pending = REQ.pack(b"RPBQ", 5, 1, 0, 4096) + REQ.pack(b"RPBQ", 5, 1, 99_000, 1000) + other + REQ.pack(b"RPBQ", 5, 1, 0, 8)
    got = serve(b, pending)
    assert (got.why, got.chunks, got.nbytes) == (lane_native.NOT_OURS, 2, 5096)
    assert got.left == pending[2 * REQ.size :]  # the other bucket's request first: Python answers it
    assert recv_all(a, len(reply(0, 4096)) + len(reply(99_000, 1000))) == reply(0, 4096) + reply(99_000, 1000)


@pytest.mark.parametrize("bad", [
    REQ.pack(b"RPBQ", 5, 1, 99_999, 2),  # past the bucket's end
    REQ.pack(b"RPBQ", 5, 1, 0, 0),  # no bytes
    REQ.pack(b"RPBQ", 5, 1, 0, (1 << 20) + 1),  # over the largest chunk
    REQ.pack(b"RPBQ", 6, 1, 0, 8),  # another version
    REQ.pack(b"RPBD", 5, 1, 0, 8) + struct.pack("<q", 4),  # the delta of it
    b"GET / HTTP/1.1\r\n\r\n0123456789",  # not a request
])
def test_what_it_does_not_answer_is_left_to_python_with_nothing_sent(pair, bad: bytes) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    got = serve(b, bad)
    assert (got.why, got.chunks, got.left) == (lane_native.NOT_OURS, 0, bad)
    a.setblocking(False)
    with pytest.raises(BlockingIOError):
        a.recv(1)


def test_a_delta_request_is_answered_for_its_base(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    got = serve(b, REQ.pack(b"RPBD", 5, 1, 10, 20) + struct.pack("<q", 4), delta_base=4)
    assert (got.why, got.chunks) == (lane_native.IDLE, 1)
    assert recv_all(a, len(reply(10, 20))) == reply(10, 20)


def test_a_change_in_the_store_stops_it_before_the_next_send(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    changes = ctypes.c_int64(0)

    def later() -> None:  # the peer reads the first reply, the store changes, then the next request comes
        recv_all(a, len(reply(0, 10)))
        changes.value += 1
        a.sendall(REQ.pack(b"RPBQ", 5, 1, 10, 10))

    t = threading.Thread(target=later)
    t.start()
    got = serve(b, REQ.pack(b"RPBQ", 5, 1, 0, 10), changes=changes, idle_ms=5000)
    t.join()
    assert (got.why, got.chunks, got.left) == (lane_native.CHANGED, 1, REQ.pack(b"RPBQ", 5, 1, 10, 10))


def test_requests_that_come_in_pieces_are_answered_and_idle_or_a_close_return(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    req = REQ.pack(b"RPBQ", 5, 1, 0, 300)
    a.sendall(req[5:])  # the request's first bytes are what Python read; the rest is still on the socket
    got = serve(b, req[:5], idle_ms=200)
    assert (got.why, got.chunks, got.left) == (lane_native.IDLE, 1, b"")  # answered, then nothing came for idle_ms
    assert recv_all(a, len(reply(0, 300))) == reply(0, 300)
    a.shutdown(socket.SHUT_WR)
    assert serve(b, b"", idle_ms=200).why == lane_native.CLOSED


def test_a_peer_gone_mid_send_is_an_error_not_a_hang(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    a.close()
    got = serve(b, REQ.pack(b"RPBQ", 5, 1, 0, 100))
    assert got.why < 0 and got.chunks == 0  # -EPIPE (or -ECONNRESET): the caller closes the connection


def test_a_chunk_larger_than_a_send_goes_out_whole_in_pieces(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    big = np.random.default_rng(4).integers(0, 256, size=(3 << 20) + 5, dtype=np.uint8)  # over 1 MiB a sendmsg
    want = struct.pack("<4sBIH", b"RPBA", 0, big.nbytes - 1, 7) + b"xxh3:ab" + big[1:].tobytes()
    got_bytes: list[bytes] = []
    reader = threading.Thread(target=lambda: got_bytes.append(recv_all(a, len(want))))
    reader.start()
    got = lane_native.serve(b, big, 5, 1, -1, HEAD, REQ.pack(b"RPBQ", 5, 1, 1, big.nbytes - 1), ctypes.c_int64(0), 0, 8 << 20,
                            idle_ms=0)
    reader.join()
    assert (got.why, got.chunks, got.nbytes) == (lane_native.IDLE, 1, big.nbytes - 1)
    assert got_bytes == [want]


def blocking(s: socket.socket) -> socket.socket:
    """Blocking mode with the kernel's timeouts, as the lane's sockets (`bulk.kernel_timeouts`)."""
    s.settimeout(None)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 5, 0))
    return s


def test_the_receiving_end_fetches_a_buckets_chunks_in_batches_and_says_when_the_text_changes(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    a = blocking(a)
    chunks = [(o, min(7000, DATA.nbytes - o)) for o in range(0, DATA.nbytes, 7000)]
    server = threading.Thread(target=serve, args=(b, b""), kwargs={"idle_ms": 200})
    server.start()
    into = np.zeros(DATA.nbytes, dtype=np.uint8)
    job = lane_native.ChunkFetch(chunks, b"RPBQ", 5, 1, -1, 4, into)
    whys, dones = [], []
    text = b""
    while job.done < len(chunks):
        whys.append(job.run(a, text, 20_000))
        dones.append(job.done)
        text = job.text
    server.join()
    assert np.array_equal(into, DATA)
    # the first chunk's text differs from the none expected; then a return every 20,000 bytes (three 7,000-byte chunks)
    assert whys[0] == lane_native.NEW_TEXT and dones[0] == 1 and text == b"xxh3:ab"
    assert set(whys[1:-1]) == {lane_native.BATCH} and whys[-1] == lane_native.ALL_LANDED
    assert all(d - c == 3 for c, d in zip(dones[1:-2], dones[2:-1], strict=True))


def test_the_receiving_end_stops_at_an_error_reply_with_its_text_left_for_python(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    a = blocking(a)
    b.sendall(reply(0, 100) + struct.pack("<4sBIH", b"RPBA", 1, 0, 4) + b"gone")  # the second request answered gone
    into = np.zeros(200, dtype=np.uint8)
    job = lane_native.ChunkFetch([(0, 100), (100, 100)], b"RPBQ", 5, 1, -1, 2, into)
    assert job.run(a, b"xxh3:ab", 1 << 30) == lane_native.BAD_STATUS
    assert job.done == 1 and np.array_equal(into[:100], DATA[:100])
    assert struct.unpack("<4sBIH", job.header) == (b"RPBA", 1, 0, 4) and a.recv(4) == b"gone"
    assert b.recv(2 * REQ.size, socket.MSG_WAITALL) == REQ.pack(b"RPBQ", 5, 1, 0, 100) + REQ.pack(b"RPBQ", 5, 1, 100, 100)


def test_more_pending_requests_than_its_buffer_holds_are_all_answered(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    reqs = [REQ.pack(b"RPBQ", 5, 1, i, 1) for i in range(lane_native.PENDING_CAP // REQ.size + 100)]  # over 64 KiB
    want = b"".join(reply(i, 1) for i in range(len(reqs)))
    got_bytes: list[bytes] = []
    reader = threading.Thread(target=lambda: got_bytes.append(recv_all(a, len(want))))
    reader.start()
    got = serve(b, b"".join(reqs))
    reader.join()
    assert (got.why, got.chunks) == (lane_native.IDLE, len(reqs)) and got_bytes == [want]


def test_an_early_request_is_answered_as_a_plain_one_once_the_checksum_is_known(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    pending = REQ.pack(b"RPBE", 5, 1, 0, 4096) + REQ.pack(b"RPBQ", 5, 1, 4096, 100)
    got = serve(b, pending)
    assert (got.why, got.chunks, got.nbytes, got.left) == (lane_native.IDLE, 2, 4196, b"")
    assert recv_all(a, len(reply(0, 4096)) + len(reply(4096, 100))) == reply(0, 4096) + reply(4096, 100)


def test_before_the_checksum_it_answers_early_requests_alone_with_no_text_and_never_the_buckets_last_chunk(pair) -> None:  # type: ignore[no-untyped-def]
    """The bucket's checksum is pending (the server gives the loop the bucket but its last byte and an empty text): an
    ``RPBE`` request is answered, the chunk that ends the bucket and a plain ``RPBQ`` are left to Python (which waits
    for the checksum), with nothing sent for them."""
    a, b = pair
    head = struct.pack("<4sBIH", b"RPBA", 0, 0, 0)
    last = REQ.pack(b"RPBE", 5, 1, 96_000, 4000)
    for front in (REQ.pack(b"RPBQ", 5, 1, 0, 4096), last):
        pending = REQ.pack(b"RPBE", 5, 1, 0, 4096) + REQ.pack(b"RPBE", 5, 1, 4096, 4096) + front
        got = lane_native.serve(b, DATA[: DATA.nbytes - 1], 5, 1, -1, head, pending, ctypes.c_int64(0), 0, 1 << 20,
                                idle_ms=0, early_only=True)
        assert (got.why, got.chunks, got.nbytes, got.left) == (lane_native.NOT_OURS, 2, 8192, front)
        want = b"".join(struct.pack("<4sBIH", b"RPBA", 0, 4096, 0) + DATA[o : o + 4096].tobytes() for o in (0, 4096))
        assert recv_all(a, len(want)) == want
    a.setblocking(False)
    with pytest.raises(BlockingIOError):
        a.recv(1)
