"""Async vs sync RL through the pool, with simulated GPUs. SIMULATED.

Every figure this writes is simulated: `sim` engines stand in for GPUs and a
sleep stands in for the optimizer step. The pool itself is real: the broker
(``python -m rollpool.broker``) and the sim workers (``python -m
rollpool.workers --engine sim --count N``, all N in one process) are child
processes, and the trainer is a `TrainerClient` in this process that submits
prompts, pulls whole groups, "trains" and publishes zero-byte weight versions
through the real weight publisher (workers fetch and apply every version).

Fixed workload (the issue's):

* 64 and 256 GPUs; one sim worker per generation GPU, 64 concurrent
  sequences per worker, 25 ms per decode step whatever the concurrency
  (the sim engine's model), prefill 0;
* output lengths lognormal, median 2,048 tokens, sigma 0.9, capped at 16,384
  (``max_new_tokens``); group size 8; B = 512 samples (64 groups) per step;
* trainer time per step = tokens in the batch x 0.05 ms / training GPUs;
* sync (AReaL's baseline): all GPUs generate one batch, then all GPUs train
  on it (eta = 0, one batch per version);
* async: 7/8 of the GPUs generate (sim workers), 1/8 train (the sleep), with
  the broker's staleness admission at eta = 1, 2, 4, 8 and the trainer's hard
  bound ``get_batch(max_staleness=eta)``. Why 7:1: at 1/8 of the GPUs a
  training step takes 9.6 s (64 GPUs) or 2.4 s (256 GPUs), so the trainer
  alone could take 54 or 214 samples/s, while the generation side gives at
  most 18 (64 GPUs, slot-bound) or 21 (256 GPUs, eta 8, window-bound): training
  is never the bottleneck, and every GPU moved from generation to training would
  only lower the slot bound (at 64 GPUs, eta 8 is slot-bound).

Both modes train the same number of samples (``--steps`` x B).

Time is compressed: the decode step and the training sleep are divided by a
time scale and measured wall time is multiplied back, so all reported seconds
are simulated seconds. The scale is chosen per run so the simulated token rate
stays within ``--token-budget`` tokens per real second (the sim engine makes
every token in Python, about 2 us each) and at most ``--max-scale``; each run
reports the CPU its broker, workers and trainer used per real second
(``cpu_seconds_*`` / ``real_seconds``) so one can see the pool was not
CPU-bound. What the scale does distort: fixed real-time latencies (publish,
apply, pull) are multiplied by it. They sit on sync's critical path once per
step (sync reaches about 0.95 of its bound) and are overlapped in async.

The analytic bound (what perfect overlap gives, nothing wasted), derived for
this workload and checked against a zero-latency model of the same rules
(`ideal_pool`, agreement within 2%):

* A group holds its n = 8 sequence slots, and its 8 samples of the broker's
  ``running``, until its longest sample ends: the sim engine returns a request
  when all n samples end and the worker returns the credits of the whole group
  then. E[group time] D = E[max of 8 lengths] x 25 ms = 202.8 s.
* Slots (Little's law): ``gen x 64 / E[D]`` samples/s (17.7 at 56 generation
  GPUs, 70.7 at 224).
* Trainer: ``B / t_train``.
* Admission window. The rule is ``accepted + running + n <= (v + eta + 1) B``,
  and ``accepted`` counts every sample delivered and not dropped, including
  those not yet turned into a published version: the batch being trained and
  the results buffered for the next one (``buffered = accepted - v B``). So
  ``running <= (eta + 1) B - buffered``, not (eta + 1) B. With results
  arriving at rate X, ``buffered`` climbs from X t_train to B while the
  trainer waits, then grows from B to B + X t_train while it trains; its time
  average is ``B (1/2 + X t_train / B)``. Little's law (``running = X E[D]``)
  then gives ``X = (eta + 1/2) B / (E[D] + t_train)``. The old figure,
  ``(eta + 1) B / E[D]``, was 10-35% too high.
* bound = min(window, slots, trainer).

What the rules cost beyond that. The admission rule bounds how many samples
are in flight, not how old they are; the trainer's hard bound drops a group
whose oldest token is more than eta versions behind. With a step every
T = B / X = E[D] / (eta + 1/2) seconds, a group is dropped when it runs longer
than about (eta + 1) T, i.e. about 1.1-1.3 E[D], whatever eta is: 18-22% of the
generated groups at every eta in the zero-latency model, which then trains
0.80-0.86 of the bound. ``ideal_pool_samples_per_s`` is that model's rate, and
``fraction_of_ideal_pool`` shows what the real pool loses on top. Measured,
that loss is almost all one effect: the capacity a version bump opens is
dispatched at once, before any worker has applied the new version, so those
groups start one version behind; the model with that one change
(``ideal_pool_start_behind_samples_per_s``) matches the measured rates within
3% (fix, not made here: hold that capacity for workers applying the new
version). ``fraction_of_bound`` is the honest figure against perfect overlap.
Cancelling a doomed group as soon as it cannot meet the bound (freeing its
slots and window early) would raise the model's rate by only 5-8%
(``ideal_pool_cancel_doomed_samples_per_s``); removing the drops needs a
design change (the trainer waits for old groups, or a staleness measure that
partial rollouts can reset).

Steady state: the run fills the admission window at version 0, and the age
mix of groups in flight settles only after about one longest group (410 s);
the steady rate counts the steps that end after ``--warmup-s`` (600 simulated
s; the last 4 steps at least, else the second half). The speedup over sync is
steady async / steady sync (sync has no warm-up); the end-to-end ratio, which
includes the async fill, is reported as ``speedup_end_to_end``, and
``speedup_vs_sync_bound`` divides by sync's analytic bound instead of its
measured rate (so the time scale's cost to sync cannot flatter async).

Reported per run: trained samples per simulated second (end to end and
steady), speedup over sync, generation-side utilisation (share of the
generation GPUs' sequence slots holding a group that was trained, from the
trained groups' start/finish times; dropped groups' slot time is not counted),
the staleness histogram, groups dropped by the hard bound, and the bounds.

Staleness without wasted generation. `ideal_pool` also models the new rule sets with
options only (version-aware dispatch ``fresh_dispatch_hold_s``, early cancellation ``cancel_doomed``,
``stale_policy="keep"`` with ``max_staleness_keep``) and reports wasted tokens by reason and the
share of trained samples older than eta; `analytic` stores, per eta, ``model_today`` (today's
broker), ``model_new_drop`` and ``model_new_keep`` (2 x eta), all MODEL figures. The pool runs
each eta under the trainer's ``--policies`` with the broker's ``--rules``: ``new`` (the default:
``--fresh-dispatch-hold-s`` of ``--hold-s`` REAL seconds, 3 by default, and
``--cancel-stale-inflight``; the trainer client tells the broker its bound with every version) or
``today`` (neither). Run keys: ``async_eta{eta}`` (drop, new rules), ``keep_eta{eta}`` (keep 2 x eta,
new rules), ``today_eta{eta}`` / ``todaykeep_eta{eta}`` (today's rules; runs stored before the
broker rules existed are renamed so by ``--merge``). All MEASURED (simulated GPUs).
`summarise` writes the maps ``keep_fraction_of_bound``, ``keep_wasted_share``,
``keep_older_than_eta_share``, ``keep_max_staleness_seen``, ``drop_wasted_share``,
``drop_fraction_of_model`` (measured / the new-drop model), ``max_staleness_seen`` (measured),
``today_*`` (measured, today's rules) and ``drop_model_wasted_share`` plus ``model_*`` (model).
A measured wasted share is the broker's (``broker_wasted`` on each run): generated tokens never
delivered to training over all generated, by reason (stale drop, cancel, failure, duplicate), whole
run including the fill; the model's count the steady state.

The full table in invocations of under 15 minutes each (``--merge`` adds runs to the JSON; each
(policy, eta) run at 40 steps takes 200-220 s here): ``--gpus 64 --etas 1,2 --no-sync --policies
keep --merge --json J``, then ``--etas 4,8``, then the same for 256; ``--reanalyse`` recomputes
the model side of a stored JSON without running the pool.

    python bench/async_speedup.py [--quick | --smoke] [--gpus 64,256] [--etas 1,2,4,8] [--no-sync]
        [--policies drop,keep] [--steps 40] [--token-budget 400000] [--max-scale 100] [--json PATH [--merge]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollpool.trainer_client import TrainerClient, TrainerClientConfig  # noqa: E402

AREAL_SPEEDUP = 2.77
HOLD_S = 5.0
"""The model's ``fresh_dispatch_hold_s`` for the new rules."""
APPLY_S = 1.0
"""The model's weight-apply latency for the rule sets that need one (simulated seconds): with it, today's
broker starts the groups a bump opens one version behind; the new rules hold them for at most HOLD_S."""
WARMUP_S = 600.0
"""Simulated seconds left out of the steady-state rate: 1.5x the longest possible group (410 s)."""


