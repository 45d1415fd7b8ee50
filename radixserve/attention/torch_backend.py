"""Paged attention in plain torch: the CPU production path and the reference for flashinfer.

Per step, ``prepare`` turns the page table into gather indices once (``torch_plans``); per
layer, ``forward`` writes the new K/V into the pool and then
- runs each prefill span's attention on its own: one ``scaled_dot_product_attention``
  (bottom-right causal mask when the span continues a cached prefix; its own K/V and
  ``is_causal`` when it does not) in fp32, and in bf16/fp16 where the CPU has AMX (the fused
  kernel's GEMMs then run on the tiles: ~2x the blocked path); query blocks with bf16/fp16
  matmuls on other CPUs (``causal_blocks``: there SDPA was ~1.5x slower), and
- batches all single-token decodes: their K/V are gathered head-major into a padded
  ``[B, Hkv, max_kv, D]`` scratch buffer (decodes sorted by length, in cache-sized chunks)
  and attended with two batched matmuls per chunk and an fp32 softmax, the GQA group folded
  into the query dimension so no K/V head is repeated (the fused kernel is slower at these
  3-row queries). A lone decode (one stream) whose window lies in a few runs of
  consecutive slots skips the gather: its matmuls read the pool's strided views in place,
  one pair per run (``torch_plans.slot_runs``; ~1.26x less CPU per batch-1 step). Runs are
  found in slot order (``lone_decode_runs``): one unmasked query does not care about its
  keys' order, and a served stream's pages come from the allocator in descending ids.

Cascade (shared-prefix) attention, on by default: the radix cache hands one system prompt's
pages to every request using it, so many sequences of a step start with the same page ids.
``prepare`` groups them (``cascade.find_cascade_groups``); per layer, each group's shared
prefix is gathered once and attended by all its members' new queries in one large matmul,
while each member attends separately to the rest of its context (positions shared..kv_len,
causal); the two partial results merge exactly through their log-sum-exps
(``partial_attention``). This replaces per-sequence gathers of the same pages (decodes) and
many small masked SDPA calls over the same prefix (prefills) with one gather and one efficient
matmul per group. Group prefixes and member prefills' rests are both "queries against one
K/V window" and run padded together in window chunks; member decodes keep the decode path,
over their shorter windows, returning the lse as well. Spans in no group are unaffected.
Sliding-window layers (``layer_windows``): a query at position p attends to positions
(p - W, p]. Per step, each distinct W gets its own plan when some query sees further back
than W (banded masks for prefills, windows [kv_len - W, kv_len) for decodes, no cascade:
a shared prefix mostly lies outside the window); otherwise those layers use the full plan.
Window chunks run torch's fused flash kernel (``flash_attend_with_lse``, which returns the
lse itself) where the CPU has AMX, and matmuls + softmax (``attend_with_lse``) elsewhere.
Attention logit soft-capping (``logits_soft_cap``, Gemma 2): prefills attend with explicit
matmuls (``soft_cap``), decodes cap their scores before the mask, and the cascade and fused
paths (which have no soft-cap) are off.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.attention import torch_plans as plans
from radixserve.attention.backend import AttentionBackend
from radixserve.attention.cascade import CascadeGroup, find_cascade_groups
from radixserve.attention.causal_blocks import causal_attention_blocked
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.partial_attention import (DEFAULT_MAX_SCORE_ELEMS, attend_with_lse,
                                                    flash_attend_with_lse,
                                                    merge_attention_states, softmax_with_lse)
from radixserve.attention.soft_cap import capped_attention, soft_cap_
from radixserve.attention.torch_plans import StepTables, TorchPlan, Window
from radixserve.attention.workspace import Workspace
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.kv_quant import can_fold, gather_decoded, gather_folded
from radixserve.attention.quant_decode import folded_decode_attention

# Upper bound on one decode chunk's gathered K (and again V), in elements: 1M elements is
# 2 MiB per tensor in bf16, so a chunk's K and V stay cache-resident between the gather and
# SDPA. Measured at 64 decodes x ~1,100 tokens (9/3 heads, D 64, bf16, one thread): 17.6 ms
# per layer with 1M-element chunks vs 22.7 ms with one 32M-element chunk. fp32 keeps it;
# bf16/fp16 chunks gather twice as much (below).
DEFAULT_MAX_GATHER_ELEMS = 2**20
# bf16/fp16 chunks (create_backend picks), twice that: 64 decodes' private windows then go
# in one chunk and 8 groups' shared prefixes in one call. Decode step at batch 64 1.13x
# faster on AMX (the fused kernel: 24 work items, even across 2 threads, against calls of
# 15 and 9); on AVX512-BF16 without AMX (matmuls) bench_engine 1.08x cache on, 1.04x off
# (docs/benchmarks.md, "Larger chunks").
DEFAULT_MAX_GATHER_ELEMS_LOW_PRECISION = 2**21

# Groups sharing fewer tokens than this are not worth a separate pass (and its merge).
DEFAULT_MIN_SHARED_TOKENS = 64


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN then runs bf16 GEMMs on them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def probs_times_values(probs: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """probs [..., keys] @ the values concatenated along keys (a list of [..., n, D] runs),
    without concatenating them: one matmul per run, summed."""
    if len(values) == 1:
        return torch.matmul(probs, values[0])
    out, start = None, 0
    for v in values:
        part = torch.matmul(probs[..., start:start + v.shape[-2]], v)
        out = part if out is None else out.add_(part)
        start += v.shape[-2]
    return out


__all__ = ["DEFAULT_MAX_GATHER_ELEMS", "DEFAULT_MAX_GATHER_ELEMS_LOW_PRECISION",
           "DEFAULT_MIN_SHARED_TOKENS", "TorchAttentionBackend", "TorchPlan"]


class TorchAttentionBackend(AttentionBackend[TorchPlan]):
    name = "torch"

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 sm_scale: float | None = None,
                 max_gather_elems: int = DEFAULT_MAX_GATHER_ELEMS, cascade: bool = True,
                 cascade_prefills: bool = True,
                 min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS,
                 max_score_elems: int = DEFAULT_MAX_SCORE_ELEMS,
                 sdpa_low_precision: bool | None = None,
                 layer_windows: Sequence[int | None] | None = None,
                 logits_soft_cap: float | None = None) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_qo_heads // num_kv_heads
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        self.max_gather_rows = max(1, max_gather_elems // head_dim)
        self.cascade = cascade                  # False: the plain per-sequence paths only
        # False: only decodes join shared-prefix groups. For bf16/fp16 prefills the blocked
        # per-span path is faster than the cascade one on CPU (scripts/bench_attention.py).
        self.cascade_prefills = cascade_prefills
        self.min_shared_tokens = min_shared_tokens
        self.max_score_elems = max_score_elems
        # bf16/fp16 prefills: torch's fused SDPA kernel where its GEMMs run on AMX (~2x the
        # blocked path's speed there), the blocked path elsewhere (where SDPA was ~1.5x slower).
        self.sdpa_low_precision = (cpu_has_amx() if sdpa_low_precision is None
                                   else sdpa_low_precision)
        # Gather scratch reused across layers and steps: a fresh multi-MB buffer per layer
        # costs page faults comparable to the attention itself. Steps run one at a time.
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ws = Workspace()                  # the cascade path's temporaries, likewise
        # Per layer: its sliding window (None: full attention); None: every layer full.
        self.layer_windows = tuple(layer_windows) if layer_windows is not None else None
        self._windows = sorted({w for w in self.layer_windows or () if w is not None})
        # Attention logits -> cap * tanh(logits / cap) (None: uncapped). Only the explicit
        # matmul paths can apply it: no cascade merge, no fused kernel.
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        if self.logits_soft_cap is not None:
            self.cascade = False
            self.sdpa_low_precision = False

    def _fused(self, dtype: torch.dtype) -> bool:
        """Whether attention in `dtype` goes through torch's fused flash kernel (fp32 prefills
        use SDPA regardless; this is the bf16/fp16 choice)."""
        return self.sdpa_low_precision and dtype != torch.float32

    # ---------------------------------------------------------------- per step
    def prepare(self, meta: AttentionMetadata) -> TorchPlan:
        t = StepTables.of(meta)
        longest = int(t.kv_lens.max()) if len(t.kv_lens) else 0
        full_used = (not self._windows or None in self.layer_windows
                     or longest <= self._windows[0])
        plan = self._full_plan(meta, t) if full_used else TorchPlan(meta)
        for w in self._windows:
            plan.by_window[w] = plan if longest <= w else self._sliding_plan(meta, t, w)
        for p in {id(p): p for p in (plan, *plan.by_window.values())}.values():
            p.lone = plans.lone_decode(p)
        return plan

    def _sliding_plan(self, meta: AttentionMetadata, t: StepTables, window: int) -> TorchPlan:
        hkv = self.num_kv_heads
        return TorchPlan(
            meta, prefills=[plans.sliding_prefill_plan(t, b, hkv, window)
                            for b in range(meta.num_prefills)],
            decodes=plans.sliding_decode_chunks(t, meta.num_prefills, hkv, window,
                                                self.max_gather_rows))

    def _full_plan(self, meta: AttentionMetadata, t: StepTables) -> TorchPlan:
        hkv = self.num_kv_heads
        groups = self._find_groups(t) if self.cascade else []
        # Where each sequence's own attention window starts: after its group's shared prefix.
        kv_start = np.zeros(meta.batch_size, dtype=np.int64)
        for g in groups:
            kv_start[list(g.members)] = g.shared_tokens
        prefills = np.arange(meta.num_prefills)
        in_group = kv_start[prefills] > 0
        plan = TorchPlan(
            meta, cascade_groups=groups,
            prefills=[plans.prefill_plan(t, int(b), hkv) for b in prefills[~in_group]],
            rests=self._window_chunks(t, [self._rest_window(t, int(b), int(kv_start[b]))
                                          for b in prefills[in_group]]),
            shared=self._window_chunks(t, [self._shared_window(t, g) for g in groups]))
        if meta.num_decodes:
            first = meta.num_prefills
            windows = t.kv_lens - kv_start
            order = first + np.argsort(windows[first:], kind="stable")
            plan.decodes = [
                plans.decode_chunk(t, chunk, kv_start, hkv)
                for chunk in plans.chunk_by_budget(order, windows * hkv, self.max_gather_rows)]
        return plan

    def _find_groups(self, t: StepTables) -> list[CascadeGroup]:
        pages = [t.pages(b) for b in range(len(t.kv_lens))]
        cached = t.kv_lens - t.new_lens
        if not self.cascade_prefills:
            cached = np.where(t.new_lens > 1, 0, cached)    # no shareable prefix: not grouped
        return find_cascade_groups(pages, cached, t.page_size, self.min_shared_tokens)

    @staticmethod
    def _rest_window(t: StepTables, b: int, kv_start: int) -> Window:
        """A member prefill's new tokens against its context after the shared prefix."""
        tokens = np.arange(t.qo_indptr[b], t.qo_indptr[b + 1])
        return Window(tokens, b, kv_start, int(t.kv_lens[b]), causal=True)

    @staticmethod
    def _shared_window(t: StepTables, g: CascadeGroup) -> Window:
        """All members' new tokens against the shared pages (read through the first member)."""
        tokens = np.concatenate([np.arange(t.qo_indptr[m], t.qo_indptr[m + 1])
                                 for m in g.members])
        return Window(tokens, g.members[0], 0, g.shared_tokens, causal=False)

    def _window_chunks(self, t: StepTables, windows: list[Window]) -> list[plans.WindowChunk]:
        return plans.window_chunks(t, windows, self.num_kv_heads, self.group,
                                   self.max_gather_rows)

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

    def _gather(self, kv_pool: KVPool, layer: int, rows: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V rows (one head of one token each) into the scratch: [len(rows), D]; an
        8-bit side comes back decoded to ``dtype`` (kv_quant)."""
        if kv_pool.quantized:
            return tuple(gather_decoded(*kv_pool.side(name, layer), rows, dtype, self._ws,
                                        f"gather.{name}") for name in "kv")
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

    def forward(self, plan: TorchPlan, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        window = self.layer_windows[layer] if self.layer_windows is not None else None
        if window is not None:
            plan = plan.by_window[window]
        if plan.lone is not None and not kv_pool.quantized:
            return self._lone_decode(plan, layer, q, k, v, kv_pool)
        # Quantized sides come back as their stored codes decode: what later steps read.
        # Only prefills without a cached prefix use them; all other paths read the pool.
        own_kv = any(p.rows is None for p in plan.prefills)
        used = kv_pool.write(layer, plan.meta.write_slots, k, v, decoded=own_kv)
        if used is not None:
            k, v = used
        out = torch.empty_like(q)
        # Cascade members' log-sum-exps over their own windows, for the merge.
        lse = q.new_empty(q.shape[:2], dtype=torch.float32) if plan.shared else None
        for p in plan.prefills:
            self._prefill(p, layer, q, k, v, kv_pool, out)
        for c in plan.decodes:
            self._decode(c, layer, q, kv_pool, out, lse)
        for c in plan.rests:
            o, o_lse = self._attend_windows(c, layer, q, kv_pool)
            out.index_copy_(0, c.dst, o)
            lse.index_copy_(0, c.dst, o_lse)
        for c in plan.shared:
            self._merge_shared(c, layer, q, kv_pool, out, lse)
        return out

    def _prefill(self, p: plans.PrefillPlan, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, kv_pool: KVPool, out: torch.Tensor) -> None:
        hkv, d, dt = self.num_kv_heads, self.head_dim, q.dtype
        if p.rows is None:                                      # [Hkv, n, D]: its own K/V
            ks, vs = k[p.start:p.end].transpose(0, 1), v[p.start:p.end].transpose(0, 1)
        else:                                                   # [Hkv, kv_len, D] from pages
            kb, vb = self._gather(kv_pool, layer, p.rows, dt)
            ks, vs = kb.view(hkv, -1, d), vb.view(hkv, -1, d)
        ks, vs = ks.to(dt), vs.to(dt)
        if self.logits_soft_cap is not None:
            out[p.start:p.end] = capped_attention(q[p.start:p.end], ks, vs, self.sm_scale,
                                                  self.logits_soft_cap,
                                                  plans.additive(p.mask, torch.float32))
            return
        if dt != torch.float32 and not self._fused(dt) and not p.banded:
            # bf16/fp16 without AMX: matmuls at the low-precision rate (SDPA ran ~1.5x slower).
            causal_attention_blocked(q[p.start:p.end], ks, vs, self.sm_scale, out[p.start:p.end])
            return
        o = F.scaled_dot_product_attention(
            q[p.start:p.end].transpose(0, 1)[None], ks[None], vs[None],
            attn_mask=plans.additive(p.mask, dt), is_causal=p.mask is None,
            scale=self.sm_scale, enable_gqa=self.group > 1)
        out[p.start:p.end] = o[0].transpose(0, 1)

    def _decode(self, c: plans.DecodeChunk, layer: int, q: torch.Tensor, kv_pool: KVPool,
                out: torch.Tensor, lse: torch.Tensor | None) -> None:
        hkv, d, dt = self.num_kv_heads, self.head_dim, q.dtype
        # Fold the GQA group into the query dim: q head h = kv_head * group + g.
        qd = q.index_select(0, c.tokens).view(c.batch, hkv, self.group, d)
        if (kv_pool.quantized and self.logits_soft_cap is None
                and can_fold(dt, (kv_pool.k_codec, kv_pool.v_codec))):
            self._decode_quantized(c, layer, qd, kv_pool, out, lse)
            return
        if c.runs is not None and not kv_pool.quantized:   # a lone decode: K/V read in place
            kd, vd = self._run_views(kv_pool, layer, c.runs, dt)
        else:
            kb, vb = self._gather(kv_pool, layer, c.rows, dt)
            kd = [kb.view(c.batch, hkv, c.max_kv, d).to(dt)]
            vd = [vb.view(c.batch, hkv, c.max_kv, d).to(dt)]
        scores = self._scores(qd, kd)
        if c.with_lse:
            # fp32 scores (the scale applied in the same pass): the lse must be exact.
            scores = (torch.mul(scores, self.sm_scale, out=self._ws.take(
                "decode.scores32", scores.shape, torch.float32, scores.device))
                if c.mask is None else
                torch.add(c.mask.additive(torch.float32), scores, alpha=self.sm_scale))
            probs, o_lse = softmax_with_lse(scores)
            lse.index_copy_(0, c.tokens, o_lse.view(c.batch, self.num_qo_heads))
            probs = probs.to(dt)
        else:
            probs = self._softmax_low_precision(scores, c.mask)
        o = probs_times_values(probs, vd)
        out.index_copy_(0, c.tokens, o.reshape(c.batch, self.num_qo_heads, d))

    def _lone_decode(self, plan: TorchPlan, layer: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        """The whole step is one decode reading its K/V in place (one user, one stream):
        the same ops as ``_decode``'s in-place branch without the step's bookkeeping (no
        query gather, no output scatter, no shape checks), the query folded by a view."""
        kv_pool.write(layer, plan.meta.write_slots, k, v, decoded=False)
        qd = q.reshape(1, self.num_kv_heads, self.group, self.head_dim)
        return self._attend_runs(plan.lone.runs, layer, qd, kv_pool).view(q.shape)

    def _attend_runs(self, runs: list[tuple[int, int]], layer: int, qd: torch.Tensor,
                     kv_pool: KVPool) -> torch.Tensor:
        """One decode's query [1, Hkv, group, D] against its K/V read in place from slot
        ``runs`` (no mask: its whole window) -> [1, Hkv, group, D]."""
        kd, vd = self._run_views(kv_pool, layer, runs, qd.dtype)
        return probs_times_values(self._softmax_low_precision(self._scores(qd, kd), None), vd)

    @staticmethod
    def _scores(qd: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
        """Decode queries [b, Hkv, group, D] . keys (runs of [b, Hkv, n, D]) -> [b, Hkv,
        group, keys]. Two batched matmuls around a softmax computed in fp32 inside (the
        numerics of transformers' eager attention): ~2.5x faster than CPU SDPA for 1-row
        queries; this is the first."""
        scores = [torch.matmul(qd, k.transpose(-1, -2)) for k in keys]
        return scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)

    def _run_views(self, kv_pool: KVPool, layer: int, runs: list[tuple[int, int]],
                   dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V of each slot run as [1, Hkv, n, D] views of the pool (no copy)."""
        hkv, d = self.num_kv_heads, self.head_dim
        k_all = kv_pool.k_flat[layer].view(-1, hkv, d)
        v_all = kv_pool.v_flat[layer].view(-1, hkv, d)
        return ([k_all[s:s + n].transpose(0, 1)[None].to(dtype) for s, n in runs],
                [v_all[s:s + n].transpose(0, 1)[None].to(dtype) for s, n in runs])

    def _softmax_low_precision(self, scores: torch.Tensor, mask: plans.Mask | None,
                               ) -> torch.Tensor:
        """softmax(scores * scale + mask) in the scores' dtype. CPU softmax computes in
        fp32 inside and rounds its output once, so this equals the fp32 softmax cast back
        (transformers' eager numerics) without two fp32 copies of the scores. In bf16 the
        scale is exact for power-of-two head dims (64: 1/8), as transformers rounds it."""
        if self.logits_soft_cap is not None:          # transformers: scale, cap, mask
            scores = soft_cap_(scores.mul_(self.sm_scale), self.logits_soft_cap)
            return (scores if mask is None else scores.add_(mask.additive(scores.dtype))
                    ).softmax(-1, dtype=torch.float32).to(scores.dtype)
        if mask is None:
            return scores.mul_(self.sm_scale).softmax(-1)
        return torch.add(mask.additive(scores.dtype), scores, alpha=self.sm_scale).softmax(-1)

    def _decode_quantized(self, c: plans.DecodeChunk, layer: int, qd: torch.Tensor,
                          kv_pool: KVPool, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """_decode over 8-bit KV: scales folded into scores and probabilities (quant_decode)."""
        k, v = (gather_folded(*kv_pool.side(name, layer), c.rows, qd.dtype, self._ws,
                              f"gather.{name}") for name in "kv")
        o, o_lse = folded_decode_attention(qd, k, v, self.sm_scale,
                                           plans.additive(c.mask, torch.float32), c.with_lse)
        if c.with_lse:
            lse.index_copy_(0, c.tokens, o_lse.view(c.batch, self.num_qo_heads))
        out.index_copy_(0, c.tokens, o.reshape(c.batch, self.num_qo_heads, self.head_dim))

    # ------------------------------------------------------- cascade, per layer
    def _fold_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[b, n, Hq, D] -> [b, Hkv, group * n, D]: q head kv * group + g becomes row
        g * n + i of kv head kv, so one matmul per kv head serves its whole GQA group."""
        b, n = x.shape[:2]
        hkv, g = self.num_kv_heads, self.group
        folded = self._ws.take("win.q_folded", (b, hkv, g * n, self.head_dim), x.dtype,
                               x.device)
        folded.view(b, hkv, g, n, -1).copy_(x.unflatten(2, (hkv, g)).permute(0, 2, 3, 1, 4))
        return folded

    def _unfold_heads(self, o: torch.Tensor,
                      lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of _fold_heads for an output [b, Hkv, group*n, D] and its lse
        [b, Hkv, group*n]: contiguous [b * n, Hq, D] and [b * n, Hq]."""
        b, hkv, rows = lse.shape
        g, n, hq = self.group, rows // self.group, self.num_qo_heads
        o_tok = self._ws.take("win.o_tokens", (b * n, hq, o.shape[-1]), o.dtype, o.device)
        lse_tok = self._ws.take("win.lse_tokens", (b * n, hq), lse.dtype, lse.device)
        o_tok.view(b, n, hkv, g, -1).copy_(o.view(b, hkv, g, n, -1).permute(0, 3, 1, 2, 4))
        lse_tok.view(b, n, hkv, g).copy_(lse.view(b, hkv, g, n).permute(0, 3, 1, 2))
        return o_tok, lse_tok

    def _attend_windows(self, c: plans.WindowChunk, layer: int, q: torch.Tensor,
                        kv_pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of a window chunk's queries with lse: [len(c.dst), Hq, D] (workspace
        tensors, valid until the next call) and [len(c.dst), Hq] fp32."""
        hkv, d, dt, dev, ws = self.num_kv_heads, self.head_dim, q.dtype, q.device, self._ws
        qs = ws.take("win.q", (c.batch, c.n_max, self.num_qo_heads, d), dt, dev)
        torch.index_select(q, 0, c.tokens, out=qs.view(-1, self.num_qo_heads, d))
        qh = self._fold_heads(qs)
        kb, vb = self._gather(kv_pool, layer, c.rows, dt)
        kv_shape = (c.batch, hkv, c.w_max, d)
        k_w, v_w = kb.view(kv_shape).to(dt), vb.view(kv_shape).to(dt)
        mask = plans.additive(c.mask, torch.float32)
        if self._fused(dt):
            o, o_lse = flash_attend_with_lse(qh, k_w, v_w, self.sm_scale, mask)
        else:
            o, o_lse = attend_with_lse(
                qh, k_w, v_w, self.sm_scale, mask, out=ws.take("win.o", qh.shape, dt, dev),
                workspace=ws, max_score_elems=self.max_score_elems)
        o, o_lse = self._unfold_heads(o, o_lse)
        if c.keep is None:
            return o, o_lse
        return o.index_select(0, c.keep), o_lse.index_select(0, c.keep)

    def _merge_shared(self, c: plans.WindowChunk, layer: int, q: torch.Tensor,
                      kv_pool: KVPool, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Groups' queries against their shared prefixes, merged into their own parts."""
        o, o_lse = self._attend_windows(c, layer, q, kv_pool)
        dt, dev, ws = q.dtype, q.device, self._ws
        own = torch.index_select(out, 0, c.dst, out=ws.take("shared.own", o.shape, dt, dev))
        merged = merge_attention_states(o, o_lse, own, lse.index_select(0, c.dst),
                                        out=ws.take("shared.merged", o.shape, torch.float32,
                                                    dev))
        if dt != torch.float32:
            merged = ws.take("shared.merged_lp", o.shape, dt, dev).copy_(merged)
        out.index_copy_(0, c.dst, merged)
