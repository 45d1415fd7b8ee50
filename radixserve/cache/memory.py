"""PagedMemory: the one place page ids are handed out and taken back.

Three layers, one job each:

- `PageAllocator` (page_allocator.py) is the free list. Only PagedMemory holds one, so no
  caller can bypass the tree's eviction or free a page behind PagedMemory's back.
- `PagedMemory` (here) sees the free list and the radix tree as one pool: `alloc` meets a
  shortage by evicting unlocked leaves, "can this request fit" is one number
  (`available_pages`: free pages plus every unlocked cached page), and every page id
  comes back through `free` (or `flush_cache` for the whole tree).
- `PrefixLease` (prefix_lease.py) is one request's hold on pages: its locked prefix of
  tree pages and its private pages. The engine and the replay tool use only leases.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .page_allocator import FreeListPool, OutOfPages, PageAllocator
from .radix_cache import EMPTY_PAGES, InsertResult, RadixCache, join_pages

__all__ = ["PagedMemory"]


class PagedMemory(FreeListPool):
    def __init__(self, num_pages: int, tree: RadixCache):
        self._free_list = PageAllocator(num_pages)
        self.tree = tree
        tree.keep_views_into(self._free_list.initial_ids)
        self.page_size = tree.page_size

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted from the tree so far (for the evicted-tokens metric)."""
        return self.tree.evicted_tokens

    def available_pages(self) -> int:
        """Pages an alloc() could get now: free + evictable (unlocked) tree pages."""
        return self._free_list.num_free + self.tree.evictable_tokens // self.page_size

    def alloc(self, n: int) -> np.ndarray:
        """`n` private pages, evicting unlocked leaves when short; OutOfPages changes nothing.

        The ids come as a read-only array (page id arrays are values: nobody writes into
        them, so the tree may keep views). Evicted pages pass straight from the tree to
        the caller (tree -> private): they are owned by nobody else, so a round trip
        through the free list would only cost time -- and when one evicted edge covers the
        request, its array is handed over without a copy.
        """
        return self.alloc_after(EMPTY_PAGES, n)

    def alloc_after(self, head: np.ndarray, n: int) -> np.ndarray:
        """`head` (the caller's page table so far) followed by `n` new private pages, as one
        read-only array; OutOfPages changes nothing. A request's table grows with one copy
        of its ids, not one for the new pages and another to append them (12k ids per
        request on long prompts at page size 1). Subclasses that watch allocations
        override this method (alloc calls it)."""
        free = self._free_list.num_free
        if n <= free:
            parts = [self._free_list.alloc(n, copy=False)]   # copied below, before any free
        else:
            short = n - free
            evictable = self.tree.evictable_tokens // self.page_size
            if short > evictable:
                raise OutOfPages(n, free + evictable)
            parts = self.tree.evict_pages(short * self.page_size)
            got = sum(map(len, parts))
            if got > short:          # evict frees exactly what whole pages need; be safe anyway
                extra = join_pages(parts)
                self.free(extra[short:])
                parts = [extra[:short]]
            if free:
                parts.insert(0, self._free_list.alloc(free, copy=False))
        if len(head):
            parts.insert(0, head)
        if len(parts) == 1 and self._free_list.is_stack_view(parts[0]):
            pages = parts[0].copy()     # the free stack's slots are reused by the next free
            pages.flags.writeable = False
            return pages
        return join_pages(parts)        # one evicted edge's (read-only) array: no copy

    def evict_ahead(self, pages: int) -> int:
        """Make at least `pages` pages free (as many as the tree can give), evicting once;
        returns the pages evicted.

        For a scheduler step about to grow many sequences by a page each: at page size 1
        with 256 decoding that is 256 `alloc_after` calls, each of which would evict its one
        page on its own (a pass through eviction, a trim of the same LRU leaf, and at
        --kv-events a trim fact). One call here evicts the same leaves in the same
        policy order, each trimmed once; the allocations then come off the free list."""
        short = pages - self._free_list.num_free
        if short <= 0:
            return 0
        short = min(short, self.tree.evictable_tokens // self.page_size)
        if short <= 0:
            return 0
        freed = join_pages(self.tree.evict_pages(short * self.page_size))
        self.free(freed)
        return len(freed)

    def free(self, pages: np.ndarray) -> None:
        """Return private pages to the free list (PageAccountingError on a double free)."""
        self._free_list.free(pages)

    def free_duplicates(self, own: np.ndarray, result: InsertResult) -> None:
        """After an insert of `own` pages: free those the tree did not adopt (subclasses
        that keep per-page state move it to the tree's equal page first)."""
        duplicates = result.duplicates(own)
        if len(duplicates):
            self.free(duplicates)

    def flush_cache(self) -> int:
        """Drop the whole tree onto the free list; returns the pages freed.

        CacheLockedError (nothing changed) while a request holds a lock on the tree.
        """
        pages = self.tree.flush()
        self.free(pages)
        return len(pages)

    def flush_namespace(self, namespace: str | None) -> int:
        """Drop one namespace (and those nested under it) onto the free list; the pages
        freed. CacheLockedError (nothing changed) while a request holds a lock in it."""
        pages = self.tree.flush_namespace(namespace)
        self.free(pages)
        return len(pages)

    def check_conservation(self, private: Iterable[np.ndarray] = ()) -> None:
        """Every page id is in exactly one of: free list, tree, one private list."""
        num_pages = self._free_list.num_pages
        free = self._free_list.free_page_ids()
        tree = self.tree.tree_page_ids()
        private = [np.asarray(p, dtype=np.int64).ravel() for p in private]
        n_private = sum(len(p) for p in private)
        owners = [("free list", free.astype(np.int64)), ("tree", tree.astype(np.int64))]
        owners += [(f"private list {i}", p) for i, p in enumerate(private)]
        problems = []
        for name, ids in owners:
            bad = ids[(ids < 0) | (ids >= num_pages)]
            if len(bad):
                problems.append(f"{name} holds out-of-range ids {bad[:16].tolist()}")
        if problems:
            raise AssertionError("; ".join(problems))
        where = np.full(num_pages, -1, dtype=np.int64)
        for k, (name, ids) in enumerate(owners):
            uniq, counts = np.unique(ids, return_counts=True)
            if (counts > 1).any():
                problems.append(f"{name} holds ids twice: {uniq[counts > 1][:16].tolist()}")
            clash = uniq[where[uniq] >= 0]
            if len(clash):
                other = owners[int(where[clash[0]])][0]
                problems.append(f"ids {clash[:16].tolist()} are in both {other} and {name}")
            where[uniq] = np.where(where[uniq] >= 0, where[uniq], k)
        missing = np.flatnonzero(where < 0)
        if len(missing):
            problems.append(f"ids owned by nobody (leaked): {missing[:16].tolist()}")
        total = len(free) + len(tree) + n_private
        if total != num_pages:
            problems.append(f"free {len(free)} + tree {len(tree)} + private {n_private} "
                            f"= {total} != num_pages {num_pages}")
        if problems:
            raise AssertionError("page conservation violated: " + "; ".join(problems))
