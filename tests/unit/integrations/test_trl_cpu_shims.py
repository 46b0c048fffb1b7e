"""The example's pure-PyTorch `flash_attn_varlen_func` (test-harness shim for TRL's ``tree_fa3``) against SDPA."""

from __future__ import annotations

import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "examples"))
from trl_cpu_shims import flash_attn_varlen_func  # noqa: E402


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal SDPA of one unpacked sequence, (L, H, D) in and out (GQA by repeating k/v heads)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_unpacked_sequences_match_causal_sdpa(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    lengths = [1, 5, 17, 3]
    d = 16
    qs = [torch.randn(n, heads, d) for n in lengths]
    ks = [torch.randn(n, kv_heads, d) for n in lengths]
    vs = [torch.randn(n, kv_heads, d) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = flash_attn_varlen_func(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu, cu, max(lengths), max(lengths), causal=True)
    want = torch.cat([_sdpa(q, k, v) for q, k, v in zip(qs, ks, vs, strict=True)])
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_softmax_scale_is_applied() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(9, 2, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, softmax_scale=0.05, causal=True)
    torch.testing.assert_close(out, _sdpa(q, k, v, scale=0.05), atol=1e-5, rtol=1e-5)


def test_fewer_queries_than_keys_align_bottom_right_as_tree_packing_needs() -> None:
    """A tree segment's queries are the last tokens of its root-to-segment path: they must equal the last
    rows of causal attention over the whole path (FlashAttention's bottom-right causal alignment)."""
    torch.manual_seed(2)
    path = 12
    q, k, v = torch.randn(path, 4, 8), torch.randn(path, 2, 8), torch.randn(path, 2, 8)
    full = _sdpa(q, k, v)
    tail = 3
    out = flash_attn_varlen_func(q[-tail:], k, v, torch.tensor([0, tail], dtype=torch.int32),
                                 torch.tensor([0, path], dtype=torch.int32), tail, path, causal=True)
    torch.testing.assert_close(out, full[-tail:], atol=1e-5, rtol=1e-5)
