"""Broker benchmark: what the broker costs, measured by the broker, beside Redis Streams and a trivial broker.

NEW METHOD (what the broker itself costs, not its load generators; `p99_ms` and `broker_cpu_us_per_rt` of the JSON
come from it)

* Load from separate processes: zero-latency simulated workers hosted many per process
  (`--hosts`, one DEALER each, epoll on their FDs) and open-loop clients (`--clients`) that
  submit at a fixed offered rate whatever the broker does (one prompt per Submit, the worst case
  for the broker), each prompt stamped with its scheduled submit time.
* Latency from the broker's own timestamps (`rollpool.broker.latency`): queued (Submit read),
  dispatched (Task sent), result in, delivered (Batch sent); p50/p99 of delivered - queued, and
  the stages. The clients' submit-to-batch latency is reported beside it (it also sees time spent
  in ZeroMQ queues before the broker reads, and the generators' own lateness).
* Saturation first (closed loop, 256 prompts in flight, median of `--sat-reps`), then open loop at
  25, 50 and 90% of that rate; the headline is 50% with 16 workers.
* CPU of the broker process alone (/proc utime + stime over the measured window, split into its
  main thread and the rest, i.e. ZeroMQ's I/O thread) per delivered round trip.
* Heartbeats alone at 1,000 and 10,000 workers, each holding `--hold` tasks: the broker's CPU per
  heartbeat with the minor-0 shape (the whole in-flight list every beat) and the minor-1 shape
  (count + digest), and false dead-worker detections (heartbeat 1 s, dead after 3 missed).
* Every run records how busy the whole machine was over its window (/proc/stat) and how much of
  that was this run's own processes: on a shared machine the difference is other people's work.

OLD METHOD (kept for `ratio` and `vs_trivial`, comparable with earlier rounds)

One load generator process runs scripted zero-latency workers and one client against each
system in turn, on loopback, closed loop (`max(64, workers)` prompts in flight):

* ``rollpool``: the real `rollpool.broker.Broker` in a child process. The client
  submits one prompt per `Submit`, long-polls `Pull` with the previous batch's
  acks piggybacked; workers answer each `Task` with a `Result` and a `Credit` (minor-0 shapes).
* ``redis``: the same dispatch-and-acknowledge job with Redis Streams consumer
  groups against a real redis-server: the client XADDs one entry per prompt to a
  task stream; each of the N consumers XREADGROUPs (BLOCK), XADDs the result
  to a result stream and XACKs the task; the client XREADGROUPs results and XACKs them.
* ``trivial``: a deque of tasks and a deque of credits on two asyncio ROUTER
  sockets, the same messages and codec, no leases, no acks, no bookkeeping.

Reported per system and worker count: round trips per second, p50/p99 seen by the client, and
the broker process's CPU per round trip; runs interleaved, medians of ``--reps``.

A/B: ``--base DIR`` adds ``rollpool@base``, the broker of another checkout (DIR holds its
``rollpool/``), to both methods, with the same load generators.

    python bench/broker.py [--quick] [--base DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if os.environ.get("ROLLPOOL_BENCH_BASE"):  # A/B: the broker child runs another checkout's rollpool
    sys.path.insert(0, os.environ["ROLLPOOL_BENCH_BASE"])

from rollpool import protocol as p  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_user_system_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def proc_threads_cpu_s(pid: int) -> tuple[float, float]:
    """(main thread, every other thread) CPU seconds of a process: the broker's Python loop vs ZeroMQ's I/O thread."""
    main = other = 0.0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
        if int(task) == pid:
            main += cpu
        else:
            other += cpu
    return main, other


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- servers (child processes)


def serve_rollpool(wep: str, cep: str, heartbeat_s: float, latency_out: str | None = None) -> None:
    """The real broker; on SIGTERM it writes its broker-side timestamps (queued, dispatched, result in, delivered) to `latency_out`."""
    import dataclasses

    import zmq.asyncio

    from rollpool.broker import Broker, BrokerConfig
    from rollpool.broker import service as broker_service

    if hasattr(broker_service, "tune_gc"):  # as `rollpool broker` runs it (absent in a checkout before it)
        broker_service.tune_gc()

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        ctx.set(zmq.MAX_SOCKETS, 65536)  # a context option (`setsockopt` would set a default socket option)
        cfg = BrokerConfig(worker_endpoint=wep, client_endpoint=cep, heartbeat_interval_s=heartbeat_s, drain_timeout_s=0.0)
        if "latency_samples" in {f.name for f in dataclasses.fields(cfg)}:
            cfg = dataclasses.replace(cfg, latency_samples=1 << 20)
        # ROLLPOOL_BENCH_COALESCE_S: the broker's coalesce_s for an experiment (default: the config's)
        if os.environ.get("ROLLPOOL_BENCH_COALESCE_S") and "coalesce_s" in {f.name for f in dataclasses.fields(cfg)}:
            cfg = dataclasses.replace(cfg, coalesce_s=float(os.environ["ROLLPOOL_BENCH_COALESCE_S"]))
        broker = Broker(cfg, p.SocketFactory(ctx, p.SocketOptions(send_hwm=100_000, recv_hwm=100_000)))
        import signal

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, broker.stop)
        # ROLLPOOL_BENCH_LOOPSTATS=1: count the event loop's selector calls (its wake-ups), for the per-round-trip breakdown
        loopstats: dict[str, int] = {}
        if os.environ.get("ROLLPOOL_BENCH_LOOPSTATS") and hasattr(loop, "_selector"):
            loopstats.update(selects=0, selects_with_events=0, events=0)
            sel = loop._selector
            orig = sel.select

            def counting_select(timeout: float | None = None) -> Any:
                ready = orig(timeout)
                loopstats["selects"] += 1
                if ready:
                    loopstats["selects_with_events"] += 1
                    loopstats["events"] += len(ready)
                return ready

            sel.select = counting_select
        await broker.run()
        loop_out.update(loopstats)
        latency = getattr(broker.state, "latency", None)  # absent in a checkout before broker-side timestamps
        if latency_out and latency is not None:
            np.save(latency_out, latency.rows())
        ctx.destroy(linger=0)

    loop_out: dict[str, int] = {}
    asyncio.run(main())
    if latency_out and loop_out:
        Path(latency_out + ".loop.json").write_text(json.dumps(loop_out))


def serve_trivial(wep: str, cep: str) -> None:
    """The reference: a deque of tasks, a deque of credits, no leases or acks."""
    import signal

    import zmq.asyncio

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        f = p.SocketFactory(ctx, p.SocketOptions(send_hwm=100_000, recv_hwm=100_000))
        ws, cs = f.router(wep), f.router(cep)
        tasks: deque[p.Prompt] = deque()
        metadata: dict[str, dict[str, Any]] = {}  # echoed on the group, as the real broker does (the load generator times by it)
        credits: deque[bytes] = deque()
        results: deque[p.GroupResult] = deque()
        pulls: deque[tuple[bytes, str]] = deque()
        inline: dict[bytes, p.Inline | None] = {}  # per peer identity, settled from its hello (as the real broker)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        seq = 0

        async def dispatch() -> None:
            nonlocal seq
            while tasks and credits:
                prompt = tasks.popleft()
                seq += 1
                ident = credits.popleft()
                await ws.send_multipart([ident, *p.encode(p.Task(task_id=f"{prompt.prompt_id}@0", prompt=prompt), inline.get(ident))])

        async def answer() -> None:
            while pulls and results:
                ident, rid = pulls.popleft()
                groups = tuple(results.popleft() for _ in range(len(results)))
                await cs.send_multipart([ident, *p.encode(p.Batch(request_id=rid, epoch="x", groups=groups), inline.get(ident))])

        async def worker_loop() -> None:
            while True:
                ident, *frames = await ws.recv_multipart()
                m = p.decode(frames)
                if type(m) is p.Credit:
                    credits.extend([ident] * m.credits)
                    await dispatch()
                elif type(m) is p.Result:
                    results.append(p.GroupResult(prompt_id=m.prompt_id, state="done", trajectories=m.trajectories,
                                                 metadata=metadata.pop(m.prompt_id, {})))
                    await answer()
                elif type(m) is p.Hello:
                    credits.extend([ident] * m.credits)
                    minor = _settle(m)
                    inline[ident] = p.inline_for(minor, m.max_header_bytes)
                    await ws.send_multipart([ident, *p.encode(p.Welcome(epoch="x", protocol=1, heartbeat_interval_s=1.0, protocol_minor=minor))])
                    await dispatch()

        async def client_loop() -> None:
            while True:
                ident, *frames = await cs.recv_multipart()
                m = p.decode(frames)
                if type(m) is p.Submit:
                    tasks.extend(m.prompts)
                    for pr in m.prompts:
                        metadata[pr.prompt_id] = pr.metadata
                    await cs.send_multipart([ident, *p.encode(p.SubmitReply(request_id=m.request_id, epoch="x", accepted=tuple(x.prompt_id for x in m.prompts)))])
                    await dispatch()
                elif type(m) is p.Pull:
                    pulls.append((ident, m.request_id))
                    await answer()
                elif type(m) is p.ClientHello:
                    minor = _settle(m)
                    inline[ident] = p.inline_for(minor, m.max_header_bytes)
                    await cs.send_multipart([ident, *p.encode(p.ClientWelcome(epoch="x", protocol=1, protocol_minor=minor))])

        loops = [asyncio.create_task(worker_loop()), asyncio.create_task(client_loop())]
        await stop.wait()
        for t in loops:
            t.cancel()
        ws.close(linger=0)
        cs.close(linger=0)
        ctx.destroy(linger=0)

    asyncio.run(main())


def _settle(hello: Any) -> int:
    """The minor settled with a peer from its hello (0 from a checkout whose protocol has no minor in the hello)."""
    settle = getattr(p, "settle_minor", None)
    return settle(getattr(hello, "protocol_minor", 0)) if settle is not None else 0


def _inline_from(welcome: Any) -> Any:
    """The inline policy a peer's welcome settles (None: frames only, from a broker of minor 11 or older)."""
    inline_for = getattr(p, "inline_for", None)
    if inline_for is None:
        return None
    return inline_for(p.settle_minor(getattr(welcome, "protocol_minor", 0)), welcome.max_header_bytes)


