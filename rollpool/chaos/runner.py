"""The chaos run: a whole pool on loopback under seeded random faults, checked end to end.

Processes (each a real ``python -m rollpool.cli ...`` child): a Redis-compatible
server, the broker, a weight relay and four sim workers (these under the
launcher's `Supervisor`, with no restarts of their own: the fault loop kills,
pauses and starts them; logs ``<name>.log`` in the work folder); in this process: the
trainer client (``TrainerClient``, hosting the weight publisher through
``publish_weights``) and the link-fault proxy between the workers and the
broker's worker port (`rollpool.chaos.proxy`; netem is not available here).

Faults, one at a time, chosen by a seeded RNG (each kind once, in a shuffled
order, before any kind repeats): SIGKILL of a worker (restarted),
SIGSTOP/SIGCONT of a worker (sometimes past the broker's dead-after), SIGKILL
of the broker (restarted on the same endpoints; the client resubmits), SIGKILL
of the relay while workers fetch through it (restarted), Redis stop and start,
and link delay and loss windows on the worker links (`CLASSIC_FAULTS`, the
default). The faults of lost and reordered messages, stalls and bad versions (`ISSUE20_FAULTS`, opt-in
with ``faults``; ``--faults issue20`` on the command line):

- ``msg_drop``, ``msg_duplicate``, ``msg_delay``, ``msg_reorder``: for 1-2 s,
  every rollpool message on every port (broker worker and client ports,
  publisher and relay router and PUB), in both directions, meets that fault
  with one of ``message_fault_rates``; ``conn_reset``: every live connection
  of one port is aborted with an RST. Both through a `FaultyZmtpProxy` (a
  fake link at the edge, `rollpool.chaos.zmtp_proxy`) in front of each port;
- ``broker_stop``: SIGSTOP of the broker for ``broker_stop_s`` (3-30 s), then SIGCONT;
- ``cancel_call``: for 1-2 s the trainer cancels its ``get_batch`` calls
  after 5-300 ms (``asyncio.wait_for``), as a trainer with its own deadline would;
- ``publisher_restart``: at the next step the trainer's publisher comes back
  on new ports; the relay's upstream is pointed at it, and every other worker
  fetches directly from wherever the broker says the publisher is;
- ``poison_version``: the next version names a parameter no worker's model has;
- ``hung_apply``: one worker's next apply hangs ``hung_apply_s`` seconds.
  Both need the fake engine at the worker's edge (`rollpool.chaos.faulty_engine`,
  ``--engine sim-chaos``), which the run then starts its workers with.

With ``poisoned_agents`` (a share of the prompts), the workers run episodes (`rollpool.chaos.agents`) on the
sim-chaos engine, and the agent of each such prompt sends poisoned requests (NaN and infinite temperatures, a
seed past int64, a top-k past int32) before its real turn: each must be refused alone. The result counts the
refusals and the engine restarts (``engine_restarts``, from the workers' logs: a restart caused by a request
is the failure this mode looks for).

The result reports per fault kind its count, per port, direction and message
type the messages dropped, duplicated, delayed and reordered
(``message_faults``; with ``every_message_action`` the run goes on until each
of the four is above 0), the calls cancelled, submit-to-terminal times
(``terminal_s``: median, p99, worst) and the terminal bound
(``terminal_bound``, see `_terminal_bound`): per prompt, the time from the
last fault's clear to terminal, less its own generation time, against
``5 x heartbeat_interval_s + apply_slot_deadline_s``; ``stuck`` counts the
prompts over it plus those never terminal.

What is checked (the trainer's view): every accepted prompt reaches a terminal
state (`lost` counts those that do not), no trajectory id is handed to the
trainer twice (`duplicated`), and every trajectory the trainer consumes is
within the staleness bound eta (`staleness_violations`; a group over the bound
is dropped by the trainer's hard check and counted in `dropped_stale`, a
terminal state). The result also records, per fault, the detection and
recovery times seen from the trainer's side (a status poller every
``poll_interval_s``, so times have that resolution).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import logging
import math
import os
import pathlib
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rollpool.launch.supervisor import ProcessSpec, Supervisor

__all__ = ["ChaosConfig", "run_chaos"]

log = logging.getLogger(__name__)

CLASSIC_FAULTS = ("kill_worker", "stop_worker", "kill_broker", "kill_relay", "redis_outage", "link_delay", "link_loss")
"""The faults the pool survives today (the default, and the CI run)."""
MESSAGE_FAULTS = ("msg_drop", "msg_duplicate", "msg_delay", "msg_reorder", "conn_reset")
"""Per-message faults and connection resets on live connections, every port, both directions (`FaultyZmtpProxy`)."""
ISSUE20_FAULTS = (*MESSAGE_FAULTS, "broker_stop", "cancel_call", "publisher_restart", "poison_version", "hung_apply")
"""Lost, duplicated and reordered messages, stalls and bad versions: the faults the reconciliation repairs
(``--faults issue20``, named after where they were first listed)."""
FAULT_KINDS = (*CLASSIC_FAULTS, *ISSUE20_FAULTS)


@dataclass(frozen=True)
class ChaosConfig:
    prompts: int = 2000
    seed: int = 0
    workers: int = 4
    group_size: int = 2
    batch_size: int = 64
    """B: samples per trainer step; the trainer publishes a new version every B consumed samples."""
    max_staleness: int = 2
    fault_interval_s: float = 1.5
    heartbeat_interval_s: float = 0.25
    task_timeout_s: float = 5.0
    window_prompts: int = 48
    """Most prompts submitted and not yet terminal."""
    weight_bytes: int = 1 << 20
    decode_s_per_token: float = 0.05
    length_median: int = 8
    poll_interval_s: float = 0.1
    deadline_s: float = 600.0
    drain_s: float = 60.0
    """No new prompts this long before `deadline_s`: a run cut short by its deadline reports the prompts it took,
    each terminal (``cut_short``), instead of counting the ones still open as lost."""
    faults: tuple[str, ...] = CLASSIC_FAULTS
    workdir: str | None = None
    message_fault_rates: tuple[float, ...] = (0.01, 0.05, 0.1)
    """Per-message probability of the fault during one msg_* window (one value chosen per window)."""
    broker_stop_s: tuple[float, float] = (3.0, 30.0)
    """SIGSTOP of the broker lasts uniformly this long (CI: 3-5 s)."""
    min_faults: int = 0
    """Keep running (pulling, injecting) until at least this many faults were injected."""
    hung_apply_s: float = 10.0
    """How long a hung apply (SIGUSR1 to a worker on the sim-chaos engine) waits before it proceeds."""
    apply_slot_deadline_s: float = 5.0
    """The broker's `apply_slot_deadline_s` (a hung apply frees its slot after this); a term of the terminal bound.
    The workers' `apply_timeout_s` is set 1 s below it (a longer hang restarts the engine: its tasks go back)."""
    result_resend_s: float = 1.0
    """The broker's `result_resend_s`: a Batch lost on the client port is sent again this long after (within the bound)."""
    every_message_action: bool = True
    """With message faults: keep running until each of dropped, duplicated, delayed and reordered is above 0."""
    poisoned_agents: float = 0.0
    """The share of prompts whose agent sends poisoned requests first (0: the workers run no episodes; above 0 they
    run `rollpool.chaos.agents:chaos_agent` on the sim-chaos engine)."""

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"ChaosConfig.faults: unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")
        lo, hi = self.broker_stop_s
        if not 0 < lo <= hi:
            raise ValueError(f"ChaosConfig.broker_stop_s must be (low, high) with 0 < low <= high, got {self.broker_stop_s}")
        if not self.message_fault_rates or not all(0 < r <= 1 for r in self.message_fault_rates):
            raise ValueError(f"ChaosConfig.message_fault_rates must be probabilities in (0, 1], got {self.message_fault_rates}")
        if not 0 <= self.poisoned_agents <= 1:
            raise ValueError(f"ChaosConfig.poisoned_agents must be a share in [0, 1], got {self.poisoned_agents}")


