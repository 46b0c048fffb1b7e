"""rollpool.integrations.trl without sockets: delivered groups -> TRL RolloutSamples, and the adapter's
objects against the Protocols of the installed TRL (its real source, not a copy)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np
import pytest

pytest.importorskip("trl")

from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol, WeightTransferProtocol
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from rollpool.integrations.trl import (
    RewardError,
    RollpoolRolloutWorker,
    RollpoolWeightTransfer,
    group_to_samples,
)
from rollpool.protocol import GroupResult, GroupState, Trajectory


def traj(i: int, out: list[int], *, versions: list[int], mask: list[int] | None = None, reward: float | None = None,
         segment: int = 0, prompt: list[int] | None = None) -> Trajectory:
    n = len(out)
    return Trajectory(
        prompt_id="p", sample_index=i, segment_index=segment, input_ids=np.array(prompt or [1, 2, 3], np.int32),
        output_ids=np.array(out, np.int32), output_logprobs=np.linspace(-1.0, -0.1, n).astype(np.float32),
        token_versions=np.array(versions, np.int32), loss_mask=np.array(mask or [1] * n, np.uint8),
        finish_reason="stop", reward=reward, output_text=f"t{i}",
    )


def group(*trajs: Trajectory) -> GroupResult:
    return GroupResult(prompt_id="p", state=GroupState.DONE, trajectories=tuple(trajs))


PROMPT = [{"role": "user", "content": "q"}]


def test_fields_of_each_sample_come_from_the_trajectory() -> None:
    g = group(traj(0, [7, 8, 2], versions=[3, 4, 4], reward=1.0), traj(1, [9, 2], versions=[4, 4], reward=0.0))
    samples = group_to_samples(g, group_id=12, prompt_messages=PROMPT, reward_kwargs={}, sample_cls=RolloutSample)
    assert len(samples) == 2 and all(isinstance(s, RolloutSample) for s in samples)
    s0, s1 = samples
    assert s0.input_ids.tolist() == [1, 2, 3, 7, 8, 2]
    assert s0.completion_mask.tolist() == [0, 0, 0, 1, 1, 1]
    np.testing.assert_allclose(s0.old_log_probs[3:], g.trajectories[0].output_logprobs)
    assert s0.old_log_probs[:3].tolist() == [0.0, 0.0, 0.0]
    assert s0.model_version == 3 and s1.model_version == 4  # the oldest sampled token
    assert s0.group_id == 12 and isinstance(s0.group_id, int)
    assert s0.prompt == PROMPT and s0.completion == [{"role": "assistant", "content": "t0"}]
    assert s0.advantage == pytest.approx(1.0, abs=1e-6) and s1.advantage == pytest.approx(-1.0, abs=1e-6)
    assert s0.metrics["reward"] == 1.0 and s0.metrics["rewards/pool"] == 1.0 and s0.enqueued_at is not None


def test_inserted_tokens_are_masked_and_do_not_set_the_version() -> None:
    """An episode's inserted tokens (loss mask 0) take an older version; model_version counts sampled tokens only."""
    t = traj(0, [5, 6, 7, 8], versions=[2, 1, 1, 3], mask=[1, 0, 0, 1], reward=1.0)
    (s,) = group_to_samples(group(t), group_id=0, prompt_messages=PROMPT, reward_kwargs={}, sample_cls=RolloutSample)
    assert s.completion_mask.tolist() == [0, 0, 0, 1, 0, 0, 1]
    assert s.model_version == 2


