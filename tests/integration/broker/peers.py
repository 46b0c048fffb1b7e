"""Scripted peers that speak rollpool's protocol over real sockets (for tests of anything that talks to a broker).

`FakeWorker`: a zero-model worker. It says hello, heartbeats, takes tasks and
answers each with a whole group of tiny trajectories (or holds them, when
``auto_complete=False``), then grants the credit back. It can vanish without a
goodbye (`vanish()`), re-hello on a new broker epoch with its in-flight tasks,
and answer Control and ApplyGrant messages.

`FakeClient`: a trainer-side client: submit, pull (long poll, piggybacked acks),
ack, set_version, status, control, cancel; requests are matched to replies by
request id.

`OldBroker`: a broker of an older protocol minor as a client sees it: a ROUTER
that welcomes with that minor and accepts every prompt it is sent (kept in
``submits``), for the tests of what a client refuses to send to such a broker.

Both are built only from `rollpool.protocol` and close their sockets in `close()`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from rollpool import protocol as p

_ids = itertools.count()


def make_prompt(prompt_id: str, group_size: int = 1, priority: int = 0, n_tokens: int = 4) -> p.Prompt:
    return p.Prompt(
        prompt_id=prompt_id,
        input_ids=np.arange(n_tokens, dtype=np.int32),
        group_size=group_size,
        priority=priority,
        metadata={"answer": prompt_id},
    )


def make_group(task: p.Task, worker_id: str, version: int = 0, n_out: int = 2) -> tuple[p.Trajectory, ...]:
    prompt = task.prompt
    ids = prompt.input_ids if prompt.input_ids is not None else np.zeros(0, dtype=np.int32)
    return tuple(
        p.Trajectory(
            prompt_id=prompt.prompt_id,
            sample_index=i,
            input_ids=ids,
            output_ids=np.full(n_out, i, dtype=np.int32),
            output_logprobs=np.zeros(n_out, dtype=np.float32),
            token_versions=np.full(n_out, version, dtype=np.int32),
            loss_mask=np.ones(n_out, dtype=np.uint8),
            finish_reason="stop",
            worker_id=worker_id,
            attempt=task.attempt,
        )
        for i in range(prompt.group_size)
    )


class FakeWorker:
    """A scripted worker on a DEALER socket (see the module docstring)."""

    def __init__(
        self,
        sockets: p.SocketFactory,
        endpoint: str,
        worker_id: str,
        *,
        capacity: int = 4,
        heartbeat_interval_s: float = 0.05,
        auto_complete: bool = True,
        delay_s: float = 0.0,
        version: int = 0,
        fingerprint: str = "",
        on_task: Callable[[p.Task], None] | None = None,
    ) -> None:
        self.sockets = sockets
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.capacity = capacity
        self.heartbeat_interval_s = heartbeat_interval_s
        self.auto_complete = auto_complete
        self.delay_s = delay_s
        self.version = version
        self.fingerprint = fingerprint
        self.on_task = on_task
        self.sock: Any = None
        self.epoch = ""
        self.welcomed = asyncio.Event()
        self.welcome: p.Welcome | None = None
        self.tasks: list[p.Task] = []
        """Every task received, in order."""
        self.inflight: dict[str, p.Task] = {}
        self.received: list[Any] = []
        """Every message received."""
        self.cancels: list[str] = []
        self.max_inflight_samples = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self.announce_inflight = True

    # -- lifecycle

    async def start(self) -> FakeWorker:
        self.sock = self.sockets.dealer(self.endpoint, identity=f"{self.worker_id}-{next(_ids)}".encode())
        self._closed = False
        self.welcomed.clear()
        await self._send(self._hello())
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name=f"{self.worker_id}._recv_loop"),
            asyncio.create_task(self._heartbeat_loop(), name=f"{self.worker_id}._heartbeat_loop"),
        ]
        await asyncio.wait_for(self.welcomed.wait(), 5.0)
        return self

    def _hello(self) -> p.Hello:
        inflight = tuple(
            p.InflightTask(task_id=t.task_id, prompt_id=t.prompt.prompt_id, group_size=t.prompt.group_size, attempt=t.attempt)
            for t in self.inflight.values()
        ) if self.announce_inflight else ()
        used = sum(t.prompt.group_size for t in self.inflight.values())
        return p.Hello(
            worker_id=self.worker_id,
            protocol_min=1,
            protocol_max=1,
            engine="fake",
            capacity=self.capacity,
            credits=max(0, self.capacity - used),
            weight_version=self.version,
            fingerprint=self.fingerprint,
            inflight=inflight,
        )

    async def vanish(self) -> None:
        """Stop talking without a goodbye (a crashed process)."""
        await self._stop_tasks()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    async def goodbye(self) -> None:
        await self._send(p.Goodbye(reason="test", task_ids=tuple(self.inflight)))
        await self.vanish()

    async def close(self) -> None:
        await self.vanish()

    async def _stop_tasks(self) -> None:
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - teardown of a fake peer: its own failure was reported by the test
                pass
        self._tasks = []

    # -- actions

    async def _send(self, msg: Any) -> None:
        if self.sock is not None:
            await self.sock.send_multipart(p.encode(msg))

    async def complete(self, task_id: str, *, version: int | None = None, credit: bool = True) -> None:
        task = self.inflight.pop(task_id)
        trajs = make_group(task, self.worker_id, self.version if version is None else version)
        await self._send(p.Result(task_id=task_id, prompt_id=task.prompt.prompt_id, trajectories=trajs))
        if credit:
            await self._send(p.Credit(credits=task.prompt.group_size))

    async def send_result_for(self, task: p.Task) -> None:
        """Send a result for `task` even if this worker no longer holds it (a late result)."""
        trajs = make_group(task, self.worker_id, self.version)
        await self._send(p.Result(task_id=task.task_id, prompt_id=task.prompt.prompt_id, trajectories=trajs))

    async def fail(self, task_id: str, error: str = "boom", retryable: bool = True) -> None:
        task = self.inflight.pop(task_id)
        await self._send(p.Result(task_id=task_id, prompt_id=task.prompt.prompt_id, error=error, retryable=retryable))
        await self._send(p.Credit(credits=task.prompt.group_size))

    async def nack(self, task_id: str) -> None:
        task = self.inflight.pop(task_id)
        await self._send(p.Nack(task_ids=(task_id,), reason="test"))
        await self._send(p.Credit(credits=task.prompt.group_size))

    async def heartbeat(self, state: str = "ready") -> None:
        await self._send(
            p.WorkerHeartbeat(worker_id=self.worker_id, inflight_task_ids=tuple(self.inflight), weight_version=self.version, state=state, epoch=self.epoch)
        )

    # -- loops

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            await self.heartbeat()

    async def _recv_loop(self) -> None:  # noqa: C901 - grandfathered: one branch per message type of the fake peer
        while True:
            frames = await self.sock.recv_multipart()
            msg = p.decode(frames)
            self.received.append(msg)
            kind = type(msg)
            if kind is p.Welcome:
                self.welcome = msg
                self.epoch = msg.epoch
                for tid in msg.refused:
                    self.inflight.pop(tid, None)
                self.welcomed.set()
            elif kind is p.Task:
                self.tasks.append(msg)
                self.inflight[msg.task_id] = msg
                used = sum(t.prompt.group_size for t in self.inflight.values())
                self.max_inflight_samples = max(self.max_inflight_samples, used)
                if self.on_task is not None:
                    self.on_task(msg)
                if self.auto_complete:
                    if self.delay_s:
                        asyncio.get_running_loop().call_later(self.delay_s, self._complete_later, msg.task_id)
                    else:
                        await self.complete(msg.task_id)
            elif kind is p.Cancel:
                self.cancels.extend(msg.task_ids)
                for tid in msg.task_ids:
                    task = self.inflight.pop(tid, None)
                    if task is not None:
                        await self._send(p.Credit(credits=task.prompt.group_size))
            elif kind is p.BrokerHeartbeat:
                if self.epoch and msg.epoch != self.epoch:
                    self.epoch = msg.epoch
                    await self._send(self._hello())
            elif kind is p.Error and msg.code == "hello_required":
                await self._send(self._hello())
            elif kind is p.Control:
                await self._send(p.ControlReply(request_id=msg.request_id, ok=True, results={"op": msg.op}))
            elif kind is p.ApplyGrant:
                self.version = msg.version
                await self._send(p.ApplyDone(version=msg.version, ok=True))

    def _complete_later(self, task_id: str) -> None:
        if task_id in self.inflight and not self._closed:
            asyncio.ensure_future(self.complete(task_id))


class FakeClient:
    """A scripted trainer client on a DEALER socket."""

    def __init__(self, sockets: p.SocketFactory, endpoint: str, client_id: str = "trainer") -> None:
        self.sockets = sockets
        self.endpoint = endpoint
        self.client_id = client_id
        self.sock: Any = None
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._recv_task: asyncio.Task[None] | None = None
        self._seq = itertools.count()
        self.errors: list[p.Error] = []
        self.welcome: p.ClientWelcome | None = None

    async def start(self, hello: bool = True) -> FakeClient:
        self.sock = self.sockets.dealer(self.endpoint, identity=f"{self.client_id}-{next(_ids)}".encode())
        self._recv_task = asyncio.create_task(self._recv_loop(), name=f"{self.client_id}._recv_loop")
        if hello:
            self.welcome = await self.request(p.ClientHello(client_id=self.client_id, protocol_min=1, protocol_max=1), key="hello")
        return self

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - teardown of a fake peer: its own failure was reported by the test
                pass
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def _rid(self) -> str:
        return f"{self.client_id}-{next(self._seq)}"

    async def request(self, msg: Any, key: str | None = None, timeout_s: float = 10.0) -> Any:
        key = key or msg.request_id
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        await self.sock.send_multipart(p.encode(msg))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._pending.pop(key, None)

    async def _recv_loop(self) -> None:
        while True:
            msg = p.decode(await self.sock.recv_multipart())
            if isinstance(msg, p.ClientWelcome):
                key: str | None = "hello"
            elif isinstance(msg, p.Error):
                self.errors.append(msg)
                key = msg.request_id or ("hello" if msg.ref_type == "client_hello" else None)
            else:
                key = getattr(msg, "request_id", None)
            fut = self._pending.get(key) if key is not None else None
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def submit(self, prompts: Sequence[p.Prompt]) -> p.SubmitReply:
        reply: p.SubmitReply = await self.request(p.Submit(request_id=self._rid(), prompts=tuple(prompts)))
        return reply

    async def pull(self, max_groups: int = 64, wait_s: float = 0.5, ack: Sequence[str] = ()) -> p.Batch:
        reply: p.Batch = await self.request(
            p.Pull(request_id=self._rid(), max_groups=max_groups, wait_s=wait_s, ack=tuple(ack)), timeout_s=wait_s + 10
        )
        return reply

    async def ack(self, prompt_ids: Sequence[str], dropped_stale: Sequence[str] = ()) -> None:
        await self.sock.send_multipart(p.encode(p.Ack(prompt_ids=tuple(prompt_ids), dropped_stale=tuple(dropped_stale))))

    async def status(self) -> p.StatusReply:
        reply: p.StatusReply = await self.request(p.StatusRequest(request_id=self._rid()))
        return reply

    async def set_version(self, version: int, weight_endpoint: str | None = None, announce_endpoint: str | None = None) -> p.Reply:
        reply: p.Reply = await self.request(
            p.SetVersion(request_id=self._rid(), version=version, weight_endpoint=weight_endpoint, announce_endpoint=announce_endpoint)
        )
        return reply

    async def control(self, op: str, timeout_s: float = 2.0) -> p.ControlReply:
        reply: p.ControlReply = await self.request(p.Control(request_id=self._rid(), op=op, timeout_s=timeout_s), timeout_s=timeout_s + 5)
        return reply

    async def cancel(self, prompt_ids: Sequence[str]) -> p.Reply:
        reply: p.Reply = await self.request(p.CancelPrompts(request_id=self._rid(), prompt_ids=tuple(prompt_ids)))
        return reply

    async def collect(self, n: int, timeout_s: float = 20.0, ack: bool = True) -> list[p.GroupResult]:
        """Pull until `n` groups arrived (acknowledging each batch with the next pull)."""
        got: list[p.GroupResult] = []
        pending_ack: list[str] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(got) < n:
            if loop.time() > deadline:
                raise TimeoutError(f"collected {len(got)} of {n} groups")
            batch = await self.pull(max_groups=256, wait_s=0.2, ack=pending_ack)
            pending_ack = [g.prompt_id for g in batch.groups] if ack else []
            got.extend(batch.groups)
        if pending_ack:
            await self.ack(pending_ack)
        return got


class OldBroker:
    """A ROUTER on tcp loopback answering a client as a broker of protocol minor `minor` would: `ClientWelcome` with
    that minor, every `Submit` accepted whole and kept in `submits`. Start with `start()`, end with `close()`."""

    def __init__(self, sockets: Any, minor: int) -> None:
        self.router: Any = sockets.router("tcp://127.0.0.1:*")
        self.endpoint: str = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.minor = minor
        self.submits: list[p.Submit] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> OldBroker:
        self._task = asyncio.create_task(self._serve())
        return self

    async def _serve(self) -> None:
        while True:
            identity, *frames = await self.router.recv_multipart()
            msg = p.decode(frames)
            if isinstance(msg, p.ClientHello):
                reply: Any = p.ClientWelcome(epoch="e", protocol=1, protocol_minor=self.minor)
            else:
                assert isinstance(msg, p.Submit), f"an old broker stand-in takes hellos and submits, got {msg!r}"
                self.submits.append(msg)
                reply = p.SubmitReply(request_id=msg.request_id, epoch="e", accepted=tuple(q.prompt_id for q in msg.prompts))
            await self.router.send_multipart([identity, *p.encode(reply)])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.router.close(linger=0)
