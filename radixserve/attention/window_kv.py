"""WindowedKV: the sliding-window layers' own pool, backend and page table (hybrid models).

The step's spans carry full page ids (the tree's and the leases'). The windowed layers
read and write through `of_page` (cache/window_pages.py): full page id -> windowed page
id, or the pool's null page where the window is absent. So a windowed layer's page table
holds real pages only from its first kept page on; before that it reads the null page,
which is never written (all zeros) and lies outside every query's window, so the window
mask gives it weight zero. A token about to be computed always has a windowed page (the
lease attaches one to every page it grows); `spans` checks it, since writing into the null
page would corrupt every absent window.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from radixserve.attention.backend import AttentionBackend
from radixserve.attention.context import GroupStep
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import build_metadata
from radixserve.attention.spans import SeqSpan

__all__ = ["WindowedKV"]


class WindowedKV:
    def __init__(self, pool: KVPool, backend: AttentionBackend, window: int):
        self.pool = pool                    # num_pages = windowed pages + the null page
        self.backend = backend
        self.window = window
        self.layers = frozenset(pool.layers)
        self.null = pool.num_pages - 1
        self.of_page: np.ndarray | None = None  # WindowPages.of_page (engine attaches it)

    def attach(self, of_page: np.ndarray) -> None:
        if of_page.max(initial=self.null) > self.null:
            raise ValueError("the windowed page map points past the windowed pool")
        self.of_page = of_page

    def spans(self, spans: Sequence[SeqSpan], page_size: int) -> list[SeqSpan]:
        """The step's spans over windowed page ids; RuntimeError if a computed token has
        no windowed page (a lease bookkeeping bug: never written into the null page)."""
        out = []
        for i, s in enumerate(spans):
            need = -(-(s.cached_len + s.new_len) // page_size)
            pages = self.of_page[np.asarray(s.pages[:need], dtype=np.int64)]
            first = s.cached_len // page_size
            if (pages[first:] == self.null).any():
                raise RuntimeError(f"span {i}: tokens {s.cached_len}..{s.cached_len + s.new_len}"
                                   " have no windowed page")
            out.append(SeqSpan(pages, s.cached_len, s.new_len))
        return out

    def prepare(self, spans: Sequence[SeqSpan], page_size: int,
                device: torch.device) -> GroupStep:
        meta = build_metadata(self.spans(spans, page_size), page_size, device)
        return GroupStep(self.layers, self.backend, self.backend.prepare(meta), self.pool)

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        """Copy-on-write of the windowed part of a page (full page ids)."""
        src, dst = int(self.of_page[src_page]), int(self.of_page[dst_page])
        if self.null in (src, dst):
            raise RuntimeError(f"copy-on-write of page {src_page} -> {dst_page}: its window "
                               "is not held")
        self.pool.copy_prefix(src, dst, num_tokens)
