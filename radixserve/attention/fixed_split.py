"""Attention whose result for a query depends only on that query and its keys: deterministic
mode's CPU attention.

The default torch backend's numbers depend on the step: a decode's keys are padded to the
longest sequence of its chunk, a prefill's matmul spans however many keys its query block
sees, a shared prefix is attended separately (cascade) and merged. Here the keys of every
query are cut into chunks of ``split`` positions at *absolute* boundaries (0, split,
2*split, ...), whatever part of the sequence is cached, computed in this step, or padding:

- scores of a chunk: one matmul reducing over head_dim only (oneDNN gives each element the
  same bits whatever the number of rows, batch or key count; tests/attention/
  test_fixed_split.py checks it), masked to positions <= the query's own;
- per chunk, in fp32: its max ``m_c``, ``p = exp(s - m_c)``, ``l_c = sum(p)``, and
  ``o_c = p @ V_c`` (a matmul reducing over exactly ``split`` keys, masked keys adding 0);
- the chunks merged in their positional order: ``M = max_c m_c``,
  ``o = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c``, the sums taken by a sequential
  scan (``cumsum``), so chunks past the query's position (weight exactly 0) change nothing.

So a query gives the same bits as a decode, in any batch, in any prefill chunk, with its
prefix from the cache or not, at any page size. Cascade groups are not formed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.attention import torch_plans as plans
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.partial_attention import softmax_with_lse
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.torch_plans import StepTables, head_major_rows

DEFAULT_SPLIT = 256         # keys per chunk: one matmul's reduction length
DEFAULT_QUERY_BLOCK = 128   # prefill queries per block (bounds the score buffer only)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    masked_from: int, split: int, scale: float) -> torch.Tensor:
    """q [b, H, R, D]; k, v [b, H, L, D] with L a multiple of ``split``, finite everywhere;
    mask: additive (0 / the dtype's lowest finite value) in q's dtype, broadcastable to [b, H, C - masked_from, R,
    split] for chunks ``masked_from`` .. C - 1 (the earlier ones are entirely visible to every
    row); every row sees key 0. Returns [b, H, R, D] in q's dtype (order: module doc)."""
    b, h, r, d = q.shape
    chunks = k.shape[2] // split
    kc = k.view(b, h, chunks, split, d)
    # Scores in q's dtype with the scale applied to q first (as causal_blocks does; exact
    # for power-of-two scales such as head_dim 64's).
    scores = torch.matmul((q * scale).unsqueeze(2), kc.transpose(-1, -2))  # [b, h, C, R, S]
    scores[:, :, masked_from:].add_(mask)
    # Per chunk: softmax (fp32 inside, rounded to q's dtype, as the default path) and its
    # log-sum-exp, lse = max - log(max probability). A fully masked chunk sees only the
    # (finite) mask value: a uniform softmax over finite keys, weighted exactly 0 below.
    probs = torch.softmax(scores, -1)
    lse = scores.amax(-1).float() - probs.amax(-1).float().log()     # [b, h, C, R]
    o = torch.matmul(probs, v.view(b, h, chunks, split, d))          # [b, h, C, R, D]
    w = torch.exp(lse - lse.amax(2, keepdim=True))
    num = (o.float() * w[..., None]).cumsum(2)[:, :, -1]             # sequential over C
    den = w.cumsum(2)[:, :, -1]
    return (num / den[..., None]).to(q.dtype)


class ChunkMask:
    """An additive mask over chunks ``first`` .. C - 1 in split_attention's layout
    [b, 1, C - first, R, split]; chunks before ``first`` are visible to every row. Cast once
    per dtype (the plan is built before the layers say which)."""

    __slots__ = ("first", "_allowed", "_by_dtype")

    def __init__(self, allowed: np.ndarray, split: int, t: StepTables) -> None:
        b, r, width = allowed.shape                          # allowed [b, R, L]
        folded = allowed.reshape(b, r, width // split, split).transpose(0, 2, 1, 3)
        whole = folded.all(axis=(0, 2, 3))                   # [C]
        self.first = len(whole) if whole.all() else int(np.argmin(whole))
        self._allowed = t.tensor(folded[:, self.first:][:, None])
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """0 where allowed, else the dtype's most negative finite value (no -inf: a chunk
        with no visible key must not give NaN; its weight is exactly 0 anyway)."""
        m = self._by_dtype.get(dtype)
        if m is None:
            m = torch.zeros(self._allowed.shape, dtype=dtype, device=self._allowed.device)
            m.masked_fill_(~self._allowed, torch.finfo(dtype).min)
            self._by_dtype[dtype] = m
        return m


def _padded(n: int, split: int) -> int:
    return -(-n // split) * split


@dataclass(slots=True)
class PrefillBlock:
    start: int                 # the step's tokens [start, end) of one span
    end: int
    keys: int                  # keys this block reads: a multiple of split
    mask: ChunkMask            # rows: group * (end - start)


@dataclass(slots=True)
class SplitPrefill:
    rows: torch.Tensor         # int64 [Hkv * padded kv_len] gather rows (head-major)
    keys: int                  # padded kv_len
    blocks: list[PrefillBlock]


@dataclass(slots=True)
class SplitDecodes:
    tokens: torch.Tensor       # int64 [b]
    rows: torch.Tensor         # int64 [b * Hkv * keys]
    keys: int
    mask: ChunkMask            # rows: 1 (broadcast over the group)


@dataclass
class FixedSplitPlan:
    meta: AttentionMetadata
    prefills: list[SplitPrefill] = field(default_factory=list)
    decodes: list[SplitDecodes] = field(default_factory=list)


class FixedSplitBackend(TorchAttentionBackend):
    """The torch backend's gathers and KV pool handling, with ``split_attention`` for every
    sequence (prefills one span at a time in query blocks, decodes batched)."""

    name = "torch-fixed-split"

    def __init__(self, *, split: int = DEFAULT_SPLIT, query_block: int = DEFAULT_QUERY_BLOCK,
                 **kw) -> None:
        super().__init__(cascade=False, **kw)
        self.split = split
        self.query_block = query_block

    def _slot_rows(self, t: StepTables, seqs: np.ndarray, keys: int) -> np.ndarray:
        """Head-major gather rows of positions [0, keys) of ``seqs``; positions past a
        sequence's end re-read its last one (finite, masked out)."""
        pos = np.minimum(np.arange(keys)[None, :], t.kv_lens[seqs][:, None] - 1)
        return head_major_rows(t.slots(seqs[:, None], pos), self.num_kv_heads)

    def prepare(self, meta: AttentionMetadata) -> FixedSplitPlan:
        t = StepTables.of(meta)
        plan = FixedSplitPlan(meta)
        for b in range(meta.num_prefills):
            plan.prefills.append(self._prefill_plan(t, b))
        if meta.num_decodes:
            first = meta.num_prefills
            keys = np.array([_padded(int(n), self.split) for n in t.kv_lens])
            order = first + np.argsort(keys[first:], kind="stable")
            for chunk in plans.chunk_by_budget(order, keys * self.num_kv_heads,
                                               self.max_gather_rows):
                width = int(keys[chunk].max())
                allowed = np.arange(width)[None, None, :] < t.kv_lens[chunk][:, None, None]
                plan.decodes.append(SplitDecodes(
                    tokens=t.tensor(t.qo_indptr[chunk]),
                    rows=t.tensor(self._slot_rows(t, chunk, width).reshape(-1)), keys=width,
                    mask=ChunkMask(allowed, self.split, t)))
        return plan

    def _prefill_plan(self, t: StepTables, b: int) -> SplitPrefill:
        start, end = int(t.qo_indptr[b]), int(t.qo_indptr[b + 1])
        kv_len = int(t.kv_lens[b])
        cached = kv_len - (end - start)
        keys = _padded(kv_len, self.split)
        blocks = []
        for s in range(start, end, self.query_block):
            e = min(end, s + self.query_block)
            pos = cached + np.arange(s - start, e - start)              # absolute positions
            width = _padded(int(pos[-1]) + 1, self.split)
            allowed = np.arange(width)[None, :] <= pos[:, None]          # [r, width]
            folded = np.tile(allowed, (self.group, 1))                  # rows (g, i)
            blocks.append(PrefillBlock(s, e, width, ChunkMask(folded[None], self.split, t)))
        rows = self._slot_rows(t, np.array([b]), keys).reshape(-1)
        return SplitPrefill(t.tensor(rows), keys, blocks)

    def forward(self, plan: FixedSplitPlan, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        kv_pool.write(layer, plan.meta.write_slots, k, v)
        out = torch.empty_like(q)
        hkv, g, d, dt = self.num_kv_heads, self.group, self.head_dim, q.dtype
        for p in plan.prefills:
            kb, vb = self._gather(kv_pool, layer, p.rows, dt)
            ks, vs = kb.view(1, hkv, p.keys, d).to(dt), vb.view(1, hkv, p.keys, d).to(dt)
            for blk in p.blocks:
                n = blk.end - blk.start
                qh = q[blk.start:blk.end].view(n, hkv, g, d).permute(1, 2, 0, 3)
                o = split_attention(qh.reshape(1, hkv, g * n, d), ks[:, :, :blk.keys],
                                    vs[:, :, :blk.keys], blk.mask.values(dt), blk.mask.first,
                                    self.split, self.sm_scale)
                out[blk.start:blk.end].view(n, hkv, g, d).copy_(
                    o.view(hkv, g, n, d).permute(2, 0, 1, 3))
        for c in plan.decodes:
            batch = c.tokens.shape[0]
            qd = q.index_select(0, c.tokens).view(batch, hkv, g, d)
            kb, vb = self._gather(kv_pool, layer, c.rows, dt)
            o = split_attention(qd, kb.view(batch, hkv, c.keys, d).to(dt),
                                vb.view(batch, hkv, c.keys, d).to(dt), c.mask.values(dt),
                                c.mask.first, self.split,
                                self.sm_scale)
            out.index_copy_(0, c.tokens, o.reshape(batch, self.num_qo_heads, d))
        return out
