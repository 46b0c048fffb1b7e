"""The wire codec: frozen dataclasses <-> ZeroMQ multipart frames.

Format of one message (pinned by the golden fixtures in tests/fixtures):

    frame 0     msgpack array [major, minor, type, fields]
                  major, minor  protocol version of the encoder (ints)
                  type          the message's type string (``"task"``, ...)
                  fields        a map of field name -> value
    frame 1..k  raw binary frames; a field whose type is an array or a blob
                holds the index of its frame (int, >= 1) instead of a value,
                or (minor 12) the raw bytes themselves, inline, as a msgpack
                ``bin``.

Arrays travel as raw little-endian bytes of a fixed dtype (token ids int32,
logprobs float32, masks uint8), so encoding 4,096 tokens costs one memcpy at
most and decoding is a zero-copy ``numpy.frombuffer`` view (read-only), of the
frame or of the inline ``bin``. The same array object referenced twice in one
message (the prompt shared by the n trajectories of a group) travels once, in a
frame.

Inline arrays (protocol minor 12, `Inline`): a frame costs a sender and a
receiver 1-3 us each in Python (a socket call, a ``zmq.Frame``), a copy of 4 KiB
about 0.2 us, and most arrays of a short rollout are tens of bytes. So an encoder
given an `Inline` policy puts an array or blob of at most `Inline.max_bytes`
into the header, up to `Inline.budget_bytes` per message; the rest, and any
array referenced more than once in the message, travel in frames. A sender uses
a policy only with a peer that settled on minor 12 or later in its hello
(`inline_for`; `Hello.protocol_minor` and the welcomes); without one
(the default) the message is exactly what minor 11 sent. Decoding reads both
forms from any peer. Weight chunks are never sent with a policy: they stay
frames, zero-copy. A record received with every array inline is a
self-contained map, so a relaying peer (the broker) may send it on as it came
(`carry_entry`, `decode(..., fields_out=)`, `encode(msg, inline, carry)`).

Decoding is strict and bounded: an unsupported major version, an unknown type,
a type the receiving socket does not accept (`decode(..., accept=...)`), a
missing required field, a value of the wrong type, an oversize header or
frame, an inline array whose size is not a whole number of its dtype, too many frames, a frame no field refers to, or a reference to a frame
that is not there all raise `ProtocolError` before anything large is
allocated. The header is unpacked under msgpack's own per-container limits
and under a budget of values (`Limits.max_header_objects`) that stops msgpack
as it builds, so a header's memory is bounded by the limits, not by how well
it compresses into small objects. Unknown fields are ignored (new optional
fields are additive), up to `Limits.max_unknown_fields` per record.
Nothing is ever unpickled or evaluated: msgpack ext types are refused.
"""

from __future__ import annotations

import dataclasses
import threading
import types
import typing
from collections.abc import Callable, Container, Sequence
from typing import Annotated, Any, TypeVar, Union, dataclass_transform, get_args, get_origin

import msgpack
import numpy as np
import numpy.typing as npt

from rollpool.protocol.errors import MessageTooLargeError, ProtocolError
from rollpool.protocol.limits import DEFAULT_LIMITS, DEFAULT_PEER_MAX_MSG_BYTES, Limits

__all__ = [
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "LORA_MINOR",
    "SUPPORTED_MAJORS",
    "Frame",
    "Int32Array",
    "Float32Array",
    "UInt8Array",
    "Blob",
    "record",
    "message",
    "encode",
    "decode",
    "message_types",
    "records_equal",
    "check_size",
    "message_bytes",
    "Inline",
    "inline_for",
    "carry_entry",
    "INLINE_MINOR",
    "CONTRACT_MINOR",
    "DELTA_MINOR",
    "EPOCH_MINOR",
    "PARKED_MINOR",
    "IMAGES_MINOR",
    "REPLAY_MINOR",
    "ADAPTER_GRANT_MINOR",
    "RING_MINOR",
    "ADAPTER_ON_MINOR",
    "BASE_ON_MINOR",
    "POLICY_MINOR",
    "DELTA_PATHS_MINOR",
    "RESULT_MIX64_MINOR",
    "EARLY_DELTA_MINOR",
    "TURN_BATCH_MINOR",
    "EARLY_BYTES_MINOR",
    "DEFAULT_INLINE_MAX_BYTES",
]

