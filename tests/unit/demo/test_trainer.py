"""The demo trainer's GRPO step trains sampled tokens only (loss_mask 1), with one advantage per episode."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import pytest

from rollpool.protocol import GroupResult
from rollpool.protocol.messages import Trajectory

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollpool.demo.trainer import GRPOConfig, _tensors, grpo_step  # noqa: E402


def _model() -> object:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config)


def _traj(i: int, output: Sequence[int], mask: Sequence[int], logprobs: Sequence[float], reward: float,
          segment: int = 0) -> Trajectory:
    q = len(output)
    return Trajectory(prompt_id="p", sample_index=i, input_ids=np.array([1, 5, 3], dtype=np.int32),
                      output_ids=np.array(output, dtype=np.int32), output_logprobs=np.array(logprobs, dtype=np.float32),
                      token_versions=np.zeros(q, dtype=np.int32), loss_mask=np.array(mask, dtype=np.uint8),
                      finish_reason="stop", reward=reward, segment_index=segment)


def _step(model: object, inserted: tuple[int, int], inserted_logprob: float) -> tuple[dict[str, float], list[object]]:
    """One GRPO step on two episodes: a sampled token, then two inserted ones (tool output) at the end."""
    m = copy.deepcopy(model)
    group = GroupResult(prompt_id="p", state="done", trajectories=(
        _traj(0, [7, *inserted], [1, 0, 0], [-2.0, inserted_logprob, inserted_logprob], reward=1.0),
        _traj(1, [8, *inserted], [1, 0, 0], [-2.5, inserted_logprob, inserted_logprob], reward=0.0),
    ))
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)  # type: ignore[attr-defined]
    figures = grpo_step(m, optimizer, [group], pad_id=0, config=GRPOConfig())
    return figures, [p.detach().clone() for p in m.parameters()]  # type: ignore[attr-defined]


def test_tokens_with_loss_mask_0_are_not_trained() -> None:
    model = _model()
    a_figures, a_params = _step(model, (9, 10), 0.0)
    # other inserted tokens with other (meaningless) logprobs: nothing the step computes may change
    b_figures, b_params = _step(model, (4, 11), -7.0)
    assert a_figures["train/tokens"] == 2.0  # the two sampled tokens, not the four inserted ones
    assert a_figures["train/loss"] == pytest.approx(b_figures["train/loss"], abs=1e-7)
    assert a_figures["train/importance_mean"] == pytest.approx(b_figures["train/importance_mean"], abs=1e-6)
    for pa, pb in zip(a_params, b_params, strict=True):
        assert torch.allclose(pa, pb, atol=1e-7)  # type: ignore[attr-defined]
    # and the step does train the sampled tokens
    assert any(not torch.equal(p0, p1) for p0, p1 in zip(model.parameters(), a_params, strict=True))  # type: ignore[attr-defined]


def test_an_episode_s_segments_share_one_advantage_from_the_episode_rewards() -> None:
    # episode 0 was rewritten once (two segments), episode 1 was not: two episodes, rewards 1 and 0
    group = GroupResult(prompt_id="p", state="done", trajectories=(
        _traj(0, [7], [1], [-1.0], reward=1.0),
        _traj(0, [7], [1], [-1.0], reward=1.0, segment=1),
        _traj(1, [8], [1], [-1.0], reward=0.0),
    ))
    advantages = _tensors([group], pad_id=0)[-1].tolist()
    assert advantages[0] == pytest.approx(advantages[1]) and advantages[0] == pytest.approx(1.0, abs=1e-3)
    assert advantages[2] == pytest.approx(-1.0, abs=1e-3)


def test_a_trajectory_whose_mask_does_not_match_its_outputs_is_refused() -> None:
    bad = _traj(0, [7, 9], [1], [-1.0, 0.0], reward=1.0)
    with pytest.raises(ValueError, match="loss-mask"):
        _tensors([GroupResult(prompt_id="p", state="done", trajectories=(bad, _traj(1, [8], [1], [-1.0], 0.0)))], pad_id=0)


def test_each_demo_task_writes_its_own_report_so_none_overwrites_another() -> None:
    from rollpool.demo.runner import DemoConfig, report_stem

    stems = [report_stem(DemoConfig()), report_stem(DemoConfig(task="tool")), report_stem(DemoConfig(task="tool", tool_disabled=True))]
    assert stems == ["demo-report", "demo-report-tool", "demo-report-tool-disabled"]


def _long_groups() -> list[GroupResult]:
    rng = np.random.default_rng(0)
    groups = []
    for p in range(3):
        trajs = []
        for i in range(4):
            q = int(rng.integers(1, 9))
            trajs.append(Trajectory(prompt_id=f"p{p}", sample_index=i, input_ids=np.array([1, 5, 3], dtype=np.int32),
                                    output_ids=rng.integers(3, 12, q).astype(np.int32),
                                    output_logprobs=np.full(q, -2.0, dtype=np.float32), token_versions=np.zeros(q, dtype=np.int32),
                                    loss_mask=np.ones(q, dtype=np.uint8), finish_reason="length", reward=float(i % 2)))
        groups.append(GroupResult(prompt_id=f"p{p}", state="done", trajectories=tuple(trajs)))
    return groups


def _params_after(config: GRPOConfig) -> tuple[dict[str, float], list[object]]:
    m = copy.deepcopy(_model())
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)  # type: ignore[attr-defined]
    figures = grpo_step(m, optimizer, _long_groups(), pad_id=0, config=config)
    return figures, [p.detach().clone() for p in m.parameters()]  # type: ignore[attr-defined]


def test_micro_batches_train_exactly_what_the_whole_batch_trains() -> None:
    whole, whole_params = _params_after(GRPOConfig())
    split, split_params = _params_after(GRPOConfig(micro_batch_tokens=24))
    assert split["train/micro_batches"] > 1
    assert split["train/tokens"] == whole["train/tokens"]
    assert split["train/loss"] == pytest.approx(whole["train/loss"], abs=1e-5)
    for a, b in zip(whole_params, split_params, strict=True):
        assert torch.allclose(a, b, atol=1e-6)  # type: ignore[attr-defined]


def test_loss_first_tokens_trains_only_the_answer_token_of_each_sample() -> None:
    figures, _ = _params_after(GRPOConfig(loss_first_tokens=1))
    assert figures["train/tokens"] == 12.0  # 3 groups x 4 samples, one token each
