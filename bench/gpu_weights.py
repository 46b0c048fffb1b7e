"""Weight updates at real model sizes on one H200: every path, both peers, JSON after every version.

Two device calls of at most 10 minutes each:

    run one:  PYTHONPATH=/tmp/site:. python3 bench/gpu_weights.py --run 8b  --out $OUT   -> h200-weights-8b.json
    run two:  PYTHONPATH=/tmp/site:. python3 bench/gpu_weights.py --run 1p4 --out $OUT   -> h200-weights-1p4.json
    (on an H100 the files are named h100-weights-*.json)

What publishing costs the trainer (8B on an 80 GB card, the trainer holding an optimizer-sized allocation too):

    PYTHONPATH=/tmp/site:. python3 bench/gpu_weights.py --run 8b --out $OUT --skip-peers --skip-raw --no-cuda-graph \
        --optimizer-gib 8 --rows cuda_ipc_cuda,shm_cpu,tcp_cpu

The same-GPU ring within the default GPU budget (two 512 MiB buckets: the 8B version is 27 buckets, so no whole-version
arena fits and it streams through a ring of two slots), beside the shm row from the same CUDA tensors, the trainer
holding an optimizer-sized 8 GiB too:

    PYTHONPATH=/tmp/site:. python3 bench/gpu_weights.py --run 8b --out $OUT --skip-peers --skip-raw --no-cuda-graph \
        --optimizer-gib 8 --rows shm_cuda,cuda_ipc_cuda

The row ``ring_only_cuda`` (only when named in ``--rows``) is the same GPU at ``keep_versions=0``: the ring alone, no
host snapshot beside it (the trainer's call returns once the worker copied every bucket out; no other peer can fetch
the version). Side by side in one run:

    PYTHONPATH=/tmp/site:. python3 bench/gpu_weights.py --run 8b --out $OUT --skip-peers --skip-raw --no-cuda-graph \
        --optimizer-gib 8 --rows shm_cuda,cuda_ipc_cuda,ring_only_cuda

The JSON's ``same_gpu_ipc_paths_taken`` says which ran (``cuda_ipc``: an arena; ``cuda_ipc_ring``: the ring),
``ipc_extra_gpu_bytes`` the trainer's extra GPU memory (peak over versions) and ``ipc_gpu_budget_peak_bytes`` the
budget's peak; ``goals`` holds ``same_gpu_ipc_s`` (<= 0.5), ``same_gpu_trainer_blocked_s`` (<= 0.3) and
``ipc_extra_gpu_bytes`` (<= 2 buckets), each "not measured" unless every version of the row came over the same GPU.

Delta versions at 8B (docs/weights.md "Delta versions"; the full rows beside them, one engine start):

    PYTHONPATH=/tmp/site:. python3 bench/gpu_weights.py --run 8b --out $OUT --skip-peers --skip-raw --no-cuda-graph \
        --rows tcp_cuda,tcp_cuda_delta,shm_cuda,shm_cuda_delta

The delta rows' versions are `sparse_step`s (--delta-fraction of the bf16 elements, 0.0215 by default); the JSON
gains changed_fraction, delta_bytes_fraction, delta_host_path_s, delta_shm_path_s, delta_trainer_blocked_s and
their goals. The ``_delta_device`` rows (tcp_cuda_delta_device, shm_cuda_delta_device) are the same with the
publisher's GPU budget raised for the row to hold the device delta base (`rollpool.weights.delta_device`: 1 x the
model's bytes plus its scratch), so the changed elements are found on the trainer's GPU; every version records the
path its delta took (``delta_made_on``: device or host, ``why_not_delta_on_device``), and the JSON gains
delta_device_host_path_s, delta_device_shm_path_s, delta_device_trainer_blocked_s, delta_device_made_on and
delta_device_phases beside the host rows' keys:

    PYTHONPATH=/tmp/site:. python3 bench/gpu_weights.py --run 8b --out $OUT --skip-peers --skip-raw --no-cuda-graph \
        --streams 8 --chunk-mib 8 --rows tcp_cuda,shm_cuda,tcp_cuda_delta,tcp_cuda_delta_device,shm_cuda_delta,shm_cuda_delta_device

Where the worker rebuilds them (``delta_rebuilt_on`` per version, from its ``sglang apply`` line): on its engine's GPU,
in place, from the version it kept there (``weight_delta_on_device``, the default: the delta's encoded bytes go to the
GPU, are decoded and scattered there and every bucket is verified there against the manifest's mix64 of the resulting
bytes), else on the host. The rows and keys of the GPU rebuild, beside the full rows and the host rebuild's baseline:

    PYTHONPATH=/tmp/site:. python3 bench/gpu_weights.py --run 8b --out $OUT --skip-peers --skip-raw --no-cuda-graph \
        --streams 8 --chunk-mib 8 --rows tcp_cuda,shm_cuda,tcp_cuda_delta_device,shm_cuda_delta_device

    -> delta_device_host_path_s (<= 0.35), delta_device_shm_path_s (<= 0.25), delta_device_rebuilt_on (per row: where
       versions 3..N were rebuilt), delta_device_rebuild_s, goals.delta_device_* (met only when every steady version
       was rebuilt on the GPU, rebuilt_goal); the host rebuild's baseline: the same with --worker-delta-host.

A goal is reported only for the path its row meant (`path_goal`): a row whose versions went over another path says
``"met": null`` and ``"not_measured"``, with the paths taken and every fallback's reason (the worker's, per fetch, and
the publisher's ``publisher_path_note``: why it offered no device buffer, e.g. its GPU budget).

(``bash .sgkit/install.sh .sgkit /tmp/site`` first, as for bench/gpu_sglang.py.)

Run one: a Llama-3-8B-shaped random model (hidden 4096, 32 layers, intermediate 14336, 32 heads, 8 KV
heads, vocab 32000: 7.2 B parameters, 14.5 GB bf16), built on the GPU and saved once. Broker, one
worker (its `sglang` engine starts SGLang as its child) and this process as the trainer, all separate
processes, on one engine start; the trainer's tensors live on the GPU (every version from CUDA
tensors). Paths, each for ``--versions`` (>= 6) versions:

- ``tcp``: the publisher offers no segments (``set_path("network")``), so the worker fetches over
  ZeroMQ tcp with ``ROLLPOOL_WEIGHT_STREAMS`` streams (``--streams``, 4 by default) and as many I/O threads in
  both processes' contexts (the worker's from ``WorkerConfig.weights.streams``), ``--chunk-mib`` chunks;
- ``shm``: the publisher's buckets are shared-memory segments (page-locked by cudaHostRegister);
  the worker maps them (no bucket byte on a socket); the publisher on path ``shm`` (no device buffer offered).
  Since protocol minor 10 the publisher also publishes a mix64 of each bucket's host bytes (summed on its GPU as
  it copies), and the worker, whose SGLang engine stages to CUDA (its default; ``--shm-cpu-copy`` turns it off), maps
  and registers the publisher's segments ahead of the first version (minor 11: the manifests name them; the row waits,
  bounded by ``--register-wait-s``, for its ``weight segments registered`` and ``weights reserved`` lines), copies each
  bucket host-to-device straight from the segment and verifies the mix64 of its device copy on the GPU
  (``staged_to`` in the row; a counted fallback to the CPU copy + checksum otherwise);
- ``cuda_ipc``: the publisher on ``auto``: the worker's hello named the GPU it sees, so the publisher snapshots
  the CUDA tensors device-to-device into an exported arena and the worker (on ``auto``) copies from it
  device-to-device and verifies the GPU checksum of its copy, which SGLang then maps (``same_gpu_ipc_s``). When the
  arena would pass the publisher's GPU budget (``--gpu-budget-mib``; default two buckets) the version streams through
  the same-GPU ring instead (two bucket-sized slots; the worker's line says ``cuda_ipc_ring``).

Per version: every tensor changes (the "optimizer step" adds +-0.01 to every tensor right after
``publish_weights`` returns); the expected checksum of every bucket is computed from the tensors'
bytes before the call and compared with the published manifest afterwards (a torn snapshot would
differ); times: trainer blocked (the ``publish_weights`` call, any event wait included), publish ->
applied, pause, fetch split (from the engine's ``sglang apply`` log line and the subscriber's
``weights fetched`` line; on the staged shm path its ``timeline``, kept as ``fetch_timeline``: per bucket when its GPU
checksum was seen, its copy queued, its digest back and verified, and every wait between), the stalls over 5 ms of
this process's event loop (the publisher serves from it: ``trainer_loop_lags_ms``); bytes served by the
publisher's sockets and the worker's received/shm bytes (``bytes_moved_per_version``). Then the peers, in a child
process with its own ``sglang.Engine`` on the same model: ``update_weights_from_disk`` (page cache warm, median of 3:
``disk_peer_s``) and ``update_weights_from_tensor`` from CUDA tensors in process (CUDA IPC, median
of 3: ``cuda_ipc_limit_s``). And the limit of the network path: raw pyzmq tcp with 4 streams
(``raw_tcp_4stream_gbps``).

Run two: the 1.4 GB model of bench/gpu_sglang.py through tcp and shm, from CUDA tensors and from CPU
tensors (``*_cpu`` rows), and its peers.

The goals (docs/weights.md) are computed into ``goals`` at the end; every figure says how it was
obtained in ``how``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(".")
RESULT: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": {}, "how": {}}
RESULT_NAME = "h200-weights-8b.json"
_MiB = 1024 * 1024

SHAPES = {
    "8b": {"vocab": 32000, "hidden": 4096, "layers": 32, "intermediate": 14336, "heads": 32, "kv_heads": 8},
    "1p4": {"vocab": 32000, "hidden": 2048, "layers": 16, "intermediate": 5632, "heads": 32, "kv_heads": 8},
}


def note(msg: str) -> None:
    print(f"[gpu_weights {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save() -> None:
    (OUT / RESULT_NAME).write_text(json.dumps(RESULT, indent=1, default=str))


def setup_env() -> None:
    kit = ROOT / ".sgkit"
    if kit.exists():
        sys.path.insert(0, str(kit))
        import smoke  # the kit's environment recipe: CUDA_HOME, JIT caches, multicast off

        smoke.setup_env()


# --------------------------------------------------------------------------- the model


def llama_names(shape: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    kv = h // shape["heads"] * shape["kv_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(shape["layers"]):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def build_model(work: Path, which: str) -> tuple[Path, int]:
    """A random Llama of the given shape, written once (weights drawn on the GPU, saved as one safetensors file)."""
    import torch
    from safetensors.torch import save_file

    from rollpool.workers.engines.tiny_model import build_tiny_model

    shape = SHAPES[which]
    out = work / f"llama-{which}"
    names = llama_names(shape)
    model_bytes = sum(2 * _numel(s) for _, s in names)
    if (out / "rollpool_built").exists():
        return out, model_bytes
    build_tiny_model(out, vocab=shape["vocab"], hidden=64, layers=1, heads=4, kv_heads=2)  # the tokenizer and a config to edit
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
               num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
               torch_dtype="bfloat16", dtype="bfloat16", tie_word_embeddings=False, max_position_embeddings=4096)
    cfg.pop("head_dim", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {}
    for name, s in names:
        if name.endswith("norm.weight"):
            sd[name] = torch.ones(s, dtype=torch.bfloat16)
        else:
            sd[name] = (torch.randn(s, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "rollpool_built").write_text("1")
    return out, model_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def load_on(model: Path, device: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: t.to(device) for k, t in load_file(str(model / "model.safetensors")).items()}


# --------------------------------------------------------------------------- the raw limit


def _raw_sender(endpoints: list[str], nbytes: int, chunk: int) -> None:
    import numpy as np
    import zmq

    ctx = zmq.Context(io_threads=len(endpoints))
    socks = []
    for ep in endpoints:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        socks.append(s)
    buf = memoryview(np.ones(chunk, dtype=np.uint8))
    per = nbytes // len(socks)

    def pump(s: Any) -> None:
        for _ in range(per // chunk):
            s.send(buf, copy=False)

    ts = [threading.Thread(target=pump, args=(s,)) for s in socks]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for s in socks:
        s.close(linger=60_000)  # queued frames still go out (linger 0 dropped them: the receiver then waited forever)
    ctx.term()


def raw_tcp_gbps(streams: int = 4, nbytes: int = 8 << 30, chunk: int = 4 * _MiB) -> float:
    """Raw pyzmq PUSH -> PULL over `streams` tcp connections (one I/O thread each), receiver copying every frame."""
    import multiprocessing as mp

    import numpy as np
    import zmq

    ctx = zmq.Context(io_threads=streams)
    pulls, eps = [], []
    for _ in range(streams):
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 60_000)  # a sender that dies raises zmq.Again here instead of hanging the run
        port = s.bind_to_random_port("tcp://127.0.0.1")
        pulls.append(s)
        eps.append(f"tcp://127.0.0.1:{port}")
    dsts = [np.empty(chunk, dtype=np.uint8) for _ in range(streams)]
    counts = [nbytes // streams // chunk] * streams
    proc = mp.get_context("spawn").Process(target=_raw_sender, args=(eps, nbytes, chunk), daemon=True)

    errors: list[BaseException] = []

    def drain(i: int) -> None:
        try:
            for _ in range(counts[i]):
                f = pulls[i].recv(copy=False)
                dsts[i][: len(f.buffer)] = np.frombuffer(f.buffer, dtype=np.uint8)
        except zmq.Again as exc:
            errors.append(exc)

    proc.start()
    pulls[0].recv(copy=False)  # the clock starts at the first frame (not at the sender's start-up)
    counts[0] -= 1
    t0 = time.perf_counter()
    ts = [threading.Thread(target=drain, args=(i,)) for i in range(streams)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    for s in pulls:
        s.close(linger=0)
    ctx.term()
    if errors:
        raise RuntimeError(f"raw tcp probe: {len(errors)} stream(s) got no frame for 60 s")
    return round(sum(counts) * chunk / dt / 1e9, 3)


def _raw_socket_sender(ports: list[int], nbytes: int, chunk: int) -> None:
    import socket

    buf = memoryview(bytearray(b"\1" * chunk))
    per = nbytes // len(ports)

    def pump(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            for _ in range(per // chunk):
                s.sendall(buf)

    ts = [threading.Thread(target=pump, args=(p,)) for p in ports]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def raw_socket_gbps(streams: int = 8, nbytes: int = 8 << 30, chunk: int = 8 * _MiB) -> float:
    """Plain TCP (what the bulk lane uses, minor 13): `streams` connections from a child process, the receiver's
    threads `recv_into` one reused buffer each; the clock from the first byte to the last."""
    import multiprocessing as mp
    import socket

    listeners = []
    for _ in range(streams):
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        ls.settimeout(60)
        listeners.append(ls)
    per = nbytes // streams // chunk * chunk
    proc = mp.get_context("spawn").Process(target=_raw_socket_sender, args=([ls.getsockname()[1] for ls in listeners], nbytes, chunk),
                                           daemon=True)
    proc.start()
    conns = [ls.accept()[0] for ls in listeners]
    starts: list[float] = []

    def drain(c: socket.socket) -> None:
        c.settimeout(60)
        dst = memoryview(bytearray(chunk))
        got = c.recv_into(dst)
        starts.append(time.perf_counter())
        while got < per:
            n = c.recv_into(dst[: min(chunk, per - got)])
            if n == 0:
                raise RuntimeError("raw socket probe: the sender closed early")
            got += n

    ts = [threading.Thread(target=drain, args=(c,)) for c in conns]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - min(starts)
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    for c in conns + listeners:
        c.close()
    return round(per * streams / dt / 1e9, 3)


# --------------------------------------------------------------------------- processes


_CHILDREN: list[subprocess.Popen[bytes]] = []


def _spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    fh = log_path.open("ab")
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env={**os.environ, **(env or {})}, stdout=fh,
                            stderr=subprocess.STDOUT, start_new_session=True)
    _CHILDREN.append(proc)
    return proc


def start_watchdog(deadline_s: float) -> None:
    """Save what there is, stop the children and exit before the device call's limit cuts the run."""

    def fire() -> None:
        time.sleep(deadline_s)
        RESULT["watchdog"] = f"the run was stopped by its own {deadline_s:.0f} s deadline (--deadline-s)"
        with contextlib.suppress(Exception):
            summarize()
        save()
        note(RESULT["watchdog"])
        for proc in _CHILDREN:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, 9)
        os._exit(3)

    threading.Thread(target=fire, daemon=True, name="watchdog").start()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, 9)