PROTOCOL_MAJOR = 1
# Minor history (each addition optional with a default; older peers ignore it):
#   1.1  Prompt.min_weight_version (dispatch by a prompt's minimum weight version)
#   1.2  Hello/Welcome/ClientHello/ClientWelcome max_msg_bytes, max_header_bytes; Trajectory.segment_index
#   1.3  Task.seq, TaskBatch, ResultBatch, Result.credits, Hello/Welcome features, constant-size worker
#        heartbeats (dispatch_seq, free_capacity, held_count, held_digest, held_full; BrokerHeartbeat.send_held)
#   1.4  streamed weight manifests: ManifestRequest.streamed, host_key; Manifest.host_key, pool;
#        BucketInfo.shm_segment; Chunk.checksum
#   1.5  Feature.RECONCILE (whole worker heartbeats acted on: leases reconciled, credit absolute);
#        Welcome.dispatch_seq (where the worker's echo starts)
#   1.6  SetVersion.rebase (checkpoint resume); version_epoch on Hello, Welcome, WorkerHeartbeat and
#        BrokerHeartbeat, rebase_version on Welcome and BrokerHeartbeat
#   1.7  ApplyDone.skipped (a worker reports a weight version it gave up on, with the reason);
#        SamplingParams.top_logprobs_num / logprob_start_len, Trajectory.output_top_ids / output_top_logprobs /
#        input_logprobs
#   1.8  staleness without waste: SetVersion.stale_bound, WorkerHeartbeat.tokens_cancelled
#   1.9  the same-GPU weight path: Manifest.cuda_ipc (CudaIpcBuffer), BucketInfo.ipc_offset / ipc_checksum,
#        ManifestRequest.gpu_uuids / wait_ipc
#   1.10 the shared-memory path staged to a GPU: BucketInfo.host_mix64 (mix64 of the bucket's host bytes)
#   1.11 the publisher's segments named before its first version: Manifest.shm_reserved (ShmSegment), Announce.shm_generation
#   1.12 small arrays and blobs inline in the header (a msgpack bin where a frame index was); the minor in the
#        hellos and welcomes: Hello/ClientHello.protocol_minor, Welcome/ClientWelcome.protocol_minor (settled)
#   1.13 the network path's bulk lane: Manifest.bulk_port (chunk bytes over plain TCP into the subscriber's buffer)
#   1.14 the versioned-service contract: Prompt.exact_weight_version (CONTRACT_MINOR)
#   1.15 run epochs on results: Trajectory.version_epoch (EPOCH_MINOR)
#   1.16 images in prompts: Prompt.images (PromptImage), Trajectory.image_sha256 / image_grid_thw (IMAGES_MINOR)
#   1.17 LoRA adapter versions: Manifest.adapter (AdapterSpec) (LORA_MINOR)
#   1.18 delta weight versions: ManifestRequest/Manifest/Fetch.delta_base, BucketInfo.encoding / delta_nbytes /
#        delta_checksum (DELTA_MINOR)
#   1.19 parked manifest requests: ManifestRequest.after_mix64 (answered once the version carries more GPU checksums),
#        Manifest.protocol_minor (the server's minor: a subscriber parks only with a server that parks) (PARKED_MINOR)
#   1.20 the replay of a redelivered episode: TurnRecords, RecordedTurn, Task.replay, Feature.REPLAY (REPLAY_MINOR)
#   1.21 adapter versions without an apply slot: Feature.ADAPTER_NO_GRANT in the broker's Welcome (ADAPTER_GRANT_MINOR)
#   1.22 the same-GPU ring: CudaIpcBuffer.ring_slots, ManifestRequest.ring / ring_done (RING_MINOR)
#   1.23 the adapter version on under a whole-model version: Manifest.adapter_on (ADAPTER_ON_MINOR)
#   1.24 the whole-model version a LoRA adapter version applies over: Manifest.base_on (BASE_ON_MINOR)
#   1.25 named policies: AdapterSpec.name, Prompt.policy, Trajectory.policy, SetVersion.adapter / adapter_since (POLICY_MINOR)
#   1.26 delta weight versions over shared memory: Manifest.delta_shm (DELTA_PATHS_MINOR)
#   1.27 the mix64 of a delta's resulting bytes on network versions too: BucketInfo.host_mix64 (RESULT_MIX64_MINOR)
#   1.28 a device-made delta served before its version's host copy to askers that verify on the GPU: ManifestRequest.device_verify (EARLY_DELTA_MINOR)
#   1.29 several tasks' finished episode turns in one message: TurnRecordBatch, Feature.TURN_BATCH (TURN_BATCH_MINOR)
#   1.30 a bucket's bytes over the bulk lane before its checksum: the lane's RPBE request (EARLY_BYTES_MINOR)
PROTOCOL_MINOR = 30
TURN_BATCH_MINOR = 29
"""The first minor whose brokers decode `TurnRecordBatch` (the finished episode turns of several tasks in one message) and
list `Feature.TURN_BATCH` in their Welcome; a worker sends one only to a broker that lists it. An older broker keeps
getting one `TurnRecords` per task, an older worker keeps sending them (this broker reads both)."""
EARLY_BYTES_MINOR = 30
"""The first minor whose servers answer the bulk lane's ``RPBE`` request (`rollpool.weights.paths.bulk`): a bucket's chunks
as soon as its bytes are in place, with an empty checksum text while its checksum is pending, but for the chunk that
ends the bucket, which waits for the checksum and carries it. A subscriber asks so only of a server whose manifest says
this minor or newer (`Manifest.protocol_minor`); an older subscriber's ``RPBQ`` is answered as before (once the bucket is
checksummed)."""
EARLY_DELTA_MINOR = 28
"""The first minor whose weight servers answer a manifest request with ``device_verify`` (the asker rebuilds a delta on
its engine's GPU and proves each bucket by `BucketInfo.host_mix64`) with a delta made on the publisher's GPU as soon as
its buckets are encoded and their mix64 known, before the version's host copy and xxh3 exist: such a manifest may carry
``""`` as a bucket's `BucketInfo.checksum` (pending), never to be taken as checked. Older servers ignore the field and
answer once the delta is complete, as to every other asker."""
RESULT_MIX64_MINOR = 27
"""The first minor whose weight servers put `BucketInfo.host_mix64` (the mix64 of the bucket's bytes) on the buckets of a
network version too when its deltas are made and its bytes come from CUDA tensors (summed on the GPU beside the copy), so
a delta manifest carries the mix64 of every bucket's *resulting* bytes on every path, and a subscriber that holds the
base on its engine's GPU rebuilds the version there and verifies it there (`rollpool.weights.delta_gpu`). Older servers
put it on shared-memory versions only (minor 10): a delta manifest without it is rebuilt on the host, as before. An
older subscriber reads the field only on the shared-memory path."""
DELTA_PATHS_MINOR = 26
"""The first minor whose weight servers put a delta's encoded bytes in shared memory for subscribers on their host
(`Manifest.delta_shm`), and whose subscribers held to the ``shm`` path ask for deltas (only of a server of this minor or
newer: an older one serves deltas over the network only, which ``shm`` forbids). An older subscriber ignores the field
and fetches the encoded bytes over the network, as before."""
POLICY_MINOR = 25
"""The first minor whose brokers read `Prompt.policy` (the LoRA adapter, by its `AdapterSpec.name`, a group is generated
with): a group naming a policy the pool does not serve is refused at submit, one naming the served policy goes only to a
worker serving it and comes back with `Trajectory.policy` set. Its clients say which adapter a version serves
(`SetVersion.adapter`, `adapter_since`). A client refuses to send a named policy to an older broker (which would ignore
it and serve the group with whatever adapter is on); an older client's versions name no adapter."""
BASE_ON_MINOR = 24
"""The first minor whose weight servers name, on a LoRA adapter version, the whole-model version it applies over
(`Manifest.base_on`), and keep that whole-model version served while it is the base of the newest adapter version; its
subscribers whose engine does not serve that whole-model version (a late joiner) fetch it and apply it, then the adapter,
in one pause. An older subscriber ignores the field (it applies the adapter over its engine's base, as before); an older
server never names one."""
ADAPTER_ON_MINOR = 23
"""The first minor whose weight servers name, on a whole-model version published after a LoRA adapter version, the
adapter version that stays on under it (`Manifest.adapter_on`), and keep that adapter version served while it is on;
its subscribers fetch and apply that adapter version with the whole-model version when they do not have it on (a late
joiner). An older subscriber ignores the field (it serves the base alone, as before); an older server never names one."""
RING_MINOR = 22
"""The first minor whose weight servers may stream a version through a same-GPU ring (`CudaIpcBuffer.ring_slots`) and
whose subscribers take one (`ManifestRequest.ring`, `ring_done`); an older subscriber never says `ring` and is answered
without the ring's device buffer (it takes shared memory or the network), an older server never offers a ring."""
ADAPTER_GRANT_MINOR = 21
"""The first minor whose brokers may list `Feature.ADAPTER_NO_GRANT` in their Welcome (not in fleet activation): a worker
that settled on it and whose engine serves adapter versions without a pause applies one without asking for an apply
slot (no `ApplyRequest` / `ApplyGrant`), and still reports it (`ApplyDone`). With an older broker it asks as before."""
REPLAY_MINOR = 20
"""The first minor whose workers stream finished episode turns to the broker (`TurnRecords`) and whose brokers hand them
to the next attempt (`Task.replay`); both sides also list `Feature.REPLAY`. An older peer gets neither."""
EPOCH_MINOR = 15
"""The first minor whose workers say which version epoch (run) the weights that made a trajectory belong to
(`Trajectory.version_epoch`); an older worker's trajectories carry -1, and the trainer client cannot tell their run."""
DELTA_MINOR = 18
"""The first minor whose subscribers ask for delta weight versions (`ManifestRequest.delta_base`); an older one never
asks and is always served full versions."""
PARKED_MINOR = 19
"""The first minor whose weight servers park a manifest request that names `ManifestRequest.after_mix64` until the
version carries more GPU checksums (`BucketInfo.host_mix64`), and say their minor on every manifest
(`Manifest.protocol_minor`); a subscriber asks an older server again every few ms instead, as that server's own
peers did."""
SUPPORTED_MAJORS: tuple[int, ...] = (1,)
"""Majors this build can decode; hello messages advertise min/max of these."""

