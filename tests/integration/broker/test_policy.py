"""Named policies (`Prompt.policy`) with peers of the previous protocol minor, on real sockets: a real `Broker`, a real
`Worker` on the sim engine (simulated tokens; the engine does not matter here) and a real `TrainerClient`.

* a client of the minor before `POLICY_MINOR` (whose versions name no adapter and whose prompts name no policy) is
  served by this broker, and its versions leave the adapter the pool serves as it was;
* this client refuses to send a named policy to a broker of that minor (which would ignore it and serve the group
  with whatever adapter is on), and sends plain prompts as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest

from rollpool import protocol as p
from rollpool.protocol.messages import Prompt, SamplingParams
from tests.integration.broker.peers import OldBroker
from tests.integration.reliability.conftest import Pool


@pytest.fixture
async def pool(zmq_ctx: Any, tmp_path: Any) -> AsyncIterator[Pool]:
    pl = Pool(zmq_ctx, tmp_path)
    try:
        yield pl
    finally:
        await pl.close()


def prompt(pid: str, policy: str | None = None) -> Prompt:
    return Prompt(prompt_id=pid, input_ids=np.arange(3, 9, dtype=np.int32), sampling=SamplingParams(max_new_tokens=4), policy=policy)


SPEC = p.AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj",), base_model="tiny", name="math")


async def test_a_client_of_the_previous_minor_is_served_and_leaves_the_served_adapter_as_it_was(pool: Pool) -> None:
    broker = await pool.start_broker()
    await pool.worker(broker.worker_endpoint, "w0")
    client = await pool.client(broker.client_endpoint)
    await client.set_version(1, adapter=SPEC)  # (weights published elsewhere: the broker is told which adapter they are)
    sock: Any = pool.sockets.dealer(broker.client_endpoint, identity=b"old")
    old = p.POLICY_MINOR - 1

    async def send(msg: Any) -> Any:
        frames = p.encode(msg)
        major, _minor, kind, fields = msgpack.unpackb(frames[0])
        fields = {k: v for k, v in fields.items() if k not in ("adapter", "adapter_since", "policy")} if isinstance(fields, dict) else fields
        frames[0] = msgpack.packb([major, old, kind, fields], use_bin_type=True)
        await sock.send_multipart(frames)
        return p.decode(await asyncio.wait_for(sock.recv_multipart(), 5))

    try:
        welcome = await send(p.ClientHello(client_id="old", protocol_min=1, protocol_max=1, protocol_minor=old))
        assert isinstance(welcome, p.ClientWelcome) and welcome.protocol_minor == old
        reply = await send(p.SetVersion(request_id="r0", version=2))  # a whole-model version, in the old shape
        assert isinstance(reply, p.Reply) and reply.ok
        reply = await send(p.Submit(request_id="r1", prompts=(prompt("q"),)))
        assert isinstance(reply, p.SubmitReply) and reply.accepted == ("q",)
        batch = await send(p.Pull(request_id="r2", max_groups=1, wait_s=5.0))
        assert isinstance(batch, p.Batch) and [g.prompt_id for g in batch.groups] == ["q"]
        assert batch.groups[0].trajectories[0].policy is None
    finally:
        sock.close(linger=0)
    counters = (await client.status())["counters"]
    assert counters["version"] == 2 and counters["policy"] == "math" and counters["policy_since"] == 1
    res = await client.submit([prompt("named", "math"), prompt("other", "code")])
    assert res.accepted == ["named"] and res.rejected == {"other": "policy_unavailable"}


async def test_the_client_refuses_to_send_a_named_policy_to_a_broker_that_would_ignore_it(pool: Pool) -> None:
    """A broker of the minor before `POLICY_MINOR` (a ROUTER answering the hello as one) would serve a named group with
    whatever adapter is on: the client raises before sending it, and sends plain prompts."""
    old = OldBroker(pool.sockets, p.POLICY_MINOR - 1).start()
    submits = old.submits
    try:
        client = await pool.client(old.endpoint)
        with pytest.raises(p.RejectedError, match=rf"policy.*minor {p.POLICY_MINOR - 1}, which ignores Prompt.policy"):
            await client.submit([prompt("x")], policy="math")
        with pytest.raises(p.RejectedError, match="policy"):
            await client.submit([prompt("y", "math")])
        assert submits == [] and client.pending() == 0
        res = await client.submit([prompt("z")])
        assert res.accepted == ["z"] and len(submits) == 1
    finally:
        await old.close()


async def test_the_sync_client_names_a_policy_and_says_which_adapter_a_version_serves(pool: Pool) -> None:
    from rollpool.trainer_client import SyncTrainerClient

    broker = await pool.start_broker()
    await pool.worker(broker.worker_endpoint, "w0")

    def run() -> tuple[Any, Any]:
        with SyncTrainerClient(broker.client_endpoint) as client:
            client.set_version(1, adapter=SPEC)
            res = client.submit([prompt("a"), prompt("b")], policy="code")
            ok = client.submit([prompt("c")], policy="math")
            return res, ok

    res, ok = await asyncio.to_thread(run)
    assert res.rejected == {"a": "policy_unavailable", "b": "policy_unavailable"} and "policy 'code' is not served" in res.details["a"]
    assert ok.accepted == ["c"] and broker.state.policy == "math"
