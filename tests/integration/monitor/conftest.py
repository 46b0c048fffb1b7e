"""Factories for monitoring tests: sinks and readers on a fresh pool name, closed at teardown."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from rollpool.monitor.reader import PoolReader
from rollpool.monitor.sink import RedisMetricsSink


@pytest.fixture
def pool() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def make_sink(redis_server: str, pool: str) -> Iterator[Callable[..., RedisMetricsSink]]:
    made: list[RedisMetricsSink] = []

    def make(url: str | None = None, **options: Any) -> RedisMetricsSink:
        options.setdefault("flush_interval_s", 0.05)
        sink = RedisMetricsSink(url or redis_server, options.pop("pool", pool), **options)
        made.append(sink)
        return sink

    yield make
    for sink in made:
        sink.close()


@pytest.fixture
def client(redis_server: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    yield r
    r.close()


@pytest.fixture
def reader(redis_server: str, pool: str) -> Iterator[PoolReader]:
    with PoolReader(redis_server, pool) as r:
        yield r


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def populate(sink: RedisMetricsSink) -> None:
    """A small pool: a broker, two workers, events and staleness samples."""
    sink.publish_state(
        "broker",
        "broker",
        {"epoch": "a1b2", "version": 4, "queued": 17, "leased": 6, "held": 2, "dispatched": 40, "completed": 33,
         "requeued": 3, "duplicates": 0, "failed": 1, "dropped_stale": 2, "workers_alive": 2},
    )
    for i, version in ((1, 4), (2, 3)):
        sink.publish_state(
            "worker",
            f"w{i}",
            {"host": "hostA", "pid": 100 + i, "engine": "sim", "model": "tiny", "weight_version": version,
             "state": "generating", "inflight": 3, "credits": 1, "tokens_total": 1000 * i,
             "tokens_per_s": 250.0 * i, "last_seen": time.time()},
            ttl_s=30,
        )
    sink.event("worker_joined", {"worker": "w1"})
    sink.event("task_requeued", {"task_id": "p7@1", "reason": "worker_lost"})
    for v in (0, 0, 1, 2, 5):
        sink.observe("staleness", v)