CONTRACT_MINOR = 14
"""The first minor whose brokers read `Prompt.exact_weight_version` (a client refuses to send one to an older broker,
which would ignore it and serve the group at any version)."""

LORA_MINOR = 17
"""The first minor whose manifests may carry `Manifest.adapter` (a LoRA adapter version on the weight channel); an older
subscriber ignores the field and would load the adapter's tensors as base weights, which its engine refuses by name."""

INLINE_MINOR = 12
"""The first minor whose decoders read an array or blob held inline in the header."""
IMAGES_MINOR = 16
"""The first minor that carries `Prompt.images` and the trajectory's image fields."""
DEFAULT_INLINE_MAX_BYTES = 16 * 1024
"""Largest array or blob an encoder puts inline (`inline_for`'s default): measured in docs/broker.md (fifth pass)."""
INLINE_BUDGET_MAX_BYTES = 256 * 1024
"""Most inline bytes in one message's header (and at most an eighth of the header the peer accepts)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Inline:
    """How an encoder may put arrays and blobs into the header (`encode(msg, inline)`; minor 12 peers only)."""

    max_bytes: int = DEFAULT_INLINE_MAX_BYTES
    """An array or blob of at most this many bytes travels inline (a msgpack bin) instead of in a frame."""
    budget_bytes: int = INLINE_BUDGET_MAX_BYTES
    """At most this many inline bytes per message; arrays past it travel in frames."""


def inline_for(peer_minor: int, peer_max_header_bytes: int = 0, inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES) -> Inline | None:
    """The inline policy for a peer that settled on `peer_minor` (None: frames only, as minor 11 and older).

    `peer_max_header_bytes` is the header limit the peer announced (0: not said, the default 4 MiB): inline
    bytes take at most an eighth of it, so inlining never pushes a header past what the peer accepts when
    frames would have fitted. `inline_max_bytes` <= 0 turns inlining off.
    """
    if peer_minor < INLINE_MINOR or inline_max_bytes <= 0:
        return None
    header = peer_max_header_bytes or DEFAULT_LIMITS.max_header_bytes
    return Inline(inline_max_bytes, min(INLINE_BUDGET_MAX_BYTES, header // 8))


class _FrameKind:
    """Marks a field that travels in its own binary frame."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: np.dtype[Any] | None) -> None:
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"_FrameKind({self.dtype})"


Int32Array = Annotated[npt.NDArray[np.int32], _FrameKind(np.dtype("<i4"))]
Float32Array = Annotated[npt.NDArray[np.float32], _FrameKind(np.dtype("<f4"))]
UInt8Array = Annotated[npt.NDArray[np.uint8], _FrameKind(np.dtype("u1"))]
Blob = Annotated[bytes | memoryview, _FrameKind(None)]
"""Opaque bytes in their own frame; decoded as a zero-copy memoryview."""

Frame = Any
"""Anything that supports the buffer protocol (zmq.Frame included)."""

_Enc = Callable[[Any, list[Any], dict[Any, Any]], Any]
_Dec = Callable[[Any, "_DecodeState"], Any]

_MESSAGES: dict[str, type[Any]] = {}
_SPECS: dict[type[Any], _RecordSpec] = {}

T = TypeVar("T")


class _DecodeState:
    __slots__ = ("frames", "sizes", "used", "limits", "arrays")

    def __init__(self, frames: list[Any], sizes: list[int], limits: Limits) -> None:
        self.frames = frames
        self.sizes = sizes
        self.arrays: dict[tuple[int, str], Any] = {}  # one view per (frame, dtype): shared arrays stay shared
        self.used = bytearray(len(frames))
        self.limits = limits


class _RecordSpec:
    """Per-class plan: how to encode and decode each field.

    Scalar fields (str, int, bool) are checked inline rather than through a
    converter call; a field equal to its (immutable) default is left off the
    wire and filled back in on decode. Both keep the common messages cheap.
    """

    __slots__ = ("cls", "plan", "decoders", "required", "static_defaults", "factories", "frame_fields", "shared", "encode", "decode")

    def __init__(self, cls: type[Any]) -> None:
        self.cls = cls
        hints = typing.get_type_hints(cls, include_extras=True)
        # (name, inline scalar type or None, converter, default or _NO_DEFAULT)
        self.plan: list[tuple[str, type[Any] | None, _Enc, Any]] = []
        self.decoders: dict[str, tuple[type[Any] | None, _Dec]] = {}
        self.required: list[str] = []
        self.static_defaults: dict[str, Any] = {}
        self.factories: dict[str, Callable[[], Any]] = {}
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            enc, dec = _converters(tp, f"{cls.__name__}.{f.name}")
            inline = tp if tp in (str, int, bool) else None
            default: Any = _NO_DEFAULT
            if f.default is not dataclasses.MISSING:
                self.static_defaults[f.name] = f.default
                if f.default is None or type(f.default) in (str, int, float, bool, tuple):
                    default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                factory: Any = f.default_factory
                shared = _SPECS[factory].shared if factory in _SPECS else None
                if shared is not None:
                    self.static_defaults[f.name] = shared  # absent on the wire: the one shared default (still encoded)
                else:
                    self.factories[f.name] = f.default_factory
            else:
                self.required.append(f.name)
            self.plan.append((f.name, inline, enc, default))
            self.decoders[f.name] = (inline, dec)
        self.frame_fields: tuple[str, ...] = tuple(
            f.name for f in dataclasses.fields(cls) if any(isinstance(m, _FrameKind) for m in _markers(hints[f.name])))
        """The fields whose type is an array or a blob (`carry_entry` checks that each travelled inline)."""
        self.shared: Any = None
        """For a record whose every field has an immutable default (`SamplingParams`): one instance with all
        of them, which decoding an empty map returns (and a missing field of this type holds) instead of
        building a new, equal one each time; frozen and holding only immutable values, it cannot change."""
        if not self.required and not self.factories and all(_immutable(d) for d in self.static_defaults.values()):
            self.shared = cls()
        self.encode: Callable[[Any, list[Any], dict[Any, Any]], dict[str, Any]] = _compile_encoder(self)
        self.decode: Callable[[Any, _DecodeState, str], Any] = _compile_decoder(self)


