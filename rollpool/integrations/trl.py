"""rollpool as the rollout backend of TRL's asynchronous GRPO trainer (TRL 1.16, extra ``rollpool[trl]``).

``trl.experimental.async_grpo.AsyncGRPOTrainer`` takes a ``rollout_worker`` (its
``RolloutWorkerProtocol``: ``rollout_buffer``, ``metrics_queue``, ``start``, ``stop``,
``update_model_version``, ``check_health``) and a ``weight_transfer`` (its
``WeightTransferProtocol``: ``init_weight_transfer``, ``pause``, ``send_weights``, ``resume``,
``destroy``). This module implements both on one `SyncTrainerClient`:

- `RollpoolRolloutWorker` submits the dataset's prompts to the pool (group size
  ``args.num_generations``, sampling from ``args``), keeps at most ``args.max_inflight_tasks``
  samples in flight, and turns each delivered group into TRL ``RolloutSample``s: prompt + completion
  ids, the loss mask as completion mask, the behaviour logprobs, the group-normalised advantage
  (rewards from the workers' ``--reward`` and/or TRL ``reward_funcs``), ``model_version`` the minimum
  policy version of the sample's sampled tokens, an integer ``group_id`` per prompt group.
- `RollpoolWeightTransfer` publishes the streamed parameters of each ``send_weights`` as one new
  version (it counts versions itself: TRL's iterator carries none; the cold sync at train begin makes
  version 1, in step with the trainer's ``model_version``). Workers fetch, verify and apply it by
  their apply mode, a bounded number at a time, so ``pause``/``resume`` stop nothing.

Guarantees: every group the pool delivers is put into ``rollout_buffer`` once or counted as a skip
(a reward function that raised, a group that failed, a group whose prompt this process never
submitted), with a log line. Exactly once ends at ``rollout_buffer``: TRL has no acknowledgement,
so a sample the trainer drops (TRL's own staleness check) or leaves in the queue at the end of
training is not given back. Every wait has a timeout; ``stop()`` joins the one thread it started
and starts no process.

TRL is imported here only, on first use. Multi-turn (TRL's ``tools`` / ``environment_factory``) is
not mapped yet: see docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollpool.protocol import ConfigError, GroupResult, GroupState, Prompt, RollpoolError, SamplingParams, Trajectory
from rollpool.trainer_client import SyncTrainerClient, TrainerClientConfig, new_prompt_id

__all__ = [
    "TRL_TESTED",
    "TRLRolloutConfig",
    "RollpoolRolloutWorker",
    "RollpoolWeightTransfer",
    "rollpool_backend",
    "group_to_samples",
]

log = logging.getLogger(__name__)

TRL_TESTED = ">=1.16.0,<1.17"
"""The TRL versions this adapter is tested with (the ``trl`` extra pins the same range)."""

RewardFunc = Callable[..., Sequence[float | None]]


def _trl_rollout_sample() -> Any:
    """TRL's `RolloutSample`, imported on first use with an error that names the extra."""
    try:
        import trl
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
    except ImportError as exc:  # pragma: no cover - exercised where TRL is absent
        raise ImportError(f"rollpool.integrations.trl needs TRL {TRL_TESTED}: pip install 'rollpool[trl]' ({exc})") from exc
    version = tuple(int(p) for p in trl.__version__.split(".")[:2] if p.isdigit())
    if version[:2] != (1, 16):
        log.warning("rollpool.integrations.trl is tested with TRL %s; this is TRL %s", TRL_TESTED, trl.__version__)
    return RolloutSample


