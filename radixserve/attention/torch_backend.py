"""Paged attention in plain torch: the CPU production path and the reference for flashinfer.

Per step, ``prepare`` turns the page table into gather indices once; per layer, ``forward``
writes the new K/V into the pool and then
- runs one ``scaled_dot_product_attention`` per prefill span (bottom-right causal mask when
  the span continues a cached prefix; its own K/V and ``is_causal`` when it does not), and
- batches all single-token decodes: their K/V are gathered head-major into a padded
  ``[B, Hkv, max_kv, D]`` scratch buffer (decodes sorted by length, in cache-sized chunks)
  and attended with two batched matmuls per chunk and an fp32 softmax, the GQA group folded
  into the query dimension so no K/V head is repeated.

Cascade (shared-prefix) attention, on by default: sequences whose page arrays start with the
same page ids (the radix cache hands one system prompt's pages to every request using it) are
grouped once per step (``cascade.find_cascade_groups``). Per layer, a group gathers its shared
prefix's K/V once and attends all its members' new queries to it in one large matmul; each
member attends separately to the rest of its context (positions shared..kv_len, causal), and
the two partial results are merged through their log-sum-exps (``partial_attention``). This
replaces per-sequence gathers of the same pages (decode) and many small masked SDPA calls over
the same prefix (prefill) with one gather and one efficient matmul per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.attention.backend import AttentionBackend
from radixserve.attention.cascade import CascadeGroup, find_cascade_groups
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.workspace import Workspace
from radixserve.attention.partial_attention import (DEFAULT_MAX_SCORE_ELEMS, attend_with_lse,
                                                    merge_attention_states, softmax_with_lse)
from radixserve.cache.kv_pool import KVPool

# Upper bound on one decode chunk's gathered K (and again V), in elements: 1M elements is
# 2 MiB per tensor in bf16, so a chunk's K and V stay cache-resident between the gather and
# SDPA. Measured at 64 decodes x ~1,100 tokens (9/3 heads, D 64, bf16, one thread): 17.6 ms
# per layer with 1M-element chunks vs 22.7 ms with one 32M-element chunk.
DEFAULT_MAX_GATHER_ELEMS = 2**20

# Groups sharing fewer tokens than this are not worth a separate pass (and its merge).
DEFAULT_MIN_SHARED_TOKENS = 64


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
class _RestChunk:
    """Cascade members' prefill queries against their own windows (the context after the
    group's shared prefix), padded into one batch: b sequences x n_max queries x w_max keys.
    Padding repeats a sequence's last query / last key; the mask and ``keep`` drop it."""

    tokens: torch.Tensor          # int64 [b * n_max]: the step's token of each query row
    keep: torch.Tensor            # int64: the real rows of that padded layout ...
    dst: torch.Tensor             # int64: ... and their tokens in the step
    rows: torch.Tensor            # int64 [b * Hkv * w_max] head-major gather rows
    mask: _Mask                   # [b, 1, group * n_max, w_max], GQA group folded in rows
    batch: int
    n_max: int
    w_max: int
@dataclass(slots=True)
class _DecodeChunk:
    tokens: torch.Tensor          # int64 [b]: which of the step's tokens these decodes are
    rows: torch.Tensor            # int64 [b * Hkv * max_kv] gather rows (padding repeats a
                                  #   valid row of the same sequence; masked out)
    mask: _Mask | None            # [b, 1, 1, max_kv]; None when no padding
    batch: int
    max_kv: int                   # the longest window (cascade members: after the prefix)
    with_lse: bool = False        # some member is in a cascade group: keep the lse


@dataclass(slots=True)
class _GroupPlan:
    group: CascadeGroup
    tokens: torch.Tensor          # int64: the step's tokens of every member, in member order
    rows: torch.Tensor            # int64 [Hkv * shared_tokens] head-major gather rows


@dataclass
class TorchPrepared:
    meta: AttentionMetadata
    prefills: list[_PrefillPlan] = field(default_factory=list)   # not in a cascade group
    rests: list[_RestChunk] = field(default_factory=list)        # prefills in a group
    decodes: list[_DecodeChunk] = field(default_factory=list)
    groups: list[_GroupPlan] = field(default_factory=list)

    @property
    def cascade_groups(self) -> list[CascadeGroup]:
        return [g.group for g in self.groups]


