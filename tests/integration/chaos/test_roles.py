"""CURVE roles, tested as a matrix: every role's key against every server socket and message type.

Keys come from `rollpool keys gen`; each role's process gets only the files
`HOST_FILES` says to ship to its host. A cell passes when the handshake
completes and the message is served (no ``unexpected_type`` error for it);
only the cells the role table allows may pass, and every allowed cell must.
Real sockets, a real broker and real weight servers (publisher and relay).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from rollpool.broker import Broker, BrokerConfig
from rollpool.cli.keys import add_key, finish_migration, generate, migrate
from rollpool.protocol import SecurityConfig, SocketFactory, decode, encode
from rollpool.protocol import messages as m
from rollpool.protocol.roles import HOST_FILES, ROLES, SERVER_SOCKETS
from rollpool.weights.serving import WeightServer
from tests.unit.protocol.samples import samples

pytestmark = pytest.mark.chaos

# every type a peer may send to a server (what servers send back is not in any accept set)
SENT_TYPES = sorted(set().union(*(s.accepts for s in SERVER_SOCKETS.values())))


def _host_dir(pool: Path, host: str, dest: Path) -> Path:
    """Copy only what `rollpool keys gen` says to ship to `host`."""
    dest.mkdir(parents=True)
    for item in HOST_FILES[host]:
        src = pool / item
        if item.endswith("/"):
            shutil.copytree(src, dest / item)
        else:
            shutil.copy(src, dest / item)
    return dest


def _message(type_name: str) -> Any:
    s = samples()
    msgs = {
        "hello": m.Hello(worker_id="matrix", protocol_min=1, protocol_max=1, engine="sim", capacity=1, credits=0),
        "credit": m.Credit(credits=0),
        "result": s["result"],
        "result_batch": m.ResultBatch(results=(s["result"],)),
        "worker_heartbeat": m.WorkerHeartbeat(worker_id="matrix"),
        "nack": m.Nack(task_ids=("t-none",)),
        "goodbye": m.Goodbye(reason="matrix"),
        "control_reply": m.ControlReply(request_id="none", ok=True),
        "apply_request": m.ApplyRequest(version=0),
        "apply_done": m.ApplyDone(version=0, ok=True),
        "turn_records": m.TurnRecords(task_id="t-none", prompt_id="none", turns=()),
        "turn_record_batch": m.TurnRecordBatch(records=(m.TurnRecords(task_id="t-none", prompt_id="none", turns=()),)),
        "client_hello": m.ClientHello(client_id="matrix", protocol_min=1, protocol_max=1),
        "submit": s["submit"],
        "pull": m.Pull(request_id="r", max_groups=1, wait_s=0.0),
        "ack": m.Ack(prompt_ids=("none",)),
        "set_version": m.SetVersion(request_id="v", version=0),
        "status_request": m.StatusRequest(request_id="s"),
        "control": m.Control(request_id="c", op="flush_cache", timeout_s=0.5),
        "cancel_prompts": m.CancelPrompts(request_id="x", prompt_ids=("none",)),
        "manifest_request": m.ManifestRequest(request_id="mr"),
        "fetch": m.Fetch(request_id="f", version=0, bucket=0, offset=0, nbytes=16),
    }
    assert set(msgs) == set(SENT_TYPES)
    return msgs[type_name]


def _probe(server: str) -> tuple[Any, type]:
    """A request that the socket always answers, to know every earlier reply has arrived."""
    if server == "broker.worker":
        return m.Hello(worker_id="", protocol_min=1, protocol_max=1, engine="sim", capacity=1, credits=0), m.Error
    if server == "broker.client":
        return m.StatusRequest(request_id="probe"), m.StatusReply
    return m.ManifestRequest(request_id="probe"), m.Manifest


async def _handshake(sock: Any, timeout_s: float = 5.0) -> bool:
    """True when the CURVE handshake succeeded, False when the server refused the key."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        from zmq.utils.monitor import parse_monitor_message

        while await mon.poll(int(timeout_s * 1000)):
            ev = parse_monitor_message(await mon.recv_multipart())
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return True
            if ev["event"] in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                return False
        raise AssertionError("no handshake outcome within the timeout")
    finally:
        sock.disable_monitor()
        mon.close(linger=0)