def test_trl_reward_funcs_get_trls_arguments_and_are_summed_with_the_workers_reward() -> None:
    seen: dict[str, Any] = {}

    def exact(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], answer: list[int], **kw: Any) -> list[float]:
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer, kw=kw)
        return [1.0 if ids[0] == a else 0.0 for ids, a in zip(completion_ids, answer, strict=True)]

    g = group(traj(0, [7], versions=[0], reward=0.5), traj(1, [8], versions=[0], reward=0.5), traj(2, [9], versions=[0]))
    samples = group_to_samples(g, group_id=0, prompt_messages=PROMPT, reward_kwargs={"answer": 7, "level": "easy"},
                               reward_funcs=[exact], reward_func_names=["exact"], sample_cls=RolloutSample)
    assert seen["completion_ids"] == [[7], [8], [9]] and seen["answer"] == [7, 7, 7] and seen["kw"] == {"level": ["easy"] * 3}
    assert seen["prompts"] == [PROMPT] * 3
    rewards = [s.metrics["reward"] for s in samples]
    assert rewards == [1.5, 0.5, 0.0]  # exact + pool (the third has no pool reward: NaN, summed as 0 by nansum)
    assert samples[0].metrics["rewards/exact"] == 1.0 and math.isnan(samples[2].metrics["rewards/pool"])
    r = np.array(rewards)
    np.testing.assert_allclose([s.advantage for s in samples], (r - r.mean()) / (r.std() + 1e-8), rtol=1e-6)


def test_an_unscored_sample_gets_advantage_zero() -> None:
    g = group(traj(0, [7], versions=[0], reward=1.0), traj(1, [8], versions=[0], reward=None), traj(2, [9], versions=[0], reward=0.0))
    samples = group_to_samples(g, group_id=0, prompt_messages=PROMPT, reward_kwargs={}, sample_cls=RolloutSample)
    assert math.isnan(samples[1].metrics["reward"]) and samples[1].advantage == 0.0
    assert samples[0].advantage == pytest.approx(1.0, abs=1e-6) and samples[2].advantage == pytest.approx(-1.0, abs=1e-6)


def test_a_later_episode_segment_is_one_more_row_with_its_episodes_advantage() -> None:
    g = group(traj(0, [7], versions=[1], reward=1.0), traj(0, [4, 7], versions=[1, 2], reward=1.0, segment=1, prompt=[1, 9]),
              traj(1, [8], versions=[1], reward=0.0))
    samples = group_to_samples(g, group_id=3, prompt_messages=PROMPT, reward_kwargs={}, sample_cls=RolloutSample)
    assert len(samples) == 3
    assert samples[0].advantage == samples[1].advantage > 0 > samples[2].advantage
    assert samples[1].input_ids.tolist() == [1, 9, 4, 7] and samples[1].completion_mask.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("bad", ["raises", "wrong_count"])
def test_a_bad_reward_function_raises_reward_error(bad: str) -> None:
    def f(completion_ids: list[list[int]], **_: Any) -> list[float]:
        if bad == "raises":
            raise ZeroDivisionError("boom")
        return [1.0]

    g = group(traj(0, [7], versions=[0]), traj(1, [8], versions=[0]))
    with pytest.raises(RewardError, match="f"):
        group_to_samples(g, group_id=0, prompt_messages=PROMPT, reward_kwargs={}, reward_funcs=[f], reward_func_names=["f"],
                         sample_cls=RolloutSample)


def _members(proto: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in getattr(proto, "__annotations__", {}):
        out[name] = None
    for name, value in vars(proto).items():
        if callable(value) and not name.startswith("_"):
            out[name] = inspect.signature(value)
    return out


@pytest.mark.parametrize("impl,proto", [(RollpoolRolloutWorker, RolloutWorkerProtocol), (RollpoolWeightTransfer, WeightTransferProtocol)])
def test_the_adapter_implements_trls_protocols(impl: type, proto: type) -> None:
    members = _members(proto)
    assert members, "the installed TRL's Protocol has no members: it changed"
    for name, sig in members.items():
        if sig is None:  # an attribute: set in __init__
            assert name in inspect.getsource(impl.__init__), f"{impl.__name__} has no attribute {name}"
            continue
        ours = inspect.signature(getattr(impl, name))
        assert list(ours.parameters) == list(sig.parameters), f"{impl.__name__}.{name}{ours} != TRL's {sig}"
