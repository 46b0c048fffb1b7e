"""Episodes on CPU: the pool's own CPU per chat turn, and many concurrent sessions (all simulated).

Two benches, each with the ``sim`` engine (every figure labelled simulated):

``--bench turns`` (default): the pool's own CPU-microseconds per chat turn. Broker, one worker
(``--engine sglang`` with the sim engine as its child, so the hop to the engine is the same HTTP hop
as on the GPU) and this process as the trainer, separate processes; the workload of
`bench/gpu_episodes.py` (an `openai` SDK agent, ``--turns`` chat turns, a user observation after
each, the history sent back unchanged). Two agent placements:

- ``remote``: the episode function in the worker is a stub that hands its endpoint to an agent
  process of this bench, which runs the SDK loop. The worker process then holds only the pool's own
  work (endpoint, rendering, tokenization, recording, the hop to the engine, logging), so its CPU
  per turn is the pool's own cost;
- ``inworker``: the SDK agent runs in the worker (as `bench/gpu_episodes.py` and users do by default); its
  CPU per turn is pool and agent together;
- ``children``: the same SDK agent in ``--agent-processes`` (default 2) child processes of the worker, the
  worker's own option (``rollpool worker --agent-processes N``); the worker's CPU per turn is then the pool's
  own again, the children's is reported as ``agent_process``.

``--placement`` takes a comma-separated list (``both`` is ``remote,inworker``), run side by side rep by rep.

``--trees before=/tmp/w41-before,after=.`` runs the same workload on several source trees (a
checkout of the code before a change beside this one), interleaved rep by rep so a shared machine's
load hits both alike; the summary gives each later tree's ratios to each earlier one (``now_vs_base``:
``pool_cpu_per_turn_ratio``, the worker's and the broker's CPU per turn, and more). CPU is ``psutil``
user+system time of each process over the phase.

``--bench sessions``: ``--sessions`` concurrent episodes (default 10,000) across ``--workers``
sim workers (1, 2, 4), token-level (``ctx.generate`` / ``ctx.append``), all submitted at once:
lost, duplicated and timed-out episodes, throughput, and the most episodes one worker held at once.

    python bench/episodes.py --trees before=/tmp/w41-before,after=. --json bench/results/cpu-episodes.json
    python bench/episodes.py --trees base=/tmp/base,now=. --profile "$(which py-spy)"   # + 'profile': py-spy per tree

``--sim-tree PATH`` makes every tree's engine child (the sim, whose CPU is not the pool's) that tree's code, so the trees
differ only in the pool's own code; ``--chat-sampling`` has that sim sample as a chat model does (no special token inside
a turn, a stop on the template's end-of-turn: `SimOptions.special_ids`). Without it the sim draws uniformly over the tiny
model's 384 ids, 7 of them special, and ends a stopped turn with the end-of-sequence: on about 80% of turns the reply's
text is then not what the template renders, and the endpoint renders the conversation a second time (a real model's
turns seldom do that; the GPU bench's random 32,000-id model, about 2% of its turns). The summary's ``*_vs_*`` keys
also give the ratio rep by rep (``per_rep_pool_cpu_ratio``), a spread that the ratio of medians hides.

Each row also has the phase's ramp and tail (`turn_timing`, from the agents' per-turn ``start`` and ``end``; the keys
`bench/gpu_episodes.py` reports): ``first_turn_start_s``, ``delivery_after_last_turn_s`` (a group's last turn to its
arrival in this process's client, `stamp_deliveries`), ``tail_s``, ``turn_s``, ``running_per_100ms``, ``waves``.
``--agent-client shared`` has the agent take one SDK client per process, as the GPU runs do (the default, a client per
episode, builds a TLS context per episode: most of the ramp on this box). The GPU's turns (a random model samples all
128 tokens, so every episode is on the same turn at once):
``--engine-extra ',server_args={"chat_sampling":true,"length":"fixed","length_median":128}'`` (instead of
``--chat-sampling``).

``--profile PY_SPY`` adds, after the measured reps, one row per tree and placement under py-spy (the worker, the
engine's child and the broker; samples of the thread holding the GIL), summarised by category in the JSON's ``profile``;
each row also reports the worker's event-loop thread's CPU alone (``worker_loop_thread_cpu_us_per_turn``).
    python bench/episodes.py --bench sessions --json bench/results/cpu-episodes-sessions.json

This module is also the episode functions' module in the worker (``--episode
rp_episodes_bench:remote_agent`` through a link in a temporary directory), so its top level imports
only the standard library.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta")
AGENT_SOCKET_ENV = "RP_BENCH_AGENT_SOCKET"


# --------------------------------------------------------------------------- the agent (the shape of bench/gpu_episodes.py)


async def sdk_loop(base_url: str, api_key: str, model: str, md: dict[str, Any], seed: str) -> dict[str, Any]:
    """An unmodified `openai` SDK agent: fixed turns, an observation after each, the history sent back unchanged."""
    import openai

    turns, tokens, tool_words = int(md["turns"]), int(md["tokens_per_turn"]), int(md["tool_words"])
    rng = random.Random(seed)
    shared = md.get("agent_client") == "shared"
    if shared:  # one SDK client per process, copied per episode: one TLS context, one pool (as bench/gpu_episodes.py's)
        client = _shared_client().with_options(base_url=base_url, api_key=api_key)
    else:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."},
                                      {"role": "user", "content": str(md["task"])}]
    done = completion_tokens = 0
    per_turn: list[dict[str, Any]] = []  # what bench/gpu_episodes.py's agent records, for its cache share
    prev: tuple[int, int] | None = None
    try:
        for t in range(turns):
            start = time.time()
            r = await client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=1.0)
            end = time.time()
            msg = r.choices[0].message
            usage = r.usage
            completion_tokens += usage.completion_tokens if usage else 0
            cached = int(usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0
            rec = {"turn": t, "prompt_tokens": usage.prompt_tokens if usage else 0,
                   "completion_tokens": usage.completion_tokens if usage else 0, "cached": cached,
                   "cacheable": (prev[0] + prev[1] - 1) if prev else 0, "start": round(start, 4), "end": round(end, 4)}
            per_turn.append(rec)
            prev = (rec["prompt_tokens"], rec["completion_tokens"])
            messages.append(msg.model_dump(exclude_none=True))  # sent back unchanged
            obs = " ".join(rng.choice(WORDS) for _ in range(tool_words))
            messages.append({"role": "user", "content": f"observation {t}: {obs}"})
            done += 1
    finally:
        if not shared:
            await client.close()
    return {"turns": done, "completion_tokens": completion_tokens, "cache_turns": per_turn}


_SHARED: dict[int, Any] = {}


def _shared_client() -> Any:
    """This event loop's one `openai.AsyncOpenAI` (``--agent-client shared``); never closed: it lives as long as the process."""
    import openai

    key = id(asyncio.get_running_loop())
    if key not in _SHARED:
        _SHARED[key] = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="-", max_retries=0, timeout=600)
    return _SHARED[key]


