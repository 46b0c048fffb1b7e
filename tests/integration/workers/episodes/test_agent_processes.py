"""``--agent-processes``: episode functions in child processes of the worker, on real processes and sockets.

A real broker, real `Worker`s and a `TrainerClient` on zmq tcp loopback; the agent processes are real
children (`rollpool.workers.episodes.processes`), the episode functions imported by path from
`agent_process_fns`. The trajectory test runs the `hf` engine on the random tiny model with the real
`openai` SDK; the kill test the sim engine (labelled simulated: its tokens are random).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from rollpool.protocol.errors import ConfigError
from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.workers.episodes.processes import AgentProcesses
from rollpool.workers.heap import GC_THRESHOLDS
from tests.integration.reliability.conftest import Pool, wait_until
from tests.integration.workers.episodes.test_worker_episodes import broker_counters, start_worker

pytest.importorskip("aiohttp")
FNS = "tests.integration.workers.episodes.agent_process_fns"
ROOT = pathlib.Path(__file__).resolve().parents[4]


def _prompts(tag: str) -> list[Prompt]:
    """Groups of one: the worker at capacity 1 (see `_run`) takes a group only when it has a credit per episode."""
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    ids = np.arange(3, 9, dtype=np.int32)
    return [Prompt(prompt_id=f"{tag}-sdk{i}", text=f"What is {i} plus 2?", group_size=1, sampling=sp) for i in range(2)] + [
        Prompt(prompt_id=f"{tag}-tok{i}", input_ids=ids + i, group_size=1, sampling=sp, metadata={"episode": "tokens"}) for i in range(2)] + [
        Prompt(prompt_id=f"{tag}-sync", input_ids=ids, group_size=1, sampling=sp, metadata={"episode": "sync"}),
        Prompt(prompt_id=f"{tag}-fail", input_ids=ids, group_size=1, sampling=sp, metadata={"episode": "fails"})]


async def _run(p: Pool, tag: str, tiny_model_dir: pathlib.Path, agent_processes: int) -> tuple[dict[str, Any], list[int]]:
    from rollpool.workers.engines.hf import HFEngine

    specs = (f"{FNS}:sdk_agent", f"tokens={FNS}:token_agent", f"sync={FNS}:sync_agent", f"fails={FNS}:failing_agent")
    # capacity 1: one sequence at a time, so a seeded turn samples the same tokens whichever run it is in
    w, task = start_worker(p, f"w-{tag}", None, engine="hf", model=str(tiny_model_dir), episode=specs, agent_processes=agent_processes,
                           engine_factory=lambda: HFEngine(model=str(tiny_model_dir), capacity=1, num_threads=1))
    client = await p.client(p.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit(_prompts(tag))
    batch = await client.get_batch(6, timeout=60)
    pids = list(w.episodes.agents.pids) if w.episodes is not None and w.episodes.agents is not None else []
    w.stop()
    await asyncio.wait_for(task, 20)
    out = {t.trajectory_id.removeprefix(f"{tag}-"): t for g in batch.groups for t in g.trajectories}
    return out, pids


@pytest.mark.timeout(120)  # about 10 s on the 2-core box: two workers on the tiny model, two agent processes
async def test_episodes_in_agent_processes_record_what_they_record_in_the_worker(pool: Pool, tiny_model_dir: pathlib.Path) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("transformers")
    await pool.start_broker()
    here, no_pids = await _run(pool, "in", tiny_model_dir, 0)
    there, pids = await _run(pool, "out", tiny_model_dir, 2)
    assert not no_pids and len(pids) == 2 and all(pids) and os.getpid() not in pids
    assert sorted(here) == sorted(there) == ["fail:0", "sdk0:0", "sdk1:0", "sync:0", "tok0:0", "tok0:0:1", "tok1:0", "tok1:0:1"]
    for tid, a in here.items():
        b = there[tid]
        assert a.output_ids.tolist() == b.output_ids.tolist(), tid
        assert a.loss_mask.tolist() == b.loss_mask.tolist(), tid
        assert a.token_versions.tolist() == b.token_versions.tolist(), tid
        assert a.input_ids.tolist() == b.input_ids.tolist(), tid
        assert (a.reward, a.finish_reason) == (b.reward, b.finish_reason), tid
        assert {k: v for k, v in a.metadata.items() if k != "pid"} == {k: v for k, v in b.metadata.items() if k != "pid"}, tid
    assert here["sdk1:0"].reward == 1.0 and (here["sdk0:0"].loss_mask == 0).any()  # two turns with a user message between
    assert there["tok0:0"].metadata["segment"] == 1  # the rewrite's segment, seen in the child after its forwarded turn
    assert here["fail:0"].finish_reason == "error"
    assert here["fail:0"].metadata["episode_error"] == "ValueError: the tool broke on sample 0"
    assert here["sdk0:0"].metadata["pid"] == os.getpid()
    assert {there[t].metadata["pid"] for t in ("sdk0:0", "sdk1:0", "tok0:0", "tok1:0")} == set(pids)  # both children served


@pytest.mark.timeout(60)  # about 5 s
async def test_an_agent_process_killed_mid_episode_fails_that_episode_once_and_is_started_again(pool: Pool, tmp_path: pathlib.Path) -> None:
    await pool.start_broker()
    w, _ = start_worker(pool, "w", None, episode=(f"{FNS}:held_agent",), agent_processes=2, restart_backoff_s=0.1)
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    md = {"pid_dir": str(tmp_path), "hold": True}
    await client.submit([Prompt(prompt_id="p", input_ids=np.arange(3, 9, dtype=np.int32), group_size=2,
                                sampling=SamplingParams(max_new_tokens=4), metadata=md)])
    assert await wait_until(lambda: len(list(tmp_path.glob("p-*"))) == 2, 20)
    assert w.episodes is not None and w.episodes.agents is not None
    before = list(w.episodes.agents.pids)
    (held,) = tmp_path.glob("p-0-*")  # noqa: ASYNC240 - a listing of a tiny directory
    victim = int(held.name.rsplit("-", 1)[1])
    assert victim in before
    os.kill(victim, signal.SIGKILL)
    (group,) = (await client.get_batch(1, timeout=20)).groups
    by = {t.sample_index: t for t in group.trajectories}
    assert sorted(by) == [0, 1] and group.attempts == 1
    assert by[1].reward == 1.0 and "episode_error" not in by[1].metadata  # the other child's episode is untouched
    assert by[0].finish_reason == "error" and by[0].reward is None
    error = by[0].metadata["episode_error"]
    assert error.startswith("AgentProcessError: the agent process") and f"pid {victim}" in error and "died" in error, error
    assert len(by[0].output_ids) == 4  # its recorded turn is kept, as for an episode that raised
    agents = w.episodes.agents
    assert await wait_until(lambda: all(agents.pids) and victim not in agents.pids, 20)
    assert agents.stats.agent_process_restarts == 1
    await client.submit([Prompt(prompt_id="q", input_ids=np.arange(3, 9, dtype=np.int32), group_size=4,
                                sampling=SamplingParams(max_new_tokens=4), metadata={"pid_dir": str(tmp_path)})])
    (again,) = (await client.get_batch(1, timeout=20)).groups
    assert [t.reward for t in again.trajectories] == [1.0] * 4
    assert {t.metadata["pid"] for t in again.trajectories} <= set(agents.pids)
    with pytest.raises(TimeoutError):
        await client.get_batch(1, timeout=0.5)  # nothing delivered twice
    c = broker_counters(pool)
    assert c.get("duplicates", 0) == 0 and c.get("requeued", 0) == 0 and c.get("workers_lost", 0) == 0


@pytest.mark.timeout(60)  # about 3 s
async def test_an_episode_past_its_timeout_is_cut_and_cancelled_in_its_agent_process(pool: Pool, tmp_path: pathlib.Path) -> None:
    await pool.start_broker()
    w, _ = start_worker(pool, "w", None, episode=(f"{FNS}:held_agent",), agent_processes=1, episode_timeout_s=1.0)
    client = await pool.client(pool.broker.client_endpoint)  # type: ignore[union-attr]
    await client.submit([Prompt(prompt_id="p", input_ids=np.arange(3, 9, dtype=np.int32), group_size=2,
                                sampling=SamplingParams(max_new_tokens=4), metadata={"pid_dir": str(tmp_path), "hold": True})])
    (group,) = (await client.get_batch(1, timeout=20)).groups
    by = {t.sample_index: t for t in group.trajectories}
    assert by[0].finish_reason == "abort" and "timed out" in by[0].metadata["episode_error"] and len(by[0].output_ids) == 4
    assert by[1].reward == 1.0
    *thresholds, frozen = by[1].metadata["gc"]  # the child froze its start-up heap and collects less often, as the worker
    assert tuple(thresholds) == GC_THRESHOLDS and frozen > 10_000
    assert w.episodes is not None and w.episodes.agents is not None
    (pid,) = w.episodes.agents.pids
    assert await wait_until(lambda: (tmp_path / f"cancelled-p-{pid}").exists(), 10)  # the child's task was cancelled
    assert w.episodes.agents.stats.agent_process_restarts == 0


async def test_an_episode_path_that_does_not_load_in_the_agent_process_stops_the_start() -> None:
    agents = AgentProcesses([f"{FNS}:held_agent"], 1)
    os.environ["RP_TEST_FAIL_IN_AGENT_PROCESS"] = "1"
    try:
        with pytest.raises(ConfigError, match=r"agent process 0 could not start: .*agent_process_fns.*refuses to load"):
            await agents.start()
    finally:
        del os.environ["RP_TEST_FAIL_IN_AGENT_PROCESS"]
    assert agents.pids == [0]


def test_a_bad_episode_path_with_agent_processes_exits_2_naming_it() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "rollpool", "worker", "--agent-processes", "2"]
    bad = subprocess.run([*cmd, "--episode", "no_such_module_x:fn"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "no_such_module_x" in bad.stderr, bad.stderr
    none = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert none.returncode == 2 and "agent_processes needs --episode" in none.stderr, none.stderr