@dataclass(frozen=True)
class Workload:
    length_median: int = 2048
    length_sigma: float = 0.9
    length_cap: int = 16_384
    decode_s_per_step: float = 0.025
    capacity: int = 64
    group_size: int = 8
    batch_size: int = 512
    train_s_per_token_gpu: float = 0.05e-3
    train_fraction: float = 1 / 8
    shared_group_length: bool = False
    """Every sample of a group has the group's one drawn length (the GPU demo's long tail: a length per prompt);
    False: a length per sample (the sim engine's)."""
    group_latency_s: float = 0.0
    """Seconds a group takes beyond its longest sample's decode steps (dispatch, prefill, the first token, the result's
    way back): fitted from the GPU demo's group timings by `bench/calibrate_sim.py`; 0 in the simulated tables."""

    def describe(self) -> str:
        return (
            f"lengths lognormal(median {self.length_median}, sigma {self.length_sigma}) capped at {self.length_cap}; "
            f"decode {self.decode_s_per_step * 1e3:g} ms/step for up to {self.capacity} sequences per worker; prefill 0; "
            f"group size {self.group_size}; B = {self.batch_size} samples/step; "
            f"train {self.train_s_per_token_gpu * 1e3:g} ms per token per training GPU; "
            f"async split: {1 - self.train_fraction:.3g} generate / {self.train_fraction:.3g} train"
        )


