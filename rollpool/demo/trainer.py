"""GRPO with decoupled-PPO importance weights, on CPU, for the demo.

Advantages are group-relative (reward minus the group mean, over the group's
standard deviation). The loss corrects for stale samples the way decoupled
PPO (AReaL) does: with behaviour logprobs ``b`` carried by the trajectories
(the policy that generated each token, possibly versions ago), proximal
logprobs ``p`` (the current policy before this update) and current logprobs
``c``::

    w     = min(exp(p - b), max_importance)          # behaviour -> proximal correction
    ratio = exp(c - p)
    loss  = -mean(w * min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A))

so stale samples are reweighted, not ignored; with one optimizer step per
batch ``ratio`` starts at 1 and the gradient is ``w * A * grad(c)``.

Only sampled tokens are trained: the mean runs over output tokens whose
``loss_mask`` is 1. Tokens an episode inserted (tool output, the chat
template's own tokens: mask 0) are context, never a target; their logprobs are
not the policy's. An episode is one sample of its group: its advantage is
computed from the rewards of the group's episodes (by ``sample_index``) and
shared by all its segments (a history rewrite gives an episode more than one
trajectory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollpool.protocol import GroupResult

__all__ = ["GRPOConfig", "grpo_step"]


@dataclass(frozen=True)
class GRPOConfig:
    lr: float = 3e-3
    clip_eps: float = 0.2
    max_importance: float = 5.0
    adv_eps: float = 1e-4
    entropy_coef: float = 0.0
    """Weight of the policy's mean entropy at the trained positions, added to the objective (keeps exploring)."""


def _tensors(groups: Sequence[GroupResult], pad_id: int) -> tuple[torch.Tensor, ...]:
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]] = []
    for g in groups:
        # one reward per episode (its segments all carry it), normalised over the group's episodes
        episode_reward: dict[int, float] = {}
        for t in g.trajectories:
            episode_reward.setdefault(t.sample_index, t.reward if t.reward is not None else 0.0)
        rewards = np.array(list(episode_reward.values()), dtype=np.float64)
        adv = dict(zip(episode_reward, (rewards - rewards.mean()) / (rewards.std() + GRPOConfig.adv_eps), strict=True))
        for t in g.trajectories:
            rows.append((np.asarray(t.input_ids), np.asarray(t.output_ids), np.asarray(t.output_logprobs),
                         np.asarray(t.loss_mask), float(adv[t.sample_index])))
    length = max(len(r[0]) + len(r[1]) for r in rows)
    n = len(rows)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attn = torch.zeros((n, length), dtype=torch.long)
    gen_mask = torch.zeros((n, length), dtype=torch.float32)  # 1 where position t+1 is a sampled token (loss_mask 1)
    behaviour = torch.zeros((n, length), dtype=torch.float32)
    advantages = torch.zeros(n, dtype=torch.float32)
    for r, (inp, out, lps, loss_mask, a) in enumerate(rows):
        p, q = len(inp), len(out)
        if len(loss_mask) != q or len(lps) != q:
            raise ValueError(f"row {r}: {q} output tokens but {len(loss_mask)} loss-mask entries and {len(lps)} logprobs")
        ids[r, :p] = torch.from_numpy(inp.astype(np.int64))
        ids[r, p : p + q] = torch.from_numpy(out.astype(np.int64))
        attn[r, : p + q] = 1
        gen_mask[r, p - 1 : p + q - 1] = torch.from_numpy((loss_mask != 0).astype(np.float32))
        behaviour[r, p - 1 : p + q - 1] = torch.from_numpy(lps.astype(np.float32))
        advantages[r] = a
    return ids, attn, gen_mask, behaviour, advantages


def _token_logprobs(model: Any, ids: torch.Tensor, attn: torch.Tensor, extra: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(token t+1), the entropy of the distribution over token t+1) at every position t."""
    # a vision model may be given other ids to run (`model_input_ids`: a sampled image token is text, not a placeholder)
    run = {k: v for k, v in extra.items() if k != "model_input_ids"}
    logits = model(input_ids=extra.get("model_input_ids", ids), attention_mask=attn, **run).logits[:, :-1, :].float()
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(lp, (0, 1)), torch.nn.functional.pad(entropy, (0, 1))


def grpo_step(model: Any, optimizer: torch.optim.Optimizer, groups: Sequence[GroupResult], *, pad_id: int,
              config: GRPOConfig = GRPOConfig(),
              extra_inputs: Callable[[Sequence[GroupResult], torch.Tensor], Mapping[str, Any]] | None = None) -> dict[str, float]:
    """One optimizer step on a batch of whole groups; returns loss figures.

    `extra_inputs(groups, ids)` gives more model inputs for the batch's rows (a trajectory per row, in group
    order): a vision-language model's pixel values for the images each row's prompt showed."""
    ids, attn, mask, behaviour, adv = _tensors(groups, pad_id)
    extra = extra_inputs(groups, ids) if extra_inputs is not None else {}
    model.train()
    with torch.no_grad():
        proximal, _ = _token_logprobs(model, ids, attn, extra)
    current, entropy = _token_logprobs(model, ids, attn, extra)
    weight = torch.exp(proximal - behaviour).clamp(max=config.max_importance)
    ratio = torch.exp(current - proximal)
    a = adv.unsqueeze(1)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - config.clip_eps, 1 + config.clip_eps) * a)
    tokens = mask.sum().clamp(min=1.0)
    mean_entropy = (entropy * mask).sum() / tokens
    loss = -(weight * surrogate * mask).sum() / tokens - config.entropy_coef * mean_entropy
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    with torch.no_grad():
        behaviour_gap = ((proximal - behaviour).abs() * mask).sum() / tokens
    return {
        "train/loss": float(loss.item()),
        "train/importance_mean": float(((weight * mask).sum() / tokens).item()),
        "train/behaviour_gap": float(behaviour_gap.item()),
        "train/tokens": float(tokens.item()),
        "train/entropy": float(mean_entropy.item()),
    }
