"""Paged attention on CUDA with flashinfer's batch prefill and decode kernels.

Written against flashinfer's documented Python API (docs.flashinfer.ai, "flashinfer.prefill"
and "flashinfer.decode" pages, and the wrappers' ``plan``/``run`` docstrings in
flashinfer/prefill.py and flashinfer/decode.py):

- ``BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD")``;
  ``.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
  num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=..., sm_scale=...,
  q_data_type=..., kv_data_type=...)``; ``.run(q, (k_cache, v_cache))``. ``causal`` defaults
  to False there, so it is always passed; the causal mask is aligned bottom-right, which is
  what a chunk continuing a cached prefix needs.
- ``BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD",
  use_tensor_cores=...)``; ``.plan(indptr, indices, last_page_len, num_qo_heads,
  num_kv_heads, head_dim, page_size, sm_scale=..., q_data_type=..., kv_data_type=...)``;
  ``.run(q, (k_cache, v_cache))``. Optional plan arguments go by keyword (positional use
  after page_size is deprecated upstream).

Plan once per step in ``prepare`` (prefill wrapper on spans [0, num_prefills), decode wrapper
on the rest), run once per layer. indptr / last_page_len arrive on pinned CPU memory and the
page indices on the GPU, so ``plan`` copies asynchronously and does not synchronize.

Deterministic mode (``deterministic=True``, docs/deterministic.md). What each call reaches,
read in flashinfer 0.6.18's source (prefill.py ``plan``; utils.py
``determine_attention_backend``; include/flashinfer/attention/scheduler.cuh
``PrefillSplitQOKVIndptr``; include/flashinfer/utils.cuh ``FA2DetermineCtaTileQ``):

- the prefill wrapper's default ``backend="auto"`` picks FA3 on sm90 (Hopper), and FA3 ignores
  ``fixed_split_size`` (only the ``fa2`` branch of ``plan`` passes it on). So the wrappers are
  built with ``backend="fa2"``: a fixed KV split (``fixed_split_size`` pages, merged in a
  fixed order; "batch-size invariant outputs", the plan docstring) on every architecture;
- FA2's query tile (16, 64 or 128 rows) follows the *plan's average* packed query length
  (new tokens x GQA group): <= 16, <= 64, more. flashinfer offers no argument to fix it
  (``uniform_q_len`` is hard-coded to 0 in Python and only read in CUDA-graph mode), and a
  16-row tile splits KV over 4 warps and merges them, so the order of a sum can change with
  the tile. Spans are therefore planned in three groups by their *own* packed length, one
  prefill wrapper each: the mean of a group stays in its members' class, so a span's tile
  depends on its own length, never on the rest of the batch;
- every sequence, decodes included, goes through a prefill wrapper, so a decode computes
  like a one-token chunk.

So on CUDA a query's output does not depend on the batch; it can depend on the length class
of the chunk that computes it (a decode vs a long chunk). scripts/gpu_check.py's
``deterministic`` section measures both.

Sliding windows (``layer_windows``): layers are grouped into window classes (full attention,
and one class per distinct window W). Each class has its own wrappers, planned per step with
its own ``window_left = W - 1`` (a plan fixes one window), and a layer runs its class's
wrappers: Gemma 3's local and global layers each get one plan per step, as SGLang's
sliding-window wrappers do. Gemma 2's attention logit soft-cap goes to every ``plan`` as
``logits_soft_cap`` (flashinfer: ``cap * tanh(x / cap)`` on the scaled logits).

flashinfer is imported lazily, on the first ``prepare``: CPU machines never import it.
The pure functions ``prefill_plan_call`` / ``decode_plan_call`` compute exactly what is
handed to ``plan`` so that it is tested without CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from radixserve.attention.backend import AttentionBackend
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.kv_pool import KVPool

WORKSPACE_BYTES = 128 * 2**20
FP8_KV_SCALE = 1.0      # uncalibrated per-tensor scale, as vLLM's and SGLang's default
DETERMINISTIC_SPLIT_TOKENS = 2048   # deterministic mode: KV split size (in tokens)
# Deterministic mode: FA3 (what "auto" picks on Hopper) ignores fixed_split_size.
DETERMINISTIC_PREFILL_BACKEND = "fa2"
# FA2's query-tile classes by packed query length (FA2DetermineCtaTileQ): <=16, <=64, more.
QUERY_TILE_BOUNDS = (16, 64)


def use_tensor_cores_for(num_qo_heads: int, num_kv_heads: int) -> bool:
    """Decode on tensor cores when the GQA group is 4 or more (flashinfer's advice: the
    CUDA-core decode kernel wastes most of its work on large groups)."""
    return num_qo_heads // num_kv_heads >= 4


@dataclass(frozen=True)
class PlanCall:
    """The positional and keyword arguments for one wrapper's ``plan``."""

    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)

    def apply(self, wrapper: Any) -> None:
        wrapper.plan(*self.args, **self.kwargs)


