"""Tokens sampled again when a worker dies mid-episode: replay off (every turn sampled again) beside replay on.

SIMULATED: the ``sim`` engine (seeded tokens, a per-token decode time), so tokens and seconds are the sim's.
One process: a broker, a doomed worker and a rescuer (real `Broker` and `Worker` on zmq tcp loopback) and a
`TrainerClient`. ``--groups`` groups of ``--n`` token-level episodes, ``--turns`` sampled turns of ``--tokens``
tokens each with a tool result inserted between turns. The doomed worker is killed (no drain, no Goodbye) once
the broker has kept ``--kill-after`` finished turns of every episode, during the next turn; the rescuer then
runs every group again. Each mode runs ``--reps`` times, modes interleaved rep by rep.

Per mode: the rescuer's engine tokens (what the re-run sampled), the tokens of the turns the dead worker had
finished, the sampled tokens delivered, and from them the tokens sampled twice among finished turns
(``regenerated = rerun + finished_by_dead - delivered``), beside the broker's own ``tokens_regenerated``
counter. The turn in flight at the death is sampled again in both modes (its tokens died with the worker).

    python bench/replay.py --json bench/results/cpu-replay-simulated.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from rollpool.broker.config import BrokerConfig  # noqa: E402
from rollpool.broker.service import Broker  # noqa: E402
from rollpool.protocol import Prompt, SamplingParams, SocketFactory  # noqa: E402
from rollpool.trainer_client import TrainerClient, TrainerClientConfig  # noqa: E402
from rollpool.workers import EpisodeContext  # noqa: E402
from rollpool.workers.config import WorkerConfig  # noqa: E402
from rollpool.workers.engines.sim import SimEngine  # noqa: E402
from rollpool.workers.worker import Worker  # noqa: E402

HB = 0.1
HOLD = asyncio.Event()


class CountingSim(SimEngine):
    """The sim engine, counting the tokens of the turns it finished."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.tokens = 0

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = await super().generate(*args, **kwargs)
        self.tokens += sum(len(s.output_ids) for s in out.samples)
        return out


def make_agent(turns: int) -> Any:
    async def agent(ctx: EpisodeContext, prompt: Prompt) -> float:
        for k in range(turns):
            await ctx.generate()
            if k < turns - 1:
                ctx.append([7, 8, 9])  # a deterministic tool's result
        return 1.0

    return agent


