"""The page table of one step, in the CSR form flashinfer's paged kernels take.

Built once per step for up to a few hundred sequences, so everything is numpy-vectorized:
no Python loop runs per token, only one list comprehension per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from radixserve.attention.spans import SeqSpan

__all__ = ["AttentionMetadata", "SeqSpan", "build_metadata"]


@dataclass
class AttentionMetadata:
    page_size: int
    qo_indptr: torch.Tensor         # int32 [B+1], CPU
    kv_indptr: torch.Tensor         # int32 [B+1], CPU
    kv_indices: torch.Tensor        # int32 [nnz_pages], on device
    kv_last_page_len: torch.Tensor  # int32 [B], CPU, in 1..page_size
    write_slots: torch.Tensor       # int64 [T], on device: where each new token's K/V goes
    qo_lens: list[int]
    kv_lens: list[int]
    num_prefills: int               # sequences [0, num_prefills) have new_len > 1

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def num_decodes(self) -> int:
        return self.batch_size - self.num_prefills

    def last_token_rows(self) -> torch.Tensor:
        """int64 [B]: each sequence's last new token in the step's flat token order."""
        return self.qo_indptr[1:].to(torch.int64) - 1


def _cpu_tensor(a: np.ndarray, pin: bool) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory() if pin else t


def _device_tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """CPU: the array itself; CUDA: an asynchronous copy from pinned memory (no sync)."""
    if device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(a))
    return _cpu_tensor(a, pin=device.type == "cuda").to(device, non_blocking=True)


def _validate(spans: Sequence[SeqSpan], page_size: int) -> int:
    """Check each span; return num_prefills (the length of the new_len > 1 head)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    num_prefills = 0
    for i, s in enumerate(spans):
        if s.new_len < 1 or s.cached_len < 0:
            raise ValueError(f"span {i}: new_len={s.new_len} must be >= 1 and "
                             f"cached_len={s.cached_len} >= 0")
        need = -(-(s.cached_len + s.new_len) // page_size)
        if len(s.pages) < need:
            raise ValueError(f"span {i}: {s.cached_len + s.new_len} tokens need {need} pages "
                             f"of {page_size}, got {len(s.pages)}")
        if s.new_len > 1:
            if num_prefills != i:
                raise ValueError(f"span {i} has new_len={s.new_len} after a single-token span: "
                                 "order spans prefill-first (new_len > 1), then decodes")
            num_prefills += 1
    return num_prefills


def build_metadata(spans: Sequence[SeqSpan], page_size: int,
                   device: torch.device | str) -> AttentionMetadata:
    """Page table and write slots for ``spans`` (prefill spans first, then decodes)."""
    device = torch.device(device)
    num_prefills = _validate(spans, page_size)
    pin = device.type == "cuda"
    batch = len(spans)
    qo_lens = np.fromiter((s.new_len for s in spans), dtype=np.int64, count=batch)
    cached = np.fromiter((s.cached_len for s in spans), dtype=np.int64, count=batch)
    kv_lens = cached + qo_lens
    num_kv_pages = (kv_lens + page_size - 1) // page_size

    qo_indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(qo_lens, out=qo_indptr[1:])
    kv_indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(num_kv_pages, out=kv_indptr[1:])
    if batch:
        kv_indices = np.concatenate(
            [np.asarray(s.pages[:n], dtype=np.int32) for s, n in zip(spans, num_kv_pages)])
    else:
        kv_indices = np.zeros(0, dtype=np.int32)
    last_page_len = kv_lens - (num_kv_pages - 1) * page_size

    # Slot of every new token: its position p in its sequence lives in that sequence's page
    # p // page_size at offset p % page_size.
    num_tokens = int(qo_indptr[-1])
    seq_of_token = np.repeat(np.arange(batch), qo_lens)
    pos = (np.arange(num_tokens, dtype=np.int64) - qo_indptr[:-1][seq_of_token]
           + cached[seq_of_token])
    pages = kv_indices[kv_indptr[:-1][seq_of_token] + pos // page_size].astype(np.int64)
    write_slots = pages * page_size + pos % page_size

    return AttentionMetadata(
        page_size=page_size,
        qo_indptr=_cpu_tensor(qo_indptr.astype(np.int32), pin),
        kv_indptr=_cpu_tensor(kv_indptr.astype(np.int32), pin),
        kv_indices=_device_tensor(kv_indices, device),
        kv_last_page_len=_cpu_tensor(last_page_len.astype(np.int32), pin),
        write_slots=_device_tensor(write_slots, device),
        qo_lens=qo_lens.tolist(),
        kv_lens=kv_lens.tolist(),
        num_prefills=num_prefills,
    )