def _keep_pinned(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A freshly computed CPU tensor, pinned when its source was (so plan() stays async)."""
    return t.pin_memory() if like.is_pinned() else t


def fixed_split_pages(page_size: int) -> int:
    """flashinfer's ``fixed_split_size`` (in pages) for deterministic mode."""
    return max(1, DETERMINISTIC_SPLIT_TOKENS // page_size)


def prefill_plan_call(meta: AttentionMetadata, *, num_qo_heads: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, sm_scale: float | None,
                      kv_dtype: torch.dtype | None = None,
                      window_left: int = -1,
                      logits_soft_cap: float | None = None) -> PlanCall | None:
    """plan() arguments for the prefill spans [0, num_prefills), or None when there are none.

    The prefill spans come first, so their CSR slices start at 0 and need no rebasing.
    """
    p = meta.num_prefills
    if p == 0:
        return None
    nnz = int(meta.kv_indptr[p])
    kwargs = dict(causal=True, sm_scale=sm_scale, q_data_type=dtype,
                  kv_data_type=kv_dtype or dtype, **_window_kwargs(window_left),
                  **_soft_cap_kwargs(logits_soft_cap))
    return PlanCall(
        args=(meta.qo_indptr[:p + 1], meta.kv_indptr[:p + 1], meta.kv_indices[:nnz],
              meta.kv_last_page_len[:p], num_qo_heads, num_kv_heads, head_dim,
              meta.page_size),
        kwargs=kwargs)


def decode_plan_call(meta: AttentionMetadata, *, num_qo_heads: int, num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype, sm_scale: float | None,
                     kv_dtype: torch.dtype | None = None,
                     window_left: int = -1,
                     logits_soft_cap: float | None = None) -> PlanCall | None:
    """plan() arguments for the single-token spans [num_prefills, B), or None.
    ``window_left``: a sliding window of W tokens is W - 1 (-1: full attention)."""
    p, b = meta.num_prefills, meta.batch_size
    if p == b:
        return None
    start = int(meta.kv_indptr[p])
    indptr = _keep_pinned(meta.kv_indptr[p:] - start, meta.kv_indptr)
    return PlanCall(
        args=(indptr, meta.kv_indices[start:], meta.kv_last_page_len[p:], num_qo_heads,
              num_kv_heads, head_dim, meta.page_size),
        kwargs=dict(sm_scale=sm_scale, q_data_type=dtype, kv_data_type=kv_dtype or dtype,
                    **_window_kwargs(window_left), **_soft_cap_kwargs(logits_soft_cap)))


def _window_kwargs(window_left: int) -> dict[str, int]:
    """plan()'s sliding window argument, passed only when there is a window (-1 is
    flashinfer's default: full attention)."""
    return {} if window_left < 0 else {"window_left": window_left}


def _soft_cap_kwargs(logits_soft_cap: float | None) -> dict[str, float]:
    """plan()'s attention logit soft-cap, passed only when there is one."""
    return {} if logits_soft_cap is None else {"logits_soft_cap": float(logits_soft_cap)}


def query_tile_class(new_tokens: int, group_size: int) -> int:
    """0, 1 or 2: which of FA2's query-tile classes a span's packed length falls in."""
    packed = new_tokens * group_size
    return sum(packed > bound for bound in QUERY_TILE_BOUNDS)


@dataclass(frozen=True)
class TileGroup:
    """Deterministic mode: the spans of one query-tile class, planned together.

    ``rows``: the group's token rows in the step (None: every row, no gather needed)."""

    tile_class: int
    plan: PlanCall
    rows: torch.Tensor | None


def deterministic_groups(meta: AttentionMetadata, *, num_qo_heads: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype, sm_scale: float | None,
                         kv_dtype: torch.dtype | None = None,
                         window_left: int = -1,
                         logits_soft_cap: float | None = None) -> list[TileGroup]:
    """One prefill plan per query-tile class present, each over its spans' own CSR slices,
    all with the fixed KV split."""
    qo = meta.qo_indptr.tolist()
    kv = meta.kv_indptr.tolist()
    last = meta.kv_last_page_len
    group_size = num_qo_heads // num_kv_heads
    classes: dict[int, list[int]] = {}
    for b in range(meta.batch_size):
        classes.setdefault(query_tile_class(qo[b + 1] - qo[b], group_size), []).append(b)
    kwargs = dict(causal=True, sm_scale=sm_scale, q_data_type=dtype,
                  kv_data_type=kv_dtype or dtype, **_window_kwargs(window_left),
                  **_soft_cap_kwargs(logits_soft_cap),
                  fixed_split_size=fixed_split_pages(meta.page_size), disable_split_kv=False)
    groups = []
    for tile_class in sorted(classes):
        spans = classes[tile_class]
        q_lens = torch.tensor([qo[b + 1] - qo[b] for b in spans])
        page_counts = torch.tensor([kv[b + 1] - kv[b] for b in spans])
        qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
        kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), page_counts.cumsum(0)])
        everything = len(spans) == meta.batch_size
        page_pos = torch.cat([torch.arange(kv[b], kv[b + 1]) for b in spans])
        rows = None if everything else torch.cat([torch.arange(qo[b], qo[b + 1])
                                                  for b in spans])
        plan = PlanCall(
            args=(_keep_pinned(qo_indptr.to(torch.int32), meta.qo_indptr),
                  _keep_pinned(kv_indptr.to(torch.int32), meta.kv_indptr),
                  meta.kv_indices if everything else
                  meta.kv_indices[page_pos.to(meta.kv_indices.device)],
                  _keep_pinned(last[torch.tensor(spans)], last),
                  num_qo_heads, num_kv_heads, head_dim, meta.page_size),
            kwargs=dict(kwargs))
        groups.append(TileGroup(tile_class, plan,
                                None if rows is None else rows.to(meta.kv_indices.device)))
    return groups