@dataclass(frozen=True)
class TRLRolloutConfig:
    """Settings of the adapter itself (TRL's own settings come from its `AsyncGRPOConfig`)."""

    pull_timeout_s: float = field(default=2.0, metadata={"help": "longest wait of one get_batch; the loop then re-checks stop and health"})
    put_timeout_s: float = field(default=1.0, metadata={"help": "longest wait of one put into a full rollout_buffer (then retried until stop)"})
    no_workers_timeout_s: float = field(default=120.0, metadata={"help": "the pool with no live worker this long is an error raised by check_health"})
    status_interval_s: float = field(default=5.0, metadata={"help": "how often the loop asks the broker for live workers and its counters"})
    stop_timeout_s: float = field(default=30.0, metadata={"help": "how long stop() waits for the loop thread, and then for its cancelled groups to be reported"})
    max_inflight_samples: int | None = field(default=None, metadata={"help": "samples submitted and not yet delivered (None: TRL's max_inflight_tasks)"})
    submit_chunk_groups: int = field(default=64, metadata={"help": "most prompt groups submitted per request"})
    metadata_columns: tuple[str, ...] | None = field(default=None, metadata={"help": "dataset columns sent to the workers as prompt metadata (None: every column but the prompt whose value is a number, string or bool)"})

    def __post_init__(self) -> None:
        for name in ("pull_timeout_s", "put_timeout_s", "no_workers_timeout_s", "status_interval_s", "stop_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"TRLRolloutConfig.{name} must be > 0, got {value}")
        if self.max_inflight_samples is not None and self.max_inflight_samples < 1:
            raise ConfigError(f"TRLRolloutConfig.max_inflight_samples must be >= 1 or None, got {self.max_inflight_samples}")
        if self.submit_chunk_groups < 1:
            raise ConfigError(f"TRLRolloutConfig.submit_chunk_groups must be >= 1, got {self.submit_chunk_groups}")


class _SharedClient:
    """One `SyncTrainerClient` shared by the rollout worker and the weight transfer; closed when both let go."""

    def __init__(self, client: SyncTrainerClient, *, owned: bool, users: int) -> None:
        self.client = client
        self._owned = owned
        self._users = users
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last and self._owned:
            with contextlib.suppress(Exception):
                self.client.close()


@dataclass
class _Pending:
    group_id: int
    prompt_messages: list[dict[str, Any]]
    reward_kwargs: dict[str, Any]
    group_size: int


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def _plain(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str)) and not (isinstance(value, float) and math.isnan(value))


