"""Rogue-peer fuzzing of live sockets: random and mutated multipart messages, seeded.

`FrameFuzzer` makes inputs from a corpus of valid messages for the target
port: bit flips, truncations, extensions, random bytes, dropped, duplicated
and swapped frames, random msgpack headers, and wholly random frame lists.
`fuzz_socket` sends them from a few rogue DEALER identities as fast as the
socket takes them (replies are drained and counted, never awaited), and every
``probe_every`` inputs a well-behaved peer asks a real question and must get
a real answer: the service stays up and keeps serving while it is fuzzed.

The decode function alone is fuzzed by ``tests/unit/protocol/test_codec.py``
(10,000 mutated and 10,000 hypothesis inputs); this module is about the
services around it. Long mode:
``ROLLPOOL_FUZZ_INPUTS=1000000 pytest tests/integration/chaos/test_fuzz_live.py``.
"""

from __future__ import annotations

import asyncio
import random
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

__all__ = ["FrameFuzzer", "FuzzReport", "fuzz_socket", "corpus_for"]


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
    def __init__(self, corpus: list[list[bytes]], seed: int = 0) -> None:
        self.corpus = corpus
        self.rng = random.Random(seed)

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

    def next(self) -> list[bytes]:
        r = self.rng
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
                header = msgpack.unpackb(bytes(good[0]), raw=False, strict_map_key=False)
                if isinstance(header, dict) and header:
                    key = r.choice(list(header))
                    header[key] = self._random_value()
                good[0] = bytearray(msgpack.packb(header, use_bin_type=True))
            except Exception:
                good[0] = bytearray(r.randbytes(16))
        elif op == 7:  # a random msgpack header (maybe with a plausible type)
            header: Any = self._random_value()
            if r.random() < 0.5:
                header = {"v": [1, 0], "t": r.choice(("hello", "submit", "pull", "fetch", "result", "credit", "zzz")), "f": header}
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
) -> FuzzReport:
    """Send `inputs` fuzzed messages to `endpoint` from `rogues` DEALER identities; run `probe` along the way."""
    import zmq

    port = "weights" if target in ("publisher", "relay") else target.split(":")[-1]
    fuzzer = FrameFuzzer(corpus_for(port), seed)
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
                except Exception:  # an asyncio future that is not ready yet: nothing to read
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
                except Exception as exc:  # a probe that fails is the finding
                    ok = False
                    report.probe_failures.append(f"input {n}: {exc!r}")
                report.probes_ok += bool(ok)
        drain()
    finally:
        for s in socks:
            s.close(linger=0)
    report.elapsed_s = round(time.monotonic() - t0, 3)
    return report
