"""Config loading (flags > env > TOML > defaults) and structured logging."""

from __future__ import annotations

import argparse
import io
import json
import logging
from dataclasses import dataclass, field

import pytest

from rollpool.protocol import ConfigError
from rollpool.protocol.config import add_config_arguments, load_config
from rollpool.protocol.logs import RateLimitedLog, configure_logging, log_fields


@dataclass(frozen=True)
class DemoConfig:
    port: int = 5555
    heartbeat_interval_s: float = 1.0
    name: str | None = None
    tags: tuple[str, ...] = ()
    verbose: bool = False
    limit: int = field(default=3, metadata={"help": "a limit"})

    def __post_init__(self) -> None:
        if self.port < 1:
            raise ConfigError(f"port must be >= 1, got {self.port}")


def test_precedence_defaults_toml_env_flags(tmp_path) -> None:  # type: ignore[no-untyped-def]
    toml = tmp_path / "c.toml"
    toml.write_text('[x]\nport = 10\nheartbeat-interval-s = 2.5\ntags = ["a", "b"]\n')
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, DemoConfig)
    args = parser.parse_args(["--port", "30", "--verbose"])
    cfg = load_config(DemoConfig, args, toml_path=str(toml), section="x", environ={"ROLLPOOL_PORT": "20", "ROLLPOOL_NAME": "n"})
    assert cfg == DemoConfig(port=30, heartbeat_interval_s=2.5, name="n", tags=("a", "b"), verbose=True)
    cfg = load_config(DemoConfig, parser.parse_args([]), toml_path=str(toml), section="x", environ={"ROLLPOOL_PORT": "20"})
    assert cfg.port == 20


def test_bad_values_name_the_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="ROLLPOOL_PORT"):
        load_config(DemoConfig, environ={"ROLLPOOL_PORT": "many"})
    with pytest.raises(ConfigError, match="port must be >= 1"):
        load_config(DemoConfig, environ={}, port=0)
    toml = tmp_path / "c.toml"
    toml.write_text("[x]\nnope = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        load_config(DemoConfig, toml_path=str(toml), section="x", environ={})


def test_json_logs_carry_structured_ids() -> None:
    buf = io.StringIO()
    configure_logging("INFO", json_lines=True, stream=buf)
    try:
        with log_fields(pool="p1", worker_id="w3"):
            logging.getLogger("rollpool.test").info("lease %s expired", "t1", extra={"prompt_id": "q9"})
        line = json.loads(buf.getvalue().strip().splitlines()[-1])
        assert line["msg"] == "lease t1 expired"
        assert (line["pool"], line["worker_id"], line["prompt_id"]) == ("p1", "w3", "q9")
    finally:
        configure_logging("WARNING")


def test_rate_limited_log_once_per_period() -> None:
    log = RateLimitedLog(logging.getLogger("rollpool.test.rl"), period_s=60)
    assert log.warning("peer-a", "bad frame", now=0.0)
    assert not log.warning("peer-a", "bad frame", now=30.0)
    assert log.warning("peer-b", "bad frame", now=30.0)
    assert log.warning("peer-a", "bad frame", now=61.0)


def test_http_clients_per_request_lines_stay_out_of_an_info_log() -> None:
    """An episode's SDK agent (httpx) logs each request at INFO: at level INFO the worker's log does not carry them."""
    buf = io.StringIO()
    configure_logging("INFO", stream=buf)
    try:
        logging.getLogger("httpx").info('HTTP Request: POST http://127.0.0.1/v1/chat/completions "HTTP/1.1 200 OK"')
        logging.getLogger("httpx").warning("a warning still shows")
        logging.getLogger("rollpool.test").info("our own INFO still shows")
        out = buf.getvalue()
        assert "HTTP Request" not in out
        assert "a warning still shows" in out and "our own INFO still shows" in out
        configure_logging("DEBUG", stream=buf)
        logging.getLogger("httpx").info("HTTP Request at DEBUG")
        assert "HTTP Request at DEBUG" in buf.getvalue()
    finally:
        configure_logging("WARNING")
