"""PageAllocator: the free list of KV page ids.

A page id is an index into the KV pool. The allocator owns every page that neither the radix
tree nor a request holds. It is a stack in a preallocated int32 array, so alloc and free are a
few vectorised numpy operations whatever the batch size, and it refuses double frees (a freed
id that is already free, or one id twice in one call): a page freed twice would later be handed
to two requests at once and silently mix their KV. A bulk free (hundreds of ids and more:
a flush, a failed request's pages) sorts the ids first, so its checks read the per-id
arrays in order rather than scattering over a pool of millions of pages.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["FreeListPool", "OutOfPages", "PageAccountingError", "PageAllocator"]


class OutOfPages(RuntimeError):
    """Not enough pages; nothing was changed. `.requested` and `.available` are page counts."""

    def __init__(self, requested: int, available: int):
        super().__init__(f"out of KV pages: requested {requested}, available {available}")
        self.requested = requested
        self.available = available


class PageAccountingError(RuntimeError):
    """A page id freed twice, or outside [0, num_pages): a bookkeeping bug in the caller."""


class PageAllocator:
    """A stack of free ids in `_stack[:_top]`, and for every id the slot it was last put in.

    An id is free iff its slot is below the top and still holds it, so alloc only moves the
    top (no per-page writes: allocation happens every decode step) and free can still tell
    an allocated id from a free one.
    """

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: the lowest ids go out first (easier to read in tests and dumps).
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._top = num_pages
        self._slots = np.arange(num_pages, dtype=np.int32)
        self._slot_of = np.empty(num_pages, dtype=np.int32)
        self._slot_of[self._stack] = self._slots
        # Slots below `_pristine` still hold their initial ids (no free has written them
        # since): those ids are handed out as views of this read-only copy, not copied (a
        # fresh pool hands out whole prompts' worth of ids per request).
        # Python-int views of the same memory, for the one-id free (numpy scalar indexing
        # costs ~4x a memoryview item; a partial last page is freed on every request).
        self._stack_items = memoryview(self._stack)
        self._slot_items = memoryview(self._slot_of)
        self._initial = self._stack.copy()
        self._initial.flags.writeable = False
        self._pristine = num_pages

    @property
    def initial_ids(self) -> np.ndarray:
        """The read-only ids that never-freed pages are handed out as views of."""
        return self._initial

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int, copy: bool = True) -> np.ndarray:
        """`n` free page ids (int32); OutOfPages, with nothing changed, when fewer are free.

        Ids never freed since the start come as a read-only view of the initial ids
        (nothing to copy); others as a copy, or with `copy=False` as a view of the free
        stack, valid only until the next free (which overwrites those slots): for a
        caller that copies it at once (see `is_stack_view`)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            raise OutOfPages(n, self._top)
        top = self._top - n
        self._top = top
        if top + n <= self._pristine:
            return self._initial[top:top + n]
        ids = self._stack[top:top + n]
        return ids.copy() if copy else ids

    def is_stack_view(self, ids: np.ndarray) -> bool:
        """Did `alloc(n, copy=False)` return a view of the free stack (valid until a free)?"""
        return ids.base is self._stack

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        """Return pages to the free list. PageAccountingError (nothing changed) on a bad id."""
        if type(pages) is np.ndarray and pages.shape == _ONE and pages.dtype == _INT32:
            self._free_one(pages.item())    # a partial last page, every request: the short path
            return
        p = np.asarray(pages)
        k = p.size
        if k == 0:
            return
        if p.ndim != 1 or p.dtype.kind not in "iu":
            raise PageAccountingError(f"page ids must be a 1-D integer array, got {p.dtype} {p.shape}")
        if k == 1:                 # the common small free (a partial last page): no temporaries
            self._free_one(p.item())
            return
        if p.dtype != _INT32:
            if p.min() < 0 or p.max() >= self.num_pages:
                raise PageAccountingError(self._range_message(p))
            p = p.astype(np.int32)
        if k >= _SORTED_FREE:
            self._free_sorted(np.sort(p))
            return
        try:                     # as unsigned, a negative id is huge: one bounds check for both
            slot = self._slot_of[p.view(np.uint32)]
        except IndexError:
            raise PageAccountingError(self._range_message(p)) from None
        top = self._top
        free_now = self._stack[slot] == p
        free_now &= slot < top
        if np.count_nonzero(free_now):
            raise PageAccountingError(
                f"double free: page(s) {np.unique(p[free_now])[:16].tolist()} already free")
        # Claim slots top..top+k. An id given twice keeps only its last slot, so an earlier
        # occurrence reads back a different one. Nothing is changed then: the slots written
        # lie above the top, which still marks those ids as allocated.
        if k > self.num_pages - top:
            self._raise_duplicates(p)
        slots = self._slots[top:top + k]
        self._pristine = min(self._pristine, top)
        self._slot_of[p] = slots
        if self._slot_of[p].tobytes() != slots.tobytes():
            self._raise_duplicates(p)
        self._stack[top:top + k] = p
        self._top = top + k

    def _free_sorted(self, p: np.ndarray) -> None:
        """A bulk free, ids sorted: the per-id lookups then walk `_slot_of` in order instead
        of scattering over the whole id space (2-3x faster from a few hundred ids on a
        large pool), a duplicate is its neighbour, and only ids whose last slot lies below
        the top need the stack read that tells a free id from a reused slot."""
        if p[0] < 0 or p[-1] >= self.num_pages:
            raise PageAccountingError(self._range_message(p))
        if (p[1:] == p[:-1]).any():
            self._raise_duplicates(p)
        top = self._top
        slot = np.take(self._slot_of, p)
        below = slot < top
        if below.any():
            maybe, at = p[below], slot[below]
            free_now = np.take(self._stack, at) == maybe
            if free_now.any():
                raise PageAccountingError(
                    f"double free: page(s) {maybe[free_now][:16].tolist()} already free")
        k = len(p)
        self._pristine = min(self._pristine, top)
        self._slot_of[p] = self._slots[top:top + k]
        self._stack[top:top + k] = p
        self._top = top + k

    def _free_one(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise PageAccountingError(f"page id(s) [{page}] outside [0, {self.num_pages})")
        top = self._top
        slot = self._slot_items[page]
        if slot < top and self._stack_items[slot] == page:
            raise PageAccountingError(f"double free: page(s) [{page}] already free")
        if top < self._pristine:
            self._pristine = top
        self._slot_items[page] = top
        self._stack_items[top] = page
        self._top = top + 1

    def free_page_ids(self) -> np.ndarray:
        """A copy of the free ids (in no particular order), for conservation checks."""
        return self._stack[:self._top].copy()

    @staticmethod
    def _raise_duplicates(p: np.ndarray) -> None:
        vals, counts = np.unique(p, return_counts=True)
        raise PageAccountingError(
            f"double free: page(s) {vals[counts > 1][:16].tolist()} freed twice in one call")

    def _range_message(self, p: np.ndarray) -> str:
        bad = p[(p < 0) | (p >= self.num_pages)]
        return f"page id(s) {bad[:16].tolist()} outside [0, {self.num_pages})"


_INT32 = np.dtype(np.int32)
_SORTED_FREE = 256           # ids from which free sorts them first (see _free_sorted)
_ONE = (1,)                  # the shape of a one-page free


class FreeListPool:
    """A pool whose pages one PageAllocator accounts (`_free_list`): the full-attention
    pages (PagedMemory) and a hybrid model's windowed pages (WindowPages)."""

    _free_list: PageAllocator

    @property
    def num_pages(self) -> int:
        return self._free_list.num_pages

    @property
    def num_free(self) -> int:
        """Pages on the free list (not counting evictable tree pages)."""
        return self._free_list.num_free