SMOKE = Workload(length_median=32, length_cap=256, decode_s_per_step=0.025, capacity=16, batch_size=32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- analytic model


def draw_lengths(w: Workload, size: int | tuple[int, ...], seed: int = 1) -> np.ndarray:
    """The sim engine's lognormal draw (round(exp(ln median + sigma z)), at least 1), capped."""
    rng = np.random.default_rng(seed)
    raw = np.maximum(1, np.rint(np.exp(math.log(w.length_median) + w.length_sigma * rng.standard_normal(size))))
    return np.minimum(raw, w.length_cap)


def split(w: Workload, gpus: int) -> tuple[int, int]:
    train = max(1, round(gpus * w.train_fraction))
    return gpus - train, train


def fluid_window_bound(w: Workload, eta: int, group_s: float, train_s: float) -> float:
    """Trained samples/s the admission window allows when nothing is wasted (derivation in the module docstring)."""
    return (eta + 0.5) * w.batch_size / (group_s + train_s)


def ideal_pool(w: Workload, gen: int, train: int, eta: int, steps: int = 400, seed: int = 7,
               hard_bound: bool = True, warmup_s: float = 0.0, cancel_doomed: bool = False,
               start_behind_at_bump: bool = False, fresh_dispatch_hold_s: float | None = None, apply_s: float = 0.0,
               stale_policy: str = "drop", max_staleness_keep: int | None = None, return_steps: bool = False) -> dict[str, Any]:
    """The pool's rules with every latency zero: a discrete-event model, for reference only.

    Same rules as the real run: AReaL admission ``accepted + running + n <= (v + eta + 1) B`` over
    ``gen x capacity / n`` group slots (a group holds its slots until its longest sample ends),
    groups taken in completion order, the trainer's hard bound judging a group's version lag when it
    is taken, training ``tokens x 0.05 ms / train`` GPUs, then the version moves on.

    Rule options (each a rule set this model prices):

    * ``start_behind_at_bump``: today's broker. The capacity a version bump opens is dispatched at
      once, before any worker has applied the new version, so those groups start one version behind.
    * ``fresh_dispatch_hold_s``: version-aware dispatch. The capacity a bump opens is held for
      workers that hold or are applying the new version, for at most the hold: with workers that
      need ``apply_s`` to apply, it goes out at the new version after ``apply_s`` when
      ``apply_s <= hold``, else after the hold, one version behind (the pool never idles longer).
    * ``cancel_doomed``: early cancellation. A running group is cancelled as soon as it can no longer
      be consumed within the bound (the version is more than the bound past its start version; the
      version only grows, so that is certain); its tokens so far are wasted, its slots and window
      released at once.
    * ``stale_policy``: ``drop`` (the hard bound drops above eta; its samples leave ``accepted``) or
      ``keep`` (delivered and trained up to ``max_staleness_keep``, default 2 x eta; dropped above).
      Under ``keep`` cancellation uses ``max_staleness_keep`` as its bound.

    Returns (steady state, after `warmup_s`): ``samples_per_s``; ``dropped_share`` and
    ``cancelled_share`` of the groups that ended; ``wasted_share`` (generated tokens never trained,
    over all generated tokens) and ``wasted_share_by_reason`` (stale_drop, cancel, failure,
    duplicate: the last two are zero here, nothing fails or repeats in this model);
    ``older_than_eta_share`` of the trained samples; ``max_staleness_seen`` among them; with `return_steps`,
    ``step_at_s``: when each step ended (every step, the warm-up included).
    """
    if stale_policy not in ("drop", "keep"):
        raise ValueError(f"stale_policy must be drop or keep, got {stale_policy!r}")
    if fresh_dispatch_hold_s is not None and fresh_dispatch_hold_s < 0:
        raise ValueError(f"fresh_dispatch_hold_s must be >= 0, got {fresh_dispatch_hold_s}")
    bound = eta if stale_policy == "drop" else (2 * eta if max_staleness_keep is None else max_staleness_keep)
    n, per_step = w.group_size, w.batch_size // w.group_size
    draws = draw_lengths(w, (steps * per_step * 4, n), seed=seed)
    if w.shared_group_length:
        draws = np.repeat(draws[:, :1], n, axis=1)
    slots = gen * w.capacity // n
    version = accepted = running = 0
    now = 0.0
    events: list[tuple[float, int]] = []  # (time, group id); -1: the training step ends; -2: a dispatch hold ends
    live: dict[int, tuple[int, float, float, int]] = {}  # group id -> (version at start, tokens, start time, draw index)
    done: deque[tuple[int, float]] = deque()
    ready: list[tuple[int, float]] = []
    training = False
    step_at: list[float] = []
    next_id = 0
    ended = {"done": 0, "dropped": 0, "cancelled": 0}
    tokens = {"generated": 0.0, "stale_drop": 0.0, "cancel": 0.0}
    trained_lags: list[int] = []
    hold_until = -1.0
    hold_start = 0  # the version groups dispatched when a hold ends start at

    def admit(start: int) -> None:
        nonlocal running, next_id
        while len(live) < slots and accepted + running + n <= (version + eta + 1) * w.batch_size:
            k = next_id % len(draws)
            lengths = draws[k]
            next_id += 1
            live[next_id] = (start, float(lengths.sum()), now, k)
            running += n
            heapq.heappush(events, (now + w.group_latency_s + float(lengths.max()) * w.decode_s_per_step, next_id))

    def counted() -> bool:
        return now >= warmup_s

    def take() -> None:
        nonlocal accepted
        while done and len(ready) < per_step:
            g = done.popleft()
            if hard_bound and version - g[0] > bound:
                accepted -= n
                if counted():
                    ended["dropped"] += 1
                    tokens["stale_drop"] += g[1]
            else:
                ready.append(g)

    admit(version)
    while len(step_at) < steps:
        now, gid = heapq.heappop(events)
        bump = gid == -1
        if bump:
            version += 1
            training = False
            step_at.append(now)
            if cancel_doomed:
                for doomed in [k for k, g in live.items() if g[0] < version - bound]:
                    start_v, _, t0, k = live.pop(doomed)  # its completion event finds nothing
                    running -= n
                    if counted():
                        ended["cancelled"] += 1
                        made = float(np.minimum(draws[k], max(0.0, now - t0 - w.group_latency_s) / w.decode_s_per_step).sum())
                        tokens["cancel"] += made
                        tokens["generated"] += made
        elif gid == -2:
            pass
        elif gid in live:
            g = live.pop(gid)
            running -= n
            accepted += n
            if counted():
                ended["done"] += 1
                tokens["generated"] += g[1]
            done.append((g[0], g[1]))
        if not training:
            take()
            if len(ready) >= per_step:
                batch, ready[:] = ready[:per_step], ready[per_step:]
                training = True
                if now >= warmup_s:
                    trained_lags.extend([version - v for v, _ in batch])
                heapq.heappush(events, (now + sum(t for _, t in batch) * w.train_s_per_token_gpu / train, -1))
        if bump and fresh_dispatch_hold_s is not None and apply_s > 0:
            delay = min(apply_s, fresh_dispatch_hold_s)
            hold_until, hold_start = now + delay, version if apply_s <= fresh_dispatch_hold_s else version - 1
            heapq.heappush(events, (hold_until, -2))
        if now < hold_until:
            continue  # the capacity this bump opened waits for workers on the new version
        if gid == -2:
            admit(hold_start)
        else:
            admit(version - 1 if bump and start_behind_at_bump and fresh_dispatch_hold_s is None else version)
    t = np.asarray(step_at)
    first = int(np.searchsorted(t, warmup_s))
    completed = max(1, ended["done"])  # every group that ran to its end (dropped ones too)
    wasted = tokens["stale_drop"] + tokens["cancel"]
    gen_tokens = max(1.0, tokens["generated"])
    lags = np.asarray(trained_lags or [0])
    return {"samples_per_s": float((len(t) - 1 - first) * w.batch_size / (t[-1] - t[first])),
            "dropped_share": ended["dropped"] / completed,
            "cancelled_share": ended["cancelled"] / max(1, ended["done"] + ended["cancelled"]),
            "wasted_share": wasted / gen_tokens,
            "wasted_share_by_reason": {"stale_drop": tokens["stale_drop"] / gen_tokens, "cancel": tokens["cancel"] / gen_tokens,
                                       "failure": 0.0, "duplicate": 0.0},
            "older_than_eta_share": float((lags > eta).mean()),
            "max_staleness_seen": int(lags.max()),
            **({"step_at_s": [float(x) for x in t]} if return_steps else {})}


@dataclass(frozen=True)
class SharedGpuCost:
    """MODEL option, the *corrected model* of `bench/calibrate_sim.py`: what `ideal_pool` leaves out when the engine
    applies every weight version by interrupting what it is generating, and (on one GPU) shares the card with the
    trainer. All zero: `shared_gpu_pool` is `ideal_pool` (same rules, same draws, fixed decode step). Not used by the
    simulated tables unless asked for (`bench/calibrate_sim.py --rerun-64`)."""

    decode_overlap: float = 0.0
    """While the trainer trains, a decode step takes (1 + decode_overlap) x `Workload.decode_s_per_step` (the trainer
    and the engine on one GPU; 0 where the trainer has GPUs of its own)."""
    decode_s_per_seq: float = 0.0
    """A decode step takes this many seconds more per sequence decoding on the engine: with it the engine's token
    rate levels off near 1 / decode_s_per_seq (the per-token work of the engine and the worker), so a fuller engine
    makes every sequence in it slower instead of making more tokens."""
    update_s_per_seq: float = 0.0
    """At each weight version the engines stop for this many seconds per sequence in flight on an engine (the
    interrupt: every running sample is re-prefilled on the new weights); no sequence in flight, no pause."""

    def update_pause_s(self, seqs_per_engine: float) -> float:
        return self.update_s_per_seq * seqs_per_engine


def shared_gpu_pool(w: Workload, cost: SharedGpuCost, gen: int, train: int, eta: int, steps: int = 400, seed: int = 7,
                    hard_bound: bool = True, warmup_s: float = 0.0, start_behind_at_bump: bool = False,
                    return_steps: bool = False) -> dict[str, Any]:
    """`ideal_pool`'s rules (admission, slots, completion order, hard bound; the drop policy) with the costs of
    `SharedGpuCost`: a discrete-event model in which the engines' clock is counted in decode steps.

    Every engine decodes one token of every sequence it holds per decode step (continuous batching), so a group
    admitted at engine step tau ends at step tau + its longest length, whatever the wall time of a step; the wall
    time of a step is `decode_s_per_step`, x (1 + `decode_overlap`) while the trainer trains, and no step runs
    during the pause after each version (`update_s_per_seq` x sequences in flight per engine: the engines are
    taken as evenly loaded, one pool of ``gen x capacity`` slots). A group's result arrives `group_latency_s` after
    its last token (its slots held until then). Returns ``samples_per_s`` (steady, after `warmup_s`),
    ``dropped_share``, ``mean_in_flight`` (sequences decoding, time-averaged), ``paused_share`` (of the wall time),
    ``trainer_idle_share`` (over the whole run, as the demo measures it),
    ``group_timings`` ([longest length, seconds from admission to result] of the trained groups) and, with
    `return_steps`, ``step_at_s``."""
    n, per_step = w.group_size, w.batch_size // w.group_size
    draws = draw_lengths(w, (steps * per_step * 4, n), seed=seed)
    if w.shared_group_length:
        draws = np.repeat(draws[:, :1], n, axis=1)
    slots = gen * w.capacity // n
    version = accepted = running = decoding = 0
    now = tau = 0.0
    paused_until = 0.0
    paused_total = in_flight_area = busy = 0.0
    finish: list[tuple[float, int]] = []  # (engine step at which the group's last token is made, group id)
    arrive: list[tuple[float, int]] = []  # (wall time its result reaches the trainer, group id)
    live: dict[int, tuple[int, float, float, int]] = {}  # group id -> (version at start, tokens, start time, draw index)
    done: deque[tuple[int, float, float, float]] = deque()  # (version at start, tokens, longest, seconds)
    ready: list[tuple[int, float, float, float]] = []
    train_end = math.inf
    step_at: list[float] = []
    timings: list[list[float]] = []
    next_id = 0
    ended = {"done": 0, "dropped": 0}

    def admit(start: int) -> None:
        nonlocal running, decoding, next_id
        while len(live) < slots and accepted + running + n <= (version + eta + 1) * w.batch_size:
            k = next_id % len(draws)
            next_id += 1
            live[next_id] = (start, float(draws[k].sum()), now, k)
            running += n
            decoding += n
            heapq.heappush(finish, (tau + float(draws[k].max()), next_id))

    def take() -> None:
        nonlocal accepted
        while done and len(ready) < per_step:
            g = done.popleft()
            if hard_bound and version - g[0] > eta:
                accepted -= n
                if now >= warmup_s:
                    ended["dropped"] += 1
            else:
                ready.append(g)

    admit(version)
    while len(step_at) < steps:
        step_s = ((w.decode_s_per_step + cost.decode_s_per_seq * decoding / gen)
                  * (1.0 + (cost.decode_overlap if train_end < math.inf else 0.0)))
        start_decoding = max(now, paused_until)
        t_finish = start_decoding + (finish[0][0] - tau) * step_s if finish else math.inf
        t_arrive = arrive[0][0] if arrive else math.inf
        t_next = min(t_finish, t_arrive, train_end)
        if t_next == math.inf:
            raise RuntimeError("shared_gpu_pool: nothing in flight and the trainer idle (batch larger than the window?)")
        if t_next > start_decoding:
            tau += (t_next - start_decoding) / step_s
        paused_total += max(0.0, min(t_next, paused_until) - now)
        in_flight_area += decoding * (t_next - now)
        now = t_next
        bump = False
        if t_next == train_end:
            version += 1
            train_end = math.inf
            step_at.append(now)
            bump = True
            if decoding:
                paused_until = now + cost.update_pause_s(decoding / gen)
        elif t_next == t_arrive:
            _, gid = heapq.heappop(arrive)
            start_v, toks, t0, k = live.pop(gid)
            running -= n
            accepted += n
            if now >= warmup_s:
                ended["done"] += 1
            done.append((start_v, toks, float(draws[k].max()), now - t0))
        else:
            _, gid = heapq.heappop(finish)
            tau = max(tau, _)  # the float sum can fall a hair short of the event's step
            decoding -= n
            heapq.heappush(arrive, (now + w.group_latency_s, gid))
        if train_end == math.inf:
            take()
            if len(ready) >= per_step:
                batch, ready[:] = ready[:per_step], ready[per_step:]
                train_end = now + sum(g[1] for g in batch) * w.train_s_per_token_gpu / train
                busy += train_end - now
                timings.extend([g[2], g[3]] for g in batch)
        admit(version - 1 if bump and start_behind_at_bump else version)
    t = np.asarray(step_at)
    first = int(np.searchsorted(t, warmup_s))
    return {"samples_per_s": float((len(t) - 1 - first) * w.batch_size / (t[-1] - t[first])) if len(t) - 1 > first else 0.0,
            "dropped_share": ended["dropped"] / max(1, ended["done"]),
            "mean_in_flight": in_flight_area / max(now, 1e-12), "paused_share": paused_total / max(now, 1e-12),
            "trainer_idle_share": 1.0 - busy / max(now, 1e-12),
            "group_timings": timings, **({"step_at_s": [float(x) for x in t]} if return_steps else {})}


def analytic(w: Workload, gpus: int, etas: list[int], warmup_s: float, rule_models: bool = True) -> dict[str, Any]:
    """The bounds and the zero-latency models at each eta (`rule_models`: also the new rule sets)."""
    per_sample = draw_lengths(w, 400_000)
    mean_tokens = float(per_sample.mean())
    groups = draw_lengths(w, (100_000, w.group_size), seed=2).max(axis=1)
    group_s = float(groups.mean()) * w.decode_s_per_step
    batches = draw_lengths(w, (2_000, w.batch_size), seed=3).max(axis=1)
    sync_gen_s = float(batches.mean()) * w.decode_s_per_step
    batch_tokens = mean_tokens * w.batch_size
    sync_train_s = batch_tokens * w.train_s_per_token_gpu / gpus
    sync_rate = w.batch_size / (sync_gen_s + sync_train_s)
    gen, train = split(w, gpus)
    train_s = batch_tokens * w.train_s_per_token_gpu / train
    bounds: dict[int, dict[str, Any]] = {}
    for eta in etas:
        window = fluid_window_bound(w, eta, group_s, train_s)
        slots = gen * w.capacity / group_s
        trainer = w.batch_size / train_s
        ideal = ideal_pool(w, gen, train, eta, warmup_s=warmup_s)
        behind = ideal_pool(w, gen, train, eta, warmup_s=warmup_s, start_behind_at_bump=True)
        bounds[eta] = {"samples_per_s": min(window, slots, trainer), "window": window, "slots": slots, "trainer": trainer,
                       "ideal_pool_samples_per_s": ideal["samples_per_s"], "ideal_pool_dropped_share": ideal["dropped_share"],
                       "ideal_pool_start_behind_samples_per_s": behind["samples_per_s"],
                       "ideal_pool_start_behind_dropped_share": behind["dropped_share"]}
        if not rule_models:
            continue
        cancel = ideal_pool(w, gen, train, eta, warmup_s=warmup_s, cancel_doomed=True)
        new_drop = ideal_pool(w, gen, train, eta, warmup_s=warmup_s, start_behind_at_bump=True, fresh_dispatch_hold_s=HOLD_S,
                              apply_s=APPLY_S, cancel_doomed=True)
        new_keep = ideal_pool(w, gen, train, eta, warmup_s=warmup_s, start_behind_at_bump=True, fresh_dispatch_hold_s=HOLD_S,
                              apply_s=APPLY_S, cancel_doomed=True, stale_policy="keep", max_staleness_keep=2 * eta)
        bounds[eta].update({"ideal_pool_cancel_doomed_samples_per_s": cancel["samples_per_s"],
                            "model_today": behind, "model_new_drop": new_drop, "model_new_keep": new_keep})
    return {
        "mean_tokens_per_sample": mean_tokens,
        "mean_group_s": group_s,
        "sync_mean_generate_s": sync_gen_s,
        "sync_train_s": sync_train_s,
        "sync_samples_per_s": sync_rate,
        "async_gen_gpus": gen,
        "async_train_gpus": train,
        "async_train_s": train_s,
        "async_bound": bounds,
    }


# --------------------------------------------------------------------------- one run through the real pool


@dataclass
class RunResult:
    mode: str
    gpus: int
    eta: int
    gen_gpus: int
    train_gpus: int
    time_scale: float
    steps: int
    samples: int
    sim_seconds: float
    samples_per_s: float
    steady_samples_per_s: float
    steady_from_s: float
    steady_steps: int
    gen_utilisation: float
    staleness_hist: dict[int, int]
    max_staleness_seen: int
    dropped_stale: int
    real_seconds: float
    cpu_seconds_children: float
    cpu_seconds_trainer: float
    step_at_s: list[float]
    stale_policy: str = "drop"
    max_staleness_keep: int | None = None
    tokens_delivered: int = 0
    wasted_tokens_stale: int = 0
    wasted_share: float = 0.0
    """Tokens the trainer client received and did not train on (stale drops, duplicates), over all it received.
    Today's broker cancels nothing in this bench (cancel_stale_inflight off), so nothing else is generated and lost."""
    kept_stale: int = 0
    older_than_eta_share: float = 0.0
    rules: str = "today"
    """The broker's rules: ``today`` (no hold, no cancellation) or ``new`` (``--fresh-dispatch-hold-s``
    and ``--cancel-stale-inflight``, the trainer's bound told with every version)."""
    client_wasted_share: float = 0.0
    """Tokens the trainer client received and did not train on, over all it received."""
    broker_wasted: dict[str, Any] | None = None
    """The broker's counters at the end of the run: generated tokens and wasted tokens by reason (stale_drop,
    cancel, failure, duplicate), their shares, doomed groups cancelled, fresh dispatches and expired holds."""


def steady_rate(step_at_s: list[float], batch_size: int, warmup_s: float) -> tuple[float, float, int]:
    """Trained samples per simulated second over the steps after `warmup_s` (rate, from, steps).

    With fewer than 4 steps after the warm-up it falls back to the second half of the steps.
    """
    t = [0.0, *step_at_s]
    first = next((i for i, x in enumerate(t) if x >= warmup_s), len(t))
    if len(t) - 1 - first < 4:
        first = (len(t) - 1) // 2
    k = len(t) - 1 - first
    return k * batch_size / (t[-1] - t[first]), t[first], k


def _proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)}
    fh = open(log_path, "ab")  # closed when the process is reaped
    return subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=fh, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def run_pool(w: Workload, mode: str, gpus: int, eta: int, steps: int, time_scale: float, log_dir: Path,
                   worker_procs: int = 1, warmup_s: float = 600.0, stale_policy: str = "drop", rules: str = "new",
                   hold_s: float = 3.0) -> RunResult:
    sync = mode == "sync"
    gen, train = (gpus, gpus) if sync else split(w, gpus)
    wep, cep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    groups_per_step = w.batch_size // w.group_size
    decode_s = w.decode_s_per_step / time_scale
    broker = _spawn(
        ["rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--batch-size", str(w.batch_size),
         "--max-staleness", str(0 if sync else eta), "--max-applying", str(gen), "--heartbeat-interval-s", "0.5",
         "--missed-heartbeats", "20", "--task-timeout-s", "3600", "--log-level", "WARNING",
         *(["--cancel-stale-inflight", "--fresh-dispatch-hold-s", str(hold_s)] if rules == "new" and not sync else [])],
        log_dir / f"broker-{mode}-{stale_policy}-{rules}-{gpus}-{eta}.log",
    )
    opts = (f"decode_s_per_token={decode_s!r},length=lognormal,length_median={w.length_median},"
            f"length_sigma={w.length_sigma},capacity={w.capacity},seed={gpus * 100 + eta}")
    shares = [gen // worker_procs + (1 if i < gen % worker_procs else 0) for i in range(worker_procs)]
    workers = [
        _spawn(
            ["rollpool.workers", "--broker", wep, "--engine", "sim", "--count", str(n), "--worker-id", f"sim{gpus}p{i}",
             "--engine-options", f"{opts}{i}", "--heartbeat-interval-s", "0.5", "--missed-heartbeats", "20", "--log-level", "WARNING"],
            log_dir / f"workers-{mode}-{stale_policy}-{gpus}-{eta}-{i}.log",
        )
        for i, n in enumerate(shares) if n > 0
    ]
    cfg = TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=30.0, keep_versions=2)
    client = TrainerClient(config=cfg)
    try:
        await client.connect()
        await client.publish_weights({}, 0)  # starts the publisher; workers subscribe via the heartbeat
        for _ in range(600):
            st = await client.status()
            if st["counters"].get("workers_alive", 0) >= gen:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"only {st['counters'].get('workers_alive')} of {gen} workers joined")
        await asyncio.sleep(1.5)  # three heartbeats: every worker has the publisher's endpoints
        sampling = {"max_new_tokens": w.length_cap, "temperature": 1.0}
        prompt_no = 0

        async def submit(n_groups: int) -> None:
            nonlocal prompt_no
            prompts = [{"input_ids": [1 + (prompt_no + i) % 1000, 7, 9], "metadata": {"i": prompt_no + i}} for i in range(n_groups)]
            prompt_no += n_groups
            res = await client.submit(prompts, group_size=w.group_size, sampling=sampling)
            if res.rejected:
                raise RuntimeError(f"submit rejected: {list(res.rejected.values())[:3]}")

        keep_limit = 2 * eta if stale_policy == "keep" else None
        hist: dict[int, int] = {}
        slot_s = 0.0
        step_done_at: list[float] = []
        cpu0 = sum(_proc_cpu_s(x.pid) for x in [broker, *workers])
        own0 = time.process_time()
        t0 = time.monotonic()
        wall0 = time.time()
        ahead = (eta + 2) * groups_per_step  # keep the queue ahead of the admission window
        version = 0
        for _ in range(steps):
            if sync:
                await submit(groups_per_step)
            elif client.pending() < ahead:  # tops up what was trained and what the hard bound dropped
                await submit(ahead - client.pending())
            batch = await client.get_batch(groups_per_step, max_staleness=0 if sync else eta, timeout=3600,
                                           stale_policy=stale_policy, max_staleness_keep=keep_limit)
            tokens = 0
            for g in batch.groups:
                starts = [t.started_at for t in g.trajectories if t.started_at > 0]
                ends = [t.finished_at for t in g.trajectories if t.finished_at > 0]
                if starts and ends:
                    slot_s += len(g.trajectories) * (max(ends) - max(min(starts), wall0))
                for t in g.trajectories:
                    tokens += len(t.output_ids)
                    s = int(version - int(np.min(t.token_versions))) if len(t.token_versions) else 0
                    hist[s] = hist.get(s, 0) + 1
            await asyncio.sleep(tokens * w.train_s_per_token_gpu / train / time_scale)
            version += 1
            await client.publish_weights({}, version)
            step_done_at.append(time.monotonic())
            print(f"     [{mode} {gpus} GPUs eta {eta}] step {version}/{steps} at {(step_done_at[-1] - t0) * time_scale:.0f} simulated s",
                  file=sys.stderr, flush=True)
        real = step_done_at[-1] - t0
        cpu = sum(_proc_cpu_s(x.pid) for x in [broker, *workers]) - cpu0
        own = time.process_time() - own0
        step_at_s = [(x - t0) * time_scale for x in step_done_at]
        steady, steady_from, steady_steps = steady_rate(step_at_s, w.batch_size, warmup_s)
        samples = steps * w.batch_size
        c = client.counters
        seen_tokens = c["tokens_delivered"] + c["wasted_tokens_stale"] + c["wasted_tokens_duplicate"]
        bc = (await client.status())["counters"]
        broker_wasted = {k: bc.get(k, 0) for k in ("generated_tokens", "wasted_tokens_stale_drop", "wasted_tokens_cancel",
                                                   "wasted_tokens_failure", "wasted_tokens_duplicate", "wasted_share",
                                                   "wasted_share_stale_drop", "wasted_share_cancel", "wasted_share_failure",
                                                   "wasted_share_duplicate", "doomed_cancelled", "fresh_dispatched", "fresh_holds",
                                                   "fresh_holds_expired", "dropped_stale")}
        older = sum(k for s_, k in hist.items() if s_ > eta)
        return RunResult(
            mode=mode, gpus=gpus, eta=0 if sync else eta, gen_gpus=gen, train_gpus=train, time_scale=time_scale,
            steps=steps, samples=samples, sim_seconds=real * time_scale,
            samples_per_s=samples / (real * time_scale),
            steady_samples_per_s=steady, steady_from_s=steady_from, steady_steps=steady_steps,
            gen_utilisation=slot_s / (gen * w.capacity * real),
            staleness_hist=dict(sorted(hist.items())), max_staleness_seen=max(hist) if hist else 0,
            dropped_stale=int(client.counters.get("dropped_stale", 0)), real_seconds=real, cpu_seconds_children=cpu,
            cpu_seconds_trainer=own, step_at_s=step_at_s, stale_policy=stale_policy, max_staleness_keep=keep_limit,
            tokens_delivered=int(c["tokens_delivered"]), wasted_tokens_stale=int(c["wasted_tokens_stale"]),
            wasted_share=float(broker_wasted["wasted_share"]),
            kept_stale=int(c["kept_stale"]), older_than_eta_share=older / max(1, sum(hist.values())),
            rules="today" if sync else rules, client_wasted_share=(c["wasted_tokens_stale"] + c["wasted_tokens_duplicate"]) / max(1, seen_tokens),
            broker_wasted=broker_wasted,
        )
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10)
        for x in workers:
            _stop(x)
        _stop(broker)


