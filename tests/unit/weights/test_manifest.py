"""The pure core of the weight channel: manifest checks and the path plan (no sockets, no threads, no torch).

Every reason a path is passed over, and every refusal, is a test here: what a subscriber on a given host with a
given hello does with a given manifest."""

from __future__ import annotations

from typing import Any

import pytest

from rollpool.protocol.errors import WeightSyncError
from rollpool.protocol.messages import BucketInfo, CudaIpcBuffer, Manifest, TensorInfo
from rollpool.weights.config import WeightPathConfig
from rollpool.weights.manifest import (
    BULK,
    CUDA_IPC,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    NETWORK,
    PATHS,
    SHM,
    SHM_DEVICE,
    FetchFacts,
    Plan,
    Step,
    check_manifest,
    chunk_bytes_of,
    plan,
    stream_jobs,
)

HOST = "boot/shm"


def _bucket(**kw: Any) -> BucketInfo:
    fields: dict[str, Any] = {"index": 0, "dtype": "float32", "nbytes": 32, "checksum": "", "shm_segment": "rollpool-p-x-1-1",
                              "ipc_offset": 0, "tensors": (TensorInfo(name="w", dtype="float32", shape=(8,), offset=0, nbytes=32),)}
    fields.update(kw)
    return BucketInfo(**fields)


def _manifest(*, ipc: bool = True, **kw: Any) -> Manifest:
    fields: dict[str, Any] = {
        "request_id": "m", "version": 3, "publisher_id": "pub", "host_key": HOST, "bulk_port": 7002, "buckets": (_bucket(),),
        "cuda_ipc": CudaIpcBuffer(device_uuid="GPU-a", handle=bytes(64), storage_bytes=4096) if ipc else None,
    }
    fields.update(kw)
    return Manifest(**fields)


def _facts(**kw: Any) -> FetchFacts:
    fields: dict[str, Any] = {"host_key": HOST, "gpu_uuids": frozenset({"GPU-a"}), "stage_device": True, "lane_host": "127.0.0.1"}
    fields.update(kw)
    return FetchFacts(**fields)


def _plan(path: str = "auto", m: Manifest | None = None, *, bulk: bool = True, **facts: Any) -> Plan:
    return plan(m if m is not None else _manifest(), _facts(**facts), WeightPathConfig(weight_path=path, weight_bulk=bulk))


# ---------------------------------------------------------------------------------------------- the order


def test_every_path_has_one_step_in_the_fallback_order() -> None:
    p = _plan()
    assert tuple(s.path for s in p.steps) == PATHS == (CUDA_IPC, SHM_DEVICE, SHM, BULK, NETWORK)
    assert p.to_try == PATHS and not p.refusal  # the same GPU, on this host, offering everything


def test_the_network_is_always_a_path_to_try_except_under_shm() -> None:
    for path in ("auto", "network", "cuda_ipc"):
        assert _plan(path, _manifest(host_key="", ipc=False, bulk_port=0)).to_try == (NETWORK,)
    assert _plan("shm").step(NETWORK) == Step(NETWORK, "the weight path is 'shm'")


# ---------------------------------------------------------------------------------------------- the same GPU


def test_cuda_ipc_is_tried_when_the_buffer_is_on_this_host_and_a_visible_gpu() -> None:
    assert _plan("auto").step(CUDA_IPC) == Step(CUDA_IPC)
    assert _plan("cuda_ipc", gpu_uuids=frozenset({"GPU-b", "GPU-a"})).step(CUDA_IPC) == Step(CUDA_IPC)


@pytest.mark.parametrize("path", ["network", "shm"])
def test_cuda_ipc_is_quiet_when_the_path_excludes_it(path: str) -> None:
    assert _plan(path).step(CUDA_IPC) == Step(CUDA_IPC, f"the weight path is {path!r}")


def test_an_empty_version_takes_no_same_host_path_and_explains_nothing() -> None:
    for m in (_manifest(buckets=()), _manifest(buckets=(_bucket(nbytes=0, tensors=()),))):
        p = _plan("auto", m)
        assert p.step(CUDA_IPC) == Step(CUDA_IPC, "the version has no bytes")
        assert p.step(SHM) == Step(SHM, "the version has no bytes")
        assert not any(s.counted for s in p.steps) and p.to_try == (BULK, NETWORK)


