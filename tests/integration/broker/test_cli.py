"""`python -m rollpool.broker` serves and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import zmq

from rollpool import protocol as p
from tests.conftest import free_tcp_port

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_sigterm_stops_the_broker_with_exit_0() -> None:
    wport, cport = free_tcp_port(), free_tcp_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollpool.broker", "--worker-endpoint", f"tcp://127.0.0.1:{wport}",
         "--client-endpoint", f"tcp://127.0.0.1:{cport}", "--drain-timeout-s", "0"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    ctx = zmq.Context()
    try:
        sock = p.SocketFactory(ctx).dealer(f"tcp://127.0.0.1:{cport}")
        sock.send_multipart(p.encode(p.StatusRequest(request_id="s")))
        assert sock.poll(20_000), "broker did not answer"
        reply = p.decode(sock.recv_multipart())
        assert isinstance(reply, p.StatusReply) and reply.counters["workers_alive"] == 0
        sock.close(linger=0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        ctx.destroy(linger=0)
        time.sleep(0)
