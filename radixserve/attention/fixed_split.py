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
  ``o = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c``, the sums taken in fp32 one
  chunk at a time, in positional order, so chunks past the query's position (weight exactly
  0) change nothing.

So a query gives the same bits as a decode, in any batch, in any prefill chunk, with its
prefix from the cache or not, at any page size. Decodes sharing a cached prefix (cascade
groups) compute its whole chunks once per group and merge them with their own: the same
chunks, the same per-chunk bits, the same merge (FixedSplitBackend).

Sliding-window layers keep the absolute chunks: a query at position p reads from the chunk
holding p - W + 1 (decodes) or its block's earliest such chunk (prefills), its mask also
cutting keys <= p - W. A chunk wholly outside a query's window weighs exactly 0 in the
merge (its lse is the mask's), and the merge starts from +0, so a query gets the same bits
whichever earlier chunks its batch read. Windowed decodes join no shared-prefix group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.attention import torch_plans as plans
from radixserve.attention.cascade import CascadeGroup
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.row_tiles import ROW_TILE, pad_rows
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.torch_plans import StepTables, head_major_rows

DEFAULT_SPLIT = 256         # keys per chunk: one matmul's reduction length
DEFAULT_QUERY_BLOCK = 128   # prefill queries per block (bounds the score buffer only)


_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                   torch.float32: torch.int32}


def row_max(x: torch.Tensor) -> torch.Tensor:
    """``x.amax(-1)`` of finite floats, exactly, from their bits read as signed integers:
    those order like the floats for values >= 0 and in reverse for values < 0, so the row's
    largest integer is the max when it is >= 0 (some value is), else the smallest integer
    is. CPU's integer reductions are vectorized where its bf16/fp16 ``amax`` is not: ~5x
    faster on the scores and probabilities here."""
    as_int = _SAME_WIDTH_INT.get(x.dtype)
    if as_int is None or x.device.type != "cpu":
        return x.amax(-1)
    bits = x.view(as_int)
    top = bits.amax(-1)
    negative = top < 0                   # every value of the row < 0 (or -0.0)
    if bool(negative.any()):
        top = torch.where(negative, bits.amin(-1), top)
    return top.view(x.dtype)