def pick_scale(rate_samples_per_s: float, mean_tokens: float, token_budget: float, max_scale: float) -> float:
    return float(max(1.0, min(max_scale, token_budget / (rate_samples_per_s * mean_tokens))))


# --------------------------------------------------------------------------- main


def summarise(out: dict[str, Any]) -> None:
    """Recompute the per-eta tables (`speedup`, `fraction_of_bound`, ...) from every stored run."""
    for key in ("speedup", "speedup_end_to_end", "speedup_vs_sync_bound", "fraction_of_bound", "fraction_of_ideal_pool", "max_staleness_seen",
                *ISSUE24_KEYS, *MODEL_KEYS, *TODAY_KEYS):
        out[key] = {}
    for gpus, runs in out["runs"].items():
        sync = runs.get("sync")
        model = runs["analytic"]
        if sync is not None:
            runs["sync_fraction_of_bound"] = sync["steady_samples_per_s"] / model["sync_samples_per_s"]
        for name, r in runs.items():
            if not name.startswith("async_eta"):
                continue
            eta = str(r["eta"])
            b = model["async_bound"][eta]
            if sync is not None:
                out["speedup"].setdefault(gpus, {})[eta] = r["steady_samples_per_s"] / sync["steady_samples_per_s"]
                out["speedup_end_to_end"].setdefault(gpus, {})[eta] = r["samples_per_s"] / sync["samples_per_s"]
            out["speedup_vs_sync_bound"].setdefault(gpus, {})[eta] = r["steady_samples_per_s"] / model["sync_samples_per_s"]
            out["fraction_of_bound"].setdefault(gpus, {})[eta] = r["steady_samples_per_s"] / b["samples_per_s"]
            out["fraction_of_ideal_pool"].setdefault(gpus, {})[eta] = r["steady_samples_per_s"] / b["ideal_pool_samples_per_s"]
            out["max_staleness_seen"].setdefault(gpus, {})[eta] = r["max_staleness_seen"]
            if r.get("rules") != "new":
                continue  # today's broker: the drop_* maps are the new rules'
            out["drop_wasted_share"].setdefault(gpus, {})[eta] = r["wasted_share"]
            if "model_new_drop" in b:
                out["drop_fraction_of_model"].setdefault(gpus, {})[eta] = r["steady_samples_per_s"] / b["model_new_drop"]["samples_per_s"]
        for eta, b in model["async_bound"].items():
            if "model_new_drop" not in b:
                continue
            nd, nk, today = b["model_new_drop"], b["model_new_keep"], b["model_today"]
            out["drop_model_wasted_share"].setdefault(gpus, {})[eta] = nd["wasted_share"]
            for key, value in (("model_today_wasted_share", today["wasted_share"]),
                               ("model_today_fraction_of_bound", today["samples_per_s"] / b["samples_per_s"]),
                               ("model_drop_fraction_of_bound", nd["samples_per_s"] / b["samples_per_s"]),
                               ("model_drop_wasted_share_of_today", nd["wasted_share"] / max(1e-9, today["wasted_share"])),
                               ("model_drop_max_staleness_seen", nd["max_staleness_seen"]),
                               ("model_keep_fraction_of_bound", nk["samples_per_s"] / b["samples_per_s"]),
                               ("model_keep_wasted_share", nk["wasted_share"]),
                               ("model_keep_older_than_eta_share", nk["older_than_eta_share"]),
                               ("model_keep_max_staleness_seen", nk["max_staleness_seen"])):
                out[key].setdefault(gpus, {})[eta] = value
        for name, r in runs.items():
            if not name.startswith(("today_eta", "todaykeep_eta")):
                continue
            eta = str(r["eta"])
            b = model["async_bound"][eta]
            prefix = "today" if name.startswith("today_") else "today_keep"
            out[f"{prefix}_fraction_of_bound"].setdefault(gpus, {})[eta] = r["steady_samples_per_s"] / b["samples_per_s"]
            if "wasted_share" in r:  # runs stored before the wasted shares were measured have none
                out[f"{prefix}_wasted_share"].setdefault(gpus, {})[eta] = r["wasted_share"]
            out[f"{prefix}_max_staleness_seen"].setdefault(gpus, {})[eta] = r["max_staleness_seen"]
        for name, r in runs.items():
            if not name.startswith("keep_eta"):
                continue
            eta = str(r["eta"])
            b = model["async_bound"][eta]
            out["keep_fraction_of_bound"].setdefault(gpus, {})[eta] = r["steady_samples_per_s"] / b["samples_per_s"]
            out["keep_wasted_share"].setdefault(gpus, {})[eta] = r["wasted_share"]
            out["keep_older_than_eta_share"].setdefault(gpus, {})[eta] = r["older_than_eta_share"]
            out["keep_max_staleness_seen"].setdefault(gpus, {})[eta] = r["max_staleness_seen"]