_MESSAGE_ACTIONS = {"msg_drop": "drop", "msg_duplicate": "duplicate", "msg_delay": "delay", "msg_reorder": "reorder"}


def _spread(values: list[float]) -> dict[str, float]:
    """Median, p99 and worst of submit-to-terminal seconds, as the trainer saw them."""
    if not values:
        return {}
    v = sorted(values)
    return {"median": round(v[len(v) // 2], 3), "p99": round(v[min(len(v) - 1, int(len(v) * 0.99))], 3),
            "max": round(v[-1], 3), "n": len(v)}


def _terminal_bound(cfg: ChaosConfig, fault_log: list[dict[str, Any]], submitted_at: dict[str, float],
                    terminal_at: dict[str, float], gen_s: dict[str, float]) -> dict[str, Any]:
    """The terminal bound, checked per prompt: after a fault clears, every prompt is terminal within
    ``5 x heartbeat_interval_s + apply_slot_deadline_s`` plus its own generation time.

    For each fault's clear ``c`` and each prompt open at it (submitted before, not terminal yet), the bound
    applies unless the next fault started before the prompt ended and before the bound ran out (then the
    next clear takes over): such a (clear, prompt) pair is ``checked``, the others ``superseded``. ``excess``
    is the time from the clear to the trainer seeing the prompt terminal (the client's pull cadence
    included) less the group's own generation time (its trajectories' ``finished_at - started_at`` as the
    worker's engine timed it; simulated here); ``over_bound`` counts the prompts with a checked excess above
    the bound; ``never_terminal`` those whose bound after a clear ran out with the prompt never terminal. A fault
    the run ended inside (``unfinished``: a start, maybe no clear) still supersedes the clear before it, or a broker
    stop under way at the end would count against the previous fault's bound.
    ``worst_cases``: the largest excesses, each with the fault whose clear it was checked against.
    """
    formula = "5 x heartbeat_interval_s + apply_slot_deadline_s + generation time"
    limit = 5 * cfg.heartbeat_interval_s + cfg.apply_slot_deadline_s
    starts = sorted(r["_t0"] for r in fault_log if "_t0" in r)  # a fault the run ended inside has no clear
    clears = sorted(r["_clear"] for r in fault_log if "_t0" in r and "_clear" in r)
    kind_at = {r["_clear"]: f'{r.get("kind", "?")} (injected at {r.get("at_s")} s)' for r in fault_log if "_t0" in r and "_clear" in r}
    excess: list[tuple[float, str]] = []
    since: list[float] = []
    over: set[str] = set()
    cases: list[dict[str, Any]] = []
    never: set[str] = set()
    superseded = 0
    for pid, s in submitted_at.items():
        t = terminal_at.get(pid, math.inf)
        gen = gen_s.get(pid, 0.0)
        for c in clears[bisect.bisect_right(clears, s):bisect.bisect_left(clears, t)]:
            j = bisect.bisect_right(starts, c)
            nxt = starts[j] if j < len(starts) else math.inf
            if nxt < min(t, c + limit + gen):
                superseded += 1
                continue
            if t == math.inf:
                never.add(pid)
                continue
            since.append(t - c)
            excess.append((t - c - gen, pid))
            cases.append({"prompt": pid, "after": kind_at.get(c, "?"), "excess_s": round(t - c - gen, 3),
                          "generation_s": round(gen, 3), "submitted_before_clear_s": round(c - s, 3)})
            if t - c - gen > limit:
                over.add(pid)
    worst = max(excess, default=(0.0, ""))
    return {
        "formula": formula,
        "heartbeat_interval_s": cfg.heartbeat_interval_s,
        "apply_slot_deadline_s": cfg.apply_slot_deadline_s,
        "bound_s": round(limit, 3),
        "checked": len(excess),
        "superseded": superseded,
        "prompts_checked": len({pid for _, pid in excess}),
        "since_clear_s": _spread(since),
        "excess_s": _spread([e for e, _ in excess]),
        "worst_excess_s": round(worst[0], 3),
        "worst_prompt": worst[1],
        "worst_generation_s": round(gen_s.get(worst[1], 0.0), 3),
        "over_bound": len(over),
        "worst_cases": sorted(cases, key=lambda r: -r["excess_s"])[:10],
        "never_terminal": len(never),
        "within_bound": not over and not never,
    }


def _engine_restarts(workdir: str, workers: list[str]) -> int:
    """Engine restarts in the workers' logs (their supervisors log each: "engine failed (...); ... restarting it")."""
    n = 0
    for w in workers:
        with contextlib.suppress(OSError):
            n += pathlib.Path(workdir, f"{w}.log").read_text(errors="replace").count("engine failed (")
    return n


_HANDED_OUT: set[int] = set()


def _free_port() -> int:
    """A free loopback port not handed out before in this process (the OS may offer a closed one twice)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no fresh loopback port after 100 tries")


@dataclass
class _Observed:
    """What the status poller saw: per worker id, the last time it was listed; the broker epoch."""

    alive: dict[str, bool] = field(default_factory=dict)
    epoch: str = ""
    delivered_at: list[float] = field(default_factory=list)


async def run_chaos(cfg: ChaosConfig) -> dict[str, Any]:  # noqa: C901 (one driver, read top to bottom)
    import zmq.asyncio

    from rollpool.chaos.faulty_engine import POISON_NAME
    from rollpool.chaos.proxy import MessageProxy
    from rollpool.chaos.zmtp_proxy import ACTIONS, FaultyZmtpProxy, MessageFaults
    from rollpool.monitor.embedded import EmbeddedRedis
    from rollpool.protocol import GroupState, SocketFactory, trajectory_staleness
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig

    rng = random.Random(cfg.seed)
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="rollpool-chaos-")
    os.makedirs(workdir, exist_ok=True)
    py = [sys.executable, "-m", "rollpool.cli", "--log-level", "WARNING"]
    ports = {k: _free_port() for k in ("bw", "bc", "proxy", "pub_r", "pub_p", "relay_r", "relay_p", "redis")}
    ep = {k: f"tcp://127.0.0.1:{p}" for k, p in ports.items()}
    hb = cfg.heartbeat_interval_s
    faults = set(cfg.faults)

    # message faults: a FaultyZmtpProxy in front of every port (the workers' link keeps the MessageProxy behind it)
    zproxies: dict[str, FaultyZmtpProxy] = {}

    def via(port_name: str, key: str) -> str:
        if not faults & set(MESSAGE_FAULTS):
            return ep[key]
        px = FaultyZmtpProxy(port_name, ep[key], listen_port=_free_port(), seed=rng.randrange(1 << 30))
        zproxies[port_name] = px
        return f"tcp://127.0.0.1:{px.listen[1]}"

    worker_port = via("broker:worker", "proxy")
    client_port = via("broker:client", "bc")
    upstream_router, upstream_pub = via("publisher:router", "pub_r"), via("publisher:pub", "pub_p")
    relay_router, relay_pub = via("relay:router", "relay_r"), via("relay:pub", "relay_p")

    redis = EmbeddedRedis(port=ports["redis"]).start()
    redis_url = redis.url
    broker_argv = [*py, "broker", "--worker-endpoint", ep["bw"], "--client-endpoint", ep["bc"],
                              "--heartbeat-interval-s", str(hb), "--task-timeout-s", str(cfg.task_timeout_s),
                              "--max-attempts", "50", "--batch-size", str(cfg.batch_size),
                              "--max-staleness", str(cfg.max_staleness), "--max-applying", str(cfg.workers),
                              "--apply-slot-deadline-s", str(cfg.apply_slot_deadline_s), "--result-resend-s", str(cfg.result_resend_s),
                              "--drain-timeout-s", "0", "--redis-url", redis_url]

    def relay_argv(up_router: str, up_pub: str) -> list[str]:
        return [*py, "relay", "--upstream", up_router, "--upstream-pub", up_pub, "--bind", ep["relay_r"],
                "--bind-pub", ep["relay_p"], "--fetch-timeout-s", "2", "--poll-interval-s", "0.5", "--redis-url", redis_url]

    # the apply faults need the fake engine at the worker's edge (rollpool.chaos.faulty_engine: sim + poison + hang)
    chaos_engine = bool(faults & {"poison_version", "hung_apply"}) or cfg.poisoned_agents > 0
    episode = ("--episode", "rollpool.chaos.agents:chaos_agent") if cfg.poisoned_agents > 0 else ()
    poison_every = max(1, round(1 / cfg.poisoned_agents)) if cfg.poisoned_agents > 0 else 0
    worker_py = [sys.executable, "-m", "rollpool.chaos", "--log-level", "WARNING"] if chaos_engine else py
    engine = "sim-chaos" if chaos_engine else "sim"
    hang = f",hang_apply_s={cfg.hung_apply_s}" if chaos_engine else ""
    # with publisher restarts, every other worker fetches from where the broker says the publisher is (no relay)
    direct = {i for i in range(cfg.workers) if "publisher_restart" in faults and i % 2 == 1}
    worker_argvs = [
        [*worker_py, "worker", "--engine", engine, "--broker", worker_port, "--worker-id", f"chaos-w{i}",
                        "--heartbeat-interval-s", str(hb), "--reconnect-backoff-s", "0.1", "--reconnect-backoff-max-s", "1",
                        "--fetch-timeout-s", "2", "--drain-timeout-s", "1", "--apply-grant-timeout-s", "2",
                        "--apply-timeout-s", str(max(0.5, cfg.apply_slot_deadline_s - 1)),
                        *(() if i in direct else ("--weight-endpoint", relay_router, "--weight-announce-endpoint", relay_pub)),
                        "--engine-options",
                        f"decode_s_per_token={cfg.decode_s_per_token},length_median={cfg.length_median},seed={i}{hang}",
                        *episode, "--redis-url", redis_url]
        for i in range(cfg.workers)
    ]
    # the launcher's Supervisor, with restarts left to the fault loop (it kills, pauses and starts children itself)
    workers = [f"w{i}" for i in range(cfg.workers)]
    specs = [ProcessSpec("broker", tuple(broker_argv), restart=False),
             ProcessSpec("relay", tuple(relay_argv(upstream_router, upstream_pub)), restart=False),
             *(ProcessSpec(w, tuple(argv), restart=False) for w, argv in zip(workers, worker_argvs, strict=True))]
    procs = Supervisor(specs, pathlib.Path(workdir), stop_timeout_s=5.0, state_file=None, label="rollpool chaos")
    procs_run: asyncio.Task[int] | None = None

    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    proxy = MessageProxy(sockets, frontend=ep["proxy"], backend=ep["bw"], seed=cfg.seed)
    client_cfg = TrainerClientConfig(
        broker=client_port, client_id="chaos-trainer", request_timeout_s=1.0, request_retries=60, pull_wait_s=0.2,
        weight_router_endpoint=ep["pub_r"], weight_pub_endpoint=ep["pub_p"], bucket_bytes=max(cfg.weight_bytes, 1 << 20),
    )
    client: TrainerClient | None = None
    fault_log: list[dict[str, Any]] = []
    observed = _Observed()
    accepted: set[str] = set()
    terminal: dict[str, str] = {}
    traj_seen: Counter[str] = Counter()
    staleness_hist: Counter[int] = Counter()
    violations = 0
    dropped_stale = 0
    done = asyncio.Event()
    t_start = time.monotonic()
    poisoned_submitted = poison_refused = poisoned_done = 0
    submitted_at: dict[str, float] = {}
    terminal_s: list[float] = []
    terminal_at: dict[str, float] = {}
    """When the trainer saw each prompt terminal (monotonic)."""
    gen_s: dict[str, float] = {}
    """Each DONE group's own generation time, from its trajectories (worker clock: finished_at - started_at)."""
    hangs: list[dict[str, Any]] = []
    """hung_apply records whose hang starts with the next apply (the next publish clears them, see below)."""
    publish_faults: list[dict[str, Any]] = []
    """publisher_restart / poison_version records the trainer loop carries out at its next publish."""
    cancel_until = [0.0]
    cancelled_calls = [0]

    try:
        for px in zproxies.values():
            await px.start()
        procs_run = asyncio.create_task(procs.run(), name="chaos.supervisor")
        await procs.wait_started()
        await proxy.start()
        client = TrainerClient(config=client_cfg, sockets=sockets)
        await client.connect()
        version = 0
        weights = {"w": np.zeros(cfg.weight_bytes // 4, dtype=np.float32)}
        import torch

        tensors = {"w": torch.from_numpy(weights["w"])}
        await client.publish_weights(tensors, version)

        async def poll_loop() -> None:
            assert client is not None
            while not done.is_set():
                with contextlib.suppress(Exception):
                    st = await client.status()
                    observed.epoch = str(st["epoch"])
                    observed.alive = {w: True for w in st["workers"]}
                await asyncio.sleep(cfg.poll_interval_s)

        async def wait_until(pred: Any, timeout_s: float) -> float | None:
            t0 = time.monotonic()
            while time.monotonic() - t0 < timeout_s:
                if pred():
                    return time.monotonic() - t0
                await asyncio.sleep(cfg.poll_interval_s / 2)
            return None

        async def restart_publisher() -> dict[str, Any]:
            """The trainer's publisher comes back on new ports; the relay's upstream follows it, workers must."""
            assert client is not None
            # TrainerClient has no public way to restart its publisher: close it and let publish_weights make a new one
            old = client._publisher
            if old is not None:
                await old.close()
            client._publisher = None
            new_r, new_p = _free_port(), _free_port()
            client.config = dataclasses.replace(client.config, weight_router_endpoint=f"tcp://127.0.0.1:{new_r}",
                                                weight_pub_endpoint=f"tcp://127.0.0.1:{new_p}")
            if "publisher:router" in zproxies:  # the relay dials the proxies: point them at the new ports
                zproxies["publisher:router"].upstream = ("127.0.0.1", new_r)
                zproxies["publisher:pub"].upstream = ("127.0.0.1", new_p)
                zproxies["publisher:router"].reset(count=False)
                zproxies["publisher:pub"].reset(count=False)
            else:  # the relay is told its new upstream, as an operator would
                await procs.kill("relay")
                await procs.start("relay", relay_argv(f"tcp://127.0.0.1:{new_r}", f"tcp://127.0.0.1:{new_p}"))
            return {"router_port": new_r, "pub_port": new_p}

        def delivered_since(t: float) -> bool:
            return bool(observed.delivered_at) and observed.delivered_at[-1] > t

        deck: list[str] = []
        injecting: list[dict[str, Any]] = []  # the fault under way, if any: logged even when the run ends inside it

        async def fault_loop() -> None:  # noqa: C901 - grandfathered: one branch per fault kind
            while not done.is_set():
                await asyncio.sleep(cfg.fault_interval_s * rng.uniform(0.5, 1.5))
                if done.is_set():
                    return
                if not deck:  # every kind once, in a seeded order, before any repeats
                    deck.extend(rng.sample(cfg.faults, len(cfg.faults)))
                kind = deck.pop()
                rec: dict[str, Any] = {"kind": kind, "at_s": round(time.monotonic() - t_start, 3)}
                t0 = time.monotonic()
                rec["_t0"] = t0
                injecting[:] = [rec]
                if kind in ("kill_worker", "stop_worker"):
                    w = rng.choice(workers)
                    wid = "chaos-" + w
                    rec["target"] = wid
                    if kind == "kill_worker":
                        await procs.kill(w)
                        rec["detect_s"] = await wait_until(lambda wid=wid: wid not in observed.alive, 10)
                        await asyncio.sleep(rng.uniform(0.0, 1.0))
                        await procs.start(w)
                        rec["_clear"] = time.monotonic()
                    else:
                        pause = rng.choice((0.3, 0.5, 1.5, 2.5))  # dead-after is 3 heartbeats = 0.75 s
                        rec["pause_s"] = pause
                        procs.send_signal(w, signal.SIGSTOP)
                        rec["detect_s"] = await wait_until(lambda wid=wid: wid not in observed.alive, pause)
                        await asyncio.sleep(max(0.0, pause - (time.monotonic() - t0)))
                        procs.send_signal(w, signal.SIGCONT)
                        rec["_clear"] = time.monotonic()
                    rec["recover_s"] = await wait_until(lambda wid=wid: wid in observed.alive, 20)
                elif kind == "kill_broker":
                    old = observed.epoch
                    await procs.kill("broker")
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
                    await procs.start("broker")
                    rec["_clear"] = time.monotonic()
                    rec["detect_s"] = await wait_until(lambda old=old: observed.epoch not in ("", old), 30)
                    rec["recover_s"] = await wait_until(lambda t0=t0, old=old: delivered_since(t0 + 0.001) and observed.epoch != old, 60)
                elif kind == "kill_relay":
                    await procs.kill("relay")
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
                    await procs.start("relay")
                    rec["_clear"] = time.monotonic()
                    rec["recover_s"] = await wait_until(lambda t0=t0: delivered_since(t0), 30)
                elif kind == "redis_outage":
                    redis.stop()
                    n0 = len(observed.delivered_at)
                    await asyncio.sleep(rng.uniform(0.5, 1.5))
                    rec["groups_during_outage"] = len(observed.delivered_at) - n0
                    redis.start()
                elif kind in _MESSAGE_ACTIONS:
                    rate = rng.choice(cfg.message_fault_rates)
                    window = rng.uniform(1.0, 2.0)
                    rec.update(rate=rate, window_s=round(window, 3), ports=sorted(zproxies))
                    for px in zproxies.values():
                        px.faults = MessageFaults(delay_s=0.05)
                        setattr(px.faults, _MESSAGE_ACTIONS[kind], rate)
                    n0 = len(observed.delivered_at)
                    await asyncio.sleep(window)
                    for px in zproxies.values():
                        px.faults = MessageFaults()
                    rec["groups_during_window"] = len(observed.delivered_at) - n0
                elif kind == "conn_reset":
                    name = rng.choice(sorted(zproxies))
                    rec.update(port=name, connections=zproxies[name].reset())
                elif kind == "broker_stop":
                    pause = rng.uniform(*cfg.broker_stop_s)
                    rec["pause_s"] = round(pause, 3)
                    procs.send_signal("broker", signal.SIGSTOP)
                    await asyncio.sleep(pause)
                    procs.send_signal("broker", signal.SIGCONT)
                    t1 = rec["_clear"] = time.monotonic()
                    rec["recover_s"] = await wait_until(lambda t1=t1: delivered_since(t1), 20)
                elif kind == "cancel_call":
                    window = rng.uniform(1.0, 2.0)
                    c0 = cancelled_calls[0]
                    cancel_until[0] = time.monotonic() + window
                    await asyncio.sleep(window)
                    rec.update(window_s=round(window, 3), cancelled=cancelled_calls[0] - c0)
                elif kind in ("publisher_restart", "poison_version"):
                    publish_faults.append(rec)  # the trainer loop carries it out at its next publish
                elif kind == "hung_apply":
                    w = rng.choice(workers)
                    rec.update(target="chaos-" + w, hang_s=cfg.hung_apply_s)
                    procs.send_signal(w, signal.SIGUSR1)  # rollpool.chaos.faulty_engine: the next apply hangs
                    hangs.append(rec)
                else:
                    if kind == "link_delay":
                        proxy.faults.delay_s = rng.choice((0.01, 0.05, 0.1))
                        rec["delay_s"] = proxy.faults.delay_s
                    else:
                        proxy.faults.loss = rng.choice((0.01, 0.05, 0.1))
                        rec["loss"] = proxy.faults.loss
                    n0 = len(observed.delivered_at)
                    await asyncio.sleep(rng.uniform(1.0, 2.0))
                    rec["groups_during_window"] = len(observed.delivered_at) - n0
                    proxy.faults.delay_s, proxy.faults.loss = 0.0, 0.0
                rec["took_s"] = round(time.monotonic() - t0, 3)
                if kind not in ("publisher_restart", "poison_version", "hung_apply"):
                    rec.setdefault("_clear", time.monotonic())  # the fault is over (window closed, process back, reset done)
                for k in ("detect_s", "recover_s"):
                    if isinstance(rec.get(k), float):
                        rec[k] = round(rec[k], 3)
                fault_log.append(rec)
                injecting.clear()
                log.info("chaos: %s", rec)

        bg = [asyncio.create_task(poll_loop(), name="chaos.poll_loop"), asyncio.create_task(fault_loop(), name="chaos.fault_loop")]
        submitted = 0
        consumed_samples = 0
        done_recs: list[dict[str, Any]] = []
        prompt_rng = np.random.default_rng(cfg.seed)
        def every_action_seen() -> bool:
            if not (cfg.every_message_action and faults & set(_MESSAGE_ACTIONS)):
                return True
            return all(sum(px.total(a) for px in zproxies.values()) > 0 for a in ("dropped", "duplicated", "delayed", "reordered"))

        cut = [False]

        def more() -> bool:
            if not cut[0] and time.monotonic() - t_start > cfg.deadline_s - cfg.drain_s:
                cut[0] = submitted < cfg.prompts or len(fault_log) < cfg.min_faults or not every_action_seen()
                if cut[0]:
                    log.warning("chaos: %d s left: no new prompts (%d of %d taken), draining", cfg.drain_s, submitted, cfg.prompts)
            # by ids, not counts: a submit retried after its reply was lost sees its own prompts as duplicates, so
            # terminal can hold ids `accepted` lacks (a count would end the run with accepted prompts still open)
            open_ids = not accepted.issubset(terminal.keys())
            if cut[0]:
                return open_ids
            return (len(terminal) < cfg.prompts or open_ids or len(fault_log) < cfg.min_faults
                    or not every_action_seen())

        while more():
            if time.monotonic() - t_start > cfg.deadline_s:
                log.error("chaos: deadline passed with %d of %d terminal", len(terminal), len(accepted))
                break
            open_prompts = len(accepted) - len(terminal)
            if submitted < cfg.prompts and open_prompts < cfg.window_prompts and not cut[0]:
                n = min(cfg.window_prompts - open_prompts, cfg.prompts - submitted, 128)
                items = [
                    {"prompt_id": f"c{cfg.seed}-{submitted + i}", "input_ids": prompt_rng.integers(1, 1000, 8).tolist(),
                     "metadata": {"poison": 1} if poison_every and (submitted + i) % poison_every == 0 else {}}
                    for i in range(n)
                ]
                poisoned_submitted += sum(1 for it in items if it["metadata"])
                res = await client.submit(items, group_size=cfg.group_size, sampling={"max_new_tokens": 32})
                accepted.update(res.accepted)
                t_sub = time.monotonic()
                for pid in res.accepted:
                    submitted_at.setdefault(pid, t_sub)
                submitted += n
                if res.rejected:
                    log.warning("chaos: %d prompts rejected: %s", len(res.rejected), list(res.rejected.items())[:3])
            want = max(1, min(8, len(accepted) - len(terminal)))
            try:
                if time.monotonic() < cancel_until[0]:  # cancel_call: the trainer gives up on calls at random
                    try:
                        batch = await asyncio.wait_for(client.get_batch(want, timeout=1.0), rng.uniform(0.005, 0.3))
                    except TimeoutError:
                        cancelled_calls[0] += 1
                        continue
                else:
                    batch = await client.get_batch(want, timeout=1.0)
            except TimeoutError:
                continue
            now = time.monotonic()
            for g in batch.groups:
                observed.delivered_at.append(now)
                worst = max(trajectory_staleness(client.version, t.token_versions) for t in g.trajectories)
                staleness_hist[worst] += 1
                for t in g.trajectories:
                    traj_seen[t.trajectory_id] += 1
                    poison_refused += int(t.metadata.get("poison_refused", 0))
                poisoned_done += any(t.metadata.get("poison") for t in g.trajectories)
                if g.prompt_id in terminal:
                    traj_seen["group:" + g.prompt_id] += 1  # a whole group handed over twice
                if g.prompt_id not in terminal and g.prompt_id in submitted_at:
                    terminal_s.append(now - submitted_at[g.prompt_id])
                    terminal_at[g.prompt_id] = now
                    starts = [t.started_at for t in g.trajectories if t.started_at > 0]
                    ends = [t.finished_at for t in g.trajectories if t.finished_at > 0]
                    gen_s[g.prompt_id] = max(0.0, max(ends) - min(starts)) if starts and ends else 0.0
                if worst > cfg.max_staleness:
                    dropped_stale += 1  # the trainer's hard bound: not trained on
                    terminal[g.prompt_id] = GroupState.DROPPED_STALE
                    continue
                terminal[g.prompt_id] = GroupState.DONE
                consumed_samples += len(g.trajectories)
            for g in batch.other:
                if g.prompt_id not in terminal and g.prompt_id in submitted_at:
                    terminal_s.append(now - submitted_at[g.prompt_id])
                    terminal_at.setdefault(g.prompt_id, now)
                terminal.setdefault(g.prompt_id, g.state)
            if consumed_samples >= cfg.batch_size:
                consumed_samples -= cfg.batch_size
                version += 1
                payload: dict[str, Any] = tensors
                while publish_faults:
                    rec = publish_faults.pop(0)
                    rec["version"] = version
                    if rec["kind"] == "publisher_restart":
                        rec.update(await restart_publisher())
                    else:
                        payload = {**tensors, POISON_NAME: torch.zeros(4)}  # a name no worker's model has
                    rec["_t0"] = time.monotonic()
                    done_recs.append(rec)
                await client.publish_weights(payload, version)
                t_pub = time.monotonic()
                for rec in done_recs:  # carried out with this publish: over once it is announced
                    rec["_clear"] = t_pub
                done_recs.clear()
                for rec in hangs:  # the hang starts with the apply of this version; the slot deadline bounds it
                    rec["_t0"] = rec["_clear"] = t_pub
                    rec["version"] = version
                hangs.clear()
        done.set()
        for task in bg:
            task.cancel()
        for task in bg:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for rec in injecting:  # the run ended inside it: its start still supersedes the clear before it
            rec["unfinished"] = True
            fault_log.append(rec)
        # consumed staleness must be within the bound (the trainer never trains past eta)
        violations = sum(c for s, c in staleness_hist.items() if s > cfg.max_staleness) - dropped_stale
        elapsed = time.monotonic() - t_start
        counters = dict(client.counters)
        with contextlib.suppress(Exception):
            status = await asyncio.wait_for(client.status(), 5)
            counters["broker"] = status["counters"]
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 10)
        await proxy.close()
        for px in zproxies.values():
            await px.close()
        procs.stop()  # SIGCONT and SIGTERM to every child, SIGKILL after 5 s
        if procs_run is not None:
            await procs_run
        redis.stop()
        sockets.close()
        ctx.destroy(linger=0)

    lost = sorted(accepted - set(terminal))
    engine_restarts = await asyncio.to_thread(_engine_restarts, workdir, workers)
    duplicated = sum(c - 1 for c in traj_seen.values() if c > 1)
    bound = _terminal_bound(cfg, fault_log, submitted_at, terminal_at, gen_s)
    for r in fault_log:
        for k in ("_t0", "_clear"):
            if k in r:
                r[k.replace("_t0", "started_at_s").replace("_clear", "cleared_at_s")] = round(r.pop(k) - t_start, 3)
    states = Counter(terminal.values())
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in FAULT_KINDS:
        recs = [r for r in fault_log if r["kind"] == kind]
        if not recs:
            continue
        entry: dict[str, Any] = {"count": len(recs)}
        for k in ("detect_s", "recover_s"):
            vals = [r[k] for r in recs if isinstance(r.get(k), float)]
            if vals:
                entry[k] = {"median": round(statistics.median(vals), 3), "max": round(max(vals), 3), "n": len(vals)}
        by_kind[kind] = entry
    return {
        "simulated": True,
        "engine": f"{engine} (the sim engine: simulated generation, no model; results are labelled simulated)",
        "config": asdict(cfg),
        "prompts_submitted": len(accepted),
        "prompts_requested": cfg.prompts,
        "cut_short": cut[0],
        "terminal": dict(states),
        "lost": len(lost),
        "lost_ids": lost[:20],
        "stuck": bound["over_bound"] + len(lost),
        "terminal_bound": bound,
        "duplicated": duplicated,
        "staleness_bound": cfg.max_staleness,
        "staleness_histogram": {str(k): v for k, v in sorted(staleness_hist.items())},
        "staleness_violations": violations,
        "dropped_stale": dropped_stale,
        "versions_published": version,
        "elapsed_s": round(elapsed, 2),
        "faults_injected": len(fault_log),
        "faults_by_kind": by_kind,
        "fault_log": fault_log,
        "restarts": {name: n for name, n in procs.restarts.items() if n},
        "engine_restarts": engine_restarts,
        "poisoned_agents": {"share": cfg.poisoned_agents, "prompts": poisoned_submitted, "delivered": poisoned_done,
                            "requests_refused": poison_refused},
        "proxy": {"forwarded": proxy.forwarded, "held_by_loss": proxy.held, "undeliverable": proxy.undeliverable},
        "message_faults": {name: px.report() for name, px in sorted(zproxies.items())},
        "message_fault_totals": {a: sum(px.total(a) for px in zproxies.values()) for a in ACTIONS if a != "forwarded"},
        "connection_resets": sum(px.resets for px in zproxies.values()),
        "cancelled_calls": cancelled_calls[0],
        "terminal_s": _spread(terminal_s),
        "client_counters": counters,
        "link_faults": "message-level proxy (tc netem unavailable: no netem qdisc in this kernel)",
        "workdir": workdir,
    }