def _encode(msg: Any, inline: Any = None) -> list[Any]:
    """`p.encode` with the peer's inline policy (a checkout without one: frames only)."""
    return p.encode(msg, inline) if inline is not None else p.encode(msg)


MINOR = {"protocol_minor": p.PROTOCOL_MINOR} if "protocol_minor" in {f.name for f in __import__("dataclasses").fields(p.Hello)} else {}
"""What a hello of this checkout says of its minor (the load generators are peers like any other)."""


def start_server(
    kind: str, heartbeat_s: float = 1.0, latency_out: str | None = None, base: str | None = None
) -> tuple[subprocess.Popen[bytes], str, str]:
    wep, cep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    extra = ["--latency-out", latency_out] if latency_out else []
    env = _child_env()
    if base:
        env["ROLLPOOL_BENCH_BASE"] = base
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--worker-endpoint", wep, "--client-endpoint", cep, "--heartbeat-s", str(heartbeat_s), *extra],
        env=env,
    )
    return proc, wep, cep


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- zmq load generator (rollpool and trivial)


def make_prompt(i: int) -> p.Prompt:
    return p.Prompt(prompt_id=f"q{i}", input_ids=np.arange(8, dtype=np.int32), group_size=1)


def zero_latency_result(task: p.Task, worker_id: str) -> p.Result:
    pr = task.prompt
    traj = p.Trajectory(
        prompt_id=pr.prompt_id,
        sample_index=0,
        input_ids=pr.input_ids if pr.input_ids is not None else np.zeros(0, np.int32),
        output_ids=np.arange(4, dtype=np.int32),
        output_logprobs=np.zeros(4, dtype=np.float32),
        token_versions=np.zeros(4, dtype=np.int32),
        loss_mask=np.ones(4, dtype=np.uint8),
        finish_reason="stop",
        worker_id=worker_id,
    )
    return p.Result(task_id=task.task_id, prompt_id=pr.prompt_id, trajectories=(traj,))


