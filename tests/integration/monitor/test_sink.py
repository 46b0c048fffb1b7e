"""`RedisMetricsSink` against a real Redis-compatible server: keys, TTLs, bounds, batching, outages."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest
import redis

from rollpool.monitor.embedded import EmbeddedRedis
from rollpool.monitor.reader import PoolReader
from rollpool.monitor.sink import RedisMetricsSink, sink_from_url
from rollpool.protocol.metrics import MetricsSink, NullMetricsSink
from tests.integration.monitor.conftest import populate, wait_until

pytestmark = pytest.mark.redis

Make = Callable[..., RedisMetricsSink]


def test_it_is_a_metrics_sink_and_no_url_means_no_monitoring(make_sink: Make) -> None:
    assert isinstance(make_sink(), MetricsSink)
    assert isinstance(sink_from_url(None), NullMetricsSink)
    assert isinstance(sink_from_url(""), NullMetricsSink)


def test_states_land_under_the_pool_keys_with_their_ttl(make_sink: Make, client: redis.Redis, pool: str) -> None:
    sink = make_sink()
    sink.publish_state("broker", "broker", {"epoch": "0123", "version": 3, "queued": 5})
    sink.publish_state("worker", "w1", {"host": "h", "state": "idle", "tokens_per_s": 12.5}, ttl_s=30)
    sink.publish_state("worker", "w1", {"host": "h", "state": "generating", "tokens_per_s": 40.0}, ttl_s=30)
    assert sink.flush()
    broker = client.hgetall(f"rollpool:{pool}:broker")
    assert broker["epoch"] == "0123" and broker["version"] == "3" and broker["queued"] == "5"
    assert client.pttl(f"rollpool:{pool}:broker") == -1
    worker = client.hgetall(f"rollpool:{pool}:worker:w1")
    assert worker["state"] == "generating" and worker["tokens_per_s"] == "40.0"  # the newest state replaces the old
    assert 25_000 < client.pttl(f"rollpool:{pool}:worker:w1") <= 30_000


def test_a_worker_that_stops_publishing_expires(make_sink: Make, reader: PoolReader) -> None:
    sink = make_sink()
    sink.publish_state("worker", "short", {"state": "idle"}, ttl_s=0.3)
    sink.publish_state("worker", "long", {"state": "idle"}, ttl_s=30)
    assert sink.flush()
    assert set(reader.snapshot().workers) == {"short", "long"}
    assert wait_until(lambda: set(reader.snapshot().workers) == {"long"}, timeout_s=5)


def test_the_events_stream_is_bounded(make_sink: Make, client: redis.Redis, pool: str) -> None:
    sink = make_sink(events_maxlen=100)
    for i in range(2000):
        sink.event("task_requeued", {"task_id": f"p{i}@1"})
    assert sink.flush()
    length = client.xlen(f"rollpool:{pool}:events")
    assert 100 <= length <= 300  # MAXLEN ~ trims whole stream nodes (100 entries each by default)
    newest = client.xrevrange(f"rollpool:{pool}:events", count=1)[0][1]
    assert newest["task_id"] == "p1999@1" and newest["kind"] == "task_requeued"


def test_the_staleness_histogram_counts(make_sink: Make, reader: PoolReader) -> None:
    sink = make_sink()
    for v in (0, 0, 1, 3, 3, 3, 100):
        sink.observe("staleness", v)
    sink.observe("staleness", float("nan"))  # ignored, not raised
    assert sink.flush()
    hist = reader.snapshot().histograms["staleness"]
    counts = dict(hist.buckets)
    assert (counts[0], counts[1], counts[2], counts[3], counts[float("inf")]) == (2, 1, 0, 3, 1)
    assert hist.count == 7 and hist.sum == 110
    assert hist.cumulative()[-1] == (float("inf"), 7)


def test_many_calls_become_few_round_trips(make_sink: Make, client: redis.Redis, reader: PoolReader) -> None:
    def execs() -> int:
        stats: dict[str, Any] = client.info("commandstats")
        return int(stats.get("cmdstat_exec", {}).get("calls", 0))

    sink = make_sink(flush_interval_s=0.2)
    before = execs()
    for i in range(500):
        sink.publish_state("worker", "w1", {"tokens_total": i}, ttl_s=30)
        sink.event("tick", {"i": i})
        sink.observe("staleness", i % 3)
    assert sink.flush()
    batches = execs() - before
    assert 1 <= batches <= 5, batches
    state = reader.snapshot(events=1000)
    assert state.workers["w1"]["tokens_total"] == 499
    assert len([e for e in state.events if e.kind == "tick"]) == 500
    assert state.histograms["staleness"].count == 500


def test_series_are_capped_lists(make_sink: Make, reader: PoolReader) -> None:
    sink = make_sink(series_interval_s=0.0, series_len=5)
    for i in range(12):
        sink.publish_state("broker", "broker", {"queued": i})
        sink.publish_state("worker", "w1", {"tokens_per_s": float(i), "host": "h"}, ttl_s=30)
    assert sink.flush()
    series = reader.snapshot(series=True).series
    assert [v for _, v in series["broker:queued"]] == [7, 8, 9, 10, 11]
    assert [v for _, v in series["worker:w1:tokens_per_s"]] == [7, 8, 9, 10, 11]


def test_a_full_buffer_drops_the_oldest_and_counts_it(redis_server: str) -> None:
    sink = RedisMetricsSink(redis_server, "unstarted", max_buffered=10, start=False)
    for i in range(25):
        sink.event("tick", {"i": i})
    stats = sink.stats()
    assert stats["dropped"] == 15 and stats["buffered"] == 10 and stats["enqueued"] == 25
    sink.close()


def test_bad_input_never_raises_into_the_caller(make_sink: Make, reader: PoolReader) -> None:
    sink = make_sink()
    sink.publish_state("worker", "has space", {"x": 1}, ttl_s=1)  # not a valid id: dropped, counted
    sink.publish_state("worker", "w1", {"obj": object(), 3: [1, 2]}, ttl_s=30)
    sink.publish_state("worker", "w2", None, ttl_s=30)  # type: ignore[arg-type]
    sink.observe("staleness", "x")  # type: ignore[arg-type]
    sink.event("e", {"nested": {"a": [1, 2]}})
    assert sink.flush()
    state = reader.snapshot()
    assert set(state.workers) == {"w1"} and state.workers["w1"]["3"] == [1, 2]
    assert state.events[-1].fields["nested"] == {"a": [1, 2]}
    assert sink.stats()["errors"] >= 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_redis_down_drops_the_oldest_and_reporting_resumes(pool: str) -> None:
    port = _free_port()
    server = EmbeddedRedis(port=port).start()
    sink = RedisMetricsSink(server.url, pool, flush_interval_s=0.05, socket_timeout_s=0.5,
                            min_backoff_s=0.05, max_backoff_s=0.3, max_buffered=1000)
    try:
        populate(sink)
        assert sink.flush()
        server.stop()

        for i in range(3000):  # more than the buffer holds: the oldest are dropped (that calls never wait: below)
            sink.publish_state("broker", "broker", {"epoch": "a1b2", "version": 5, "queued": i})
            sink.event("task_requeued", {"task_id": f"q{i}@1"})
            sink.observe("staleness", 1)
        assert wait_until(lambda: sink.stats()["failed_flushes"] >= 2 and not sink.stats()["connected"], timeout_s=5)

        server = EmbeddedRedis(port=port).start()  # same port, empty server
        with PoolReader(server.url, pool) as reader:
            def back() -> bool:
                s = reader.snapshot(events=5)
                return (
                    s.broker is not None
                    and s.broker["queued"] == 2999
                    and "staleness" in s.histograms
                    and s.histograms["staleness"].count >= 1
                    and bool(s.events)
                    and s.events[-1].fields.get("task_id") == "q2999@1"
                )

            assert wait_until(back, timeout_s=10), reader.snapshot(events=5)
            assert sink.stats()["dropped"] > 0  # the buffer overflowed during the outage: counted, not blocking
            assert wait_until(lambda: sink.stats()["connected"] is True, timeout_s=5)  # set by the writer after its EXEC returns
            sink.publish_state("worker", "w9", {"state": "idle"}, ttl_s=30)
            assert sink.flush()
            assert "w9" in reader.snapshot().workers
    finally:
        sink.close()
        server.stop()


class _BlackHole:
    """A TCP listener that accepts a connection and never answers: a Redis that hangs, not one that refuses."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.conn: socket.socket | None = None

    def wait_for_a_request(self) -> bytes:
        """Accept the sink's connection and read what it sent: its writer now waits for a reply that never comes."""
        self.listener.settimeout(10)
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(10)
        return self.conn.recv(65536)

    def close(self) -> None:  # the writer's read ends (connection reset), so its thread can finish
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def test_calls_never_wait_for_a_redis_that_does_not_answer(pool: str) -> None:
    """The writer thread is stuck in a round trip (socket timeout 300 s, beyond the test's own timeout); 9,000 calls
    still return, the buffer's oldest entries are dropped and counted, and the stuck round trip has neither
    succeeded nor failed yet: no call waited for the network."""
    hole = _BlackHole()
    sink = RedisMetricsSink(hole.url, pool, flush_interval_s=0.01, socket_timeout_s=300,
                            max_buffered=1000, close_timeout_s=0.5)
    try:
        sink.event("first", {})
        assert hole.wait_for_a_request()  # the writer sent its request and waits
        for i in range(3000):
            sink.publish_state("broker", "broker", {"queued": i})
            sink.event("task_requeued", {"task_id": f"q{i}@1"})
            sink.observe("staleness", 1)
        stats = sink.stats()
        assert stats["enqueued"] == 9001 and stats["dropped"] >= 9001 - 1000 - 1, stats
        assert stats["flushes"] == 0 and stats["failed_flushes"] == 0, stats  # the one round trip is still hanging
    finally:
        hole.close()
        sink.close()


