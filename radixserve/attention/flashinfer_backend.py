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

Deterministic mode (``deterministic=True``, docs/deterministic.md): every plan gets
``fixed_split_size`` (FA2 split-KV in pages: each sequence's KV is split at fixed page
multiples and the partial states merged in a fixed order, so a query's output does not depend
on the batch; the plan docstrings: "will lead to deterministic softmax score reduction in the
merge_states kernel, and therefore batch-size invariant outputs"), and every sequence, decodes
included, goes through the prefill wrapper, so a token's K/V and output come from one kernel
whether it is computed in a prefill, a decode or a recompute. (The decode wrapper supports
``fixed_split_size`` only on tensor cores.) Checked only when a GPU is lent
(scripts/gpu_check.py, section "deterministic").

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
                      deterministic: bool = False, window_left: int = -1) -> PlanCall | None:
    """plan() arguments for the prefill spans [0, num_prefills), or None when there are none.

    The prefill spans come first, so their CSR slices start at 0 and need no rebasing.
    ``deterministic``: every span (decodes too) with a fixed KV split.
    """
    p = meta.batch_size if deterministic else meta.num_prefills
    if p == 0:
        return None
    nnz = int(meta.kv_indptr[p])
    kwargs = dict(causal=True, sm_scale=sm_scale, q_data_type=dtype,
                  kv_data_type=kv_dtype or dtype, **_window_kwargs(window_left))
    if deterministic:
        kwargs.update(fixed_split_size=fixed_split_pages(meta.page_size),
                      disable_split_kv=False)
    return PlanCall(
        args=(meta.qo_indptr[:p + 1], meta.kv_indptr[:p + 1], meta.kv_indices[:nnz],
              meta.kv_last_page_len[:p], num_qo_heads, num_kv_heads, head_dim,
              meta.page_size),
        kwargs=kwargs)


def decode_plan_call(meta: AttentionMetadata, *, num_qo_heads: int, num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype, sm_scale: float | None,
                     kv_dtype: torch.dtype | None = None,
                     window_left: int = -1) -> PlanCall | None:
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
                    **_window_kwargs(window_left)))


def _window_kwargs(window_left: int) -> dict[str, int]:
    """plan()'s sliding window argument, passed only when there is a window (-1 is
    flashinfer's default: full attention)."""
    return {} if window_left < 0 else {"window_left": window_left}


@dataclass
class FlashInferPlan:
    """A step's plan: the wrappers hold the kernel plans; this says how to split q."""

    meta: AttentionMetadata
    num_prefill_tokens: int   # tokens [0, n) go to the prefill wrapper, the rest to decode
    has_prefill: bool
    has_decode: bool


class FlashInferBackend(AttentionBackend[FlashInferPlan]):
    """flashinfer paged kernels; the plan lives in the wrappers, so steps run one at a time."""

    name = "flashinfer"

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str,
                 sm_scale: float | None = None, kv_dtype: torch.dtype | None = None,
                 deterministic: bool = False,
                 layer_windows: Sequence[int | None] | None = None) -> None:
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        self.use_tensor_cores = use_tensor_cores_for(num_qo_heads, num_kv_heads)
        self.deterministic = deterministic
        # One window for every layer (Mistral, Qwen2 with sliding_window): planned into the
        # kernels as flashinfer's window_left = W - 1. Mixed windows are refused: one
        # wrapper pair plans one window (create_backend falls back to torch for them).
        windows = set(layer_windows or (None,))
        if len(windows) != 1:
            raise ValueError(f"flashinfer backend: one window for all layers, got {windows}")
        window = windows.pop()
        self.window_left = -1 if window is None else window - 1
        # FP8 KV: flashinfer's kernels take one scalar scale per K and V tensor
        # (run(..., k_scale=, v_scale=)), so the pool stores them with this fixed scale.
        self.kv_dtype = kv_dtype or dtype
        self.fixed_kv_scale = FP8_KV_SCALE if self.kv_dtype != dtype else None
        self._run_kw = ({} if self.fixed_kv_scale is None else
                        dict(k_scale=FP8_KV_SCALE, v_scale=FP8_KV_SCALE))
        # Created on first use so that constructing the backend needs neither CUDA nor
        # flashinfer (backend selection is tested on CPU machines).
        self._prefill_wrapper: Any = None
        self._decode_wrapper: Any = None

    def _ensure_wrappers(self) -> None:
        if self._prefill_wrapper is not None:
            return
        import flashinfer  # lazy: only CUDA machines get here

        # One workspace shared by both wrappers, as SGLang does: their run() calls are
        # sequential on one stream, and each wrapper keeps its own int (plan) workspace.
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self.use_tensor_cores)

    def plan_calls(self, meta: AttentionMetadata) -> tuple[PlanCall | None, PlanCall | None]:
        kw = dict(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                  head_dim=self.head_dim, dtype=self.dtype, sm_scale=self.sm_scale,
                  kv_dtype=self.kv_dtype, window_left=self.window_left)
        if self.deterministic:      # one kernel for every token (see module doc)
            return prefill_plan_call(meta, **kw, deterministic=True), None
        return prefill_plan_call(meta, **kw), decode_plan_call(meta, **kw)

    def prepare(self, meta: AttentionMetadata) -> FlashInferPlan:
        prefill, decode = self.plan_calls(meta)
        if prefill is not None or decode is not None:
            self._ensure_wrappers()
        if prefill is not None:
            prefill.apply(self._prefill_wrapper)
        if decode is not None:
            decode.apply(self._decode_wrapper)
        prefill_spans = meta.batch_size if self.deterministic else meta.num_prefills
        return FlashInferPlan(meta, num_prefill_tokens=int(meta.qo_indptr[prefill_spans]),
                              has_prefill=prefill is not None, has_decode=decode is not None)

    def forward(self, plan: FlashInferPlan, layer: int, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        kv_pool.write(layer, plan.meta.write_slots, k, v, decoded=False)
        cache = (kv_pool.k[layer], kv_pool.v[layer])
        q = q.contiguous()   # the model's q may be a view of a fused qkv projection
        n = plan.num_prefill_tokens
        if not plan.has_decode:
            return self._prefill_wrapper.run(q, cache, **self._run_kw) if plan.has_prefill \
                else torch.empty_like(q)
        if not plan.has_prefill:
            return self._decode_wrapper.run(q, cache, **self._run_kw)
        out = torch.empty_like(q)
        out[:n] = self._prefill_wrapper.run(q[:n], cache, **self._run_kw)
        out[n:] = self._decode_wrapper.run(q[n:], cache, **self._run_kw)
        return out
