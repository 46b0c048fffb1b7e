"""A trainer that resumes from a checkpoint at an older version rebases the pool (protocol 1.6).

On real sockets: an in-process broker, sim workers (simulated generation) fed by a
real weight publisher hosted by the real `TrainerClient`. The first trainer reaches
version 3 and consumes samples; it dies, and the second resumes from its version-1
checkpoint. Without a rebase the lower version is refused with an error naming both
versions and the way out; with it the pool's version and admission account restart
at 1, the workers forget version 3 (an abandoned run), apply the lower version 1 and
serve it, and the run goes on to version 2.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollpool.protocol import RejectedError
from rollpool.trainer_client import SyncTrainerClient, TrainerClient
from tests.integration.reliability.conftest import BrokerProcess, Pool, wait_until

pytestmark = [pytest.mark.timeout(90)]


def _tensors(torch: Any, value: float) -> dict[str, Any]:
    return {"w": torch.full((64,), value)}


async def _at(workers: list[Any], version: int, timeout_s: float = 15) -> bool:
    return await wait_until(lambda: all(w.weight_version == version for w in workers), timeout_s)


async def _consume(client: TrainerClient, n: int, tag: str) -> list[int]:
    await client.submit([[i + 1, i + 2, i + 3] for i in range(n)], group_size=1)
    batch = await client.get_batch(n, timeout=20)
    assert len(batch.groups) == n, tag
    return sorted({int(v) for g in batch.groups for t in g.trajectories for v in t.token_versions})


async def test_a_trainer_resuming_from_an_older_checkpoint_rebases_the_pool(pool: Pool) -> None:
    torch = pytest.importorskip("torch")
    # eta 1, B 2: at version v at most (v + 2) x 2 samples accepted + running; workers more than 1 behind get nothing
    broker = await pool.start_broker(max_staleness=1, batch_size=2)
    workers = [await pool.worker(broker.worker_endpoint, f"w{i}") for i in range(2)]
    first = await pool.client(broker.client_endpoint, client_id="trainer-a")
    for v in (1, 2, 3):
        await first.publish_weights(_tensors(torch, float(v)), v)
    assert await _at(workers, 3)
    assert await _consume(first, 8, "first run") == [3]
    assert broker.state.staleness.accepted == 8
    await first.close()  # the trainer dies at version 3; its last checkpoint is version 1

    second = await pool.client(broker.client_endpoint, client_id="trainer-b")
    with pytest.raises(RejectedError, match=r"version 1 is older than the pool's version 3.*rebase_version\(1\)"):
        await second.set_version(1)
    assert broker.state.version == 3  # refused: nothing changed

    await second.rebase_version(1)
    st = broker.state
    assert (st.version, st.staleness.version, st.staleness.accepted) == (1, 1, 2)  # as if the run reached 1 in order
    assert st.counters["rebases"] == 1 and st.version_epoch > 0 and second.version == 1
    await second.publish_weights(_tensors(torch, 1.0), 1)  # the checkpoint's weights, on a fresh publisher
    assert await _at(workers, 1), [w.weight_version for w in workers]  # a lower version, applied
    # without the rebased admission account (accepted 8 > (1 + 2) x 2) nothing could be dispatched now
    assert await _consume(second, 4, "resumed at 1") == [1]
    await second.publish_weights(_tensors(torch, 2.0), 2)
    assert await _at(workers, 2)
    assert await _consume(second, 2, "resumed, version 2") == [2]
    counters = (await second.status())["counters"]
    assert counters["version"] == 2 and counters["rebases"] == 1 and counters["duplicates"] == 0


def test_the_sync_client_rebases_too_and_a_lower_version_without_it_is_refused(tmp_path: Any) -> None:
    bp = BrokerProcess(["--heartbeat-interval-s", "0.2"], str(tmp_path / "broker.log"))
    try:
        with SyncTrainerClient(bp.client_endpoint, connect_timeout_s=30) as client:
            client.set_version(5)
            with pytest.raises(RejectedError, match=r"version 2 is older than the pool's version 5"):
                client.set_version(2)
            client.rebase_version(2)
            counters = client.status()["counters"]
            assert counters["version"] == 2 and counters["rebases"] == 1 and counters["version_epoch"] > 0
            client.set_version(3)  # and forward from there as usual
            assert client.status()["counters"]["version"] == 3
    finally:
        bp.stop()