@dataclass(frozen=True)
class KernelRun:
    """One wrapper's run in a step, over the token rows it was planned for."""

    wrapper: Any
    rows: slice | torch.Tensor      # a slice of the step's tokens, or their indices


@dataclass
class FlashInferPlan:
    """A step's plan: the wrappers hold the kernel plans; ``runs`` says which rows each reads
    (per window class; ``runs`` is the first class's)."""

    meta: AttentionMetadata
    runs: list[KernelRun]
    by_class: list[list[KernelRun]] = field(default_factory=list)


@dataclass
class WindowClass:
    """The layers sharing one sliding window (or full attention) and their wrappers."""

    window_left: int                # W - 1; -1: full attention
    prefill: Any = None
    decode: Any = None
    tiles: list[Any] = field(default_factory=list)   # deterministic: one per tile class


def window_classes(layer_windows: Sequence[int | None] | None
                   ) -> tuple[list[int | None], list[int] | None]:
    """(the distinct windows, full attention first; each layer's index into them, or None
    when there is one class)."""
    windows = sorted(set(layer_windows or (None,)), key=lambda w: -1 if w is None else w)
    if len(windows) == 1:
        return windows, None
    return windows, [windows.index(w) for w in layer_windows]


class FlashInferBackend(AttentionBackend[FlashInferPlan]):
    """flashinfer paged kernels; the plan lives in the wrappers, so steps run one at a time."""

    name = "flashinfer"

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str,
                 sm_scale: float | None = None, kv_dtype: torch.dtype | None = None,
                 deterministic: bool = False,
                 layer_windows: Sequence[int | None] | None = None,
                 logits_soft_cap: float | None = None) -> None:
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        self.use_tensor_cores = use_tensor_cores_for(num_qo_heads, num_kv_heads)
        self.deterministic = deterministic
        self.logits_soft_cap = logits_soft_cap
        # Window classes, planned into the kernels as flashinfer's window_left = W - 1: one
        # (Llama; Mistral with its window on every layer) or several (Gemma: local/global).
        # Their wrappers are created on first use, so that constructing the backend needs
        # neither CUDA nor flashinfer (backend selection is tested on CPU machines).
        windows, self.layer_class = window_classes(layer_windows)
        self.classes = [WindowClass(-1 if w is None else w - 1) for w in windows]
        self.window_left = self.classes[0].window_left
        # FP8 KV: flashinfer's kernels take one scalar scale per K and V tensor
        # (run(..., k_scale=, v_scale=)), so the pool stores them with this fixed scale.
        self.kv_dtype = kv_dtype or dtype
        self.fixed_kv_scale = FP8_KV_SCALE if self.kv_dtype != dtype else None
        self._run_kw = ({} if self.fixed_kv_scale is None else
                        dict(k_scale=FP8_KV_SCALE, v_scale=FP8_KV_SCALE))

    def _ensure_wrappers(self) -> None:
        if all(c.prefill is not None for c in self.classes):
            return
        import flashinfer  # lazy: only CUDA machines get here

        # One workspace shared by all wrappers, as SGLang does: their run() calls are
        # sequential on one stream, and each wrapper keeps its own int (plan) workspace.
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper
        for c in self.classes:
            if c.prefill is not None:
                continue
            if self.deterministic:
                c.tiles = [prefill(workspace, "NHD", backend=DETERMINISTIC_PREFILL_BACKEND)
                           for _ in range(len(QUERY_TILE_BOUNDS) + 1)]
                c.prefill = c.tiles[0]
                continue
            c.prefill = prefill(workspace, "NHD")
            c.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=self.use_tensor_cores)

    def _plan_kw(self, window_left: int | None = None) -> dict:
        return dict(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, dtype=self.dtype, sm_scale=self.sm_scale,
                    kv_dtype=self.kv_dtype, logits_soft_cap=self.logits_soft_cap,
                    window_left=self.window_left if window_left is None else window_left)

    def plan_calls(self, meta: AttentionMetadata, window_left: int | None = None,
                   ) -> tuple[PlanCall | None, PlanCall | None]:
        """Default mode: the prefill and decode wrappers' plan() arguments (for one window
        class; default: the first)."""
        kw = self._plan_kw(window_left)
        return prefill_plan_call(meta, **kw), decode_plan_call(meta, **kw)

    def prepare(self, meta: AttentionMetadata) -> FlashInferPlan:
        if meta.batch_size == 0:
            return FlashInferPlan(meta, [], [[] for _ in self.classes])
        self._ensure_wrappers()
        by_class = [self._plan_class(meta, c) for c in self.classes]
        return FlashInferPlan(meta, by_class[0], by_class)

    def _plan_class(self, meta: AttentionMetadata, c: WindowClass) -> list[KernelRun]:
        """Plan one window class's wrappers for the step -> the runs its layers make."""
        if self.deterministic:
            runs = []
            for group in deterministic_groups(meta, **self._plan_kw(c.window_left)):
                wrapper = c.tiles[group.tile_class]
                group.plan.apply(wrapper)
                rows = slice(0, meta.num_tokens) if group.rows is None else group.rows
                runs.append(KernelRun(wrapper, rows))
            return runs
        prefill, decode = self.plan_calls(meta, c.window_left)
        n = int(meta.qo_indptr[meta.num_prefills])
        runs = []
        if prefill is not None:
            prefill.apply(c.prefill)
            runs.append(KernelRun(c.prefill, slice(0, n)))
        if decode is not None:
            decode.apply(c.decode)
            runs.append(KernelRun(c.decode, slice(n, meta.num_tokens)))
        return runs

    def forward(self, plan: FlashInferPlan, layer: int, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        kv_pool.write(layer, plan.meta.write_slots, k, v, decoded=False)
        cache = (kv_pool.k[layer], kv_pool.v[layer])
        q = q.contiguous()   # the model's q may be a view of a fused qkv projection
        runs = plan.runs if self.layer_class is None else plan.by_class[self.layer_class[layer]]
        only = runs[0].rows if len(runs) == 1 else None
        if isinstance(only, slice) and only == slice(0, q.shape[0]):
            return runs[0].wrapper.run(q, cache, **self._run_kw)
        out = torch.empty_like(q)
        for run in runs:
            if isinstance(run.rows, slice):
                out[run.rows] = run.wrapper.run(q[run.rows], cache, **self._run_kw)
            else:
                out.index_copy_(0, run.rows, run.wrapper.run(q.index_select(0, run.rows),
                                                              cache, **self._run_kw))
        return out
