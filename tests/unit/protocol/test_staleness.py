"""Staleness arithmetic: AReaL's admission rule and staleness at consumption."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpool.protocol import ConfigError, StalenessController, admission_capacity, can_admit, trajectory_staleness


def test_exactly_at_the_bound_is_admitted_one_over_is_refused() -> None:
    # (v + eta + 1) * B = (2 + 1 + 1) * 8 = 32
    assert can_admit(4, version=2, eta=1, batch_size=8, accepted=20, running=8)  # 20 + 8 + 4 == 32
    assert not can_admit(5, version=2, eta=1, batch_size=8, accepted=20, running=8)  # 33 > 32
    assert admission_capacity(2, 1, 8, 20, 8) == 4


def test_eta_zero_is_synchronous_one_batch_per_version() -> None:
    assert admission_capacity(0, 0, 16, 0, 0) == 16
    assert admission_capacity(0, 0, 16, 16, 0) == 0
    assert admission_capacity(1, 0, 16, 16, 0) == 16


def test_unbounded_when_eta_is_none() -> None:
    assert admission_capacity(0, None, 8, 10**9, 10**9) is None
    assert can_admit(10**6, 0, None, 8, 10**9, 0)


def test_requeued_failed_and_dropped_samples_use_no_capacity() -> None:
    c = StalenessController(batch_size=4, eta=0)
    c.on_dispatch(4)
    assert c.capacity() == 0
    c.on_requeue(4)
    assert c.capacity() == 4
    c.on_dispatch(4)
    c.on_complete(4)
    assert c.capacity() == 0
    c.on_drop(4)
    assert c.capacity() == 4


def test_staleness_at_consumption_is_decided_by_the_oldest_token() -> None:
    assert trajectory_staleness(5, np.array([3, 4, 5], dtype=np.int32)) == 2
    assert trajectory_staleness(5, [5, 5]) == 0
    assert trajectory_staleness(5, []) == 0


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        StalenessController(batch_size=0, eta=1)
    with pytest.raises(ConfigError, match="eta"):
        StalenessController(batch_size=1, eta=-1)


@settings(max_examples=300, deadline=None)
@given(
    batch_size=st.integers(1, 16),
    eta=st.integers(0, 4),
    ops=st.lists(st.tuples(st.sampled_from(["dispatch", "complete", "requeue", "bump", "consume"]), st.integers(1, 8)), max_size=200),
)
def test_consumed_samples_never_exceed_the_bound(batch_size: int, eta: int, ops: list[tuple[str, int]]) -> None:
    """Simulate a trainer that consumes B samples per version step: no consumed sample is staler than eta."""
    c = StalenessController(batch_size=batch_size, eta=eta)
    running: list[tuple[int, int]] = []  # (n, version at dispatch)
    done: list[int] = []  # versions of completed samples, FIFO
    for op, n in ops:
        if op == "dispatch" and c.can_admit(n):
            c.on_dispatch(n)
            running.append((n, c.version))
        elif op == "complete" and running:
            k, v = running.pop(0)
            c.on_complete(k)
            done.extend([v] * k)
        elif op == "requeue" and running:
            k, _ = running.pop()
            c.on_requeue(k)
        elif op in ("bump", "consume") and len(done) >= batch_size:
            # the trainer takes one batch at its current version, then steps
            batch, done[:] = done[:batch_size], done[batch_size:]
            for v in batch:
                assert c.version - v <= eta
            c.set_version(c.version + 1)
        assert c.accepted + c.running <= (c.version + eta + 1) * batch_size
