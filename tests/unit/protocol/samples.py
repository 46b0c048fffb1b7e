"""Fixed sample messages: the golden wire fixtures are their encodings."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rollpool import protocol as p


def header_bins(v: Any) -> int:
    """How many msgpack bin values (arrays or blobs inline, minor 12) a decoded header holds."""
    if type(v) is bytes:
        return 1
    if type(v) is list:
        return sum(header_bins(x) for x in v)
    if type(v) is dict:
        return sum(header_bins(x) for x in v.values())
    return 0


def _turn(sample_index: int, turn: int, *, top: bool = False) -> Any:
    return p.RecordedTurn(sample_index=sample_index, turn=turn, request_digest=0x1234_5678_9ABC_DEF0 + turn,
                          output_ids=np.array([11, 12, 2], dtype=np.int32), logprobs=np.array([-0.5, -1.0, -0.25], dtype=np.float32),
                          token_versions=np.array([3, 3, 4], dtype=np.int32), finish_reason="stop", output_text="hi",
                          matched_stop_id=2, first_token_at=1.5, finished_at=2.0,
                          top_ids=np.arange(6, dtype=np.int32) if top else None,
                          top_logprobs=np.full(6, -2.0, dtype=np.float32) if top else None, attempt=0)


def samples() -> dict[str, Any]:
    ids = np.array([1, 2, 3, 50_000], dtype=np.int32)
    traj = p.Trajectory(
        prompt_id="p1",
        sample_index=1,
        input_ids=ids,
        output_ids=np.array([7, 8, 2], dtype=np.int32),
        output_logprobs=np.array([-0.5, -1.25, -0.125], dtype=np.float32),
        token_versions=np.array([3, 3, 4], dtype=np.int32),
        loss_mask=np.array([1, 1, 1], dtype=np.uint8),
        finish_reason="stop",
        worker_id="w0",
        attempt=1,
        output_text="hi",
        finished_at=1.5,
        reward=1.0,
        metadata={"answer": "42"},
        version_epoch=7,
    )
    prompt = p.Prompt(
        prompt_id="p1",
        input_ids=ids,
        group_size=2,
        sampling=p.SamplingParams(max_new_tokens=16, temperature=0.7, top_k=5, stop=("\n",), seed=3),
        priority=1,
        metadata={"answer": "42"},
        min_weight_version=3,
    )
    return {
        "hello": p.Hello(worker_id="w0", protocol_min=1, protocol_max=1, engine="hf", capacity=8, credits=8,
                         weight_version=2, apply_modes=("interrupt", "drain"), fingerprint="abc",
                         inflight=(p.InflightTask(task_id="t1", prompt_id="p1", group_size=2, attempt=1),)),
        "task": p.Task(task_id="t1", prompt=prompt, attempt=1, deadline_s=60.0),
        "result": p.Result(task_id="t1", prompt_id="p1", trajectories=(traj,)),
        "submit": p.Submit(request_id="r1", prompts=(prompt, p.Prompt(prompt_id="p2", text="2+2="))),
        "batch": p.Batch(request_id="r2", epoch="e1",
                         groups=(p.GroupResult(prompt_id="p1", state=p.GroupState.DONE, trajectories=(traj,), attempts=1),
                                 p.GroupResult(prompt_id="p3", state=p.GroupState.FAILED, reason="max_attempts"))),
        "manifest": p.Manifest(request_id="m1", version=4, publisher_id="pub", buckets=(
            p.BucketInfo(index=0, dtype="float32", nbytes=32, checksum="crc32:0badf00d", tensors=(
                p.TensorInfo(name="w", dtype="float32", shape=(2, 4), offset=0, nbytes=32),)),)),
        "chunk": p.Chunk(request_id="c1", version=4, bucket=0, offset=0, data=b"\x00\x01\x02\x03"),
        # minor 1: a streamed manifest (a pending checksum, a shared-memory segment) and a chunk carrying the checksum
        "manifest_request_streamed": p.ManifestRequest(request_id="m2", version=None, streamed=True, host_key="boot/1.2"),
        "manifest_streamed": p.Manifest(request_id="m2", version=5, publisher_id="pub", host_key="boot/1.2", pool="default", buckets=(
            p.BucketInfo(index=0, dtype="float32", nbytes=32, checksum="", shm_segment="rollpool-default-pub-7-1", tensors=(
                p.TensorInfo(name="w", dtype="float32", shape=(2, 4), offset=0, nbytes=32),)),)),
        "chunk_streamed": p.Chunk(request_id="c2", version=5, bucket=0, offset=0, data=b"\x00\x01", checksum="xxh3_64:0123456789abcdef"),
        "error": p.Error(code="protocol", message="bad frame", request_id=None, ref_type="task"),
        # minor 1: dispatch sequence numbers, batched tasks and results, constant-size heartbeats
        "task_seq": p.Task(task_id="t2", prompt=prompt, attempt=0, seq=7),
        "task_batch": p.TaskBatch(tasks=(p.Task(task_id="t2", prompt=prompt, seq=7), p.Task(task_id="t3", prompt=prompt, seq=8))),
        "result_batch": p.ResultBatch(results=(p.Result(task_id="t1", prompt_id="p1", trajectories=(traj,)),
                                               p.Result(task_id="t4", prompt_id="p4", error="boom", retryable=False)), credits=3),
        "worker_heartbeat": p.WorkerHeartbeat(worker_id="w0", weight_version=2, tokens_total=99, epoch="e1", dispatch_seq=8,
                                              free_capacity=5, held_count=2, held_digest=p.held_digest(["t2", "t3"])),
        "worker_heartbeat_full": p.WorkerHeartbeat(worker_id="w0", inflight_task_ids=("t2", "t3"), epoch="e1", dispatch_seq=8,
                                                   free_capacity=5, held_count=2, held_digest=p.held_digest(["t2", "t3"]), held_full=True),
        "broker_heartbeat_send_held": p.BrokerHeartbeat(epoch="e1", weight_version=2, send_held=True, dispatch_seq=8),
        "welcome": p.Welcome(epoch="e1", protocol=1, heartbeat_interval_s=1.0, features=p.FEATURES, dispatch_seq=7),
        # minor 6: a rebase (checkpoint resume) and the version epoch it starts
        "set_version_rebase": p.SetVersion(request_id="v1", version=3, rebase=True),
        "broker_heartbeat_rebased": p.BrokerHeartbeat(epoch="e1", weight_version=3, version_epoch=1767225600000, rebase_version=3),
        "worker_heartbeat_epoch": p.WorkerHeartbeat(worker_id="w0", weight_version=3, epoch="e1", version_epoch=1767225600000),
        # minor 7: a skipped version; top logprobs and input logprobs
        "apply_done_skipped": p.ApplyDone(version=3, ok=False, error="EngineError: q has shape (2,)", skipped=True),
        "result_top_logprobs": p.Result(task_id="t4", prompt_id="p1", trajectories=(dataclasses.replace(
            traj, output_top_ids=np.array([7, 9, 8, 7, 2, 5], dtype=np.int32),
            output_top_logprobs=np.array([-0.5, -2.0, -1.25, -1.5, -0.125, -3.0], dtype=np.float32),
            input_logprobs=np.array([-4.0, -2.5, -0.75], dtype=np.float32)),)),  # from position 1 (no NaN: it never equals itself)
        # minor 8: the trainer's staleness bound, the worker's cancelled tokens
        "set_version_bound": p.SetVersion(request_id="r3", version=5, stale_bound=8),
        "worker_heartbeat_cancelled": p.WorkerHeartbeat(worker_id="w0", weight_version=2, epoch="e1", tokens_cancelled=640),
        # minor 9: the same-GPU weight path (CUDA IPC handles as raw bytes, a GPU checksum per bucket)
        "manifest_request_ipc": p.ManifestRequest(request_id="m3", version=6, streamed=True, host_key="boot/1.2",
                                                  gpu_uuids=("GPU-5f0c",), wait_ipc=True),
        "manifest_cuda_ipc": p.Manifest(request_id="m3", version=6, publisher_id="pub", host_key="boot/1.2", pool="default",
                                        cuda_ipc=p.CudaIpcBuffer(device_uuid="GPU-5f0c", handle=bytes(range(64)), storage_bytes=1 << 20,
                                                                 storage_offset=256, ref_counter_handle=b"/torch_7_1", ref_counter_offset=2,
                                                                 event_handle=bytes(64), event_sync_required=True),
                                        buckets=(p.BucketInfo(index=0, dtype="float32", nbytes=32, checksum="", ipc_offset=0,
                                                              ipc_checksum="mix64:0123456789abcdef", tensors=(
                                            p.TensorInfo(name="w", dtype="float32", shape=(2, 4), offset=0, nbytes=32),)),)),
        # minor 10: the shared-memory path staged to a GPU (a mix64 of each bucket's host bytes)
        "manifest_shm_mix64": p.Manifest(request_id="m4", version=7, publisher_id="pub", host_key="boot/1.2", pool="default",
                                         buckets=(p.BucketInfo(index=0, dtype="bfloat16", nbytes=16, checksum="xxh3_64:0123456789abcdef",
                                                               shm_segment="rollpool-default-pub-7-1", host_mix64="mix64:fedcba9876543210",
                                                               tensors=(p.TensorInfo(name="w", dtype="bfloat16", shape=(8,), offset=0, nbytes=16),)),)),
        # minor 11: the publisher's segments named before its first version (registered ahead by a staging worker)
        "manifest_shm_reserved": p.Manifest(request_id="m5", version=-1, host_key="boot/1.2",
                                            shm_reserved=(p.ShmSegment(name="rollpool-default-pub-7-1", nbytes=1 << 29),
                                                          p.ShmSegment(name="rollpool-default-pub-7-2", nbytes=4096))),
        "announce_shm_generation": p.Announce(version=3, publisher_id="pub", total_bytes=1 << 30, num_buckets=2, shm_generation=4),
        # minor 13: the network path's bulk lane
        "manifest_bulk_port": p.Manifest(request_id="m6", version=8, publisher_id="pub", chunk_bytes=8 << 20, bulk_port=41234,
                                         buckets=(p.BucketInfo(index=0, dtype="bfloat16", nbytes=16, checksum="xxh3_64:0123456789abcdef",
                                                               tensors=(p.TensorInfo(name="w", dtype="bfloat16", shape=(8,), offset=0, nbytes=16),)),)),
        # minor 16: a LoRA adapter version (LORA_MINOR)
        "manifest_adapter": p.Manifest(request_id="m7", version=9, publisher_id="pub",
                                       adapter=p.AdapterSpec(rank=16, alpha=32.0, target_modules=("q_proj", "v_proj"),
                                                             base_fingerprint="0123456789abcdef", base_model="Qwen/Qwen3-8B")),
        # minor 14: the versioned-service contract (a group served only at one exact weight version)
        "submit_exact_version": p.Submit(request_id="r9", prompts=(p.Prompt(prompt_id="p9", text="2+2=", exact_weight_version=5),)),
        # minor 20: the replay of a redelivered episode (REPLAY_MINOR): finished turns streamed, handed to the next attempt
        "turn_records": p.TurnRecords(task_id="p1@0", prompt_id="p1", turns=(_turn(0, 0), _turn(1, 0))),
        "task_replay": p.Task(task_id="p1@1", prompt=prompt, attempt=1, seq=9, replay=(_turn(0, 0), _turn(0, 1, top=True))),
        # minor 12: the minor in hellos and welcomes (inline arrays: `inline_samples`)
        "hello_minor12": p.Hello(worker_id="w0", protocol_min=1, protocol_max=1, engine="hf", capacity=8, credits=8, protocol_minor=12),
        "welcome_minor12": p.Welcome(epoch="e1", protocol=1, heartbeat_interval_s=1.0, features=p.FEATURES, protocol_minor=12),
        "client_hello_minor12": p.ClientHello(client_id="c0", protocol_min=1, protocol_max=1, protocol_minor=12),
        "client_welcome_minor12": p.ClientWelcome(epoch="e1", protocol=1, weight_version=2, protocol_minor=12),
        # minor 19: a parked manifest request (answered once the version carries more GPU checksums) and the server's minor
        "manifest_request_parked": p.ManifestRequest(request_id="m8", version=7, streamed=True, host_key="boot/1.2", after_mix64=3),
        "manifest_server_minor": p.Manifest(request_id="m8", version=7, publisher_id="pub", host_key="boot/1.2", protocol_minor=19),
        # minor 22: the same-GPU ring (RING_MINOR): a ring of slots, a taker's request releasing the buckets below 3
        "manifest_request_ring": p.ManifestRequest(request_id="m9", version=7, streamed=True, host_key="boot/1.2",
                                                   gpu_uuids=("GPU-5f0c",), ring=True, ring_done=3),
        "manifest_ring": p.Manifest(request_id="m9", version=7, publisher_id="pub", host_key="boot/1.2", protocol_minor=22,
                                    cuda_ipc=p.CudaIpcBuffer(device_uuid="GPU-5f0c", handle=bytes(range(64)), storage_bytes=1 << 21,
                                                             ring_slots=2),
                                    buckets=(p.BucketInfo(index=0, dtype="float32", nbytes=32, checksum="", ipc_offset=1 << 20,
                                                          ipc_checksum="mix64:0123456789abcdef"),)),
        # minor 23: a whole-model version published after adapter version 9, which stays on under it (ADAPTER_ON_MINOR)
        "manifest_adapter_on": p.Manifest(request_id="m10", version=11, publisher_id="pub", protocol_minor=23, adapter_on=9,
                                          buckets=(p.BucketInfo(index=0, dtype="float32", nbytes=32, checksum="xxh3_64:0123456789abcdef",
                                                                tensors=(p.TensorInfo(name="w", dtype="float32", shape=(8,), offset=0, nbytes=32),)),)),
        # minor 24: an adapter version published over whole-model version 10, its base (BASE_ON_MINOR)
        "manifest_base_on": p.Manifest(request_id="m11", version=12, publisher_id="pub", protocol_minor=24, base_on=10,
                                       adapter=p.AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj",)),
                                       buckets=(p.BucketInfo(index=0, dtype="float32", nbytes=32, checksum="xxh3_64:0123456789abcdef",
                                                             tensors=(p.TensorInfo(name="w", dtype="float32", shape=(8,), offset=0, nbytes=32),)),)),
        # minor 25: named policies (POLICY_MINOR): a prompt naming an adapter, the adapter a version serves, a trajectory saying it
        "submit_policy": p.Submit(request_id="r10", prompts=(p.Prompt(prompt_id="p10", text="2+2=", policy="math-lora"),)),
        "set_version_adapter": p.SetVersion(request_id="r11", version=13, adapter_since=12,
                                            adapter=p.AdapterSpec(rank=16, alpha=32.0, target_modules=("q_proj", "v_proj"),
                                                                  base_model="Qwen/Qwen3-8B", name="math-lora")),
        "batch_policy": p.Batch(request_id="r12", epoch="e1", groups=(p.GroupResult(prompt_id="p1", state=p.GroupState.DONE, attempts=1,
                                                                                    trajectories=(dataclasses.replace(traj, policy="math-lora"),)),)),
        # minor 26: a delta whose encoded bytes lie in the publisher's shared memory (DELTA_PATHS_MINOR)
        "manifest_delta_shm": p.Manifest(request_id="m12", version=14, publisher_id="pub", host_key="boot/1.2", protocol_minor=26,
                                         delta_base=13, delta_shm=p.ShmSegment(name="rollpool-default-pub_delta-o0123456789abcdef-1", nbytes=4096),
                                         buckets=(p.BucketInfo(index=0, dtype="bfloat16", nbytes=32, checksum="xxh3_64:0123456789abcdef",
                                                               encoding="gaps", delta_nbytes=8, delta_checksum="xxh3_64:fedcba9876543210",
                                                               tensors=(p.TensorInfo(name="w", dtype="bfloat16", shape=(16,), offset=0, nbytes=32),)),)),
        # minor 28: a delta asker that verifies on its GPU by the mix64 of the resulting bytes (EARLY_DELTA_MINOR), and the
        # early delta it may get: a bucket's checksum still pending, its host_mix64 there
        "manifest_request_device_verify": p.ManifestRequest(request_id="m13", version=15, streamed=True, delta_base=14, device_verify=True),
        "manifest_delta_early": p.Manifest(request_id="m13", version=15, publisher_id="pub", protocol_minor=28, delta_base=14,
                                           buckets=(p.BucketInfo(index=0, dtype="bfloat16", nbytes=32, checksum="", host_mix64="mix64:0123456789abcdef",
                                                                 encoding="gaps", delta_nbytes=8, delta_checksum="xxh3_64:fedcba9876543210",
                                                                 tensors=(p.TensorInfo(name="w", dtype="bfloat16", shape=(16,), offset=0, nbytes=32),)),)),
        # minor 29: several tasks' finished episode turns in one message (TURN_BATCH_MINOR)
        "turn_record_batch": p.TurnRecordBatch(records=(p.TurnRecords(task_id="p1@0", prompt_id="p1", turns=(_turn(0, 0), _turn(1, 0))),
                                                        p.TurnRecords(task_id="p2@1", prompt_id="p2", turns=(_turn(0, 1, top=True),)))),
    }


INLINE = "@inline"
"""A golden fixture's name ending in this is `inline_samples()[name]` encoded with the default `p.Inline()`."""


def inline_samples() -> dict[str, Any]:
    """Minor 12: messages whose small arrays and blobs travel inline in the header (a msgpack bin); an array
    referenced twice in one message (the prompt of both tasks of `task_batch`) still travels once, in a frame."""
    s = samples()
    return {name + INLINE: s[name] for name in ("task", "task_batch", "result", "result_batch", "submit", "batch", "chunk",
                                                "result_top_logprobs", "turn_records", "task_replay", "turn_record_batch")}
