"""Every subcommand maps a bad configuration to exit status 2 and one line on stderr naming the field
(rollpool.cli.main owns the mapping), before any socket, engine or child process starts."""

from __future__ import annotations

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
    ],
    ids=["broker-staleness", "broker-endpoint", "worker-episode", "relay-no-upstream", "relay-keep", "launch-workers"],
)
def test_a_bad_configuration_exits_2_with_the_field_on_stderr(argv: list[str], names: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert names in err
    assert err.startswith(f"rollpool {argv[0]}: error: ")
    assert "Traceback" not in err