def group_to_samples(
    group: GroupResult,
    *,
    group_id: int,
    prompt_messages: list[dict[str, Any]],
    reward_kwargs: Mapping[str, Any],
    reward_funcs: Sequence[RewardFunc] = (),
    reward_func_names: Sequence[str] = (),
    decode: Callable[[Sequence[int]], str] | None = None,
    current_version: int = 0,
    sample_cls: Any = None,
) -> list[Any]:
    """One delivered DONE group -> TRL `RolloutSample`s (one per trajectory; a later episode segment is one more row).

    Rewards: one column per TRL reward function (called once for the group, TRL's signature:
    ``prompts``, ``completions``, ``completion_ids`` and the dataset's other columns as lists),
    plus the workers' reward when any trajectory carries one; summed per sample, a ``None`` is
    NaN, a sample with no number at all is unscored (advantage 0), the advantage is
    ``(r - mean) / (std + 1e-8)`` over the scored samples, as TRL's own worker computes it.
    A reward function that raises or returns the wrong count raises `RewardError`.
    """
    sample_cls = sample_cls if sample_cls is not None else _trl_rollout_sample()
    trajs = sorted(group.trajectories, key=lambda t: (t.sample_index, t.segment_index))
    by_sample: dict[int, list[Trajectory]] = {}
    for t in trajs:
        by_sample.setdefault(t.sample_index, []).append(t)
    order = sorted(by_sample)
    n = len(order)
    if n == 0:
        return []
    completions: list[list[dict[str, Any]]] = []
    completion_ids: list[list[int]] = []
    for i in order:
        ids = [int(x) for seg in by_sample[i] for x in seg.output_ids]
        text = "".join(seg.output_text or "" for seg in by_sample[i])
        if not text and decode is not None:
            text = decode(ids)
        completions.append([{"role": "assistant", "content": text}])
        completion_ids.append(ids)
    columns: list[list[float]] = []
    kwargs = {k: [v] * n for k, v in reward_kwargs.items()}
    for func, name in zip(reward_funcs, reward_func_names, strict=True):
        try:
            values = func(prompts=[prompt_messages] * n, completions=completions, completion_ids=completion_ids, **kwargs)
        except Exception as exc:
            raise RewardError(f"reward function {name} raised {type(exc).__name__}: {exc}") from exc
        values = list(values)
        if len(values) != n:
            raise RewardError(f"reward function {name} returned {len(values)} values for {n} completions")
        columns.append([float("nan") if v is None else float(v) for v in values])
    names = list(reward_func_names)
    worker_rewards = [next((s.reward for s in by_sample[i] if s.reward is not None), None) for i in order]
    if any(r is not None for r in worker_rewards):
        columns.append([float("nan") if r is None else float(r) for r in worker_rewards])
        names.append("pool")
    arr = np.array(columns, dtype=np.float64).reshape(len(columns), n)
    unscored = np.all(np.isnan(arr), axis=0)
    rewards = np.nansum(arr, axis=0) if len(columns) else np.zeros(n)
    rewards[unscored] = np.nan
    advantages = np.zeros(n)
    scored = ~np.isnan(rewards)
    reward_std = float("nan")
    if scored.any():
        vals = rewards[scored]
        advantages[scored] = (vals - vals.mean()) / (vals.std() + 1e-8)
        reward_std = float(vals.std())
    now = time.time()
    out: list[Any] = []
    for col, i in enumerate(order):
        metrics = {"reward": float(rewards[col]), "reward_std": reward_std,
                   **{f"rewards/{name}": float(arr[k, col]) for k, name in enumerate(names)}}
        for seg in by_sample[i]:
            mask = np.asarray(seg.loss_mask, dtype=np.int64)
            if not mask.any():
                continue  # nothing sampled in this segment: no loss term (TRL skips such rows too)
            prompt_len = len(seg.input_ids)
            versions = np.asarray(seg.token_versions)
            sampled = versions[mask.astype(bool)] if len(versions) == len(mask) else versions
            out.append(sample_cls(
                prompt=prompt_messages,
                completion=completions[col],
                input_ids=np.concatenate([np.asarray(seg.input_ids, dtype=np.int64), np.asarray(seg.output_ids, dtype=np.int64)]),
                completion_mask=np.concatenate([np.zeros(prompt_len, dtype=np.int64), mask]),
                old_log_probs=np.concatenate([np.zeros(prompt_len, dtype=np.float32), np.asarray(seg.output_logprobs, dtype=np.float32)]),
                advantage=float(advantages[col]),
                model_version=int(sampled.min()) if len(sampled) else int(current_version),
                group_id=int(group_id),
                metrics=dict(metrics),
                enqueued_at=now,
            ))
    return out


class RewardError(RollpoolError):
    """A TRL reward function raised or returned the wrong number of values (the group is skipped and counted)."""


