"""Adapter versions without an apply slot (protocol minor 21, `ADAPTER_GRANT_MINOR`), the broker's side on real sockets:
its Welcome lists `Feature.ADAPTER_NO_GRANT` in rolling activation and not in fleet activation (where the workers' asks
are how it switches them together), and an `ApplyDone` that no grant preceded moves the worker's version, the version's
convergence and the apply slots exactly as a granted one does."""

from __future__ import annotations

import asyncio

import pytest

from rollpool import protocol as p
from tests.integration.broker.conftest import Harness
from tests.integration.broker.test_broker_wire import RawWorker


async def _until(cond: object, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("activation", ["rolling", "fleet"])
async def test_the_welcome_lists_adapter_versions_without_grant_only_outside_fleet_activation(start_broker, activation: str) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker(activation=activation)
    w = RawWorker(h, "w", minor=p.PROTOCOL_MINOR, capacity=2, features=p.FEATURES)
    try:
        welcome = await w.hello()
        assert (p.Feature.ADAPTER_NO_GRANT in welcome.features) is (activation == "rolling")
        assert p.Feature.REPLAY in welcome.features  # the other features are listed as before
    finally:
        w.close()


async def test_an_apply_done_without_a_grant_moves_the_version_and_its_convergence_and_frees_no_slot(start_broker) -> None:  # type: ignore[no-untyped-def]
    h: Harness = await start_broker(activation="rolling", max_applying=1)
    c = await h.client()
    a = RawWorker(h, "a", minor=p.PROTOCOL_MINOR, capacity=2, features=p.FEATURES)
    b = RawWorker(h, "b", minor=p.PROTOCOL_MINOR, capacity=2, features=p.FEATURES)
    try:
        await a.hello()
        await b.hello()
        await c.set_version(1)
        st = h.broker.state
        # b holds the one apply slot (a whole-model version, say); a applies an adapter version without asking
        await b.send(p.ApplyRequest(version=1))
        await b.recv(p.ApplyGrant)
        await a.send(p.ApplyDone(version=1, ok=True, duration_s=0.01))
        await _until(lambda: st.workers["a"].version == 1)
        assert st.applying == frozenset({"b"})  # a's report took no slot and freed none
        assert st.counters["versions_converged"] == 0  # b does not serve 1 yet
        await b.send(p.ApplyDone(version=1, ok=True, duration_s=0.01))
        await _until(lambda: st.counters["versions_converged"] == 1)
        assert st.workers["b"].version == 1 and st.applying == frozenset()
    finally:
        a.close()
        b.close()