def test_close_is_bounded_when_redis_hangs(pool: str) -> None:
    """close() gives up on the last flush after close_timeout_s: it returns while the writer is still stuck in a
    round trip that would take 300 s (beyond the test's own timeout) to fail."""
    hole = _BlackHole()
    sink = RedisMetricsSink(hole.url, pool, socket_timeout_s=300, close_timeout_s=0.5)
    try:
        for i in range(100):
            sink.event("tick", {"i": i})
        assert hole.wait_for_a_request()
        sink.close()
        assert sink._thread.is_alive()  # close returned without the writer: the hanging round trip did not hold it
        assert sink.stats()["flushes"] == 0 and sink.stats()["failed_flushes"] == 0
    finally:
        hole.close()
        sink._thread.join(10)
    assert not sink._thread.is_alive()


def test_close_is_bounded_when_redis_is_gone(pool: str) -> None:
    sink = RedisMetricsSink(f"redis://127.0.0.1:{_free_port()}/0", pool, socket_timeout_s=0.5, close_timeout_s=2.0)
    for i in range(100):
        sink.event("tick", {"i": i})
    sink.close()  # refused at once: the last flush fails fast and the writer ends
    assert not sink._thread.is_alive()


def test_within_the_buffer_bound_an_outage_loses_nothing(pool: str) -> None:
    port = _free_port()
    server = EmbeddedRedis(port=port).start()
    sink = RedisMetricsSink(server.url, pool, flush_interval_s=0.05, socket_timeout_s=0.5,
                            min_backoff_s=0.05, max_backoff_s=0.2)
    try:
        server.stop()
        for i in range(200):
            sink.event("task_requeued", {"task_id": f"p{i}@1"})
            sink.observe("staleness", i % 4)
        assert wait_until(lambda: sink.stats()["failed_flushes"] >= 1, timeout_s=5)
        server = EmbeddedRedis(port=port).start()
        assert sink.flush(timeout_s=10)
        with PoolReader(server.url, pool) as reader:
            state = reader.snapshot(events=1000)
        assert state.histograms["staleness"].count == 200
        assert [e.fields["task_id"] for e in state.events] == [f"p{i}@1" for i in range(200)]
        assert sink.stats()["dropped"] == 0
    finally:
        sink.close()
        server.stop()