def _started(fetched: dict[str, Any], t_pub: float) -> float | None:
    """When the worker's staged fetch began, seconds after the publish (its ``weights fetched`` line's timeline)."""
    tl = fetched.get("timeline")
    if not tl or "at" not in fetched:
        return None
    return round(fetched["at"] - tl["total_ms"] / 1000 - t_pub, 4)


class LoopLag:
    """The bench process's event loop (the publisher serves the worker's requests from it): each stall over 5 ms since
    `begin` (ms after it, and how long), so a slow version can be told from a publisher that did not answer."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.lags: list[tuple[float, float]] = []
        self.task: asyncio.Task[None] | None = None

    def begin(self) -> None:
        loop = asyncio.get_running_loop()
        self.t0, self.lags = loop.time(), []
        if self.task is None:
            self.task = loop.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.001)
            late = loop.time() - t - 0.001
            if late > 0.005:
                self.lags.append((round((t - self.t0) * 1000, 1), round(late * 1000, 1)))


_REFUSALS = ("Loaded weights leave no GPU memory", "Not enough memory", "CUDA out of memory")


def engine_refused(worker_log: Path) -> str:
    """The line of the worker's log that says its SGLang cannot start at these settings ('' if none): the worker
    retries the start every 30 s, which would only run the bench into its deadline."""
    if not worker_log.exists():
        return ""
    for line in worker_log.read_text(errors="replace").splitlines():
        if any(r in line for r in _REFUSALS):
            return line.strip()[:500]
    return ""


def _json_lines(log_path: Path, marker: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if marker in line:
            with contextlib.suppress(ValueError):
                d = json.loads(line[line.index(marker) + len(marker):])
                out[int(d["version"])] = d
    return out


def _json_lines_all(log_path: Path, marker: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in log_path.read_text(errors="replace").splitlines():
        if marker in line:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line[line.index(marker) + len(marker):]))
    return out


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- the trainer's checks


def expected_checksums(sd: dict[str, Any], bucket_bytes: int) -> list[str]:
    """Every bucket's checksum computed from the tensors' own bytes now (before publish), one bucket buffer reused."""
    import torch

    from rollpool.weights.bucketing import BucketPlanner, Checksummer, dtype_name, flat_bytes, tensor_bytes

    planner = BucketPlanner(bucket_bytes)
    for name, t in sd.items():
        planner.place(name, dtype_name(t.dtype), tuple(t.shape), tensor_bytes(t))
    buf = torch.empty(max((b.nbytes for b in planner.buckets), default=0), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    out = []
    for b in planner.buckets:
        for ti in b.tensors:
            buf[ti.offset : ti.offset + ti.nbytes].copy_(flat_bytes(sd[ti.name]))
        s = Checksummer()
        s.update(buf[: b.nbytes].numpy())
        out.append(s.hexdigest())
    return out


def sparse_step(sd: dict[str, Any], v: int, fraction: float) -> None:
    """The delta rows' step: `fraction` of each tensor's bf16 elements, scattered at random, move to a neighbouring bf16
    value (their 16-bit pattern +-1, alternating by version), the rest stay bit-identical. A stand-in for AdamW at an
    RL learning rate, whose fp32 master weights and moments (16 bytes a parameter) do not fit one card beside the 8B
    engine; `fraction` defaults to the changed fraction bench/weights.py --delta measured for AdamW at lr 1e-6."""
    import torch

    gens: dict[Any, Any] = {}
    with torch.no_grad():
        for t in sd.values():
            if t.dtype != torch.bfloat16:
                continue
            g = gens.setdefault(t.device, torch.Generator(device=t.device).manual_seed(v))
            w = t.view(torch.int16).view(-1)
            mask = torch.rand(w.shape, generator=g, device=w.device) < fraction
            # kernels queued, no host sync (as an optimizer's step): `w[mask] += 1` counts the mask on the host first,
            # which held the bench's event loop, and with it the publisher, ~0.1 s per version at 8B on an H100
            w.add_(mask.to(torch.int16), alpha=1 if v % 2 else -1)


DELTA_PHASES = ("delta_compare_s", "delta_encode_s", "delta_pin_s", "delta_checksum_s", "delta_made_s", "delta_after_complete_s",
                "delta_ready_after_publish_s", "early_delta_ready_after_publish_s", "early_mix_s", "early_called_after_publish_s", "early_landed_after_publish_s", "early_parts_after_publish_s", "delta_shm_write_s", "manifest_after_publish_s", "manifest_wait_s", "fetch_s", "rebuild_s", "verify_s",
                "rebuild_after_fetch_s", "delta_total_s")


def row_name(path: str, on: str, delta: bool | str) -> str:
    """``tcp_cuda``, ``tcp_cuda_delta`` (deltas, made where the budget as given allows), ``tcp_cuda_delta_device``
    (deltas, the budget raised to hold the device base)."""
    return f"{path}_{on}" + ("_delta" if delta else "") + ("_device" if delta == "device" else "")


def device_base_bytes(sd: dict[str, Any], bucket_bytes: int) -> int:
    """What the publisher's device delta base costs for this model (`DeviceBase.need_bytes` of its buckets)."""
    from rollpool.protocol.messages import BucketInfo
    from rollpool.weights.delta_device import DeviceBase
    from rollpool.weights.snapshot import plan_version

    _items, _places, planner = plan_version(sd, bucket_bytes, None)
    return DeviceBase.need_bytes([BucketInfo(index=b.index, dtype=b.dtype, nbytes=b.nbytes, checksum="", tensors=tuple(b.tensors))
                                  for b in planner.buckets])