ISSUE24_KEYS = ("keep_fraction_of_bound", "keep_wasted_share", "keep_older_than_eta_share", "drop_wasted_share",
                "drop_model_wasted_share", "drop_fraction_of_model", "keep_max_staleness_seen")
"""The staleness-rule figures (with ``max_staleness_seen``): keep_* and drop_wasted_share, drop_fraction_of_model and the
staleness maxima are MEASURED through the real pool with today's broker (the client's stale_policy; the new broker
rules (``rules`` on each run: ``new``, the broker's fresh_dispatch_hold_s and early cancellation); the wasted
shares are the broker's counters (generated tokens never delivered to training, by reason, whole run);
drop_model_wasted_share is the MODEL (ideal_pool) of the new drop rules."""
TODAY_KEYS = ("today_fraction_of_bound", "today_wasted_share", "today_max_staleness_seen", "today_keep_fraction_of_bound",
              "today_keep_wasted_share", "today_keep_max_staleness_seen")
"""MEASURED with today's broker rules (``--rules today``, or runs stored before the broker had those rules)."""
MODEL_KEYS = ("model_today_wasted_share", "model_today_fraction_of_bound", "model_drop_fraction_of_bound",
              "model_drop_wasted_share_of_today", "model_drop_max_staleness_seen", "model_keep_fraction_of_bound",
              "model_keep_wasted_share", "model_keep_older_than_eta_share", "model_keep_max_staleness_seen")
