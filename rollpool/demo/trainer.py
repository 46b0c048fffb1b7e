"""GRPO with decoupled-PPO importance weights, for the demo (CPU, or the model's GPU).

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

On a GPU (the model's device is where the step runs) a batch with long outputs does not fit as one padded
matrix: ``micro_batch_tokens`` splits it into micro-batches of rows of similar length (each padded to its own
longest row, at most that many padded tokens each), whose gradients add up to the whole batch's (the loss is
normalised by the whole batch's token count), and ``autocast`` runs the forward passes in bfloat16 on CUDA
(the master weights and the optimizer stay in the model's dtype). ``loss_first_tokens`` trains only the first k
sampled tokens of each trajectory: the demo's long-tail setup, whose reward reads the first token only and whose
tail stands in for a reasoning trace (generated and run through the trainer like one, but not a target).
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
    micro_batch_tokens: int = 0
    """Most padded tokens per forward/backward pass (rows grouped by length); 0: the whole batch at once."""
    autocast: bool = False
    """Forward passes in bfloat16 under torch.autocast when the model is on CUDA (ignored on CPU)."""
    loss_first_tokens: int | None = None
    """Train only the first k sampled tokens of each trajectory (None: every sampled token)."""


Row = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]
"""(input ids, output ids, output logprobs, loss mask, advantage) of one trajectory."""


def _rows(groups: Sequence[GroupResult], loss_first_tokens: int | None = None) -> list[Row]:
    rows: list[Row] = []
    for g in groups:
        # one reward per episode (its segments all carry it), normalised over the group's episodes
        episode_reward: dict[int, float] = {}
        for t in g.trajectories:
            episode_reward.setdefault(t.sample_index, t.reward if t.reward is not None else 0.0)
        rewards = np.array(list(episode_reward.values()), dtype=np.float64)
        adv = dict(zip(episode_reward, (rewards - rewards.mean()) / (rewards.std() + GRPOConfig.adv_eps), strict=True))
        for t in g.trajectories:
            loss_mask = np.asarray(t.loss_mask)
            if loss_first_tokens is not None:
                # the first k sampled tokens only (positions of later sampled tokens get mask 0)
                sampled = np.cumsum(loss_mask != 0)
                loss_mask = np.where(sampled <= loss_first_tokens, loss_mask, 0).astype(loss_mask.dtype)
            rows.append((np.asarray(t.input_ids), np.asarray(t.output_ids), np.asarray(t.output_logprobs),
                         loss_mask, float(adv[t.sample_index])))
    return rows


def _pad(rows: Sequence[Row], pad_id: int) -> tuple[torch.Tensor, ...]:
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


def _tensors(groups: Sequence[GroupResult], pad_id: int) -> tuple[torch.Tensor, ...]:
    return _pad(_rows(groups), pad_id)


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices in micro-batches: rows sorted by length, each micro-batch at most `max_tokens` padded tokens
    (rows x its longest row; a row longer than `max_tokens` goes alone); 0: one batch of every row, in order."""
    if max_tokens <= 0:
        return [list(range(len(lengths)))]
    out: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: lengths[k]):
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


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
    order): a vision-language model's pixel values for the images each row's prompt showed (then the batch is
    one pass: micro-batches need rows of one kind)."""
    rows = _rows(groups, config.loss_first_tokens)
    device = next(iter(model.parameters())).device
    use_autocast = config.autocast and device.type == "cuda"
    chunks = micro_batches([len(r[0]) + len(r[1]) for r in rows], 0 if extra_inputs is not None else config.micro_batch_tokens)
    tokens = torch.tensor(float(sum(int((r[3] != 0).sum()) for r in rows))).clamp(min=1.0).to(device)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = {"loss": 0.0, "weight": 0.0, "gap": 0.0, "entropy": 0.0}
    for chunk in chunks:
        ids, attn, mask, behaviour, adv = (t.to(device) for t in _pad([rows[i] for i in chunk], pad_id))
        extra = extra_inputs(groups, ids) if extra_inputs is not None else {}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_autocast):
            with torch.no_grad():
                proximal, _ = _token_logprobs(model, ids, attn, extra)
            current, entropy = _token_logprobs(model, ids, attn, extra)
        weight = torch.exp(proximal - behaviour).clamp(max=config.max_importance)
        ratio = torch.exp(current - proximal)
        a = adv.unsqueeze(1)
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - config.clip_eps, 1 + config.clip_eps) * a)
        entropy_sum = (entropy * mask).sum()
        loss = -(weight * surrogate * mask).sum() / tokens - config.entropy_coef * entropy_sum / tokens
        loss.backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            sums["loss"] += float(loss.item())
            sums["weight"] += float((weight * mask).sum().item())
            sums["gap"] += float(((proximal - behaviour).abs() * mask).sum().item())
            sums["entropy"] += float(entropy_sum.item())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    n = float(tokens.item())
    return {
        "train/loss": sums["loss"],
        "train/importance_mean": sums["weight"] / n,
        "train/behaviour_gap": sums["gap"] / n,
        "train/tokens": n,
        "train/entropy": sums["entropy"] / n,
        "train/micro_batches": float(len(chunks)),
    }