def run_zmq_load(
    wep: str,
    cep: str,
    n_workers: int,
    seconds: float,
    window: int,
    *,
    heartbeat_s: float = 0.0,
    rate_per_s: float = 0.0,
    status_at_end: bool = False,
) -> dict[str, Any]:
    """Drive a broker: returns round trips/s, latencies (s) and, optionally, the broker's status counters."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 8192)  # a context option (`setsockopt` would set a default socket option)
    f = p.SocketFactory(ctx, p.SocketOptions(send_hwm=100_000, recv_hwm=100_000))
    capacity = max(1, -(-window // n_workers))
    workers = []
    poller = zmq.Poller()
    for i in range(n_workers):
        s = f.dealer(wep, identity=f"bw{i}".encode())
        s.send_multipart(p.encode(p.Hello(worker_id=f"bw{i}", protocol_min=1, protocol_max=1, engine="zero", capacity=capacity, credits=capacity,
                                          **MINOR)))
        workers.append(s)
        poller.register(s, zmq.POLLIN)
    client = f.dealer(cep, identity=b"bench-client")
    poller.register(client, zmq.POLLIN)
    client.send_multipart(p.encode(p.ClientHello(client_id="bench", protocol_min=1, protocol_max=1, **MINOR)))
    inline: dict[Any, Any] = {}  # per socket: the policy its welcome settled
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    done = 0
    seq = 0
    pulls_out = 0
    to_ack: list[str] = []
    credit_frames = p.encode(p.Credit(credits=1))
    hb_next = [time.perf_counter() + (i / max(1, n_workers)) * heartbeat_s for i in range(n_workers)] if heartbeat_s else []
    t_start = time.perf_counter()
    t_measure = t_start + min(0.5, seconds / 4)
    t_end = t_measure + seconds
    done_at_measure = 0
    measuring = False
    next_submit = t_start
    rid = 0
    while True:
        now = time.perf_counter()
        if not measuring and now >= t_measure:
            measuring = True
            done_at_measure = done
            t_measure = now
        if now >= t_end:
            break
        # client: keep `window` prompts in flight (or follow the open-loop rate), and a pull waiting
        while len(sent_at) < window and (not rate_per_s or next_submit <= now):
            seq += 1
            pid = f"q{seq}"
            sent_at[pid] = time.perf_counter()
            rid += 1
            client.send_multipart(_encode(p.Submit(request_id=str(rid), prompts=(make_prompt(seq),)), inline.get(client)))
            if rate_per_s:
                next_submit += 1.0 / rate_per_s
        while pulls_out < 2:
            rid += 1
            client.send_multipart(p.encode(p.Pull(request_id=str(rid), max_groups=4096, wait_s=0.5, ack=tuple(to_ack))))
            to_ack = []
            pulls_out += 1
        if hb_next:
            for i, t in enumerate(hb_next):
                if t <= now:
                    workers[i].send_multipart(p.encode(p.WorkerHeartbeat(worker_id=f"bw{i}")))
                    hb_next[i] = t + heartbeat_s
        timeout_ms = 1 if rate_per_s else 50
        for sock, _ev in poller.poll(timeout_ms):
            for _ in range(1000):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = p.decode(frames)
                kind = type(msg)
                if kind is p.Task:
                    sock.send_multipart(_encode(zero_latency_result(msg, sock.identity.decode()), inline.get(sock)))
                    sock.send_multipart(credit_frames)
                elif kind is p.Welcome or kind is p.ClientWelcome:
                    inline[sock] = _inline_from(msg)
                elif kind is p.Batch:
                    pulls_out -= 1
                    t = time.perf_counter()
                    for g in msg.groups:
                        t0 = sent_at.pop(g.prompt_id, None)
                        if t0 is not None:
                            done += 1
                            if measuring:
                                latencies.append(t - t0)
                        to_ack.append(g.prompt_id)
                elif kind is p.Error:
                    raise RuntimeError(f"broker error: {msg}")
    elapsed = time.perf_counter() - t_measure
    counters: dict[str, Any] = {}
    if status_at_end:
        client.send_multipart(p.encode(p.StatusRequest(request_id="status")))
        deadline = time.perf_counter() + 5
        while time.perf_counter() < deadline:
            if client.poll(100):
                m = p.decode(client.recv_multipart())
                if type(m) is p.StatusReply:
                    counters = m.counters
                    break
    for s in workers:
        s.close(linger=0)
    client.close(linger=0)
    ctx.destroy(linger=0)
    return {"rt": done - done_at_measure, "elapsed_s": elapsed, "latencies": latencies, "counters": counters}


# --------------------------------------------------------------------------- Redis Streams reference


async def run_redis_load(url: str, n_workers: int, seconds: float, window: int) -> dict[str, Any]:
    import redis.asyncio as aioredis

    tasks_key, results_key = "bench:tasks", "bench:results"
    admin = aioredis.from_url(url)
    await admin.flushall()
    await admin.xgroup_create(tasks_key, "workers", id="0", mkstream=True)
    await admin.xgroup_create(results_key, "trainer", id="0", mkstream=True)
    stop = asyncio.Event()
    payload = make_prompt(0)

    async def consumer(i: int) -> None:
        r = aioredis.from_url(url)
        name = f"c{i}"
        try:
            while not stop.is_set():
                got = await r.xreadgroup("workers", name, {tasks_key: ">"}, count=max(1, -(-window // n_workers)), block=200)
                for _stream, entries in got or ():
                    pipe = r.pipeline(transaction=False)
                    for entry_id, fields in entries:
                        prompt = p.decode([fields[b"h"], fields[b"i"]]).prompts[0]
                        res = p.encode(zero_latency_result(p.Task(task_id=f"{prompt.prompt_id}@0", prompt=prompt), name))
                        pipe.xadd(results_key, {str(k): bytes(memoryview(v)) for k, v in enumerate(res)})
                        pipe.xack(tasks_key, "workers", entry_id)
                    await pipe.execute()
        finally:
            await r.aclose()

    consumers = [asyncio.create_task(consumer(i)) for i in range(n_workers)]
    client = aioredis.from_url(url)
    reader = aioredis.from_url(url)
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    done = 0
    seq = 0
    loop = asyncio.get_running_loop()
    t_measure = loop.time() + min(0.5, seconds / 4)
    t_end = t_measure + seconds
    measuring = False
    done_at_measure = 0
    space = asyncio.Event()
    space.set()

    async def submitter() -> None:
        nonlocal seq
        while not stop.is_set():
            await space.wait()
            pipe = client.pipeline(transaction=False)
            n = 0
            while len(sent_at) < window:
                seq += 1
                pr = p.Prompt(prompt_id=f"q{seq}", input_ids=payload.input_ids, group_size=1)
                frames = _encode_prompt(pr)
                sent_at[pr.prompt_id] = time.perf_counter()
                pipe.xadd(tasks_key, {"h": frames[0], "i": bytes(memoryview(frames[1]))})
                n += 1
            if n:
                await pipe.execute()
            space.clear()

    sub = asyncio.create_task(submitter())
    try:
        while True:
            now = loop.time()
            if not measuring and now >= t_measure:
                measuring, done_at_measure, t_measure = True, done, now
            if now >= t_end:
                break
            got = await reader.xreadgroup("trainer", "t", {results_key: ">"}, count=4096, block=200)
            ids = []
            t = time.perf_counter()
            for _stream, entries in got or ():
                for entry_id, fields in entries:
                    res = p.decode([fields[str(k).encode()] for k in range(len(fields))])
                    t0 = sent_at.pop(res.prompt_id, None)
                    if t0 is not None:
                        done += 1
                        if measuring:
                            latencies.append(t - t0)
                    ids.append(entry_id)
            if ids:
                await reader.xack(results_key, "trainer", *ids)
                space.set()
    finally:
        stop.set()
        space.set()
        await asyncio.gather(sub, *consumers, return_exceptions=True)
        for r in (client, reader, admin):
            await r.aclose()
    return {"rt": done - done_at_measure, "elapsed_s": loop.time() - t_measure, "latencies": latencies}


def _encode_prompt(pr: p.Prompt) -> list[Any]:
    """A task-stream entry: one prompt as the same bytes a rollpool client sends per prompt (a Submit of one)."""
    return p.encode(p.Submit(request_id="r", prompts=(pr,)))


# --------------------------------------------------------------------------- new method: open-loop load from generator processes
#
# Every process below is started with the same absolute CLOCK_MONOTONIC times (`--t-start`, `--t-measure`,
# `--t-end`), which the broker's own timestamps share (Linux: one monotonic clock per machine), so broker-side
# rows, generator-side latencies and /proc CPU samples all cut the same measurement window.


def _mono() -> float:
    return time.monotonic()


def _sleep_until(t: float) -> None:
    while True:
        d = t - _mono()
        if d <= 0:
            return
        time.sleep(min(d, 0.05))


def _wait_go(args: argparse.Namespace, serve: Any = None) -> None:
    """Say ready (a file), then wait for the driver's go file with the run's times (serving meanwhile)."""
    Path(args.ready).touch()
    go = Path(args.go)
    while not go.exists():
        if serve is not None:
            serve(0.01)
        else:
            time.sleep(0.01)
    times = json.loads(go.read_text())
    args.t_start, args.t_measure, args.t_end = times["t_start"], times["t_measure"], times["t_end"]


def gen_workers_main(args: argparse.Namespace) -> None:
    """One process hosting many zero-latency simulated workers (one DEALER each), driven by epoll on their FDs.

    A worker answers every task at once (or holds `--hold` tasks forever, for the heartbeat runs), heartbeats
    every `--heartbeat-s` (phases spread evenly), and speaks minor 1 (TaskBatch, ResultBatch, Result.credits,
    held digest) when the broker's Welcome lists it and `--wire new`; `--wire old` is a minor-0 worker
    (Result + Credit, the whole in-flight list in every heartbeat).
    """
    import selectors

    ids = [f"{args.prefix}{i}" for i in range(args.first, args.first + args.count)]
    new_wire = args.wire == "new"
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 65536)  # a context option (`setsockopt` would set a default socket option)
    f = p.SocketFactory(ctx, p.SocketOptions(send_hwm=100_000, recv_hwm=100_000))
    socks: list[Any] = []
    sel = selectors.DefaultSelector()
    features = p.FEATURES if new_wire else ()
    n = len(ids)
    broker_features: list[frozenset[str]] = [frozenset()] * n
    inline: list[Any] = [None] * n  # the policy each worker's welcome settled (new wire only)
    epoch = [""] * n
    seq = [0] * n
    held: list[dict[str, None]] = [{} for _ in range(n)]
    send_full = [False] * n
    stats: dict[str, float] = {"tasks": 0, "results": 0, "heartbeats": 0, "errors": 0, "held_requests": 0, "messages_in": 0,
                               "max_hb_late_s": 0.0}
    hb = args.heartbeat_s
    next_hb: list[float] = []
    credit1 = p.encode(p.Credit(credits=1))

    def heartbeat(i: int) -> None:
        h = held[i]
        if new_wire and p.Feature.HELD_DIGEST in broker_features[i]:
            full = send_full[i]
            send_full[i] = False
            msg = p.WorkerHeartbeat(worker_id=ids[i], epoch=epoch[i], dispatch_seq=seq[i], free_capacity=args.capacity - len(h),
                                    held_count=len(h), held_digest=p.held_digest(h), inflight_task_ids=tuple(h) if full else (),
                                    held_full=full)
        else:
            msg = p.WorkerHeartbeat(worker_id=ids[i], epoch=epoch[i], inflight_task_ids=tuple(h))
        socks[i].send_multipart(p.encode(msg))
        stats["heartbeats"] += 1

    def on_tasks(i: int, tasks: tuple[p.Task, ...]) -> None:
        s = socks[i]
        stats["tasks"] += len(tasks)
        results = []
        for t in tasks:
            if t.seq > seq[i]:
                seq[i] = t.seq
            if len(held[i]) < args.hold:
                held[i][t.task_id] = None
                continue
            results.append(zero_latency_result(t, ids[i]))
        if not results:
            return
        stats["results"] += len(results)
        bf = broker_features[i]
        inl = inline[i]
        if len(results) > 1 and p.Feature.RESULT_BATCH in bf:
            s.send_multipart(_encode(p.ResultBatch(results=tuple(results), credits=len(results)), inl))
        elif p.Feature.RESULT_CREDITS in bf:
            for r in results:
                s.send_multipart(_encode(p.Result(task_id=r.task_id, prompt_id=r.prompt_id, trajectories=r.trajectories, credits=1), inl))
        else:
            for r in results:
                s.send_multipart(p.encode(r))
                s.send_multipart(credit1)

    def drain(i: int) -> None:
        s = socks[i]
        while True:
            try:
                frames = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    continue
                return
            stats["messages_in"] += 1
            msg = p.decode(frames)
            kind = type(msg)
            if kind is p.Task:
                on_tasks(i, (msg,))
            elif kind is p.TaskBatch:
                on_tasks(i, msg.tasks)
            elif kind is p.BrokerHeartbeat:
                if msg.send_held:
                    send_full[i] = True
                    stats["held_requests"] += 1
            elif kind is p.Welcome:
                broker_features[i] = frozenset(msg.features) if new_wire else frozenset()
                inline[i] = _inline_from(msg) if new_wire else None
                epoch[i] = msg.epoch
            elif kind is p.Error:
                stats["errors"] += 1

    sweep_at = [_mono() + 0.5]

    def serve(timeout: float) -> None:
        now = _mono()
        if hb > 0:
            for i in range(len(next_hb)):
                if next_hb[i] <= now:
                    late = now - next_hb[i]
                    if late > stats["max_hb_late_s"]:
                        stats["max_hb_late_s"] = late
                    heartbeat(i)
                    next_hb[i] = now + hb
        for key, _ev in sel.select(timeout):
            drain(key.data)
        if now >= sweep_at[0]:  # ZeroMQ's FD is edge-triggered: a safety sweep now and then
            for i in range(len(socks)):
                if socks[i].getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    drain(i)
            sweep_at[0] = now + 0.5

    # connect in chunks and keep the ones already connected heartbeating meanwhile (a slow start must not
    # look like a dead worker to the broker)
    for i, wid in enumerate(ids):
        s = f.dealer(args.worker_endpoint, identity=wid.encode())
        s.send_multipart(p.encode(p.Hello(worker_id=wid, protocol_min=1, protocol_max=1, engine="zero", capacity=args.capacity,
                                          credits=args.capacity, features=features, **(MINOR if new_wire else {}))))
        socks.append(s)
        sel.register(s.getsockopt(zmq.FD), selectors.EVENT_READ, i)
        next_hb.append(_mono() + hb * (0.2 + 0.8 * ((i * 7919) % n) / n) if hb > 0 else 0.0)
        if i % 100 == 99:
            serve(0)
    welcome_by = _mono() + 120
    while not all(epoch) and _mono() < welcome_by:  # ready = every worker welcomed (heartbeating meanwhile)
        serve(0.01)
    _wait_go(args, serve)
    cpu0 = None
    while _mono() < args.t_end:
        serve(0.01)
        if cpu0 is None and _mono() >= args.t_measure:
            cpu0 = time.process_time()
    stats["cpu_in_window_s"] = time.process_time() - (cpu0 if cpu0 is not None else time.process_time())
    # keep heartbeating until the driver has read the broker's counters (its stop file): workers that fell
    # silent at the window's end were counted dead by a broker answering the status request late
    stop, linger_until = Path(args.go).with_name("stop"), _mono() + 120
    while not stop.exists() and _mono() < linger_until:
        serve(0.01)
    for s in socks:
        s.close(linger=0)
    ctx.destroy(linger=0)
    Path(args.out).write_text(json.dumps(stats))


def gen_client_main(args: argparse.Namespace) -> None:
    """One trainer-side client: submits at a fixed rate (open loop) or keeps `--window` in flight (closed loop, rate 0).

    Every prompt carries its submit time (CLOCK_MONOTONIC) in its metadata, which the broker echoes on the
    group, so any client that receives a group can time it; each client acks what it receives.
    """
    ctx = zmq.Context()
    f = p.SocketFactory(ctx, p.SocketOptions(send_hwm=100_000, recv_hwm=100_000))
    cid = args.prefix
    c = f.dealer(args.client_endpoint, identity=cid.encode())
    c.send_multipart(p.encode(p.ClientHello(client_id=cid, protocol_min=1, protocol_max=1, **MINOR)))
    inline: Any = None  # the policy the ClientWelcome settles (read before the start, as a real client does)
    if c.poll(30_000):
        m = p.decode(c.recv_multipart())
        if type(m) is p.ClientWelcome:
            inline = _inline_from(m)
    _wait_go(args)
    rate, window, per_submit = args.rate, args.window, max(1, args.per_submit)
    ids = np.arange(8, dtype=np.int32)
    lat: list[float] = []
    sent = received = in_window_sent = 0
    mine_in_flight = 0
    to_ack: list[str] = []
    pulls_out = 0
    rid = 0
    seq = 0
    _sleep_until(args.t_start)
    next_submit = args.t_start
    pending: list[p.Prompt] = []
    cpu0 = None
    while True:
        now = _mono()
        if now >= args.t_end:
            break
        if cpu0 is None and now >= args.t_measure:
            cpu0 = time.process_time()
        if rate > 0:
            while next_submit <= now:
                seq += 1
                pending.append(p.Prompt(prompt_id=f"{cid}-{seq}", input_ids=ids, metadata={"t": next_submit, "c": cid}))
                next_submit += 1.0 / rate
            # a trainer-shaped client (per_submit > 1) waits until a whole Submit's worth is due
            batch, pending = (pending, []) if len(pending) >= per_submit else ([], pending)
        else:
            batch = []
            while mine_in_flight + len(batch) < window:
                seq += 1
                batch.append(p.Prompt(prompt_id=f"{cid}-{seq}", input_ids=ids, metadata={"t": now, "c": cid}))
        for k in range(0, len(batch), per_submit):
            rid += 1
            chunk = tuple(batch[k:k + per_submit])
            c.send_multipart(_encode(p.Submit(request_id=str(rid), prompts=chunk), inline))
        sent += len(batch)
        mine_in_flight += len(batch)
        if args.t_measure <= now:
            in_window_sent += len(batch)
        while pulls_out < 2:
            rid += 1
            c.send_multipart(p.encode(p.Pull(request_id=str(rid), max_groups=4096, wait_s=0.2, ack=tuple(to_ack))))
            to_ack = []
            pulls_out += 1
        wait_ms = max(1, min(20, int((next_submit - _mono()) * 1000))) if rate > 0 else 20
        if c.poll(wait_ms):
            while True:
                try:
                    frames = c.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                m = p.decode(frames)
                if type(m) is p.Batch:
                    pulls_out -= 1
                    t = _mono()
                    for g in m.groups:
                        received += 1
                        t0 = g.metadata.get("t")
                        if g.metadata.get("c") == cid:
                            mine_in_flight -= 1
                        if isinstance(t0, float) and args.t_measure <= t0 and t <= args.t_end:
                            lat.append(t - t0)
                        to_ack.append(g.prompt_id)
                elif type(m) is p.ClientWelcome:
                    inline = _inline_from(m)
                elif type(m) is p.Error:
                    raise RuntimeError(f"broker error: {m}")
    c.close(linger=0)
    ctx.destroy(linger=0)
    cpu = time.process_time() - (cpu0 if cpu0 is not None else time.process_time())
    Path(args.out).write_text(json.dumps({"sent": sent, "sent_in_window": in_window_sent, "received": received, "lat": lat, "cpu_in_window_s": cpu}))


def _machine_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        parts = [int(x) for x in fh.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return sum(parts) - idle, sum(parts)


def _status(cep: str) -> dict[str, Any]:
    import dataclasses

    ctx = zmq.Context()
    f = p.SocketFactory(ctx, p.SocketOptions())
    c = f.dealer(cep, identity=b"bench-status")
    try:
        c.send_multipart(p.encode(p.StatusRequest(request_id="status")))
        if c.poll(10_000):
            # a StatusReply maps every worker: past 4,096 workers it exceeds the default decode limits (max_map_len)
            m = p.decode(c.recv_multipart(), dataclasses.replace(p.DEFAULT_LIMITS, max_map_len=1 << 20))
            if type(m) is p.StatusReply:
                return dict(m.counters)
        return {}
    finally:
        c.close(linger=0)
        ctx.destroy(linger=0)


def open_loop_run(
    system: str,
    n_workers: int,
    *,
    rate: float,
    seconds: float,
    hosts: int = 2,
    clients: int = 2,
    window: int = 256,
    per_submit: int = 1,
    heartbeat_s: float = 1.0,
    wire: str = "new",
    hold: int = 0,
    warmup_s: float = 0.7,
    preload: int = 0,
    base: str | None = None,
) -> dict[str, Any]:
    """One run of the new method; rate 0 = closed loop (saturation: one client keeps `window` in flight)."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="rollpool-bench-"))
    lat_path = tmp / "broker_latency.npy"
    proc, wep, cep = start_server(system, heartbeat_s=heartbeat_s, latency_out=str(lat_path), base=base)
    gens: list[subprocess.Popen[bytes]] = []
    try:
        time.sleep(0.3)
        go = tmp / "go.json"
        ready: list[Path] = []

        def common(name: str) -> list[str]:
            ready.append(tmp / f"ready-{name}")
            return ["--go", str(go), "--ready", str(ready[-1])]
        per_host = -(-n_workers // hosts)
        capacity = max(1, -(-window // n_workers)) if not hold else hold
        for h in range(hosts):
            first = h * per_host
            count = min(per_host, n_workers - first)
            if count <= 0:
                break
            gens.append(_spawn(["--gen-workers", "--worker-endpoint", wep, "--prefix", "bw", "--first", str(first), "--count", str(count),
                                "--capacity", str(capacity), "--hold", str(hold), "--heartbeat-s", str(heartbeat_s), "--wire", wire,
                                "--out", str(tmp / f"w{h}.json"), *common(f"w{h}")]))
        n_clients = 1 if rate <= 0 else clients
        for k in range(n_clients):
            gens.append(_spawn(["--gen-client", "--client-endpoint", cep, "--prefix", f"c{k}", "--rate", repr(rate / n_clients if rate > 0 else rate),
                                "--window", str(window), "--per-submit", str(per_submit), "--out", str(tmp / f"c{k}.json"), *common(f"c{k}")]))
        # every generator connected (and, for the real broker, every worker's hello handled) before the clock starts
        deadline = _mono() + 60 + n_workers / 100
        while not all(x.exists() for x in ready):
            if _mono() > deadline or any(g.poll() is not None for g in gens):
                raise RuntimeError("a load generator did not start")
            time.sleep(0.02)
        if system != "trivial":
            while int(_status(cep).get("workers_alive", 0)) < n_workers:  # a StatusReply grows with workers: ask rarely
                if _mono() > deadline:
                    raise RuntimeError("not every simulated worker was welcomed")
                time.sleep(0.05 + n_workers / 20_000)
        else:
            time.sleep(0.3)
        t_start = _mono() + 0.2
        t_measure = t_start + warmup_s + (n_workers * hold / 20_000 if hold else 0.0)
        t_end = t_measure + seconds
        go.with_suffix(".tmp").write_text(json.dumps({"t_start": t_start, "t_measure": t_measure, "t_end": t_end}))
        go.with_suffix(".tmp").rename(go)
        if preload:
            _preload(cep, preload, t_start)
        _sleep_until(t_measure)
        c0 = proc_cpu_s(proc.pid)
        t0m, t0o = proc_threads_cpu_s(proc.pid)
        us0 = proc_user_system_s(proc.pid)
        m0 = _machine_jiffies()
        la0 = os.getloadavg()[0]
        _sleep_until(t_end)
        c1 = proc_cpu_s(proc.pid)
        t1m, t1o = proc_threads_cpu_s(proc.pid)
        us1 = proc_user_system_s(proc.pid)
        m1 = _machine_jiffies()
        counters = _status(cep) if system != "trivial" else {}
        go.with_name("stop").touch()  # the worker generators heartbeat until now (see gen_workers_main)
        for g in gens:
            g.wait(60)
    finally:
        for g in gens:
            if g.poll() is None:
                g.kill()
        stop_server(proc)
    wstats = [json.loads((tmp / f"w{h}.json").read_text()) for h in range(len(gens)) if (tmp / f"w{h}.json").exists()]
    cstats = [json.loads(x.read_text()) for x in sorted(tmp.glob("c*.json"))]
    client_lat = [x for c in cstats for x in c["lat"]]
    window_s = t_end - t_measure
    busy = (m1[0] - m0[0]) / max(1, m1[1] - m0[1])
    gen_cpu = sum(x.get("cpu_in_window_s", 0.0) for x in wstats + cstats)
    out: dict[str, Any] = {
        "system": system,
        "workers": n_workers,
        "offered_per_s": rate if rate > 0 else None,
        "closed_loop_window": window if rate <= 0 else None,
        "wire": wire,
        "broker_cpu_s": c1 - c0,
        "broker_main_thread_cpu_s": t1m - t0m,
        "broker_other_threads_cpu_s": t1o - t0o,
        "broker_user_cpu_s": round(us1[0] - us0[0], 3),
        "broker_system_cpu_s": round(us1[1] - us0[1], 3),
        "client_p50_ms": pct(client_lat, 50),
        "client_p99_ms": pct(client_lat, 99),
        "heartbeats_sent": sum(w["heartbeats"] for w in wstats),
        "held_requests": sum(w["held_requests"] for w in wstats),
        "worker_errors": sum(w["errors"] for w in wstats),
        "machine_busy_frac": round(busy, 3),
        "generators_cpu_s": round(gen_cpu, 3),
        "ours_cpu_frac": round(((c1 - c0) + gen_cpu) / (window_s * (os.cpu_count() or 1)), 3),
        "loadavg_1m_at_start": round(la0, 2),
    }
    if lat_path.exists():
        rows = np.load(lat_path)
        delivered = rows[(rows[:, 3] >= t_measure) & (rows[:, 3] <= t_end)]  # throughput: deliveries in the window
        sel = rows[(rows[:, 0] >= t_measure) & (rows[:, 3] <= t_end)]  # latency: groups queued in the window
        e2e = list(sel[:, 3] - sel[:, 0])
        rt = len(delivered)
        sent_in_window = sum(c["sent_in_window"] for c in cstats)
        out["queued_in_window_not_delivered_by_end"] = max(0, sent_in_window - len(sel)) if rate > 0 else None
        out.update(
            rt_per_s=rt / window_s,
            p50_ms=pct(e2e, 50),
            p99_ms=pct(e2e, 99),
            queue_p99_ms=pct(list(sel[:, 1] - sel[:, 0]), 99),
            worker_p99_ms=pct(list(sel[:, 2] - sel[:, 1]), 99),
            handover_p99_ms=pct(list(sel[:, 3] - sel[:, 2]), 99),
            latency_source="broker",
        )
    else:
        rt = len(client_lat)
        out.update(rt_per_s=rt / window_s, p50_ms=out["client_p50_ms"], p99_ms=out["client_p99_ms"], latency_source="client")
    out["cpu_us_per_rt"] = (c1 - c0) / max(rt, 1) * 1e6 if rt else None
    out["main_thread_us_per_rt"] = (t1m - t0m) / max(rt, 1) * 1e6 if rt else None
    if counters:
        done = max(1, int(counters.get("completed", 0)))
        for k in ("reads", "messages_in", "messages_out", "frames_in", "frames_out"):  # over the whole run (warm-up included), per group completed
            if k in counters:
                out[f"broker_{k}_per_rt"] = round(int(counters[k]) / done, 3)
        loop_path = Path(str(lat_path) + ".loop.json")
        if loop_path.exists():
            for k, v in json.loads(loop_path.read_text()).items():
                out[f"broker_loop_{k}_per_rt"] = round(v / done, 3)
        out["false_dead"] = int(counters.get("workers_lost", -1))
        out["workers_alive"] = int(counters.get("workers_alive", -1))
        hbs = counters.get("heartbeats")
        out["broker_heartbeats"] = hbs
        out["held_mismatches"] = counters.get("held_mismatches")
    for x in tmp.iterdir():
        x.unlink()
    tmp.rmdir()
    return out


def _child_env() -> dict[str, str]:
    """The environment of the bench's children: this checkout first on the path, then the caller's PYTHONPATH
    (on the device, the kit's folder holds pyzmq)."""
    path = os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    return {**os.environ, "PYTHONPATH": path}


def _spawn(extra: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *extra], env=_child_env())


def _preload(cep: str, n: int, t_start: float) -> None:
    """Submit `n` prompts for the held-task runs (workers keep them: heartbeats then describe what they hold)."""
    ctx = zmq.Context()
    f = p.SocketFactory(ctx, p.SocketOptions(send_hwm=100_000, recv_hwm=100_000))
    c = f.dealer(cep, identity=b"bench-preload")
    ids = np.arange(8, dtype=np.int32)
    _sleep_until(t_start)
    for k in range(0, n, 512):
        c.send_multipart(p.encode(p.Submit(request_id=str(k), prompts=tuple(p.Prompt(prompt_id=f"h{j}", input_ids=ids) for j in range(k, min(n, k + 512))))))
    c.close(linger=0)
    ctx.destroy(linger=0)


# --------------------------------------------------------------------------- driver


def pct(xs: list[float], q: float) -> float:
    if not len(xs):
        return float("nan")
    return float(np.percentile(np.asarray(xs), q)) * 1000


def one_run(system: str, n_workers: int, seconds: float, redis_url: str | None, redis_pid: int | None, base: str | None = None) -> dict[str, Any]:
    """The old method: one closed-loop generator process (client + workers), latency seen by the client."""
    window = max(64, n_workers)
    if system == "redis":
        assert redis_url is not None and redis_pid is not None
        c0 = proc_cpu_s(redis_pid)
        out = asyncio.run(run_redis_load(redis_url, n_workers, seconds, window))
        cpu = proc_cpu_s(redis_pid) - c0
    else:
        proc, wep, cep = start_server("rollpool" if system == "rollpool@base" else system, base=base if system == "rollpool@base" else None)
        try:
            time.sleep(0.3)
            c0 = proc_cpu_s(proc.pid)
            out = run_zmq_load(wep, cep, n_workers, seconds, window)
            cpu = proc_cpu_s(proc.pid) - c0
        finally:
            stop_server(proc)
    rt = out["rt"]
    return {
        "rt_per_s": rt / out["elapsed_s"],
        "p50_ms": pct(out["latencies"], 50),
        "p99_ms": pct(out["latencies"], 99),
        "cpu_us_per_rt": cpu / max(rt, 1) * 1e6,
    }


def _r(x: Any, nd: int = 3) -> Any:
    return None if x is None or (isinstance(x, float) and x != x) else (round(x, nd) if isinstance(x, float) else x)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt_run(r: dict[str, Any]) -> str:
    return (f"{r['system']:13s} {r['workers']:5d} w  offered {r['offered_per_s'] or 0:7.0f}/s  {r['rt_per_s']:7.0f} rt/s  "
            f"p50 {r['p50_ms']:7.2f}  p99 {r['p99_ms']:7.2f} ms ({r['latency_source']})  client p99 {r['client_p99_ms']:7.2f} ms  "
            f"cpu {r['cpu_us_per_rt'] or float('nan'):6.1f} us/rt  machine busy {r['machine_busy_frac']:.2f} (ours {r['ours_cpu_frac']:.2f})")


def old_method(args: argparse.Namespace, systems: list[str], worker_counts: list[int], reps: int, seconds: float, base: str | None) -> dict[str, Any]:
    redis_ctx = None
    redis_url = redis_pid = None
    if "redis" in systems:
        from rollpool.monitor.embedded import EmbeddedRedis

        redis_ctx = EmbeddedRedis().start()
        redis_url = redis_ctx.url
        redis_pid = redis_ctx.proc.pid if redis_ctx.proc else None
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for rep in range(reps):
            for n in worker_counts:
                order = systems if rep % 2 == 0 else systems[::-1]
                for system in order:
                    r = one_run(system, n, seconds, redis_url, redis_pid, base)
                    runs.setdefault((system, n), []).append(r)
                    _log(f"  old method rep {rep} {system:13s} {n:4d} workers: {r['rt_per_s']:8.0f} rt/s  p50 {r['p50_ms']:.2f} ms  "
                         f"p99 {r['p99_ms']:.2f} ms  cpu {r['cpu_us_per_rt']:.1f} us/rt")
    finally:
        if redis_ctx is not None:
            redis_ctx.stop()

    def med(system: str, n: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[(system, n)])

    def ratio_med(a: str, b: str, n: int) -> float:
        # ratios per repetition (interleaved pairs), then the median
        return statistics.median(x["rt_per_s"] / y["rt_per_s"] for x, y in zip(runs[(a, n)], runs[(b, n)], strict=True))

    print("\nOLD METHOD (closed loop, one generator process for the client and every worker, latency seen by the client)")
    header = f"{'workers':>7} | {'system':<13} | {'rt/s':>8} | {'p50 ms':>7} | {'p99 ms':>7} | {'broker CPU us/rt':>16}"
    print(header)
    print("-" * len(header))
    for n in worker_counts:
        for system in systems:
            print(f"{n:>7} | {system:<13} | {med(system, n, 'rt_per_s'):>8.0f} | {med(system, n, 'p50_ms'):>7.2f} | "
                  f"{med(system, n, 'p99_ms'):>7.2f} | {med(system, n, 'cpu_us_per_rt'):>16.1f}")
        line = ""
        if "redis" in systems and "rollpool" in systems:
            line += f"   rollpool / redis streams: {ratio_med('rollpool', 'redis', n):.2f}"
        if "trivial" in systems and "rollpool" in systems:
            line += f"   rollpool / trivial: {ratio_med('rollpool', 'trivial', n):.2f}"
        if "rollpool@base" in systems:
            line += f"   rollpool / rollpool@base: {ratio_med('rollpool', 'rollpool@base', n):.2f}"
        print(f"{'':>7}{line}")
    head_n = 16 if 16 in worker_counts else worker_counts[0]
    return {
        "workers_headline": head_n,
        "reps": reps,
        "seconds_per_run": seconds,
        "ratio": round(ratio_med("rollpool", "redis", head_n), 3) if {"rollpool", "redis"} <= set(systems) else None,
        "vs_trivial": round(ratio_med("rollpool", "trivial", head_n), 3) if {"rollpool", "trivial"} <= set(systems) else None,
        "vs_base": round(ratio_med("rollpool", "rollpool@base", head_n), 3) if {"rollpool", "rollpool@base"} <= set(systems) else None,
        "by_workers": {
            f"{system}:{n}": {k: round(med(system, n, k), 3) for k in ("rt_per_s", "p50_ms", "p99_ms", "cpu_us_per_rt")}
            for system in systems
            for n in worker_counts
        },
    }


def new_method(args: argparse.Namespace, systems: list[str], n_workers: int, seconds: float, base: str | None) -> dict[str, Any]:
    """Saturation (closed loop, 256 in flight), then open loop at 25/50/90% of each system's own saturation rate."""
    out: dict[str, Any] = {"workers": n_workers, "hosts": args.hosts, "clients": args.clients, "seconds_per_run": seconds, "runs": {}}
    sat_rate: dict[str, float] = {}
    for system in systems:
        kind = "rollpool" if system.startswith("rollpool") else system
        b = base if system == "rollpool@base" else None
        sats = []
        for _ in range(args.sat_reps):
            sat = open_loop_run(kind, n_workers, rate=0.0, seconds=seconds, hosts=args.hosts, window=256, base=b,
                                warmup_s=args.warmup_s)
            sat["system"] = system
            _log("  new method saturation " + _fmt_run(sat))
            sats.append(sat)
        sat = sorted(sats, key=lambda r: r["rt_per_s"])[len(sats) // 2]
        sat_rate[system] = sat["rt_per_s"]
        out["runs"][system] = {"saturation": {k: _r(v) for k, v in sat.items()}}
    # (fraction of saturation, prompts per Submit): the last is the same 50% load shaped like a trainer's step
    loads = [(0.25, 1), (0.5, 1), (0.9, 1), (0.5, 32)]
    got: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rep in range(args.load_reps):  # interleaved: every system once per repetition, alternating order
        for system in (systems if rep % 2 == 0 else systems[::-1]):
            kind = "rollpool" if system.startswith("rollpool") else system
            b = base if system == "rollpool@base" else None
            for i, (frac, per_submit) in enumerate(loads):
                r = open_loop_run(kind, n_workers, rate=frac * sat_rate[system], seconds=seconds, hosts=args.hosts, clients=args.clients,
                                  base=b, warmup_s=args.warmup_s, per_submit=per_submit)
                r["system"] = system
                r["fraction_of_saturation"] = frac
                r["prompts_per_submit"] = per_submit
                _log("  new method open loop  " + _fmt_run(r) + (f"  ({per_submit} per submit)" if per_submit > 1 else ""))
                got.setdefault((system, i), []).append(r)
    for (system, i), rs in got.items():
        frac, per_submit = loads[i]
        name = f"{int(frac * 100)}%" + (f", {per_submit} per submit" if per_submit > 1 else "")
        med = sorted(rs, key=lambda r: r["p99_ms"])[len(rs) // 2]  # the repetition with the median p99
        row = {k: _r(v) for k, v in med.items()}
        row["p99_ms_all_reps"] = [_r(r["p99_ms"]) for r in rs]
        row["cpu_us_per_rt_all_reps"] = [_r(r["cpu_us_per_rt"], 1) for r in rs]
        row["machine_busy_all_reps"] = [r["machine_busy_frac"] for r in rs]
        out["runs"][system][name] = row
    print(f"\nNEW METHOD ({n_workers} zero-latency workers in {args.hosts} generator processes, open-loop clients in {args.clients} processes; "
          "latency from the broker's own timestamps where it has them: queued -> delivered)")
    header = (f"{'system':<13} | {'load':>10} | {'offered/s':>9} | {'rt/s':>7} | {'p50 ms':>7} | {'p99 ms':>7} | {'client p99':>10} | "
              f"{'broker CPU us/rt':>16} | {'frames/rt':>9} | {'machine busy':>12}")
    print(header)
    print("-" * len(header))
    for system, rows in out["runs"].items():
        for load, r in rows.items():
            print(f"{system:<13} | {load:>10} | {r['offered_per_s'] or 0:>9.0f} | {r['rt_per_s']:>7.0f} | {r['p50_ms'] or float('nan'):>7.2f} | "
                  f"{r['p99_ms'] or float('nan'):>7.2f} | {r['client_p99_ms'] or float('nan'):>10.2f} | {r['cpu_us_per_rt'] or float('nan'):>16.1f} | "
                  f"{_frames_per_rt(r):>9} | {r['machine_busy_frac']:>12.2f}")
    return out


def _frames_per_rt(r: dict[str, Any]) -> str:
    """ZeroMQ frames the broker read and sent per round trip (its counters `frames_in` + `frames_out`; "-" for a broker
    without them)."""
    fi, fo = r.get("broker_frames_in_per_rt"), r.get("broker_frames_out_per_rt")
    return f"{fi + fo:.1f}" if fi is not None and fo is not None else "-"


def heartbeat_runs(args: argparse.Namespace, counts: list[int], seconds: float) -> dict[str, Any]:
    """Workers that each hold `--hold` tasks and only heartbeat: the broker's CPU for heartbeats alone, old wire vs new."""
    out: dict[str, Any] = {}
    for n in counts:
        for wire in ("old", "new"):
            hosts = max(2, min(8, n // 1500 + 1))
            r = open_loop_run("rollpool", n, rate=-1.0, seconds=seconds, hosts=hosts, hold=args.hold, preload=n * args.hold, wire=wire,
                              heartbeat_s=1.0, warmup_s=args.hb_warmup_s)
            hbs = r.get("broker_heartbeats") or 0
            row = {
                "workers": n,
                "wire": wire,
                "held_per_worker": args.hold,
                "generator_processes": hosts,
                "broker_cpu_frac_of_core": round(r["broker_cpu_s"] / seconds, 3),
                "broker_cpu_us_per_heartbeat": round(r["broker_cpu_s"] / max(1.0, n * seconds) * 1e6, 2),
                "heartbeats_counted_by_broker": hbs,
                "false_dead": r.get("false_dead"),
                "workers_alive": r.get("workers_alive"),
                "held_mismatches": r.get("held_mismatches"),
                "worker_errors": r["worker_errors"],
                "machine_busy_frac": r["machine_busy_frac"],
                "ours_cpu_frac": r["ours_cpu_frac"],
            }
            out[f"{n}:{wire}"] = row
            _log(f"  heartbeats {n:6d} workers, {wire} wire: broker {row['broker_cpu_frac_of_core']:.3f} of a core, "
                 f"{row['broker_cpu_us_per_heartbeat']:.1f} us per heartbeat, false dead {row['false_dead']}, alive {row['workers_alive']}, "
                 f"machine busy {row['machine_busy_frac']:.2f}")
    print(f"\nHEARTBEATS ALONE (each worker holds {args.hold} tasks and heartbeats every 1 s; dead after 3 missed)")
    header = f"{'workers':>7} | {'wire':>4} | {'broker core frac':>16} | {'us/heartbeat':>12} | {'false dead':>10} | {'alive':>6} | {'machine busy':>12}"
    print(header)
    print("-" * len(header))
    for row in out.values():
        print(f"{row['workers']:>7} | {row['wire']:>4} | {row['broker_cpu_frac_of_core']:>16.3f} | {row['broker_cpu_us_per_heartbeat']:>12.1f} | "
              f"{row['false_dead']!s:>10} | {row['workers_alive']!s:>6} | {row['machine_busy_frac']:>12.2f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 workers only, short runs, heartbeats at 1,000 workers (about 2 minutes)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of the old method (interleaved)")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per run")
    ap.add_argument("--workers", default=None, help="worker counts of the old method (default 1,16,256; --quick: 16)")
    ap.add_argument("--systems", default="rollpool,redis,trivial")
    ap.add_argument("--base", default=None, help="another checkout's root: add `rollpool@base` (its broker) to both methods, for A/B")
    ap.add_argument("--new-workers", type=int, default=16, help="workers of the new method's runs (the headline: 16)")
    ap.add_argument("--hosts", type=int, default=2, help="generator processes hosting the simulated workers")
    ap.add_argument("--clients", type=int, default=2, help="open-loop client processes")
    ap.add_argument("--sat-reps", type=int, default=None, help="saturation runs per system (the median is used)")
    ap.add_argument("--load-reps", type=int, default=None, help="repetitions of every open-loop point (median p99; default 3, --quick 1)")
    ap.add_argument("--hold", type=int, default=4, help="tasks each worker holds in the heartbeat runs")
    ap.add_argument("--heartbeat-workers", default=None, help="worker counts of the heartbeat runs (default 1000,10000; --quick: 1000)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: old,new,heartbeats,scale")
    ap.add_argument("--warmup-s", type=float, default=0.7, help="unmeasured seconds at the start of each new-method run")
    ap.add_argument("--hb-warmup-s", type=float, default=2.0, help="unmeasured seconds at the start of each heartbeat run")
    ap.add_argument("--hb-seconds", type=float, default=None, help="measured seconds of each heartbeat run (default 10; --quick: 4)")
    ap.add_argument("--json", default=None)
    # roles of the child processes
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--gen-workers", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gen-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--client-endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--latency-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefix", default="", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--capacity", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--wire", default="new", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--window", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--per-submit", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--go", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ready", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--t-start", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--t-measure", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--t-end", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve == "rollpool":
        prof_path = os.environ.get("ROLLPOOL_BENCH_PROFILE")  # cProfile the broker child: where its CPU goes
        if prof_path:
            import cProfile

            # ROLLPOOL_BENCH_PROFILE_TIMER=thread: the main thread's CPU time (default: wall time, which also
            # counts the time the broker waited for a core on a busy machine)
            prof = cProfile.Profile(time.thread_time) if os.environ.get("ROLLPOOL_BENCH_PROFILE_TIMER") == "thread" else cProfile.Profile()
            prof.enable()
        try:
            serve_rollpool(args.worker_endpoint, args.client_endpoint, args.heartbeat_s, args.latency_out)
        finally:
            if prof_path:
                prof.disable()
                prof.dump_stats(prof_path)
        return 0
    if args.serve == "trivial":
        serve_trivial(args.worker_endpoint, args.client_endpoint)
        return 0
    if args.gen_workers:
        gen_workers_main(args)
        return 0
    if args.gen_client:
        if args.rate < 0:  # the heartbeat runs: no prompt flow beyond the preload
            _wait_go(args)
            _sleep_until(args.t_end)
            Path(args.out).write_text(json.dumps({"sent": 0, "sent_in_window": 0, "received": 0, "lat": []}))
            return 0
        gen_client_main(args)
        return 0

    reps = args.reps or 3
    seconds = args.seconds or (1.5 if args.quick else 4.0)
    args.sat_reps = args.sat_reps or (1 if args.quick else 3)
    args.load_reps = args.load_reps or (1 if args.quick else 3)
    worker_counts = [int(x) for x in (args.workers or ("16" if args.quick else "1,16,256")).split(",")]
    hb_counts = [int(x) for x in (args.heartbeat_workers or ("1000" if args.quick else "1000,10000")).split(",")]
    systems = args.systems.split(",")
    skip = set(filter(None, args.skip.split(",")))
    if args.base:
        systems.append("rollpool@base")
    t0 = time.perf_counter()
    m0 = _machine_jiffies()
    la0 = os.getloadavg()
    out: dict[str, Any] = {"bench": "broker"}
    old = old_method(args, systems, worker_counts, reps, seconds, args.base) if "old" not in skip else {}
    new = new_method(args, [s for s in systems if s != "redis"], args.new_workers, seconds * 1.5, args.base) if "new" not in skip else {}
    hbs = heartbeat_runs(args, hb_counts, args.hb_seconds or (4.0 if args.quick else 10.0)) if "heartbeats" not in skip else {}
    scale: dict[str, Any] = {}
    if "scale" not in skip:
        r = open_loop_run("rollpool", 1000, rate=2000.0, seconds=4.0 if args.quick else 10.0, hosts=4, clients=args.clients, heartbeat_s=1.0)
        scale = {k: _r(v) for k, v in r.items()}
        print(f"\nSCALE: 1,000 workers heartbeating at 1 s, 2,000 prompts/s offered (new method): {r['rt_per_s']:.0f} rt/s, "
              f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms (broker side; client p99 {r['client_p99_ms']:.2f} ms), "
              f"false dead {r.get('false_dead')}, alive {r.get('workers_alive')}")
    m1 = _machine_jiffies()
    head = new.get("runs", {}).get("rollpool", {}).get("50%", {})
    out.update(
        ratio=old.get("ratio"),
        vs_trivial=old.get("vs_trivial"),
        p99_ms=head.get("p99_ms"),
        p50_ms=head.get("p50_ms"),
        p99_ms_source="broker-side timestamps (queued -> delivered), open loop at 50% of saturation, 16 workers",
        broker_cpu_us_per_rt=_r(head.get("cpu_us_per_rt"), 1),
        broker_cpu_us_per_rt_at_saturation=_r(new.get("runs", {}).get("rollpool", {}).get("saturation", {}).get("cpu_us_per_rt"), 1),
        saturation_rt_per_s=_r(new.get("runs", {}).get("rollpool", {}).get("saturation", {}).get("rt_per_s"), 1),
        false_dead_1000=hbs.get("1000:new", {}).get("false_dead"),
        false_dead_10000=hbs.get("10000:new", {}).get("false_dead"),
        old_method=old,
        new_method=new,
        heartbeats=hbs,
        scale=scale,
        machine={
            "cpus": os.cpu_count(),
            "busy_frac_over_the_whole_bench": round((m1[0] - m0[0]) / max(1, m1[1] - m0[1]), 3),
            "loadavg_at_start": [round(x, 2) for x in la0],
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "note": "2 cores shared with other jobs; every run records machine_busy_frac (all processes) and ours_cpu_frac "
                    "(the broker and the generators of that run) over its window: the difference is what others used",
        },
        elapsed_s=round(time.perf_counter() - t0, 1),
        python=platform.python_version(),
    )
    print(f"\n(elapsed {out['elapsed_s']} s; machine busy {out['machine']['busy_frac_over_the_whole_bench']:.2f} of {os.cpu_count()} cores over the bench)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