"""The zero-latency model (ideal_pool) of each rule set: today's broker, new drop rules, new rules with keep (2 x eta)."""


def print_model_table(gpus: str, model: dict[str, Any]) -> None:
    """The rule sets side by side in the zero-latency model (MODEL, not measured)."""
    print(f"   MODEL (ideal_pool, apply {APPLY_S:g} s, hold {HOLD_S:g} s): {'eta':>4}{'bound':>7}"
          f"{'today':>7}{'waste':>7}{'new drop':>9}{'waste':>7}{'/today':>7}{'keep 2eta':>10}{'waste':>7}{'>eta':>6}{'max':>5}")
    for eta, b in sorted(model["async_bound"].items(), key=lambda kv: int(kv[0])):
        if "model_new_drop" not in b:
            continue
        t, d, k = b["model_today"], b["model_new_drop"], b["model_new_keep"]
        bound = b["samples_per_s"]
        print(f"   {'':<44}{eta:>4}{bound:>7.2f}{t['samples_per_s'] / bound:>7.2f}{t['wasted_share']:>7.3f}"
              f"{d['samples_per_s'] / bound:>9.2f}{d['wasted_share']:>7.3f}{d['wasted_share'] / max(1e-9, t['wasted_share']):>7.2f}"
              f"{k['samples_per_s'] / bound:>10.2f}{k['wasted_share']:>7.3f}{k['older_than_eta_share']:>6.2f}{k['max_staleness_seen']:>5}")