def served_delta(served: Any) -> Any:
    """The delta a version is served with when the worker applied it: the complete one, or (a device-made delta served
    early, minor 28) the early one, which holds its phases until the complete delta replaces it. The complete one
    alone is absent at apply time on every early-served version but a row's first (applied after it), so reading only
    it would leave the steady versions' server phases (`early_mix_s` among them) None."""
    if served is None:
        return None
    return served.delta or served.early


def delta_phases(made: Any, f: dict[str, Any], t_pub: float) -> dict[str, Any]:
    """Where a delta version's time went: the server's phases (`WeightServer.note_delta`: compare, encode and checksum
    seconds summed over the buckets, the delta made from its first bucket's encode and from the version's last
    checksum, ready after publish, and served early: before the version's host copy was checksummed, to workers that
    verify on their GPU) and the worker's (its ``weights fetched`` line: the manifest in hand after publish
    and its wait, the encoded bytes' fetch, the rebuild and its checksum summed over the buckets, what the rebuild
    added after the fetch, the whole delta fetch)."""
    tm = dict(made.timings) if made is not None else {}
    out: dict[str, Any] = {"delta_compare_s": tm.get("compare_s"), "delta_encode_s": tm.get("encode_s"),
                           # of delta_encode_s: allocating the page-locked host buffers of a device delta's payloads
                           "delta_pin_s": tm.get("pin_s"), "delta_checksum_s": tm.get("checksum_s"),
                           "delta_made_s": tm.get("delta_made_s"), "delta_after_complete_s": tm.get("delta_after_complete_s"),
                           "delta_ready_after_publish_s": round(tm["made_at"] - t_pub, 4) if "made_at" in tm else None,
                           # a device-made delta served before the version's host copy was checksummed (minor 28), to
                           # workers that verify on their GPU: when it was (None: it was not served early)
                           "early_delta_ready_after_publish_s": round(tm["early_at"] - t_pub, 4) if "early_at" in tm else None,
                           "early_mix_s": tm.get("early_mix_s"),  # of which: the mix64 of the resulting bytes, on the publisher's GPU
                           # the early delta's steps after publish: the mix64 in hand (serve_early_delta called), the
                           # last payload on the host, every part checksummed
                           **{f"early_{k[:-3]}_after_publish_s": round(tm[k] - t_pub, 4) if tm.get(k) else None
                              for k in ("called_at", "landed_at", "parts_at")},
                           # and: the encoded bytes written to a shared-memory segment (a publisher whose versions are there)
                           "delta_shm_write_s": tm.get("shm_write_s"),
                           "manifest_after_publish_s": round(f["manifest_at"] - t_pub, 4) if "manifest_at" in f else None,
                           "manifest_wait_s": f.get("manifest_s")}
    for k in ("fetch_s", "rebuild_s", "verify_s", "rebuild_after_fetch_s", "delta_total_s"):
        out[k] = f.get(k)
    return out


def optimizer_step(sd: dict[str, Any], v: int) -> None:
    """Every tensor changes: +-0.01 (alternating, so magnitudes stay put), right after publish returns."""
    import torch

    with torch.no_grad():
        torch._foreach_add_(list(sd.values()), 0.01 if v % 2 else -0.01)


ROWS: list[tuple[str, str, bool | str]] = [("tcp", "cuda", False), ("shm", "cuda", False), ("cuda_ipc", "cuda", False), ("tcp", "cpu", False),
                                           ("shm", "cpu", False)]
DELTA_ROWS: list[tuple[str, str, bool | str]] = [("tcp", "cuda", True), ("shm", "cuda", True), ("tcp", "cuda", "device"), ("shm", "cuda", "device")]


TORCH_DIFF_ROW = "the bench's _torchdiff row (the torch ops compare)"
"""What `diff_kernel.switch_off` is told for a ``_torchdiff`` row (a row after it turns them back on)."""


def select_rows(names: str, *, delta: bool = False) -> list[tuple[str, str, bool | str]]:
    """The rows of a run: every row (`ROWS`, and `DELTA_ROWS` with `delta`), or those `names` (comma-separated) names in
    its order. ``tcp_cpu_stepN`` / ``shm_cpu_stepN`` is the CPU row again with the trainer's step on N threads (0: no
    step), a diagnostic beside the row itself in the same engine start: its figures are its own, not the goals'.
    ``tcp_cuda_delta_device_torchdiff`` / ``shm_cuda_delta_device_torchdiff`` is the device delta row with the
    publisher's diff kernels switched off (`rollpool.weights.diff_kernel`: the torch ops compare), the before of an
    in-run before/after, likewise its own figure."""
    rows = [*ROWS, *(DELTA_ROWS if delta else [])]
    if not names:
        return rows
    by_name = {row_name(*r): r for r in [*ROWS, *DELTA_ROWS, ("ring_only", "cuda", False)]}
    out: list[tuple[str, str, bool | str]] = []
    for n in names.split(","):
        base, _, threads = n.partition("_step")
        if threads.isdigit() and base in ("tcp_cpu", "shm_cpu"):
            path, _on, flag = by_name[base]
            out.append((path, f"cpu@{int(threads)}", flag))
        elif n.endswith("_delta_device_torchdiff") and n.removesuffix("_torchdiff") in by_name:
            path, on, flag = by_name[n.removesuffix("_torchdiff")]
            out.append((path, f"{on}@torchdiff", flag))
        elif n in by_name:
            out.append(by_name[n])
    return out