def _markers(tp: Any) -> list[Any]:
    """The `Annotated` markers of a field's type, through ``X | None``."""
    if get_origin(tp) in (Union, types.UnionType):
        return [m for a in get_args(tp) if a is not type(None) for m in _markers(a)]
    return list(get_args(tp)[1:]) if get_origin(tp) is Annotated else []


def _compile_encoder(spec: _RecordSpec) -> Callable[[Any, list[Any], dict[Any, Any]], dict[str, Any]]:
    """The record's encoder as straight-line code (one block per field, no per-field loop or tuple unpacking).

    The same rules as a loop over `spec.plan`: a field equal to its immutable default is left off, a
    str/int/bool field of exactly its type is stored as it is, anything else goes through its converter.
    """
    ns: dict[str, Any] = {"cls": spec.cls, "ProtocolError": ProtocolError, "shared": spec.shared}
    lines = ["def enc(obj, frames, memo):"]
    if spec.shared is not None:
        lines.append("    if obj is shared:")  # every field at its default: every one is left off
        lines.append("        return {}")
    lines += ["    if obj.__class__ is not cls:",
              f"        raise ProtocolError('encode', {'expected ' + spec.cls.__name__ + ', got '!r} + type(obj).__name__)",
              "    out = {}"]
    for i, (name, inline, enc, default) in enumerate(spec.plan):
        ns[f"e{i}"] = _OPTIONAL[enc] if default is None and enc in _OPTIONAL else enc
        store = f"out[{name!r}] = " + (f"v if type(v) is t{i} else e{i}(v, frames, memo)" if inline is not None else f"e{i}(v, frames, memo)")
        if inline is not None:
            ns[f"t{i}"] = inline
        lines.append(f"    v = obj.{name}")
        if default is _NO_DEFAULT:
            lines.append(f"    {store}")
        elif default is None:
            lines.append("    if v is not None:")
            lines.append(f"        {store}")
        else:
            ns[f"d{i}"] = default
            ns[f"dt{i}"] = type(default)
            lines.append(f"    if not (v is d{i} or (type(v) is dt{i} and v == d{i})):")
            lines.append(f"        {store}")
    lines.append("    return out")
    exec("\n".join(lines), ns)  # code made from the record's own field list (as dataclasses makes __init__), never from wire data
    return ns["enc"]  # type: ignore[no-any-return]


def _compile_decoder(spec: _RecordSpec) -> Callable[[Any, _DecodeState, str], Any]:
    """The record's decoder as straight-line code: each field looked up once, checked inline or by its
    converter, its default or factory filled in when absent; the object built through its slots (a record
    has no `__post_init__`, so this is what its `__init__` does, without the keyword call).

    Refuses what the loop over the wire map refused: not a map, more unknown fields than
    `Limits.max_unknown_fields`, a missing required field, a value its converter refuses.
    """
    cls = spec.cls
    name_ = cls.__name__
    ns: dict[str, Any] = {"cls": cls, "new": object.__new__, "M": _NO_DEFAULT, "_fail": _fail, "_unknown_fields": _unknown_fields, "spec": spec,
                          "shared": spec.shared}
    nfields = len(spec.plan)
    lines = ["def dec(raw, st, path):",
             "    if type(raw) is not dict:",
             f"        raise _fail('type', path, {'expected a map for ' + name_ + ', got '!r} + type(raw).__name__)",
             "    n = len(raw)",
             *(["    if not n:", "        return shared"] if spec.shared is not None else []),
             "    bound = st.limits.max_unknown_fields",
             f"    if n > {nfields} + bound:",
             "        raise _unknown_fields(spec, raw, bound, path)",
             "    found = 0",
             "    get = raw.get",
             "    o = new(cls)"]
    for i, (name, _inline, _enc, _default) in enumerate(spec.plan):
        inline, dec = spec.decoders[name]
        ns[f"c{i}"] = dec
        ns[f"s{i}"] = cls.__dict__[name].__set__  # the slot's setter (a frozen record refuses plain setattr)
        lines.append(f"    v = get({name!r}, M)")
        lines.append("    if v is M:")
        if name in spec.static_defaults:
            ns[f"d{i}"] = spec.static_defaults[name]
            lines.append(f"        v = d{i}")
        elif name in spec.factories:
            ns[f"f{i}"] = spec.factories[name]
            lines.append(f"        v = f{i}()")
        else:
            lines.append(f"        raise _fail('missing_field', path, {name_ + '.' + name + ' is required'!r})")
        lines.append("    else:")
        lines.append("        found += 1")
        if inline is not None:
            ns[f"t{i}"] = inline
            lines.append(f"        if type(v) is not t{i}:")
            lines.append(f"            v = c{i}(v, st)")
        elif dec in _OPTIONAL:
            ns[f"c{i}"] = _OPTIONAL[dec]
            lines.append("        if v is not None:")
            lines.append(f"            v = c{i}(v, st)")
        else:
            lines.append(f"        v = c{i}(v, st)")
        lines.append(f"    s{i}(o, v)")
    lines.append("    if n - found > bound:")
    lines.append("        raise _unknown_fields(spec, raw, bound, path)")
    lines.append("    return o")
    exec("\n".join(lines), ns)  # code made from the record's own field list, never from wire data
    return ns["dec"]  # type: ignore[no-any-return]


_NO_DEFAULT = object()
_OPTIONAL: dict[Any, Any] = {}
"""The converter of ``X | None`` -> the converter of ``X`` (one call less per field in the compiled code)."""


def _immutable(v: Any) -> bool:
    if v is None or type(v) in (str, int, float, bool, bytes):
        return True
    return type(v) is tuple and all(_immutable(x) for x in v)


def _records_eq(self: Any, other: Any) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return records_equal(self, other)


