"""Attention logit soft-capping (Gemma 2): scores -> cap * tanh(scores / cap) before the mask.

SDPA and the fused flash kernel have no soft-cap, so a backend with one attends with explicit
matmuls here, in transformers' eager order: (q k^T) * scale, capped, masked, softmax in fp32,
rounded to the working dtype, times V.
"""

from __future__ import annotations

import torch


def soft_cap_(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), in place (as transformers: divide, tanh, multiply)."""
    return scores.div_(cap).tanh_().mul_(cap)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     cap: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Soft-capped attention of one span. q: [n, Hq, D] (token-major); k, v: [Hkv, kv_len, D];
    mask: additive [n, kv_len], or None for bottom-right causal. Returns [n, Hq, D]."""
    n, hq, d = q.shape
    hkv, kv_len = k.shape[0], k.shape[1]
    g = hq // hkv
    qh = q.reshape(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
    scores = soft_cap_(torch.bmm(qh, k.transpose(1, 2)).mul_(scale), cap)
    if mask is None:
        mask = torch.full((n, kv_len), float("-inf"), dtype=scores.dtype,
                          device=scores.device).triu_(kv_len - n + 1)
    scores = scores.view(hkv, g, n, kv_len).add_(mask.to(scores.dtype))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.bmm(probs.view(hkv, g * n, kv_len), v)          # [Hkv, g * n, D]
    return o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