def _cpu_step(threads: int | None, step: Any, step_args: tuple[Any, ...]) -> None:
    """The CPU row's trainer step, on torch's intra-op threads (all cores by default) or on `threads` of them."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        step(*step_args)
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- the pool


async def pool_stage(model: Path, model_bytes: int, args: argparse.Namespace, rows: list[tuple[str, str, bool | str]]) -> None:
    """One engine start; `rows` = [(path, tensors_on, delta)], each for args.versions versions (delta: the publisher
    offers delta versions and every version is a `sparse_step`; the worker asks for deltas on every row when any row
    is a delta row: a publisher with them off answers full versions)."""
    import torch
    import zmq.asyncio

    from rollpool.protocol.sockets import SocketFactory
    from rollpool.trainer_client.client import TrainerClient, TrainerClientConfig
    from rollpool.weights import diff_kernel
    from rollpool.weights.publisher import WeightPublisher

    wep, cep, sg_port = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}", _port()
    broker = _spawn(["rollpool.broker", "--worker-endpoint", wep, "--client-endpoint", cep, "--batch-size", "256",
                     "--max-staleness", "1000", "--max-applying", "1", "--task-timeout-s", "3600", "--log-level", "WARNING"],
                    OUT / "broker.log")
    worker_log = OUT / "worker.log"
    opts = f"port={sg_port},capacity={args.capacity},mem_fraction_static={args.mem_fraction},log_dir={OUT},context_length=2048"
    if args.no_cuda_graph:  # a shorter engine start (no graph capture); the weight path is the same (weights update in place)
        opts += ',server_args={"disable_cuda_graph":true}'
    # the worker's ZeroMQ context gets one I/O thread per stream from ROLLPOOL_WEIGHT_STREAMS (WorkerConfig.weights.streams)
    wenv = {"ROLLPOOL_WEIGHT_PATH": "auto", "ROLLPOOL_WEIGHT_STREAMS": str(args.streams),
            "ROLLPOOL_WEIGHT_RESERVE_BYTES": str(model_bytes)}  # the worker reserves its 2 page-locked versions at start
    if any(delta for _p, _o, delta in rows):
        wenv["ROLLPOOL_WEIGHT_DELTA"] = "1"
        # the worker rebuilds a delta on its engine's GPU (the version it applied kept there: weight_delta_on_device, on by
        # default) where the delta carries the mix64 of its resulting bytes; --worker-delta-host: on the host, as before
        wenv["ROLLPOOL_WEIGHT_DELTA_ON_DEVICE"] = "0" if args.worker_delta_host else "1"
    if args.shm_cpu_copy:  # the shm row through the CPU copy + CPU checksum (the staged-to-GPU path is the default)
        wenv["ROLLPOOL_WEIGHT_SHM_TO_DEVICE"] = "0"
    # the trainer's GPU memory (its model, an optimizer's state) is taken before the worker's SGLang starts: SGLang sizes
    # its KV cache from the memory free before and after its own model load, so a trainer allocating during that load
    # counts as SGLang's weights (seen on the H100 with --optimizer-gib 8: "Loaded weights leave no GPU memory for the
    # KV cache under --mem-fraction-static=0.3", retried every 30 s until the deadline)
    sd_cuda = load_on(model, "cuda")
    held = None
    if args.optimizer_gib > 0:  # the trainer's optimizer state on the same GPU, held for the whole run
        held = torch.empty(int(args.optimizer_gib * (1 << 30)), dtype=torch.uint8, device="cuda")
        RESULT["optimizer_bytes_held"] = int(held.numel())
    torch.cuda.synchronize()
    t_spawn = time.time()
    worker = _spawn(["rollpool.workers", "--broker", wep, "--engine", "sglang", "--model", str(model), "--worker-id", "sg0",
                     "--engine-options", opts, "--apply-mode", "interrupt", "--window-chunks", "16", "--log-level", "INFO"], worker_log, wenv)
    zctx = zmq.asyncio.Context(io_threads=args.streams)
    lag = LoopLag()
    from rollpool.weights.config import WeightPathConfig

    budget = None if args.gpu_budget_mib is None else args.gpu_budget_mib * _MiB
    pub = WeightPublisher(SocketFactory(zctx), router_endpoint=f"tcp://127.0.0.1:{_port()}", pub_endpoint=f"tcp://127.0.0.1:{_port()}",
                          keep_versions=2, bucket_bytes=args.bucket_mib * _MiB, chunk_bytes=args.chunk_mib * _MiB, path="auto", pool="bench",
                          weights=dataclasses.replace(WeightPathConfig.from_env(), publisher_gpu_budget_bytes=budget))
    RESULT["bucket_bytes"] = args.bucket_mib * _MiB
    RESULT["publisher_gpu_budget_bytes"] = pub.gpu_budget.budget
    t = time.time()
    pub.reserve({k: v for k, v in sd_cuda.items()})
    RESULT["publisher_reserve_s"] = round(time.time() - t, 2)
    await pub.start()
    client = TrainerClient(config=TrainerClientConfig(broker=cep, pull_wait_s=0.5, request_timeout_s=60.0, keep_versions=2))
    client._publisher = pub  # bench: the trainer client publishes through this publisher (its path switched per row)
    stage = RESULT["rows"]
    try:
        await client.connect()
        await client.publish_weights({}, 0)
        t0 = time.time()
        while True:
            st = await client.status()
            if st["counters"].get("workers_alive", 0) >= 1:
                break
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited {worker.returncode}: {worker_log.read_text(errors='replace')[-3000:]}")
            if time.time() - t0 > 400:
                raise RuntimeError("the sglang worker never joined")
            refused = engine_refused(worker_log)
            if refused:
                raise RuntimeError(f"the worker's SGLang refused to start: {refused}")
            await asyncio.sleep(0.2)
        RESULT["worker_join_s"] = round(time.time() - t0, 1)
        RESULT["worker_spawned_before_join_s"] = round(time.time() - t_spawn, 1)
        note(f"worker joined after {RESULT['worker_join_s']} s")
        save()
        v, last_rx, last_ipc, last_dev, last_bulk = 0, 0, 0, 0, 0
        last_kind, last_on = "shm", "cuda"  # the publisher was made on auto and reserved for these tensors
        t_joined = time.time()
        sd_cpu: dict[str, Any] | None = None
        budget_as_made, device_made = pub.gpu_budget.budget, 0
        for path, spec, delta in rows:
            # "cpu@N": the CPU row again, its trainer step on N threads (0: none), named tcp_cpu_stepN; "cuda@torchdiff":
            # the device delta row with the diff kernels off, named ..._torchdiff (`select_rows`)
            on, _, extra = spec.partition("@")
            threads = extra if extra.isdigit() else ""
            step_threads = int(threads) if threads else args.cpu_step_threads
            name = row_name(path, on, delta) + (f"_step{threads}" if threads else "_torchdiff" if extra == "torchdiff" else "")
            if extra == "torchdiff":
                diff_kernel.switch_off(TORCH_DIFF_ROW)
            elif diff_kernel._off == TORCH_DIFF_ROW:  # (a row after it: the kernels back, unless they failed for real)
                diff_kernel._off = None
            recs: list[dict[str, Any]] = []
            stage[name] = {"path": path, "tensors_on": on, "delta": bool(delta), "versions": recs, "cpu_step_threads": step_threads}
            # the device delta rows: the budget raised to hold the device base for the row; the others: as made (a base
            # that does not fit it is not made, so those rows' deltas are the host's)
            pub.gpu_budget.budget = budget_as_made
            if delta == "device":
                pub.gpu_budget.budget = max(budget_as_made, pub.gpu_budget.used + device_base_bytes(sd_cuda, args.bucket_mib * _MiB))
            stage[name]["publisher_gpu_budget_bytes"] = pub.gpu_budget.budget
            if ("host" if path == "tcp" else "shm") != last_kind or on != last_on:
                # the last row's served versions leave (and their buffers with them) before this row reserves its own:
                # both sets at once, beside a CPU copy of the state dict and the worker's 2 versions, ran the H100 host's
                # 128 GiB out at 8B (three runs killed before their last rows)
                for old in list(pub._server.versions):
                    pub._evict(old)
                pub._buffers.trim_spares(0)
            pub.set_path({"tcp": "network", "shm": "shm", "cuda_ipc": "auto", "ring_only": "auto"}[path])
            pub.config = dataclasses.replace(pub.config, weight_delta=bool(delta))  # read at each publish
            # ring_only: the same GPU at keep_versions=0 (the ring alone, no host copy; the call returns once the worker
            # copied every bucket out); every other row keeps its 2 versions (read at each publish)
            pub.keep_versions = 0 if path == "ring_only" else 2
            stage[name]["keep_versions"] = pub.keep_versions
            # one CPU copy for the CPU rows in a row (a second beside it was 14.5 GB more of the host's memory, which
            # ran out at 8B with the publisher's and the worker's 2 versions each), dropped at the next CUDA row
            if on == "cuda":
                sd, sd_cpu = sd_cuda, None
            else:
                sd = sd_cpu = sd_cpu if sd_cpu is not None else {k: t.cpu() for k, t in sd_cuda.items()}
            kind = "host" if path == "tcp" else "shm"  # the cuda_ipc row's host buckets (for other peers) are shm too
            if kind != last_kind or on != last_on:
                t = time.time()
                pub.reserve(sd)  # this path's buffers before its first version (its kind differs from the last row's)
                stage[name]["reserve_s"] = round(time.time() - t, 2)
            last_kind, last_on = kind, on
            if kind == "shm":
                # the worker maps and page-locks the publisher's segments ahead (minor 11), in a thread, from the moment a
                # manifest names them: wait for that before the row's first version (bounded), and say how long it took
                # (the cuda_ipc row's segments too: page-locking them holds the worker's CUDA driver calls up)
                t = time.time()
                want = len(pub._server.shm_reserved)
                while time.time() - t < args.register_wait_s:
                    lines = [d for d in _json_lines_all(worker_log, "weight segments registered ") if d.get("segments") == want]
                    # and the worker's own start-up reserve (page-locking its host buffers holds it up: it must not meet v1)
                    reserved = _json_lines_all(worker_log, "weights reserved ")
                    if lines and lines[-1].get("registered", 0) >= want and reserved:
                        stage[name]["worker_registered_ahead"] = lines[-1]
                        stage[name]["worker_reserved"] = reserved[-1]
                        break
                    await asyncio.sleep(0.2)
                stage[name]["register_wait_s"] = round(time.time() - t, 2)
                stage[name]["registered_after_join_s"] = round(time.time() - t_joined, 2)
                note(f"{name}: worker registered {want} segments ahead; waited {stage[name]['register_wait_s']} s")
            for _ in range(args.versions):
                v += 1
                want = expected_checksums(sd, args.bucket_mib * _MiB)
                served0 = pub.bytes_served
                lane = getattr(pub._server, "bulk", None)
                early0 = getattr(lane, "early_chunks", 0)
                if on == "cuda":
                    torch.cuda.synchronize()
                lag.begin()
                gpu_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                t_pub = time.time()
                await client.publish_weights(sd, v)
                t_ret = time.time()
                ret_manifest = pub.manifest_of(v)
                # the trainer's next step, right after publish returns: CPU tensors' step runs off the publisher's loop, as
                # with SyncTrainerClient (its loop in a thread of its own) or a trainer running its step in a thread; on
                # this loop, a 14.5 GB CPU step (1.76 s seen on the H100 host) held up the manifests the worker waited for
                step, step_args = (sparse_step, (sd, v + 1, args.delta_fraction)) if delta else (optimizer_step, (sd, v))
                if on == "cuda":
                    step(*step_args)  # kernels queued on the GPU: the loop goes on at once
                elif step_threads != 0:  # 0: no step (what the trainer's own CPU step costs the lane, isolated)
                    await asyncio.to_thread(_cpu_step, step_threads, step, step_args)
                await pub.wait_ready(v)
                manifest = pub.manifest_of(v)
                # the trainer's GPU memory the publisher took beyond what it held before this version (its arenas)
                extra_gpu = (torch.cuda.max_memory_allocated() - gpu_before) if torch.cuda.is_available() else 0
                mixed_at_return = sum(1 for b in (ret_manifest.buckets if ret_manifest is not None else ()) if b.host_mix64)
                # keep_versions=0 through the ring: no host copy, so no host checksum to compare (the worker verified the
                # GPU checksum of every bucket it copied out of the ring): not checked, not counted as torn
                torn = None if pub.keep_versions == 0 else manifest is None or [b.checksum for b in manifest.buckets] != want
                deadline = time.time() + 300
                while True:
                    applied = _json_lines(worker_log, "sglang apply ")
                    if v in applied:
                        break
                    refused = engine_refused(worker_log)
                    if time.time() > deadline or worker.poll() is not None or refused:
                        raise RuntimeError(f"version {v} never applied ({refused or 'no apply line'}); worker log: "
                                           f"{worker_log.read_text(errors='replace')[-2000:]}")
                    await asyncio.sleep(0.02)
                a = applied[v]
                f = _json_lines(worker_log, "weights fetched ").get(v, {})
                rec: dict[str, Any] = {
                    "version": v, "trainer_blocked_s": round(t_ret - t_pub, 4), "publish_to_applied_s": round(a["applied_at"] - t_pub, 4),
                    "pause_s": round(a.get("pause_s", float("nan")), 4), "torn_snapshot": torn, "fetched_path": f.get("path"),
                    "fetched_after_publish_s": round(f["at"] - t_pub, 4) if "at" in f else None,
                    "publisher_socket_bytes": pub.bytes_served - served0, "model_bytes": model_bytes,
                    "lane_early_chunks": getattr(lane, "early_chunks", 0) - early0,  # sent before their bucket's checksum (RPBE)
                    "stage_h2d_s": a.get("stage_h2d_s"), "h2d_s": a.get("h2d_s"), "sglang_update_s": a.get("sglang_update_s"),
                    "staged_by_bucket": a.get("staged_by_bucket"), "stage_started_at_s": round(a["stage_started_at"] - t_pub, 4) if "stage_started_at" in a else None,
                    "update_started_after_publish_s": round(a["update_started_at"] - t_pub, 4) if "update_started_at" in a else None,
                    "publisher_ipc_versions": pub.stats.get("ipc_versions"),
                    "staged_to": f.get("staged_to"), "host_mix64_at_return": mixed_at_return,
                    "buckets": len(manifest.buckets) if manifest is not None else None,
                    "publish_phases": dict(pub.last_phases),
                    "fetch_timeline": f.get("timeline"), "fetch_started_after_publish_s": _started(f, t_pub),
                    "trainer_loop_lags_ms": lag.lags[:40],
                    # every fallback with its reason: the worker's for this fetch, the publisher's same-GPU decision
                    "fallback_reasons": f.get("fallback_reasons", []), "worker_fallbacks_total": f.get("fallbacks"),
                    "publisher_path_note": "; no ring: ".join(x for x in (pub.path_note.get("why_not_cuda_ipc"), pub.path_note.get("why_not_ring")) if x),
                    "publisher_ipc_broken": pub._ipc.broken or pub._ipc.ring.broken or None,
                    "publisher_offered": pub.path_note.get("offered"), "publisher_last_ring": pub.path_note.get("last_ring"),
                    "extra_gpu_bytes_peak": extra_gpu, "publisher_gpu_budget_bytes": pub.gpu_budget.budget,
                    "publisher_gpu_budget_peak_bytes": pub.gpu_budget.peak, "ipc_ring_bytes": pub.stats.get("ipc_ring_bytes"),
                    "ring_s": f.get("ring_s"), "ring_slots": f.get("ring_slots"),
                }
                made = served_delta(pub._server.versions.get(v))
                rec.update({"delta_base": f.get("delta_base", -1), "delta_bytes": f.get("delta_bytes"),
                            "changed_fraction": round(made.changed_fraction, 6) if made is not None else None,
                            "delta_wire_bytes": made.wire_bytes if made is not None else None})
                rec["delta_phases"] = delta_phases(made, f, t_pub) if delta else None
                # this version's delta came from the device only if the publisher counted one (the row's first version
                # writes the base, and its delta, if any, is the host's)
                device_made, device_made_before = pub.delta_device_versions, device_made
                rec["delta_made_on"] = ("device" if device_made > device_made_before else "host") if delta else None
                rec["why_not_delta_on_device"] = pub.path_note.get("why_not_delta_on_device") if delta else None
                rec["delta_compared_by"] = pub.path_note.get("delta_compared_by") if delta else None  # kernels or torch ops
                # where the worker rebuilt it (its apply record, else its fetch line): device, host, or None (a full version)
                rec["delta_rebuilt_on"] = a.get("delta_rebuilt_on") or f.get("delta_rebuilt_on")
                rec["delta_device_rebuild_s"] = a.get("delta_device_rebuild_s", f.get("device_rebuild_s"))
                rec["why_not_rebuilt_on_device"] = f.get("why_not_delta_on_device") or None
                rx = int(f.get("bytes_received", last_rx))  # the worker subscriber's running count of socket bytes
                rec["worker_socket_bytes"], last_rx = rx - last_rx, rx
                bulk = int(f.get("bulk_bytes", last_bulk))  # of those, over the bulk lane (minor 13)
                rec["worker_bulk_lane_bytes"], last_bulk = bulk - last_bulk, bulk
                ipc = int(f.get("ipc_bytes", last_ipc))
                rec["worker_ipc_bytes"], last_ipc = ipc - last_ipc, ipc
                dev = int(f.get("device_stage_bytes", last_dev))
                rec["worker_device_stage_bytes"], last_dev = dev - last_dev, dev
                recs.append(rec)
                note(f"{name} v{v}: {json.dumps({k: rec[k] for k in ('trainer_blocked_s', 'publish_to_applied_s', 'pause_s', 'fetched_path', 'torn_snapshot')})}")
                summarize()
                save()
                await asyncio.sleep(0.3)
    finally:
        with contextlib.suppress(Exception):
            text = worker_log.read_text(errors="replace")
            RESULT["worker_hello_required"] = text.count("hello_required")  # the broker forgot the worker (its loop stalled)
            RESULT["worker_segments_registered"] = _json_lines_all(worker_log, "weight segments registered ")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 10)
        _stop(worker)
        _stop(broker)
        with contextlib.suppress(Exception):
            await pub.close()
        zctx.destroy(linger=0)
        del sd_cuda, held


# --------------------------------------------------------------------------- the peers


_PEER_CODE = r"""
import json, statistics, sys, time, torch
from safetensors.torch import load_file
import sglang
model, out = sys.argv[1], sys.argv[2]
eng = sglang.Engine(model_path=model, mem_fraction_static=0.5, random_seed=0, context_length=2048, log_level="warning",
                    attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                    disable_cuda_graph=len(sys.argv) > 3 and sys.argv[3] == "nograph")