def test_no_device_buffer_is_quiet_on_auto_and_a_counted_fallback_on_cuda_ipc() -> None:
    plain = _manifest(ipc=False)
    why = "the publisher offers no device buffer for this version"
    assert _plan("auto", plain).step(CUDA_IPC) == Step(CUDA_IPC, why)
    assert _plan("cuda_ipc", plain).step(CUDA_IPC) == Step(CUDA_IPC, why, counted=True)


def test_a_gpu_buffer_on_another_host_is_a_counted_fallback() -> None:
    why = "the publisher's GPU buffer is on another host"
    assert _plan("auto", host_key="other/shm").step(CUDA_IPC) == Step(CUDA_IPC, why, counted=True)
    assert _plan("auto", _manifest(host_key="")).step(CUDA_IPC) == Step(CUDA_IPC, why, counted=True)


def test_a_gpu_this_process_does_not_see_is_a_counted_fallback() -> None:
    why = "the publisher's GPU is not visible to this process"
    assert _plan("auto", gpu_uuids=frozenset({"GPU-b"})).step(CUDA_IPC) == Step(CUDA_IPC, why, counted=True)
    assert _plan("cuda_ipc", gpu_uuids=frozenset()).step(CUDA_IPC) == Step(CUDA_IPC, why, counted=True)


def test_a_bucket_missing_from_the_device_buffer_is_a_counted_fallback() -> None:
    m = _manifest(buckets=(_bucket(ipc_offset=-1),))
    assert _plan("auto", m).step(CUDA_IPC) == Step(CUDA_IPC, "a bucket is missing from the publisher's device buffer", counted=True)
    assert _plan("auto", m).to_try == (SHM_DEVICE, SHM, BULK, NETWORK)  # the next paths still serve it


# ---------------------------------------------------------------------------------------------- shared memory


def test_shared_memory_is_tried_on_this_host_under_auto_shm_and_cuda_ipc() -> None:
    for path in ("auto", "shm", "cuda_ipc"):
        assert _plan(path).step(SHM) == Step(SHM)


def test_shared_memory_is_quiet_under_network() -> None:
    assert _plan("network").step(SHM) == Step(SHM, "the weight path is 'network'")
    assert _plan("network").to_try == (BULK, NETWORK)


def test_no_segments_offered_is_a_counted_fallback_and_under_shm_a_refusal() -> None:
    why = "the publisher offers no shared memory for this version"
    for m in (_manifest(host_key=""), _manifest(buckets=(_bucket(shm_segment=""),))):
        assert _plan("auto", m).step(SHM) == Step(SHM, why, counted=True)
        assert _plan("shm", m).refusal == f"weight path 'shm': {why}"


def test_a_publisher_on_another_host_is_a_counted_fallback_and_under_shm_a_refusal() -> None:
    why = "the publisher is on another host (or another /dev/shm)"
    assert _plan("auto", host_key="other/shm").step(SHM) == Step(SHM, why, counted=True)
    assert _plan("shm", host_key="other/shm").refusal == f"weight path 'shm': {why}"
    assert not _plan("shm").refusal


# ---------------------------------------------------------------------------------------------- shm staged to the GPU


def test_staging_to_the_gpu_needs_an_engine_that_stages() -> None:
    assert _plan("auto").step(SHM_DEVICE) == Step(SHM_DEVICE)
    assert _plan("shm").step(SHM_DEVICE) == Step(SHM_DEVICE)
    assert _plan("auto", stage_device=False).step(SHM_DEVICE) == Step(SHM_DEVICE, "the engine does not stage to a GPU")


@pytest.mark.parametrize("path", ["network", "cuda_ipc"])
def test_staging_to_the_gpu_is_quiet_outside_auto_and_shm(path: str) -> None:
    assert _plan(path).step(SHM_DEVICE) == Step(SHM_DEVICE, f"the weight path is {path!r}")


