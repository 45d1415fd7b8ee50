"""Paged attention in plain torch: the CPU production path and the reference for flashinfer.

Per step, ``prepare`` turns the page table into gather indices once; per layer, ``forward``
writes the new K/V into the pool and then
- runs one ``scaled_dot_product_attention`` per prefill span (bottom-right causal mask when
  the span continues a cached prefix; its own K/V and ``is_causal`` when it does not), and
- batches all single-token decodes: their K/V are gathered head-major into a padded
  ``[B, Hkv, max_kv, D]`` scratch buffer (decodes sorted by length, in cache-sized chunks)
  and attended with two batched matmuls per chunk and an fp32 softmax, the GQA group folded
  into the query dimension so no K/V head is repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.attention.backend import AttentionBackend
from radixserve.attention.metadata import AttentionMetadata
from radixserve.cache.kv_pool import KVPool

# Upper bound on one decode chunk's gathered K (and again V), in elements: 1M elements is
# 2 MiB per tensor in bf16, so a chunk's K and V stay cache-resident between the gather and
# SDPA. Measured at 64 decodes x ~1,100 tokens (9/3 heads, D 64, bf16, one thread): 17.6 ms
# per layer with 1M-element chunks vs 22.7 ms with one 32M-element chunk.
DEFAULT_MAX_GATHER_ELEMS = 2**20


class _Mask:
    """A boolean attention mask, converted once per dtype to the additive form SDPA uses.

    SDPA converts a bool mask with torch.where on every call; doing it once per step instead
    of once per layer saves real time on CPU (bf16 broadcasting ``where`` is slow there).
    """

    __slots__ = ("allowed", "_additive")

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed
        self._additive: dict[torch.dtype, torch.Tensor] = {}

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        m = self._additive.get(dtype)
        if m is None:
            m = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            m.masked_fill_(~self.allowed, float("-inf"))
            self._additive[dtype] = m
        return m


def _additive(mask: _Mask | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if mask is None else mask.additive(dtype)


@dataclass(slots=True)
class _PrefillPlan:
    start: int                    # token range [start, end) of this span in the step
    end: int
    rows: torch.Tensor | None     # int64 [Hkv * kv_len] rows of the pool's [slots*Hkv, D]
                                  # view; None: no cached prefix, attend over the inputs
    mask: _Mask | None            # [new_len, kv_len], bottom-right causal; None: is_causal


@dataclass(slots=True)
class _DecodeChunk:
    tokens: torch.Tensor          # int64 [b]: which of the step's tokens these decodes are
    rows: torch.Tensor            # int64 [b * Hkv * max_kv] gather rows (padding repeats a
                                  #   valid row of the same sequence; masked out)
    mask: _Mask | None            # [b, 1, 1, max_kv]; None when no padding
    batch: int
    max_kv: int


@dataclass
class TorchPrepared:
    meta: AttentionMetadata
    prefills: list[_PrefillPlan] = field(default_factory=list)
    decodes: list[_DecodeChunk] = field(default_factory=list)


def _slots(kv_indices: np.ndarray, page_start: np.ndarray, pos: np.ndarray,
           page_size: int) -> np.ndarray:
    """Pool slot of position ``pos`` of the sequence whose pages start at ``page_start``."""
    return kv_indices[page_start + pos // page_size].astype(np.int64) * page_size + pos % page_size


def _head_major_rows(slots: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Rows of the [slots*Hkv, D] pool view laid out as [..., Hkv, len] (head-major)."""
    heads = np.arange(num_kv_heads, dtype=np.int64)[:, None]
    return slots[..., None, :] * num_kv_heads + heads


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 sm_scale: float | None = None,
                 max_gather_elems: int = DEFAULT_MAX_GATHER_ELEMS) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_qo_heads // num_kv_heads
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        self.max_gather_rows = max(1, max_gather_elems // head_dim)
        # Gather scratch reused across layers and steps: a fresh multi-MB buffer per layer
        # costs page faults comparable to the attention itself. Steps run one at a time.
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---------------------------------------------------------------- per step
    def prepare(self, meta: AttentionMetadata) -> TorchPrepared:
        device = meta.kv_indices.device
        kv_indices = meta.kv_indices.cpu().numpy()
        kv_indptr = meta.kv_indptr.numpy().astype(np.int64)
        qo_indptr = meta.qo_indptr.numpy().astype(np.int64)
        kv_lens = np.asarray(meta.kv_lens, dtype=np.int64)
        ps, hkv = meta.page_size, self.num_kv_heads
        prepared = TorchPrepared(meta)

        for b in range(meta.num_prefills):
            start, end = int(qo_indptr[b]), int(qo_indptr[b + 1])
            kv_len, new_len = int(kv_lens[b]), end - start
            if kv_len == new_len:
                prepared.prefills.append(_PrefillPlan(start, end, None, None))
                continue
            slots = _slots(kv_indices, kv_indptr[b], np.arange(kv_len), ps)
            rows = torch.from_numpy(_head_major_rows(slots, hkv).reshape(-1)).to(device)
            mask = torch.ones(new_len, kv_len, dtype=torch.bool, device=device)
            mask = mask.tril(kv_len - new_len)     # token i sees positions <= cached + i
            prepared.prefills.append(_PrefillPlan(start, end, rows, _Mask(mask)))

        if meta.num_decodes:
            first = meta.num_prefills
            order = first + np.argsort(kv_lens[first:], kind="stable")
            for chunk in self._chunk_by_budget(order, kv_lens):
                prepared.decodes.append(
                    self._decode_chunk(chunk, kv_lens, kv_indptr, qo_indptr, kv_indices, ps,
                                       device))
        return prepared

    def _chunk_by_budget(self, order: np.ndarray, kv_lens: np.ndarray) -> list[np.ndarray]:
        """Split length-sorted decodes so each chunk's padded gather fits the budget."""
        chunks, start = [], 0
        for i in range(1, len(order)):
            # Sorted ascending, so adding decode i pads the chunk to its length.
            if (i - start + 1) * kv_lens[order[i]] * self.num_kv_heads > self.max_gather_rows:
                chunks.append(order[start:i])
                start = i
        chunks.append(order[start:])
        return chunks

    def _decode_chunk(self, seqs: np.ndarray, kv_lens: np.ndarray, kv_indptr: np.ndarray,
                      qo_indptr: np.ndarray, kv_indices: np.ndarray, page_size: int,
                      device: torch.device) -> _DecodeChunk:
        lens = kv_lens[seqs]
        max_kv = int(lens.max())
        pos = np.arange(max_kv, dtype=np.int64)[None, :]
        valid = pos < lens[:, None]
        # Padding re-reads the sequence's last position: a finite value the mask removes.
        slots = _slots(kv_indices, kv_indptr[seqs][:, None],
                       np.minimum(pos, lens[:, None] - 1), page_size)
        rows = _head_major_rows(slots, self.num_kv_heads).reshape(-1)
        mask = None
        if not valid.all():
            mask = _Mask(torch.from_numpy(valid[:, None, None, :]).to(device))
        return _DecodeChunk(tokens=torch.from_numpy(qo_indptr[seqs]).to(device),
                            rows=torch.from_numpy(rows).to(device), mask=mask,
                            batch=len(seqs), max_kv=max_kv)

    # ---------------------------------------------------------------- per layer
    def _buffers(self, rows: int, width: int,
                 like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._scratch
        if s is None or s[0].shape[0] < rows or s[0].shape[1] != width \
                or s[0].dtype != like.dtype or s[0].device != like.device:
            shape = (max(rows, s[0].shape[0] if s is not None else 0), width)
            s = (torch.empty(shape, dtype=like.dtype, device=like.device),
                 torch.empty(shape, dtype=like.dtype, device=like.device))
            self._scratch = s
        return s[0][:rows], s[1][:rows]

    def _gather(self, kv_pool: KVPool, layer: int,
                rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V rows (one head of one token each) into the scratch: [len(rows), D]."""
        kh = kv_pool.k_flat[layer].view(-1, self.head_dim)
        vh = kv_pool.v_flat[layer].view(-1, self.head_dim)
        dtype = kh.dtype
        if (self.head_dim * kh.element_size()) % 8 == 0:
            # Same bytes, moved as int64 words: index_select's int64 path is ~1.5x faster on
            # CPU than its bf16 one for these 128-byte rows.
            kh, vh = kh.view(torch.int64), vh.view(torch.int64)
        kb, vb = self._buffers(rows.shape[0], kh.shape[1], kh)
        torch.index_select(kh, 0, rows, out=kb)
        torch.index_select(vh, 0, rows, out=vb)
        return kb.view(dtype), vb.view(dtype)

    def forward(self, prepared: TorchPrepared, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        meta = prepared.meta
        kv_pool.write(layer, meta.write_slots, k, v)
        out = torch.empty_like(q)
        hkv, d, dt = self.num_kv_heads, self.head_dim, q.dtype

        for p in prepared.prefills:
            qs = q[p.start:p.end].transpose(0, 1)[None]            # [1, Hq, n, D]
            if p.rows is None:
                ks = k[p.start:p.end].transpose(0, 1)[None].to(dt)  # [1, Hkv, n, D]
                vs = v[p.start:p.end].transpose(0, 1)[None].to(dt)
            else:
                kb, vb = self._gather(kv_pool, layer, p.rows)
                ks = kb.view(1, hkv, -1, d).to(dt)
                vs = vb.view(1, hkv, -1, d).to(dt)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=_additive(p.mask, dt), is_causal=p.mask is None,
                scale=self.sm_scale, enable_gqa=self.group > 1)
            out[p.start:p.end] = o[0].transpose(0, 1)

        for c in prepared.decodes:
            # Fold the GQA group into the query dim: q head h = kv_head * group + g.
            qd = q.index_select(0, c.tokens).view(c.batch, hkv, self.group, d)
            kb, vb = self._gather(kv_pool, layer, c.rows)
            kd = kb.view(c.batch, hkv, c.max_kv, d).to(dt)
            vd = vb.view(c.batch, hkv, c.max_kv, d).to(dt)
            # Two batched matmuls with the softmax in fp32 (the numerics of transformers'
            # eager attention): ~2.5x faster than CPU SDPA for these 1-row queries.
            scores = torch.matmul(qd, kd.transpose(-1, -2)).float()
            if c.mask is None:
                scores.mul_(self.sm_scale)
            else:
                scores = torch.add(c.mask.additive(torch.float32), scores, alpha=self.sm_scale)
            o = torch.matmul(scores.softmax(-1).to(dt), vd)
            out.index_copy_(0, c.tokens, o.reshape(c.batch, self.num_qo_heads, d))
        return out