res = {"disk": [], "tensor": []}
for _ in range(3):
    t = time.time(); ok = eng.update_weights_from_disk(model); res["disk"].append(time.time() - t)
    res["disk_ok"] = bool(ok[0]) if isinstance(ok, tuple) else bool(ok)
sd = {k: v.cuda() for k, v in load_file(model + "/model.safetensors").items()}
torch.cuda.synchronize()
for i in range(3):
    for v in sd.values():
        v.add_(0.01 if i % 2 == 0 else -0.01)
    torch.cuda.synchronize()
    t = time.time(); eng.update_weights_from_tensor(list(sd.items())); torch.cuda.synchronize(); res["tensor"].append(time.time() - t)
json.dump(res, open(out, "w"))
eng.shutdown()
"""


def peers_stage(model: Path, timeout_s: int, no_cuda_graph: bool = False) -> None:
    out = OUT / "peers.json"
    try:
        subprocess.run([sys.executable, "-c", _PEER_CODE, str(model), str(out), "nograph" if no_cuda_graph else "graph"], cwd=ROOT, timeout=timeout_s, check=True,
                       stdout=(OUT / "peers.log").open("ab"), stderr=subprocess.STDOUT)
        res = json.loads(out.read_text())
        RESULT["disk_peer_runs_s"] = [round(x, 3) for x in res["disk"]]
        RESULT["disk_peer_s"] = round(statistics.median(res["disk"]), 3)
        RESULT["cuda_ipc_limit_runs_s"] = [round(x, 3) for x in res["tensor"]]
        RESULT["cuda_ipc_limit_s"] = round(statistics.median(res["tensor"]), 3)
    except Exception as exc:  # noqa: BLE001 - recorded; the rest of the JSON stands
        RESULT["peers_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    summarize()
    save()


# --------------------------------------------------------------------------- summary and goals


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x == x]
    return round(statistics.median(xs), 4) if xs else None


def path_goal(row: dict[str, Any], meant: str | tuple[str, ...], value: float | None, limit: float, *,
              goal: str | None = None) -> dict[str, Any]:
    """A path's goal from its row: measured only when every version of the row was fetched over the path the row meant
    (`meant`: one path name or several accepted ones, as the worker's ``weights fetched`` line names them); otherwise
    ``"met": None`` with ``"not_measured"`` saying which paths ran instead and why (the fallbacks recorded per version).
    Pure: the CPU test (tests/unit/bench/test_gpu_weights_goals.py) holds it to never report a path it did not take."""
    wanted = (meant,) if isinstance(meant, str) else tuple(meant)
    versions = row.get("versions", [])
    taken = sorted({str(r.get("fetched_path")) for r in versions})
    out: dict[str, Any] = {"value": value, "goal": goal or f"<= {limit}", "meant": "/".join(wanted), "paths_taken": taken}
    off = [r for r in versions if r.get("fetched_path") not in wanted]
    if not versions or off or value is None:
        reasons = sorted({str(x) for r in off for x in (r.get("fallback_reasons") or [])}
                         | {str(r["publisher_path_note"]) for r in off if r.get("publisher_path_note")})
        why = (f"{len(off)} of {len(versions)} versions were fetched over {sorted({str(r.get('fetched_path')) for r in off})}, "
               f"not {'/'.join(wanted)}" if off else "no figure" if versions else "the row has no versions")
        out.update(met=None, not_measured=why, fallback_reasons=reasons)
        return out
    out["met"] = value <= limit
    return out


def rebuilt_on(row: dict[str, Any]) -> dict[str, Any]:
    """Where the worker rebuilt a delta row's versions 3..N (its apply record's ``delta_rebuilt_on``): the places seen
    (``none``: a version that came whole, a fallback), the count per place, and the reasons the GPU did not."""
    steady = row.get("versions", [])[2:]
    places = [str(r.get("delta_rebuilt_on") or "none") for r in steady]
    return {"places": sorted(set(places)), "counts": {p: places.count(p) for p in sorted(set(places))},
            "why_not_device": sorted({str(r["why_not_rebuilt_on_device"]) for r in steady if r.get("why_not_rebuilt_on_device")})}


def rebuilt_goal(row: dict[str, Any]) -> dict[str, Any]:
    """A device delta row's goal keeps its verdict only when the worker rebuilt every steady version on its GPU (the
    path the row is meant to show); otherwise ``met`` None and ``not_measured`` says where they were rebuilt. Pure:
    tests/unit/bench/test_gpu_weights_goals.py holds it to never credit a path not taken."""
    where = rebuilt_on(row)
    out: dict[str, Any] = {"rebuilt_on": where["places"]}
    if where["places"] != ["device"]:
        out.update(met=None, not_measured=f"the worker rebuilt versions 3..N on {where['counts']}, not only its GPU",
                   why_not_rebuilt_on_device=where["why_not_device"])
    return out


def summarize() -> None:
    rows = RESULT["rows"]
    model_bytes = RESULT.get("model_bytes", 0)

    def warm(row: dict[str, Any], key: str) -> float | None:
        vs = row.get("versions", [])
        return _median([r[key] for r in vs[2:]] or [r[key] for r in vs[1:]])

    def first_over_warm(row: dict[str, Any]) -> float | None:
        vs = row.get("versions", [])
        w = warm(row, "publish_to_applied_s")
        return round(vs[0]["publish_to_applied_s"] / w, 3) if vs and w else None

    def first_delta_over_warm(row: dict[str, Any]) -> float | None:
        """A delta row's first version rebuilt from a delta over the median of versions 3..N: its first version is a full
        one (nothing to be a delta of), so this is the row's cold start."""
        vs = row.get("versions", [])
        w = warm(row, "publish_to_applied_s")
        first = next((r for r in vs if isinstance(r.get("delta_base"), int) and r["delta_base"] >= 0), None)
        return round(first["publish_to_applied_s"] / w, 3) if first is not None and w else None

    for row in rows.values():
        if row.get("versions"):
            row["summary"] = {k: warm(row, k) for k in ("trainer_blocked_s", "publish_to_applied_s", "pause_s", "fetched_after_publish_s")}
            row["summary"]["first_over_warm"] = first_over_warm(row)
            if row.get("delta"):
                row["summary"]["first_delta_over_warm"] = first_delta_over_warm(row)
            row["summary"]["torn_snapshots"] = sum(1 for r in row["versions"] if r["torn_snapshot"])
            row["summary"]["paths_taken"] = sorted({str(r["fetched_path"]) for r in row["versions"]})
            row["summary"]["staged_to"] = sorted({str(r.get("staged_to")) for r in row["versions"]})
            row["summary"]["extra_gpu_bytes_peak"] = max((int(r.get("extra_gpu_bytes_peak") or 0) for r in row["versions"]), default=0)
            row["summary"]["fallback_reasons"] = sorted({str(x) for r in row["versions"] for x in (r.get("fallback_reasons") or [])})
            for k in ("update_started_after_publish_s", "sglang_update_s"):
                row["summary"][k] = warm(row, k) if all(r.get(k) is not None for r in row["versions"]) else None
            if row.get("delta"):  # medians of each phase over the versions rebuilt from a delta
                rebuilt = [r["delta_phases"] for r in row["versions"] if r.get("delta_phases") and isinstance(r.get("delta_base"), int) and r["delta_base"] >= 0]
                row["summary"]["delta_phases"] = {k: _median([p[k] for p in rebuilt if p.get(k) is not None]) for k in DELTA_PHASES}
    tcp, shm = rows.get("tcp_cuda", {}), rows.get("shm_cuda", {})
    host = (tcp.get("summary") or {}).get("publish_to_applied_s")
    pause = (tcp.get("summary") or {}).get("pause_s")
    shm_s = (shm.get("summary") or {}).get("publish_to_applied_s")
    shm_pause = (shm.get("summary") or {}).get("pause_s")
    RESULT["host_path_s"] = host
    RESULT["shm_path_s"] = round(shm_s - shm_pause, 4) if shm_s is not None and shm_pause is not None else None
    ipc = rows.get("cuda_ipc_cuda", {})
    ipc_s, ipc_pause = (ipc.get("summary") or {}).get("publish_to_applied_s"), (ipc.get("summary") or {}).get("pause_s")
    RESULT["same_gpu_ipc_s"] = round(ipc_s - ipc_pause, 4) if ipc_s is not None and ipc_pause is not None else None
    RESULT["pause_s"] = pause
    blocked = [r["trainer_blocked_s"] for name, row in rows.items() if name.endswith("_cuda") for r in row.get("versions", [])[1:]]
    RESULT["trainer_blocked_s"] = _median(blocked)
    RESULT["first_over_warm"] = {name: (row.get("summary") or {}).get("first_over_warm") for name, row in rows.items() if row.get("versions")}
    RESULT["bytes_moved_per_version"] = {name: {"model_bytes": model_bytes,
                                                "publisher_socket_bytes": _median([r["publisher_socket_bytes"] for r in row["versions"]]),
                                                "worker_socket_bytes": _median([r.get("worker_socket_bytes") for r in row["versions"]]),
                                                "worker_ipc_bytes": _median([r.get("worker_ipc_bytes") for r in row["versions"]]),
                                                "worker_device_stage_bytes": _median([r.get("worker_device_stage_bytes") for r in row["versions"]])}
                                         for name, row in rows.items() if row.get("versions")}
    goals: dict[str, Any] = {}
    disk, raw = RESULT.get("disk_peer_s"), RESULT.get("raw_tcp_4stream_gbps")
    if host and disk:
        goals["host_path_vs_disk"] = {"value": round(host / disk, 3), "goal": "<= 0.9", "met": host <= 0.9 * disk}
    if host and raw and pause is not None and host > pause:
        eff = model_bytes / (host - pause) / 1e9
        goals["transfer_efficiency_vs_raw"] = {"value": round(eff / raw, 3), "goal": ">= 0.7", "met": eff / raw >= 0.7}
    raw_n = {k: v for k, v in RESULT.items() if k.startswith(("raw_tcp_", "raw_socket_")) and k.endswith("stream_gbps") and k != "raw_tcp_4stream_gbps"}
    for k, v in raw_n.items():
        if host and v and pause is not None and host > pause:
            RESULT["transfer_efficiency_vs_" + k] = round(model_bytes / (host - pause) / 1e9 / v, 3)
    RESULT["same_gpu_ipc_paths_taken"] = (ipc.get("summary") or {}).get("paths_taken")
    RESULT["ipc_extra_gpu_bytes"] = (ipc.get("summary") or {}).get("extra_gpu_bytes_peak")
    RESULT["same_gpu_trainer_blocked_s"] = _median([r["trainer_blocked_s"] for r in ipc.get("versions", [])[1:]])
    RESULT["ipc_gpu_budget_peak_bytes"] = max((int(r.get("publisher_gpu_budget_peak_bytes") or 0) for r in ipc.get("versions", [])), default=None)
    if ipc.get("versions"):
        # the same-GPU goals count for the path that ran, arena (cuda_ipc) or ring (cuda_ipc_ring), and only for it
        same_gpu = ("cuda_ipc", "cuda_ipc_ring")
        goals["same_gpu_ipc_s"] = path_goal(ipc, same_gpu, RESULT["same_gpu_ipc_s"], 0.5)
        goals["same_gpu_trainer_blocked_s"] = path_goal(ipc, same_gpu, RESULT["same_gpu_trainer_blocked_s"], 0.3)
        bucket = RESULT.get("bucket_bytes")
        if bucket:
            goals["ipc_extra_gpu_bytes"] = path_goal(ipc, same_gpu, RESULT["ipc_extra_gpu_bytes"], 2 * bucket,
                                                     goal=f"<= 2 buckets ({2 * bucket} bytes)")
    ro = rows.get("ring_only_cuda", {})
    if ro.get("versions"):  # keep_versions=0 through the ring alone: the same goals, on the ring only
        ro_s, ro_pause = (ro.get("summary") or {}).get("publish_to_applied_s"), (ro.get("summary") or {}).get("pause_s")
        RESULT["ring_only_ipc_s"] = round(ro_s - ro_pause, 4) if ro_s is not None and ro_pause is not None else None
        RESULT["ring_only_trainer_blocked_s"] = _median([r["trainer_blocked_s"] for r in ro["versions"][1:]])
        RESULT["ring_only_extra_gpu_bytes"] = (ro.get("summary") or {}).get("extra_gpu_bytes_peak")
        RESULT["ring_only_paths_taken"] = (ro.get("summary") or {}).get("paths_taken")
        goals["ring_only_ipc_s"] = path_goal(ro, "cuda_ipc_ring", RESULT["ring_only_ipc_s"], 0.5)
        goals["ring_only_trainer_blocked_s"] = path_goal(ro, "cuda_ipc_ring", RESULT["ring_only_trainer_blocked_s"], 0.3)
        bucket = RESULT.get("bucket_bytes")
        if bucket:
            goals["ring_only_extra_gpu_bytes"] = path_goal(ro, "cuda_ipc_ring", RESULT["ring_only_extra_gpu_bytes"], 2 * bucket,
                                                           goal=f"<= 2 buckets ({2 * bucket} bytes)")
    cpu_shm, cpu_tcp = rows.get("shm_cpu", {}), rows.get("tcp_cpu", {})
    RESULT["cpu_tensors_shm_path_s"] = (cpu_shm.get("summary") or {}).get("publish_to_applied_s")
    RESULT["cpu_tensors_tcp_path_s"] = (cpu_tcp.get("summary") or {}).get("publish_to_applied_s")
    RESULT["cpu_tensors_trainer_blocked_s"] = _median([r["trainer_blocked_s"] for name, row in rows.items() if name.endswith("_cpu")
                                                       for r in row.get("versions", [])[1:]])
    if cpu_shm.get("versions"):
        goals["cpu_tensors_shm_path_s"] = path_goal(cpu_shm, ("shm", "shm_device"), RESULT["cpu_tensors_shm_path_s"], 1.5)
    if cpu_tcp.get("versions") and host:
        goals["cpu_tensors_tcp_vs_cuda_tcp"] = path_goal(cpu_tcp, "network", RESULT["cpu_tensors_tcp_path_s"], 1.2 * host,
                                                         goal=f"<= 1.2 x tcp_cuda ({host} s)")
    # the CPU rows run again with the trainer's step on N threads (`select_rows`): their own figures, beside the goals'
    RESULT["cpu_tensors_by_step_threads"] = {
        name: {"cpu_step_threads": row.get("cpu_step_threads"), "publish_to_applied_s": (row.get("summary") or {}).get("publish_to_applied_s"),
               "trainer_blocked_s": _median([r["trainer_blocked_s"] for r in row.get("versions", [])[1:]])}
        for name, row in rows.items() if "_cpu_step" in name and row.get("versions")}
    if RESULT.get("params", {}).get("cpu_step_threads") == 0:  # a diagnostic run: the trainer's CPU step left out
        for k in ("cpu_tensors_shm_path_s", "cpu_tensors_tcp_vs_cuda_tcp"):
            if k in goals:
                goals[k] = {**goals[k], "met": None, "not_measured": "--cpu-step-threads 0: no trainer step after publish"}
    if RESULT["cpu_tensors_trainer_blocked_s"] is not None:
        v = RESULT["cpu_tensors_trainer_blocked_s"]
        goals["cpu_tensors_trainer_blocked_s"] = {"value": v, "goal": "<= 0.5", "met": v <= 0.5}
    if shm.get("versions"):  # the shm row's figure counts only when shared memory served it
        goals["shm_path_s"] = path_goal(shm, ("shm", "shm_device"), RESULT["shm_path_s"], 0.5)
    if RESULT["trainer_blocked_s"] is not None:
        goals["trainer_blocked_s"] = {"value": RESULT["trainer_blocked_s"], "goal": "<= 0.5", "met": RESULT["trainer_blocked_s"] <= 0.5}
    # a delta row's first version is a full one measured against its steady deltas: its cold start is its first delta
    # a shared-memory row whose first version came before the worker had registered the segments (the register wait ran
    # out: after a row switch the bench has evicted every version, so none announced the new row's segments) measured the
    # bench's switch, not a cold start: not counted, and said so
    unregistered = sorted(name for name, row in rows.items() if row.get("register_wait_s") is not None and not row.get("worker_registered_ahead"))
    fow = [x for name, x in RESULT["first_over_warm"].items() if x is not None and not rows[name].get("delta") and name not in unregistered
           and "_cpu_step" not in name]
    if fow:
        goals["first_over_warm"] = {"value": max(fow), "goal": "<= 1.2", "met": max(fow) <= 1.2}
        if unregistered:
            goals["first_over_warm"]["not_counted"] = {name: "the row's segments were not registered ahead of its first version" for name in unregistered}
    RESULT["first_delta_over_warm"] = {name: row["summary"].get("first_delta_over_warm") for name, row in rows.items()
                                       if row.get("delta") and row.get("summary")}
    fdw = [x for name, x in RESULT["first_delta_over_warm"].items() if x is not None and not name.endswith("_torchdiff")]
    if fdw:
        goals["first_delta_over_warm"] = {"value": max(fdw), "goal": "<= 1.2", "met": max(fdw) <= 1.2}
    if pause is not None:
        goals["pause_s"] = {"value": pause, "goal": "<= 0.15", "met": pause <= 0.15}
    # the device delta rows with and without the diff kernels (a _torchdiff row: the before of an in-run before/after)
    RESULT["delta_device_by_compare"] = {
        name: {"compared_by": sorted({str(r.get("delta_compared_by")) for r in row["versions"][1:]}),
               "publish_to_applied_s": (row.get("summary") or {}).get("publish_to_applied_s"),
               "trainer_blocked_s": _median([r["trainer_blocked_s"] for r in row["versions"][1:]]),
               **{k: ((row.get("summary") or {}).get("delta_phases") or {}).get(k) for k in ("delta_compare_s", "delta_encode_s")}}
        for name, row in rows.items() if "_delta_device" in name and row.get("versions")}
    device_rows = {name: row for name, row in rows.items() if name.endswith("_delta_device") and row.get("versions")}
    if device_rows:  # the same keys for the rows whose deltas were made on the trainer's GPU
        dt, ds = device_rows.get("tcp_cuda_delta_device", {}), device_rows.get("shm_cuda_delta_device", {})
        RESULT["delta_device_host_path_s"] = (dt.get("summary") or {}).get("publish_to_applied_s")
        ds_s, ds_pause = (ds.get("summary") or {}).get("publish_to_applied_s"), (ds.get("summary") or {}).get("pause_s")
        RESULT["delta_device_shm_path_s"] = round(ds_s - ds_pause, 4) if ds_s is not None and ds_pause is not None else None
        RESULT["delta_device_trainer_blocked_s"] = _median([r["trainer_blocked_s"] for row in device_rows.values() for r in row["versions"][1:]])
        RESULT["delta_device_made_on"] = sorted({str(r.get("delta_made_on")) for row in device_rows.values() for r in row["versions"][1:]})
        RESULT["delta_device_compared_by"] = sorted({str(r.get("delta_compared_by")) for row in device_rows.values() for r in row["versions"][1:]})
        RESULT["delta_device_why_not"] = sorted({str(r.get("why_not_delta_on_device")) for row in device_rows.values()
                                                 for r in row["versions"][1:] if r.get("why_not_delta_on_device")})
        steady_dev = [r for row in device_rows.values() for r in row["versions"] if isinstance(r.get("delta_base"), int) and r["delta_base"] >= 0]
        RESULT["delta_device_phases"] = {k: _median([r["delta_phases"][k] for r in steady_dev if (r.get("delta_phases") or {}).get(k) is not None])
                                         for k in DELTA_PHASES}
        on_device = RESULT["delta_device_made_on"] == ["device"]
        RESULT["delta_device_rebuilt_on"] = {name: rebuilt_on(row) for name, row in device_rows.items()}
        RESULT["delta_device_rebuild_s"] = _median([r.get("delta_device_rebuild_s") for r in steady_dev])
        for key, limit in (("delta_device_host_path_s", 0.35), ("delta_device_shm_path_s", 0.25), ("delta_device_trainer_blocked_s", 0.15)):
            if RESULT.get(key) is not None:  # a figure of the device path only when every delta was made there
                goals[key] = {"value": RESULT[key], "goal": f"<= {limit}", "met": RESULT[key] <= limit if on_device else None,
                              "made_on": RESULT["delta_device_made_on"]}
                if not on_device:
                    goals[key]["not_measured"] = f"deltas made on {RESULT['delta_device_made_on']}, not only the device"
                    goals[key]["why_not_device"] = RESULT["delta_device_why_not"]
                row = {"delta_device_host_path_s": dt, "delta_device_shm_path_s": ds}.get(key)
                if row is not None:  # and only when the worker rebuilt every steady version where the row says
                    goals[key].update(rebuilt_goal(row))
    delta_rows = [row for name, row in rows.items() if name.endswith("_delta") and row.get("versions")]
    if delta_rows:
        steady = [r for row in delta_rows for r in row["versions"] if isinstance(r.get("delta_base"), int) and r["delta_base"] >= 0]
        RESULT["changed_fraction"] = _median([r["changed_fraction"] for r in steady if r.get("changed_fraction") is not None])
        # over a socket only: a delta read from the publisher's shared memory (minor 26) moves no socket byte
        RESULT["delta_bytes_fraction"] = _median([r["worker_socket_bytes"] / model_bytes for r in steady
                                                  if model_bytes and r.get("worker_socket_bytes") is not None and r.get("fetched_path") != "shm"])
        RESULT["delta_versions_rebuilt"] = len(steady)
        dt, ds = rows.get("tcp_cuda_delta", {}), rows.get("shm_cuda_delta", {})
        RESULT["delta_host_path_s"] = (dt.get("summary") or {}).get("publish_to_applied_s")
        ds_s, ds_pause = (ds.get("summary") or {}).get("publish_to_applied_s"), (ds.get("summary") or {}).get("pause_s")
        RESULT["delta_shm_path_s"] = round(ds_s - ds_pause, 4) if ds_s is not None and ds_pause is not None else None
        RESULT["delta_shm_paths_taken"] = (ds.get("summary") or {}).get("paths_taken")
        RESULT["delta_trainer_blocked_s"] = _median([r["trainer_blocked_s"] for row in delta_rows for r in row["versions"][1:]])
        RESULT["delta_phases"] = {k: _median([r["delta_phases"][k] for r in steady if (r.get("delta_phases") or {}).get(k) is not None])
                                  for k in DELTA_PHASES}
        RESULT["delta_rebuilt_on"] = {name: rebuilt_on(row) for name, row in rows.items() if name.endswith("_delta") and row.get("versions")}
        for key, limit in (("delta_bytes_fraction", 0.05), ("delta_host_path_s", 0.35), ("delta_shm_path_s", 0.25),
                           ("delta_trainer_blocked_s", 0.15)):
            if RESULT.get(key) is not None:
                goals[key] = {"value": RESULT[key], "goal": f"<= {limit}", "met": RESULT[key] <= limit}
                row = {"delta_host_path_s": dt, "delta_shm_path_s": ds}.get(key)
                if row is not None:  # where the worker rebuilt them, said beside the figure
                    goals[key]["rebuilt_on"] = rebuilt_on(row)["places"]
    RESULT["goals"] = goals