async def agent(ctx: Any, prompt: Any) -> float:
    """The SDK agent in the worker's process."""
    res = await sdk_loop(ctx.openai_base_url, ctx.api_key, ctx.model, dict(prompt.metadata), f"{prompt.prompt_id}:{ctx.sample_index}")
    ctx.metadata["cache_turns"] = res.pop("cache_turns")
    ctx.metadata["agent"] = res
    return 0.0


async def remote_agent(ctx: Any, prompt: Any) -> float:
    """A stub: hands the episode's endpoint to one of the bench's agent processes (``AGENT_SOCKET_ENV``: their
    sockets, comma-separated; one per episode by its index) and waits for its answer."""
    socks = os.environ[AGENT_SOCKET_ENV].split(",")
    reader, writer = await asyncio.open_unix_connection(socks[(hash(prompt.prompt_id) + ctx.sample_index) % len(socks)])
    try:
        writer.write(json.dumps({"base_url": ctx.openai_base_url, "api_key": ctx.api_key, "model": ctx.model,
                                 "md": dict(prompt.metadata), "seed": f"{prompt.prompt_id}:{ctx.sample_index}"}).encode() + b"\n")
        await writer.drain()
        line = await reader.readline()
    finally:
        writer.close()
    res = json.loads(line)
    if "error" in res:
        raise RuntimeError(res["error"])
    ctx.metadata["cache_turns"] = res.pop("cache_turns")
    ctx.metadata["agent"] = res
    return 0.0


async def token_agent(ctx: Any, prompt: Any) -> float:
    """A token-level agent for the many-sessions bench: turns of `ctx.generate`, an observation appended after each."""
    md = prompt.metadata
    turns = 0
    for t in range(int(md["turns"])):
        await ctx.generate()
        ctx.append([5 + (t + i) % 50 for i in range(int(md["obs_tokens"]))])
        turns += 1
    ctx.metadata["agent"] = {"turns": turns}
    return 1.0


def _serve_agents(path: str) -> None:
    """The agent process: one SDK loop per connection (``--agent-process PATH``)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req = json.loads(await reader.readline())
            try:
                res = await sdk_loop(req["base_url"], req["api_key"], req["model"], req["md"], req["seed"])
            except Exception as exc:  # noqa: BLE001 - reported to the episode, which fails with it
                res = {"error": f"{type(exc).__name__}: {exc}"}
            writer.write(json.dumps(res).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_unix_server(handle, path, limit=1 << 20, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# --------------------------------------------------------------------------- processes


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Pool:
    """Broker and workers of one source tree, started as `python -m` processes with that tree first on the path."""

    def __init__(self, tree: Path, work: Path, label: str) -> None:
        self.tree, self.work, self.label = tree, work, label
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "PYTHONPATH": f"{tree}:{work / 'agent'}", "PYTHONDONTWRITEBYTECODE": "1"}

    def spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        fh = (self.work / log).open("ab")
        proc = subprocess.Popen([sys.executable, *args], cwd=self.tree, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, 9)
        self.procs.clear()


def _cpu(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def _main_thread_cpu(pid: int) -> float:
    """User+system CPU of the process's main thread (its event loop), from its thread id (the pid)."""
    import psutil

    try:
        return next((float(t.user_time + t.system_time) for t in psutil.Process(pid).threads() if t.id == pid), 0.0)
    except psutil.Error:
        return 0.0


def _agent_children(pids: list[int]) -> list[int]:
    """Those of `pids` that are a worker's agent processes."""
    import psutil

    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if "rollpool.workers.episodes" in psutil.Process(pid).cmdline():
                out.append(pid)
    return out


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


# --------------------------------------------------------------------------- profile (py-spy, outside the process)

# Where a sample's CPU went: the leaf-most frame of its stack that one of these matches (file path
# fragment or function name), so json.dumps under aiohttp's response counts as JSON, a chat-template
# render under the endpoint as the template; asyncio's own frames only when nothing else in the stack
# matches (a socket write under aiohttp's client is the hop). Order matters only within one frame.
PROFILE_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the sim engine (the simulated model)", ("engines/sim.py", "_SimPrefixCache")),
    ("tokenizer and chat template", ("/transformers/", "/tokenizers/", "/jinja2/", "episodes/chat.py", "engines/tokenizer.py")),
    ("JSON", ("/json/", "orjson", "/msgpack/")),
    ("logging", ("/logging/",)),
    ("ZeroMQ and the broker link", ("/zmq/", "workers/link.py", "protocol/codec.py", "protocol/messages.py")),
    ("hop to the engine (sglang engine, its HTTP client)", ("engines/sglang/", "aiohttp/client", "aiohttp/connector",
                                                           "aiohttp/streams", "aiohttp/http_writer")),
    ("endpoint HTTP server (aiohttp web)", ("aiohttp/web", "aiohttp/http_parser", "aiohttp/helpers", "aiohttp/multidict",
                                           "/multidict/", "/yarl/", "episodes/server.py")),
    ("the openai SDK agent", ("/openai/", "/httpx/", "/httpcore/", "/pydantic", "/anyio/", "/h11/", "/ssl.py")),
    ("episode turn (recording, sampling checks)", ("episodes/episode.py", "episodes/recording.py", "protocol/sampling.py",
                                                  "/dataclasses.py", "/numpy/")),
    ("episode runner, worker, sessions", ("episodes/runner.py", "workers/worker.py", "workers/session.py", "rollpool/")),
    ("tool and worker threads (hand-off)", ("/concurrent/futures/", "/threading.py", "/queue.py")),
)
FALLBACK_CATEGORY = ("asyncio scheduling and sockets", ("/asyncio/", "/selectors.py", "/socket.py"))
# a thread waiting (py-spy --nonblocking reports some waits as running): not CPU, left out of the shares
IDLE_LEAVES = ("select (selectors.py", "_worker (concurrent/futures/thread.py", "wait (threading.py", "poll (zmq/")


