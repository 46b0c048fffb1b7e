"""Multi-turn episodes on SGLang: how much of each turn's prompt the prefix cache serves.

One device call (H200, kit installed as for bench/gpu_sglang.py):

    PYTHONPATH=/tmp/site:. python3 bench/gpu_episodes.py --out $OUT        -> h200-episodes.json

On CPU, the same run against the sglang engine's child serving the sim engine, whose prefix cache is
simulated (a list of recent sequences; labelled ``simulated``)::

    python bench/gpu_episodes.py --backend sim --out /tmp/ep

Broker, one worker (``--engine sglang``, SGLang as the engine's child) and this process as the trainer,
separate processes. The worker runs `agent` below for every sample: an unmodified agent on the `openai`
SDK through the episode endpoint, ``--turns`` chat turns of ``--tokens-per-turn`` sampled tokens, each
followed by a user message of about ``--tool-tokens`` tokens (an environment's observation), the history
sent back unchanged. Per turn after the first, the agent reads SGLang's ``cached_tokens`` (the endpoint's
``usage.prompt_tokens_details.cached_tokens``) and counts the cacheable tokens: the previous turn's
prompt and output, less the one last sampled token (it has no KV yet). Phase ``no_update``: no weight
update in the window. Phase ``one_update``: the same workload with one version published while it runs
(SGLang flushes its cache on an update, so the turns right after it are recomputed).

The peer, in the same run once the pool is stopped (``--peer``, on by default with ``--backend sglang``): the
same agent loop on an in-process ``sglang.Engine`` in a child process of this bench (same model, capacity
``--concurrency`` as ``max_running_requests``, ``--mem-fraction``, context, the engine kwargs the worker's
child uses): ``--groups`` x ``--n`` episodes at once, each ``--turns`` turns where the chat template is
re-rendered over the whole history and tokenized (the model directory's tokenizer), ``async_generate`` on the
ids with the end-of-turn token as a stop token (as the endpoint sends), the reply decoded and appended with an
observation of ``--tool-words`` words. Phases ``no_update`` and ``one_update`` (one
``update_weights_from_tensor`` of every tensor +-0.01 from CUDA tensors at half the peer's no-update wall time,
the API notes' in-process recipe: the update waits for running requests, then flushes the cache). The JSON's
``pool_vs_inprocess_episodes`` is the pool's output tokens/s over the peer's, per phase.

``--hop off`` sends the worker's per-sample calls to its SGLang child over HTTP instead of the ZeroMQ hop (the
sglang engine's ``hop`` option; the JSON's ``hop``), for the two side by side in two calls on one machine.

``--agent-processes N`` is the worker's own option: the agents run in N child processes of the worker,
each with its own event loop (``rollpool worker --agent-processes``), so the worker's event loop holds only
the pool's own work; 0 (the default) runs them in the worker.

``--agent-client shared``: the agent takes one ``openai.AsyncOpenAI`` per process and copies it per episode
(``with_options(base_url=..., api_key=...)``: one TLS context and one connection pool) instead of a new client per
episode (the default, as most agents are written: each builds a TLS context, tens of ms of CPU); the JSON's
``agent_client``, the file name's ``-shared-client``. It tells the SDK's per-episode cost from the pool's.

``--profile-s S``: after the measured phases, phase ``profiled`` runs the no_update workload round after round
while py-spy (bench/profiling.py; the ``py-spy`` on PATH or the wheel in ``.gpuextra/``, which must travel with
the checkout: the device call's ``carry: [".gpuextra"]``) samples for S seconds the worker, one agent process (with
``--agent-processes``), the worker's SGLang child and its scheduler, and likewise the peer's process and its
scheduler once the peer's phases are done. Per process ``profile-<role>.txt`` (top 25 functions by own and by
cumulative samples, shares by category, CPU seconds over the window), ``.raw`` (py-spy's collapsed stacks) and
``-dump.txt`` (one ``py-spy dump``); in the JSON, ``profile`` (all of it per role) and ``profile_top_self`` (the
top 10 [function, share] per role). Sampling that fails (no py-spy, no ptrace rights) is recorded in the role's
``error`` with the ptrace facts (``ptrace``), never failing the run.

    PYTHONPATH=/tmp/site:. python3 bench/gpu_episodes.py --out $OUT                        -> <card>-episodes.json (h100, h200)
    PYTHONPATH=/tmp/site:. python3 bench/gpu_episodes.py --out $OUT --agent-processes 8    -> <card>-episodes-ap8.json
                                                                             (agents in 8 child processes of the worker)
    PYTHONPATH=/tmp/site:. python3 bench/gpu_episodes.py --out $OUT --agent-processes 8 --profile-s 20 --deadline-s 420
                                                                          -> the same + profile-<role>.txt, profile_top_self
    PYTHONPATH=/tmp/site:. python3 bench/gpu_episodes.py --out $OUT --agent-processes 8 --apply-mode drain
                                                                 -> <card>-episodes-ap8-drain.json (the worker drains for the
                                                                    update, as the peer's update does, instead of interrupting)

``one_update`` also reports what the update cost the pool: ``apply`` (the worker's sglang engine's own timings of it:
``stopped_s``, how long it sent nothing; ``pause_s``, ``sglang_update_s``, ``verify_s``; ``*_at`` in seconds after the
phase's start), ``publish_called_at_s`` .. ``published_at_s`` (the trainer's publish call), and in every phase
``longest_gap_s`` (the longest stretch with no turn ending) and ``turns_ended_per_s``.

Every phase, the pool's and the peer's, also reports its ramp and tail (`bench.episodes.turn_timing`, from each turn's
``start`` and ``end`` as its agent saw them, in seconds after the submit): ``first_turn_start_s`` (min, median, max over
the episodes: the submit to each episode's first request), ``delivery_after_last_turn_s`` (median, max over the groups:
a group's last turn to ``get_batch`` returning it; the pool only), ``tail_s`` (the phase's wall less its last turn's
end), ``turn_s`` (one turn, request to answer, median and max), ``running_per_100ms`` (episodes running at 0.1 .. 1.0 s)
and ``waves`` (per turn index: first start, last start, first end, last end). The random model samples all 128 tokens
of nearly every turn, so every episode is on the same turn at once: a phase is 6 waves of 128 requests, and
``turns_ended_per_s`` counts waves cut by whole seconds.

``--sglang-log-level info`` runs SGLang at INFO in the worker's child and in the peer, and every phase of both gets
``scheduler`` (`SchedulerLog`: from their logs, what SGLang's scheduler did in the phase): ``prefill_batches`` (forward
passes that admitted new requests: each holds back the running requests' next token by one pass),
``prefill_seqs``, ``seqs_per_prefill`` and ``decode_log_lines`` (one per 40 decode passes). Requests that reach the
scheduler spread out are admitted in more, smaller prefill passes than requests that arrive together.
``--sglang-args JSON`` gives both SGLangs the same extra ``sglang.Engine`` keywords (the JSON's ``sglang_args``), e.g.
``'{"enable_mixed_chunk": true}'`` (new requests' prefill in the same pass as the running requests' decode), to run
a setting on both sides in one call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_weights as gw  # noqa: E402 - the model builder, process helpers and kit setup
from bench import profiling  # noqa: E402 - py-spy on the pool's and the peer's processes (--profile-s)
from bench.episodes import _apply_lines, _shared_client, add_workload_args, phase_timing, turn_timing  # noqa: E402 - the workload both episode benches run

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta")


# --------------------------------------------------------------------------- the agent (runs in the worker)


async def agent(ctx: Any, prompt: Any) -> float:
    """An unmodified `openai` SDK agent: fixed turns, observations between them, history sent back unchanged."""
    import openai

    md = prompt.metadata
    turns, tokens, tool_words = int(md["turns"]), int(md["tokens_per_turn"]), int(md["tool_words"])
    rng = random.Random(f"{prompt.prompt_id}:{ctx.sample_index}")
    if md.get("agent_client") == "shared":  # one SDK client per process, copied per episode: one TLS context, one pool
        client = _shared_client().with_options(base_url=ctx.openai_base_url, api_key=ctx.api_key)
    else:  # a client per episode, as most agents are written: each builds its own TLS context (certifi's bundle)
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0, timeout=600)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."},
                                      {"role": "user", "content": str(md["task"])}]
    per_turn: list[dict[str, Any]] = []
    prev: tuple[int, int] | None = None
    try:
        for t in range(turns):
            t0 = time.time()
            r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=tokens, temperature=1.0)
            msg = r.choices[0].message
            usage = r.usage
            cached = int(usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0
            rec = {"turn": t, "prompt_tokens": usage.prompt_tokens if usage else 0,
                   "completion_tokens": usage.completion_tokens if usage else 0, "cached": cached,
                   "cacheable": (prev[0] + prev[1] - 1) if prev else 0, "s": round(time.time() - t0, 4), "start": round(t0, 4),
                   "end": round(time.time(), 4)}
            per_turn.append(rec)
            prev = (rec["prompt_tokens"], rec["completion_tokens"])
            messages.append(msg.model_dump(exclude_none=True))  # sent back unchanged
            obs = " ".join(rng.choice(WORDS) for _ in range(tool_words))
            messages.append({"role": "user", "content": f"observation {t}: {obs}"})
    finally:
        if md.get("agent_client") != "shared":
            await client.close()
    ctx.metadata["cache_turns"] = per_turn
    return 0.0


# --------------------------------------------------------------------------- SGLang's own batches (--sglang-log-level info)


def sglang_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--sglang-args``: extra ``sglang.Engine`` keywords, the same for the worker's child and the peer."""
    if not args.sglang_args:
        return {}
    try:
        value = json.loads(args.sglang_args)
    except ValueError as exc:
        raise SystemExit(f"--sglang-args must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"--sglang-args must be a JSON object, got {args.sglang_args!r}")
    return value


_PREFILL = re.compile(r"Prefill batch[^,]*, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")


class SchedulerLog:
    """What SGLang's scheduler logged at INFO during a phase, read from its log files between the phase's start and end
    (their sizes at `start`): ``prefill_batches`` (its ``Prefill batch`` lines: forward passes that admitted new
    requests, each holding back every running request's next token by one pass), ``prefill_seqs`` (the requests they
    admitted), ``seqs_per_prefill``, ``prefill_new_tokens`` and ``decode_log_lines`` (one per ``decode_log_interval``
    decode passes, 40 by default). Empty at SGLang's default level (warning)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.offsets = {p: p.stat().st_size if p.exists() else 0 for p in paths}

    def read(self) -> dict[str, Any]:
        text = ""
        for p in self.paths:
            if p.exists():
                with p.open("rb") as fh:
                    fh.seek(self.offsets.get(p, 0))
                    text += fh.read().decode(errors="replace")
        batches = [tuple(int(x) for x in m) for m in _PREFILL.findall(text)]
        seqs = sum(b[0] for b in batches)
        return {"prefill_batches": len(batches), "prefill_seqs": seqs,
                "seqs_per_prefill": round(seqs / len(batches), 2) if batches else None,
                "prefill_new_tokens": sum(b[1] for b in batches), "decode_log_lines": text.count("Decode batch")}


# --------------------------------------------------------------------------- the trainer side


def cache_share(groups: list[Any]) -> dict[str, Any]:
    cached = cacheable = turns = 0
    full = 0
    for g in groups:
        for tr in g.trajectories:
            for rec in tr.metadata.get("cache_turns", []):
                if rec["turn"] == 0:
                    continue
                turns += 1
                cached += min(rec["cached"], rec["cacheable"])
                cacheable += rec["cacheable"]
                full += rec["cached"] >= rec["cacheable"]
    return {"cached_tokens": cached, "cacheable_tokens": cacheable, "share": round(cached / cacheable, 4) if cacheable else None,
            "turns_counted": turns, "turns_fully_cached": full}


def turn_gaps(groups: list[Any], t0: float) -> dict[str, Any]:
    """When the phase's turns ended (the agents' clocks, this host's): the longest stretch with no turn ending (after the
    first and before the last), where it began (s after the phase's start), and turns ended per second of the phase. A weight
    update that stops generation shows as a gap."""
    ends = sorted(float(rec["end"]) - t0 for g in groups for tr in g.trajectories for rec in tr.metadata.get("cache_turns", [])
                  if "end" in rec)
    if len(ends) < 2:
        return {}
    gap, at = max((b - a, a) for a, b in zip(ends, ends[1:], strict=False))
    per_s = [0] * (int(ends[-1]) + 1)
    for e in ends:
        per_s[max(0, int(e))] += 1
    return {"longest_gap_s": round(gap, 3), "longest_gap_at_s": round(at, 3), "turns_ended_per_s": per_s}


async def run_phase(client: Any, name: str, args: argparse.Namespace, publish_at: float | None, sd: dict[str, Any] | None,
                    version: int) -> dict[str, Any]:
    from rollpool.protocol import Prompt, SamplingParams

    def task(i: int) -> str:
        rng = random.Random(i)
        return f"Task {i}: " + " ".join(rng.choice(WORDS) for _ in range(40))

    prompts = [Prompt(prompt_id=f"{name}-{i}", text=task(i), group_size=args.n,
                      sampling=SamplingParams(max_new_tokens=args.tokens_per_turn, temperature=1.0),
                      metadata={"turns": args.turns, "tokens_per_turn": args.tokens_per_turn, "tool_words": args.tool_words,
                                "task": task(i), "agent_client": args.agent_client})
               for i in range(args.groups)]
    logs = sorted(Path(args.out).glob("sglang-*.log"))  # noqa: ASYNC240 - a directory listing, before the phase's clock starts
    sched = SchedulerLog(logs) if args.sglang_log_level == "info" else None
    t0 = time.time()
    res = await client.submit(prompts)
    if res.rejected:
        raise RuntimeError(f"rejected: {res.rejected}")
    groups: list[Any] = []
    delivered: dict[str, float] = {}  # prompt id -> when get_batch returned it
    published_at = None
    publish_call: list[float] = []

    async def publish() -> None:
        # at publish_at exactly, as the peer's update (a check between get_batch calls came up to a second late)
        nonlocal published_at
        assert publish_at is not None
        await asyncio.sleep(max(0.0, publish_at - (time.time() - t0)))
        if sd is not None:
            gw.optimizer_step(sd, version)
        publish_call.append(round(time.time() - t0, 3))
        await client.publish_weights(sd if sd is not None else {}, version)
        published_at = round(time.time() - t0, 3)
        gw.note(f"{name}: published version {version} at {published_at} s")

    publisher = asyncio.ensure_future(publish()) if publish_at is not None else None
    while len(groups) < args.groups:
        if publisher is not None and publisher.done():
            publisher.result()  # a failed publish fails the phase
        try:
            batch = await client.get_batch(1, timeout=1.0)
        except TimeoutError:
            if time.time() - t0 > args.phase_timeout_s:
                raise RuntimeError(f"{name}: {len(groups)} of {args.groups} groups after {args.phase_timeout_s} s") from None
            continue
        groups += batch.groups
        now = time.time()
        delivered.update((g.prompt_id, now) for g in batch.groups)
        for other in batch.other:
            raise RuntimeError(f"{name}: group {other.prompt_id} ended {other.state}: {other.reason}")
    wall = time.time() - t0
    if publisher is not None:
        await publisher
    out = {"wall_s": round(wall, 2), "episodes": sum(len(g.trajectories) for g in groups), "published_at_s": published_at,
           **cache_share(groups), **turn_gaps(groups, t0), **phase_timing(groups, t0, delivered, wall)}
    if publish_call:  # the publish call's start (its end is published_at_s), and the worker's apply as its engine logged it
        out["publish_called_at_s"] = publish_call[0]
        applies = _apply_lines(Path(args.out) / "worker.log")
        if applies:
            a = applies[-1]
            out["apply"] = {k: (round(float(v) - t0, 3) if k.endswith("_at") else round(float(v), 4)) for k, v in a.items()
                            if isinstance(v, int | float)}
    versions = sorted({int(v) for g in groups for tr in g.trajectories for v in tr.token_versions})
    out["token_versions_seen"] = versions
    if sched is not None:
        out["scheduler"] = sched.read()
    out["sampled_tokens"] = sum(int((tr.loss_mask == 1).sum()) for g in groups for tr in g.trajectories)
    out["output_tokens_per_s"] = round(out["sampled_tokens"] / wall, 1)
    return out


async def profile_pool(client: Any, args: argparse.Namespace, worker_pid: int, result: dict[str, Any]) -> None:
    """Phase ``profiled``: the no_update workload again, round after round, while py-spy samples the pool's processes."""
    roles: dict[str, int | None] = {"worker": worker_pid}
    if args.agent_processes:
        roles["agent"] = profiling.find_child(worker_pid, "rollpool.workers.episodes", "--index")
    roles["sglang"] = sg = profiling.find_child(worker_pid, "rollpool.workers.engines.sglang.server")
    if sg is not None and args.backend == "sglang":
        roles["sglang-scheduler"] = profiling.find_child(sg, "scheduler")
    sampler = profiling.Sampler(Path(args.out), args.profile_s, rate=args.profile_rate, gil=args.profile_gil,
                                  native=args.profile_native)
    await asyncio.to_thread(sampler.start, roles)
    rounds: list[dict[str, Any]] = []
    try:
        while not rounds or sampler.running():
            rounds.append(await run_phase(client, f"profile{len(rounds)}", args, None, None, 0))
    finally:
        prof = await asyncio.to_thread(sampler.finish)
        record_profile(result, prof)
    result["profiled"] = {"rounds": len(rounds), "output_tokens_per_s": [r["output_tokens_per_s"] for r in rounds],
                          "note": "the no_update workload with py-spy attached (its overhead included); not a measured phase"}


def record_profile(result: dict[str, Any], prof: dict[str, dict[str, Any]]) -> None:
    result.setdefault("profile", {}).update(prof)
    top = result.setdefault("profile_top_self", {})
    for role, info in prof.items():
        top[role] = info.get("top_self", [])[:10] if info.get("samples") else f"no samples: {info.get('error', 'unknown')}"
        gw.note(f"profile {role}: {info.get('samples', 0)} samples, cpu_share {info.get('cpu_share')}, "
                f"top {info.get('top_self', [])[:3]} {info.get('error', '')}")


# --------------------------------------------------------------------------- the peer: the same loop on an in-process sglang.Engine


def _task(i: int) -> str:
    rng = random.Random(i)
    return f"Task {i}: " + " ".join(rng.choice(WORDS) for _ in range(40))


REPLY_MARK = "\x00rollpool-reply\x00"


def rest_after_reply(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The ids the chat template puts after the last reply (``messages[-2]``, the assistant's) up to the next generation
    prompt: the reply's end, the new user message (``messages[-1]``), the assistant's header."""
    text = tok.apply_chat_template(messages[:-2] + [{"role": "assistant", "content": REPLY_MARK}, messages[-1]],
                                   tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text.split(REPLY_MARK, 1)[1], add_special_tokens=False))


async def _peer_phase(eng: Any, tok: Any, args: argparse.Namespace, name: str, update_at: float | None,
                      sd: dict[str, Any] | None) -> dict[str, Any]:
    """`args.groups` x `args.n` episodes at once. ``--peer-history text``: the chat template re-rendered and tokenized every
    turn, the reply decoded to text (a random model's replies then come back shorter than sampled: byte tokens collapse
    in the decode, so its contexts run smaller than the pool's, which keeps the sampled ids); ``tokens``: each turn's
    prompt is the last one's ids, the reply's ids as sampled and the rendered rest (the new user message and the
    generation prompt), the ids the pool's endpoint runs."""
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    stop = [eot] if isinstance(eot, int) and eot >= 0 else []
    sampled = 0
    turns = 0
    records: dict[tuple[str, int], list[dict[str, Any]]] = {}  # the turns' start and end, as the pool's agent records them

    async def episode(i: int, j: int) -> None:
        nonlocal sampled, turns
        rng = random.Random(f"{name}-{i}:{j}")
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."},
                                          {"role": "user", "content": _task(i)}]
        mine = records.setdefault((str(i), j), [])
        ids: list[int] = []
        for t in range(args.turns):
            start = time.time()
            if args.peer_history == "text" or t == 0:
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                ids = tok.encode(text, add_special_tokens=False)
            else:
                ids = ids + rest_after_reply(tok, messages)
            out = await eng.async_generate(input_ids=ids, sampling_params={"max_new_tokens": args.tokens_per_turn, "temperature": 1.0,
                                                                           "stop_token_ids": stop}, return_logprob=True)
            sampled += len(out["output_ids"])
            turns += 1
            mine.append({"turn": t, "start": start, "end": time.time(), "prompt_tokens": len(ids)})
            reply = list(out["output_ids"])
            ids = ids + (reply[:-1] if reply and stop and reply[-1] == stop[0] else reply)  # the template writes the end itself
            messages.append({"role": "assistant", "content": tok.decode(out["output_ids"], skip_special_tokens=True)})
            obs = " ".join(rng.choice(WORDS) for _ in range(args.tool_words))
            messages.append({"role": "user", "content": f"observation {t}: {obs}"})

    async def update() -> float:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        try:
            from sglang.srt.utils.common import MultiprocessingSerializer
        except ImportError:
            from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[no-redef]

        assert update_at is not None and sd is not None
        await asyncio.sleep(update_at)
        import torch

        for v in sd.values():
            v.add_(0.01)
        torch.cuda.synchronize()
        t = time.time()
        req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[MultiprocessingSerializer.serialize(list(sd.items()))],
                                              flush_cache=True, weight_version="1")
        ok, msg = await eng.tokenizer_manager.update_weights_from_tensor(req, None)
        if not ok:
            raise RuntimeError(f"peer update failed: {msg}")
        return round(time.time() - t, 3)

    sched = SchedulerLog([Path(args.out) / "peer.log"]) if args.sglang_log_level == "info" else None
    t0 = time.time()
    upd = asyncio.ensure_future(update()) if update_at is not None else None
    await asyncio.gather(*(episode(i, j) for i in range(args.groups) for j in range(args.n)))
    wall = time.time() - t0
    out: dict[str, Any] = {"wall_s": round(wall, 2), "episodes": args.groups * args.n, "turns": turns, "sampled_tokens": sampled,
                           "output_tokens_per_s": round(sampled / wall, 1), **turn_timing(records, t0, wall)}
    if sched is not None:
        sys.stderr.flush()
        out["scheduler"] = sched.read()
    if upd is not None:
        out["update_s"] = await upd
        out["published_at_s"] = update_at
    return out


def peer_main(args: argparse.Namespace) -> int:
    """The in-process peer (a child of the bench, so the pool's processes are gone and its GPU memory is free)."""
    gw.setup_env()
    import sglang
    from transformers import AutoTokenizer

    model = str(gw.build_model(Path(args.work), args.shape)[0])
    res: dict[str, Any] = {}
    kwargs = {"dtype": "bfloat16", "mem_fraction_static": args.mem_fraction, "max_running_requests": args.concurrency, "random_seed": 0,
              "context_length": args.context, "attention_backend": "triton", "sampling_backend": "pytorch",
              "log_level": args.sglang_log_level, "grammar_backend": "none", "cuda_graph_backend_prefill": "disabled",
              **sglang_args(args)}
    eng = sglang.Engine(model_path=model, **kwargs)
    try:
        tok = AutoTokenizer.from_pretrained(model)
        sd = gw.load_on(Path(model), "cuda")
        loop = eng.loop
        res["warmup"] = loop.run_until_complete(_peer_phase(eng, tok, argparse.Namespace(**{**vars(args), "groups": 2, "turns": 2}),
                                                            "warmup", None, None))
        res["no_update"] = loop.run_until_complete(_peer_phase(eng, tok, args, "no-update", None, None))
        Path(args.peer_out).write_text(json.dumps(res))
        res["one_update"] = loop.run_until_complete(_peer_phase(eng, tok, args, "one-update", res["no_update"]["wall_s"] / 2, sd))
        Path(args.peer_out).write_text(json.dumps(res))
        if args.profile_s > 0:  # the same rounds-under-py-spy as the pool's profiled phase, on this process
            profiling.allow_ptrace_self()
            me = os.getpid()
            sampler = profiling.Sampler(Path(args.out), args.profile_s, rate=args.profile_rate, gil=args.profile_gil,
                                  native=args.profile_native)
            sampler.start({"peer": me, "peer-scheduler": profiling.find_child(me, "scheduler")})
            rounds: list[float] = []
            try:
                while not rounds or sampler.running():
                    rounds.append(loop.run_until_complete(_peer_phase(eng, tok, args, f"profile{len(rounds)}", None, None))["output_tokens_per_s"])
            finally:
                res["profile"] = sampler.finish()
            res["profiled"] = {"rounds": len(rounds), "output_tokens_per_s": rounds}
            Path(args.peer_out).write_text(json.dumps(res))
    finally:
        eng.shutdown()
    return 0


def run_peer(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import subprocess

    out = Path(args.out) / "peer.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--peer-out", str(out)]
    for k in ("shape", "work", "groups", "n", "concurrency", "turns", "tokens_per_turn", "tool_words", "context", "mem_fraction", "out",
              "profile_s", "profile_rate", "sglang_log_level", "sglang_args", "peer_history"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    cmd += ["--profile-gil"] if args.profile_gil else []
    cmd += ["--profile-native"] if args.profile_native else []
    try:
        with (Path(args.out) / "peer.log").open("ab") as fh:
            env = {**os.environ, **(profiling.ptrace_hook_env(Path(args.work)) if args.profile_s > 0 else {})}
            subprocess.run(cmd, cwd=ROOT, timeout=args.peer_timeout_s + args.profile_s, check=True, stdout=fh,
                           stderr=subprocess.STDOUT, env=env)
    except Exception as exc:  # noqa: BLE001 - recorded; what the peer wrote stands
        result["peer_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    if out.exists():
        result["inprocess"] = json.loads(out.read_text())
        if "profile" in result["inprocess"]:
            record_profile(result, result["inprocess"].pop("profile"))
    ratios = {}
    for phase in ("no_update", "one_update"):
        pool, peer = result.get(phase, {}).get("output_tokens_per_s"), result.get("inprocess", {}).get(phase, {}).get("output_tokens_per_s")
        ratios[phase] = round(pool / peer, 3) if pool and peer else None
    result["pool_vs_inprocess_episodes"] = ratios
    gw.note(f"pool_vs_inprocess_episodes: {ratios}")


async def main_async(args: argparse.Namespace, result: dict[str, Any], save: Any) -> None:
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig
    from rollpool.weights.publisher import WeightPublisher

    work = Path(args.work)
    if args.backend == "sglang":
        model, model_bytes = gw.build_model(work, args.shape)
        sd = gw.load_on(model, "cuda")
    else:
        from rollpool.workers.engines.tiny_model import build_tiny_model

        model = work / "tiny"
        if not (model / "config.json").exists():
            build_tiny_model(model)
        model_bytes, sd = 0, None
    result["model"] = {"path_kind": args.shape if args.backend == "sglang" else "tiny", "bytes": model_bytes}
    wep, cep, sg_port = f"tcp://127.0.0.1:{gw._port()}", f"tcp://127.0.0.1:{gw._port()}", gw._port()
    out = Path(args.out)
    broker = gw._spawn(["rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--max-staleness", "1000",
                        "--task-timeout-s", "3600", "--log-level", "WARNING"], out / "broker.log")
    opts = f"port={sg_port},capacity={args.concurrency},backend={args.backend},context_length={args.context},log_dir={out},hop={args.hop}"
    if args.backend == "sglang":  # the child's sglang.Engine, as the peer's (its keywords)
        server = {**({"log_level": args.sglang_log_level} if args.sglang_log_level != "warning" else {}), **sglang_args(args)}
        if server:
            opts += f",server_args={json.dumps(server, separators=(',', ':'))}"
    if args.backend == "sglang":
        opts += f",mem_fraction_static={args.mem_fraction}"
    wlog = out / "worker.log"
    fn = "bench.gpu_episodes:agent"
    env = profiling.ptrace_hook_env(work) if args.profile_s > 0 else {}
    worker = gw._spawn(["rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(model), "--worker-id", "ep0",
                        "--engine-options", opts, "--episode", fn, "--max-episodes", str(args.concurrency),
                        "--max-context-tokens", str(args.context), "--apply-mode", args.apply_mode, "--agent-processes", str(args.agent_processes),
                        "--log-level", "INFO"], wlog, env=env)
    zctx = zmq.asyncio.Context()
    pub = WeightPublisher(SocketFactory(zctx), router_endpoint=f"tcp://127.0.0.1:{gw._port()}",
                          pub_endpoint=f"tcp://127.0.0.1:{gw._port()}", keep_versions=2, pool="bench-episodes")
    await pub.start()
    client = TrainerClient(config=TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=60.0, keep_versions=2))
    client._publisher = pub  # bench: the client publishes through this publisher
    try:
        await client.connect()
        await client.publish_weights({}, 0)
        t0 = time.time()
        while (await client.status())["counters"].get("workers_alive", 0) < 1:
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited {worker.returncode}: {wlog.read_text(errors='replace')[-3000:]}")
            if time.time() - t0 > args.join_timeout_s:
                raise RuntimeError("the worker never joined")
            await asyncio.sleep(0.2)
        result["worker_join_s"] = round(time.time() - t0, 1)
        gw.note(f"worker joined after {result['worker_join_s']} s")
        save()
        result["warmup"] = await run_phase(client, "warmup", argparse.Namespace(**{**vars(args), "groups": 2, "turns": 2}), None, None, 0)
        result["no_update"] = await run_phase(client, "no-update", args, None, None, 0)
        gw.note(f"no_update: {json.dumps(result['no_update'])}")
        save()
        at = result["no_update"]["wall_s"] / 2
        result["one_update"] = await run_phase(client, "one-update", args, at, sd, 1)
        gw.note(f"one_update: {json.dumps(result['one_update'])}")
        save()
        if args.profile_s > 0:
            await profile_pool(client, args, worker.pid, result)
            save()
        result["worker_declared_dead"] = (out / "broker.log").read_text(errors="replace").count("declared dead")
        save()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10)
        gw._stop(worker)
        gw._stop(broker)
        with contextlib.suppress(Exception):
            await pub.close()
        zctx.destroy(linger=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sglang", "sim"), default="sglang")
    ap.add_argument("--shape", choices=tuple(gw.SHAPES), default="1p4")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/gpu_episodes")
    add_workload_args(ap)
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--join-timeout-s", type=float, default=300)
    ap.add_argument("--phase-timeout-s", type=float, default=240)
    ap.add_argument("--deadline-s", type=float, default=560)
    ap.add_argument("--agent-processes", type=int, default=0, help="the worker's --agent-processes: its episode functions in N child processes (0: in the worker)")
    ap.add_argument("--agent-client", choices=("per-episode", "shared"), default="per-episode",
                    help="the agent's openai client: a new AsyncOpenAI per episode (each builds a TLS context), or one per "
                         "process copied per episode with with_options (the JSON's agent_client)")
    ap.add_argument("--apply-mode", choices=("interrupt", "drain"), default="interrupt",
                    help="the worker's --apply-mode for the one_update phase (the JSON's apply_mode)")
    ap.add_argument("--peer", choices=("on", "off"), default="on", help="the in-process sglang.Engine peer (sglang backend only)")
    ap.add_argument("--hop", choices=("auto", "off"), default="auto",
                    help="the worker's per-sample calls to SGLang: auto (the ZeroMQ hop to its launched child) or off (HTTP)")
    ap.add_argument("--peer-timeout-s", type=float, default=300)
    ap.add_argument("--peer-history", choices=("text", "tokens"), default="text",
                    help="the in-process peer's next prompt: the conversation re-rendered from text (as the issue's loop), or the "
                         "ids run so far + the reply's sampled ids + the rendered rest (the pool's ids); both report context_tokens")
    ap.add_argument("--sglang-args", default="",
                    help="a JSON object of sglang.Engine keywords for the worker's SGLang child and the peer alike, e.g. "
                         "'{\"enable_mixed_chunk\": true}' (the JSON's sglang_args)")
    ap.add_argument("--sglang-log-level", choices=("warning", "info"), default="warning",
                    help="SGLang's log level in the worker's child and the peer (info: each phase's 'scheduler' key counts "
                         "SGLang's prefill passes and the requests each admitted, from their logs)")
    ap.add_argument("--profile-s", type=float, default=0,
                    help="after the measured phases, py-spy samples the worker, one agent process, the SGLang child (and the "
                         "peer's process) for this many seconds while the no_update workload runs again: profile-<role>.txt; 0: off")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second (--profile-s)")
    ap.add_argument("--profile-gil", action="store_true", help="py-spy --gil: only the thread holding the GIL (Python's own CPU)")
    ap.add_argument("--profile-native", action="store_true",
                    help="py-spy --native: C and Rust frames too (the collector, waits for the GIL, the tokenizer's Rust)")
    ap.add_argument("--peer-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sglang_args(args)  # a bad --sglang-args ends the run here, before any device time
    if args.peer_out:
        return peer_main(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gw.OUT = out
    gw.RESULT_NAME = "h200-episodes.json" if args.backend == "sglang" else "cpu-episodes-simulated.json"
    result = gw.RESULT
    result.pop("rows", None)
    result["what"] = "bench/gpu_episodes.py: multi-turn openai-SDK agents through the episode endpoint on one sglang worker"
    result["simulated"] = args.backend == "sim"
    result["workload"] = {k: getattr(args, k) for k in ("groups", "n", "concurrency", "turns", "tokens_per_turn", "tool_words", "context")}
    result["how"] = {"share": "sum over turns 2..T of min(SGLang cached_tokens, cacheable) / sum of cacheable, where cacheable is "
                              "the previous turn's prompt_tokens + completion_tokens - 1 (the last sampled token has no KV)",
                     "one_update": "the same workload; one version published (every tensor +-0.01, from CUDA tensors) at half "
                                   "the no_update phase's wall time"}
    gw.start_watchdog(args.deadline_s)
    if args.backend == "sglang":
        gw.setup_env()
        import torch

        result["machine"] = torch.cuda.get_device_name(0)
        card = next((c for c in ("h100", "h200", "a100", "b200") if c in result["machine"].lower()), "gpu")
        gw.RESULT_NAME = (f"{card}-episodes{f'-ap{args.agent_processes}' if args.agent_processes else ''}"
                          f"{'-shared-client' if args.agent_client == 'shared' else ''}"
                          f"{'-drain' if args.apply_mode == 'drain' else ''}.json")
    result["agent_processes"] = args.agent_processes
    result["agent_client"] = args.agent_client
    result["apply_mode"] = args.apply_mode
    result["how"]["apply"] = ("one_update.apply: the worker's sglang engine's apply (its 'sglang apply' log line): stopped_s from "
                              "the pause's start until samples may be sent again, pause_s (abort and wait, or drain), "
                              "sglang_update_s, verify_s, ...; *_at in s after the phase's start. longest_gap_s: the longest "
                              "stretch of the phase with no turn ending; publish_called_at_s .. published_at_s: the trainer's "
                              "publish_weights call")
    if args.profile_s > 0:
        result["how"]["profile"] = ("phase 'profiled', after the measured ones: the no_update workload round after round while py-spy "
                                    "samples each process for --profile-s s (idle threads left out); profile-<role>.txt per process, "
                                    "profile_top_self: the top 10 functions by own samples, [function, share of the role's samples]")
        result["ptrace"] = profiling.ptrace_facts()
    result["hop"] = args.hop
    result["sglang_args"] = sglang_args(args)
    try:
        asyncio.run(main_async(args, result, gw.save))
    except Exception as exc:  # noqa: BLE001 - recorded; the partial JSON stands
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        gw.note(f"failed: {exc!r}")
    if args.backend == "sglang" and args.peer == "on" and "error" not in result:
        gw.save()
        run_peer(args, result)
    result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    gw.save()
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
