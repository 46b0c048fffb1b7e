"""A publisher's shared-memory segments as the weight tests poke them: a byte flipped in place (flipping it again
restores it), the bucket bytes read back, and a fake metrics sink that restores a flipped byte on the first refetch."""

from __future__ import annotations

import os
from typing import Any

from rollpool.protocol.metrics import MemoryMetricsSink
from rollpool.weights.memory import SHM_DIR, SHM_HEADER_BYTES


def segment_exists(segment: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, segment))


def bucket_bytes(segment: str, nbytes: int) -> bytes:
    """The first `nbytes` of the segment's bucket bytes (after its header)."""
    with open(os.path.join(SHM_DIR, segment), "rb") as f:
        f.seek(SHM_HEADER_BYTES)
        return f.read(nbytes)


def flip_byte(segment: str, offset: int = 100) -> None:
    """Flip the bits of one bucket byte of the segment (a corruption; the same call again undoes it)."""
    with open(os.path.join(SHM_DIR, segment), "r+b") as f:
        f.seek(SHM_HEADER_BYTES + offset)
        b = f.read(1)
        f.seek(SHM_HEADER_BYTES + offset)
        f.write(bytes([b[0] ^ 0x5A]))


class RestoreOnRefetch(MemoryMetricsSink):
    """Fake sink: the first refetch of `bucket` over `path` (``shm`` or ``shm_device``) flips the byte back (a
    transient fault in the shared memory)."""

    def __init__(self, segment: str, offset: int, path: str, bucket: int = 0) -> None:
        super().__init__()
        self.segment, self.offset, self.path, self.bucket = segment, offset, path, bucket
        self.restored = False

    def event(self, name: str, fields: dict[str, Any]) -> None:
        super().event(name, fields)
        if (name == "bucket_refetched" and not self.restored and fields["bucket"] == self.bucket
                and fields["path"] == self.path):
            flip_byte(self.segment, self.offset)
            self.restored = True
