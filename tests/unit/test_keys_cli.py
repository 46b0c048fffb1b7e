"""`rollpool keys`: one key set per role, what each host is shipped, migration from one key set (files only)."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from rollpool.cli import keys as keys_cli
from rollpool.protocol import SecurityConfig
from rollpool.protocol.errors import ConfigError


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    keys_cli.add_arguments(parser)
    return keys_cli.run(parser.parse_args(list(argv)))


def test_gen_writes_a_pair_per_role_and_prints_what_to_ship(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "keys"
    assert _run("gen", str(d), "--add", "worker:node7") == 0
    out = capsys.readouterr().out
    assert "worker host" in out and "server.key  worker.key  worker.key_secret" in out
    for role in ("trainer", "worker", "relay"):
        assert (d / f"{role}.key").exists() and (d / "allowed" / role / f"{role}.key").exists()
        assert stat.S_IMODE(os.stat(d / f"{role}.key_secret").st_mode) == 0o600
    assert (d / "allowed" / "worker" / "worker-node7.key").exists()
    assert not (d / "allowed_clients").exists() and not (d / "client.key").exists()
    assert _run("gen", str(d), "--add", "nope") == 2


def test_export_copies_only_the_hosts_files(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    keys_cli.generate(str(d))
    assert _run("export", str(d), "worker", str(tmp_path / "w")) == 0
    got = sorted(str(p.relative_to(tmp_path / "w")) for p in (tmp_path / "w").rglob("*") if p.is_file())
    assert got == ["server.key", "worker.key", "worker.key_secret"]
    sec = SecurityConfig.from_dir(str(tmp_path / "w"))  # the role is the one pair present
    assert sec is not None and sec.client_key_file == str(tmp_path / "w" / "worker.key_secret")
    with pytest.raises(ConfigError, match="unknown role"):
        SecurityConfig.from_dir(str(d), role="admin")


def test_migrate_needs_a_pre_roles_directory_and_finish_retires_it(tmp_path: Path) -> None:
    import zmq.auth

    assert _run("migrate", str(tmp_path / "missing")) == 2
    legacy = tmp_path / "legacy"
    (legacy / "allowed_clients").mkdir(parents=True)
    zmq.auth.create_certificates(str(legacy), "server")
    pub, _ = zmq.auth.create_certificates(str(legacy), "client")
    os.replace(pub, legacy / "allowed_clients" / "client.key")
    assert _run("migrate", str(legacy)) == 0
    for role in ("trainer", "worker", "relay"):
        assert (legacy / "allowed" / role / "legacy-client.key").exists()  # old hosts still admitted
    assert _run("migrate", str(legacy), "--finish") == 0
    assert not any((legacy / "allowed").rglob("legacy-*")) and (legacy / "allowed_clients.retired").is_dir()
