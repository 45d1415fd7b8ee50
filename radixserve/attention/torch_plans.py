"""The torch backend's per-step plans: the page table turned into gather rows and masks.

Built once per step by ``TorchAttentionBackend.prepare`` (numpy, no per-token Python loop)
and read by every layer's ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.attention.cascade import CascadeGroup
from radixserve.attention.metadata import AttentionMetadata


class Mask:
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


def additive(mask: Mask | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if mask is None else mask.additive(dtype)


@dataclass(slots=True)
class StepTables:
    """The step's page table as numpy arrays: what the plans are built from."""

    kv_indices: np.ndarray        # int32 page ids, sequences concatenated
    kv_indptr: np.ndarray         # int64 [B+1]
    qo_indptr: np.ndarray         # int64 [B+1]
    kv_lens: np.ndarray           # int64 [B]
    page_size: int
    device: torch.device

    @classmethod
    def of(cls, meta: AttentionMetadata) -> StepTables:
        return cls(kv_indices=meta.kv_indices.cpu().numpy(),
                   kv_indptr=meta.kv_indptr.numpy().astype(np.int64),
                   qo_indptr=meta.qo_indptr.numpy().astype(np.int64),
                   kv_lens=np.asarray(meta.kv_lens, dtype=np.int64),
                   page_size=meta.page_size, device=meta.kv_indices.device)

    @property
    def new_lens(self) -> np.ndarray:
        return np.diff(self.qo_indptr)

    def pages(self, seq: int) -> np.ndarray:
        return self.kv_indices[self.kv_indptr[seq]:self.kv_indptr[seq + 1]]

    def slots(self, seqs: np.ndarray | int, pos: np.ndarray) -> np.ndarray:
        """Pool slot of position ``pos`` of sequence(s) ``seqs`` (broadcasting)."""
        return (self.kv_indices[self.kv_indptr[seqs] + pos // self.page_size]
                .astype(np.int64) * self.page_size + pos % self.page_size)

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)


def head_major_rows(slots: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Rows of the [slots*Hkv, D] pool view laid out as [..., Hkv, len] (head-major)."""
    heads = np.arange(num_kv_heads, dtype=np.int64)[:, None]
    return slots[..., None, :] * num_kv_heads + heads


@dataclass(slots=True)
class PrefillPlan:
    start: int                    # token range [start, end) of this span in the step
    end: int
    rows: torch.Tensor | None     # int64 [Hkv * kv_len] rows of the pool's [slots*Hkv, D]
                                  # view; None: no cached prefix, attend over the inputs
    mask: Mask | None             # [new_len, kv_len], bottom-right causal; None: is_causal
    banded: bool = False          # the mask also cuts a sliding window (not plain causal)


@dataclass(slots=True)
class DecodeChunk:
    tokens: torch.Tensor          # int64 [b]: which of the step's tokens these decodes are
    rows: torch.Tensor            # int64 [b * Hkv * max_kv] gather rows (padding repeats a
                                  #   valid row of the same sequence; masked out)
    mask: Mask | None             # [b, 1, 1, max_kv]; None when no padding
    batch: int
    max_kv: int                   # the longest window (cascade members: after the prefix)
    with_lse: bool = False        # some member is in a cascade group: keep the lse
    # A single decode whose window lies in at most MAX_DECODE_RUNS runs of consecutive
    # slots: (first slot, length) of each, read in place instead of gathered (None: gather)
    runs: list[tuple[int, int]] | None = None


@dataclass(slots=True)
class Window:
    """Queries attending to one K/V window: a cascade group's shared prefix (all members'
    new tokens, no mask) or a member prefill's rest (its new tokens, bottom-right causal)."""

    tokens: np.ndarray            # the step's token ids of the queries
    seq: int                      # the sequence whose pages hold the window
    lo: int                       # window = positions [lo, hi) of that sequence
    hi: int
    causal: bool


@dataclass(slots=True)
class WindowChunk:
    """Windows padded into one batch: b windows x n_max queries x w_max keys. Padding
    repeats a window's last query and last key; the mask and ``keep`` drop it."""

    tokens: torch.Tensor          # int64 [b * n_max]: the step's token of each query row
    keep: torch.Tensor | None     # int64: the real rows of that padded layout (None: all)
    dst: torch.Tensor             # int64: the step's tokens of the real rows, in order
    rows: torch.Tensor            # int64 [b * Hkv * w_max] head-major gather rows
    mask: Mask | None             # [b, 1, group * n_max, w_max] (any causal window), or
                                  #   [b, 1, 1, w_max] (key padding only), or None
    batch: int
    n_max: int
    w_max: int


