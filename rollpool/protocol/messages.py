"""Every message rollpool puts on the wire, as frozen dataclasses.

Three flows share one codec (see `codec.py`):

worker <-> broker (worker DEALER, broker ROUTER "worker" port)
    Hello -> Welcome; Credit; Task / TaskBatch; Result / ResultBatch;
    WorkerHeartbeat / BrokerHeartbeat; Nack; Goodbye; Cancel; Control ->
    ControlReply; ApplyRequest -> ApplyGrant -> ApplyDone (rolling weight updates).
client <-> broker (client DEALER, broker ROUTER "client" port)
    ClientHello -> ClientWelcome; Submit -> SubmitReply; Pull -> Batch; Ack;
    SetVersion -> Reply; StatusRequest -> StatusReply; Control -> ControlReply;
    CancelPrompts -> Reply.
weights (publisher PUB + ROUTER; worker or relay SUB + DEALER)
    Announce (PUB); ManifestRequest -> Manifest; Fetch -> Chunk.
any
    Error: the answer to a request that could not be served.

Requests carry a `request_id` that the reply echoes. Every broker reply and
heartbeat carries the broker's `epoch`, so peers notice a restart. Fields with
defaults are optional on the wire; a later minor version adds fields only with
defaults, so older peers keep decoding newer messages. A new message type is
sent only to a peer that said it speaks it (`Hello.features`, `Welcome.features`).

Minor 1 (broker at scale, reconciliation groundwork): per-worker dispatch
sequence numbers (`Task.seq`); heartbeats that echo the highest one received,
the worker's absolute free capacity and a constant-size digest of the tasks it
holds (`held_count`, `held_digest`), the full list only when asked
(`BrokerHeartbeat.send_held`) or when the worker chooses (`held_full`); several
tasks or results per message (`TaskBatch`, `ResultBatch`) and credit returned
with a result (`Result.credits`), each used only when both sides list the
feature (`FEATURES`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable
from dataclasses import field
from typing import Any

import numpy as np

from rollpool.protocol.codec import Blob, Float32Array, Int32Array, UInt8Array, message, record

__all__ = [
    # features and the held-task digest
    "FEATURES",
    "Feature",
    "task_digest",
    "held_digest",
    # records
    "SamplingParams",
    "Prompt",
    "PromptImage",
    "Trajectory",
    "GroupResult",
    "InflightTask",
    "Rejection",
    "TensorInfo",
    "BucketInfo",
    "CudaIpcBuffer",
    "AdapterSpec",
    "ShmSegment",
    # group terminal states and finish reasons
    "GroupState",
    "FinishReason",
    # worker states (on WorkerHeartbeat.state) and weight-apply modes
    "WorkerState",
    "ApplyMode",
    # worker flow
    "Hello",
    "Welcome",
    "Credit",
    "Task",
    "RecordedTurn",
    "TurnRecords",
    "TurnRecordBatch",
    "TaskBatch",
    "Result",
    "ResultBatch",
    "WorkerHeartbeat",
    "BrokerHeartbeat",
    "Nack",
    "Goodbye",
    "Cancel",
    "Control",
    "ControlReply",
    "ApplyRequest",
    "ApplyGrant",
    "ApplyDone",
    # client flow
    "ClientHello",
    "ClientWelcome",
    "Submit",
    "SubmitReply",
    "Pull",
    "Batch",
    "Ack",
    "SetVersion",
    "StatusRequest",
    "StatusReply",
    "CancelPrompts",
    "Reply",
    # weights
    "Announce",
    "ManifestRequest",
    "Manifest",
    "Fetch",
    "Chunk",
    # any
    "Error",
]


class GroupState:
    """Terminal states of a prompt group, as the trainer is told of them."""

    DONE = "done"
    FAILED = "failed"
    DROPPED_STALE = "dropped_stale"
    CANCELLED = "cancelled"
    ALL = (DONE, FAILED, DROPPED_STALE, CANCELLED)


class FinishReason:
    """Why one sample ended (data on the trajectory, never an exception)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    ALL = (STOP, LENGTH, ABORT, ERROR)


class WorkerState:
    """The worker states that travel on `WorkerHeartbeat.state` (the broker dispatches to ``ready`` only)."""

    STARTING = "starting"
    READY = "ready"
    APPLYING = "applying"
    RESTARTING = "restarting"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    STOPPED = "stopped"
    ALL = (STARTING, READY, APPLYING, RESTARTING, DRAINING, SLEEPING, STOPPED)


class ApplyMode:
    """How an engine applies a weight version (`Engine.pause(mode)`; `--apply-mode`; docs/workers.md)."""

    INTERRUPT = "interrupt"
    """Running sequences stop at a step boundary and resume as prompt + partial output on the new weights."""
    IN_PLACE = "in_place"
    """Running sequences are held with their KV cache and continue on the new weights."""
    DRAIN = "drain"
    """No new sequence starts; the update waits for the running ones to finish."""
    ALL = (INTERRUPT, IN_PLACE, DRAIN)


