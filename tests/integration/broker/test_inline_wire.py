"""Protocol minor 12 on real sockets: small arrays travel inline in the header, and only between peers whose hello
and welcome settled on minor 12; a minor-11 worker and client get (and send) every array in a frame, as before."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import zmq

from rollpool import protocol as p
from tests.integration.broker.conftest import Harness
from tests.integration.broker.peers import make_group, make_prompt
from tests.unit.protocol.samples import header_bins

OLD = 11
"""The previous minor: its hellos do not carry `protocol_minor` and its headers say 11."""


class RawPeer:
    """A worker or client on a bare DEALER speaking minor `minor`: it keeps every message's raw frames."""

    def __init__(self, h: Harness, name: str, *, minor: int, worker: bool) -> None:
        self.sock = h.sockets.dealer(h.broker.worker_endpoint if worker else h.broker.client_endpoint, identity=name.encode())
        self.name = name
        self.minor = minor
        self.inline: p.Inline | None = None
        self.received: list[tuple[list[bytes], Any]] = []
        self.sent: list[list[bytes]] = []

    def close(self) -> None:
        self.sock.close(linger=0)

    async def send(self, msg: Any) -> None:
        frames = [bytes(memoryview(f)) for f in p.encode(msg, self.inline)]
        if self.minor < p.INLINE_MINOR:  # what a minor-11 build writes: its own minor, no protocol_minor
            major, _minor, kind, fields = msgpack.unpackb(frames[0])
            fields.pop("protocol_minor", None)
            frames[0] = msgpack.packb([major, self.minor, kind, fields], use_bin_type=True)
        self.sent.append(frames)
        await self.sock.send_multipart(frames)

    async def recv(self, kind: type[Any], timeout_s: float = 5.0) -> tuple[list[bytes], Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no {kind.__name__}; got {[type(m).__name__ for _f, m in self.received]}")
            if not await self.sock.poll(int(left * 1000), zmq.POLLIN):
                continue
            frames = await self.sock.recv_multipart()
            msg = p.decode(frames)
            self.received.append((frames, msg))
            if type(msg) is kind:
                return frames, msg

    async def worker_hello(self, capacity: int) -> p.Welcome:
        await self.send(p.Hello(worker_id=self.name, protocol_min=1, protocol_max=1, engine="raw", capacity=capacity, credits=capacity,
                                protocol_minor=p.PROTOCOL_MINOR))
        _f, welcome = await self.recv(p.Welcome)
        self.inline = p.inline_for(p.settle_minor(welcome.protocol_minor), welcome.max_header_bytes)
        return welcome  # type: ignore[no-any-return]

    async def client_hello(self) -> p.ClientWelcome:
        await self.send(p.ClientHello(client_id=self.name, protocol_min=1, protocol_max=1, protocol_minor=p.PROTOCOL_MINOR))
        _f, welcome = await self.recv(p.ClientWelcome)
        self.inline = p.inline_for(p.settle_minor(welcome.protocol_minor), welcome.max_header_bytes)
        return welcome  # type: ignore[no-any-return]

    async def serve_tasks(self, n: int) -> list[list[bytes]]:
        """Answer `n` tasks with a group each; returns the raw frames of the messages that carried them."""
        raw: list[list[bytes]] = []
        done = 0
        while done < n:
            frames, msg = await self.recv(p.Task)
            raw.append(frames)
            await self.send(p.Result(task_id=msg.task_id, prompt_id=msg.prompt.prompt_id, trajectories=make_group(msg, self.name, n_out=3),
                                     credits=1))
            done += 1
        return raw

    async def pull_all(self, n: int) -> tuple[list[list[bytes]], list[p.GroupResult]]:
        raw: list[list[bytes]] = []
        groups: list[p.GroupResult] = []
        ack: tuple[str, ...] = ()
        i = 0
        while len(groups) < n:
            i += 1
            await self.send(p.Pull(request_id=f"{self.name}-{i}", max_groups=64, wait_s=0.5, ack=ack))
            frames, batch = await self.recv(p.Batch)
            if batch.groups:
                raw.append(frames)
            groups += batch.groups
            ack = tuple(g.prompt_id for g in batch.groups)
        await self.send(p.Ack(prompt_ids=ack))
        return raw, groups


def _check_groups(groups: list[p.GroupResult], names: list[str]) -> None:
    assert sorted(g.prompt_id for g in groups) == sorted(names)
    for g in groups:
        (t,) = g.trajectories
        assert t.input_ids.tolist() == [0, 1, 2, 3] and t.output_ids.tolist() == [0, 0, 0] and t.loss_mask.tolist() == [1, 1, 1]
        assert not t.output_ids.flags.writeable


async def test_inline_arrays_flow_only_between_peers_that_settled_on_minor_12(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker(heartbeat_interval_s=5.0)
    old_w, new_w = RawPeer(h, "w11", minor=OLD, worker=True), RawPeer(h, "w12", minor=p.PROTOCOL_MINOR, worker=True)
    old_c, new_c = RawPeer(h, "c11", minor=OLD, worker=False), RawPeer(h, "c12", minor=p.PROTOCOL_MINOR, worker=False)
    try:
        # the hellos settle: a minor-11 peer is welcomed without a minor (it would ignore one) and gets frames only
        assert (await old_w.worker_hello(2)).protocol_minor == 0 and old_w.inline is None
        assert (await new_w.worker_hello(2)).protocol_minor == p.PROTOCOL_MINOR and new_w.inline is not None
        assert (await old_c.client_hello()).protocol_minor == 0 and old_c.inline is None
        assert (await new_c.client_hello()).protocol_minor == p.PROTOCOL_MINOR and new_c.inline is not None
        for rnd, puller in ((1, old_c), (2, new_c)):
            names = [f"r{rnd}-{i}" for i in range(4)]
            # each client submits two (the new one inline, the old one in frames); each worker (capacity 2) serves two
            for c, some in ((new_c, names[:2]), (old_c, names[2:])):
                await c.send(p.Submit(request_id=f"s{rnd}", prompts=tuple(make_prompt(n) for n in some)))
                _f, reply = await c.recv(p.SubmitReply)
                assert sorted(reply.accepted) == sorted(some)
            assert len(new_c.sent[-1]) == 1 and header_bins(msgpack.unpackb(new_c.sent[-1][0])) == 2  # both prompts inline
            assert len(old_c.sent[-1]) == 3 and header_bins(msgpack.unpackb(old_c.sent[-1][0])) == 0
            old_raw, new_raw = await asyncio.gather(old_w.serve_tasks(2), new_w.serve_tasks(2))
            for frames in old_raw:  # a minor-11 worker: the prompt in a frame
                assert len(frames) == 2 and header_bins(msgpack.unpackb(frames[0])) == 0
            for frames in new_raw:  # a minor-12 worker: in the header
                assert len(frames) == 1 and header_bins(msgpack.unpackb(frames[0])) == 1
            assert all(len(f) == 1 for f in new_w.sent[-2:]) and all(len(f) > 1 for f in old_w.sent[-2:])
            # whoever sent them and however they came, the minor-11 client gets frames, the minor-12 one the header
            raw, groups = await puller.pull_all(4)
            _check_groups(groups, names)
            for frames in raw:
                n_inline = header_bins(msgpack.unpackb(frames[0]))
                if puller is old_c:
                    assert n_inline == 0 and len(frames) > 1
                else:
                    assert n_inline > 0 and len(frames) == 1
        counters = h.broker.counters()
        assert counters["protocol_errors"] == 0
        assert counters["frames_in"] >= counters["messages_in"] and counters["frames_out"] >= 2 * counters["messages_out"]
    finally:
        for peer in (old_w, new_w, old_c, new_c):
            peer.close()


async def test_a_broker_with_inlining_off_sends_frames_to_a_minor_12_peer(start_broker) -> None:  # type: ignore[no-untyped-def]
    """`BrokerConfig.inline_max_bytes = 0`: the minor still settles at 12 (the peer may inline to the broker), but the
    broker's own messages carry every array in a frame."""
    h: Harness = await start_broker(heartbeat_interval_s=5.0, inline_max_bytes=0)
    w, c = RawPeer(h, "w12", minor=p.PROTOCOL_MINOR, worker=True), RawPeer(h, "c12", minor=p.PROTOCOL_MINOR, worker=False)
    try:
        assert (await w.worker_hello(1)).protocol_minor == p.PROTOCOL_MINOR
        await c.client_hello()
        await c.send(p.Submit(request_id="s", prompts=(make_prompt("a"),)))
        await c.recv(p.SubmitReply)
        (frames,) = await w.serve_tasks(1)
        assert len(frames) == 2 and header_bins(msgpack.unpackb(frames[0])) == 0
        raw, groups = await c.pull_all(1)
        _check_groups(groups, ["a"])
        assert all(header_bins(msgpack.unpackb(f[0])) == 0 for f in raw)
    finally:
        w.close()
        c.close()


def test_the_codec_sizes_inline_bytes_to_the_dtype() -> None:
    """An inline field is raw little-endian bytes, exactly as its frame would be."""
    ids = np.array([1, -2, 70_000], dtype=np.int32)
    (header,) = p.encode(make_prompt_submit(ids), p.Inline())
    assert msgpack.unpackb(header)[3]["prompts"][0]["input_ids"] == ids.astype("<i4").tobytes()


def make_prompt_submit(ids: np.ndarray[Any, Any]) -> p.Submit:
    return p.Submit(request_id="r", prompts=(p.Prompt(prompt_id="a", input_ids=ids),))


async def test_trajectories_received_inline_go_to_a_minor_12_client_as_they_came(start_broker) -> None:  # type: ignore[no-untyped-def]
    """A result whose arrays all travelled inline is sent on in its received maps (not decoded and encoded again):
    seen on the wire as a field this broker does not know, from a newer worker, reaching a minor-12 client; a
    minor-11 client gets the trajectories encoded again (frames, the unknown field gone), and a result whose arrays
    came in frames is encoded again for everyone."""
    h: Harness = await start_broker(heartbeat_interval_s=5.0)
    w, old_w = RawPeer(h, "w12", minor=p.PROTOCOL_MINOR, worker=True), RawPeer(h, "w11", minor=OLD, worker=True)
    new_c, old_c = RawPeer(h, "c12", minor=p.PROTOCOL_MINOR, worker=False), RawPeer(h, "c11", minor=OLD, worker=False)
    try:
        await w.worker_hello(1)
        await new_c.client_hello()
        await old_c.client_hello()
        for puller in (new_c, old_c):
            name = f"for-{puller.name}"
            await new_c.send(p.Submit(request_id=name, prompts=(make_prompt(name),)))
            await new_c.recv(p.SubmitReply)
            _f, task = await w.recv(p.Task)
            frames = p.encode(p.Result(task_id=task.task_id, prompt_id=name, trajectories=make_group(task, "w12", n_out=3), credits=1), w.inline)
            major, minor, kind, fields = msgpack.unpackb(frames[0])
            fields["trajectories"][0]["from_minor_13"] = "kept"
            await w.sock.send_multipart([msgpack.packb([major, minor, kind, fields], use_bin_type=True)])
            raw, groups = await puller.pull_all(1)
            _check_groups(groups, [name])
            (t,) = msgpack.unpackb(raw[0][0])[3]["groups"][0]["trajectories"]
            if puller is new_c:
                assert t["from_minor_13"] == "kept" and len(raw[0]) == 1 and type(t["output_ids"]) is bytes
            else:
                assert "from_minor_13" not in t and len(raw[0]) > 1 and type(t["output_ids"]) is int
        # arrays in frames (a minor-11 worker): encoded again, inline, for the minor-12 client
        await w.send(p.Goodbye(reason="done"))  # the next task can only go to the minor-11 worker
        await h.wait_for(lambda: "w12" not in h.broker.state.workers)
        await old_w.worker_hello(1)
        await new_c.send(p.Submit(request_id="s", prompts=(make_prompt("framed"),)))
        await new_c.recv(p.SubmitReply)
        await old_w.serve_tasks(1)
        raw, groups = await new_c.pull_all(1)
        _check_groups(groups, ["framed"])
        assert len(raw[0]) == 1 and header_bins(msgpack.unpackb(raw[0][0])) == 5
        assert h.broker.counters()["protocol_errors"] == 0
    finally:
        for peer in (w, old_w, new_c, old_c):
            peer.close()