def test_the_reasons_against_shared_memory_are_counted_once_at_the_cpu_step() -> None:
    p = _plan("auto", host_key="other/shm")
    why = "the publisher is on another host (or another /dev/shm)"
    assert p.step(SHM_DEVICE) == Step(SHM_DEVICE, why)  # quiet here
    assert [s for s in p.steps if s.counted] == [Step(CUDA_IPC, "the publisher's GPU buffer is on another host", counted=True),
                                                 Step(SHM, why, counted=True)]


# ---------------------------------------------------------------------------------------------- the bulk lane


def test_the_bulk_lane_is_tried_when_offered_reachable_and_on() -> None:
    assert _plan("network").step(BULK) == Step(BULK)


@pytest.mark.parametrize(("m", "kw", "why"), [
    (_manifest(bulk_port=0), {}, "the server offers no bulk lane (CURVE, not TCP, or switched off there)"),
    (_manifest(), {"lane_host": None}, "the ROUTER endpoint is not TCP"),
    (_manifest(), {"bulk": False}, "the bulk lane is switched off here"),
    (_manifest(), {"unreachable_lanes": frozenset({("127.0.0.1", 7002)})}, "the bulk lane could not be reached before"),
])
def test_the_bulk_lane_passed_over_is_never_counted(m: Manifest, kw: dict[str, Any], why: str) -> None:
    p = _plan("network", m, **kw)
    assert p.step(BULK) == Step(BULK, why) and p.to_try == (NETWORK,)


def test_a_lane_unreachable_on_another_port_is_still_tried() -> None:
    assert _plan("network", unreachable_lanes=frozenset({("127.0.0.1", 9999)})).step(BULK) == Step(BULK)


def test_under_shm_neither_the_lane_nor_the_router_is_tried() -> None:
    p = _plan("shm")
    assert p.to_try == (SHM_DEVICE, SHM) and p.step(BULK) == Step(BULK, "the weight path is 'shm'")


# ---------------------------------------------------------------------------------------------- manifest checks


def test_a_sound_manifest_passes_with_pending_and_known_checksums() -> None:
    m = _manifest()
    assert check_manifest(m) is m
    assert check_manifest(_manifest(buckets=(_bucket(checksum="crc32:0000abcd"),)))


@pytest.mark.parametrize(("bucket", "fault"), [
    (_bucket(index=1), "bucket 0 has index 1"),
    (_bucket(nbytes=-1, tensors=()), "negative size"),
    (_bucket(tensors=(TensorInfo(name="w", dtype="float32", shape=(9,), offset=0, nbytes=36),)), "does not fit"),
    (_bucket(tensors=(TensorInfo(name="w", dtype="float32", shape=(8,), offset=4, nbytes=32),)), "does not fit"),
    (_bucket(nbytes=40, tensors=(TensorInfo(name="w", dtype="float32", shape=(8,), offset=2, nbytes=32),)), "not aligned to 4"),
    (_bucket(tensors=(TensorInfo(name="w", dtype="float32", shape=(-8,), offset=0, nbytes=32),)), "negative dimension"),
    (_bucket(tensors=(TensorInfo(name="w", dtype="float33", shape=(8,), offset=0, nbytes=32),)), "unknown weight dtype 'float33'"),
    (_bucket(checksum="md5:00"), "checksum algorithm 'md5' cannot be verified here"),
])
def test_a_manifest_that_cannot_be_verified_is_refused_by_name(bucket: BucketInfo, fault: str) -> None:
    with pytest.raises(WeightSyncError, match="manifest of version 3 is invalid") as err:
        check_manifest(_manifest(buckets=(bucket,)))
    assert fault in str(err.value)


def test_the_chunk_size_asked_for_stays_within_the_servers_bounds() -> None:
    assert chunk_bytes_of(_manifest(chunk_bytes=1)) == MIN_CHUNK_BYTES
    assert chunk_bytes_of(_manifest(chunk_bytes=1 << 30)) == MAX_CHUNK_BYTES
    assert chunk_bytes_of(_manifest(chunk_bytes=1 << 20)) == 1 << 20


