"""The episode runner at the token level, on a scripted engine (a fake at the process edge; no sockets)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from rollpool.protocol.errors import ConfigError
from rollpool.protocol.messages import Prompt, SamplingParams
from rollpool.workers import EpisodeContext
from rollpool.workers.episodes import (
    ContextLengthExceededError,
    EpisodeClosedError,
    EpisodeConfig,
    EpisodeRunner,
    load_episode_function,
    load_episode_functions,
)
from rollpool.workers.episodes.runner import START_SLICE_S
from tests.unit.workers.episodes.scripted_engine import ScriptedEngine

EOS = 99


def _prompt(n: int = 1, **kw: Any) -> Prompt:
    return Prompt(prompt_id="p", input_ids=np.array([1, 2, 3], dtype=np.int32), group_size=n,
                  sampling=SamplingParams(max_new_tokens=8), **kw)


def _runner(engine: ScriptedEngine, fn: Any, **cfg: Any) -> EpisodeRunner:
    return EpisodeRunner(engine, fn, EpisodeConfig(serve_openai=False, **cfg), worker_id="w1")


async def test_a_token_level_episode_records_sampled_and_inserted_tokens_with_versions() -> None:
    engine = ScriptedEngine([[10, 11, EOS], [12, EOS]], eos_id=EOS, version=4)

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        ctx.append([50])  # before any sample: the start version
        s = await ctx.generate()
        assert s.output_ids == [10, 11, EOS]
        engine.version = 5  # a weight update between turns
        ctx.append([60, 61])  # after: the version of the sampled token before (4)
        await ctx.generate(max_new_tokens=4)
        ctx.metadata["turns"] = 2
        return 0.75

    async with _runner(engine, episode) as runner:
        (t,) = await runner.run_group(_prompt(metadata={"answer": 7}))
    assert engine.prompts == [[1, 2, 3, 50], [1, 2, 3, 50, 10, 11, EOS, 60, 61]]
    assert t.trajectory_id == "p:0" and t.input_ids.tolist() == [1, 2, 3]
    assert t.output_ids.tolist() == [50, 10, 11, EOS, 60, 61, 12, EOS]
    assert t.loss_mask.tolist() == [0, 1, 1, 1, 0, 0, 1, 1]
    assert t.token_versions.tolist() == [4, 4, 4, 4, 4, 4, 5, 5]
    assert t.output_logprobs.tolist() == [0.0, -0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert t.reward == 0.75 and t.metadata == {"answer": 7, "turns": 2} and t.worker_id == "w1"
    assert t.finish_reason == "stop"
    assert runner.stats.turns == 2 and runner.stats.in_flight == 0


async def test_n_episodes_of_a_group_run_side_by_side_on_the_one_engine() -> None:
    engine = ScriptedEngine([[10, EOS]] * 4, eos_id=EOS, delay_s=0.05)

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        await ctx.generate()
        return float(ctx.sample_index)

    async with _runner(engine, episode) as runner:
        out = await runner.run_group(_prompt(4))
    assert [t.sample_index for t in out] == [0, 1, 2, 3] and [t.reward for t in out] == [0.0, 1.0, 2.0, 3.0]
    assert engine.max_concurrent == 4


async def test_max_episodes_bounds_the_episodes_running_at_once() -> None:
    engine = ScriptedEngine([[10, EOS]] * 6, eos_id=EOS, delay_s=0.02)
    running, most = 0, 0

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await ctx.generate()
        running -= 1

    async with _runner(engine, episode, max_episodes=2) as runner:
        out = await runner.run_group(_prompt(6))
    assert len(out) == 6 and most == 2


async def test_an_exception_is_that_samples_error_with_its_message() -> None:
    engine = ScriptedEngine([[10, EOS]] * 2, eos_id=EOS)

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        await ctx.generate()
        if ctx.sample_index == 1:
            raise RuntimeError("the environment crashed")
        return 1.0

    async with _runner(engine, episode) as runner:
        a, b = await runner.run_group(_prompt(2))
    assert a.finish_reason == "stop" and a.reward == 1.0
    assert b.finish_reason == "error" and b.reward is None
    assert b.metadata["episode_error"] == "RuntimeError: the environment crashed"
    assert b.output_ids.tolist() == [10, EOS]  # what it recorded is kept
    assert runner.stats.failed == 1


async def test_a_return_value_that_is_not_a_number_is_reported_not_raised() -> None:
    async def episode(ctx: EpisodeContext, prompt: Prompt) -> str:
        return "yes"

    async with _runner(ScriptedEngine(eos_id=EOS), episode) as runner:
        (t,) = await runner.run_group(_prompt())
    assert t.reward is None and "not a finite number" in t.metadata["reward_error"]


async def test_an_episode_that_never_returns_is_cut_at_its_timeout() -> None:
    engine = ScriptedEngine([[10, EOS]], eos_id=EOS)

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> None:
        await ctx.generate()
        await asyncio.Event().wait()

    async with _runner(engine, episode, episode_timeout_s=0.2) as runner:
        (t,) = await runner.run_group(_prompt())
    assert t.finish_reason == "abort" and "timed out after 0.2s" in t.metadata["episode_error"]
    assert t.output_ids.tolist() == [10, EOS] and runner.stats.timed_out == 1


async def test_appending_past_the_context_ends_the_episode_with_length() -> None:
    engine = ScriptedEngine([[10, 11, 12, 13, 14, 15, 16, 17]], eos_id=EOS)

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> None:
        s = await ctx.generate()
        assert len(s.output_ids) == 5  # max_new_tokens cut to the room left (8 - 3)
        ctx.append([1])

    async with _runner(engine, episode, max_context_tokens=8) as runner:
        (t,) = await runner.run_group(_prompt())
    assert t.finish_reason == "length" and "past the context of 8" in t.metadata["episode_error"]
    assert len(t.input_ids) + len(t.output_ids) == 8


async def test_a_sync_episode_and_its_tool_run_in_threads_while_the_loop_keeps_serving() -> None:
    engine = ScriptedEngine([[10, EOS], [11, EOS]], eos_id=EOS)
    released = threading.Event()
    on_loop_ran = asyncio.Event()

    def slow_tool() -> list[int]:
        # waits for a coroutine on the event loop: were the loop blocked by this thread, it would time out
        assert released.wait(timeout=10), "the event loop did not run while a sync tool waited"
        return [70, 71]

    def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        ctx.generate_sync()
        ctx.append(slow_tool())
        ctx.generate_sync()
        return 1.0

    async def the_loop_goes_on() -> None:
        await asyncio.sleep(0.05)
        released.set()
        on_loop_ran.set()

    async with _runner(engine, episode) as runner:
        ticker = asyncio.create_task(the_loop_goes_on())
        (t,) = await runner.run_group(_prompt())
        await ticker
    assert on_loop_ran.is_set() and t.reward == 1.0
    assert t.output_ids.tolist() == [10, EOS, 70, 71, 11, EOS] and t.loss_mask.tolist() == [1, 1, 0, 0, 1, 1]


async def test_ctx_tool_runs_a_sync_tool_in_a_thread_and_counts_it() -> None:
    def tool(x: int) -> int:
        assert threading.current_thread() is not threading.main_thread()
        return x + 1

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        return float(await ctx.tool(tool, 1))

    async with _runner(ScriptedEngine(eos_id=EOS), episode) as runner:
        (t,) = await runner.run_group(_prompt())
    assert t.reward == 2.0 and runner.stats.tool_calls == 1


async def test_cancelling_the_group_aborts_its_turns_and_closes_its_episodes() -> None:
    engine = ScriptedEngine([[10, EOS]] * 2, eos_id=EOS, delay_s=30)
    contexts: list[EpisodeContext] = []

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> None:
        contexts.append(ctx)
        await ctx.generate()

    async with _runner(engine, episode) as runner:
        task = asyncio.create_task(runner.run_group(_prompt(2), request_prefix="task-1"))
        await engine.wait_running(2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(engine.aborted) == ["task-1:0:t1", "task-1:1:t1"]
        assert runner.stats.in_flight == 0 and runner.stats.turns_in_flight == 0
        with pytest.raises(EpisodeClosedError):
            contexts[0].append([1])


async def test_a_prompt_can_name_its_episode_function() -> None:
    async def a(ctx: EpisodeContext, prompt: Prompt) -> float:
        return 1.0

    async def b(ctx: EpisodeContext, prompt: Prompt) -> float:
        return 2.0

    async with _runner(ScriptedEngine(eos_id=EOS), {"default": a, "b": b}) as runner:
        (x,) = await runner.run_group(_prompt())
        (y,) = await runner.run_group(_prompt(metadata={"episode": "b"}))
        (z,) = await runner.run_group(_prompt(metadata={"episode": "nope"}))
    assert (x.reward, y.reward) == (1.0, 2.0)
    assert z.finish_reason == "error" and "'nope'" in z.metadata["episode_error"]


def test_loading_episode_functions_by_path() -> None:
    fns = load_episode_functions(["tests.unit.workers.episodes.episode_fns:solve",
                                  "other=tests.unit.workers.episodes.episode_fns:sync_solve"])
    assert set(fns) == {"default", "other"} and fns["default"].__name__ == "solve"
    with pytest.raises(ConfigError, match="tests.unit.workers.episodes.no_such"):
        load_episode_function("tests.unit.workers.episodes.no_such:solve")
    with pytest.raises(ConfigError, match="has no missing"):
        load_episode_function("tests.unit.workers.episodes.episode_fns:missing")
    with pytest.raises(ConfigError, match="not callable"):
        load_episode_function("tests.unit.workers.episodes.episode_fns:not_callable")
    with pytest.raises(ConfigError, match="package.module:function"):
        load_episode_function("no_colon")
    with pytest.raises(ConfigError, match="given twice"):
        load_episode_functions(["x=tests.unit.workers.episodes.episode_fns:solve", "x=tests.unit.workers.episodes.episode_fns:solve"])


def test_episode_config_checks_its_ranges() -> None:
    with pytest.raises(ConfigError, match="max_episodes"):
        EpisodeConfig(max_episodes=0)
    with pytest.raises(ConfigError, match="unknown tool-call parser 'x'"):
        EpisodeConfig(tool_call_parser="x")
    with pytest.raises(ConfigError, match="loopback"):
        EpisodeRunner(ScriptedEngine(), lambda c, p: None, EpisodeConfig(host="0.0.0.0"))


async def test_a_timeout_inside_the_episodes_own_code_is_its_error_not_the_episode_timeout() -> None:
    async def episode(ctx: EpisodeContext, prompt: Prompt) -> None:
        raise TimeoutError("the environment did not answer")

    async with _runner(ScriptedEngine(eos_id=EOS), episode, episode_timeout_s=60) as runner:
        (t,) = await runner.run_group(_prompt())
    assert t.finish_reason == "error" and t.metadata["episode_error"] == "TimeoutError: the environment did not answer"
    assert t.input_ids.tolist() == [1, 2, 3] and t.output_ids.tolist() == []  # recorded nothing: the prompt, no output
    assert runner.stats.timed_out == 0


async def test_token_level_input_ids_extend_the_sequence_or_start_a_new_segment() -> None:
    engine = ScriptedEngine([[10, EOS], [11, EOS], [12, EOS]], eos_id=EOS)

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> None:
        await ctx.generate()
        await ctx.generate(input_ids=[*ctx.token_ids, 7])  # extends: 7 inserted, mask 0
        assert ctx.segment_index == 0
        await ctx.generate(input_ids=[1, 2, 8])  # does not: a new segment
        assert ctx.segment_index == 1

    async with _runner(engine, episode) as runner:
        a, b = await runner.run_group(_prompt())
    assert (a.trajectory_id, b.trajectory_id) == ("p:0", "p:0:1")
    assert a.output_ids.tolist() == [10, EOS, 7, 11, EOS] and a.loss_mask.tolist() == [1, 1, 0, 1, 1]
    assert b.input_ids.tolist() == [1, 2, 8] and b.output_ids.tolist() == [12, EOS]
    assert runner.stats.segments == 2 and runner.stats.reused_prefix_tokens == 5  # the second turn's prompt was in the sequence


async def test_append_while_a_turn_is_sampled_is_refused() -> None:
    engine = ScriptedEngine([[10, EOS]], eos_id=EOS, delay_s=0.2)

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> None:
        turn = asyncio.create_task(ctx.generate())
        await engine.wait_running(1)
        with pytest.raises(RuntimeError, match="being sampled"):
            ctx.append([5])
        await turn

    async with _runner(engine, episode) as runner:
        (t,) = await runner.run_group(_prompt())
    assert t.output_ids.tolist() == [10, EOS] and "episode_error" not in t.metadata


async def test_an_agent_that_recovers_from_the_context_in_a_new_segment_keeps_length_on_the_overflowed_one() -> None:
    engine = ScriptedEngine([[10, 11, 12, 13, EOS], [20, EOS]], eos_id=EOS)

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        await ctx.generate()
        with pytest.raises(ContextLengthExceededError):
            ctx.append([1, 2, 3])  # 8 + 3 > 10
        await ctx.generate(input_ids=[1, 2])  # summarised: a new segment
        return 1.0

    async with _runner(engine, episode, max_context_tokens=10) as runner:
        a, b = await runner.run_group(_prompt())
    assert (a.finish_reason, b.finish_reason) == ("length", "stop") and a.reward == b.reward == 1.0


def test_the_worker_command_exits_2_naming_an_episode_path_that_does_not_import(capsys: pytest.CaptureFixture[str]) -> None:
    from rollpool.cli import main

    assert main(["worker", "--episode", "no_such_pkg.mod:fn"]) == 2
    assert "no_such_pkg.mod:fn" in capsys.readouterr().err
    assert main(["worker", "--episode", "tests.unit.workers.episodes.episode_fns:solve",
                 "--episode", "other=tests.unit.workers.episodes.episode_fns:missing"]) == 2
    assert "has no missing" in capsys.readouterr().err


def test_episode_flags_repeat_into_the_worker_config() -> None:
    import argparse

    from rollpool.cli.worker import add_arguments
    from rollpool.protocol.config import load_config
    from rollpool.workers.config import WorkerConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--episode", "a.b:c", "--episode", "x=d.e:f", "--max-episodes", "8", "--episode-timeout-s", "5"])
    cfg = load_config(WorkerConfig, args, environ={})
    assert cfg.episode == ("a.b:c", "x=d.e:f") and cfg.max_episodes == 8 and cfg.episode_timeout_s == 5.0


async def _start_passes(first_step_s: float, n: int) -> list[int]:
    """The pass of the event loop in which each of 2 groups x `n` episodes ran its first step (`first_step_s` of CPU)."""
    engine = ScriptedEngine([[10, EOS]] * (2 * n), eos_id=EOS)
    passes = 0
    seen: list[int] = []

    async def ticker() -> None:
        nonlocal passes
        while True:
            passes += 1
            await asyncio.sleep(0)

    async def episode(ctx: EpisodeContext, prompt: Prompt) -> float:
        seen.append(passes)
        time.sleep(first_step_s)  # noqa: ASYNC251 - the point: a first step that holds the loop (an SDK client's TLS set-up)
        await ctx.generate()
        return 1.0

    tick = asyncio.create_task(ticker())
    try:
        async with _runner(engine, episode) as runner:
            results = await asyncio.gather(runner.run_group(_prompt(n)), runner.run_group(_prompt(n)))
    finally:
        tick.cancel()
    assert sum(len(r) for r in results) == 2 * n
    return seen


async def test_episodes_with_long_first_steps_start_in_passes_of_their_own() -> None:
    """Episodes whose first step is long must not all run in one pass of the loop: the worker's heartbeats share
    it, and a loop held for seconds got the worker declared dead (and its groups run twice)."""
    seen = await _start_passes(1.5 * START_SLICE_S, 6)
    assert len(set(seen)) == len(seen) == 12  # no two long starts in the same pass


async def test_quick_episode_starts_share_a_pass() -> None:
    """... while quick starts are not spread one per pass (10,000 token-level episodes would wait 10,000 passes)."""
    seen = await _start_passes(0.0, 50)
    assert len(set(seen)) < len(seen) / 5


async def test_the_tokenizer_lane_runs_calls_in_order_off_the_loop_and_runs_nothing_after_shutdown() -> None:
    from rollpool.workers.episodes.episode import TokenizerLane

    lane = TokenizerLane()
    try:
        loop_thread = threading.get_ident()
        seen: list[tuple[int, bool]] = []

        def work(i: int) -> int:
            seen.append((i, threading.get_ident() != loop_thread))
            return 2 * i

        assert await asyncio.gather(*(lane.call(work, i) for i in range(50))) == [2 * i for i in range(50)]
        assert seen == [(i, True) for i in range(50)]  # one at a time, in order, never on the loop

        def bad_template() -> None:
            raise ValueError("the template refused")

        with pytest.raises(ValueError, match="the template refused"):
            await lane.call(bad_template)
        started, release = threading.Event(), threading.Event()

        def slow() -> str:
            started.set()
            release.wait(10)
            return "done"

        running = asyncio.ensure_future(lane.call(slow))
        queued = asyncio.ensure_future(lane.call(work, 99))
        assert await asyncio.to_thread(started.wait, 10)
        lane.shutdown()
        release.set()
        assert await running == "done"  # the call under way finishes
        with pytest.raises(asyncio.CancelledError):
            await queued  # the queued one never runs
        assert (99, True) not in seen
        with pytest.raises(RuntimeError, match="shut down"):
            await lane.call(work, 1)
    finally:
        lane.shutdown()


async def test_a_small_tokenizer_call_runs_on_the_loop_only_while_the_lane_is_idle() -> None:
    """A small call (a turn's rendering) costs less on the loop than two hand-offs between threads, each waiting for
    the GIL under a busy loop; but the tokenizer must never be used by two threads at once: while the lane's thread
    holds a call, a small call queues behind it, in order."""
    from rollpool.workers.episodes.episode import TokenizerLane

    lane = TokenizerLane()
    try:
        loop_thread = threading.get_ident()
        seen: list[tuple[str, bool]] = []

        def work(name: str) -> str:
            seen.append((name, threading.get_ident() == loop_thread))
            return name

        assert await lane.call(work, "idle", small=True) == "idle"
        assert await lane.call(work, "large") == "large"
        assert seen == [("idle", True), ("large", False)]
        started, release = threading.Event(), threading.Event()

        def slow() -> str:
            started.set()
            release.wait(10)
            seen.append(("slow", False))
            return "slow"

        running = asyncio.ensure_future(lane.call(slow))
        assert await asyncio.to_thread(started.wait, 10)
        behind = asyncio.ensure_future(lane.call(work, "behind", small=True))
        await asyncio.sleep(0.05)
        assert not behind.done()  # not run beside the thread's call
        release.set()
        assert await running == "slow" and await behind == "behind"
        assert seen[-2:] == [("slow", False), ("behind", False)]  # in order, on the lane's thread
        assert await lane.call(work, "idle again", small=True) == "idle again"
        assert seen[-1] == ("idle again", True) and lane.inline_calls == 2
    finally:
        lane.shutdown()


async def test_a_large_tokenizer_call_runs_beside_the_lane_with_its_own_copy_of_the_tokenizer() -> None:
    """One agent's huge message (seconds of tokenizing) held every other episode's turns behind it in the one lane:
    a call past `LARGE_CHARS` runs on a thread of its own with a copy of the tokenizer, so the tokenizer is still
    used by one thread at a time and the other turns go on."""
    from rollpool.workers.episodes.episode import TokenizerLane

    class Tok:
        def __init__(self) -> None:
            self.name = "shared"

        def __deepcopy__(self, memo: Any) -> Tok:
            other = Tok()
            other.name = "copy"
            return other

    shared = Tok()
    lane = TokenizerLane(tokenizer=shared)
    try:
        started, release = threading.Event(), threading.Event()

        def huge(t: Tok, text: str) -> str:
            started.set()
            release.wait(10)
            return f"{t.name}:{len(text)}"

        def turn(t: Tok) -> str:
            return t.name

        big = asyncio.ensure_future(lane.call(huge, shared, "x" * 1000, large=True))
        assert await asyncio.to_thread(started.wait, 10)
        assert await asyncio.wait_for(lane.call(turn, shared), 5) == "shared"  # not behind the huge one
        release.set()
        assert await big == "copy:1000" and lane.large_calls == 1
        assert await lane.call(huge, shared, "y", large=True) == "copy:1"  # the copy is made once and kept
    finally:
        release.set()
        lane.shutdown()


async def test_a_tokenizer_that_cannot_be_copied_keeps_large_calls_in_the_lane_in_order() -> None:
    from rollpool.workers.episodes.episode import TokenizerLane

    class Uncopyable:
        def __deepcopy__(self, memo: Any) -> Any:
            raise TypeError("no copies")

    shared = Uncopyable()
    lane = TokenizerLane(tokenizer=shared)
    try:
        seen: list[Any] = []

        def work(t: Any, i: int) -> int:
            seen.append((t is shared, threading.current_thread().name))
            return i

        assert await lane.call(work, shared, 1, large=True) == 1
        assert await lane.call(work, shared, 2, large=True) == 2
        assert lane.large_calls == 0 and seen == [(True, "rollpool-episode-tokenizer")] * 2
    finally:
        lane.shutdown()