@dataclass
class TorchPlan:
    """A step's plan for the torch backend: gather rows and masks for every layer."""

    meta: AttentionMetadata
    prefills: list[PrefillPlan] = field(default_factory=list)   # spans in no cascade group
    decodes: list[DecodeChunk] = field(default_factory=list)
    cascade_groups: list[CascadeGroup] = field(default_factory=list)
    rests: list[WindowChunk] = field(default_factory=list)    # member prefills after prefix
    shared: list[WindowChunk] = field(default_factory=list)   # the groups' shared prefixes
    # Sliding window W -> the plan its layers use (this plan itself when no query of the
    # step sees further back than W, so the window changes nothing).
    by_window: dict[int, TorchPlan] = field(default_factory=dict)
    # The step is this one decode, read in place (lone_decode): the backend's short path.
    lone: DecodeChunk | None = None


def lone_decode(plan: TorchPlan) -> DecodeChunk | None:
    """The plan's decode chunk when it is all the step does and reads its K/V in place
    (one sequence in a few slot runs, no cascade merge), else None."""
    if plan.prefills or plan.rests or plan.shared or len(plan.decodes) != 1:
        return None
    c = plan.decodes[0]
    return c if c.runs is not None and not c.with_lse else None


def chunk_by_budget(order: np.ndarray, sizes: np.ndarray, max_rows: int) -> list[np.ndarray]:
    """Split ``order`` (sorted by ascending ``sizes``) so that a chunk's padded size,
    len(chunk) * the largest size in it, stays within ``max_rows`` (one item at least)."""
    chunks, start = [], 0
    for i in range(1, len(order)):
        if (i - start + 1) * sizes[order[i]] > max_rows:
            chunks.append(order[start:i])
            start = i
    chunks.append(order[start:])
    return chunks


def prefill_plan(t: StepTables, b: int, num_kv_heads: int) -> PrefillPlan:
    start, end = int(t.qo_indptr[b]), int(t.qo_indptr[b + 1])
    kv_len, new_len = int(t.kv_lens[b]), end - start
    if kv_len == new_len:
        return PrefillPlan(start, end, None, None)
    rows = head_major_rows(t.slots(b, np.arange(kv_len)), num_kv_heads).reshape(-1)
    mask = torch.ones(new_len, kv_len, dtype=torch.bool, device=t.device)
    mask = mask.tril(kv_len - new_len)     # token i sees positions <= cached + i
    return PrefillPlan(start, end, t.tensor(rows), Mask(mask))


# A lone decode reads its K/V where they lie when its window is this few slot runs: each run
# costs two small matmuls per layer, against a gather copy of the whole window (batch 1,
# 1,090 keys: the scores' matmul over the pool's strided view took half the CPU time of
# gather + matmul). A single stream's window is its prompt's run plus its decode's runs.
MAX_DECODE_RUNS = 4