HOW = {
    "host_path_s": "row tcp_cuda: median over versions 3..N of publish_weights call start -> the engine's applied_at (its 'sglang apply' log line)",
    "shm_path_s": "row shm_cuda: the same median, less the row's median pause_s",
    "same_gpu_ipc_s": "row cuda_ipc_cuda (publisher on auto, worker on auto: same host, same GPU UUID): the same median, less the row's median pause_s",
    "trainer_blocked_s": "duration of TrainerClient.publish_weights (snapshot copied, CUDA side-stream event waited, broker set_version) over the CUDA rows, versions 2..N",
    "pause_s": "row tcp_cuda: the engine's pause_s (pause -> resume around update_weights), median over versions 3..N",
    "first_over_warm": "per row: version 1's publish_to_applied_s over the median of versions 3..N (its goal over the rows of full versions: a delta row's version 1 is a full version; a shm row whose segments were not registered ahead of its first version, after a row switch, is left out and named in the goal's not_counted)",
    "first_delta_over_warm": "per delta row: the first version rebuilt from a delta, its publish_to_applied_s over the median of versions 3..N (the delta row's cold start; goal <= 1.2 as first_over_warm's)",
    "disk_peer_s": "a child process's sglang.Engine on the same model file: update_weights_from_disk, page cache warm, median of 3",
    "cuda_ipc_limit_s": "the same engine: update_weights_from_tensor of CUDA tensors in process, median of 3",
    "raw_tcp_4stream_gbps": "pyzmq PUSH -> PULL, 4 tcp connections, 4 I/O threads each side, 4 MiB frames copied by the receiver, 8 GiB",
    "raw_tcp_Nstream_gbps": "the same probe with --streams connections and I/O threads each side (when not 4), in the same run",
    "register_wait_s": "shm rows: how long the bench waited, before the row's first version, for the worker's 'weight segments registered' line naming every publisher segment (mapped and page-locked ahead, minor 11)",
    "publish_phases": "per version: WeightPublisher.last_phases, seconds from the publish call to: buffers taken (begun), the version announced, every copy handed out (issued), every copy done (landed), the GPU mix64 reads done (mixed), the call's return (returned); publish_weights adds the broker's set_version after that",
    "torn_snapshot": "every bucket's xxh3_64 computed from the trainer's tensors before publish_weights vs the published manifest after the optimizer step",
    "cpu_tensors_trainer_blocked_s": "duration of publish_weights over the *_cpu rows (the trainer's tensors on the host), versions 2..N",
    "cpu_tensors_shm_path_s": "row shm_cpu: median over versions 3..N of publish -> applied (pause included); its goal counts only if every version came over shm/shm_device",
    "cpu_tensors_tcp_path_s": "row tcp_cpu: the same median; goal <= 1.2 x host_path_s (tcp_cuda), counted only if every version came over the network",
    "same_gpu_ipc_paths_taken": "row cuda_ipc_cuda: the paths the worker's 'weights fetched' lines named: cuda_ipc (a whole-version arena) or cuda_ipc_ring (the bucket-by-bucket ring); the same-GPU goals are 'not measured' unless every version came over one of those",
    "same_gpu_trainer_blocked_s": "row cuda_ipc_cuda: duration of publish_weights, versions 2..N (the ring: until every bucket is out of the trainer's tensors, into its slot and into the host snapshot)",
    "ipc_extra_gpu_bytes": "row cuda_ipc_cuda: max over versions of torch.cuda.max_memory_allocated() during publish_weights..wait_ready less memory_allocated() before it, in the trainer's process (version 1 includes the ring's or arena's allocation; every version the checksums' temporaries)",
    "ring_only_ipc_s": "row ring_only_cuda (keep_versions=0 on the same GPU: the ring alone, no host copy): median publish -> applied over versions 3..N less the row's median pause_s; ring_only_trainer_blocked_s, ring_only_extra_gpu_bytes and ring_only_paths_taken as for the cuda_ipc row",
    "ipc_gpu_budget_peak_bytes": "row cuda_ipc_cuda: the publisher's GpuBudget.peak (the ring's or arenas' bytes, never past publisher_gpu_budget_bytes)",
    "bucket_bytes": "the publisher's bucket size (--bucket-mib)",
    "fallback_reasons": "per version: the worker subscriber's fallback reasons of that fetch (its 'weights fetched' line); publisher_path_note: why the publisher offered no device buffer",
    "changed_fraction": "delta rows (--delta): median over the versions the worker rebuilt from a delta of the publisher's changed fraction (changed bf16 elements over all, WeightServer's delta); the step is sparse_step at --delta-fraction, a stand-in for AdamW (see its docstring)",
    "delta_bytes_fraction": "delta rows: median over the versions rebuilt from a delta of the worker's socket bytes for that version over the model's bytes",
    "delta_host_path_s": "row tcp_cuda_delta: median over versions 3..N of publish -> applied (a delta's encoded bytes over the bulk lane, else the ROUTER)",
    "delta_shm_path_s": "row shm_cuda_delta (publisher on shm, deltas on): the same median less the row's pause. Since minor 26 a delta's encoded bytes are read from the publisher's shared memory (fetched_path shm) and rebuilt on the host; a worker whose engine stages to CUDA (the default) takes shm_device full versions, which leave no host base: since minor 27 it holds them on its GPU (weight_delta_on_device) and rebuilds the deltas there (delta_rebuilt_on); with --worker-delta-host pass --shm-cpu-copy too for this row to carry deltas (delta_shm_paths_taken says which ran)",
    "delta_trainer_blocked_s": "duration of publish_weights over the delta rows, versions 2..N (the delta is computed after publish returns, off the trainer's call)",
    "delta_device_host_path_s": "row tcp_cuda_delta_device (the publisher's GPU budget raised for the row to hold the device delta base): median over versions 3..N of publish -> applied",
    "delta_device_shm_path_s": "row shm_cuda_delta_device: the same median less the row's pause",
    "delta_device_trainer_blocked_s": "duration of publish_weights over the _delta_device rows, versions 2..N: the diff on the trainer's GPU and the base's update (the host copy is made from the base after the call)",
    "delta_device_made_on": "the _delta_device rows' versions 2..N: where each delta was made (device: the publisher's delta_device_versions counted it, else host); delta_device_why_not: the reasons path_note gave for host",
    "delta_device_phases": "as delta_phases, over the _delta_device rows",
    "delta_device_by_compare": "per device delta row, with (name as the row) and without the diff kernels (its _torchdiff twin, --rows): what compared (compared_by), publish_to_applied_s, trainer_blocked_s (median of versions 2..N), and the row's median delta_compare_s and delta_encode_s; the _torchdiff rows count in no goal",
    "delta_device_compared_by": "the _delta_device rows' versions 2..N: what compared their buckets on the trainer's GPU (the publisher's path_note delta_compared_by): kernels (rollpool.weights.diff_kernel) or torch ops (why)",
    "delta_rebuilt_on": "per delta row, versions 3..N: where the worker rebuilt each version (the 'sglang apply' line's delta_rebuilt_on: device = in place on its engine's GPU from the version it kept there, verified there against the manifest's mix64 of the resulting bytes; host = host buffers, then staged; none = the version came whole), with the worker's reasons the GPU did not (why_not_rebuilt_on_device). A _delta_device row's goals count only when every steady version was rebuilt on the device (rebuilt_goal)",
    "delta_device_rebuild_s": "the _delta_device rows' versions rebuilt from a delta: median of the worker's GPU seconds for the rebuild (patch + mix64 check, summed over buckets; its apply record's delta_device_rebuild_s)",
    "delta_phases": "delta rows: medians over the versions rebuilt from a delta of where the time went (delta_phases in bench/gpu_weights.py): the server's delta_compare_s, delta_encode_s (of it delta_pin_s: allocating a device delta's page-locked payload buffers, made ahead since they cost 0.6 s there), delta_checksum_s (summed over buckets), delta_made_s, delta_after_complete_s, delta_ready_after_publish_s, early_delta_ready_after_publish_s (a device-made delta served before the host copy was checksummed, to workers that verify on their GPU: minor 28; absent when not served early), early_mix_s (the publisher's GPU summing the mix64 of the resulting bytes for it), delta_shm_write_s (the encoded bytes written to a shared-memory segment, before a delta is served where the publisher's versions are in shared memory); the worker's manifest_after_publish_s, manifest_wait_s, fetch_s, rebuild_s and verify_s (summed over buckets), rebuild_after_fetch_s, delta_total_s",
    "bytes_moved_per_version": "model_bytes (every tensor changes every version) and the bytes the publisher's sockets served (0 on the shm path)",
}