async def _served(sock: Any, server: str, type_name: str) -> bool:
    """Send one message of `type_name`, then the probe; False if the socket refused the type."""
    await sock.send_multipart(encode(_message(type_name)))
    probe, expect = _probe(server)
    await sock.send_multipart(encode(probe))
    refused = False
    while True:
        assert await sock.poll(5000), f"{server}: no answer to the probe after {type_name}"
        reply = decode(await sock.recv_multipart())
        if isinstance(reply, m.Error) and reply.code == "unexpected_type" and reply.ref_type == type_name:
            refused = True
        elif isinstance(reply, expect) and (
            reply.ref_type == "hello" and reply.code == "invalid" if expect is m.Error else reply.request_id == "probe"
        ):
            return not refused


class Servers:
    def __init__(self, pool: Path, tmp: Path) -> None:
        # one context per server process, as deployed (a context has one ZAP handler)
        self.ctxs = [zmq.asyncio.Context() for _ in range(3)]
        self.broker_sockets = SocketFactory(self.ctxs[0], security=SecurityConfig.from_dir(str(_host_dir(pool, "broker", tmp / "broker-host"))))
        self.trainer_sockets = SocketFactory(self.ctxs[1], security=SecurityConfig.from_dir(str(_host_dir(pool, "trainer", tmp / "trainer-host")), role="trainer"))
        self.relay_sockets = SocketFactory(self.ctxs[2], security=SecurityConfig.from_dir(str(_host_dir(pool, "relay", tmp / "relay-host")), role="relay"))
        self.broker = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*"), self.broker_sockets)
        self.publisher = WeightServer(self.trainer_sockets, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", name="publisher")
        self.relay = WeightServer(self.relay_sockets, router_endpoint="tcp://127.0.0.1:*", pub_endpoint="tcp://127.0.0.1:*", name="relay")
        self.task: asyncio.Task[None] | None = None
        self.started: list[WeightServer] = []

    async def start(self) -> dict[str, str]:
        self.task = asyncio.create_task(self.broker.run())
        await asyncio.wait_for(self.broker.ready.wait(), 5)
        await self.publisher.start()
        self.started.append(self.publisher)
        await self.relay.start()
        self.started.append(self.relay)
        assert self.publisher.pub_endpoint and self.relay.pub_endpoint
        return {
            "broker.worker": self.broker.worker_endpoint,
            "broker.client": self.broker.client_endpoint,
            "publisher.router": self.publisher.router_endpoint,
            "publisher.pub": self.publisher.pub_endpoint,
            "relay.router": self.relay.router_endpoint,
            "relay.pub": self.relay.pub_endpoint,
        }

    async def close(self) -> None:
        self.broker.stop()
        if self.task is not None:
            await asyncio.wait_for(self.task, 10)
        for ws in self.started:
            await ws.close()
        for f in (self.broker_sockets, self.trainer_sockets, self.relay_sockets):
            f.close()
        for c in self.ctxs:
            c.destroy(linger=0)


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    generate(str(tmp_path / "pool"))
    return tmp_path / "pool"


async def test_role_matrix_only_the_allowed_cells_pass(pool: Path, tmp_path: Path) -> None:
    servers = Servers(pool, tmp_path)
    client_ctx = zmq.asyncio.Context()
    got: dict[tuple[str, str, str], bool] = {}
    try:
        endpoints = await servers.start()
        for role in ROLES:
            sec = SecurityConfig.from_dir(str(_host_dir(pool, role, tmp_path / f"{role}-client")))  # role inferred from the files
            factory = SocketFactory(client_ctx, security=sec)
            for server, endpoint in endpoints.items():
                sock = factory.sub(None) if server.endswith(".pub") else factory.dealer(None, identity=os.urandom(8))
                try:
                    mon_task = asyncio.ensure_future(_handshake(sock))
                    await asyncio.sleep(0)
                    sock.connect(endpoint)
                    admitted = await mon_task
                    for t in SENT_TYPES:
                        if not admitted or server.endswith(".pub"):
                            got[(role, server, t)] = False
                        else:
                            got[(role, server, t)] = await _served(sock, server, t)
                    got[(role, server, "handshake")] = admitted
                finally:
                    sock.close(linger=0)
            factory.close()
        expected = {}
        for role in ROLES:
            for server, spec in SERVER_SOCKETS.items():
                expected[(role, server, "handshake")] = role in spec.admits
                for t in SENT_TYPES:
                    expected[(role, server, t)] = role in spec.admits and t in spec.accepts
        wrong = sorted(k for k in expected if got.get(k) != expected[k])
        passed = sum(got.values())
        print(f"role matrix: {len(got)} cells, {passed} pass, {len(got) - passed} refused, {len(wrong)} wrong")
        assert not wrong, [(k, got.get(k)) for k in wrong][:40]
        # the refusals were counted by role and socket, and reach the status counters `rollpool top` shows
        counters = servers.broker.counters()
        assert counters.get("refused.role.worker@broker.client", 0) >= 1
        assert counters.get("refused.role.trainer@broker.worker", 0) >= 1
        assert counters.get("refused.limit.message_type", 0) >= 1
    finally:
        await servers.close()
        client_ctx.destroy(linger=0)


async def test_worker_host_files_cannot_pull_ack_or_set_version(pool: Path, tmp_path: Path) -> None:
    """Break 1: with only a worker host's files one could pull the trainer's groups and send SetVersion(1e9)."""
    servers = Servers(pool, tmp_path)
    client_ctx = zmq.asyncio.Context()
    try:
        endpoints = await servers.start()
        worker_files = SecurityConfig.from_dir(str(_host_dir(pool, "worker", tmp_path / "stolen")))
        factory = SocketFactory(client_ctx, security=worker_files)
        sock = factory.dealer(endpoints["broker.client"], identity=b"intruder")
        try:
            await sock.send_multipart(encode(m.SetVersion(request_id="evil", version=10**9)))
            await sock.send_multipart(encode(m.Pull(request_id="steal", max_groups=64, wait_s=0.0)))
            await sock.send_multipart(encode(m.Ack(prompt_ids=("p",))))
            answered = await sock.poll(1500)
        finally:
            sock.close(linger=0)
            factory.close()
        assert not answered, "a worker key was served on the client port"
        assert servers.broker.state.version < 10**9, "a worker key set the version"
        assert servers.broker.counters().get("refused.role.worker@broker.client", 0) >= 1
    finally:
        await servers.close()
        client_ctx.destroy(linger=0)


async def test_allowed_keys_reload_on_sighup_and_migration_from_one_key_set(tmp_path: Path) -> None:
    """Pre-roles dir -> migrate (old key still admitted) -> new role key added on SIGHUP -> finish (old key refused)."""
    import zmq.auth

    legacy = tmp_path / "legacy"
    (legacy / "allowed_clients").mkdir(parents=True)
    zmq.auth.create_certificates(str(legacy), "server")
    pub, _ = zmq.auth.create_certificates(str(legacy), "client")
    shutil.copy(pub, legacy / "allowed_clients")
    server_sockets = SocketFactory(zmq.asyncio.Context(), security=SecurityConfig.from_dir(str(legacy)))
    broker = Broker(BrokerConfig(worker_endpoint="tcp://127.0.0.1:*", client_endpoint="tcp://127.0.0.1:*"), server_sockets)
    task = asyncio.create_task(broker.run())
    client_ctx = zmq.asyncio.Context()

    async def admitted(sec: SecurityConfig, port: str) -> bool:
        f = SocketFactory(client_ctx, security=sec)
        sock = f.dealer(None, identity=os.urandom(6))
        try:
            fut = asyncio.ensure_future(_handshake(sock))
            await asyncio.sleep(0)
            sock.connect(broker.client_endpoint if port == "client" else broker.worker_endpoint)
            return await fut
        finally:
            sock.close(linger=0)
            f.close()

    old_key = SecurityConfig(client_key_file=str(legacy / "client.key_secret"), server_public_file=str(legacy / "server.key"))
    try:
        await asyncio.wait_for(broker.ready.wait(), 5)
        assert await admitted(old_key, "client") and await admitted(old_key, "worker")  # one set: everywhere

        migrate(str(legacy))
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, server_sockets.reload_keys)
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.2)
        worker_key = SecurityConfig.from_dir(str(legacy), role="worker")
        assert await admitted(worker_key, "worker") and not await admitted(worker_key, "client")  # roles now hold
        assert await admitted(old_key, "client") and await admitted(old_key, "worker")  # old hosts keep working

        add_key(str(legacy), "worker", "node7")  # a new host, admitted without a restart
        node7 = SecurityConfig(client_key_file=str(legacy / "worker-node7.key_secret"), server_public_file=str(legacy / "server.key"))
        assert not await admitted(node7, "worker")  # not yet: the allowed keys are read on SIGHUP only
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.2)
        assert await admitted(node7, "worker")

        finish_migration(str(legacy))
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.2)
        assert not await admitted(old_key, "client") and not await admitted(old_key, "worker")
        assert await admitted(SecurityConfig.from_dir(str(legacy), role="trainer"), "client")
        loop.remove_signal_handler(signal.SIGHUP)
    finally:
        broker.stop()
        await asyncio.wait_for(task, 10)
        server_sockets.close()
        server_sockets.context.destroy(linger=0)
        client_ctx.destroy(linger=0)