Categories = tuple[tuple[str, tuple[str, ...]], ...]


def _category(stack: str, categories: Categories = PROFILE_CATEGORIES,
              fallback: tuple[str, tuple[str, ...]] = FALLBACK_CATEGORY) -> str:
    # py-spy names a file by its package part ("json/__init__.py", "transformers/..."); a "/" in front lets the
    # marks that start with one ("/json/", "/transformers/", "/ssl.py") match it
    frames = [f.replace(" (", " (/", 1) for f in stack.split(";")]
    for frame in reversed(frames):
        for name, marks in categories:
            if any(m in frame for m in marks):
                return name
    if any(m in frame for frame in frames for m in fallback[1]):
        return fallback[0]
    return "other"


def profile_summary(raw: str, top: int = 25, categories: Categories = PROFILE_CATEGORIES,
                    fallback: tuple[str, tuple[str, ...]] = FALLBACK_CATEGORY) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks -> the share of samples per category (the first of `categories` whose marks a
    frame has, from the leaf up; else `fallback`, else "other") and the top leaf functions."""
    cats: dict[str, int] = {}
    leaves: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        if any(m in stack.split(";")[-1] for m in IDLE_LEAVES):
            continue
        total += n
        cat = _category(stack, categories, fallback)
        cats[cat] = cats.get(cat, 0) + n
        leaf = stack.split(";")[-1]
        leaves[leaf] = leaves.get(leaf, 0) + n
    share = {k: round(v / total, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])} if total else {}
    top_leaves = [[k, round(v / total, 3)] for k, v in sorted(leaves.items(), key=lambda kv: -kv[1])[:top]] if total else []
    return {"samples": total, "share_by_category": share, "top_leaf_frames": top_leaves}


class Profiler:
    """`py-spy record` on one process for the measured phase (``--profile PY_SPY``); stopped with SIGINT. Only the thread
    holding the GIL is sampled (``--gil``): Python's own CPU, not threads waiting for it."""

    def __init__(self, py_spy: str, pid: int, out: Path, rate_hz: int = 1000) -> None:
        self.out = out
        env = {**os.environ}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", str(rate_hz), "--format", "raw",
                                      "--output", str(out), "--nonblocking", "--threads", "--gil"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    def stop(self) -> dict[str, Any]:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            return profile_summary(self.out.read_text())
        except OSError as exc:
            return {"error": f"py-spy wrote nothing: {exc}"}


async def _client(cep: str) -> Any:
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig

    client = TrainerClient(config=TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=60.0, keep_versions=2))
    await client.connect()
    await client.publish_weights({}, 0)
    return client


