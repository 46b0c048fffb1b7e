"""The same-GPU ring's slot schedule (`rollpool.weights.ring`): every rule of its docstring, on an injected clock."""

from __future__ import annotations

import pytest

from rollpool.weights.ring import RingSchedule

A, B = b"peer-a", b"peer-b"


def ring(n: int = 5, slots: int = 2, *, claim: float = 1.0, release: float = 2.0) -> RingSchedule:
    return RingSchedule(7, n, slots, start_s=100.0, claim_timeout_s=claim, release_timeout_s=release)


def test_bucket_k_lives_in_slot_k_mod_slots_and_is_filled_in_order() -> None:
    r = ring(5, 2)
    assert [r.slot_of(k) for k in range(5)] == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError):
        r.slot_of(5)
    with pytest.raises(ValueError, match="out of order"):
        r.fill(1)
    assert r.fill(0) == 0 and r.filled == 1


def test_before_a_claim_only_the_first_slots_buckets_are_filled() -> None:
    r = ring(5, 2)
    r.fill(0)
    r.fill(1)
    assert not r.may_fill()
    with pytest.raises(ValueError, match="still holds bucket 0"):
        r.fill(2)


def test_a_slot_is_reused_only_once_its_bucket_is_released() -> None:
    r = ring(5, 2)
    r.fill(0), r.fill(1)
    assert r.claim(A, 100.1) == ""
    assert r.release(A, 0, 100.2) == "" and not r.may_fill()  # nothing copied out yet
    assert r.release(A, 1, 100.3) == "" and r.may_fill()  # bucket 0 copied out: slot 0 takes bucket 2
    assert r.fill(2) == 0 and not r.may_fill()  # slot 1 still holds bucket 1
    r.release(A, 2, 100.4)
    assert r.fill(3) == 1


def test_one_taker_per_ring_and_the_others_are_told_why() -> None:
    r = ring()
    assert r.claim(A, 100.1) == ""
    assert r.claim(A, 100.2) == ""  # a re-ask of the taker
    assert "another subscriber" in r.claim(B, 100.2)
    assert r.release(B, 1, 100.3) == "not the taker of this ring"
    assert r.released == 0


def test_releases_are_cumulative_late_or_repeated_ones_change_nothing_and_a_lost_one_is_covered() -> None:
    r = ring(5, 2)
    r.claim(A, 100.0)
    r.fill(0), r.fill(1)
    r.release(A, 2, 100.1)  # the release of bucket 0 (done=1) was lost: done=2 covers it
    assert r.released == 2 and r.may_fill()
    r.release(A, 1, 100.2)  # a late one
    assert r.released == 2
    r.release(A, 2, 100.3)  # a repeated one
    assert r.released == 2 and not r.abandoned


def test_releasing_a_bucket_never_put_in_its_slot_abandons_the_ring() -> None:
    r = ring(5, 2)
    r.claim(A, 100.0)
    r.fill(0)
    why = r.release(A, 2, 100.1)
    assert "never put in its slot" in why and r.abandoned == why and r.ended and not r.may_fill()


def test_a_parked_request_is_answered_once_its_bucket_is_in_its_slot_or_the_ring_ended() -> None:
    r = ring(3, 2)
    r.claim(A, 100.0)
    assert not r.answer_now(0)
    r.fill(0)
    assert r.answer_now(0) and not r.answer_now(1)
    r.abandon("test")
    assert r.answer_now(1) and r.answer_now(2)


def test_no_claim_within_the_claim_timeout_abandons_the_ring() -> None:
    r = ring(claim=1.0)
    assert r.deadline_s() == 101.0
    assert r.expire(100.99) == "" and not r.ended
    why = r.expire(101.0)
    assert "no subscriber claimed" in why and r.ended
    assert "abandoned" in r.claim(A, 101.1)  # too late: the taker takes the host path


def test_a_dead_taker_that_releases_nothing_times_out_from_its_last_progress() -> None:
    r = ring(5, 2, release=2.0)
    r.claim(A, 100.5)
    r.fill(0), r.fill(1)
    r.release(A, 1, 101.0)
    assert r.deadline_s() == 103.0
    r.release(A, 1, 102.5)  # a repeated release is no progress
    assert r.expire(102.9) == ""
    why = r.expire(103.0)
    assert "released no ring slot within 2 s" in why and "1 of 5" in why and r.all_filled


def test_the_taker_leaving_abandons_the_ring_and_another_peer_cannot() -> None:
    r = ring()
    r.claim(A, 100.0)
    r.leave(B)
    assert not r.ended
    r.leave(A, "bucket 0 failed its checksum")
    assert r.abandoned == "bucket 0 failed its checksum"


def test_done_when_every_bucket_is_released_then_nothing_expires() -> None:
    r = ring(3, 2)
    r.claim(A, 100.0)
    for k in range(3):
        while not r.may_fill():
            r.release(A, r.released + 1, 100.0)
        r.fill(k)
    assert r.all_filled and not r.done
    r.release(A, 3, 100.1)
    assert r.done and r.ended and not r.abandoned and r.deadline_s() is None and r.expire(1e9) == ""
    r.abandon("late")  # an ended ring stays done
    assert r.done


def test_an_empty_version_is_done_at_once_and_bad_shapes_are_refused() -> None:
    assert ring(0).done
    with pytest.raises(ValueError):
        RingSchedule(1, 3, 0, start_s=0, claim_timeout_s=1, release_timeout_s=1)
    with pytest.raises(ValueError):
        RingSchedule(1, 3, 2, start_s=0, claim_timeout_s=0, release_timeout_s=1)
