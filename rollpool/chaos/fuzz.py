"""Rogue-peer fuzzing of live sockets: random and mutated multipart messages, seeded.

`FrameFuzzer` makes inputs from a corpus of valid messages for the target
port: bit flips, truncations, extensions, random bytes, dropped, duplicated
and swapped frames, random msgpack headers, and wholly random frame lists.
`fuzz_socket` sends them from a few rogue DEALER identities as fast as the
socket takes them (replies are drained and counted, never awaited), and every
``probe_every`` inputs a well-behaved peer asks a real question and must get
a real answer: the service stays up and keeps serving while it is fuzzed.

With ``hostile=True`` the fuzzer also sends what a peer probing the limits
would: headers of a few MiB that expand into millions of small values (the
4 MiB empty-map bomb), valid messages carrying hundreds of unknown fields, and
long-polls held open (a pull flood from one identity).

`fuzz_broker_process` runs all of it against a broker in its own process (so
its memory is its own: the peak, VmHWM, is reported) while a well-behaved
worker heartbeats throughout (it must never be declared dead) and a
well-behaved client is answered every ``probe_every`` inputs.

The decode function alone is fuzzed by ``tests/unit/protocol/test_codec.py``
(10,000 mutated and 10,000 hypothesis inputs); this module is about the
services around it. Long mode:
``ROLLPOOL_FUZZ_INPUTS=1000000 pytest tests/integration/chaos/test_fuzz_live.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from rollpool.protocol import (
    Ack,
    Credit,
    Fetch,
    Hello,
    ManifestRequest,
    Prompt,
    Pull,
    Result,
    SamplingParams,
    SetVersion,
    StatusRequest,
    Submit,
    WorkerHeartbeat,
    encode,
)

__all__ = ["FrameFuzzer", "FuzzReport", "fuzz_socket", "corpus_for", "header_bomb", "fuzz_broker_process"]


def header_bomb(type_name: str = "credit", nbytes: int = 4 * 1024 * 1024 - 64) -> bytes:
    """A valid header whose unknown field holds ~`nbytes` empty maps (each 1 byte on the wire, ~64 in memory)."""
    inner: list[dict[str, Any]] = [{}] * 65_536
    lists = max(1, nbytes // (65_536 + 3))
    return bytes(msgpack.packb([1, 0, type_name, {"zz_unknown": [inner] * lists}], use_bin_type=True))


def corpus_for(port: str) -> list[list[bytes]]:
    """Valid messages a peer of `port` (``worker``, ``client``, ``weights``) would send."""
    prompt = Prompt(prompt_id="fz", input_ids=np.arange(8, dtype=np.int32), group_size=2, sampling=SamplingParams(max_new_tokens=4))
    msgs: list[Any]
    if port == "worker":
        msgs = [
            Hello(worker_id="rogue", protocol_min=1, protocol_max=1, engine="sim", capacity=4, credits=4),
            Credit(credits=3),
            WorkerHeartbeat(worker_id="rogue"),
            Result(task_id="fz@1", prompt_id="fz"),
        ]
    elif port == "client":
        msgs = [
            Submit(request_id="r1", prompts=(prompt,)),
            Pull(request_id="r2", max_groups=4, wait_s=0.0),
            StatusRequest(request_id="r3"),
            Ack(prompt_ids=("fz",)),
            SetVersion(request_id="r4", version=0),
        ]
    elif port == "weights":
        msgs = [ManifestRequest(request_id="m1"), Fetch(request_id="f1", version=0, bucket=0, offset=0, nbytes=1024)]
    else:
        raise ValueError(f"unknown port kind {port!r}")
    return [[bytes(f) for f in encode(m)] for m in msgs]


class FrameFuzzer:
    def __init__(self, corpus: list[list[bytes]], seed: int = 0, *, hostile: bool = False) -> None:
        self.corpus = corpus
        self.rng = random.Random(seed)
        self.hostile = hostile
        self.hostile_sent: dict[str, int] = {"bomb": 0, "unknown_fields": 0, "long_pull": 0}
        self._bomb = header_bomb() if hostile else b""

    def _hostile(self) -> list[bytes] | None:
        r = self.rng
        x = r.random()
        if x < 0.005:
            self.hostile_sent["bomb"] += 1
            return [self._bomb]
        if x < 0.025:
            self.hostile_sent["unknown_fields"] += 1
            good = r.choice(self.corpus)
            header = msgpack.unpackb(good[0], raw=False)
            header[3] = {**header[3], **{f"x{i}": i for i in range(r.randrange(17, 600))}}
            return [msgpack.packb(header, use_bin_type=True), *good[1:]]
        if x < 0.075 and any(msgpack.unpackb(f[0], raw=False)[2] == "pull" for f in self.corpus):
            self.hostile_sent["long_pull"] += 1
            return [bytes(f) for f in encode(Pull(request_id=f"lp{r.randrange(1 << 30)}", max_groups=1, wait_s=60.0))]
        return None

    def _random_value(self, depth: int = 0) -> Any:
        r = self.rng
        kind = r.randrange(8 if depth < 2 else 6)
        if kind == 0:
            return r.randrange(-(2**63), 2**64)
        if kind == 1:
            return r.random() * 10 ** r.randrange(-5, 40)
        if kind == 2:
            return "".join(chr(r.randrange(32, 0x2FF)) for _ in range(r.randrange(20)))
        if kind == 3:
            return r.randbytes(r.randrange(32))
        if kind == 4:
            return None
        if kind == 5:
            return r.choice((True, False))
        if kind == 6:
            return [self._random_value(depth + 1) for _ in range(r.randrange(4))]
        return {str(self._random_value(depth + 1))[:8]: self._random_value(depth + 1) for _ in range(r.randrange(4))}

    def next(self) -> list[bytes]:  # noqa: C901 - grandfathered: one branch per mutation kind
        r = self.rng
        if self.hostile:
            frames = self._hostile()
            if frames is not None:
                return frames
        good = [bytearray(f) for f in r.choice(self.corpus)]
        op = r.randrange(10)
        if op == 0:  # bit flips in one frame
            f = r.choice(good)
            for _ in range(r.randrange(1, 8)):
                if f:
                    f[r.randrange(len(f))] ^= 1 << r.randrange(8)
        elif op == 1:  # truncate a frame
            f = r.choice(good)
            del f[r.randrange(len(f) + 1):]
        elif op == 2:  # extend a frame with junk
            r.choice(good).extend(r.randbytes(r.randrange(1, 64)))
        elif op == 3:  # drop a frame
            if len(good) > 1:
                del good[r.randrange(len(good))]
            else:
                good = [bytearray()]
        elif op == 4:  # duplicate or add frames
            good.append(bytearray(r.randbytes(r.randrange(64))) if r.random() < 0.5 else bytearray(r.choice(good)))
        elif op == 5:  # swap frames
            r.shuffle(good)
        elif op == 6:  # a header field replaced with a random msgpack value
            try:
                decoded = msgpack.unpackb(bytes(good[0]), raw=False, strict_map_key=False)
                fields = decoded[3] if isinstance(decoded, list) and len(decoded) == 4 else None
                if isinstance(fields, dict) and fields:  # the wire header is [major, minor, type, fields]
                    fields[r.choice(list(fields))] = self._random_value()
                elif isinstance(decoded, list) and decoded:
                    decoded[r.randrange(len(decoded))] = self._random_value()
                good[0] = bytearray(msgpack.packb(decoded, use_bin_type=True))
            except Exception:  # noqa: BLE001 - a mutation msgpack cannot re-pack becomes random bytes
                good[0] = bytearray(r.randbytes(16))
        elif op == 7:  # a random msgpack header (maybe with a plausible type)
            header: Any = self._random_value()
            if r.random() < 0.5:
                header = [1, r.randrange(3), r.choice(("hello", "submit", "pull", "fetch", "result", "credit", "zzz")), header]
            good = [bytearray(msgpack.packb(header, use_bin_type=True))]
        elif op == 8:  # wholly random frames
            good = [bytearray(r.randbytes(r.randrange(256))) for _ in range(r.randrange(1, 5))]
        else:  # a byte-wise overwrite of the header
            f = good[0]
            for _ in range(r.randrange(1, 4)):
                if f:
                    f[r.randrange(len(f))] = r.randrange(256)
        return [bytes(f) for f in good]


@dataclass
class FuzzReport:
    target: str
    inputs: int = 0
    replies: int = 0
    probes: int = 0
    probes_ok: int = 0
    send_again: int = 0
    elapsed_s: float = 0.0
    probe_failures: list[str] = field(default_factory=list)
    hostile: dict[str, int] = field(default_factory=dict)


async def fuzz_socket(
    sockets: Any,
    endpoint: str,
    target: str,
    inputs: int,
    probe: Callable[[], Awaitable[bool]],
    *,
    seed: int = 0,
    probe_every: int = 1000,
    rogues: int = 4,
    hostile: bool = False,
) -> FuzzReport:
    """Send `inputs` fuzzed messages to `endpoint` from `rogues` DEALER identities; run `probe` along the way."""
    import zmq

    port = "weights" if target in ("publisher", "relay") else target.split(":")[-1]
    fuzzer = FrameFuzzer(corpus_for(port), seed, hostile=hostile)
    socks = [sockets.dealer(endpoint, identity=f"rogue-{seed}-{i}".encode()) for i in range(rogues)]
    report = FuzzReport(target=target)
    t0 = time.monotonic()

    def drain() -> None:
        for s in socks:
            while True:
                try:
                    s.recv_multipart(flags=zmq.NOBLOCK).result()
                    report.replies += 1
                except zmq.Again:
                    break
                except Exception:  # noqa: BLE001 - an asyncio future that is not ready yet: nothing to read
                    break

    try:
        for n in range(inputs):
            frames = fuzzer.next()
            s = socks[n % rogues]
            for _attempt in range(100):
                try:
                    await s.send_multipart(frames, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    report.send_again += 1
                    drain()
                    await asyncio.sleep(0.001)
            report.inputs += 1
            if n % 64 == 63:
                drain()
                await asyncio.sleep(0)  # let the service (on this loop, in tests) read
            if n % probe_every == probe_every - 1 or n == inputs - 1:
                report.probes += 1
                try:
                    ok = await asyncio.wait_for(probe(), 10)
                except Exception as exc:  # noqa: BLE001 - a probe that fails is the finding
                    ok = False
                    report.probe_failures.append(f"input {n}: {exc!r}")
                report.probes_ok += bool(ok)
        drain()
    finally:
        for s in socks:
            s.close(linger=0)
    report.elapsed_s = round(time.monotonic() - t0, 3)
    report.hostile = dict(fuzzer.hostile_sent)
    return report


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_kib(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _start_broker(wdir: str, worker_ep: str, client_ep: str, heartbeat_interval_s: float) -> subprocess.Popen[bytes]:
    with open(os.path.join(wdir, "broker.log"), "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "rollpool.broker", "--worker-endpoint", worker_ep, "--client-endpoint", client_ep,
             "--heartbeat-interval-s", str(heartbeat_interval_s), "--log-level", "WARNING"],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )


async def fuzz_broker_process(  # noqa: C901 - grandfathered: a driver: start, fuzz, probe, measure, report
    inputs: int, *, seed: int = 0, probe_every: int = 250, workdir: str | None = None, heartbeat_interval_s: float = 0.5
) -> dict[str, Any]:
    """Fuzz a broker process's two ports (hostile inputs included) while good peers are served; report its peak memory.

    Returns a JSON-able dict: inputs per port, probes answered, the good
    worker's heartbeats and whether it was ever declared dead, the broker's
    refusal counters, and its VmRSS at start and VmHWM (peak) at the end.
    """
    import tempfile

    import zmq.asyncio

    from rollpool.protocol import ClientHello, SocketFactory, StatusReply, Welcome, decode

    wdir = workdir or tempfile.mkdtemp(prefix="rollpool-fuzz-")
    bw, bc = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    proc = _start_broker(wdir, bw, bc, heartbeat_interval_s)
    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    client = sockets.dealer(bc, identity=b"good-client")
    worker = sockets.dealer(bw, identity=b"good-worker")
    out: dict[str, Any] = {"inputs": inputs, "seed": seed, "heartbeat_interval_s": heartbeat_interval_s}
    stop = asyncio.Event()
    beats = {"sent": 0, "welcomes": 0}

    async def ask_status() -> StatusReply:
        await client.send_multipart(encode(StatusRequest(request_id=f"s{time.monotonic_ns()}")))
        while True:
            reply = decode(await asyncio.wait_for(client.recv_multipart(), 5))
            if isinstance(reply, StatusReply):
                return reply

    async def heartbeat_loop() -> None:
        hello = Hello(worker_id="good-worker", protocol_min=1, protocol_max=1, engine="sim", capacity=1, credits=0)
        await worker.send_multipart(encode(hello))
        while not stop.is_set():
            await worker.send_multipart(encode(WorkerHeartbeat(worker_id="good-worker")))
            beats["sent"] += 1
            while await worker.poll(0):
                if isinstance(decode(await worker.recv_multipart()), Welcome):
                    beats["welcomes"] += 1
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except TimeoutError:
                pass

    beat_task: asyncio.Task[None] | None = None
    try:
        for _ in range(200):  # the broker process binds its ports
            await client.send_multipart(encode(ClientHello(client_id="good", protocol_min=1, protocol_max=1)))
            if await client.poll(100):
                await client.recv_multipart()
                break
        else:
            raise RuntimeError(f"the broker did not start (log in {wdir})")
        out["rss_start_kib"] = _rss_kib(proc.pid, "VmRSS")
        beat_task = asyncio.create_task(heartbeat_loop(), name="fuzz.heartbeat_loop")

        async def probe() -> bool:
            return isinstance(await ask_status(), StatusReply)

        reports = []
        for i, (name, ep) in enumerate((("broker:client", bc), ("broker:worker", bw))):
            share = inputs // 2 + (inputs % 2 if i == 0 else 0)
            reports.append(await fuzz_socket(sockets, ep, name, share, probe, seed=seed + i, probe_every=probe_every, hostile=True))
        stop.set()
        await beat_task
        status = await ask_status()
        c = status.counters
        out.update(
            reports={r.target: {"inputs": r.inputs, "replies": r.replies, "probes": f"{r.probes_ok}/{r.probes}",
                                "hostile": r.hostile, "elapsed_s": r.elapsed_s, "probe_failures": r.probe_failures[:3]}
                     for r in reports},
            total_inputs=sum(r.inputs for r in reports),
            probes_ok=sum(r.probes_ok for r in reports),
            probes=sum(r.probes for r in reports),
            heartbeats_sent=beats["sent"],
            good_worker_alive="good-worker" in status.workers,
            workers_lost=c.get("workers_lost"),
            protocol_errors=c.get("protocol_errors"),
            refusals={k: v for k, v in c.items() if k.startswith(("refused.", "disconnects.", "handshake_"))},
            broker_alive=proc.poll() is None,
            rss_end_kib=_rss_kib(proc.pid, "VmRSS"),
            rss_peak_kib=_rss_kib(proc.pid, "VmHWM"),
        )
        return out
    finally:
        stop.set()
        if beat_task is not None and not beat_task.done():
            beat_task.cancel()
        client.close(linger=0)
        worker.close(linger=0)
        ctx.destroy(linger=0)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
