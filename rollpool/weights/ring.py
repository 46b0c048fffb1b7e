"""The same-GPU ring's slot schedule: pure bookkeeping (no torch, no I/O, an injected clock).

When a whole-version arena would pass the publisher's GPU budget but a few bucket-sized slots fit, the publisher
streams a version through a ring of `slots` device slots (`rollpool.weights.paths.ipc_ring`). One `RingSchedule` per
version says which bucket goes where and when, and what a release that is lost, late or never comes means.

Rules (each one a unit test in tests/unit/weights/test_ring.py)
    - Bucket k lives in slot ``k % slots``. Buckets are filled in order, each once.
    - One subscriber takes a version's ring: the first that claims it (`claim`); any other is refused with the reason
      (it takes the host path). Before a claim the first `slots` buckets may be filled, no more.
    - Bucket k may be filled once the taker has released bucket ``k - slots`` (``k < released + slots``): a slot is
      never written while the bucket in it may still be copied out.
    - Releases are cumulative: ``release(n)`` means buckets below n were copied out. A late or repeated release (n at
      or below what is released) changes nothing; a lost one is covered by the next. Releasing a bucket that was never
      put in its slot is a protocol fault: the ring is abandoned with that reason.
    - A taker's parked request for bucket k (its ``ring_done`` = k) is answered once bucket k is in its slot, or once the
      ring has ended (done or abandoned), so the asker never waits on a ring that will not move.
    - Time-outs, from the injected clock: no claim within `claim_timeout_s` of the start, or no release (progress) within
      `release_timeout_s` of the last one, abandons the ring with the reason (`expire`). A taker may also leave
      (`leave`: it falls back to the host path). Abandoning loses nothing: the version's host buckets are complete
      (the publisher snapshots them beside the ring) and the taker's next answer says the ring is gone.
    - The ring is done when every bucket is released; only then (or once abandoned) are the slots free for the next
      version's ring.
"""

from __future__ import annotations

__all__ = ["RING_LEFT", "RingSchedule"]

RING_LEFT = -2
"""`ManifestRequest.ring_done` of a taker that leaves the ring (it takes the host path for the rest of the version)."""


class RingSchedule:
    """One version's passage through a ring of `slots` slots (see the module docstring)."""

    def __init__(self, version: int, num_buckets: int, slots: int, *, start_s: float, claim_timeout_s: float,
                 release_timeout_s: float) -> None:
        if slots < 1:
            raise ValueError(f"a ring needs at least one slot, got {slots}")
        if num_buckets < 0:
            raise ValueError(f"num_buckets must be >= 0, got {num_buckets}")
        if claim_timeout_s <= 0 or release_timeout_s <= 0:
            raise ValueError("claim_timeout_s and release_timeout_s must be > 0")
        self.version = version
        self.num_buckets = num_buckets
        self.slots = slots
        self.claim_timeout_s = claim_timeout_s
        self.release_timeout_s = release_timeout_s
        self.filled = 0
        """Buckets below this are (or were) in their slot."""
        self.released = 0
        """Buckets below this were copied out by the taker (their slots free)."""
        self.taker: bytes | None = None
        self.abandoned = ""
        """Why the ring was abandoned ("" while it streams or once done)."""
        self._start_s = start_s
        self._progress_s = start_s

    # -- where and when

    def slot_of(self, bucket: int) -> int:
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket {bucket} is not one of {self.num_buckets}")
        return bucket % self.slots

    @property
    def done(self) -> bool:
        """Every bucket released by the taker."""
        return not self.abandoned and self.released >= self.num_buckets

    @property
    def ended(self) -> bool:
        """Done or abandoned: the slots are free for the next version's ring."""
        return self.done or bool(self.abandoned)

    @property
    def all_filled(self) -> bool:
        """Every bucket was put in its slot (the trainer's tensors are no longer read), or the ring ended."""
        return self.ended or self.filled >= self.num_buckets

    def may_fill(self) -> bool:
        """Whether the next bucket (`filled`) may be put in its slot now."""
        return not self.ended and self.filled < self.num_buckets and self.filled < self.released + self.slots

    def fill(self, bucket: int) -> int:
        """Bucket `bucket` is now in its slot (it must be the next one, and `may_fill`); returns the slot."""
        if bucket != self.filled:
            raise ValueError(f"bucket {bucket} filled out of order (the next is {self.filled})")
        if not self.may_fill():
            raise ValueError(f"bucket {bucket} may not be filled: slot {bucket % self.slots} still holds bucket {bucket - self.slots}"
                             if not self.ended else f"the ring of version {self.version} has ended")
        self.filled += 1
        return bucket % self.slots

    # -- the taker

    def claim(self, peer: bytes, now_s: float) -> str:
        """`peer` asks to take the ring: "" when it is (or already was) the taker, else why not."""
        if self.abandoned:
            return f"the same-GPU ring of version {self.version} was abandoned ({self.abandoned})"
        if self.taker is None:
            self.taker = peer
            self._progress_s = now_s
            return ""
        if self.taker != peer:
            return f"the same-GPU ring of version {self.version} serves another subscriber on this GPU"
        return ""

    def release(self, peer: bytes, done: int, now_s: float) -> str:
        """The taker copied out every bucket below `done`: "" (taken note of; a late or repeated one changes nothing),
        else why not (another peer, or a protocol fault that abandons the ring)."""
        if peer != self.taker:
            return "not the taker of this ring"
        if self.ended:
            return ""
        if done > self.filled:
            self.abandon(f"the subscriber released bucket {done - 1}, which was never put in its slot")
            return self.abandoned
        if done > self.released:
            self.released = done
            self._progress_s = now_s
        return ""

    def leave(self, peer: bytes, why: str = "the subscriber left the ring") -> None:
        """The taker leaves (it takes the host path): the ring is abandoned. Another peer's leave changes nothing."""
        if peer == self.taker and not self.ended:
            self.abandon(why)

    def answer_now(self, ring_done: int) -> bool:
        """Whether the taker's request for bucket `ring_done` is answered now (it is in its slot, or the ring ended)."""
        return self.ended or self.filled > ring_done

    # -- time

    def deadline_s(self) -> float | None:
        """When the ring is abandoned if nothing happens (None once it ended)."""
        if self.ended:
            return None
        if self.taker is None:
            return self._start_s + self.claim_timeout_s
        return self._progress_s + self.release_timeout_s

    def expire(self, now_s: float) -> str:
        """Abandon the ring if its deadline passed; the reason ("" when it did not)."""
        deadline = self.deadline_s()
        if deadline is None or now_s < deadline:
            return ""
        if self.taker is None:
            self.abandon(f"no subscriber claimed the same-GPU ring within {self.claim_timeout_s:g} s")
        else:
            self.abandon(f"the subscriber released no ring slot within {self.release_timeout_s:g} s "
                         f"(it had released {self.released} of {self.num_buckets} buckets)")
        return self.abandoned

    def abandon(self, why: str) -> None:
        if not self.ended:
            self.abandoned = why or "abandoned"