def chunk_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   hidden: torch.Tensor | None, masked_from: int, split: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's attention on its own. q [b, H, R, D]; k, v [b, H, L, D] with L a
    multiple of ``split``, finite everywhere; hidden: bool, True where a key is masked,
    broadcastable to [b, H, C - masked_from, R, split] for chunks ``masked_from`` .. C - 1
    (the earlier ones are entirely visible to every row; None when all are). Returns o [b, H, C, R, D] in q's dtype and lse [b, H, C, R] in fp32; a row's
    values depend only on that row and its chunk (tests/attention/test_fixed_split.py)."""
    b, h, r, d = q.shape
    chunks = k.shape[2] // split
    kc = k.view(b, h, chunks, split, d)
    # Scores in q's dtype with the scale applied to q first (as causal_blocks does; exact
    # for power-of-two scales such as head_dim 64's).
    scores = _row_invariant_matmul((q * scale).unsqueeze(2), kc.transpose(-1, -2))
    if hidden is not None and masked_from < chunks:
        # Masked scores are set to the lowest finite value, not offset by it: in fp16,
        # score + (-65504) overflows to -inf for any score <= -16, and a chunk of only such
        # keys (a short decode's padding in a batch with a longer one) then gave NaN.
        scores[:, :, masked_from:].masked_fill_(hidden, torch.finfo(scores.dtype).min)
    # Per chunk: softmax (fp32 inside, rounded to q's dtype, as the default path) and its
    # log-sum-exp, lse = max - log(max probability). A fully masked chunk sees only the
    # (finite) mask value: a uniform softmax over finite keys, weighted exactly 0 below.
    probs = torch.softmax(scores, -1)
    lse = row_max(scores).float() - row_max(probs).float().log()     # [b, h, C, R]
    return _row_invariant_matmul(probs, v.view(b, h, chunks, split, d)), lse  # [b, h, C, R, D]


def _row_invariant_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` in a's dtype, each row's bits independent of the other rows
    (a [..., R, K], b [..., K, N]). oneDNN's bf16 kernels are so (checked by the tests on AMX
    and AVX512-BF16 CPUs). fp16 is not on a CPU without fp16 arithmetic (AVX512-BF16 only:
    rare 1-ulp flips by a row's position in the call), nor is fp32 (MKL takes other kernels
    for a few rows): those multiply in fp32 in tiles of exactly ``ROW_TILE`` rows, zero-padded
    (one kernel shape, invariant by construction, as the linears' fixed tiles), and fp16
    rounds the fp32 sums once, as its own kernel does. CPU only; elsewhere a plain matmul
    (deterministic mode on CUDA is flashinfer's)."""
    if a.dtype == torch.bfloat16 or a.device.type != "cpu":
        return torch.matmul(a, b)
    rows = a.shape[-2]
    tiles = -(-rows // ROW_TILE)
    a32 = pad_rows(a.float(), tiles * ROW_TILE)
    out = torch.matmul(a32.unflatten(-2, (tiles, ROW_TILE)), b.float().unsqueeze(-3))
    return out.flatten(-3, -2)[..., :rows, :].to(a.dtype)


def merge_chunks(o: torch.Tensor, lse: torch.Tensor,
                 before: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """chunk_partials' results merged over dim 2 in its order -> [b, H, R, D] in o's dtype:
    fp32 sums taken one chunk at a time, elementwise (so no kernel's reduction order
    enters; 0.15 ms vs 0.73 ms for ``cumsum`` over dim 2 at 64 decodes x 5 chunks, one
    thread: CPU cumsum accumulates in double one element at a time). A chunk with lse -inf
    (and finite o) adds exactly 0, wherever it stands. ``before``: the (o, lse) of chunks
    that precede these, merged first: the same bits as merging their concatenation over
    dim 2 (the max is exact, every other step elementwise), without copying it."""
    parts = [(o, lse)] if before is None else [before, (o, lse)]
    top = lse.amax(2, keepdim=True)
    if before is not None:
        top = torch.maximum(before[1].amax(2, keepdim=True), top)
    # From +0: a leading chunk of weight 0 (outside a sliding window) then adds +0 or -0,
    # which leaves +0, as if the chunk had not been read.
    num = o.new_zeros(o.shape[:2] + o.shape[3:], dtype=torch.float32)
    den = lse.new_zeros(lse.shape[:2] + lse.shape[3:])
    for part_o, part_lse in parts:
        w = torch.exp(part_lse - top)
        weighted = part_o.float() * w[..., None]
        for c in range(part_o.shape[2]):
            num += weighted[:, :, c]
            den += w[:, :, c]
    return (num / den[..., None]).to(o.dtype)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    hidden: torch.Tensor | None, masked_from: int, split: int,
                    scale: float) -> torch.Tensor:
    """Attention of q over k/v in chunks (arguments: chunk_partials; every row sees key 0).
    Returns [b, H, R, D] in q's dtype (order: module doc)."""
    return merge_chunks(*chunk_partials(q, k, v, hidden, masked_from, split, scale))


class ChunkMask:
    """Which keys of chunks ``first`` .. C - 1 each row may not see (``hidden``, bool, in
    split_attention's layout [b, 1, C - first, R, split]); chunks before ``first`` are
    visible to every row. One mask for every dtype: chunk_partials sets the hidden scores to
    the dtype's lowest finite value (no -inf: a chunk with no visible key must not give NaN;
    its weight is exactly 0 anyway)."""

    __slots__ = ("first", "hidden")

    def __init__(self, allowed: np.ndarray, split: int, t: StepTables) -> None:
        b, r, width = allowed.shape                          # allowed [b, R, L]
        folded = allowed.reshape(b, r, width // split, split).transpose(0, 2, 1, 3)
        whole = folded.all(axis=(0, 2, 3))                   # [C]
        self.first = len(whole) if whole.all() else int(np.argmin(whole))
        self.hidden = t.tensor(~folded[:, self.first:][:, None])


def _padded(n: int, split: int) -> int:
    return -(-n // split) * split


@dataclass(slots=True)
class PrefillBlock:
    start: int                 # the step's tokens [start, end) of one span
    end: int
    keys: int                  # keys this block reads end at: a multiple of split
    mask: ChunkMask            # rows: group * (end - start)
    first_key: int = 0         # ...and start at (a multiple of split; > 0: windowed)


@dataclass(slots=True)
class SplitPrefill:
    rows: torch.Tensor         # int64 [Hkv * (keys - first_key)] gather rows (head-major)
    keys: int                  # padded kv_len
    blocks: list[PrefillBlock]
    first_key: int = 0         # the first position gathered (the earliest block's)


@dataclass(slots=True)
class SplitDecodes:
    tokens: torch.Tensor       # int64 [b]
    decodes: torch.Tensor      # int64 [b]: their indices among the step's decodes
    rows: torch.Tensor         # int64 [b * Hkv * keys]: positions [own_start, +keys)
    keys: int
    mask: ChunkMask            # rows: 1 (broadcast over the group)


@dataclass(slots=True)
class SharedChunks:
    """Chunks [first, first + chunks) of the shared prefixes of ``groups`` decode groups (the
    same number of whole chunks each), read once for all their members and computed in one
    call, batched over the groups (every member's query sees all of them: no mask). Members
    are laid out [groups, members]; a group with fewer members repeats its first one's
    query (rows are independent; those results are dropped)."""

    tokens: torch.Tensor       # int64 [groups * members]: the members' tokens, padded
    real: torch.Tensor         # int64 [n]: positions of the real members in that layout
    decodes: torch.Tensor      # int64 [n]: their indices among the step's decodes
    rows: torch.Tensor         # int64 [groups * Hkv * chunks * split] gather rows
    groups: int
    members: int               # members per group in the layout (the most of any)
    sizes: tuple[int, ...]     # each group's real members (``decodes`` in that order)
    first: int
    chunks: int


@dataclass
class FixedSplitPlan:
    meta: AttentionMetadata
    prefills: list[SplitPrefill] = field(default_factory=list)
    decodes: list[SplitDecodes] = field(default_factory=list)
    shared: list[SharedChunks] = field(default_factory=list)
    shared_chunks: int = 0     # the most shared chunks of any decode (0: no groups)
    # Sliding window W -> the plan its layers use (this plan when no query sees past W).
    by_window: dict[int, FixedSplitPlan] = field(default_factory=dict)


class FixedSplitBackend(TorchAttentionBackend):
    """The torch backend's gathers and KV pool handling, with ``split_attention``'s chunks for
    every sequence (prefills one span at a time in query blocks, decodes batched).

    Decodes whose sequences share whole chunks of cached pages (the default backend's cascade
    groups, ``cascade.find_cascade_groups``, cut down to a multiple of ``split``) compute
    those chunks once for the group, all members' query rows in one matmul per chunk, and
    their own chunks as usual; each query then merges its chunks in positional order. The
    per-chunk results do not depend on which other rows are computed with them, so this
    gives the same bits as computing every decode alone (``group_decodes=False``)."""

    name = "torch-fixed-split"

    def __init__(self, *, split: int = DEFAULT_SPLIT, query_block: int = DEFAULT_QUERY_BLOCK,
                 group_decodes: bool = True, **kw) -> None:
        super().__init__(cascade=False, cascade_prefills=False, min_shared_tokens=split, **kw)
        self.split = split
        self.query_block = query_block
        self.group_decodes = group_decodes

    def _slot_rows(self, t: StepTables, seqs: np.ndarray, keys: int,
                   start: np.ndarray | int = 0) -> np.ndarray:
        """Head-major gather rows of positions [start, start + keys) of ``seqs``; positions
        past a sequence's end re-read its last one (finite, masked out)."""
        pos = np.minimum(np.arange(keys)[None, :] + np.reshape(start, (-1, 1)),
                         t.kv_lens[seqs][:, None] - 1)
        return head_major_rows(t.slots(seqs[:, None], pos), self.num_kv_heads)

    def prepare(self, meta: AttentionMetadata) -> FixedSplitPlan:
        t = StepTables.of(meta)
        plan = self._full_split_plan(meta, t)
        longest = int(t.kv_lens.max()) if len(t.kv_lens) else 0
        for w in self._windows:
            # Inside the window every key is visible and read from chunk 0 either way.
            plan.by_window[w] = plan if longest <= w else self._windowed_plan(meta, t, w)
        return plan

    def _windowed_plan(self, meta: AttentionMetadata, t: StepTables,
                       window: int) -> FixedSplitPlan:
        """Each query's chunks from the one holding its first visible key, masked to its
        window (positions p - W < key <= p); decodes ungrouped."""
        plan = FixedSplitPlan(meta)
        for b in range(meta.num_prefills):
            plan.prefills.append(self._prefill_plan(t, b, window))
        first = meta.num_prefills
        if meta.num_decodes:
            seqs = np.arange(first, meta.batch_size)
            lens = t.kv_lens[seqs]
            own_start = np.maximum(lens - window, 0) // self.split * self.split
            keys = np.array([_padded(int(n), self.split) for n in lens - own_start])
            order = np.argsort(keys, kind="stable")
            for chunk in plans.chunk_by_budget(order, keys * self.num_kv_heads,
                                               self.max_gather_rows):
                width = int(keys[chunk].max())
                pos = own_start[chunk][:, None, None] + np.arange(width)[None, None, :]
                n = lens[chunk][:, None, None]
                allowed = (pos < n) & (pos >= n - window)
                plan.decodes.append(SplitDecodes(
                    tokens=t.tensor(t.qo_indptr[seqs[chunk]]), decodes=t.tensor(chunk),
                    rows=t.tensor(self._slot_rows(t, seqs[chunk], width, own_start[chunk])
                                  .reshape(-1)),
                    keys=width, mask=ChunkMask(allowed, self.split, t)))
        return plan

    def _full_split_plan(self, meta: AttentionMetadata, t: StepTables) -> FixedSplitPlan:
        plan = FixedSplitPlan(meta)
        for b in range(meta.num_prefills):
            plan.prefills.append(self._prefill_plan(t, b))
        if meta.num_decodes:
            first = meta.num_prefills
            own_start = np.zeros(meta.batch_size, dtype=np.int64)
            if self.group_decodes:
                groups = self._find_groups(t)      # decodes only (cascade_prefills=False)
                for g in groups:
                    own_start[list(g.members)] = g.shared_tokens // self.split * self.split
                plan.shared = self._shared_plans(t, groups, first)
                plan.shared_chunks = int(own_start.max()) // self.split
            keys = np.array([_padded(int(n), self.split) for n in t.kv_lens - own_start])
            order = first + np.argsort(keys[first:], kind="stable")
            for chunk in plans.chunk_by_budget(order, keys * self.num_kv_heads,
                                               self.max_gather_rows):
                width = int(keys[chunk].max())
                pos = own_start[chunk][:, None, None] + np.arange(width)[None, None, :]
                allowed = pos < t.kv_lens[chunk][:, None, None]
                plan.decodes.append(SplitDecodes(
                    tokens=t.tensor(t.qo_indptr[chunk]), decodes=t.tensor(chunk - first),
                    rows=t.tensor(self._slot_rows(t, chunk, width, own_start[chunk])
                                  .reshape(-1)),
                    keys=width, mask=ChunkMask(allowed, self.split, t)))
        return plan

    def _shared_plans(self, t: StepTables, groups: list[CascadeGroup],
                      first_decode: int) -> list[SharedChunks]:
        """The groups' whole shared chunks (each read through its first member's pages):
        groups with the same number of whole chunks batched into one call, in calls whose
        gather fits the budget (fewer groups, then fewer chunks, per call). The shared
        tokens precede every member's query, so no chunk needs a mask."""
        by_chunks: dict[int, list[CascadeGroup]] = {}
        for g in groups:
            by_chunks.setdefault(g.shared_tokens // self.split, []).append(g)
        chunk_rows = self.num_kv_heads * self.split
        out = []
        for chunks, same in sorted(by_chunks.items()):
            per_call = max(1, self.max_gather_rows // (chunk_rows * chunks))
            for i in range(0, len(same), per_call):
                batch = same[i:i + per_call]
                per_slice = max(1, self.max_gather_rows // (chunk_rows * len(batch)))
                for c0 in range(0, chunks, per_slice):
                    out.append(self._shared_call(t, batch, c0, min(chunks, c0 + per_slice),
                                                 first_decode))
        return out

    def _shared_call(self, t: StepTables, batch: list[CascadeGroup], c0: int, c1: int,
                     first_decode: int) -> SharedChunks:
        """One call over chunks [c0, c1) of ``batch``'s groups, members padded (SharedChunks)."""
        members = [np.array(g.members) for g in batch]
        width = max(len(m) for m in members)
        padded = np.stack([np.concatenate([m, np.repeat(m[:1], width - len(m))])
                           for m in members])                       # [groups, width]
        real = np.concatenate([i * width + np.arange(len(m)) for i, m in enumerate(members)])
        leaders = np.array([m[0] for m in members])
        rows = self._slot_rows(t, leaders, (c1 - c0) * self.split, c0 * self.split)
        return SharedChunks(
            tokens=t.tensor(t.qo_indptr[padded.reshape(-1)]), real=t.tensor(real),
            decodes=t.tensor(np.concatenate(members) - first_decode),
            rows=t.tensor(rows.reshape(-1)), groups=len(batch), members=width,
            sizes=tuple(len(m) for m in members), first=c0, chunks=c1 - c0)

    def _prefill_plan(self, t: StepTables, b: int, window: int | None = None) -> SplitPrefill:
        start, end = int(t.qo_indptr[b]), int(t.qo_indptr[b + 1])
        kv_len = int(t.kv_lens[b])
        cached = kv_len - (end - start)
        keys = _padded(kv_len, self.split)
        blocks = []
        for s in range(start, end, self.query_block):
            e = min(end, s + self.query_block)
            pos = cached + np.arange(s - start, e - start)              # absolute positions
            width = _padded(int(pos[-1]) + 1, self.split)
            lo = 0 if window is None else max(int(pos[0]) + 1 - window, 0) // self.split \
                * self.split
            key_pos = np.arange(lo, width)[None, :]
            allowed = key_pos <= pos[:, None]                            # [r, width - lo]
            if window is not None:
                allowed &= key_pos > pos[:, None] - window
            folded = np.tile(allowed, (self.group, 1))                  # rows (g, i)
            blocks.append(PrefillBlock(s, e, width, ChunkMask(folded[None], self.split, t),
                                       lo))
        first_key = blocks[0].first_key
        rows = self._slot_rows(t, np.array([b]), keys - first_key, first_key).reshape(-1)
        return SplitPrefill(t.tensor(rows), keys, blocks, first_key)

    def forward(self, plan: FixedSplitPlan, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        window = self.layer_windows[layer] if self.layer_windows is not None else None
        if window is not None:
            plan = plan.by_window[window]
        kv_pool.write(layer, plan.meta.write_slots, k, v)
        out = torch.empty_like(q)
        hkv, g, d, dt = self.num_kv_heads, self.group, self.head_dim, q.dtype
        for p in plan.prefills:
            kb, vb = self._gather(kv_pool, layer, p.rows, dt)
            width = p.keys - p.first_key
            ks, vs = kb.view(1, hkv, width, d).to(dt), vb.view(1, hkv, width, d).to(dt)
            for blk in p.blocks:
                n = blk.end - blk.start
                qh = q[blk.start:blk.end].view(n, hkv, g, d).permute(1, 2, 0, 3)
                span = slice(blk.first_key - p.first_key, blk.keys - p.first_key)
                o = split_attention(qh.reshape(1, hkv, g * n, d), ks[:, :, span],
                                    vs[:, :, span], blk.mask.hidden, blk.mask.first,
                                    self.split, self.sm_scale)
                out[blk.start:blk.end].view(n, hkv, g, d).copy_(
                    o.view(hkv, g, n, d).permute(2, 0, 1, 3))
        shared = self._shared_partials(plan, layer, q, kv_pool) if plan.shared else None
        for c in plan.decodes:
            batch = c.tokens.shape[0]
            qd = q.index_select(0, c.tokens).view(batch, hkv, g, d)
            kb, vb = self._gather(kv_pool, layer, c.rows, dt)
            o, lse = chunk_partials(qd, kb.view(batch, hkv, c.keys, d).to(dt),
                                    vb.view(batch, hkv, c.keys, d).to(dt), c.mask.hidden,
                                    c.mask.first, self.split, self.sm_scale)
            before = None               # the shared chunks come first: positional order
            if shared is not None:
                before = (shared[0].index_select(0, c.decodes),
                          shared[1].index_select(0, c.decodes))
            out.index_copy_(0, c.tokens, merge_chunks(o, lse, before).reshape(batch, -1, d))
        return out

    def _shared_partials(self, plan: FixedSplitPlan, layer: int, q: torch.Tensor,
                         kv_pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decode's shared chunks' (o, lse), [decodes, Hkv, shared_chunks, group, D]
        and [..., group]: computed once per group; a decode in no group (or sharing fewer
        chunks) gets o 0 and lse -inf there, which the merge weighs exactly 0."""
        hkv, g, d, dt = self.num_kv_heads, self.group, self.head_dim, q.dtype
        n, cs = plan.meta.num_decodes, plan.shared_chunks
        o_all = q.new_zeros(n, hkv, cs, g, d)
        lse_all = q.new_full((n, hkv, cs, g), float("-inf"), dtype=torch.float32)
        for s in plan.shared:
            gs, m, keys = s.groups, s.members, s.chunks * self.split
            # Each group's member rows against its chunks, all groups in one call: row
            # (member, g) of batch entry (group).
            qg = q.index_select(0, s.tokens).view(gs, m, hkv, g, d).transpose(1, 2)
            kb, vb = self._gather(kv_pool, layer, s.rows, dt)
            o, lse = chunk_partials(qg.reshape(gs, hkv, m * g, d),
                                    kb.view(gs, hkv, keys, d).to(dt),
                                    vb.view(gs, hkv, keys, d).to(dt), None, s.chunks,
                                    self.split, self.sm_scale)
            o = o.view(gs, hkv, s.chunks, m, g, d).permute(0, 3, 1, 2, 4, 5)
            lse = lse.view(gs, hkv, s.chunks, m, g).permute(0, 3, 1, 2, 4)
            span = slice(s.first, s.first + s.chunks)
            o_all[s.decodes, :, span] = o.reshape(gs * m, hkv, s.chunks, g, d)[s.real]
            lse_all[s.decodes, :, span] = lse.reshape(gs * m, hkv, s.chunks, g)[s.real]
        return o_all, lse_all