class RollpoolRolloutWorker:
    """TRL's `RolloutWorkerProtocol`, served by a rollpool pool (see the module docstring)."""

    def __init__(
        self,
        client: SyncTrainerClient,
        *,
        train_dataset: Iterable[Mapping[str, Any]],
        args: Any,
        processing_class: Any,
        reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Any = None,
        config: TRLRolloutConfig | None = None,
        _shared: _SharedClient | None = None,
    ) -> None:
        if tools or environment_factory is not None:
            raise NotImplementedError(
                "RollpoolRolloutWorker does not map TRL's tools / environment_factory yet: multi-turn rollouts run as "
                "rollpool episodes on the workers (`--episode module:function`); see docs/integrations.md, 'Multi-turn'")
        self.config = config or TRLRolloutConfig()
        self.client = client
        self._shared = _shared or _SharedClient(client, owned=False, users=1)
        self.args = args
        self.tokenizer = processing_class
        funcs = [] if reward_funcs is None else ([reward_funcs] if callable(reward_funcs) else list(reward_funcs))
        for f in funcs:
            if not callable(f):
                raise ConfigError(f"reward_funcs must be callables, got {type(f).__name__}")
        self.reward_funcs: list[RewardFunc] = funcs
        self.reward_func_names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
        self.dataset = train_dataset
        self._check_dataset(train_dataset)
        self.group_size = int(args.num_generations)
        if self.group_size < 2:
            raise ConfigError(f"args.num_generations must be >= 2 (GRPO compares the samples of a group), got {self.group_size}")
        self.sampling = self._sampling_from(args, processing_class)
        self.rollout_buffer: queue.Queue[Any] = queue.Queue(maxsize=max(0, int(getattr(args, "queue_maxsize", 0) or 0)))
        self.metrics_queue: queue.Queue[dict[str, float]] = queue.Queue(maxsize=4096)
        self.counters: dict[str, int] = {k: 0 for k in (
            "groups_submitted", "groups_rejected", "groups_delivered", "samples_delivered", "groups_failed",
            "groups_cancelled", "groups_dropped_stale", "reward_errors", "rows_without_prompt", "unknown_groups",
            "samples_without_sampled_tokens", "samples_not_put_at_stop", "groups_done_after_stop", "duplicated")}
        self._pending: dict[str, _Pending] = {}
        # exactly-once check at the boundary: trajectory ids put into rollout_buffer (bounded window)
        self._seen: dict[str, None] = {}
        self._seen_window = 1_000_000
        self._group_ids = itertools.count()
        self._rows: Iterator[Mapping[str, Any]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._heartbeat = time.time()
        self._no_workers_since: float | None = None
        self._trainer_version = 0
        self._stopped = False
        self._sample_cls = _trl_rollout_sample()

    # ---------------------------------------------------------------- construction helpers

    @staticmethod
    def _check_dataset(dataset: Any) -> None:
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "prompt" not in columns:
            raise ConfigError(f"the train dataset has no 'prompt' column (columns: {list(columns)})")
        try:
            length = len(dataset)
        except TypeError:
            return  # an iterable dataset: rows without a prompt are counted skips
        if length == 0:
            raise ConfigError("the train dataset is empty")

    @staticmethod
    def _sampling_from(args: Any, tokenizer: Any) -> SamplingParams:
        penalty = getattr(args, "repetition_penalty", 1.0)
        if penalty not in (None, 1.0):
            raise ConfigError(f"args.repetition_penalty={penalty}: rollpool's engines do not apply a repetition penalty (use 1.0)")
        top_k = getattr(args, "top_k", None)
        eos = getattr(tokenizer, "eos_token_id", None)
        return SamplingParams(
            max_new_tokens=int(args.max_completion_length),
            temperature=float(args.temperature),
            top_p=float(getattr(args, "top_p", 1.0) or 1.0),
            top_k=int(top_k) if top_k not in (None, 0) and int(top_k) > 0 else -1,
            min_p=float(getattr(args, "min_p", None) or 0.0),
            stop_token_ids=(int(eos),) if eos is not None else (),
        )

    def _max_inflight(self) -> int:
        if self.config.max_inflight_samples is not None:
            return self.config.max_inflight_samples
        # TRL resolves max_inflight_tasks (-1) in the trainer's __init__, on the same args object
        value = int(getattr(self.args, "max_inflight_tasks", -1))
        if value < 0:
            per_step = int(self.args.per_device_train_batch_size) * int(self.args.gradient_accumulation_steps)
            value = max(int(getattr(self.args, "max_staleness", 1)), 1) * per_step
        return max(value, self.group_size)

    # ---------------------------------------------------------------- RolloutWorkerProtocol

    def start(self) -> None:
        """Start the rollout loop thread (TRL calls it once, after the cold weight sync)."""
        if self._thread is not None:
            log.warning("RollpoolRolloutWorker.start() called twice; ignoring")
            return
        self._heartbeat = time.time()
        self._thread = threading.Thread(target=self._run, name="rollpool-trl-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop, join its thread (bounded) and release the client; no process is left."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        try:
            if self._thread is not None:
                self._thread.join(self.config.stop_timeout_s)
                if self._thread.is_alive():
                    log.error("rollpool TRL rollout thread did not stop within %.0f s", self.config.stop_timeout_s)
                else:
                    self._cancel_pending()
            log.info("rollpool TRL rollout worker stopped: %s", self.counters)
        finally:
            self._shared.release()

    def _cancel_pending(self) -> None:
        """Training is over: cancel this worker's groups still in the pool and wait (bounded) until each is reported.

        Every accepted group so reaches a terminal state the trainer side is told of (CANCELLED, or DONE
        when it finished first: then it is counted in ``groups_done_after_stop``, not put in the buffer).
        """
        ids = [pid for pid in self.client.pending_ids() if pid in self._pending]
        if not ids:
            return
        try:
            self.client.cancel(ids)
            deadline = time.monotonic() + self.config.stop_timeout_s
            while any(pid in self._pending for pid in self.client.pending_ids()) and time.monotonic() < deadline:
                try:
                    batch = self.client.get_batch(1, timeout=min(self.config.pull_timeout_s, max(0.1, deadline - time.monotonic())))
                except TimeoutError:
                    continue
                for g in batch.groups:
                    if self._pending.pop(g.prompt_id, None) is not None:
                        self.counters["groups_done_after_stop"] += 1
                for g in batch.other:
                    self._other(g, quiet=True)
        except Exception as exc:  # noqa: BLE001 - the broker gone at the end of a run: its groups are its own to report
            log.warning("cancelling %d in-flight groups at stop failed: %s", len(ids), exc)
        # a get_batch that times out keeps the terminal groups it saw for its next return; the client has
        # them (no longer pending), so each cancelled group that left the pending set is reported
        still = set(self.client.pending_ids())
        for pid in [pid for pid in self._pending if pid not in still]:
            del self._pending[pid]
            self.counters["groups_cancelled"] += 1
        left = sum(1 for pid in still if pid in self._pending)
        if left:
            log.warning("%d groups still in flight in the pool after stop (not reported within %.0f s)", left, self.config.stop_timeout_s)

    def update_model_version(self, model_version: int) -> None:
        """TRL's policy version: forwarded to the broker (admission counts from it) when it is not there yet."""
        self._trainer_version = int(model_version)
        if self._trainer_version > self.client.version:
            self.client.set_version(self._trainer_version)
        elif self._trainer_version < self.client.version:
            log.warning("TRL reports model version %d but the pool has version %d published", model_version, self.client.version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise when the loop failed, the pool has had no live worker too long, or the loop is hung."""
        if self._failure is not None:
            raise RuntimeError(f"rollpool rollout worker failed: {self._failure}") from self._failure
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("rollpool rollout thread exited unexpectedly")
        age = time.time() - self._heartbeat
        if self._thread is not None and age > stale_after_s:
            raise RuntimeError(f"rollpool rollout loop heartbeat stale: {age:.0f} s > {stale_after_s:.0f} s")

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        last_status = 0.0
        try:
            while not self._stop.is_set():
                self._heartbeat = time.time()
                now = time.monotonic()
                if now - last_status >= self.config.status_interval_s:
                    last_status = now
                    self._check_workers(now)
                self._top_up()
                try:
                    batch = self.client.get_batch(1, timeout=self.config.pull_timeout_s)
                except TimeoutError:
                    continue
                for g in batch.other:
                    self._other(g)
                for g in batch.groups:
                    self._deliver(g, batch.stats)
        except BaseException as exc:
            if not self._stop.is_set():
                log.exception("rollpool TRL rollout loop failed")
                self._failure = exc

    def _check_workers(self, now: float) -> None:
        status = self.client.status()
        live = len(status.get("workers", {}))
        self._push({"rollpool/workers_live": float(live)})
        if live:
            self._no_workers_since = None
            return
        if self._no_workers_since is None:
            self._no_workers_since = now
            log.warning("rollpool pool has no live worker (waiting up to %.0f s)", self.config.no_workers_timeout_s)
        elif now - self._no_workers_since > self.config.no_workers_timeout_s:
            raise RollpoolError(f"the pool has had no live worker for {now - self._no_workers_since:.0f} s "
                                f"(no_workers_timeout_s={self.config.no_workers_timeout_s}); {len(self._pending)} groups wait in the broker")

    def _next_row(self) -> Mapping[str, Any]:
        """The dataset cycled forever, as TRL's own worker does (TRL stops by steps or epochs)."""
        for _ in range(2):
            if self._rows is None:
                self._rows = iter(self.dataset)
            try:
                return next(self._rows)
            except StopIteration:
                self._rows = None
        raise ConfigError("the train dataset yielded no rows")

    def _encode(self, messages: list[dict[str, Any]], raw: Any) -> list[int]:
        if isinstance(raw, str):
            return list(self.tokenizer(raw, add_special_tokens=False)["input_ids"])
        kw = dict(getattr(self.args, "chat_template_kwargs", None) or {})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return [int(x) for x in ids]

    def _top_up(self) -> None:
        # samples in flight in the pool and samples waiting in rollout_buffer both count: the pipeline
        # stays about max_staleness steps deep, so what TRL consumes is rarely too stale to train on
        room = self._max_inflight() - len(self._pending) * self.group_size - self.rollout_buffer.qsize()
        groups = min(room // self.group_size, self.config.submit_chunk_groups)
        if groups <= 0:
            return
        prompts: list[Prompt] = []
        pend: dict[str, _Pending] = {}
        tries = 0
        while len(prompts) < groups and tries < groups * 4:
            tries += 1
            row = self._next_row()
            raw = row.get("prompt") if isinstance(row, Mapping) else None
            if raw is None or (not isinstance(raw, str) and not isinstance(raw, Sequence)):
                self.counters["rows_without_prompt"] += 1
                self._push({"rollpool/rows_without_prompt_total": 1.0})
                log.warning("dataset row without a usable 'prompt' skipped (keys: %s)", sorted(row) if isinstance(row, Mapping) else type(row).__name__)
                continue
            messages = _messages(raw)
            ids = self._encode(messages, raw)
            extra = {k: v for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
            cols = self.config.metadata_columns
            metadata = {k: v for k, v in extra.items() if (k in cols if cols is not None else _plain(v))}
            pid = new_prompt_id()
            prompts.append(Prompt(prompt_id=pid, input_ids=np.asarray(ids, dtype=np.int32), group_size=self.group_size,
                                  sampling=self.sampling, metadata=metadata))
            pend[pid] = _Pending(group_id=next(self._group_ids), prompt_messages=messages, reward_kwargs=extra,
                                 group_size=self.group_size)
        if not prompts:
            return
        result = self.client.submit(prompts)
        for pid in result.accepted:
            self._pending[pid] = pend[pid]
        self.counters["groups_submitted"] += len(result.accepted)
        if result.rejected:
            # queue_full and the like: nothing is lost, those rows are simply not in flight (the dataset cycles)
            self.counters["groups_rejected"] += len(result.rejected)
            log.info("broker rejected %d prompt groups (first: %s)", len(result.rejected), next(iter(result.rejected.values())))

    def _other(self, g: GroupResult, *, quiet: bool = False) -> None:
        self._pending.pop(g.prompt_id, None)
        key = {GroupState.FAILED: "groups_failed", GroupState.CANCELLED: "groups_cancelled",
               GroupState.DROPPED_STALE: "groups_dropped_stale"}.get(g.state, "groups_failed")
        self.counters[key] += 1
        self._push({f"rollpool/{key}_total": 1.0})
        if not quiet:
            log.warning("prompt group %s ended %s: %s (skipped)", g.prompt_id, g.state, g.reason)

    def _deliver(self, g: GroupResult, stats: Mapping[str, float]) -> None:
        info = self._pending.pop(g.prompt_id, None)
        if info is None:
            self.counters["unknown_groups"] += 1
            log.warning("group %s was not submitted by this rollout worker (an earlier process with the same client id?): skipped", g.prompt_id)
            return
        try:
            samples = group_to_samples(
                g, group_id=info.group_id, prompt_messages=info.prompt_messages, reward_kwargs=info.reward_kwargs,
                reward_funcs=self.reward_funcs, reward_func_names=self.reward_func_names, decode=self._decode,
                current_version=self.client.version, sample_cls=self._sample_cls)
        except RewardError as exc:
            self.counters["reward_errors"] += 1
            self._push({"rollpool/reward_errors_total": 1.0})
            log.warning("prompt group %s skipped: %s", g.prompt_id, exc)
            return
        for t in g.trajectories:
            if t.trajectory_id in self._seen:
                self.counters["duplicated"] += 1
                log.error("trajectory %s delivered twice", t.trajectory_id)
            self._seen[t.trajectory_id] = None
        while len(self._seen) > self._seen_window:
            del self._seen[next(iter(self._seen))]
        missing = sum(1 for t in g.trajectories if not np.asarray(t.loss_mask).any())
        self.counters["samples_without_sampled_tokens"] += missing
        self.counters["groups_delivered"] += 1
        self._push({k: float(v) for k, v in stats.items() if isinstance(v, (int, float))})
        for i, s in enumerate(samples):
            while True:
                if self._stop.is_set():
                    self.counters["samples_not_put_at_stop"] += len(samples) - i
                    return
                try:
                    self.rollout_buffer.put(s, timeout=self.config.put_timeout_s)
                    break
                except queue.Full:
                    self._heartbeat = time.time()  # waiting on the trainer is not a hang
            self.counters["samples_delivered"] += 1

    def _decode(self, ids: Sequence[int]) -> str:
        try:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
        except Exception:  # noqa: BLE001 - decoding ids with the trainer's tokenizer is best effort (text only)
            return ""

    def _push(self, values: dict[str, float]) -> None:
        with contextlib.suppress(queue.Full):
            self.metrics_queue.put_nowait(values)


class RollpoolWeightTransfer:
    """TRL's `WeightTransferProtocol`: each `send_weights` publishes one new version to the pool."""

    def __init__(self, client: SyncTrainerClient, *, _shared: _SharedClient | None = None,
                 publish_timeout_s: float = 600.0) -> None:
        self.client = client
        self._shared = _shared or _SharedClient(client, owned=False, users=1)
        self.publish_timeout_s = publish_timeout_s
        self.version = client.version
        self.published: list[int] = []
        self._destroyed = False

    def init_weight_transfer(self) -> None:
        """Check the broker answers (bounded by the client's request timeout and retries)."""
        status = self.client.status()
        log.info("rollpool weight transfer ready: broker epoch %s, %d live workers", status.get("epoch"), len(status.get("workers", {})))

    def pause(self) -> None:
        """Nothing to stop: workers apply a verified version by their apply mode, a bounded number at a time."""

    def resume(self) -> None:
        """See `pause`."""

    def send_weights(self, iterator: Iterable[tuple[str, Any]]) -> None:
        """Publish every ``(name, tensor)`` of the iterator as the next version.

        The iterator is consumed on the calling (trainer) thread, so any collective it runs (an FSDP
        ``full_tensor()``) stays there; the publisher snapshots the tensors before this returns, so
        the trainer may update them right after.
        """
        named: dict[str, Any] = {}
        for name, tensor in iterator:
            if name in named:
                raise ValueError(f"send_weights got parameter {name!r} twice")
            named[str(name)] = tensor
        if not named:
            raise ValueError("send_weights got no tensors")
        version = max(self.version, self.client.version) + 1
        self.client.publish_weights(named, version)
        self.version = version
        self.published.append(version)

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self._shared.release()


def rollpool_backend(
    broker: str | SyncTrainerClient,
    *,
    train_dataset: Iterable[Mapping[str, Any]],
    args: Any,
    processing_class: Any,
    reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
    tools: Sequence[Callable[..., Any]] | None = None,
    environment_factory: Any = None,
    config: TRLRolloutConfig | None = None,
    client_config: TrainerClientConfig | None = None,
) -> tuple[RollpoolRolloutWorker, RollpoolWeightTransfer]:
    """The two objects to pass to ``AsyncGRPOTrainer(rollout_worker=..., weight_transfer=...)``, on one client.

    ``broker`` is the broker's client endpoint (a client is made and closed by the pair) or an
    existing `SyncTrainerClient` (left open).
    """
    if isinstance(broker, SyncTrainerClient):
        client, owned = broker, False
    else:
        cfg = client_config or TrainerClientConfig(broker=broker)
        client, owned = SyncTrainerClient(broker, config=cfg), True
    shared = _SharedClient(client, owned=owned, users=2)
    try:
        worker = RollpoolRolloutWorker(client, train_dataset=train_dataset, args=args, processing_class=processing_class,
                                       reward_funcs=reward_funcs, tools=tools, environment_factory=environment_factory,
                                       config=config, _shared=shared)
    except BaseException:
        if owned:
            client.close()
        raise
    return worker, RollpoolWeightTransfer(client, _shared=shared)
