"""Shared scenario builders and the dense reference for the attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.attention.metadata import SeqSpan
from radixserve.attention.kv_pool import KVPool


def slot_of(pages: np.ndarray, pos: int, page_size: int) -> int:
    """Brute-force slot of one position (the tests' independent page arithmetic)."""
    return int(pages[pos // page_size]) * page_size + pos % page_size


@dataclass
class Scenario:
    spans: list[SeqSpan]
    full_k: list[torch.Tensor]   # per span: [kv_len, Hkv, D], the whole sequence
    full_v: list[torch.Tensor]
    q: torch.Tensor              # [T, Hq, D] for the new tokens, spans concatenated
    k: torch.Tensor              # [T, Hkv, D]
    v: torch.Tensor


def make_scenario(pool: KVPool, lens: list[tuple[int, int]], num_qo_heads: int,
                  seed: int = 0, extra_pages: int = 0, layer: int = 0) -> Scenario:
    """Random K/V for sequences given as (cached_len, new_len), their pages scattered at
    random over the pool; the cached prefix is written straight into the pool."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    ps, hkv, d, dt = pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype
    need = [-(-(c + n) // ps) + extra_pages for c, n in lens]
    assert sum(need) <= pool.num_pages
    perm = rng.permutation(pool.num_pages).astype(np.int32)
    spans, full_k, full_v, qs, ks, vs = [], [], [], [], [], []
    off = 0
    for (cached, new), npages in zip(lens, need):
        pages = perm[off:off + npages]
        off += npages
        kv_len = cached + new
        fk = torch.randn(kv_len, hkv, d, generator=gen).to(dt)
        fv = torch.randn(kv_len, hkv, d, generator=gen).to(dt)
        for p in range(cached):
            s = slot_of(pages, p, ps)
            pool.k_flat[layer][s] = fk[p]
            pool.v_flat[layer][s] = fv[p]
        spans.append(SeqSpan(pages=pages, cached_len=cached, new_len=new))
        full_k.append(fk)
        full_v.append(fv)
        qs.append(torch.randn(new, num_qo_heads, d, generator=gen).to(dt))
        ks.append(fk[cached:])
        vs.append(fv[cached:])
    cat = lambda xs, h: torch.cat(xs) if xs else torch.zeros(0, h, d, dtype=dt)  # noqa: E731
    return Scenario(spans, full_k, full_v, cat(qs, num_qo_heads), cat(ks, hkv), cat(vs, hkv))


def dense_attention(sc: Scenario, sm_scale: float | None = None,
                    window: int | None = None) -> torch.Tensor:
    """Per-sequence SDPA on contiguous K/V in float64 with an explicit bottom-right mask;
    ``window``: a query at position p also sees only positions > p - window."""
    outs = []
    off = 0
    for span, fk, fv in zip(sc.spans, sc.full_k, sc.full_v):
        n, kv_len = span.new_len, span.cached_len + span.new_len
        q = sc.q[off:off + n].double().transpose(0, 1)            # [Hq, n, D]
        off += n
        group = q.shape[0] // fk.shape[1]
        k = fk.double().transpose(0, 1).repeat_interleave(group, 0)
        v = fv.double().transpose(0, 1).repeat_interleave(group, 0)
        i = torch.arange(n)[:, None]
        j = torch.arange(kv_len)[None, :]
        mask = j <= span.cached_len + i
        if window is not None:
            mask &= j > span.cached_len + i - window
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)
                    .transpose(0, 1))
    if not outs:
        return torch.zeros_like(sc.q, dtype=torch.float64)
    return torch.cat(outs)
