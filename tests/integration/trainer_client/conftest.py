"""Real processes for client tests: a broker (restartable on the same endpoints) and sim workers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest


@dataclass
class Pool:
    dir: str
    worker_ep: str
    client_ep: str
    broker_args: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start_broker(self) -> None:
        self._start("broker", ["rollpool.broker", "--worker-endpoint", self.worker_ep, "--client-endpoint", self.client_ep,
                               "--heartbeat-interval-s", "0.2", "--log-level", "INFO", *self.broker_args])

    def kill_broker(self) -> None:
        proc = self.procs["broker"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def start_sim_workers(self, count: int = 4, options: str = "decode_s_per_token=0.0005,length_median=8,capacity=16") -> None:
        self._start("workers", ["rollpool.workers", "--broker", self.worker_ep, "--engine", "sim", "--count", str(count),
                                "--worker-id", "sim", "--heartbeat-interval-s", "0.2", "--engine-options", options,
                                "--log-level", "INFO"])

    def start_hf_worker(self, model: str, worker_id: str = "hf0") -> None:
        self._start(worker_id, ["rollpool.workers", "--broker", self.worker_ep, "--engine", "hf", "--model", model,
                                "--worker-id", worker_id, "--heartbeat-interval-s", "0.2", "--log-level", "INFO"])

    def stop(self) -> None:
        # workers first (they say goodbye to a live broker), then the broker
        for name in sorted(self.procs, key=lambda n: n == "broker"):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def logs(self) -> str:
        out = []
        for name in self.procs:
            path = os.path.join(self.dir, f"{name}.log")
            if os.path.exists(path):
                out.append(f"--- {name}\n" + open(path).read()[-3000:])
        return "\n".join(out)


@pytest.fixture
def pool_factory() -> Iterator[object]:
    pools: list[Pool] = []

    def make(broker_args: list[str] | None = None) -> Pool:
        d = tempfile.mkdtemp(prefix="rp-tc-", dir="/tmp")
        p = Pool(dir=d, worker_ep=f"ipc://{d}/w", client_ep=f"ipc://{d}/c", broker_args=broker_args or [])
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.stop()
        shutil.rmtree(p.dir, ignore_errors=True)