def test_streams_take_buckets_in_order_and_the_last_ones_are_cut_so_the_streams_finish_together() -> None:
    mib = 1 << 20
    # buckets of 5, 1, 1, 1 chunks over 2 streams: bucket 0 has less than 2x its bytes left after its start, so it is
    # cut in two (both streams start on it, the first bucket a streamed publish makes ready); the rest are whole
    jobs, parts, folded = stream_jobs([5 * mib, mib, mib, mib], mib, 2)
    assert [(b, len(c)) for b, c in jobs] == [(0, 3), (0, 2), (1, 1), (2, 1), (3, 1)]
    assert parts == [2, 1, 1, 1] and folded == [False, True, True, True]
    # 33 equal buckets over 8 streams (the 8B-shaped model): the first 26 whole, the last 7 cut finer toward the end
    jobs, parts, _folded = stream_jobs([64 * mib] * 33, mib, 8)
    assert [b for b, _c in jobs][:26] == list(range(26)) and parts[:26] == [1] * 26
    assert parts[26:] == [2, 2, 2, 2, 3, 4, 8] and sum(len(c) for _b, c in jobs) == 33 * 64
    assert [len(c) for b, c in jobs if b == 32] == [8] * 8
    # empty buckets get no job; a last chunk is the bucket's rest
    jobs, parts, _folded = stream_jobs([0, mib + 5], mib, 1)
    assert jobs == [(1, [(0, mib), (mib, 5)])] and parts == [0, 1]


def test_the_plan_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, rollpool.weights.manifest; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------- where a delta's bytes are read


def _delta(**kw: Any) -> Manifest:
    from rollpool.protocol import DELTA_PATHS_MINOR
    from rollpool.protocol.messages import ShmSegment

    fields: dict[str, Any] = {"delta_base": 2, "delta_shm": ShmSegment(name="rollpool-p-x_delta-1-1", nbytes=65536),
                              "protocol_minor": DELTA_PATHS_MINOR, "cuda_ipc": None}
    fields.update(kw)
    return _manifest(**fields)


def _delta_plan(path: str = "auto", m: Manifest | None = None, **facts: Any) -> Plan:
    from rollpool.weights.manifest import delta_plan

    return delta_plan(m if m is not None else _delta(), _facts(**facts), WeightPathConfig(weight_path=path))


def test_a_delta_in_shared_memory_on_this_host_is_read_there_first_then_the_lane_then_the_router() -> None:
    p = _delta_plan()
    assert p.to_try == (SHM, BULK, NETWORK) and not p.refusal
    assert _delta_plan("shm").to_try == (SHM,)
    assert _delta_plan("network").to_try == (BULK, NETWORK)
    assert _delta_plan("network").step(SHM).why_not == "the weight path is 'network'"


@pytest.mark.parametrize(("m", "facts", "why"), [
    (_delta(delta_shm=None), {}, "the publisher offers no shared memory for this delta"),
    (_delta(), {"host_key": "other"}, "the publisher is on another host (or another /dev/shm)"),
])
def test_a_delta_not_in_shared_memory_here_goes_over_the_network_quietly_and_is_refused_under_shm(m: Manifest, facts: dict[str, Any],
                                                                                                  why: str) -> None:
    p = _delta_plan("auto", m, **facts)
    assert p.to_try == (BULK, NETWORK) and p.step(SHM).why_not == why and not p.step(SHM).counted
    strict = _delta_plan("shm", m, **facts)
    assert strict.refusal == f"weight path 'shm': {why}" and strict.to_try == ()


def test_a_delta_of_a_server_older_than_the_minor_whose_lane_serves_deltas_goes_over_the_router() -> None:
    from rollpool.protocol import DELTA_PATHS_MINOR

    p = _delta_plan("auto", _delta(protocol_minor=DELTA_PATHS_MINOR - 1, delta_shm=None))
    assert p.to_try == (NETWORK,) and "serves no deltas" in p.step(BULK).why_not
    assert _delta_plan("auto", _delta(bulk_port=0)).to_try == (SHM, NETWORK)  # no lane offered at all