def print_table(gpus: str, runs: dict[str, Any]) -> None:
    model = runs["analytic"]
    sync = runs.get("sync")
    print(f"   {'run':<13}{'scale':>6}{'steps':>6}{'samples/s':>10}{'steady':>8}{'bound':>7}{'of bound':>9}{'ideal':>7}{'of ideal':>9}"
          f"{'speedup':>8}{'util':>6}{'max st':>7}{'dropped':>8}{'cpu/real':>9}  staleness histogram")
    names = (["sync"] if sync else []) + sorted((k for k in runs if k.startswith(("async_eta", "keep_eta", "today_eta", "todaykeep_eta"))),
                                                key=lambda k: (int(k.split("eta")[1]), k))
    for name in names:
        r = runs[name]
        if name == "sync":
            bound, ideal = model["sync_samples_per_s"], model["sync_samples_per_s"]
        else:
            b = model["async_bound"][str(r["eta"])]
            bound, ideal = b["samples_per_s"], b["ideal_pool_samples_per_s"]
        speed = f"{r['steady_samples_per_s'] / sync['steady_samples_per_s']:>7.2f}x" if sync else f"{'-':>8}"
        cpu = (r["cpu_seconds_children"] + r["cpu_seconds_trainer"]) / r["real_seconds"]
        label = "sync" if name == "sync" else f"{name.split('_eta')[0].replace('async', 'drop')} eta={r['eta']}"
        print(f"   {label:<13}{r['time_scale']:>6.1f}{r['steps']:>6}{r['samples_per_s']:>10.2f}{r['steady_samples_per_s']:>8.2f}{bound:>7.2f}"
              f"{r['steady_samples_per_s'] / bound:>9.2f}{ideal:>7.2f}{r['steady_samples_per_s'] / ideal:>9.2f}{speed}"
              f"{r['gen_utilisation']:>6.2f}{r['max_staleness_seen']:>7}{r['dropped_stale']:>8}{cpu:>9.2f}  {r['staleness_hist']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 GPUs, sync and eta 4 (drop and keep), 16 steps (under nine minutes)")
    ap.add_argument("--policies", default="drop,keep", help="trainer stale policies run through the pool at each eta")
    ap.add_argument("--rules", default="new", choices=("new", "today"),
                    help="broker rules: new (fresh dispatch hold and early cancellation) or today's")
    ap.add_argument("--hold-s", type=float, default=3.0,
                    help="the broker's fresh_dispatch_hold_s under --rules new, REAL seconds (it must cover a real apply)")
    ap.add_argument("--smoke", action="store_true", help="a tiny non-standard workload for the test suite")
    ap.add_argument("--gpus", default="64,256")
    ap.add_argument("--etas", default="1,2,4,8")
    ap.add_argument("--no-sync", action="store_true", help="skip the sync baseline (with --merge: keep the stored one)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup-s", type=float, default=WARMUP_S, help="simulated seconds left out of the steady-state rate")
    ap.add_argument("--token-budget", type=float, default=400_000.0, help="simulated tokens per real second a run may produce")
    ap.add_argument("--max-scale", type=float, default=100.0)
    ap.add_argument("--worker-procs", type=int, default=1, help="processes the sim workers are spread over")
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge", action="store_true", help="add these runs to the ones already in --json (same workload and steps)")
    ap.add_argument("--reanalyse", action="store_true", help="recompute the analytic side and tables of --json; run nothing")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    if args.reanalyse:
        stored = json.loads(Path(args.json).read_text())
        for gpus, runs in stored["runs"].items():
            ran = sorted({int(k.split("_eta")[1]) for k in runs if "_eta" in k and k.split("_eta")[1].isdigit()})
            model = analytic(Workload(), int(gpus), ran, stored["warmup_s"])
            runs["analytic"] = {**model, "async_bound": {str(k): v for k, v in model["async_bound"].items()}}
            print_table(gpus, runs)
            print_model_table(gpus, runs["analytic"])
        summarise(stored)
        stored["commands"] = [*stored.get("commands", []), " ".join(["python", "bench/async_speedup.py", *sys.argv[1:]])]
        Path(args.json).write_text(json.dumps(stored, indent=1) + "\n")
        return 0
    w = Workload()
    gpu_list = [int(x) for x in args.gpus.split(",")]
    etas = [int(x) for x in args.etas.split(",")]
    steps, warmup_s = args.steps, args.warmup_s
    policies = [x for x in args.policies.split(",") if x]
    if not set(policies) <= {"drop", "keep"}:
        raise SystemExit(f"--policies: drop and/or keep, got {args.policies}")
    if args.quick:
        gpu_list, etas, steps, policies = [64], [4], 16, ["drop", "keep"]
    if args.smoke:
        w, gpu_list, etas, steps, warmup_s = SMOKE, [8], [2], 3, 0.0
    log_dir = Path(args.log_dir or f"/tmp/rollpool-async-speedup-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)

    print("SIMULATED: sim engines stand in for GPUs, a sleep for the optimizer; broker, workers and trainer client are real.")
    print(f"workload: {w.describe()}{' (SMOKE: not the issue workload)' if args.smoke else ''}")
    print(f"GPUs {gpu_list}, eta {etas}, {steps} steps x {w.batch_size} samples per run, steady state after {warmup_s:g} simulated s; "
          f"host {platform.node()} ({os.cpu_count()} cores); sim workers in {args.worker_procs} process(es); "
          f"token budget {args.token_budget:g}/s, max scale {args.max_scale:g}")
    command = " ".join(["python", "bench/async_speedup.py", *sys.argv[1:]])
    out: dict[str, Any] = {
        "simulated": True,
        "workload": {**asdict(w), "description": w.describe(), "smoke": args.smoke},
        "steps": steps,
        "warmup_s": warmup_s,
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "worker_procs": args.worker_procs, "token_budget": args.token_budget},
        "areal_speedup": AREAL_SPEEDUP,
        "commands": [command],
        "runs": {},
    }
    if args.merge and args.json and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        if old.get("workload", {}).get("description") != out["workload"]["description"] or old.get("steps") != steps:
            raise SystemExit(f"--merge: {args.json} holds another workload or step count")
        out["runs"] = old.get("runs", {})
        for runs_ in out["runs"].values():  # runs stored before the new broker rules: today's
            for k in [k for k, r in runs_.items() if k.startswith(("async_eta", "keep_eta")) and "rules" not in r]:
                runs_[("today_eta" if k.startswith("async") else "todaykeep_eta") + k.split("_eta")[1]] = {**runs_.pop(k), "rules": "today"}
        out["commands"] = [*old.get("commands", []), command]
    for gpus in gpu_list:
        model = analytic(w, gpus, etas, warmup_s)
        runs = out["runs"].setdefault(str(gpus), {})
        old_bounds = runs.get("analytic", {}).get("async_bound", {})
        runs["analytic"] = {**model, "async_bound": {**old_bounds, **{str(k): v for k, v in model["async_bound"].items()}}}
        print(f"\n== {gpus} GPUs: sync = {gpus} GPUs alternating; async = {model['async_gen_gpus']} generate + {model['async_train_gpus']} train")
        print(f"   analytic: E[tokens/sample] {model['mean_tokens_per_sample']:.0f}, E[group time] {model['mean_group_s']:.1f} s, "
              f"sync step {model['sync_mean_generate_s']:.1f} s generate + {model['sync_train_s']:.2f} s train, "
              f"async train step {model['async_train_s']:.2f} s")
        if not args.no_sync:
            scale = pick_scale(model["sync_samples_per_s"], model["mean_tokens_per_sample"], args.token_budget, args.max_scale)
            runs["sync"] = asdict(asyncio.run(run_pool(w, "sync", gpus, 0, steps, scale, log_dir, args.worker_procs, warmup_s)))
        for eta in etas:
            bound = model["async_bound"][eta]["samples_per_s"]
            scale = pick_scale(bound, model["mean_tokens_per_sample"], args.token_budget, args.max_scale)
            for policy in policies:
                r = asyncio.run(run_pool(w, "async", gpus, eta, steps, scale, log_dir, args.worker_procs, warmup_s, policy,
                                         rules=args.rules, hold_s=args.hold_s))
                kind = ("async" if policy == "drop" else "keep") if args.rules == "new" else ("today" if policy == "drop" else "todaykeep")
                runs[f"{kind}_eta{eta}"] = asdict(r)
        summarise(out)
        print_table(str(gpus), runs)
        print_model_table(str(gpus), runs["analytic"])
        print(f"   (AReaL reports {AREAL_SPEEDUP}x at equal GPUs; all figures above are simulated seconds; speedup = steady async / steady sync)")
    summarise(out)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    bad = [(g, e) for key in ("max_staleness_seen", "today_max_staleness_seen") for g, m in out[key].items() for e, s in m.items() if s > int(e)]
    bad += [(g, f"keep {e}") for g, m in out["keep_max_staleness_seen"].items() for e, s in m.items() if s > 2 * int(e)]
    if bad:
        print(f"STALENESS ABOVE ETA in {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