def main() -> int:
    global OUT, RESULT_NAME
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", choices=("8b", "1p4"), default="8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/gpu_weights")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--chunk-mib", type=int, default=4, help="the publisher's chunk size (the network path's Fetch replies; at most 16)")
    ap.add_argument("--shm-cpu-copy", action="store_true", help="the worker's shm path copies on the CPU (ROLLPOOL_WEIGHT_SHM_TO_DEVICE=0)")
    ap.add_argument("--worker-delta-host", action="store_true",
                    help="the worker rebuilds delta versions on the host (ROLLPOOL_WEIGHT_DELTA_ON_DEVICE=0), the baseline of the device rebuild")
    ap.add_argument("--no-cuda-graph", action="store_true", help="SGLang without CUDA graphs in the worker and the peer (a shorter start)")
    ap.add_argument("--register-wait-s", type=float, default=90.0,
                    help="before a shm row: wait at most this long for the worker's segments registered ahead")
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--mem-fraction", type=float, default=0.3,
                    help="SGLang's static share of GPU memory (the trainer's model, 2 arenas and the worker's 2 device versions share the GPU)")
    ap.add_argument("--optimizer-gib", type=float, default=0.0,
                    help="the trainer also holds this much GPU memory for the whole run (an optimizer's state; Adam's two fp32 "
                         "moments of a bf16 model are 4x its bytes, more than one card holds beside SGLang: give what fits)")
    ap.add_argument("--gpu-budget-mib", type=int, default=None,
                    help="the publisher's GPU budget (WeightPathConfig.publisher_gpu_budget_bytes; default: two buckets)")
    ap.add_argument("--rows", default="", help="comma-separated subset of rows, e.g. cuda_ipc_cuda,tcp_cuda (default: all of the run); "
                    "tcp_cpu_stepN / shm_cpu_stepN: the CPU row again, its trainer step on N threads (0: none), not counted in the goals; "
                    "tcp_cuda_delta_device_torchdiff / shm_cuda_delta_device_torchdiff: the device delta row with the diff kernels off")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--skip-raw", action="store_true", help="skip the raw ZeroMQ tcp probe (rows without tcp)")
    ap.add_argument("--peers-timeout-s", type=int, default=240)
    ap.add_argument("--delta", action="store_true", help="add the delta rows tcp_cuda_delta, shm_cuda_delta and their _delta_device twins "
                    "(every version a sparse_step)")
    ap.add_argument("--delta-fraction", type=float, default=0.0215,
                    help="the delta rows' changed fraction per version (default: bench/weights.py --delta, AdamW at lr 1e-6, on CPU)")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="save and exit after this long (the device call's limit is 600 s)")
    ap.add_argument("--cpu-step-threads", type=int, default=None,
                    help="the CPU-tensor rows' trainer step after each publish on this many of torch's threads (default: torch's own, "
                         "every core; 0: no step, to see what the trainer's own CPU step costs the transfer)")
    args = ap.parse_args()
    if args.versions < 6:
        ap.error("--versions: at least 6 per path (the issue's rule)")
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    RESULT_NAME = f"h200-weights-{args.run}.json"
    start_watchdog(args.deadline_s)
    setup_env()
    import torch

    RESULT["machine"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    if "H100" in RESULT["machine"]:  # an H100's figures do not overwrite the H200's file
        RESULT_NAME = f"h100-weights-{args.run}.json"
    RESULT["run"] = args.run
    RESULT["params"] = vars(args)
    try:  # which send and receive code the bulk lane ran (ROLLPOOL_LANE_NATIVE=0: Python's; absent in older checkouts)
        from rollpool.weights.paths import lane_native

        RESULT["lane_native"] = {"enabled": lane_native.enabled(), "off_reason": lane_native._off}
    except ImportError:
        RESULT["lane_native"] = {"enabled": False, "off_reason": "this checkout has no compiled lane loops"}
    # bytes before their checksum (minor 30): the worker asks unless ROLLPOOL_WEIGHT_EARLY_BYTES=0 (it inherits this
    # environment); servable from the version's last copy
    RESULT["early_bytes"] = {"worker_asks": os.environ.get("ROLLPOOL_WEIGHT_EARLY_BYTES", "1") not in ("0", "false", "False")}
    RESULT["how"] = HOW
    save()
    # this process's publisher logs at INFO into the step's folder (gpu_batch.sh packs it with the worker's log): its
    # "published weight version" lines say when each version was checksummed, its device-delta and kernel lines why
    publisher_log = logging.FileHandler(OUT / "publisher.log")
    publisher_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("rollpool.weights").addHandler(publisher_log)
    logging.getLogger("rollpool.weights").setLevel(logging.INFO)
    t = time.time()
    model, model_bytes = build_model(Path(args.work), args.run)
    RESULT["model"] = {**SHAPES[args.run], "dtype": "bfloat16", "bytes": model_bytes, "build_s": round(time.time() - t, 1)}
    RESULT["model_bytes"] = model_bytes
    note(f"model {args.run}: {model_bytes / 1e9:.2f} GB in {RESULT['model']['build_s']} s")
    save()
    if not args.skip_raw:
        note("raw tcp probe")
        try:
            RESULT["raw_tcp_4stream_gbps"] = raw_tcp_gbps(4)
            note(f"raw tcp x4: {RESULT['raw_tcp_4stream_gbps']} GB/s")
            if args.streams != 4:
                RESULT[f"raw_tcp_{args.streams}stream_gbps"] = raw_tcp_gbps(args.streams)
                note(f"raw tcp x{args.streams}: {RESULT[f'raw_tcp_{args.streams}stream_gbps']} GB/s")
            RESULT[f"raw_socket_{args.streams}stream_gbps"] = raw_socket_gbps(args.streams)
            note(f"raw plain tcp x{args.streams} (the bulk lane's transport): {RESULT[f'raw_socket_{args.streams}stream_gbps']} GB/s")
        except Exception as exc:  # noqa: BLE001 - recorded; the rest of the run goes on
            RESULT["raw_tcp_error"] = f"{type(exc).__name__}: {exc}"[:1000]
        save()
    rows = select_rows(args.rows, delta=args.delta)
    if not args.skip_peers:  # first: a hang later in the pool stage must not cost the peers' figures
        note("peers: update_weights_from_disk and update_weights_from_tensor in a child sglang.Engine")
        t = time.time()
        peers_stage(model, args.peers_timeout_s, args.no_cuda_graph)
        RESULT["peers_stage_s"] = round(time.time() - t, 1)
        note(f"peers: disk {RESULT.get('disk_peer_s')} s, cuda ipc limit {RESULT.get('cuda_ipc_limit_s')} s {RESULT.get('peers_error', '')}")
    try:
        asyncio.run(pool_stage(model, model_bytes, args, rows))
    except Exception as exc:  # noqa: BLE001 - recorded; the partial JSON stands
        RESULT["pool_error"] = f"{type(exc).__name__}: {exc}"[:3000]
        note(f"pool stage failed: {exc!r}")
    save()
    summarize()
    RESULT["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    note(json.dumps(RESULT.get("goals", {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
