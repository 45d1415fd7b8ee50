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
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.torch_plans import StepTables, head_major_rows

DEFAULT_SPLIT = 256         # keys per chunk: one matmul's reduction length
DEFAULT_QUERY_BLOCK = 128   # prefill queries per block (bounds the score buffer only)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    split: int, scale: float) -> torch.Tensor:
    """q [b, H, R, D]; k, v [b, H, L, D] with L a multiple of ``split``, finite everywhere;
    mask: additive fp32 (0 / -inf) broadcastable to [b, H, R, L], every row seeing key 0.
    Returns [b, H, R, D] in q's dtype (see module doc for the order of operations)."""
    b, h, r, d = q.shape
    chunks = k.shape[2] // split
    scores = torch.matmul(q, k.transpose(-1, -2))                     # [b, h, r, L]
    s = torch.add(mask, scores, alpha=scale).view(b, h, r, chunks, split)
    m = s.amax(-1)                                                    # [b, h, r, C]
    p = torch.exp(s - m.clamp(min=torch.finfo(torch.float32).min)[..., None])
    l = p.sum(-1)
    pv = torch.matmul(p.to(q.dtype).transpose(2, 3),                  # [b, h, C, r, S]
                      v.view(b, h, chunks, split, v.shape[-1]))       # -> [b, h, C, r, D]
    w = torch.exp(m - m.amax(-1, keepdim=True))                       # [b, h, r, C]
    num = (pv.float() * w.transpose(2, 3)[..., None]).cumsum(2)[:, :, -1]
    den = (l * w).cumsum(-1)[..., -1:]
    return (num / den).to(q.dtype)


@dataclass(slots=True)
class PrefillBlock:
    start: int                 # the step's tokens [start, end) of one span
    end: int
    keys: int                  # keys this block reads: a multiple of split
    mask: torch.Tensor         # fp32 additive [1, 1, group * (end - start), keys]


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
    mask: torch.Tensor         # fp32 additive [b, 1, 1, keys]


@dataclass
class FixedSplitPlan:
    meta: AttentionMetadata
    prefills: list[SplitPrefill] = field(default_factory=list)
    decodes: list[SplitDecodes] = field(default_factory=list)


def _padded(n: int, split: int) -> int:
    return -(-n // split) * split


def _additive(allowed: np.ndarray, t: StepTables) -> torch.Tensor:
    m = np.where(allowed, np.float32(0), np.float32(-np.inf))
    return t.tensor(m)


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
                allowed = np.arange(width)[None, :] < t.kv_lens[chunk][:, None]
                plan.decodes.append(SplitDecodes(
                    tokens=t.tensor(t.qo_indptr[chunk]),
                    rows=t.tensor(self._slot_rows(t, chunk, width).reshape(-1)), keys=width,
                    mask=_additive(allowed[:, None, None, :], t)))
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
            blocks.append(PrefillBlock(s, e, width, _additive(folded[None, None], t)))
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
                                    vs[:, :, :blk.keys], blk.mask, self.split, self.sm_scale)
                out[blk.start:blk.end].view(n, hkv, g, d).copy_(
                    o.view(hkv, g, n, d).permute(2, 0, 1, 3))
        for c in plan.decodes:
            batch = c.tokens.shape[0]
            qd = q.index_select(0, c.tokens).view(batch, hkv, g, d)
            kb, vb = self._gather(kv_pool, layer, c.rows, dt)
            o = split_attention(qd, kb.view(batch, hkv, c.keys, d).to(dt),
                                vb.view(batch, hkv, c.keys, d).to(dt), c.mask, self.split,
                                self.sm_scale)
            out.index_copy_(0, c.tokens, o.reshape(batch, self.num_qo_heads, d))
        return out
