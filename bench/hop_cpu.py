"""The worker's CPU per call on the hop to the sglang engine's child: its `HopClient` beside a zmq.asyncio DEALER.

SIMULATED: one child of the sglang engine serving the sim engine (``--backend sim``, 1 us a token, ``--tokens`` a
sample), started as the engine starts it (its command line, a per-launch token, an ``ipc://`` hop). In this process
two clients take turns on the same child, rep by rep: ``hop`` (`rollpool.workers.engines.sglang.hop.HopClient`, the
DEALER driven from the event loop) and ``zmq_asyncio`` (the same frames through a ``zmq.asyncio`` DEALER awaiting a
future per send and per receive: what the worker's end of the hop was before). Each round sends ``--concurrency``
``/generate`` calls at once (a ``--prompt-tokens`` prompt each, as an episode's turn does); the CPU is this process's
user+system time over the round (the child's is its own), per call.

    python bench/hop_cpu.py --json bench/results/cpu-hop-simulated.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class ZmqAsyncioClient:
    """The reference: the hop's frames through a zmq.asyncio DEALER (a reader task; a future per send and receive)."""

    def __init__(self, endpoint: str, token: str) -> None:
        import zmq.asyncio

        from rollpool.protocol.sockets import SocketFactory

        self._token = token.encode()
        self._context = zmq.asyncio.Context()
        self._sock = SocketFactory(self._context).dealer(endpoint, max_msg_bytes=1 << 30)
        self._ids = itertools.count(1)
        self._pending: dict[bytes, asyncio.Future[tuple[int, bytes]]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            fut = self._pending.pop(frames[0], None)
            if fut is not None and not fut.done():
                fut.set_result((int(frames[1]), frames[2]))

    async def request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        from rollpool.workers.engines.sglang.hop import _pack_ids
        from rollpool.workers.engines.sglang.http import HttpError, dumps, loads

        body = dict(body or {})
        ids = body.pop("input_ids", None)
        rid = struct.pack("<Q", next(self._ids))
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._sock.send_multipart([self._token, rid, path.encode(), dumps(body),
                                             b"" if ids is None else _pack_ids(ids)], copy=False)
            async with asyncio.timeout(timeout_s):
                status, payload = await fut
        finally:
            self._pending.pop(rid, None)
        if status >= 300:
            raise HttpError(status, payload)
        return loads(payload) if payload else None

    async def close(self) -> None:
        self._reader.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass
        self._sock.close(linger=0)
        self._context.term()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_child(model: Path, work: Path, tokens: int) -> tuple[subprocess.Popen[bytes], str, str]:
    from rollpool.workers.engines.sglang.engine import SGLangEngine
    from rollpool.workers.engines.sglang.http import TOKEN_ENV

    port = _port()
    args = {"decode_s_per_token": 1e-6, "length": "fixed", "length_median": tokens}
    eng = SGLangEngine(model=str(model), port=port, capacity=1024, backend="sim", server_args=json.dumps(args))
    token, hop = secrets.token_urlsafe(16), f"ipc://{work}/hop"
    log = (work / "child.log").open("ab")
    proc = subprocess.Popen(eng.command(hop=hop), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, TOKEN_ENV: token})
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the sim child exited {proc.returncode}: {(work / 'child.log').read_text()[-2000:]}")
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/health_generate", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=5):
                return proc, hop, token
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


async def _round(client: Any, args: argparse.Namespace, tag: str) -> tuple[float, int]:
    import numpy as np

    ids = np.arange(7, 7 + args.prompt_tokens, dtype=np.int32) % 300 + 7  # int32, as the sglang engine hands them over

    async def call(i: int) -> None:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": args.tokens, "temperature": 1.0},
                "return_logprob": True, "rid": f"{tag}-{i}"}
        out = await client.request("POST", "/generate", body, timeout_s=120)
        assert len(out["output_ids"]) == args.tokens

    t0 = time.process_time()
    for r in range(args.rounds):
        await asyncio.gather(*(call(r * args.concurrency + i) for i in range(args.concurrency)))
    return time.process_time() - t0, args.rounds * args.concurrency


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollpool.workers.engines.sglang.hop import HopClient
    from rollpool.workers.engines.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="rp-hop-"))
    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        build_tiny_model(model)
    proc, hop, token = _start_child(model, work, args.tokens)
    rows: list[dict[str, Any]] = []
    try:
        clients = {"hop": HopClient(hop, token=token), "zmq_asyncio": ZmqAsyncioClient(hop, token)}
        for c in clients.values():  # warm: both connected, the child's code paths loaded
            await _round(c, argparse.Namespace(**{**vars(args), "rounds": 1}), "warm")
        for rep in range(args.reps):
            for name in (list(clients) if rep % 2 == 0 else list(reversed(clients))):
                cpu_s, calls = await _round(clients[name], args, f"{name}-{rep}")
                rows.append({"client": name, "rep": rep, "calls": calls, "cpu_us_per_call": round(cpu_s / calls * 1e6, 1)})
                print(json.dumps(rows[-1]), flush=True)
        for c in clients.values():
            await c.close()
    finally:
        proc.terminate()
        proc.wait(20)
    med = {n: statistics.median(r["cpu_us_per_call"] for r in rows if r["client"] == n) for n in ("hop", "zmq_asyncio")}
    paired = [round(a["cpu_us_per_call"] / b["cpu_us_per_call"], 3) for a in rows if a["client"] == "hop"
              for b in rows if b["client"] == "zmq_asyncio" and b["rep"] == a["rep"]]
    return {"what": "bench/hop_cpu.py", "simulated": True, "params": {k: v for k, v in vars(args).items() if k != "json"},
            "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end", "rows": rows,
            "summary": {"cpu_us_per_call_median": med, "hop_vs_zmq_asyncio": round(med["hop"] / med["zmq_asyncio"], 3),
                        "per_rep_ratio": paired}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model-dir", default="/tmp/rp-episodes-tiny")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