def records_equal(a: Any, b: Any) -> bool:
    """Deep equality that compares arrays and blobs by content."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        return a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, (bytes, bytearray, memoryview)) and isinstance(b, (bytes, bytearray, memoryview)):
        return bytes(a) == bytes(b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        if a.__class__ is not b.__class__:
            return False
        return all(
            records_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(records_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(records_equal(a[k], b[k]) for k in a)
    return bool(a == b)


class _Factory:
    """The default of a field with a default factory in a compiled `__init__` (as dataclasses' own marker)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


def _compile_init(cls: type[Any]) -> Callable[..., None] | None:
    """`cls.__init__` as dataclasses writes it for a frozen record (same parameters, defaults and default
    factories), storing each field through its slot's setter instead of ``object.__setattr__`` by name: a
    third less per object built (every Task, GroupResult and reply the broker sends). None (dataclasses'
    own is kept) for a record with anything else to do: `__post_init__`, keyword-only or non-init fields."""
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or any(not f.init or f.kw_only for f in fields):
        return None
    ns: dict[str, Any] = {"F": _FACTORY}
    params: list[str] = []
    body: list[str] = []
    for i, f in enumerate(fields):
        ns[f"s{i}"] = cls.__dict__[f.name].__set__
        if f.default is not dataclasses.MISSING:
            ns[f"d{i}"] = f.default
            params.append(f"{f.name}=d{i}")
            body.append(f"    s{i}(self, {f.name})")
        elif f.default_factory is not dataclasses.MISSING:
            ns[f"f{i}"] = f.default_factory
            params.append(f"{f.name}=F")
            body.append(f"    s{i}(self, f{i}() if {f.name} is F else {f.name})")
        else:
            params.append(f.name)
            body.append(f"    s{i}(self, {f.name})")
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body or ["    pass"]), ns)  # from the record's own fields
    init: Callable[..., None] = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    return init


@dataclass_transform(frozen_default=True)
def record(cls: type[T]) -> type[T]:
    """Make `cls` a frozen, slotted dataclass that can nest inside messages."""
    dc = dataclasses.dataclass(frozen=True, slots=True, eq=False)(cls)
    fast_init = _compile_init(dc)
    if fast_init is not None:
        dc.__init__ = fast_init  # type: ignore[method-assign]
    dc.__eq__ = _records_eq  # type: ignore[method-assign]
    dc.__hash__ = None  # type: ignore[assignment]
    _SPECS[dc] = _RecordSpec(dc)
    return dc


@dataclass_transform(frozen_default=True)
def message(type_name: str) -> Callable[[type[T]], type[T]]:
    """Register a top-level message type under its wire `type_name`."""

    def wrap(cls: type[T]) -> type[T]:
        if type_name in _MESSAGES:
            raise TypeError(f"message type {type_name!r} registered twice")
        dc: Any = record(cls)
        dc.TYPE = type_name
        _MESSAGES[type_name] = dc
        return cls if dc is cls else dc

    return wrap


def message_types() -> dict[str, type[Any]]:
    """Every registered message type by its wire name."""
    return dict(_MESSAGES)


# --------------------------------------------------------------------------- converters


def _fail(code: str, path: str, detail: str) -> ProtocolError:
    return ProtocolError(code, f"{path}: {detail}")


def _converters(tp: Any, path: str) -> tuple[_Enc, _Dec]:  # noqa: C901 - grandfathered: one branch per annotation shape the codec supports
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        for marker in extra:
            if isinstance(marker, _FrameKind):
                return _frame_converters(marker.dtype, path)
        return _converters(base, path)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1 or len(get_args(tp)) != 2:
            raise TypeError(f"{path}: only `X | None` unions are supported")
        enc, dec = _converters(args[0], path)

        def enc_opt(v: Any, frames: list[Any], memo: dict[Any, Any]) -> Any:
            return None if v is None else enc(v, frames, memo)

        def dec_opt(v: Any, st: _DecodeState) -> Any:
            return None if v is None else dec(v, st)

        _OPTIONAL[enc_opt] = enc  # the compiled record code tests for None itself and calls these directly
        _OPTIONAL[dec_opt] = dec
        return enc_opt, dec_opt
    if origin in (list, tuple):
        targs = get_args(tp)
        item = targs[0]
        if origin is tuple and not (len(targs) == 2 and targs[1] is Ellipsis):
            raise TypeError(f"{path}: only tuple[X, ...] is supported")
        if item in (str, int, float, bool):
            check = _scalar_check(item, path + "[]")

            iconv = _scalar_encoder(item, path + "[]")

            def enc_scalars(v: Any, frames: list[Any], memo: dict[Any, Any]) -> Any:
                return [iconv(x) for x in v]

            def dec_scalars(v: Any, st: _DecodeState) -> Any:
                if type(v) is not list:
                    raise _fail("type", path, f"expected a list, got {type(v).__name__}")
                return tuple([check(x) for x in v])

            return enc_scalars, dec_scalars
        ienc, idec = _converters(item, path + "[]")
        if isinstance(item, type) and item in _SPECS:
            rdec, ipath = _SPECS[item].decode, path + "[]"

            def dec_records(v: Any, st: _DecodeState) -> Any:
                if type(v) is not list:
                    raise _fail("type", path, f"expected a list, got {type(v).__name__}")
                return tuple([rdec(x, st, ipath) for x in v])

            def enc_records(v: Any, frames: list[Any], memo: dict[Any, Any]) -> Any:
                carry = memo.get(_CARRY)
                if carry is not None:  # records received as maps that are sent on as they came (`carry_entry`)
                    entry = carry.get(id(v))
                    if entry is not None and entry[0] is v:
                        inl = memo[_INLINE]
                        if entry[3] <= inl[0] and entry[2] <= inl[1]:
                            inl[1] -= entry[2]
                            return entry[1]
                return [ienc(x, frames, memo) for x in v]

            return enc_records, dec_records

        def enc_list(v: Any, frames: list[Any], memo: dict[Any, Any]) -> Any:
            return [ienc(x, frames, memo) for x in v]

        def dec_list(v: Any, st: _DecodeState) -> Any:
            if type(v) is not list:
                raise _fail("type", path, f"expected a list, got {type(v).__name__}")
            return tuple([idec(x, st) for x in v])

        return enc_list, dec_list
    if origin is dict:
        key, _value = get_args(tp)
        if key is not str:
            raise TypeError(f"{path}: only dict[str, Any] is supported")

        def enc_map(v: Any, frames: list[Any], memo: dict[Any, Any]) -> Any:
            return v

        def dec_map(v: Any, st: _DecodeState) -> Any:
            if type(v) is not dict:
                raise _fail("type", path, f"expected a map, got {type(v).__name__}")
            _check_free(v, st.limits.max_depth, path)
            return v

        return enc_map, dec_map
    if tp is Any:

        def enc_any(v: Any, frames: list[Any], memo: dict[Any, Any]) -> Any:
            return v

        def dec_any(v: Any, st: _DecodeState) -> Any:
            _check_free(v, st.limits.max_depth, path)
            return v

        return enc_any, dec_any
    if tp in (str, int, float, bool, bytes):
        check = _scalar_check(tp, path)
        conv = _scalar_encoder(tp, path)

        def enc_scalar(v: Any, frames: list[Any], memo: dict[Any, Any]) -> Any:
            return conv(v)

        def dec_scalar(v: Any, st: _DecodeState) -> Any:
            return check(v)

        return enc_scalar, dec_scalar
    if isinstance(tp, type) and tp in _SPECS:
        spec = _SPECS[tp]
        rec_enc, rec_dec = spec.encode, spec.decode
        return (rec_enc, lambda v, st: rec_dec(v, st, path))
    raise TypeError(f"{path}: unsupported field type {tp!r}")


