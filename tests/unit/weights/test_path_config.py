"""`WeightPathConfig` and the relay's flags: the path, the stream count and the page-locked budget, validated by name."""

from __future__ import annotations

import argparse

import pytest

from rollpool.cli.relay import add_arguments
from rollpool.protocol.config import load_config
from rollpool.protocol.errors import ConfigError
from rollpool.weights.config import RelayConfig, WeightPathConfig, default_streams, weight_streams


def parse(*argv: str) -> RelayConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return load_config(RelayConfig, p.parse_args(list(argv)), section="relay")


def test_flags_and_environment_set_the_weight_path(monkeypatch: pytest.MonkeyPatch) -> None:
    c = parse("--upstream", "tcp://t:1", "--weight-path", "network", "--weight-streams", "3", "--pinned-budget-bytes", "1024")
    assert (c.weight_path, c.streams, c.pinned_budget_bytes) == ("network", 3, 1024)
    monkeypatch.setenv("ROLLPOOL_WEIGHT_PATH", "shm")
    c = parse("--upstream", "tcp://t:1")
    assert c.weight_path == "shm" and c.streams == default_streams() and c.pinned_budget_bytes is None
    assert c.subscriber_kwargs() == {"path": "shm", "streams": default_streams(), "pinned_budget_bytes": None}


def test_the_streams_variable_reaches_the_relay_as_it_reaches_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """`weight_streams` 0 (the flag's default) is automatic: ROLLPOOL_WEIGHT_STREAMS, else the default, for the relay's
    config as for `weight_streams()` (the worker's); 0 given to `weight_streams` is automatic too, not an error."""
    monkeypatch.delenv("ROLLPOOL_WEIGHT_STREAMS", raising=False)
    assert weight_streams(0) == weight_streams(None) == default_streams()
    monkeypatch.setenv("ROLLPOOL_WEIGHT_STREAMS", "6")
    assert weight_streams(0) == weight_streams() == 6
    assert parse("--upstream", "tcp://t:1").streams == 6
    assert parse("--upstream", "tcp://t:1", "--weight-streams", "3").streams == 3


@pytest.mark.parametrize(("kw", "field"), [({"weight_path": "nfs"}, "weight_path"), ({"weight_streams": 17}, "weight_streams"),
                                           ({"pinned_budget_bytes": -1}, "pinned_budget_bytes")])
def test_bad_values_name_their_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        WeightPathConfig(**kw)  # type: ignore[arg-type]


def test_the_relay_flags_reach_its_upstream_subscriber_budget_included(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")  # a real relay
    import zmq.asyncio

    from rollpool.cli.relay import make_relay
    from rollpool.protocol.sockets import SocketFactory

    monkeypatch.delenv("ROLLPOOL_PINNED_BUDGET_BYTES", raising=False)
    ctx = zmq.asyncio.Context()
    try:
        relay = make_relay(parse("--upstream", "tcp://t:1", "--weight-path", "network", "--weight-streams", "3",
                                 "--pinned-budget-bytes", "1024"), SocketFactory(ctx))
        up = relay.upstream
        assert (up.path, up.streams, up.pinned_budget_bytes) == ("network", 3, 1024)
        up.close()
    finally:
        ctx.destroy(linger=0)
