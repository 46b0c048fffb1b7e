"""Every subcommand maps a bad configuration to exit status 2 and one line on stderr naming the field
(rollpool.cli.main owns the mapping), before any socket, engine or child process starts."""

from __future__ import annotations

import pathlib
import socket

import pytest

from rollpool.cli import main


@pytest.mark.parametrize(
    "argv, names",
    [
        (["broker", "--max-staleness", "-1"], "BrokerConfig.max_staleness"),
        (["broker", "--worker-endpoint", "nowhere"], "BrokerConfig.worker_endpoint"),
        (["worker", "--episode", "no_such_pkg.mod:fn"], "no_such_pkg.mod:fn"),
        (["relay"], "RelayConfig.upstream is required"),
        (["relay", "--upstream", "tcp://127.0.0.1:1", "--keep-versions", "0"], "RelayConfig.keep_versions"),
        (["launch", "local", "--workers", "0"], "LocalLaunchConfig.workers"),
        (["worker", "--engine", "vllm"], "unknown engine 'vllm'; known: hf, sglang, sim"),
        (["worker", "--engine", "hf", "--model", "/no/such/model"], "model directory '/no/such/model' does not exist"),
        (["launch", "local", "--engine", "vllm"], "unknown engine 'vllm'"),
        (["launch", "local", "--engine", "hf", "--model", "/no/such/model"], "model directory '/no/such/model' does not exist"),
    ],
    ids=["broker-staleness", "broker-endpoint", "worker-episode", "relay-no-upstream", "relay-keep", "launch-workers",
         "worker-engine", "worker-model", "launch-engine", "launch-model"],
)
def test_a_bad_configuration_exits_2_with_the_field_on_stderr(argv: list[str], names: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert names in err
    assert err.startswith(f"rollpool {argv[0]}: error: ")
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["broker", "--worker-endpoint", "{busy}"], ["broker", "--client-endpoint", "{busy}"],
                                  ["launch", "local", "--worker-endpoint", "{busy}", "--log-dir", "{logs}"],
                                  ["launch", "local", "--client-endpoint", "{busy}", "--log-dir", "{logs}"]],
                         ids=["broker-worker", "broker-client", "launch-worker", "launch-client"])
def test_an_endpoint_in_use_is_refused_before_anything_starts(argv: list[str], tmp_path: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as held:  # something already listens on the port (another broker, say)
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = f"tcp://127.0.0.1:{held.getsockname()[1]}"
        logs = tmp_path / "logs"
        argv = [a.format(busy=busy, logs=logs) for a in argv]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rollpool {argv[0]}: error: ") and busy in err and "cannot be bound" in err
    assert len(err.strip().splitlines()) == 1
    assert not logs.exists()  # nothing was started (no child, no log folder)


@pytest.mark.parametrize("argv", [["launch", "local", "--log-level", "DEBUG"], ["launch", "--log-level", "DEBUG", "local"],
                                  ["--log-level", "DEBUG", "launch", "local"], ["--log-level", "DEBUG", "broker"]])
def test_launch_local_takes_the_log_level_where_every_subcommand_does(argv: list[str]) -> None:
    from rollpool.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.log_level == "DEBUG" and getattr(args, "launcher", "local") == "local"
