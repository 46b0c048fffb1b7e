"""Broker benchmark: rollpool's broker vs Redis Streams consumer groups vs a trivial asyncio ROUTER broker.

One load generator (this process) runs scripted zero-latency workers and one
client against each system in turn, on loopback:

* ``rollpool``: the real `rollpool.broker.Broker` in a child process. The client
  submits one prompt per `Submit`, long-polls `Pull` with the previous batch's
  acks piggybacked; workers answer each `Task` with a `Result` and a `Credit`.
* ``redis``: the same dispatch-and-acknowledge job with Redis Streams consumer
  groups against a real redis-server: the client XADDs one entry per prompt to a
  task stream; each of the N consumers XREADGROUPs (BLOCK), XADDs the result
  to a result stream and XACKs the task; the client XREADGROUPs results and XACKs them.
* ``trivial``: a deque of tasks and a deque of credits on two asyncio ROUTER
  sockets, the same messages and codec, no leases, no acks, no bookkeeping.

A round trip is submit -> dispatch -> result -> batch -> ack. Reported per system and worker
count (1, 16, 256): round trips per second, p50/p99 latency seen by the client
(submit to batch; the workers add zero time, so it is all broker and transport),
and the broker process's CPU time per round trip (utime + stime from /proc).
Runs are interleaved (every system once per repetition) and the medians of
``--reps`` (>= 3) repetitions are reported.

Scale mode: 1,000 connected workers heartbeating every second while 2,000
prompts/s flow; it reports p99 latency and false dead-worker detections.

    python bench/broker.py [--quick] [--reps 3] [--seconds 2] [--json PATH]
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

from rollpool import protocol as p  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- servers (child processes)


def serve_rollpool(wep: str, cep: str, heartbeat_s: float) -> None:
    import zmq.asyncio

    from rollpool.broker import Broker, BrokerConfig

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        cfg = BrokerConfig(worker_endpoint=wep, client_endpoint=cep, heartbeat_interval_s=heartbeat_s, drain_timeout_s=0.0)
        broker = Broker(cfg, p.SocketFactory(ctx, p.SocketOptions(send_hwm=100_000, recv_hwm=100_000)))
        import signal

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, broker.stop)
        await broker.run()
        ctx.destroy(linger=0)

    asyncio.run(main())


def serve_trivial(wep: str, cep: str) -> None:
    """The reference: a deque of tasks, a deque of credits, no leases or acks."""
    import signal

    import zmq.asyncio

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        f = p.SocketFactory(ctx, p.SocketOptions(send_hwm=100_000, recv_hwm=100_000))
        ws, cs = f.router(wep), f.router(cep)
        tasks: deque[p.Prompt] = deque()
        credits: deque[bytes] = deque()
        results: deque[p.GroupResult] = deque()
        pulls: deque[tuple[bytes, str]] = deque()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        seq = 0

        async def dispatch() -> None:
            nonlocal seq
            while tasks and credits:
                prompt = tasks.popleft()
                seq += 1
                await ws.send_multipart([credits.popleft(), *p.encode(p.Task(task_id=f"{prompt.prompt_id}@0", prompt=prompt))])

        async def answer() -> None:
            while pulls and results:
                ident, rid = pulls.popleft()
                groups = tuple(results.popleft() for _ in range(len(results)))
                await cs.send_multipart([ident, *p.encode(p.Batch(request_id=rid, epoch="x", groups=groups))])

        async def worker_loop() -> None:
            while True:
                ident, *frames = await ws.recv_multipart()
                m = p.decode(frames)
                if type(m) is p.Credit:
                    credits.extend([ident] * m.credits)
                    await dispatch()
                elif type(m) is p.Result:
                    results.append(p.GroupResult(prompt_id=m.prompt_id, state="done", trajectories=m.trajectories))
                    await answer()
                elif type(m) is p.Hello:
                    credits.extend([ident] * m.credits)
                    await ws.send_multipart([ident, *p.encode(p.Welcome(epoch="x", protocol=1, heartbeat_interval_s=1.0))])
                    await dispatch()

        async def client_loop() -> None:
            while True:
                ident, *frames = await cs.recv_multipart()
                m = p.decode(frames)
                if type(m) is p.Submit:
                    tasks.extend(m.prompts)
                    await cs.send_multipart([ident, *p.encode(p.SubmitReply(request_id=m.request_id, epoch="x", accepted=tuple(x.prompt_id for x in m.prompts)))])
                    await dispatch()
                elif type(m) is p.Pull:
                    pulls.append((ident, m.request_id))
                    await answer()

        loops = [asyncio.create_task(worker_loop()), asyncio.create_task(client_loop())]
        await stop.wait()
        for t in loops:
            t.cancel()
        ws.close(linger=0)
        cs.close(linger=0)
        ctx.destroy(linger=0)

    asyncio.run(main())


def start_server(kind: str, heartbeat_s: float = 1.0) -> tuple[subprocess.Popen[bytes], str, str]:
    wep, cep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--worker-endpoint", wep, "--client-endpoint", cep, "--heartbeat-s", str(heartbeat_s)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
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
    ctx.setsockopt(zmq.MAX_SOCKETS, 8192)
    f = p.SocketFactory(ctx, p.SocketOptions(send_hwm=100_000, recv_hwm=100_000))
    capacity = max(1, -(-window // n_workers))
    workers = []
    poller = zmq.Poller()
    for i in range(n_workers):
        s = f.dealer(wep, identity=f"bw{i}".encode())
        s.send_multipart(p.encode(p.Hello(worker_id=f"bw{i}", protocol_min=1, protocol_max=1, engine="zero", capacity=capacity, credits=capacity)))
        workers.append(s)
        poller.register(s, zmq.POLLIN)
    client = f.dealer(cep, identity=b"bench-client")
    poller.register(client, zmq.POLLIN)
    client.send_multipart(p.encode(p.ClientHello(client_id="bench", protocol_min=1, protocol_max=1)))
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
            client.send_multipart(p.encode(p.Submit(request_id=str(rid), prompts=(make_prompt(seq),))))
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
                    sock.send_multipart(p.encode(zero_latency_result(msg, sock.identity.decode())))
                    sock.send_multipart(credit_frames)
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


# --------------------------------------------------------------------------- driver


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return float(np.percentile(np.asarray(xs), q)) * 1000


def one_run(system: str, n_workers: int, seconds: float, redis_url: str | None, redis_pid: int | None) -> dict[str, Any]:
    window = max(64, n_workers)
    if system == "redis":
        assert redis_url is not None and redis_pid is not None
        c0 = proc_cpu_s(redis_pid)
        out = asyncio.run(run_redis_load(redis_url, n_workers, seconds, window))
        cpu = proc_cpu_s(redis_pid) - c0
    else:
        proc, wep, cep = start_server(system)
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


def scale_run(seconds: float, n_workers: int = 1000, rate: float = 2000.0) -> dict[str, Any]:
    proc, wep, cep = start_server("rollpool", heartbeat_s=1.0)
    try:
        time.sleep(0.3)
        out = run_zmq_load(wep, cep, n_workers, seconds, window=4096, heartbeat_s=1.0, rate_per_s=rate, status_at_end=True)
    finally:
        stop_server(proc)
    c = out["counters"]
    return {
        "workers": n_workers,
        "target_prompts_per_s": rate,
        "rt_per_s": out["rt"] / out["elapsed_s"],
        "p50_ms": pct(out["latencies"], 50),
        "p99_ms": pct(out["latencies"], 99),
        "false_dead": int(c.get("workers_lost", -1)),
        "workers_alive": int(c.get("workers_alive", -1)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 reps of 1.5 s per cell and a 7 s scale run (< 3 minutes)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--workers", default="1,16,256")
    ap.add_argument("--systems", default="rollpool,redis,trivial")
    ap.add_argument("--no-scale", action="store_true")
    ap.add_argument("--scale-seconds", type=float, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--client-endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve == "rollpool":
        serve_rollpool(args.worker_endpoint, args.client_endpoint, args.heartbeat_s)
        return 0
    if args.serve == "trivial":
        serve_trivial(args.worker_endpoint, args.client_endpoint)
        return 0

    reps = args.reps or 3
    seconds = args.seconds or (1.5 if args.quick else 4.0)
    scale_seconds = args.scale_seconds or (7.0 if args.quick else 15.0)
    worker_counts = [int(x) for x in args.workers.split(",")]
    systems = args.systems.split(",")
    t0 = time.perf_counter()

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
                    r = one_run(system, n, seconds, redis_url, redis_pid)
                    runs.setdefault((system, n), []).append(r)
                    print(f"  rep {rep} {system:9s} {n:4d} workers: {r['rt_per_s']:8.0f} rt/s  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  cpu {r['cpu_us_per_rt']:.1f} us/rt", file=sys.stderr)
    finally:
        if redis_ctx is not None:
            redis_ctx.stop()

    def med(system: str, n: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[(system, n)])

    def ratio_med(a: str, b: str, n: int) -> float:
        # ratios per repetition (interleaved pairs), then the median
        return statistics.median(x["rt_per_s"] / y["rt_per_s"] for x, y in zip(runs[(a, n)], runs[(b, n)], strict=True))

    print()
    header = f"{'workers':>7} | {'system':<9} | {'rt/s':>8} | {'p50 ms':>7} | {'p99 ms':>7} | {'broker CPU us/rt':>16}"
    print(header)
    print("-" * len(header))
    for n in worker_counts:
        for system in systems:
            print(f"{n:>7} | {system:<9} | {med(system, n, 'rt_per_s'):>8.0f} | {med(system, n, 'p50_ms'):>7.2f} | {med(system, n, 'p99_ms'):>7.2f} | {med(system, n, 'cpu_us_per_rt'):>16.1f}")
        if "redis" in systems and "rollpool" in systems:
            print(f"{'':>7}   rollpool / redis streams: {ratio_med('rollpool', 'redis', n):.2f}", end="")
        if "trivial" in systems and "rollpool" in systems:
            print(f"   rollpool / trivial: {ratio_med('rollpool', 'trivial', n):.2f}", end="")
        print()

    scale: dict[str, Any] = {}
    if not args.no_scale:
        scale = scale_run(scale_seconds)
        print(
            f"\nscale: {scale['workers']} workers heartbeating at 1 s, {scale['target_prompts_per_s']:.0f} prompts/s offered: "
            f"{scale['rt_per_s']:.0f} rt/s, p50 {scale['p50_ms']:.2f} ms, p99 {scale['p99_ms']:.2f} ms, "
            f"false dead-worker detections {scale['false_dead']} (alive at end {scale['workers_alive']})"
        )
    head_n = 16 if 16 in worker_counts else worker_counts[0]
    out: dict[str, Any] = {
        "bench": "broker",
        "workers_headline": head_n,
        "reps": reps,
        "seconds_per_run": seconds,
        "rollpool_rt_per_s": round(med("rollpool", head_n, "rt_per_s"), 1) if "rollpool" in systems else None,
        "redis_streams_rt_per_s": round(med("redis", head_n, "rt_per_s"), 1) if "redis" in systems else None,
        "trivial_rt_per_s": round(med("trivial", head_n, "rt_per_s"), 1) if "trivial" in systems else None,
        "ratio": round(ratio_med("rollpool", "redis", head_n), 3) if {"rollpool", "redis"} <= set(systems) else None,
        "vs_trivial": round(ratio_med("rollpool", "trivial", head_n), 3) if {"rollpool", "trivial"} <= set(systems) else None,
        "p50_ms": round(med("rollpool", head_n, "p50_ms"), 3) if "rollpool" in systems else None,
        "p99_ms": round(med("rollpool", head_n, "p99_ms"), 3) if "rollpool" in systems else None,
        "broker_cpu_us_per_rt": round(med("rollpool", head_n, "cpu_us_per_rt"), 1) if "rollpool" in systems else None,
        "false_dead_1000": scale.get("false_dead"),
        "scale": scale,
        "by_workers": {
            f"{system}:{n}": {k: round(med(system, n, k), 3) for k in ("rt_per_s", "p50_ms", "p99_ms", "cpu_us_per_rt")}
            for system in systems
            for n in worker_counts
        },
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    print(f"\n(elapsed {out['elapsed_s']} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
