"""bench/profiling.py: the summary of py-spy's stacks, the failures it records instead of raising, a real sample."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import profiling


def test_own_and_cumulative_shares_and_waits_left_out() -> None:
    raw = "\n".join([
        "<module> (a.py);run (asyncio/runners.py);handle (rollpool/workers/episodes/server.py);dumps (json/__init__.py) 6",
        "<module> (a.py);run (asyncio/runners.py);handle (rollpool/workers/episodes/server.py) 2",
        "<module> (a.py);run (asyncio/runners.py);select (selectors.py) 50",  # the event loop waiting
        "Thread._bootstrap (threading.py);ThreadedChildWatcher._do_waitpid (asyncio/unix_events.py) 40",
        "<module> (a.py);render (jinja2/environment.py) 2",
        "not a stack line",
    ])
    s = profiling.summarize_raw(raw)
    assert s["samples"] == 10
    assert s["idle_samples_left_out"] == 90
    assert s["top_self"][0] == ["dumps (json/__init__.py)", 0.6]
    assert dict(s["top_self"]) == {"dumps (json/__init__.py)": 0.6, "handle (rollpool/workers/episodes/server.py)": 0.2,
                                   "render (jinja2/environment.py)": 0.2}
    cum = dict(s["top_cum"])
    assert cum["<module> (a.py)"] == 1.0
    assert cum["handle (rollpool/workers/episodes/server.py)"] == 0.8
    assert s["share_by_category"]["JSON"] == 0.6
    assert s["share_by_category"]["tokenizer and chat template"] == 0.2


def test_a_recursive_function_counts_once_per_sample_in_the_cumulative_share() -> None:
    s = profiling.summarize_raw("main (m.py);f (m.py);f (m.py);f (m.py) 4\n")
    assert dict(s["top_cum"])["f (m.py)"] == 1.0
    assert s["top_self"] == [["f (m.py)", 1.0]]


def test_no_pyspy_and_no_process_are_recorded_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiling, "find_pyspy", lambda: (None, "no py-spy on PATH and no wheel"))
    sampler = profiling.Sampler(tmp_path, 1)
    sampler.start({"worker": None, "me": 1})
    res = sampler.finish()
    assert res["worker"]["error"] == "process not found"
    assert res["me"]["error"] == "no py-spy on PATH and no wheel"
    assert "sampling failed: no py-spy" in (tmp_path / "profile-me.txt").read_text()


def test_descendants_are_found_by_their_argv() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "marker-for-find-child"])
    try:
        import os

        assert profiling.find_child(os.getpid(), "marker-for-find-child") == proc.pid
        assert profiling.find_child(os.getpid(), "marker-for-find-child", "absent-needle") is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(profiling.find_pyspy()[0] is None, reason="no py-spy (PATH or .gpuextra's wheel)")
def test_a_busy_process_is_sampled_and_summarized(tmp_path: Path) -> None:
    code = "def spin_here():\n    while True:\n        sum(i * i for i in range(1000))\nspin_here()\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.3)  # the interpreter is up
        sampler = profiling.Sampler(tmp_path, 2)
        sampler.start({"spinner": proc.pid})
        res = sampler.finish()["spinner"]
    finally:
        proc.kill()
        proc.wait()
    if "error" in res and "ptrace" in res["error"].lower():
        pytest.skip(f"no ptrace rights here: {res['error']}")
    assert res["samples"] > 0
    assert any("spin_here" in f for f, _ in res["top_cum"])
    assert res["cpu_s"] > 0
    assert "spin_here" in (tmp_path / "profile-spinner.txt").read_text()
    assert "spin_here" in (tmp_path / "profile-spinner-dump.txt").read_text()


def test_categories_match_the_file_names_py_spy_prints() -> None:
    from bench.episodes import _category

    # py-spy prints a file by its package part, without the leading "/" of the full path
    assert _category("agent (bench/gpu_episodes.py);create_default_context (ssl.py)") == "the openai SDK agent"
    assert _category("x (rollpool/workers/episodes/server.py);dumps (json/__init__.py)") == "JSON"
    assert _category("run (asyncio/runners.py);select (selectors.py)") == "asyncio scheduling and sockets"


def test_native_stacks_tell_cpu_from_waits_and_count_waits_for_the_gil() -> None:
    raw = "\n".join([
        "main (m.py);run (asyncio/runners.py);epoll_wait (libc.so.6) 50",  # the loop idle
        "Thread.run (threading.py);_worker (m.py);PyThread_acquire_lock_timed (libpython3.11.so.1.0);0x7f00 (libc.so.6) 20",
        "lane (m.py);_queue_SimpleQueue_get_impl (_queuemodule.c);pthread_cond_timedwait (libc.so.6);0x7f00 (libc.so.6) 10",
        "main (m.py);Episode.chat (rollpool/workers/episodes/episode.py);pthread_cond_wait (libc.so.6);0x7f01 (libc.so.6) 3",
        "lane (m.py);encode (tokenizers/tokenizers.abi3.so);pthread_cond_timedwait (libc.so.6) 1",
        "main (m.py);Episode.chat (rollpool/workers/episodes/episode.py) 6",
    ])
    s = profiling.summarize_raw(raw)
    assert (s["samples"], s["idle_samples_left_out"], s["gil_wait_samples"]) == (6, 80, 4)
    assert s["gil_wait_share"] == 0.4
    assert s["top_gil_wait"][0] == ["Episode.chat (rollpool/workers/episodes/episode.py)", 0.75]
    assert s["top_self"] == [["Episode.chat (rollpool/workers/episodes/episode.py)", 1.0]]