async def _wait_workers(client: Any, n: int, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> float:
    t0 = time.time()
    while (await client.status())["counters"].get("workers_alive", 0) < n:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a pool process exited {p.returncode} while joining")
        if time.time() - t0 > timeout_s:
            raise RuntimeError(f"fewer than {n} workers joined in {timeout_s} s")
        await asyncio.sleep(0.2)
    return time.time() - t0


async def _collect(client: Any, n_groups: int, timeout_s: float) -> list[Any]:
    """Every group at once (one `get_batch` of all: a call per group rechecks the whole buffer each time)."""
    try:
        batch = await client.get_batch(n_groups, timeout=timeout_s)
    except TimeoutError as exc:
        raise RuntimeError(f"not all {n_groups} groups within {timeout_s} s: {exc}") from None
    for other in batch.other:
        raise RuntimeError(f"group {other.prompt_id} ended {other.state}: {other.reason}")
    return list(batch.groups)


def stamp_deliveries(client: Any) -> dict[str, float]:
    """Bench instrumentation: when each group reached the trainer's process, its prompt id -> the time (``time.time()``)
    the client's pull that carried it returned (`get_batch` hands them over once its n are there). Wraps the client's
    private ``_pull``, so it sees every pull of every `get_batch`."""
    delivered: dict[str, float] = {}
    pull = client._pull

    async def timed(*args: Any, **kwargs: Any) -> Any:
        batch = await pull(*args, **kwargs)
        now = time.time()
        for g in batch.groups:
            delivered.setdefault(g.prompt_id, now)
        return batch

    client._pull = timed
    return delivered


def _spread(xs: list[float], keys: tuple[str, ...] = ("min", "median", "max")) -> dict[str, float] | None:
    if not xs:
        return None
    pick = {"min": min(xs), "median": _median(xs), "max": max(xs)}
    return {k: round(float(pick[k] or 0.0), 4) for k in keys}


def phase_timing(groups: list[Any], t0: float, delivered: dict[str, float], wall_s: float) -> dict[str, Any]:
    """`turn_timing` of a pool's phase: each episode's turns from its trajectories' ``cache_turns`` (the agent's records;
    an episode's segments carry the same), each group's delivery from `delivered` (its prompt id -> the time)."""
    episodes: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for g in groups:
        for tr in g.trajectories:
            recs = tr.metadata.get("cache_turns") or []
            if recs:
                episodes.setdefault((g.prompt_id, tr.sample_index), recs)
    return turn_timing(episodes, t0, wall_s, delivered)


def turn_timing(episodes: dict[tuple[str, int], list[dict[str, Any]]], t0: float, wall_s: float,
                delivered: dict[str, float] | None = None) -> dict[str, Any]:
    """A phase's ramp and tail from each episode's turns (``{(group, index): [{"turn", "start", "end"}, ...]}``, the
    agents' clock, this host's; ``start`` may be given as ``end`` less ``s``) and each group's delivery, all in seconds
    after `t0` (just before the submit):

    - ``first_turn_start_s``: each episode's first request leaving its agent (min, median, max over episodes): the ramp;
    - ``delivery_after_last_turn_s``: per group, its delivery less the end of its last turn (median, max): the tail
      (only with `delivered`);
    - ``last_turn_end_s`` (the phase's last turn) and ``tail_s`` (``wall_s`` less it);
    - ``running_per_100ms``: how many episodes were between their first turn's start and their last turn's end at
      0.1, 0.2, ..., 1.0 s (the in-process loop has every episode running at once from the start);
    - ``turn_s``: one turn's time as its agent saw it, request to answer (median, max over every turn);
    - ``waves``: per turn index, [first start, last start, first end, last end] over the episodes: with every episode
      on the same turn at once, a turn's requests leave their agents spread over [first start, last start];
    - ``context_tokens`` (where the records carry ``prompt_tokens``): the prompt tokens the engine ran, summed over every
      turn, and the mean of the last turn's (the KV each decode step reads grows with them, so two loops compare only at
      the same context)."""
    spans: list[tuple[float, float]] = []
    waves: dict[int, list[float]] = {}
    group_end: dict[str, float] = {}
    durations: list[float] = []
    for (group, _), recs in episodes.items():
        times = [((float(r["start"]) if "start" in r else float(r["end"]) - float(r["s"])) - t0, float(r["end"]) - t0, int(r["turn"]))
                 for r in recs]
        for b, e, turn in times:
            durations.append(e - b)
            w = waves.setdefault(turn, [b, b, e, e])
            waves[turn] = [min(w[0], b), max(w[1], b), min(w[2], e), max(w[3], e)]
        spans.append((min(b for b, _, _ in times), max(e for _, e, _ in times)))
        group_end[group] = max(group_end.get(group, -math.inf), spans[-1][1])
    if not spans:
        return {}
    last = max(e for _, e in spans)
    out: dict[str, Any] = {"first_turn_start_s": _spread([s for s, _ in spans])}
    if delivered is not None:
        out["delivery_after_last_turn_s"] = _spread([delivered[g] - t0 - e for g, e in group_end.items() if g in delivered],
                                                    ("median", "max"))
    out.update({"last_turn_end_s": round(last, 4), "tail_s": round(wall_s - last, 4),
                "running_per_100ms": [sum(1 for s, e in spans if s <= m / 10 < e) for m in range(1, 11)],
                "turn_s": _spread(durations, ("median", "max")),
                "waves": [[round(x, 3) for x in waves[t]] for t in sorted(waves)]})
    prompts = [(int(r["turn"]), int(r["prompt_tokens"])) for recs in episodes.values() for r in recs if r.get("prompt_tokens")]
    if prompts:
        final = max(t for t, _ in prompts)
        lasts = [n for t, n in prompts if t == final]
        out["context_tokens"] = {"sum": sum(n for _, n in prompts), "last_turn_mean": round(sum(lasts) / len(lasts), 1)}
    return out


# --------------------------------------------------------------------------- bench: CPU per turn


def _prompts(name: str, args: argparse.Namespace, groups: int) -> list[Any]:
    from rollpool.protocol import Prompt, SamplingParams

    def task(i: int) -> str:
        rng = random.Random(i)
        return f"Task {i}: " + " ".join(rng.choice(WORDS) for _ in range(40))

    return [Prompt(prompt_id=f"{name}-{i}", text=task(i), group_size=args.n,
                   sampling=SamplingParams(max_new_tokens=args.tokens_per_turn, temperature=1.0),
                   metadata={"turns": args.turns, "tokens_per_turn": args.tokens_per_turn, "tool_words": args.tool_words,
                             "task": task(i), "agent_client": args.agent_client})
            for i in range(groups)]


def _sim_child_options(args: argparse.Namespace, work: Path) -> str:
    """The sglang engine options that make every tree's engine child the same sim: ``--sim-tree`` (the child runs
    that tree's code, through a ``python`` that starts there) and ``--chat-sampling`` (its sim samples as a chat model
    does: `SimOptions.special_ids`)."""
    out = ""
    if args.sim_tree:
        tree = Path(args.sim_tree).resolve()
        wrapper = work / "sim-python"
        if not wrapper.exists():  # python -m puts the working directory first on the path: start in the sim's tree
            wrapper.write_text(f"#!/bin/sh\ncd '{tree}' && PYTHONPATH='{tree}' exec '{sys.executable}' \"$@\"\n")
            wrapper.chmod(0o755)
        out += f",python={wrapper}"
    if args.chat_sampling:
        out += ',server_args={"chat_sampling":true}'
    return out


async def turns_row(tree: Path, label: str, placement: str, args: argparse.Namespace, work: Path, model: Path,
                    profile: bool = False) -> dict[str, Any]:
    """One pool of `tree`: warm-up, then the measured phase; CPU of each process over the phase (`profile`: py-spy on
    the worker and the engine's child over the phase, which costs them CPU: such a row is not one of the measured ones)."""
    pool = Pool(tree, work, label)
    broker_log = work / f"broker-{label}.log"
    dead0 = broker_log.read_text(errors="replace").count("declared dead") if broker_log.exists() else 0
    wep, cep, sg_port = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}", _port()
    sock = str(work / f"agents-{label}-{placement}.sock")
    agents: list[subprocess.Popen[bytes]] = []
    client = None
    try:
        broker = pool.spawn(["-m", "rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--max-staleness", "1000",
                             "--task-timeout-s", "3600", "--log-level", "WARNING"], f"broker-{label}.log")
        if placement == "remote":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock)
            agents.append(pool.spawn([str(ROOT / "bench" / "episodes.py"), "--agent-process", sock], f"agents-{label}.log"))
        fn = "rp_episodes_bench:remote_agent" if placement == "remote" else "rp_episodes_bench:agent"
        agent_processes = args.agent_processes if placement == "children" else 0
        opts = (f"port={sg_port},capacity={args.concurrency},backend=sim,context_length={args.context},log_dir={work}"
                f"{_sim_child_options(args, work)}{args.engine_extra}")
        pool.env[AGENT_SOCKET_ENV] = sock
        worker = pool.spawn(["-m", "rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(model), "--worker-id",
                             f"ep-{label}", "--engine-options", opts, "--episode", fn, "--max-episodes", str(args.concurrency),
                             "--max-context-tokens", str(args.context), "--apply-mode", args.apply_mode, "--log-level", "INFO",
                             *(["--agent-processes", str(agent_processes)] if agent_processes else [])],
                            f"worker-{label}-{placement}.log")
        client = await _client(cep)
        join_s = await _wait_workers(client, 1, pool.procs, 120)
        await client.submit(_prompts(f"warm-{label}", argparse.Namespace(**{**vars(args), "turns": 2}), 2))
        await _collect(client, 2, args.phase_timeout_s)
        if args.update:  # a first version, applied while idle: what loads lazily on the first update (torch in the sim child) is in
            await client.publish_weights(_bumped(model), 1)
            await client.wait_for_version(1, timeout=120)
        # the worker's children: the engine's child, and its agent processes (``python -m rollpool.workers.episodes``)
        kids = _children(worker.pid)
        mine = set(_agent_children(kids))
        child = [p for p in kids if p not in mine]
        pids = {"worker": [worker.pid], "engine_child": child, "broker": [broker.pid],
                "agent_process": [a.pid for a in agents] + sorted(mine)}
        profilers = {}
        if profile:
            profilers = {"worker": Profiler(args.profile, worker.pid, work / f"profile-{label}-{placement}-worker.txt")}
            if child:
                profilers["engine_child"] = Profiler(args.profile, child[0], work / f"profile-{label}-{placement}-child.txt")
            profilers["broker"] = Profiler(args.profile, broker.pid, work / f"profile-{label}-{placement}-broker.txt")
            await asyncio.sleep(1.0)  # py-spy attached
        before = {k: sum(_cpu(p) for p in v) for k, v in pids.items()}
        loop0 = _main_thread_cpu(worker.pid)
        mine0 = time.process_time()
        delivered = stamp_deliveries(client)
        t0 = time.time()
        res = await client.submit(_prompts(f"{placement}-{label}", args, args.groups))
        if res.rejected:
            raise RuntimeError(f"rejected: {res.rejected}")
        groups = await _collect(client, args.groups, args.phase_timeout_s)
        wall = time.time() - t0
        timing = phase_timing(groups, t0, delivered, wall)
        after = {k: sum(_cpu(p) for p in v) for k, v in pids.items()}
        loop_cpu = _main_thread_cpu(worker.pid) - loop0
        trainer_cpu = time.process_time() - mine0
        profiles = {k: prof.stop() for k, prof in profilers.items()}
        update = await update_phase(client, label, placement, args, model, work / f"worker-{label}-{placement}.log", wall) \
            if args.update and not profile else None
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 10)
        pool.stop()
    trajs = [tr for g in groups for tr in g.trajectories]
    turns = sum(int(tr.metadata.get("agent", {}).get("turns", 0)) for tr in trajs)
    episodes = len({(tr.prompt_id, tr.sample_index) for tr in trajs})
    sampled = sum(int((tr.loss_mask == 1).sum()) for tr in trajs)
    cpu = {k: after[k] - before[k] for k in pids}
    per_turn = {f"{k}_cpu_us_per_turn": round(1e6 * v / turns, 1) if turns else None for k, v in cpu.items()}
    per_turn["trainer_cpu_us_per_turn"] = round(1e6 * trainer_cpu / turns, 1) if turns else None
    # the worker's event loop alone; the rest of the worker's CPU is its threads (tokenizer, ZeroMQ's I/O, tools)
    per_turn["worker_loop_thread_cpu_us_per_turn"] = round(1e6 * loop_cpu / turns, 1) if turns else None
    dead = broker_log.read_text(errors="replace").count("declared dead") - dead0
    row = {"tree": label, "placement": placement, "simulated": True, "wall_s": round(wall, 2), "join_s": round(join_s, 1),
           "worker_declared_dead": dead,
           "episodes": episodes, "trajectories": len(trajs), "segments_per_episode": round(len(trajs) / max(1, episodes), 3),
           "turns": turns, "sampled_tokens": sampled, "turns_per_s": round(turns / wall, 1),
           "output_tokens_per_s": round(sampled / wall, 1), **per_turn, **timing,
           "pool_cpu_us_per_turn": round(1e6 * (cpu["worker"] + cpu["broker"]) / turns, 1) if turns else None,
           "worker_and_engine_child_cpu_us_per_turn": round(1e6 * (cpu["worker"] + cpu["engine_child"]) / turns, 1) if turns else None,
           "worker_and_agent_processes_cpu_us_per_turn": round(1e6 * (cpu["worker"] + cpu["agent_process"]) / turns, 1) if turns else None}
    if profile:
        row["profile"] = profiles
    if update is not None:
        row["one_update"] = update
        row["one_update_vs_no_update"] = round(update["output_tokens_per_s"] / row["output_tokens_per_s"], 3)
    print(f"  {label:>8s} {placement:>8s}: {json.dumps(row)}", flush=True)
    return row