class Feature:
    """Optional wire features a peer lists in `Hello.features` / `Welcome.features` (minor 1).

    A sender uses one only when the receiver listed it: an older peer lists none and
    keeps getting (and sending) the minor-0 shapes.
    """

    TASK_BATCH = "task_batch"
    """The worker decodes `TaskBatch` (several tasks in one message)."""
    RESULT_BATCH = "result_batch"
    """The broker decodes `ResultBatch` (several results, and credit, in one message)."""
    RESULT_CREDITS = "result_credits"
    """The broker reads `Result.credits` (credit returned with the result, no separate Credit)."""
    HELD_DIGEST = "held_digest"
    """The broker checks `WorkerHeartbeat.held_digest` and may ask for the full list (`BrokerHeartbeat.send_held`)."""
    RECONCILE = "reconcile"
    """(minor 5) Once welcomed, the worker's heartbeats are whole: `dispatch_seq` echoes the highest `Task.seq`
    received since `Welcome.dispatch_seq`, `free_capacity` is absolute and the held list is complete. The broker
    acts on them: a lease at or below the echo the worker does not hold (or one above it not echoed two heartbeat
    intervals after dispatch) is requeued burning no attempt, and credit is set from the free capacity. A worker
    without it only has its heartbeats recorded."""
    IMAGES = "images"
    """(minor 16, `IMAGES_MINOR`) The worker reads `Prompt.images`: the broker gives a prompt with images only to a
    worker that lists it (an older one would drop the images and generate from the text alone); such a prompt
    waits in the queue while no connected worker lists it."""
    REPLAY = "replay"
    """(minor 20, `REPLAY_MINOR`) Episode turns are kept off the worker: a broker that lists it reads `TurnRecords`
    (each finished turn of a running episode, streamed as it ends) and a worker that lists it reads `Task.replay`
    (the turns an earlier attempt of the group recorded). Each side sends them only to a peer that lists it."""
    TURN_BATCH = "turn_batch"
    """(minor 29, `TURN_BATCH_MINOR`; the broker's Welcome only) The broker decodes `TurnRecordBatch`: the finished turns
    of every task that a worker gathered, in one message instead of one `TurnRecords` per task. A worker sends it only to a
    broker that lists it; an older broker keeps getting `TurnRecords`."""
    ADAPTER_NO_GRANT = "adapter_no_grant"
    """(minor 21, `ADAPTER_GRANT_MINOR`; the broker's Welcome only) An adapter version needs no apply slot: a worker whose
    engine serves adapter versions without a pause (``adapters_without_pause``) applies one without `ApplyRequest` /
    `ApplyGrant` and reports it with `ApplyDone` as always. Listed only when the broker's activation allows it: not in
    fleet activation, where the workers' asks are how the broker switches them together."""


FEATURES: tuple[str, ...] = (Feature.TASK_BATCH, Feature.RESULT_BATCH, Feature.RESULT_CREDITS, Feature.HELD_DIGEST, Feature.RECONCILE,
                             Feature.IMAGES, Feature.REPLAY, Feature.ADAPTER_NO_GRANT, Feature.TURN_BATCH)
"""Every feature this build speaks."""

_DIGEST_MASK = (1 << 63) - 1


def _edge_version(token_versions: Int32Array, loss_mask: UInt8Array, *, first: bool) -> int:
    """The version of the first (or last) sampled token: mask 1 where the mask matches the versions, else any token."""
    versions = np.asarray(token_versions)
    if not versions.size:
        return -1
    mask = np.asarray(loss_mask)
    if mask.shape == versions.shape:
        idx = np.flatnonzero(mask)
        if idx.size:
            return int(versions[idx[0] if first else idx[-1]])
    return int(versions[0 if first else -1])


def task_digest(task_id: str) -> int:
    """A 63-bit hash of one task id (the same in every process: blake2b, not Python's salted hash)."""
    return int.from_bytes(hashlib.blake2b(task_id.encode(), digest_size=8).digest(), "little") & _DIGEST_MASK


def held_digest(task_ids: Iterable[str]) -> int:
    """The digest of a set of held task ids: the XOR of their `task_digest`s.

    XOR makes it incremental (add or remove one id: XOR its digest in or out) and
    independent of order; blake2b (not a CRC, which is linear) keeps two different
    small sets from colliding except by chance (2^-63).
    """
    d = 0
    for tid in task_ids:
        d ^= task_digest(tid)
    return d


# --------------------------------------------------------------------------- records