@dataclass(slots=True)
class _StepTables:
    """The step's page table as numpy arrays: what ``prepare`` builds its plans from."""

    kv_indices: np.ndarray        # int32 page ids, sequences concatenated
    kv_indptr: np.ndarray         # int64 [B+1]
    qo_indptr: np.ndarray         # int64 [B+1]
    kv_lens: np.ndarray           # int64 [B]
    page_size: int
    device: torch.device

    @classmethod
    def of(cls, meta: AttentionMetadata) -> _StepTables:
        return cls(kv_indices=meta.kv_indices.cpu().numpy(),
                   kv_indptr=meta.kv_indptr.numpy().astype(np.int64),
                   qo_indptr=meta.qo_indptr.numpy().astype(np.int64),
                   kv_lens=np.asarray(meta.kv_lens, dtype=np.int64),
                   page_size=meta.page_size, device=meta.kv_indices.device)


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
                 max_gather_elems: int = DEFAULT_MAX_GATHER_ELEMS, cascade: bool = True,
                 min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS,
                 max_score_elems: int = DEFAULT_MAX_SCORE_ELEMS) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_qo_heads // num_kv_heads
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        self.max_gather_rows = max(1, max_gather_elems // head_dim)
        self.cascade = cascade
        self.min_shared_tokens = min_shared_tokens
        self.max_score_elems = max_score_elems
        # Gather scratch reused across layers and steps: a fresh multi-MB buffer per layer
        # costs page faults comparable to the attention itself. Steps run one at a time.
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ws = Workspace()       # the cascade path's temporaries, likewise reused

    # ---------------------------------------------------------------- per step
    def prepare(self, meta: AttentionMetadata) -> TorchPrepared:
        t = _StepTables.of(meta)
        prepared = TorchPrepared(meta)
        groups = self._find_groups(t) if self.cascade else []
        # Where each sequence's own attention window starts: after its group's shared prefix.
        kv_start = np.zeros(meta.batch_size, dtype=np.int64)
        for g in groups:
            kv_start[list(g.members)] = g.shared_tokens
        prepared.groups = [self._group_plan(g, t) for g in groups]
        windows = t.kv_lens - kv_start
        prefills = np.arange(meta.num_prefills)
        prepared.prefills = [self._prefill_plan(int(b), t) for b in prefills[kv_start[prefills] == 0]]
        members = prefills[kv_start[prefills] > 0]
        if len(members):
            order = members[np.argsort(windows[members], kind="stable")]
            prepared.rests = [self._rest_chunk(chunk, kv_start, t)
                              for chunk in self._chunk_by_budget(order, windows)]
        if meta.num_decodes:
            first = meta.num_prefills
            order = first + np.argsort(windows[first:], kind="stable")
            prepared.decodes = [self._decode_chunk(chunk, kv_start, t)
                                for chunk in self._chunk_by_budget(order, windows)]
        return prepared

    def _find_groups(self, t: _StepTables) -> list[CascadeGroup]:
        pages = [t.kv_indices[t.kv_indptr[b]:t.kv_indptr[b + 1]] for b in range(len(t.kv_lens))]
        cached = t.kv_lens - np.diff(t.qo_indptr)
        return find_cascade_groups(pages, cached, t.page_size, self.min_shared_tokens)

    def _rows(self, t: _StepTables, seq: int, lo: int, hi: int) -> torch.Tensor:
        """Head-major gather rows of positions [lo, hi) of sequence ``seq``."""
        slots = _slots(t.kv_indices, t.kv_indptr[seq], np.arange(lo, hi), t.page_size)
        return torch.from_numpy(_head_major_rows(slots, self.num_kv_heads).reshape(-1)) \
            .to(t.device)

    def _group_plan(self, g: CascadeGroup, t: _StepTables) -> _GroupPlan:
        tokens = np.concatenate([np.arange(t.qo_indptr[m], t.qo_indptr[m + 1])
                                 for m in g.members])
        return _GroupPlan(g, torch.from_numpy(tokens).to(t.device),
                          self._rows(t, g.members[0], 0, g.shared_tokens))

    def _prefill_plan(self, b: int, t: _StepTables) -> _PrefillPlan:
        start, end = int(t.qo_indptr[b]), int(t.qo_indptr[b + 1])
        kv_len, new_len = int(t.kv_lens[b]), end - start
        if kv_len == new_len:
            return _PrefillPlan(start, end, None, None)
        mask = torch.ones(new_len, kv_len, dtype=torch.bool, device=t.device)
        mask = mask.tril(kv_len - new_len)     # token i sees positions <= cached + i
        return _PrefillPlan(start, end, self._rows(t, b, 0, kv_len), _Mask(mask))

    def _rest_chunk(self, seqs: np.ndarray, kv_start: np.ndarray,
                    t: _StepTables) -> _RestChunk:
        new = np.diff(t.qo_indptr)[seqs]
        win = t.kv_lens[seqs] - kv_start[seqs]
        n_max, w_max = int(new.max()), int(win.max())
        i = np.minimum(np.arange(n_max)[None, :], new[:, None] - 1)       # [b, n_max]
        j = np.arange(w_max)[None, None, :]
        # Query i sees window positions <= (win - new) + i (bottom-right causal), < win.
        allowed = (j <= (win - new)[:, None, None] + i[:, :, None]) & (j < win[:, None, None])
        allowed = np.broadcast_to(allowed[:, None, None], (len(seqs), 1, self.group) +
                                  allowed.shape[1:]).reshape(len(seqs), 1, -1, w_max)
        tokens = t.qo_indptr[seqs][:, None] + i
        real = np.arange(n_max)[None, :] < new[:, None]
        slots = _slots(t.kv_indices, t.kv_indptr[seqs][:, None],
                       kv_start[seqs][:, None] + np.minimum(j[0], win[:, None] - 1),
                       t.page_size)
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(t.device)  # noqa: E731
        return _RestChunk(
            tokens=as_tensor(tokens.reshape(-1)), keep=as_tensor(np.flatnonzero(real)),
            dst=as_tensor(tokens[real]),
            rows=as_tensor(_head_major_rows(slots, self.num_kv_heads).reshape(-1)),
            mask=_Mask(as_tensor(allowed)), batch=len(seqs), n_max=n_max, w_max=w_max)

    def _chunk_by_budget(self, order: np.ndarray, windows: np.ndarray) -> list[np.ndarray]:
        """Split window-sorted decodes so each chunk's padded gather fits the budget."""
        chunks, start = [], 0
        for i in range(1, len(order)):
            # Sorted ascending, so adding decode i pads the chunk to its length.
            if (i - start + 1) * windows[order[i]] * self.num_kv_heads > self.max_gather_rows:
                chunks.append(order[start:i])
                start = i
        chunks.append(order[start:])
        return chunks

    def _decode_chunk(self, seqs: np.ndarray, kv_start: np.ndarray,
                      t: _StepTables) -> _DecodeChunk:
        starts = kv_start[seqs]
        lens = t.kv_lens[seqs] - starts
        max_kv = int(lens.max())
        pos = np.arange(max_kv, dtype=np.int64)[None, :]
        valid = pos < lens[:, None]
        # Padding re-reads the window's last position: a finite value the mask removes.
        slots = _slots(t.kv_indices, t.kv_indptr[seqs][:, None],
                       starts[:, None] + np.minimum(pos, lens[:, None] - 1), t.page_size)
        rows = _head_major_rows(slots, self.num_kv_heads).reshape(-1)
        mask = None
        if not valid.all():
            mask = _Mask(torch.from_numpy(valid[:, None, None, :]).to(t.device))
        return _DecodeChunk(tokens=torch.from_numpy(t.qo_indptr[seqs]).to(t.device),
                            rows=torch.from_numpy(rows).to(t.device), mask=mask,
                            batch=len(seqs), max_kv=max_kv, with_lse=bool((starts > 0).any()))

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

    def _fold_heads(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """[b, n, Hq, D] -> [b, Hkv, group * n, D] (a workspace tensor): q head kv * group + g
        becomes row g * n + i of kv head kv, so one matmul per kv head serves its group."""
        b, n = x.shape[:2]
        hkv, g = self.num_kv_heads, self.group
        folded = self._ws.take(name, (b, hkv, g * n, self.head_dim), x.dtype, x.device)
        folded.view(b, hkv, g, n, -1).copy_(x.unflatten(2, (hkv, g)).permute(0, 2, 3, 1, 4))
        return folded

    def _unfold_heads(self, o: torch.Tensor, lse: torch.Tensor, o_into: torch.Tensor,
                      lse_into: torch.Tensor) -> None:
        """The inverse of _fold_heads for an output [b, Hkv, group*n, D] and its lse
        [b, Hkv, group*n], written into contiguous [b, n, Hq, D] and [b, n, Hq] tensors."""
        b, hkv, rows = lse.shape
        g = self.group
        n = rows // g
        o_into.view(b, n, hkv, g, -1).copy_(o.view(b, hkv, g, n, -1).permute(0, 3, 1, 2, 4))
        lse_into.view(b, n, hkv, g).copy_(lse.view(b, hkv, g, n).permute(0, 3, 1, 2))

    def forward(self, prepared: TorchPrepared, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        kv_pool.write(layer, prepared.meta.write_slots, k, v)
        out = torch.empty_like(q)
        # Cascade members' log-sum-exps over their own windows, for the merge.
        lse = q.new_empty(q.shape[:2], dtype=torch.float32) if prepared.groups else None
        for p in prepared.prefills:
            self._prefill(p, layer, q, k, v, kv_pool, out)
        for r in prepared.rests:
            self._rest(r, layer, q, kv_pool, out, lse)
        for c in prepared.decodes:
            self._decode(c, layer, q, kv_pool, out, lse)
        for g in prepared.groups:
            self._shared_prefix(g, layer, q, kv_pool, out, lse)
        return out

    def _prefill(self, p: _PrefillPlan, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, kv_pool: KVPool, out: torch.Tensor) -> None:
        hkv, d, dt = self.num_kv_heads, self.head_dim, q.dtype
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

    def _rest(self, r: _RestChunk, layer: int, q: torch.Tensor, kv_pool: KVPool,
              out: torch.Tensor, lse: torch.Tensor) -> None:
        """Cascade members' prefill over their windows after the shared prefix, with lse."""
        hkv, d, dt, dev, ws = self.num_kv_heads, self.head_dim, q.dtype, q.device, self._ws
        padded = (r.batch, r.n_max, self.num_qo_heads, d)
        qs = ws.take("rest.q", padded, dt, dev)
        torch.index_select(q, 0, r.tokens, out=qs.view(-1, self.num_qo_heads, d))
        qh = self._fold_heads(qs, "rest.q_folded")
        kb, vb = self._gather(kv_pool, layer, r.rows)
        o, o_lse = attend_with_lse(
            qh, kb.view(r.batch, hkv, r.w_max, d).to(dt), vb.view(r.batch, hkv, r.w_max, d).to(dt),
            self.sm_scale, r.mask.additive(torch.float32),
            out=ws.take("rest.o", qh.shape, dt, dev), workspace=ws,
            max_score_elems=self.max_score_elems)
        o_tok = ws.take("rest.o_tokens", padded, dt, dev)
        lse_tok = ws.take("rest.lse_tokens", padded[:3], torch.float32, dev)
        self._unfold_heads(o, o_lse, o_tok, lse_tok)
        out.index_copy_(0, r.dst, o_tok.view(-1, self.num_qo_heads, d).index_select(0, r.keep))
        lse.index_copy_(0, r.dst, lse_tok.view(-1, self.num_qo_heads).index_select(0, r.keep))

    def _decode(self, c: _DecodeChunk, layer: int, q: torch.Tensor, kv_pool: KVPool,
                out: torch.Tensor, lse: torch.Tensor | None) -> None:
        hkv, d, dt = self.num_kv_heads, self.head_dim, q.dtype
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
        if c.with_lse:
            probs, o_lse = softmax_with_lse(scores)
            lse.index_copy_(0, c.tokens, o_lse.view(c.batch, self.num_qo_heads))
        else:
            probs = scores.softmax(-1)
        o = torch.matmul(probs.to(dt), vd)
        out.index_copy_(0, c.tokens, o.reshape(c.batch, self.num_qo_heads, d))

    def _shared_prefix(self, g: _GroupPlan, layer: int, q: torch.Tensor, kv_pool: KVPool,
                       out: torch.Tensor, lse: torch.Tensor) -> None:
        """All of a group's queries against its shared prefix at once, merged into out."""
        hkv, d, dt, dev, ws = self.num_kv_heads, self.head_dim, q.dtype, q.device, self._ws
        n = g.tokens.shape[0]
        mine = (n, self.num_qo_heads, d)
        qs = torch.index_select(q, 0, g.tokens, out=ws.take("shared.q", mine, dt, dev))
        qh = self._fold_heads(qs[None], "shared.q_folded")[0]
        kb, vb = self._gather(kv_pool, layer, g.rows)
        o, o_lse = attend_with_lse(qh, kb.view(hkv, -1, d).to(dt), vb.view(hkv, -1, d).to(dt),
                                   self.sm_scale, out=ws.take("shared.o", qh.shape, dt, dev),
                                   workspace=ws, max_score_elems=self.max_score_elems)
        o_tok = ws.take("shared.o_tokens", mine, dt, dev)
        lse_tok = ws.take("shared.lse_tokens", mine[:2], torch.float32, dev)
        self._unfold_heads(o[None], o_lse[None], o_tok[None], lse_tok[None])
        rest = torch.index_select(out, 0, g.tokens, out=ws.take("shared.rest", mine, dt, dev))
        merged = merge_attention_states(o_tok, lse_tok, rest, lse.index_select(0, g.tokens),
                                        out=ws.take("shared.merged", mine, torch.float32, dev))
        if dt != torch.float32:
            merged = ws.take("shared.merged_lp", mine, dt, dev).copy_(merged)
        out.index_copy_(0, g.tokens, merged)
