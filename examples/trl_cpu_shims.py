"""Test-harness-only shims that let TRL 1.16's AsyncGRPOTrainer run on a CPU build of torch.

Not library code: rollpool.integrations.trl contains no shim. The example and its test install
exactly these two, by name, and nothing else of TRL is modified:

1. ``guard_mfu_probe``: TRL's trainer calls ``torch.cuda.get_device_name`` unguarded in its MFU
   probe (``get_peak_flops_per_device``), which raises on a CPU build. The guard returns ``None``
   (TRL's own "peak FLOPs unknown: MFU metrics off") when CUDA is not available.
2. ``install_cpu_tree_attention``: TRL always loads the model with ``attn_implementation="tree_fa3"``,
   whose forward fetches a FlashAttention-3 kernel from a model hub at run time. This registers a
   pure-PyTorch ``flash_attn_varlen_func`` (same arguments, same causal convention) as that kernel.
   ``tests/integration/integrations/test_trl_shims.py`` checks it against SDPA on unpacked inputs.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["flash_attn_varlen_func", "guard_mfu_probe", "install_cpu_tree_attention", "install_all"]


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, **_: Any) -> torch.Tensor:
    """FlashAttention's varlen attention in plain PyTorch: (total_q, H, D) per packed sequence.

    As in FlashAttention, ``causal`` aligns the mask to the bottom right when a sequence has fewer
    queries than keys (query i of Lq sees keys up to i + Lk - Lq), heads of k/v are shared by
    groups of query heads (GQA), and ``window_size=(left, right)`` limits how far back/forward a
    query looks (-1: unlimited).
    """
    del max_seqlen_q, max_seqlen_k
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks, vs = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        if lq == 0:
            continue
        rep = qs.shape[1] // ks.shape[1]
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qi = torch.arange(lq).unsqueeze(1) + (lk - lq)
        kj = torch.arange(lk).unsqueeze(0)
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= kj <= qi
        left, right = window_size
        if left >= 0:
            allowed &= kj >= qi - left
        if right >= 0 and not causal:
            allowed &= kj <= qi + right
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[cq[i]:cq[i + 1]] = torch.einsum("hqk,khd->qhd", probs, vs.float()).to(q.dtype)
    return out


def guard_mfu_probe() -> None:
    """Shim 1: TRL's MFU probe returns None (MFU off) instead of raising where CUDA is absent."""
    from trl.experimental.async_grpo import async_grpo_trainer as trainer_mod

    probe = trainer_mod.get_peak_flops_per_device
    if getattr(probe, "_rollpool_guarded", False):
        return

    def guarded(accelerator: Any, dtype: str) -> float | None:
        if not torch.cuda.is_available():
            return None
        return probe(accelerator, dtype)  # type: ignore[no-any-return]

    guarded._rollpool_guarded = True  # type: ignore[attr-defined]
    trainer_mod.get_peak_flops_per_device = guarded


def install_cpu_tree_attention() -> None:
    """Shim 2: the ``tree_fa3`` kernel TRL fetches from a hub is this module's pure-PyTorch function."""
    from trl.experimental.async_grpo import packing

    kernel = types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    packing._flash_attn = lambda: kernel


def install_all() -> None:
    guard_mfu_probe()
    install_cpu_tree_attention()