def _apply_lines(log: Path) -> list[dict[str, Any]]:
    """The sglang engine's ``sglang apply {...}`` log lines (one per weight update: pause, update, resume timings)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        _, mark, rest = line.partition("sglang apply ")
        if mark:
            with contextlib.suppress(ValueError):
                out.append(json.loads(rest[rest.index("{"):rest.rindex("}") + 1]))
    return out


def _bumped(model: Path) -> dict[str, Any]:
    """The model's tensors, each +0.01: a version to publish."""
    from safetensors.torch import load_file

    return {k: v + 0.01 for k, v in load_file(str(model / "model.safetensors")).items()}


async def update_phase(client: Any, label: str, placement: str, args: argparse.Namespace, model: Path, log: Path,
                       no_update_wall_s: float) -> dict[str, Any]:
    """The measured workload again on the same pool, with one weight version (every tensor of the model +0.01) published
    at half the no-update phase's wall time, as bench/gpu_episodes.py's ``one_update`` (version 2: version 1 was applied
    before the measured phases, while idle); the engine's own timings of the
    apply (how long it generated nothing: ``stopped_s``) from its log."""
    sd, version = _bumped(model), 2
    applied0 = len(_apply_lines(log))
    t0 = time.time()
    res = await client.submit(_prompts(f"{placement}-{label}-u{version}", args, args.groups))
    if res.rejected:
        raise RuntimeError(f"rejected: {res.rejected}")
    collect = asyncio.ensure_future(_collect(client, args.groups, args.phase_timeout_s))
    await asyncio.sleep(max(0.0, no_update_wall_s / 2 - (time.time() - t0)))
    p0 = time.time()
    await client.publish_weights(sd, version)
    published = (round(p0 - t0, 3), round(time.time() - t0, 3))
    groups = await collect
    wall = time.time() - t0
    for _ in range(50):  # the apply's log line comes after the resume
        if len(_apply_lines(log)) > applied0:
            break
        await asyncio.sleep(0.1)
    applies = _apply_lines(log)[applied0:]
    trajs = [tr for g in groups for tr in g.trajectories]
    sampled = sum(int((tr.loss_mask == 1).sum()) for tr in trajs)
    versions = sorted({int(v) for tr in trajs for v, m in zip(tr.token_versions, tr.loss_mask, strict=True) if m == 1})
    keys = ("stopped_s", "pause_s", "serialize_s", "sglang_update_s", "verify_s", "resume_s", "staged")
    if applies and "stopped_s" not in applies[0] and {"applied_at", "update_started_at", "pause_s"} <= set(applies[0]):
        a = applies[0]  # a tree from before stopped_s: the pause, then update start to the resume's end
        a["stopped_s"] = float(a["pause_s"]) + float(a["applied_at"]) - float(a["update_started_at"])
    return {"wall_s": round(wall, 2), "published_s": published, "sampled_tokens": sampled,
            "output_tokens_per_s": round(sampled / wall, 1), "token_versions_seen": versions,
            "apply": {k: round(float(applies[0][k]), 4) for k in keys if k in applies[0]} if applies else None,
            "applied_at_s": round(float(applies[0]["applied_at"]) - t0, 3) if applies and "applied_at" in applies[0] else None}


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


