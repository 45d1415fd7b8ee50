"""PageAllocator: the free list of KV page ids.

A page id is an index into the KV pool. The allocator owns every page that neither the radix
tree nor a request holds. It is a stack in a preallocated int32 array, so alloc and free are a
few vectorised numpy operations whatever the batch size, and it refuses double frees (a freed
id that is already free, or one id twice in one call): a page freed twice would later be handed
to two requests at once and silently mix their KV.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["OutOfPages", "PageAccountingError", "PageAllocator"]


class OutOfPages(RuntimeError):
    """Not enough pages; nothing was changed. `.requested` and `.available` are page counts."""

    def __init__(self, requested: int, available: int):
        super().__init__(f"out of KV pages: requested {requested}, available {available}")
        self.requested = requested
        self.available = available


class PageAccountingError(RuntimeError):
    """A page id freed twice, or outside [0, num_pages): a bookkeeping bug in the caller."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: the lowest ids go out first (easier to read in tests and dumps).
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._top = num_pages
        # _mark[p] == 0: allocated; != 0: free. free() writes each id's position in the call
        # (1-based) and reads it back: an id given twice keeps only its last position.
        self._mark = np.ones(num_pages, dtype=np.int32)
        self._stamps = np.arange(1, num_pages + 1, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray:
        """`n` free page ids (int32); OutOfPages, with nothing changed, when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            raise OutOfPages(n, self._top)
        top = self._top - n
        ids = self._stack[top:self._top].copy()
        self._top = top
        self._mark[ids] = 0
        return ids

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        """Return pages to the free list. PageAccountingError (nothing changed) on a bad id."""
        p = np.asarray(pages)
        k = p.size
        if k == 0:
            return
        if p.ndim != 1 or p.dtype.kind not in "iu":
            raise PageAccountingError(f"page ids must be a 1-D integer array, got {p.dtype} {p.shape}")
        if p.dtype != np.int32:
            if p.min() < 0 or p.max() >= self.num_pages:
                raise PageAccountingError(self._range_message(p))
            p = p.astype(np.int32)
        mark = self._mark
        try:                     # as unsigned, a negative id is huge: one bounds check for both
            current = mark[p.view(np.uint32)]
        except IndexError:
            raise PageAccountingError(self._range_message(p)) from None
        if np.count_nonzero(current):
            again = np.unique(p[current != 0])
            raise PageAccountingError(f"double free: page(s) {again[:16].tolist()} already free")
        stamps = self._stamps[:k]
        mark[p] = stamps
        if mark[p].tobytes() != stamps.tobytes():
            mark[p] = 0                                  # undo: nothing changed
            vals, counts = np.unique(p, return_counts=True)
            raise PageAccountingError(
                f"double free: page(s) {vals[counts > 1][:16].tolist()} freed twice in one call")
        self._stack[self._top:self._top + k] = p
        self._top += k

    def free_page_ids(self) -> np.ndarray:
        """A copy of the free ids (in no particular order), for conservation checks."""
        return self._stack[:self._top].copy()

    def _range_message(self, p: np.ndarray) -> str:
        bad = p[(p < 0) | (p >= self.num_pages)]
        return f"page id(s) {bad[:16].tolist()} outside [0, {self.num_pages})"
