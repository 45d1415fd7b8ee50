"""WindowedMemory: PagedMemory for a hybrid model, with the sliding-window layers' pool.

The full-attention page ids work exactly as in PagedMemory (free list, tree, leases).
Beside them, `windows` (WindowPages) accounts the windowed layers' pages, attached to full
page ids. This class keeps the two in step at the three places pages change hands:

- a page handed to a lease (`alloc_after`) gets a windowed page: it is about to be
  computed. The windowed pool is made room for first, by dropping the windows of the
  least recently used unlocked leaves (their full-attention KV and every earlier match
  point stay usable), then by evicting whole leaves;
- a page going back to the free list (`free`, flushes, eviction surplus) loses its window;
- a duplicate page an insert did not adopt hands its window to the tree's equal page when
  that one has none (the second request through a branch point refills its window).

Which windows a lease drops while it runs, and where a match may end, is WindowedLease's
and WindowRule's.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .memory import PagedMemory
from .page_allocator import OutOfPages
from .radix_cache import InsertResult, RadixCache
from .window_pages import WindowPages
from .window_rule import WindowRule

__all__ = ["WindowedMemory"]


class WindowedMemory(PagedMemory):
    def __init__(self, num_pages: int, tree: RadixCache, window_pages: int, rule: WindowRule):
        super().__init__(num_pages, tree)
        self.windows = WindowPages(window_pages, num_pages)
        self.rule = rule
        self.dropped_windows = 0        # windowed pages taken from the tree for room

    def alloc_after(self, head: np.ndarray, n: int) -> np.ndarray:
        """PagedMemory.alloc_after, each new page with a windowed page. OutOfPages when
        either pool is short (windows of unlocked leaves may have been dropped by then)."""
        self._window_room(n)
        pages = super().alloc_after(head, n)
        new = pages[len(head):]
        self.windows.detach(new)     # pages evicted from the tree may still carry windows
        self.windows.attach(new)
        return pages

    def free(self, pages: np.ndarray) -> None:
        self.windows.detach(pages)
        super().free(pages)

    def free_duplicates(self, own: np.ndarray, result: InsertResult) -> None:
        dup = result.duplicates(own)
        if len(dup):
            mask = np.asarray(own) != result.pages
            self.windows.move(np.asarray(own)[mask], result.pages[mask])
            self.free(dup)

    def drop_windows(self, pages: np.ndarray) -> int:
        """Free the windowed KV of `pages` (their full-attention KV stays); how many."""
        return self.windows.detach(pages)

    def _window_room(self, n: int) -> None:
        """At least `n` free windowed pages: drop the windows of unlocked leaves in
        eviction order, then evict leaves whole; OutOfPages if the locked part holds the rest."""
        if n <= self.windows.num_free:
            return
        for leaf in self.tree.iter_evictable():
            self.dropped_windows += self.windows.detach(leaf.pages)
            if n <= self.windows.num_free:
                return
        while n > self.windows.num_free and self.tree.evictable_tokens:
            self.free(self.tree.evict(self.page_size))
        if n > self.windows.num_free:
            raise OutOfPages(n, self.windows.num_free)

    def usable_point(self, pages: np.ndarray, matched: int, cow_page: int = -1) -> int:
        """The largest match point <= `matched` whose window is present (WindowRule)."""
        if matched == 0:
            return 0
        ids = pages if cow_page < 0 else np.append(pages, cow_page)
        return self.rule.usable_point(self.windows.present(ids), matched)

    def check_conservation(self, private: Iterable[np.ndarray] = ()) -> None:
        private = list(private)
        super().check_conservation(private)
        self.windows.check([self.tree.tree_page_ids(), *private])