async def bench_turns(args: argparse.Namespace, result: dict[str, Any], save: Any) -> None:
    work, model, trees = args.workdir, Path(args.model_dir), args.tree_paths
    placements = ["remote", "inworker"] if args.placement == "both" else args.placement.split(",")
    if bad := set(placements) - {"remote", "inworker", "children"}:
        raise SystemExit(f"--placement: unknown {sorted(bad)} (remote, inworker, children, both)")
    rows: list[dict[str, Any]] = result.setdefault("rows", [])
    try:
        for rep in range(args.reps):
            for placement in placements:
                order = trees if rep % 2 == 0 else list(reversed(trees))
                for label, tree in order:
                    row = await turns_row(tree, label, placement, args, work, model)
                    row["rep"] = rep
                    rows.append(row)
                    save()
        if args.profile:  # after the measured reps, one profiled row per tree and placement (py-spy costs CPU)
            profiles = result.setdefault("profile", {})
            for placement in placements:
                for label, tree in trees:
                    row = await turns_row(tree, label, placement, args, work, model, profile=True)
                    profiles[f"{placement}/{label}"] = {"what": "py-spy --nonblocking --gil --threads, 1000 Hz, over the measured "
                                                                "phase (samples of the thread holding the GIL: Python's CPU); share "
                                                                "of samples by the leaf-most frame a category matches "
                                                                "(bench/episodes.py PROFILE_CATEGORIES); simulated",
                                                        "worker_cpu_us_per_turn_while_profiled": row["worker_cpu_us_per_turn"],
                                                        **row["profile"]}
                    save()
    finally:
        if args.profile_raw:
            Path(args.profile_raw).mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, after the rows
            for f in work.glob("profile-*.txt"):
                shutil.copy(f, args.profile_raw)
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, Any] = {}
    for placement in placements:
        for label, _ in trees:
            mine = [r for r in rows if r["tree"] == label and r["placement"] == placement]
            summary[f"{placement}/{label}"] = {
                k: _median([r[k] for r in mine]) for k in ("worker_cpu_us_per_turn", "worker_loop_thread_cpu_us_per_turn",
                                                           "pool_cpu_us_per_turn", "engine_child_cpu_us_per_turn",
                                                           "worker_and_engine_child_cpu_us_per_turn", "agent_process_cpu_us_per_turn",
                                                           "worker_and_agent_processes_cpu_us_per_turn", "turns_per_s",
                                                           "output_tokens_per_s")}
        for i, (a, _) in enumerate(trees if args.reps else []):  # every later tree against every earlier one
            for b, _ in trees[i + 1:]:
                x, y = summary[f"{placement}/{a}"], summary[f"{placement}/{b}"]
                summary[f"{placement}/{b}_vs_{a}"] = {
                    "pool_cpu_per_turn_ratio": round(y["pool_cpu_us_per_turn"] / x["pool_cpu_us_per_turn"], 3),
                    "worker_cpu_per_turn_ratio": round(y["worker_cpu_us_per_turn"] / x["worker_cpu_us_per_turn"], 3),
                    "worker_and_engine_child_cpu_per_turn_ratio": round(
                        y["worker_and_engine_child_cpu_us_per_turn"] / x["worker_and_engine_child_cpu_us_per_turn"], 3),
                    "turns_per_s_ratio": round(y["turns_per_s"] / x["turns_per_s"], 3),
                    "per_rep_pool_cpu_ratio": _per_rep_ratios(rows, placement, a, b)}
    if args.update:  # the one-update phase: its throughput over the no-update phase's, and how long the engine stopped
        for placement in placements:
            for label, _ in trees:
                mine = [r for r in rows if r["tree"] == label and r["placement"] == placement and r.get("one_update")]
                summary[f"{placement}/{label}"]["one_update_vs_no_update"] = _median([r["one_update_vs_no_update"] for r in mine])
                summary[f"{placement}/{label}"]["update_stopped_s"] = _median(
                    [r["one_update"]["apply"]["stopped_s"] for r in mine if (r["one_update"].get("apply") or {}).get("stopped_s") is not None])
    if {"inworker", "children"} <= set(placements) and args.reps:
        for label, _ in trees:
            x, y = summary[f"inworker/{label}"], summary[f"children/{label}"]
            summary[f"children_vs_inworker/{label}"] = {
                "agent_processes": args.agent_processes,
                "worker_cpu_per_turn_ratio": round(y["worker_cpu_us_per_turn"] / x["worker_cpu_us_per_turn"], 3),
                "worker_loop_thread_cpu_per_turn_ratio": round(
                    y["worker_loop_thread_cpu_us_per_turn"] / x["worker_loop_thread_cpu_us_per_turn"], 3),
                "turns_per_s_ratio": round(y["turns_per_s"] / x["turns_per_s"], 3)}
    result["summary"] = summary
    print(json.dumps(summary, indent=1))