def _scalar_encoder(tp: type[Any], path: str) -> Callable[[Any], Any]:
    """Accept numpy scalars for numbers; refuse anything that would change meaning."""

    def conv(v: Any) -> Any:
        if tp is int:
            if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
                return int(v)
        elif tp is float:
            if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)):
                return float(v)
        elif tp is bool:
            if isinstance(v, (bool, np.bool_)):
                return bool(v)
        elif tp is bytes:
            if isinstance(v, (bytes, bytearray, memoryview)):
                return bytes(v)
        elif type(v) is tp:
            return v
        raise _fail("encode", path, f"expected {tp.__name__}, got {type(v).__name__}")

    return conv


def _scalar_check(tp: type[Any], path: str) -> Callable[[Any], Any]:
    if tp is float:

        def check_float(v: Any) -> float:
            t = type(v)
            if t is float:
                return v  # type: ignore[no-any-return]
            if t is int:
                return float(v)
            raise _fail("type", path, f"expected float, got {t.__name__}")

        return check_float

    def check(v: Any) -> Any:
        if type(v) is not tp:
            raise _fail("type", path, f"expected {tp.__name__}, got {type(v).__name__}")
        return v

    return check


def _check_free(v: Any, depth: int, path: str) -> None:
    """Free-form values (metadata) may hold only msgpack natives, bounded in depth."""
    if depth < 0:
        raise _fail("oversize", path, "nesting too deep")
    t = type(v)
    if t is dict:
        for k, x in v.items():
            if type(k) is not str:
                raise _fail("type", path, "map keys must be strings")
            _check_free(x, depth - 1, path)
    elif t is list:
        for x in v:
            _check_free(x, depth - 1, path)
    elif t not in (str, int, float, bool, bytes, type(None)):
        raise _fail("type", path, f"unsupported value type {t.__name__}")


_INLINE = object()
"""The memo key of an encode's inline state: ``[max_bytes, budget_bytes_left]`` (absent: frames only)."""
_CARRY = object()
"""The memo key of an encode's carried records: id(tuple of records) -> `carry_entry` (absent: none)."""


def carry_entry(records: tuple[Any, ...], raws: Any) -> tuple[Any, list[Any], int, int] | None:
    """What lets a received tuple of records be sent on without encoding them again: ``(records, raws, inline
    bytes, largest inline value)`` when `raws` (from `decode(..., fields_out=...)`) are the maps `records` were
    decoded from and every array or blob in them travelled inline (a frame index would name a frame of the message
    they came in); None otherwise. Records whose arrays are their own fields only (`Trajectory`). An entry is used by
    `encode(msg, inline, carry)` for the same tuple object, within the inline policy; the maps go out as they came,
    unknown fields of a newer sender included (they were bounded when decoded)."""
    if not records or type(raws) is not list or len(raws) != len(records):
        return None
    names = _SPECS[type(records[0])].frame_fields
    total = largest = 0
    for raw in raws:
        if type(raw) is not dict:
            return None
        for name in names:
            v = raw.get(name)
            if v is None:
                continue
            if type(v) is not bytes:
                return None
            n = len(v)
            total += n
            if n > largest:
                largest = n
    return (records, raws, total, largest)


def _blob_converters(path: str) -> tuple[_Enc, _Dec]:
    def enc_blob(v: Any, frames: list[Any], memo: dict[Any, Any]) -> Any:
        key = (id(v), 0)
        idx = memo.get(key)
        if idx is None:
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise _fail("encode", path, f"expected bytes-like, got {type(v).__name__}")
            inl = memo.get(_INLINE)
            if inl is not None:
                arr = np.frombuffer(v, np.uint8)  # zero-copy; packed (inline) or sent (frame) like an array
                return _inline_or_frame(arr, key, frames, memo, inl)
            frames.append(v)
            idx = memo[key] = len(frames) - 1
        elif type(idx) is not int:
            return _promote(idx, key, frames, memo)
        return idx

    def dec_blob(v: Any, st: _DecodeState) -> Any:
        if type(v) is bytes:
            _check_inline(v, 1, st, path)
            return memoryview(v)
        f = st.frames[_frame_index(v, st, path)]
        return f if type(f) is memoryview else memoryview(f)

    return enc_blob, dec_blob


def _frame_converters(dtype: np.dtype[Any] | None, path: str) -> tuple[_Enc, _Dec]:
    if dtype is None:
        return _blob_converters(path)

    itemsize = dtype.itemsize

    def enc_array(v: Any, frames: list[Any], memo: dict[Any, Any]) -> Any:
        key = (id(v), itemsize)
        idx = memo.get(key)
        if idx is None:
            try:
                arr = np.ascontiguousarray(v, dtype=dtype)
            except (TypeError, ValueError, OverflowError) as exc:
                raise _fail("encode", path, f"cannot convert to {dtype}: {exc}") from exc
            if arr.ndim != 1:
                arr = arr.reshape(-1)
            inl = memo.get(_INLINE)
            if inl is not None:
                n = arr.nbytes
                if n <= inl[0] and n <= inl[1]:  # inline (as `_inline_or_frame`, written out: one call less per array)
                    inl[1] -= n
                    memo[key] = arr
                    memo[id(arr)] = -1
                    return arr
            frames.append(arr)
            idx = memo[key] = len(frames) - 1
        elif type(idx) is not int:
            return _promote(idx, key, frames, memo)
        return idx

    return enc_array, _array_decoder(dtype, path)


def _inline_or_frame(arr: Any, key: Any, frames: list[Any], memo: dict[Any, Any], inl: list[int]) -> Any:
    """An array met for the first time in an encode with an inline policy: inline if small enough and the budget
    allows (the array itself goes into the fields; the packer writes its bytes as a bin), else a frame."""
    n = arr.nbytes
    if n <= inl[0] and n <= inl[1]:
        inl[1] -= n
        memo[key] = arr
        memo[id(arr)] = -1  # the packer's default: pack this one inline (unless promoted to a frame later)
        return arr
    frames.append(arr)
    idx = memo[key] = len(frames) - 1
    return idx


def _promote(arr: Any, key: Any, frames: list[Any], memo: dict[Any, Any]) -> int:
    """An inline array referenced a second time: it travels once, in a frame, and every reference names it
    (the first one too: the packer finds its index by the array's id)."""
    frames.append(arr)
    idx = memo[key] = memo[id(arr)] = len(frames) - 1
    memo[_INLINE][1] += arr.nbytes
    return idx


