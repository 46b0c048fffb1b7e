"""`WeightPathConfig` and the relay's flags: the path, the stream count and the page-locked budget, validated by name."""

from __future__ import annotations

import argparse

import pytest

from rollpool.cli.relay import add_arguments
from rollpool.protocol.config import load_config
from rollpool.protocol.errors import ConfigError
from rollpool.weights.config import RelayConfig, WeightPathConfig, default_streams


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
    assert c.path_config() == WeightPathConfig(weight_path="shm")


def test_the_streams_variable_reaches_the_relay_as_it_reaches_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """`weight_streams` 0 (the flag's default) is automatic; ROLLPOOL_WEIGHT_STREAMS sets it when the config is loaded,
    for the relay's config as for the worker's and for a facade made without one (`WeightPathConfig.from_env`)."""
    monkeypatch.delenv("ROLLPOOL_WEIGHT_STREAMS", raising=False)
    assert WeightPathConfig().streams == WeightPathConfig.from_env().streams == default_streams()
    monkeypatch.setenv("ROLLPOOL_WEIGHT_STREAMS", "6")
    assert WeightPathConfig.from_env().streams == 6 and WeightPathConfig().streams == default_streams()
    assert parse("--upstream", "tcp://t:1").streams == 6
    assert parse("--upstream", "tcp://t:1", "--weight-streams", "3").streams == 3


@pytest.mark.parametrize(("kw", "field"), [({"weight_path": "nfs"}, "weight_path"), ({"weight_streams": 17}, "weight_streams"),
                                           ({"pinned_budget_bytes": -1}, "pinned_budget_bytes"),
                                           ({"weight_reserve_bytes": -1}, "weight_reserve_bytes"),
                                           ({"weight_copy_threads": 65}, "weight_copy_threads")])
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


def test_every_weight_knob_is_a_field_read_once_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables that library code used to read in the middle of a fetch are fields now, read when the config is
    loaded: by the worker's and the client's configs, nested and flat on the command line, and by `from_env`."""
    from rollpool.trainer_client.client import TrainerClientConfig
    from rollpool.workers.config import WorkerConfig

    env = {"ROLLPOOL_WEIGHT_BULK": "0", "ROLLPOOL_WEIGHT_RESERVE_BYTES": "4096", "ROLLPOOL_WEIGHT_SHM_TO_DEVICE": "off",
           "ROLLPOOL_WEIGHT_COPY_THREADS": "3", "ROLLPOOL_WEIGHT_PATH": "network", "ROLLPOOL_PINNED_BUDGET_BYTES": "0"}
    want = WeightPathConfig(weight_path="network", pinned_budget_bytes=0, weight_bulk=False, weight_reserve_bytes=4096,
                            weight_shm_to_device=False, weight_copy_threads=3)
    assert WeightPathConfig.from_env(env) == want and want.copy_threads == 3
    assert load_config(WorkerConfig, {}, environ=env).weights == want
    assert load_config(TrainerClientConfig, {}, environ=env).weights == want
    flags = load_config(WorkerConfig, {"weight_path": "shm", "weight_bulk": True}, environ=env).weights
    assert (flags.weight_path, flags.weight_bulk, flags.weight_reserve_bytes) == ("shm", True, 4096)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    made = WorkerConfig()  # made in code: its weights are read from the environment once, now
    for name in env:
        monkeypatch.delenv(name)
    assert made.weights == want