def _per_rep_ratios(rows: list[dict[str, Any]], placement: str, a: str, b: str) -> list[float]:
    """Tree `b`'s pool CPU per turn over tree `a`'s, rep by rep (the two rows of one rep ran next to each other)."""
    by = {(r["tree"], r["rep"]): r for r in rows if r["placement"] == placement and "rep" in r and not r.get("profile")}
    return [round(by[(b, rep)]["pool_cpu_us_per_turn"] / by[(a, rep)]["pool_cpu_us_per_turn"], 3)
            for (tree, rep) in sorted(by) if tree == a and (b, rep) in by]


# --------------------------------------------------------------------------- bench: many sessions


async def sessions_row(workers: int, args: argparse.Namespace, work: Path, tree: Path = ROOT, label: str = "this") -> dict[str, Any]:
    """`--sessions` token-level episodes on `workers` sim workers of `tree`, all submitted at once."""
    from rollpool.protocol import Prompt, SamplingParams

    pool = Pool(tree, work, f"s{workers}")
    wep, cep = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    client = None
    try:
        broker = pool.spawn(["-m", "rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--max-staleness", "1000",
                             "--task-timeout-s", "3600", "--log-level", "WARNING"], f"broker-s{workers}.log")
        per_worker = -(-args.sessions // workers // args.n) * args.n  # every session held at once, across the workers
        opts = (f"capacity={per_worker},decode_s_per_token={args.decode_s_per_token},length=fixed,"
                f"length_median={args.tokens_per_turn}")
        wprocs = [pool.spawn(["-m", "rollpool.workers", "--broker", wep, "--engine", "sim", "--worker-id", f"w{i}",
                              "--engine-options", opts, "--episode", "rp_episodes_bench:token_agent", "--max-episodes", str(per_worker),
                              "--capacity", str(per_worker), "--log-level", "WARNING"], f"worker-s{workers}-{i}.log")
                  for i in range(workers)]
        client = await _client(cep)
        await _wait_workers(client, workers, pool.procs, 120)
        n_groups = args.sessions // args.n
        import numpy as np

        prompts = [Prompt(prompt_id=f"s{workers}-{i}", input_ids=np.array([1, 2, 3, 4 + i % 50], dtype=np.int32), group_size=args.n,
                          sampling=SamplingParams(max_new_tokens=args.tokens_per_turn, temperature=1.0),
                          metadata={"turns": args.session_turns, "obs_tokens": 8})
                   for i in range(n_groups)]
        held = {f"w{i}": 0 for i in range(workers)}
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    st = await client.status()
                    for wid, w in st.get("workers", {}).items():
                        if wid in held:  # leases are groups: n episodes each
                            held[wid] = max(held[wid], int(w.get("inflight", 0)) * args.n)
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        cpu0 = sum(_cpu(p.pid) for p in wprocs), _cpu(broker.pid), time.process_time()
        t0 = time.time()
        res = await client.submit(prompts)
        if res.rejected:
            raise RuntimeError(f"rejected: {len(res.rejected)}")
        groups = await _collect(client, n_groups, args.phase_timeout_s)
        wall = time.time() - t0
        stop.set()
        await watcher
        cpu = sum(_cpu(p.pid) for p in wprocs) - cpu0[0], _cpu(broker.pid) - cpu0[1], time.process_time() - cpu0[2]
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 10)
        pool.stop()
    ids = [(tr.prompt_id, tr.sample_index, tr.segment_index) for g in groups for tr in g.trajectories]
    want = {(p.prompt_id, i, 0) for p in prompts for i in range(args.n)}
    timed_out = sum(1 for g in groups for tr in g.trajectories if "timed out" in str(tr.metadata.get("episode_error", "")))
    failed = sum(1 for g in groups for tr in g.trajectories if tr.finish_reason in ("error", "abort"))
    turns = sum(int(tr.metadata.get("agent", {}).get("turns", 0)) for g in groups for tr in g.trajectories)
    dead = (work / f"broker-s{workers}.log").read_text(errors="replace").count("declared dead")
    row = {"tree": label, "workers": workers, "simulated": True, "sessions": len(want), "delivered": len(ids), "lost": len(want - set(ids)),
           "worker_declared_dead": dead,
           "duplicated": len(ids) - len(set(ids)), "unexpected": len(set(ids) - want), "timed_out": timed_out, "failed": failed,
           "wall_s": round(wall, 2), "turns": turns, "turns_per_s": round(turns / wall, 1), "episodes_per_s": round(len(set(ids)) / wall, 1),
           "max_held_by_one_worker": max(held.values()) if held else None, "held_per_worker": held,
           "workers_cpu_s": round(cpu[0], 1), "broker_cpu_s": round(cpu[1], 1), "trainer_cpu_s": round(cpu[2], 1)}
    print(f"  sessions: {json.dumps(row)}", flush=True)
    return row