def slot_runs(slots: np.ndarray, max_runs: int = MAX_DECODE_RUNS,
              ) -> list[tuple[int, int]] | None:
    """``slots`` as (first slot, length) runs of consecutive slots; None past ``max_runs``."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    if len(breaks) >= max_runs:
        return None
    edges = [0, *breaks.tolist(), len(slots)]
    return [(int(slots[a]), b - a) for a, b in zip(edges, edges[1:])]


def decode_chunk(t: StepTables, seqs: np.ndarray, kv_start: np.ndarray,
                 num_kv_heads: int, cascade: bool = True) -> DecodeChunk:
    """Single-token sequences ``seqs`` over their windows [kv_start, kv_len). ``cascade``:
    a start past 0 is a cascade group's shared prefix, so keep the lse for the merge
    (False: it is a sliding window's start, nothing to merge)."""
    starts = kv_start[seqs]
    lens = t.kv_lens[seqs] - starts
    max_kv = int(lens.max())
    pos = np.arange(max_kv, dtype=np.int64)[None, :]
    valid = pos < lens[:, None]
    # Padding re-reads the window's last position: a finite value the mask removes.
    slots = t.slots(seqs[:, None], starts[:, None] + np.minimum(pos, lens[:, None] - 1))
    rows = head_major_rows(slots, num_kv_heads).reshape(-1)
    mask = None if valid.all() else Mask(t.tensor(valid[:, None, None, :]))
    return DecodeChunk(tokens=t.tensor(t.qo_indptr[seqs]), rows=t.tensor(rows), mask=mask,
                       batch=len(seqs), max_kv=max_kv,
                       with_lse=cascade and bool((starts > 0).any()),
                       runs=lone_decode_runs(slots[0]) if len(seqs) == 1 else None)


def lone_decode_runs(slots: np.ndarray) -> list[tuple[int, int]] | None:
    """The runs of a lone decode's window in slot order, not position order: one query
    without a mask attends to a set of keys (softmax and sum do not depend on their order),
    so slots handed out in reverse fit too. The allocator gives a fresh prompt's pages in
    descending ids (its stack pops the lowest id first) and each decoded token the next id
    up, so in position order a served stream was one run per token (the gather path),
    sorted it is one run."""
    return slot_runs(np.sort(slots))


def sliding_prefill_plan(t: StepTables, b: int, num_kv_heads: int,
                         window: int) -> PrefillPlan:
    """A prefill span of a sliding-window layer: token at position p sees positions
    (p - window, p], as transformers' sliding-window causal mask."""
    start, end = int(t.qo_indptr[b]), int(t.qo_indptr[b + 1])
    kv_len, new_len = int(t.kv_lens[b]), end - start
    cached = kv_len - new_len
    if cached == 0 and new_len <= window:
        return PrefillPlan(start, end, None, None)
    lo = max(0, cached - window + 1)            # the first key the first query needs
    q_pos = np.arange(cached, kv_len)[:, None]
    k_pos = np.arange(lo, kv_len)[None, :]
    allowed = t.tensor((k_pos <= q_pos) & (k_pos > q_pos - window))
    rows = None if cached == 0 else t.tensor(
        head_major_rows(t.slots(b, np.arange(lo, kv_len)), num_kv_heads).reshape(-1))
    return PrefillPlan(start, end, rows, Mask(allowed), banded=True)


def sliding_decode_chunks(t: StepTables, first: int, num_kv_heads: int, window: int,
                          max_rows: int) -> list[DecodeChunk]:
    """The step's decodes (sequences ``first``...) over their last ``window`` positions."""
    seqs = np.arange(first, len(t.kv_lens))
    if not len(seqs):
        return []
    kv_start = np.maximum(0, t.kv_lens - window)
    widths = t.kv_lens - kv_start
    order = seqs[np.argsort(widths[seqs], kind="stable")]
    return [decode_chunk(t, chunk, kv_start, num_kv_heads, cascade=False)
            for chunk in chunk_by_budget(order, widths * num_kv_heads, max_rows)]


def window_chunk(t: StepTables, windows: list[Window], num_kv_heads: int,
                 group: int) -> WindowChunk:
    """Pad ``windows`` into one batch (see WindowChunk)."""
    n = np.array([len(w.tokens) for w in windows], dtype=np.int64)
    width = np.array([w.hi - w.lo for w in windows], dtype=np.int64)
    causal = np.array([w.causal for w in windows])
    n_max, w_max = int(n.max()), int(width.max())
    i = np.minimum(np.arange(n_max)[None, :], n[:, None] - 1)             # [b, n_max]
    j = np.arange(w_max)[None, :]
    tokens = np.stack([w.tokens[row] for w, row in zip(windows, i)])
    seqs = np.array([w.seq for w in windows])[:, None]
    lo = np.array([w.lo for w in windows])[:, None]
    slots = t.slots(seqs, lo + np.minimum(j, width[:, None] - 1))
    mask = None
    if causal.any():
        # Query i sees positions <= diag + i (bottom-right causal) and < width.
        diag = np.where(causal, width - n, width)
        allowed = ((j[:, None, :] <= diag[:, None, None] + i[:, :, None])
                   & (j[:, None, :] < width[:, None, None]))             # [b, n_max, w_max]
        # Rows of the folded query layout are (g, i): repeat each window's mask per group.
        folded = np.repeat(allowed[:, None], group, axis=1)
        mask = Mask(t.tensor(folded.reshape(len(windows), 1, group * n_max, w_max)))
    elif (width < w_max).any():                                         # key padding only
        mask = Mask(t.tensor((j < width[:, None])[:, None, None, :]))
    real = np.arange(n_max)[None, :] < n[:, None]
    return WindowChunk(
        tokens=t.tensor(tokens.reshape(-1)),
        keep=None if real.all() else t.tensor(np.flatnonzero(real)),
        dst=t.tensor(tokens[real]), rows=t.tensor(head_major_rows(slots, num_kv_heads)
                                                  .reshape(-1)),
        mask=mask, batch=len(windows), n_max=n_max, w_max=w_max)


def window_chunks(t: StepTables, windows: list[Window], num_kv_heads: int, group: int,
                  max_rows: int, max_waste: float = 2.0) -> list[WindowChunk]:
    """Windows sorted by width (then query count), padded into chunks whose K/V gather fits
    ``max_rows`` and whose padded query x key work is at most ``max_waste`` x the real."""
    if not windows:
        return []
    n = np.array([len(w.tokens) for w in windows], dtype=np.int64)
    width = np.array([w.hi - w.lo for w in windows], dtype=np.int64)
    order = np.lexsort((n, width))
    chunks, start, n_max, real = [], 0, n[order[0]], n[order[0]] * width[order[0]]
    for pos in range(1, len(order)):
        i, count = order[pos], pos - start + 1
        n_max, real = max(n_max, n[i]), real + n[i] * width[i]
        # Sorted by width, so window i sets the chunk's padded width.
        padded = count * n_max * width[i]
        if count * width[i] * num_kv_heads > max_rows or padded > max_waste * real:
            chunks.append(order[start:pos])
            start, n_max, real = pos, n[i], n[i] * width[i]
    chunks.append(order[start:])
    return [window_chunk(t, [windows[i] for i in chunk], num_kv_heads, group)
            for chunk in chunks]