@record
class SamplingParams:
    """Sampling settings of one prompt group (the names SGLang uses)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 means no top-k truncation."""
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings."""
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs_num: int = 0
    """Report the logprobs of the k most likely tokens at every output position (0: none; SGLang's name).
    A worker whose engine cannot refuses the task (an error result naming it); protocol 1.7."""
    logprob_start_len: int = -1
    """Report the logprobs of the prompt's tokens from this position on (-1: none; SGLang's name). A worker
    whose engine cannot refuses the task; protocol 1.7."""


@record
class PromptImage:
    """One image of a prompt (protocol 1.16, `IMAGES_MINOR`): exactly one of `data`, `path`, `url`.

    `data` is the encoded image file (PNG, JPEG, ...; a base64 data URI is decoded into it by
    `PromptImage.of`); `path` a file the worker reads (the worker's file system, not the trainer's);
    `url` an http(s) address the worker fetches only when its operator allows it (``image_fetch``),
    under a size and a time limit. The worker refuses anything else with an error result naming why."""

    data: Blob | None = None
    path: str = ""
    url: str = ""

    @staticmethod
    def of(value: PromptImage | bytes | bytearray | memoryview | str) -> PromptImage:
        """An image from raw bytes, a ``data:image/...;base64,`` URI, an ``http(s)://`` URL or a local path.

        A malformed data URI raises ValueError here (the caller's mistake, before anything is sent)."""
        if isinstance(value, PromptImage):
            return value
        if isinstance(value, (bytes, bytearray, memoryview)):
            return PromptImage(data=bytes(value))
        if not isinstance(value, str) or not value:
            raise TypeError(f"an image is bytes, a data URI, a URL or a path, got {type(value).__name__}")
        if value.startswith("data:"):
            head, sep, payload = value.partition(",")
            if not sep or not head.endswith(";base64"):
                raise ValueError(f"an image data URI must be data:<type>;base64,<data>, got {value[:40]!r}...")
            try:
                return PromptImage(data=base64.b64decode(payload, validate=True))
            except binascii.Error as exc:
                raise ValueError(f"an image data URI holds invalid base64: {exc}") from exc
        if value.startswith(("http://", "https://")):
            return PromptImage(url=value)
        return PromptImage(path=value)


@record
class Prompt:
    """One prompt group: `group_size` samples of the same input on one engine."""

    prompt_id: str
    input_ids: Int32Array | None = None
    text: str | None = None
    """Tokenized by the worker with the model's tokenizer when `input_ids` is None."""
    apply_chat_template: bool = False
    group_size: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    """Higher is dispatched first; equal priorities keep submission order."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Small map echoed back on every trajectory (e.g. the reference answer)."""
    exempt_from_staleness: bool = False
    """True for rollouts that are not training samples (evaluation): the broker dispatches them
    outside the staleness admission rule and does not count them as accepted or running."""
    min_weight_version: int = -1
    """Dispatch only to a worker whose applied weight version is at least this (-1: any worker).
    Synchronous callers set it to the version they just published, so the next generation is
    served at that version or newer (added in protocol 1.1; older brokers ignore it)."""
    exact_weight_version: int = -1
    """Serve the group only at exactly this weight version (-1: any): it goes only to a worker serving it, and
    a result with a sampled token of another version is not delivered (the group is tried again on a worker
    still at the version). When no live worker holds it and none can reach it (older than every worker's
    version, given up by every worker, or never published), the group fails at once with the reason; a
    version in the future by more than the staleness bound allows is refused at submit (protocol 1.14,
    `CONTRACT_MINOR`; the client refuses to send it to an older broker)."""
    images: tuple[PromptImage, ...] = ()
    """Images the prompt shows the model, in the order of its image placeholders (docs/multimodal.md); they
    travel once per group. Protocol 1.16 (`IMAGES_MINOR`); a worker whose engine takes no images refuses the
    prompt (an error result), never ignores them."""
    policy: str | None = None
    """The policy to generate the group with: the name of a LoRA adapter the pool serves (`AdapterSpec.name`, as the
    trainer published it; docs/lora.md). None: whatever the pool serves, as before. A name the pool does not serve (no
    adapter of that name announced, or the base model's name while an adapter is on) is refused at submit
    (``policy_unavailable``, naming what is served); the group goes only to a worker serving the policy, and is
    delivered only when every sampled token was made under it (`Trajectory.policy` then says so). Protocol 1.25
    (`POLICY_MINOR`; the client refuses to send one to an older broker)."""


@record
class Trajectory:
    """One sample of a group, every output token tagged with its policy version."""

    prompt_id: str
    sample_index: int
    input_ids: Int32Array
    output_ids: Int32Array
    """The stop token included, as SGLang reports it."""
    output_logprobs: Float32Array
    """log_softmax(logits / temperature) of each output token, before top-k/top-p."""
    token_versions: Int32Array
    """Policy (weight) version that produced each output token."""
    loss_mask: UInt8Array
    """1 for generated tokens, 0 for tokens inserted by a multi-turn workflow."""
    finish_reason: str
    worker_id: str = ""
    attempt: int = 0
    output_text: str | None = None
    queued_at: float = 0.0
    started_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    """Wall-clock timestamps (seconds since the epoch)."""
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    segment_index: int = 0
    """Episodes: the segment of sample `sample_index` this trajectory holds (a history rewrite starts a
    new one); 0 for a plain generate call."""
    output_top_ids: Int32Array | None = None
    """With `SamplingParams.top_logprobs_num` k: the k most likely token ids at every output position,
    row-major (len(output_ids) * k), most likely first; None otherwise (protocol 1.7)."""
    output_top_logprobs: Float32Array | None = None
    """Their logprobs (the same log_softmax(logits / temperature) as `output_logprobs`), same layout."""
    input_logprobs: Float32Array | None = None
    """With `SamplingParams.logprob_start_len` s >= 0: the logprob of each prompt token from position s on
    (len(input_ids) - s values, the same log_softmax), NaN for position 0 (nothing precedes it); protocol 1.7."""
    version_epoch: int = -1
    """The pool's version epoch (run) that the weights which made the newest token belong to (`SetVersion.rebase`
    starts a new one; 0: never rebased); -1: not stated (a worker older than protocol 1.15, `EPOCH_MINOR`).
    `token_versions` count within it: after a rebase to v, a token of version above v from an earlier epoch was
    made by weights of the abandoned run."""

    @property
    def version_start(self) -> int:
        """The weight version of the first sampled token (-1: no sampled token), for a caller that wants only that."""
        return _edge_version(self.token_versions, self.loss_mask, first=True)

    @property
    def version_end(self) -> int:
        """The weight version of the last sampled token (-1: no sampled token)."""
        return _edge_version(self.token_versions, self.loss_mask, first=False)
    image_sha256: tuple[str, ...] = ()
    """With `Prompt.images`: the sha256 (hex) of each image's encoded bytes as the engine decoded them, in order;
    `input_ids` then hold each image's placeholder tokens expanded (as the model saw them). Protocol 1.16."""
    image_grid_thw: Int32Array | None = None
    """With `Prompt.images` on a Qwen2-VL-style model: the (t, h, w) patch grid of each image, row-major (3 per image),
    to check a trainer's own preprocessing against; None otherwise. Protocol 1.16."""
    policy: str | None = None
    """With `Prompt.policy`: the policy (LoRA adapter name) every sampled token was made under, set by the broker after
    checking each token's version against the versions announced for it; None otherwise. Protocol 1.25."""

    @property
    def trajectory_id(self) -> str:
        """The dedup key: ``f"{prompt_id}:{sample_index}"``, or ``f"{prompt_id}:{sample_index}:{segment_index}"`` for a later segment."""
        if self.segment_index:
            return f"{self.prompt_id}:{self.sample_index}:{self.segment_index}"
        return f"{self.prompt_id}:{self.sample_index}"


@record
class GroupResult:
    """A prompt group in its terminal state, as delivered to the trainer."""

    prompt_id: str
    state: str
    """One of `GroupState.ALL`."""
    trajectories: tuple[Trajectory, ...] = ()
    """All n samples when DONE; empty otherwise."""
    reason: str = ""
    attempts: int = 0
    worker_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@record
class InflightTask:
    """A task a worker holds, re-announced on hello after a broker restart."""

    task_id: str
    prompt_id: str
    group_size: int
    attempt: int = 0


@record
class Rejection:
    """Why a submitted prompt was not accepted."""

    prompt_id: str
    reason: str
    """``duplicate``, ``invalid``, ``group_too_large``, ``queue_full``, ``stopping``."""
    detail: str = ""


@record
class TensorInfo:
    """Where one named tensor lies inside its bucket."""

    name: str
    dtype: str
    """numpy-style name (``float32``, ``bfloat16``, ...)."""
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@record
class BucketInfo:
    """One contiguous bucket of a weight version."""

    index: int
    dtype: str
    nbytes: int
    checksum: str
    """``"<algorithm>:<hex digest>"`` of the bucket's bytes; ``""`` while a streamed publish is still
    checksumming it (the bucket's chunks then carry it, `Chunk.checksum`)."""
    tensors: tuple[TensorInfo, ...] = ()
    shm_segment: str = ""
    """Same-host path: the POSIX shared-memory segment holding the bucket (``""``: none); see `Manifest.host_key`."""
    ipc_offset: int = -1
    """Same-GPU path (minor 9): where the bucket starts in `Manifest.cuda_ipc` (-1: not there)."""
    ipc_checksum: str = ""
    """Same-GPU path: ``"mix64:<hex>"`` of the bucket's bytes computed on the GPU (``""``: pending or none)."""
    host_mix64: str = ""
    """Same-host path staged to a GPU (minor 10): ``"mix64:<hex>"`` of the bucket's host bytes (its `shm_segment`), so a
    subscriber that copies the segment host-to-device verifies its device copy on its GPU (``""``: pending or none;
    set once the bucket's bytes have landed in the segment). Since minor 27 (`RESULT_MIX64_MINOR`) also on network
    versions whose deltas are made from CUDA tensors; on a delta manifest it is the mix64 of the bucket's *resulting*
    bytes, which a subscriber holding the base on its GPU verifies its rebuild there against."""
    encoding: str = ""
    """Delta versions (minor 18, `DELTA_MINOR`), on a manifest naming `Manifest.delta_base`: how the bucket travels,
    ``"whole"`` (its bytes), ``"unchanged"`` (nothing: the base's bucket is the result), ``"gaps"`` (the changed elements:
    2-byte gaps between their indices, then their new values) or ``"sparse"`` (int32 indices, then the values); see
    `rollpool.weights.delta`. ``""``: a full version.
    `checksum` is always of the resulting bytes."""
    delta_nbytes: int = 0
    """The bytes the bucket's encoding carries (fetched with `Fetch.delta_base`)."""
    delta_checksum: str = ""
    """Checksum of those encoded bytes (what arrives is checked before it is decoded)."""


@record
class ShmSegment:
    """One shared-memory segment a publisher holds (minor 11): a worker that stages from shared memory to its GPU maps
    and page-locks it before the first version that uses it."""

    name: str
    nbytes: int
    """The bucket bytes it holds (after its 4 KiB header)."""


@record
class CudaIpcBuffer:
    """A device buffer the publisher exports to processes on the same GPU (CUDA IPC, minor 9).

    The pieces of torch's storage sharing (``UntypedStorage._share_cuda_``), each as raw bytes or a
    number: nothing is pickled. A receiver opens it with ``UntypedStorage._new_shared_cuda``.
    """

    device_uuid: str
    """The GPU's UUID (a receiver maps it to its own device index, whatever CUDA_VISIBLE_DEVICES says)."""
    handle: bytes
    """``cudaIpcMemHandle_t`` of the allocation that holds the buffer."""
    storage_bytes: int
    storage_offset: int = 0
    """Where the buffer starts within the allocation."""
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False
    ring_slots: int = 0
    """(minor 22, `RING_MINOR`) > 0: the buffer is a ring of that many bucket-sized slots through which the version streams
    (bucket k in slot k % ring_slots, at its `BucketInfo.ipc_offset`, each `ipc_checksum` valid while the bucket is in
    its slot); one subscriber takes it, asking bucket by bucket (`ManifestRequest.ring_done`). 0: a whole-version arena."""


@record
class AdapterSpec:
    """A LoRA adapter version (minor 17, `LORA_MINOR`): the version's tensors are the adapter's ``lora_A`` / ``lora_B``
    matrices (PEFT's names and layout: A is (rank, in_features), B is (out_features, rank)), applied as
    ``y = base(x) + (x A^T B^T) * alpha / rank`` on each target module of the base model."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ()
    """Module names as PEFT gives them (``q_proj``, ``down_proj``, ...): the last component of the targeted Linear layers."""
    base_fingerprint: str = ""
    """`model_fingerprint` of the base model the adapter applies to (``""``: not checked)."""
    base_model: str = ""
    """The base model's name or path, for error messages."""
    name: str = ""
    """(minor 25, `POLICY_MINOR`) The policy this adapter serves: prompts name it (`Prompt.policy`). Versions of one
    adapter under training keep one name; ``""``: unnamed (no prompt can name it)."""


# --------------------------------------------------------------------------- worker flow


@message("hello")
class Hello:
    """Worker -> broker on connect, and again when it sees a new broker epoch."""

    worker_id: str
    protocol_min: int
    protocol_max: int
    engine: str
    capacity: int
    """Most sequences the worker runs at once."""
    credits: int
    """Sequences it can take now (capacity minus those in flight)."""
    weight_version: int = -1
    apply_modes: tuple[str, ...] = ()
    fingerprint: str = ""
    """Digest of the model config and tokenizer; clients may refuse a mismatch."""
    inflight: tuple[InflightTask, ...] = ()
    engine_info: dict[str, Any] = field(default_factory=dict)
    host: str = ""
    pid: int = 0
    pool: str = "default"
    max_msg_bytes: int = 0
    """The largest message part this peer's socket accepts (its MAXMSGSIZE; 0: not said, 64 MiB assumed).
    Senders refuse anything larger with an error naming the limit (libzmq would drop it with the connection)."""
    max_header_bytes: int = 0
    """The largest header this peer decodes (0: not said, 4 MiB assumed)."""
    features: tuple[str, ...] = ()
    """Optional wire features the worker speaks (`Feature`, minor 1)."""
    version_epoch: int = 0
    """(minor 6) The version epoch `weight_version` belongs to: the last `Welcome`/`BrokerHeartbeat.version_epoch`
    the worker saw (0: none; see `SetVersion.rebase`)."""
    protocol_minor: int = 0
    """(minor 12) The minor version this peer speaks of `protocol_max` (0: not said, minor 11 or older). The broker
    settles on the lower of the two (`Welcome.protocol_minor`) and sends inline arrays only from minor 12 on."""


@message("welcome")
class Welcome:
    """Broker -> worker: the settled protocol and where to get weights."""

    epoch: str
    protocol: int
    heartbeat_interval_s: float
    weight_version: int = -1
    """Newest version the trainer announced (-1: none yet)."""
    weight_endpoint: str | None = None
    """The publisher's ROUTER (bucket fetch)."""
    announce_endpoint: str | None = None
    """The publisher's PUB (announcements)."""
    adopted: tuple[str, ...] = ()
    """In-flight task ids the broker took over from the hello."""
    refused: tuple[str, ...] = ()
    """In-flight task ids the worker should drop (already done elsewhere)."""
    max_msg_bytes: int = 0
    """The largest message part this peer's socket accepts (its MAXMSGSIZE; 0: not said, 64 MiB assumed).
    Senders refuse anything larger with an error naming the limit (libzmq would drop it with the connection)."""
    max_header_bytes: int = 0
    """The largest header this peer decodes (0: not said, 4 MiB assumed)."""
    features: tuple[str, ...] = ()
    """Optional wire features the broker speaks (`Feature`, minor 1)."""
    dispatch_seq: int = 0
    """(minor 5) The last `Task.seq` sent to this worker before this welcome: a `Feature.RECONCILE` worker's
    echo starts from it (numbers go on across re-hellos; a worker the broker did not know starts at 0)."""
    version_epoch: int = 0
    """(minor 6) The pool's version epoch: it moves on at each rebase (`SetVersion.rebase`; 0: never rebased)."""
    rebase_version: int = -1
    """(minor 6) The lowest version a rebase since the worker's `Hello.version_epoch` went back to: a worker whose
    `weight_version` is above it serves weights of an abandoned run, forgets them and applies whatever version
    comes next, lower or not (-1: nothing to forget)."""
    protocol_minor: int = 0
    """(minor 12) The minor both sides speak: the lower of the broker's and `Hello.protocol_minor` (0: a broker of
    minor 11 or older). From 12 on each side may send small arrays inline in the header (`codec.inline_for`)."""


@message("credit")
class Credit:
    """Worker -> broker: `credits` more sequences may be sent."""

    credits: int


@record
class RecordedTurn:
    """One finished turn of an episode (one engine call), as the engine returned it (protocol 1.20, `REPLAY_MINOR`).

    A worker streams them to the broker while the episode runs (`TurnRecords`); when the group is run again after
    its worker died, the broker hands them to the next attempt (`Task.replay`), which serves a turn from its record
    instead of sampling it when the request is the same (`request_digest`)."""

    sample_index: int
    """The episode (sample of the group)."""
    turn: int
    """0, 1, ...: the episode's sampled turns in order (a refused request is not a turn)."""
    request_digest: int
    """63-bit blake2b of what the engine was asked: the whole token sequence, the sampling and any grammar."""
    output_ids: Int32Array
    logprobs: Float32Array
    token_versions: Int32Array
    finish_reason: str
    output_text: str | None = None
    matched_stop_id: int = -1
    """The stop token that ended the turn (-1: none, or a stop string: `matched_stop_text`)."""
    matched_stop_text: str = ""
    first_token_at: float = 0.0
    finished_at: float = 0.0
    top_ids: Int32Array | None = None
    """With top logprobs asked: k ids per output token, row-major; None otherwise."""
    top_logprobs: Float32Array | None = None
    attempt: int = 0
    """The attempt of the group that sampled the turn (set by the broker when it stores it)."""


@message("task")
class Task:
    """Broker -> worker: one prompt group to generate."""

    task_id: str
    prompt: Prompt
    attempt: int = 0
    deadline_s: float = 0.0
    """Most seconds the broker waits for the result (0: no deadline)."""
    queued_at: float = 0.0
    min_version: int = -1
    """The oldest weight version the broker accepts output from."""
    seq: int = 0
    """Per-worker dispatch sequence number (1, 2, ... within one broker epoch; 0: not numbered).
    The worker echoes the highest it has received in `WorkerHeartbeat.dispatch_seq`."""
    replay: tuple[RecordedTurn, ...] = ()
    """(minor 20, `REPLAY_MINOR`; only to a worker listing `Feature.REPLAY`) Turns earlier attempts of this group
    recorded, by episode and turn: an episode whose request matches the recorded one is served the record instead
    of a new sample (docs/episodes.md, "When a worker dies")."""


@message("task_batch")
class TaskBatch:
    """Broker -> worker: several tasks in one message (only to a worker listing `Feature.TASK_BATCH`).

    Exactly the same as the tasks sent one by one, in this order.
    """

    tasks: tuple[Task, ...]


@message("result")
class Result:
    """Worker -> broker: the whole group of one task, or why it failed."""

    task_id: str
    prompt_id: str
    trajectories: tuple[Trajectory, ...] = ()
    error: str | None = None
    """Set when the worker could not produce the group; the broker may retry."""
    retryable: bool = True
    credits: int = 0
    """Sequences freed with this result, as if a `Credit(credits)` followed it; only to a
    broker listing `Feature.RESULT_CREDITS` (an older one would ignore it and the credit
    would be lost)."""


@message("turn_records")
class TurnRecords:
    """Worker -> broker (only to a broker listing `Feature.REPLAY`): turns of a running episode group, as they end.

    The broker keeps them while the task's lease is the current one (a record from any other attempt is ignored),
    within its replay bounds, and forgets them when the group reaches a terminal state."""

    task_id: str
    prompt_id: str
    turns: tuple[RecordedTurn, ...]


@message("turn_record_batch")
class TurnRecordBatch:
    """Worker -> broker (minor 29, `TURN_BATCH_MINOR`; only to a broker listing `Feature.TURN_BATCH`): several tasks'
    `TurnRecords` in one message, exactly as if each were sent on its own, in this order.

    A worker gathers finished turns for a moment before streaming them, and those of one moment mostly belong to
    different tasks (a group's episodes end their turns at different times): one message per task was about one
    message per turn, and the send, the broker's read and its decode of each were most of what streaming turns cost."""

    records: tuple[TurnRecords, ...]


@message("result_batch")
class ResultBatch:
    """Worker -> broker: several results, then `credits` (only to a broker listing `Feature.RESULT_BATCH`).

    The same as the results sent one by one in this order followed by `Credit(credits)`.
    """

    results: tuple[Result, ...]
    credits: int = 0


@message("worker_heartbeat")
class WorkerHeartbeat:
    """Worker -> broker every `heartbeat_interval_s`: liveness, and (minor 1) what the worker holds.

    Its size does not grow with what the worker holds: the held tasks travel as a
    count and a digest (`held_digest`); the full list (`inflight_task_ids` with
    `held_full`) only when the broker asks (`BrokerHeartbeat.send_held`) or the
    worker chooses (a minor-0 worker always sends the list and no digest).
    Everything describes the worker after it handled every task up to `dispatch_seq`
    and sent every result before this heartbeat (one connection keeps order).
    """

    worker_id: str
    inflight_task_ids: tuple[str, ...] = ()
    weight_version: int = -1
    state: str = WorkerState.READY
    """One of `WorkerState` (``ready``, ``applying``, ``draining``, ``sleeping``, ``restarting``, ...)."""
    tokens_total: int = 0
    epoch: str = ""
    """The broker epoch the worker believes in ("" before its first welcome)."""
    dispatch_seq: int = -1
    """The highest `Task.seq` received in this epoch (-1: not reported, 0: none yet)."""
    free_capacity: int = -1
    """Sequences the worker could take now, absolute, not a delta (-1: not reported)."""
    held_count: int = -1
    """How many tasks the worker holds (generating or result not yet sent; -1: not reported)."""
    held_digest: int = 0
    """`held_digest` of the held task ids (meaningful when `held_count` >= 0)."""
    held_full: bool = False
    """`inflight_task_ids` is the complete list of held tasks (else it may be empty or partial)."""
    version_epoch: int = 0
    """(minor 6) The version epoch `weight_version` belongs to (as `Hello.version_epoch`)."""
    tokens_cancelled: int = -1
    """(minor 8) Tokens generated, since the worker started, for tasks the broker cancelled before their
    result (never delivered: wasted, reason cancel); cumulative (-1: not reported)."""


@message("broker_heartbeat")
class BrokerHeartbeat:
    epoch: str
    weight_version: int = -1
    weight_endpoint: str | None = None
    announce_endpoint: str | None = None
    send_held: bool = False
    """Sent to one worker whose held digest disagreed with the broker's leases: put the full
    list in the next heartbeat (`WorkerHeartbeat.held_full`)."""
    dispatch_seq: int = -1
    """With `send_held`: the highest `Task.seq` the broker had sent this worker (-1: not stated)."""
    version_epoch: int = 0
    """(minor 6) As `Welcome.version_epoch`."""
    rebase_version: int = -1
    """(minor 6) The version the last rebase went back to (-1: never rebased); see `Welcome.rebase_version`."""


@message("nack")
class Nack:
    """Worker -> broker: hand these tasks back now (not counted as a failure)."""

    task_ids: tuple[str, ...]
    reason: str = ""


@message("goodbye")
class Goodbye:
    """Either way: the sender is leaving; a worker hands back `task_ids`."""

    reason: str = ""
    task_ids: tuple[str, ...] = ()


@message("cancel")
class Cancel:
    """Broker -> worker: stop these tasks; their results will be dropped."""

    task_ids: tuple[str, ...]
    reason: str = ""


@message("control")
class Control:
    """Client -> broker -> every worker: sleep, wake, flush_cache, drain, resume."""

    request_id: str
    op: str
    tags: tuple[str, ...] = ()
    args: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30.0


@message("control_reply")
class ControlReply:
    request_id: str
    ok: bool
    error: str | None = None
    results: dict[str, Any] = field(default_factory=dict)
    """Per worker id: ``{"ok": bool, "error": str | None, ...}``."""
    epoch: str = ""


@message("apply_request")
class ApplyRequest:
    """Worker -> broker: may I pause to apply `version` (rolling updates)?"""

    version: int


@message("apply_grant")
class ApplyGrant:
    version: int


@message("apply_done")
class ApplyDone:
    version: int
    ok: bool
    duration_s: float = 0.0
    error: str | None = None
    skipped: bool = False
    """The worker gave this version up for good (its fetch, grant or apply kept failing, a restarted engine
    included); `error` says why. It keeps its last good version and follows the next one (protocol 1.7)."""


# --------------------------------------------------------------------------- client flow


@message("client_hello")
class ClientHello:
    client_id: str
    protocol_min: int
    protocol_max: int
    fingerprint: str = ""
    """When set, the broker refuses to dispatch to workers with another fingerprint."""
    max_msg_bytes: int = 0
    """The largest message part this peer's socket accepts (its MAXMSGSIZE; 0: not said, 64 MiB assumed).
    Senders refuse anything larger with an error naming the limit (libzmq would drop it with the connection)."""
    max_header_bytes: int = 0
    """The largest header this peer decodes (0: not said, 4 MiB assumed)."""
    protocol_minor: int = 0
    """(minor 12) As `Hello.protocol_minor`: the minor this client speaks (0: minor 11 or older)."""


@message("client_welcome")
class ClientWelcome:
    epoch: str
    protocol: int
    weight_version: int = -1
    redelivered: int = 0
    """Groups this client had been sent but not acknowledged, made ready again."""
    max_msg_bytes: int = 0
    """The largest message part this peer's socket accepts (its MAXMSGSIZE; 0: not said, 64 MiB assumed).
    Senders refuse anything larger with an error naming the limit (libzmq would drop it with the connection)."""
    max_header_bytes: int = 0
    """The largest header this peer decodes (0: not said, 4 MiB assumed)."""
    protocol_minor: int = 0
    """(minor 12) As `Welcome.protocol_minor`: the minor settled with this client (0: a broker of minor 11 or older)."""


@message("submit")
class Submit:
    request_id: str
    prompts: tuple[Prompt, ...]


@message("submit_reply")
class SubmitReply:
    request_id: str
    epoch: str
    accepted: tuple[str, ...] = ()
    rejected: tuple[Rejection, ...] = ()


@message("pull")
class Pull:
    """Ask for up to `max_groups` terminal groups, waiting up to `wait_s`."""

    request_id: str
    max_groups: int
    wait_s: float = 0.0
    ack: tuple[str, ...] = ()
    """Prompt ids acknowledged with this request (saves a round trip)."""


@message("batch")
class Batch:
    request_id: str
    epoch: str
    groups: tuple[GroupResult, ...] = ()
    weight_version: int = -1


@message("ack")
class Ack:
    """Client -> broker: these groups were consumed; forget them."""

    prompt_ids: tuple[str, ...]
    dropped_stale: tuple[str, ...] = ()
    """Of those, the groups the trainer dropped as too stale (frees capacity)."""


@message("set_version")
class SetVersion:
    """Client -> broker: the trainer's version. Versions move forward; a lower one is refused (`Reply.ok` false)
    unless `rebase` is set."""

    request_id: str
    version: int
    weight_endpoint: str | None = None
    announce_endpoint: str | None = None
    rebase: bool = False
    """(minor 6) The trainer resumed from a checkpoint at `version`, which may be lower than the pool's: the
    pool's version becomes `version`, its admission counters restart from it, a new version epoch begins and
    workers serving a version above it take the next version announced, lower or not."""
    stale_bound: int = -1
    """(minor 8) The staleness above which the trainer will not train a group (its stale_policy's bound:
    max_staleness under drop and regenerate, max_staleness_keep under keep; -1: not stated). The broker's
    early cancellation and result-time drop judge by it instead of its eta."""
    adapter: AdapterSpec | None = None
    """(minor 25, `POLICY_MINOR`) The LoRA adapter the pool serves from this version on (its `name` is the policy prompts
    may name): the adapter of this version or, for a whole-model version, the one that stays on under it. None: not said
    (the broker keeps what it was last told; there is no version that turns an adapter off)."""
    adapter_since: int = -1
    """(minor 25) The first version this adapter (by name) was published at: its tokens from there on are that policy's."""


@message("status_request")
class StatusRequest:
    request_id: str


@message("status_reply")
class StatusReply:
    request_id: str
    epoch: str
    counters: dict[str, Any] = field(default_factory=dict)
    workers: dict[str, Any] = field(default_factory=dict)
    """Per worker id: a map of its live state."""


@message("cancel_prompts")
class CancelPrompts:
    request_id: str
    prompt_ids: tuple[str, ...]


@message("reply")
class Reply:
    """Generic acknowledgement of a client request."""

    request_id: str
    ok: bool = True
    epoch: str = ""
    error: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- weights


@message("announce")
class Announce:
    """Publisher PUB: a new version is ready to fetch."""

    version: int
    publisher_id: str
    total_bytes: int
    num_buckets: int
    shm_generation: int = 0
    """Bumped whenever the publisher's set of shared-memory segments changes (minor 11): a subscriber that registers
    them ahead of use asks for the manifest again (`Manifest.shm_reserved`) when it sees a new value."""


@message("manifest_request")
class ManifestRequest:
    """Ask for a version's manifest; ``version=None`` means the latest."""

    request_id: str
    version: int | None = None
    streamed: bool = False
    """The asker accepts a manifest whose checksums are still pending (minor 1). Without it the answer
    waits until every bucket's checksum exists, so a subscriber of minor 0 gets the manifest it knows."""
    host_key: str = ""
    """The asker's host identity (its "hello" for the same-host paths; informational for the publisher)."""
    gpu_uuids: tuple[str, ...] = ()
    """The GPUs the asker sees (minor 9): with a matching `host_key`, a publisher on ``auto`` exports its next versions
    to the same-GPU path (`Manifest.cuda_ipc`)."""
    wait_ipc: bool = False
    """Answer once every bucket's `BucketInfo.ipc_checksum` exists (the same-GPU path; the host checksums may still be pending)."""
    delta_base: int = -1
    """(minor 18, `DELTA_MINOR`) The version the asker holds whole and verified: it accepts a delta against it. -1: full
    versions only (a peer of minor 15 or older never says more)."""
    after_mix64: int = -1
    """(minor 19, `PARKED_MINOR`) >= 0: a parked request: the answer waits until the version's manifest carries more
    than this many GPU checksums (`BucketInfo.host_mix64`), or none will come (not a shared-memory version); the
    version's eviction answers ``gone``. -1: answered at once. A server older than `PARKED_MINOR` ignores it and
    answers at once (`Manifest.protocol_minor` tells the asker which it is talking to)."""
    ring: bool = False
    """(minor 22, `RING_MINOR`) The asker can take a same-GPU ring (`CudaIpcBuffer.ring_slots`). A version that streams
    through a ring is answered without its device buffer to an asker that does not say so (an older subscriber would
    read the slots as an arena)."""
    ring_done: int = -1
    """(minor 22, `RING_MINOR`) >= 0: the asker takes the version's ring (the first to ask is its one taker) and has
    copied every bucket below this out of it, releasing their slots; the answer waits until bucket `ring_done` is in its
    slot or the ring ended (then the manifest names no device buffer). -2 (`rollpool.weights.ring.RING_LEFT`): the taker
    leaves the ring. -1: not a ring request."""
    device_verify: bool = False
    """(minor 28, `EARLY_DELTA_MINOR`) With `delta_base`: the asker rebuilds a delta on its engine's GPU and verifies each
    bucket there against `BucketInfo.host_mix64`, so a delta made on the publisher's GPU may be answered as soon as its
    buckets are encoded and their mix64 known, before the version's host copy is checksummed: its buckets' `checksum`
    may then be ``""`` (pending), and the asker takes none of them as checked. False: the delta comes complete, as to
    every asker before minor 28 (an older server ignores the field)."""


@message("manifest")
class Manifest:
    request_id: str
    version: int
    """-1 when the publisher holds no version yet."""
    publisher_id: str = ""
    buckets: tuple[BucketInfo, ...] = ()
    chunk_bytes: int = 4 * 1024 * 1024
    host_key: str = ""
    """The publisher's host identity; a subscriber with the same key may map `BucketInfo.shm_segment`."""
    pool: str = ""
    """The pool the publisher serves (segment names carry it)."""
    cuda_ipc: CudaIpcBuffer | None = None
    """Same-GPU path (minor 9): the device buffer holding every bucket (at `BucketInfo.ipc_offset`)."""
    shm_reserved: tuple[ShmSegment, ...] = ()
    """Every shared-memory segment the publisher holds now, served or reserved (minor 11; on every manifest, the empty
    version -1 one included, with `host_key` set), so a worker staging to its GPU maps and page-locks them before the
    first version that uses them. Empty from a relay, a publisher without segments, or one of minor 10 or older."""
    bulk_port: int = 0
    """(minor 13) The TCP port of the server's bulk lane (`rollpool.weights.paths.bulk`: chunk bytes over plain TCP, received
    straight into the subscriber's buffer), on the host of its ROUTER endpoint; 0: none (CURVE, not TCP, turned off,
    or a server of minor 12 or older), so chunks come over the ROUTER."""
    adapter: AdapterSpec | None = None
    """(minor 17, `LORA_MINOR`) The version is a LoRA adapter for the base model it names (its tensors are the adapter's);
    None: a whole-model version."""
    delta_base: int = -1
    """(minor 18, `DELTA_MINOR`) >= 0: a delta against that version (each bucket's `BucketInfo.encoding`); -1: a full version."""
    protocol_minor: int = 0
    """(minor 19, `PARKED_MINOR`) The minor of the server that answered (the weight channel has no hello; 0: a server
    older than `PARKED_MINOR`, which does not park `ManifestRequest.after_mix64`)."""
    adapter_on: int = -1
    """(minor 23, `ADAPTER_ON_MINOR`) On a whole-model version published after a LoRA adapter version: that adapter
    version, which the engines keep on under this one (the policy of this version is its base plus that adapter,
    docs/lora.md); the server keeps it served while it is on, so a subscriber that does not have it on (a late joiner)
    fetches it and applies it with this version. -1: no adapter is on (or a server older than `ADAPTER_ON_MINOR`)."""
    base_on: int = -1
    """(minor 24, `BASE_ON_MINOR`) On a LoRA adapter version: the whole-model version it applies over (the policy of
    this version is that version plus this adapter, docs/lora.md); the server keeps it served while it is the base of the
    newest adapter version, so a subscriber whose engine does not serve it (a late joiner) fetches it and applies it,
    then this adapter, in one pause. -1: the engines' model from disk (or a server older than `BASE_ON_MINOR`)."""
    delta_shm: ShmSegment | None = None
    """(minor 26, `DELTA_PATHS_MINOR`) On a delta manifest (`delta_base` >= 0) from a publisher whose version is in shared
    memory: the segment holding the delta's encoded bytes, each carried bucket's (`BucketInfo.delta_nbytes`) in bucket
    order, each starting at a multiple of 8 bytes; its header names the version while they are valid. A subscriber on
    this host (`host_key`) reads them there instead of fetching them; None: over the network only (a relay, a version
    not in shared memory, or a server older than `DELTA_PATHS_MINOR`)."""


@message("fetch")
class Fetch:
    """Ask for `nbytes` of a bucket from `offset` (one chunk of a window)."""

    request_id: str
    version: int
    bucket: int
    offset: int
    nbytes: int
    delta_base: int = -1
    """(minor 18, `DELTA_MINOR`) >= 0: the bytes are of the bucket's encoding against that base (`BucketInfo.delta_nbytes`)."""


@message("chunk")
class Chunk:
    request_id: str
    version: int
    bucket: int
    offset: int
    data: Blob
    checksum: str = ""
    """The bucket's checksum when the manifest was sent before it existed (streamed publish, minor 1)."""


# --------------------------------------------------------------------------- any


@message("error")
class Error:
    """The answer to a message that could not be served."""

    code: str
    message: str
    request_id: str | None = None
    ref_type: str | None = None
    """The type of the message this answers, when it could be read."""