async def bench_sessions(args: argparse.Namespace, result: dict[str, Any], save: Any) -> None:
    work = args.workdir
    rows: list[dict[str, Any]] = result.setdefault("rows", [])
    counts = [int(x) for x in args.workers.split(",")]
    try:
        for rep in range(args.reps):
            for w in counts if rep % 2 == 0 else list(reversed(counts)):
                for label, tree in args.tree_paths if rep % 2 == 0 else list(reversed(args.tree_paths)):
                    row = await sessions_row(w, args, work, tree, label)
                    row["rep"] = rep
                    rows.append(row)
                    save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["summary"] = {f"{label}/workers={w}": {k: _median([r[k] for r in rows if r["workers"] == w and r["tree"] == label])
                                                   for k in ("wall_s", "turns_per_s", "episodes_per_s", "max_held_by_one_worker")}
                         for w in counts for label, _ in args.tree_paths}
    result["summary"]["lost_duplicated_timed_out_failed_dead"] = [
        sum(r[k] for r in rows) for k in ("lost", "duplicated", "timed_out", "failed", "worker_declared_dead")]
    print(json.dumps(result["summary"], indent=1))


# --------------------------------------------------------------------------- main


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The episode workload's flags (this bench and bench/gpu_episodes.py run the same one)."""
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="episodes per group")
    ap.add_argument("--concurrency", type=int, default=128, help="the engine's capacity and the worker's max_episodes")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tokens-per-turn", type=int, default=128)
    ap.add_argument("--tool-words", type=int, default=24)
    ap.add_argument("--context", type=int, default=4096)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", choices=("turns", "sessions"), default="turns")
    ap.add_argument("--agent-process", metavar="SOCKET", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help="write the result here")
    ap.add_argument("--trees", default=f"this={ROOT}", help="label=path,... source trees to compare (interleaved)")
    ap.add_argument("--placement", default="both", help="comma-separated: remote, inworker, children; both = remote,inworker")
    ap.add_argument("--agent-processes", type=int, default=2, help="the children placement's worker --agent-processes")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--agent-client", choices=("per-episode", "shared"), default="per-episode",
                    help="turns bench: the agent's openai client, a new AsyncOpenAI per episode (each builds a TLS context) or "
                         "one per process copied per episode (bench/gpu_episodes.py --agent-client shared, what the GPU runs use)")
    ap.add_argument("--profile", default="", metavar="PY_SPY",
                    help="turns bench: after the measured reps, one row per tree and placement under this py-spy binary "
                         "(the JSON's 'profile': where the worker's, the engine child's and the broker's CPU went)")
    ap.add_argument("--profile-raw", default="", metavar="DIR", help="keep py-spy's raw stacks in DIR")
    ap.add_argument("--model-dir", default="/tmp/rp-episodes-tiny")
    ap.add_argument("--update", action="store_true",
                    help="turns bench: after each measured phase, the workload again with one weight version published at half "
                         "its wall time (row key one_update: throughput, the engine's stopped_s and apply timings)")
    ap.add_argument("--apply-mode", default="interrupt", help="the worker's --apply-mode (interrupt, drain)")
    ap.add_argument("--keep-work", action="store_true", help="keep the work directory (the pool's logs); its path is printed")
    ap.add_argument("--engine-extra", default="", help="appended to the sglang engine's options, e.g. ',engine_kwargs=...'")
    ap.add_argument("--sim-tree", default="", metavar="PATH",
                    help="turns bench: every tree's engine child (the sim) runs this tree's code, so trees differ only in the "
                         "pool's own code (the child's CPU is not the pool's)")
    ap.add_argument("--chat-sampling", action="store_true",
                    help="turns bench: the sim samples as a chat model does (no special token inside a turn, a stop on the "
                         "end-of-turn; SimOptions.special_ids); the sim's tree (--sim-tree, else every tree) must have it")
    add_workload_args(ap)
    ap.add_argument("--phase-timeout-s", type=float, default=600)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--workers", default="1,2,4", help="sessions bench: worker counts, one row each")
    ap.add_argument("--session-turns", type=int, default=3)
    ap.add_argument("--decode-s-per-token", type=float, default=0.01, help="sessions bench: the sim engine's decode time")
    args = ap.parse_args()
    if args.agent_process:
        _serve_agents(args.agent_process)
        return 0
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if args.bench == "sessions" and args.tokens_per_turn == 128:
        args.tokens_per_turn = 16
    result: dict[str, Any] = {"what": f"bench/episodes.py --bench {args.bench}", "simulated": True,
                              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "params": dict(vars(args)),
                              "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start"}

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    # the episode functions' module, importable in the workers of every tree (see the module docstring)
    args.workdir = Path(tempfile.mkdtemp(prefix="rp-episodes-"))
    if args.keep_work:
        print(f"work directory: {args.workdir}", flush=True)
    (args.workdir / "agent").mkdir()
    (args.workdir / "agent" / "rp_episodes_bench.py").symlink_to(Path(__file__).resolve())
    args.tree_paths = [(label, Path(path).resolve()) for label, _, path in (t.partition("=") for t in args.trees.split(","))]
    if args.bench == "turns" and not (Path(args.model_dir) / "config.json").exists():
        from rollpool.workers.engines.tiny_model import build_tiny_model

        build_tiny_model(Path(args.model_dir))
    run = bench_turns if args.bench == "turns" else bench_sessions
    try:
        asyncio.run(run(args, result, save))
    except Exception as exc:  # noqa: BLE001 - recorded; the partial JSON stands
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        print(f"failed: {exc!r}", flush=True)
    result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    result["load_average_at_end"] = round(os.getloadavg()[0], 1)
    save()
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