def _check_inline(v: bytes, itemsize: int, st: _DecodeState, path: str) -> None:
    n = len(v)
    if n > st.limits.max_frame_bytes:  # (msgpack's max_bin_len bounds it first with the default limits)
        raise ProtocolError("oversize", f"{path}: inline value of {n} bytes, limit {st.limits.max_frame_bytes}", limit="max_frame_bytes")
    if n % itemsize:
        raise _fail("frames", path, f"inline value of {n} bytes is not a whole number of {itemsize}-byte items")


def _array_decoder(dtype: np.dtype[Any], path: str) -> _Dec:
    """A zero-copy, read-only view of the frame a field's index names (one per frame and dtype), or of the
    inline bytes the field holds (minor 12)."""
    itemsize = dtype.itemsize
    dtype_key = dtype.str
    frombuffer = np.frombuffer

    def dec_array(v: Any, st: _DecodeState) -> Any:
        sizes = st.sizes
        if type(v) is not int or not 1 <= v < len(sizes):
            if type(v) is bytes:  # inline: bytes are immutable, so the view is read-only already
                n = len(v)
                if n % itemsize or n > st.limits.max_frame_bytes:
                    _check_inline(v, itemsize, st, path)  # raises, with the reason
                return frombuffer(v, dtype)
            _frame_index(v, st, path)  # raises, with the reason
        st.used[v] = 1
        key = (v, dtype_key)
        arrays = st.arrays
        arr = arrays.get(key)
        if arr is None:
            if sizes[v] % itemsize:
                raise _fail("frames", path, f"frame of {sizes[v]} bytes is not a whole number of {dtype}")
            arr = arrays[key] = frombuffer(st.frames[v], dtype)  # positional: half the cost of dtype=
            if arr.flags.writeable:  # a zmq.Frame's buffer is writable; a decoded message is not (bytes never were)
                arr.flags.writeable = False
        return arr

    return dec_array


def _frame_index(v: Any, st: _DecodeState, path: str) -> int:
    if type(v) is not int:
        raise _fail("type", path, f"expected a frame index, got {type(v).__name__}")
    if not 1 <= v < len(st.frames):
        raise _fail("frames", path, f"frame index {v} out of range (message has {len(st.frames)} frames)")
    st.used[v] = 1
    return v


def _unknown_fields(spec: _RecordSpec, raw: dict[Any, Any], bound: int, path: str) -> ProtocolError:
    unknown = sum(1 for k in raw if k not in spec.decoders)
    return ProtocolError(
        "oversize", f"{path}: {unknown} unknown fields in {spec.cls.__name__}, limit {bound}", limit="max_unknown_fields"
    )


class _BudgetExceeded(Exception):
    pass


class _Budget:
    """Counts values as msgpack builds containers; raising stops the unpacker before it builds more."""

    __slots__ = ("left",)

    def __init__(self, n: int) -> None:
        self.left = n

    def on_list(self, v: list[Any]) -> list[Any]:
        self.left -= len(v) + 1
        if self.left < 0:
            raise _BudgetExceeded
        return v

    def on_map(self, v: dict[Any, Any]) -> dict[Any, Any]:
        self.left -= 2 * len(v) + 1
        if self.left < 0:
            raise _BudgetExceeded
        return v


# --------------------------------------------------------------------------- public API


_PACKERS = threading.local()


class _PackState:
    """This thread's msgpack packer (``packb`` builds a new one, its buffer included, for every call; a packer's
    `pack` resets its buffer after each call and after a failed one, so reusing it changes nothing), and the memo
    of the encode in progress, through which its `default` packs the inline arrays (an array is not a msgpack
    type: `default` is asked, and answers its bytes, or its frame index when it was promoted to a frame)."""

    __slots__ = ("memo", "packer")

    def __init__(self) -> None:
        self.memo: dict[Any, Any] | None = None
        self.packer = msgpack.Packer(use_bin_type=True, default=self.default)

    def default(self, obj: Any) -> Any:
        memo = self.memo
        if memo is not None:
            r = memo.get(id(obj))
            if r is not None:
                return memoryview(obj) if r < 0 else r
        raise TypeError(f"can not serialize {type(obj).__name__!r} object")


def _pack_state() -> _PackState:
    try:
        ps: _PackState = _PACKERS.p
    except AttributeError:
        ps = _PACKERS.p = _PackState()
    return ps


def encode(msg: Any, inline: Inline | None = None, carry: dict[int, Any] | None = None) -> list[Any]:
    """Encode a registered message to a list of frames for ``send_multipart``.

    Frame 0 is bytes; the others are numpy arrays or bytes-like objects that
    ZeroMQ sends without a Python-side copy. With `inline` (only for a peer of
    minor 12 or later: `inline_for`), small arrays and blobs travel in frame 0, and `carry` (id of a tuple of
    records -> `carry_entry`) sends such tuples as the maps they were received in.
    """
    cls = msg.__class__
    type_name = getattr(cls, "TYPE", None)
    if type_name is None or _MESSAGES.get(type_name) is not cls:
        raise ProtocolError("encode", f"{cls.__name__} is not a registered message type")
    frames: list[Any] = [b""]
    try:
        if inline is None:
            fields = _SPECS[cls].encode(msg, frames, {})  # type: ignore[index]
            frames[0] = _pack_state().packer.pack([PROTOCOL_MAJOR, PROTOCOL_MINOR, type_name, fields])
        else:
            memo: dict[Any, Any] = {_INLINE: [inline.max_bytes, inline.budget_bytes]}
            if carry:
                memo[_CARRY] = carry
            fields = _SPECS[cls].encode(msg, frames, memo)  # type: ignore[index]
            ps = _pack_state()
            ps.memo = memo
            try:
                frames[0] = ps.packer.pack([PROTOCOL_MAJOR, PROTOCOL_MINOR, type_name, fields])
            finally:
                ps.memo = None
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError("encode", f"{type_name}: {exc}") from exc
    return frames


def message_bytes(frames: Sequence[Frame]) -> int:
    """Bytes of the largest part of an encoded message (what a receiver's MAXMSGSIZE is checked against)."""
    largest = 0
    for f in frames:
        t = type(f)
        n = len(f) if t is bytes else f.nbytes if t is np.ndarray else memoryview(f).nbytes
        if n > largest:
            largest = n
    return largest


def check_size(frames: Sequence[Frame], max_msg_bytes: int, what: str, max_header_bytes: int = 0) -> None:
    """Refuse (`MessageTooLargeError`, naming the limit) a message the peer would drop or refuse.

    ZeroMQ applies MAXMSGSIZE to each message part; a part over it makes the
    receiving libzmq close the connection, silently, with the message lost. The
    limits are those the peer announced in its hello or welcome; 0 (an older
    peer that did not say) means the defaults every rollpool peer has used.
    """
    if not frames:
        return
    limit = max_msg_bytes or DEFAULT_PEER_MAX_MSG_BYTES
    largest = message_bytes(frames)
    if largest > limit:
        raise MessageTooLargeError(what, largest, limit)
    header_limit = max_header_bytes or DEFAULT_LIMITS.max_header_bytes
    header = memoryview(frames[0]).nbytes
    if header > header_limit:
        raise MessageTooLargeError(f"{what} header", header, header_limit, limit="max_header_bytes")