async def one_run(args: argparse.Namespace, replay: bool, rep: int) -> dict[str, Any]:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sockets = SocketFactory(ctx)
    broker = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*", heartbeat_interval_s=HB,
                                 drain_timeout_s=0.0), sockets)
    broker_task = asyncio.create_task(broker.run())
    await asyncio.wait_for(broker.ready.wait(), 5)
    engines: dict[str, CountingSim] = {}

    def factory(name: str) -> Any:
        def make() -> CountingSim:
            engines[name] = CountingSim(decode_s_per_token=args.decode_s, length="fixed", length_median=args.tokens,
                                        capacity=args.groups * args.n, vocab=1000, seed=rep)
            return engines[name]
        return make

    def worker(name: str) -> tuple[Worker, asyncio.Task[None]]:
        cfg = WorkerConfig(broker=broker.worker_endpoint, worker_id=name, heartbeat_interval_s=HB, reconnect_backoff_s=0.1,
                           reconnect_backoff_max_s=0.5, drain_timeout_s=0.2, send_timeout_s=1.0, episode_replay=replay,
                           max_episodes=args.groups * args.n)
        w = Worker(cfg, sockets, engine_factory=factory(name), episodes={"default": make_agent(args.turns)})
        return w, asyncio.create_task(w.run())

    client = TrainerClient(config=TrainerClientConfig(broker=broker.client_endpoint, request_timeout_s=0.5, pull_wait_s=0.5),
                           sockets=sockets)
    tasks: list[asyncio.Task[None]] = []
    try:
        await client.connect()
        _doomed, doomed_task = worker("doomed")
        tasks.append(doomed_task)
        prompts = [Prompt(prompt_id=f"r{rep}-g{i}", input_ids=np.arange(3, 9, dtype=np.int32), group_size=args.n,
                          sampling=SamplingParams(max_new_tokens=args.tokens)) for i in range(args.groups)]
        await client.submit(prompts)
        st = broker.state
        want = args.kill_after * args.groups * args.n
        deadline = time.monotonic() + 60
        while st.counters["replay_turns_kept"] < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the doomed worker kept {st.counters['replay_turns_kept']} of {want} turns")
            await asyncio.sleep(0.005)
        finished_by_dead = sum(len(t.output_ids) for g in st.groups.values() for per in (g.turns or {}).values() for t in per)
        doomed_task.cancel()  # killed: no drain, no Goodbye, no hand-back
        await asyncio.gather(doomed_task, return_exceptions=True)
        rescuer, rescuer_task = worker("rescuer")
        tasks.append(rescuer_task)
        t0 = time.monotonic()
        batch = await client.get_batch(args.groups, timeout=60)
        rerun_s = time.monotonic() - t0
        delivered = sum(int(t.loss_mask.sum()) for g in batch.groups for t in g.trajectories)
        rerun = engines["rescuer"].tokens
        stats = rescuer.episodes.stats if rescuer.episodes is not None else None
        return {
            "mode": "replay on" if replay else "replay off",
            "rep": rep,
            "episodes": args.groups * args.n,
            "finished_by_dead_tokens": finished_by_dead,
            "rerun_engine_tokens": rerun,
            "delivered_sampled_tokens": delivered,
            "regenerated_tokens": rerun + finished_by_dead - delivered,
            "broker_tokens_regenerated": st.counters["tokens_regenerated"],
            "turns_replayed": stats.turns_replayed if stats else 0,
            "workers_lost": st.counters["workers_lost"],
            "rerun_s": round(rerun_s, 3),
        }
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 5)
        broker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(broker_task, 10)
        sockets.close()
        ctx.destroy(linger=0)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for rep in range(args.reps):
        for replay in (False, True):
            runs.append(await one_run(args, replay, rep))
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for mode in ("replay off", "replay on"):
        rows = [r for r in runs if r["mode"] == mode]
        summary[mode] = {k: statistics.median(r[k] for r in rows) for k in
                         ("finished_by_dead_tokens", "rerun_engine_tokens", "delivered_sampled_tokens", "regenerated_tokens",
                          "broker_tokens_regenerated", "turns_replayed", "rerun_s")}
        summary[mode]["regenerated_per_worker_death"] = summary[mode]["regenerated_tokens"]  # one death per run
    return {"bench": "replay", "simulated": True, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": runs, "median": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4, help="prompt groups in flight on the doomed worker")
    ap.add_argument("--n", type=int, default=4, help="episodes per group")
    ap.add_argument("--turns", type=int, default=6, help="sampled turns per episode")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per sampled turn")
    ap.add_argument("--kill-after", type=int, default=3, help="finished turns of every episode before the kill")
    ap.add_argument("--decode-s", type=float, default=0.002, help="the sim engine's seconds per decoded token")
    ap.add_argument("--reps", type=int, default=3, help="runs per mode, interleaved")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    if not 0 < args.kill_after < args.turns:
        ap.error("--kill-after must be in [1, --turns - 1]")
    out = asyncio.run(main_async(args))
    print("SIMULATED (sim engine): tokens sampled again after one worker death, median of", args.reps, "runs")
    print(f"{'':28}{'replay off':>14}{'replay on':>14}")
    for key in ("finished_by_dead_tokens", "rerun_engine_tokens", "delivered_sampled_tokens", "regenerated_tokens",
                "broker_tokens_regenerated", "turns_replayed", "rerun_s"):
        print(f"{key:28}{out['median']['replay off'][key]:>14}{out['median']['replay on'][key]:>14}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