_ZMQ_FRAME: Any = None
"""`zmq.Frame` once decode has seen one (found by name: the codec does not import zmq)."""


def _zmq_frame_seen(t: type[Any]) -> None:
    global _ZMQ_FRAME
    _ZMQ_FRAME = t


_UNPACK_KW: dict[int, tuple[Limits, dict[str, Any]]] = {}


def _unpack_kw(limits: Limits) -> dict[str, Any]:
    """msgpack's options for headers under `limits` (built once per `Limits` object, which is frozen)."""
    entry = _UNPACK_KW.get(id(limits))
    if entry is None or entry[0] is not limits:
        kw = dict(raw=False, use_list=True, strict_map_key=True, max_str_len=limits.max_str_len, max_bin_len=limits.max_bin_len,
                  max_array_len=limits.max_array_len, max_map_len=limits.max_map_len, max_ext_len=0)
        if len(_UNPACK_KW) > 64:  # a program that makes many Limits objects: forget the old ones
            _UNPACK_KW.clear()
        entry = _UNPACK_KW[id(limits)] = (limits, kw)
    return entry[1]


def decode(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS, accept: Container[str] | None = None,  # noqa: C901 - grandfathered: the strict decoder's checks, in order, each with its error code
           fields_out: list[Any] | None = None) -> Any:
    """Decode frames into a message object; raises `ProtocolError` and nothing else.

    `accept`: the message types the receiving socket serves; any other type is
    refused (``unexpected_type``) before its fields are decoded. `fields_out`: a list the header's field map is
    appended to once the message decoded (for `carry_entry`).
    """
    try:
        n = len(frames)
    except TypeError as exc:
        raise ProtocolError("malformed", "frames must be a sequence") from exc
    if n == 0:
        raise ProtocolError("truncated", "no frames")
    if n > limits.max_frames:
        raise ProtocolError("oversize", f"{n} frames, limit {limits.max_frames}", limit="max_frames")
    views: list[Any] = list(frames)
    sizes: list[int] = [0] * n
    max_frame = limits.max_frame_bytes
    for i in range(n):  # in order: the first frame that is not bytes-like or too large is the one named
        f = views[i]
        t = type(f)
        if t is bytes or t is _ZMQ_FRAME:  # their len() is their size; numpy and msgpack read them as they are
            size = len(f)
        else:
            try:
                mv = memoryview(f)
            except TypeError as exc:
                raise ProtocolError("malformed", f"frame {i} is not bytes-like") from exc
            size = mv.nbytes
            views[i] = mv
            if _ZMQ_FRAME is None and t.__name__ == "Frame" and t.__module__ == "zmq.sugar.frame":
                _zmq_frame_seen(t)
        if i == 0:
            if size > limits.max_header_bytes:
                raise ProtocolError("oversize", f"header of {size} bytes, limit {limits.max_header_bytes}", limit="max_header_bytes")
        elif size > max_frame:
            raise ProtocolError("oversize", f"frame {i} of {size} bytes, limit {max_frame}", limit="max_frame_bytes")
        sizes[i] = size
    total = sum(sizes)
    if total > limits.max_message_bytes:
        raise ProtocolError("oversize", f"message of {total} bytes, limit {limits.max_message_bytes}", limit="max_message_bytes")
    # every msgpack value takes at least one byte, so a header no longer than the budget cannot exceed
    # it: only longer ones pay for counting (a Python call per container)
    unpack_kw = _unpack_kw(limits)
    try:
        if sizes[0] > limits.max_header_objects:
            budget = _Budget(limits.max_header_objects)
            header = msgpack.unpackb(views[0], list_hook=budget.on_list, object_hook=budget.on_map, **unpack_kw)
        else:
            header = msgpack.unpackb(views[0], **unpack_kw)
    except _BudgetExceeded:
        raise ProtocolError(
            "oversize", f"header holds more than {limits.max_header_objects} values", limit="max_header_objects"
        ) from None
    except ValueError as exc:  # msgpack reports its own size limits as ValueError
        if "exceeds max_" in str(exc) and "max_ext_len" not in str(exc):  # ext types are refused as malformed
            raise ProtocolError("oversize", f"header: {exc}", limit="msgpack") from exc
        raise ProtocolError("malformed", f"header is not valid msgpack: {type(exc).__name__}") from exc
    except Exception as exc:  # msgpack raises many types; all mean "bad header"
        raise ProtocolError("malformed", f"header is not valid msgpack: {type(exc).__name__}") from exc
    if type(header) is not list or len(header) != 4:
        raise ProtocolError("malformed", "header must be [major, minor, type, fields]")
    major, minor, type_name, fields = header
    if type(major) is not int or type(minor) is not int:
        raise ProtocolError("malformed", "protocol version must be two ints")
    if major not in SUPPORTED_MAJORS:
        raise ProtocolError("version", f"protocol major {major} not supported (this peer speaks {list(SUPPORTED_MAJORS)})")
    if type(type_name) is not str:
        raise ProtocolError("malformed", "message type must be a string")
    cls = _MESSAGES.get(type_name)
    if cls is None:
        raise ProtocolError("unknown_type", f"unknown message type {type_name[:64]!r}")
    if accept is not None and type_name not in accept:
        raise ProtocolError("unexpected_type", f"{type_name} is not accepted on this socket", limit="message_type")
    st = _DecodeState(views, sizes, limits)
    msg = _SPECS[cls].decode(fields, st, type_name)
    if n > 1 and st.used.count(1) != n - 1:
        unused = [i for i in range(1, n) if not st.used[i]]
        raise ProtocolError("frames", f"{type_name}: frames {unused[:8]} are not referenced")
    if fields_out is not None:
        fields_out.append(fields)
    return msg


def peek_type(frames: Sequence[Frame]) -> str | None:
    """The type string of a message without decoding it fully (None if unreadable).

    Streams the header: the version ints are skipped and the fields are never
    read, so a hostile header costs no more here than its own bytes.
    """
    try:
        unpacker = msgpack.Unpacker(raw=False, max_str_len=256, max_bin_len=256, max_array_len=4, max_map_len=0, max_ext_len=0)
        unpacker.feed(frames[0])
        if unpacker.read_array_header() != 4:
            return None
        unpacker.skip()
        unpacker.skip()
        t = unpacker.unpack()
        return t if type(t) is str else None
    except Exception:  # noqa: BLE001 - peek_type never raises: bytes that do not unpack have no type
        return None
