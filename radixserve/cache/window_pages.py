"""WindowPages: the sliding-window layers' own page accounting.

A hybrid model's full-attention layers keep every token's KV, in the pages the radix tree
and the leases hand out (the *full* page ids). Its sliding-window layers need only the
windows that a running request or a future match reads, so they get a smaller pool with
its own free list. Each full page id either has a windowed page attached (`of_page[p]`, the
windowed layers' KV of the same tokens) or not (`of_page[p] == null`): the windowed pool's
one extra page, never handed out and never written, so a page table read through
`of_page` stays all zeros where a window is absent (attention masks those positions).

Who owns a windowed page is who owns the full page it is attached to (tree, a lease, or
nobody: then it must be free), so the full pages' conservation carries over: free windowed
pages + pages attached to tree pages + pages attached to private pages == total.
With host/disk tiers, a node demoted keeps its windows in this pool under its new ids
(host/disk slots, cache/tiers.py): `take_over` moves them, and they are kept in `lower`, a
dict, since the disk tier may have millions of slots (the pool's map stays one array, which
the runner reads).
Torch-free: the replay tool runs it without a model.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .page_allocator import FreeListPool, OutOfPages, PageAllocator

__all__ = ["WindowPages"]


class WindowPages(FreeListPool):
    def __init__(self, num_pages: int, num_full_pages: int):
        self._free_list = PageAllocator(num_pages)
        self.null = num_pages           # the all-zero page absent windows read
        self.of_page = np.full(num_full_pages, self.null, dtype=np.int32)
        self.lower: dict[int, int] = {}     # host/disk tree id -> its windowed page

    def _split(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """Pool page ids and lower-tier ids."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids) or ids.max() < len(self.of_page):
            return ids, ids[:0]
        in_pool = ids < len(self.of_page)
        return ids[in_pool], ids[~in_pool]

    def _get(self, ids: np.ndarray) -> np.ndarray:
        """The windowed page of each id (null: none)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids) or ids.max() < len(self.of_page):
            return self.of_page[ids]
        out = np.full(len(ids), self.null, dtype=np.int32)
        in_pool = ids < len(self.of_page)
        out[in_pool] = self.of_page[ids[in_pool]]
        out[~in_pool] = [self.lower.get(i, self.null) for i in ids[~in_pool].tolist()]
        return out

    def window_of(self, ids: np.ndarray) -> np.ndarray:
        """The windowed page of each id, a pool page or a lower-tier slot (`null`: none)."""
        return self._get(ids)

    def attach_lower(self, ids: list[int]) -> np.ndarray:
        """A windowed page for each lower-tier id (a restored disk node's page: its saved
        window is read into it); OutOfPages when the pool has too few free."""
        if any(i < len(self.of_page) or i in self.lower for i in ids):
            raise ValueError("attach_lower takes lower-tier ids without a window")
        pages = self._free_list.alloc(len(ids))
        self.lower.update(zip(ids, pages.tolist()))
        return pages

    def present(self, full_pages: np.ndarray) -> np.ndarray:
        """bool per id (a pool page or a lower-tier slot): its windowed KV is held."""
        return self._get(full_pages) != self.null

    def attach(self, full_pages: np.ndarray) -> None:
        """A windowed page for each of `full_pages` (pool ids) lacking one (OutOfPages:
        nothing changed)."""
        full_pages = np.asarray(full_pages, dtype=np.int64)
        lacking = full_pages[self.of_page[full_pages] == self.null]
        if len(lacking) > self._free_list.num_free:
            raise OutOfPages(len(lacking), self._free_list.num_free)
        if len(lacking):
            self.of_page[lacking] = self._free_list.alloc(len(lacking))

    def detach(self, full_pages: np.ndarray) -> int:
        """Free the windowed pages of `full_pages` (those that have one); how many."""
        pool, lower = self._split(full_pages)
        held = pool[self.of_page[pool] != self.null]
        if len(held):
            self._free_list.free(self.of_page[held])
            self.of_page[held] = self.null
        freed = [self.lower.pop(i) for i in lower.tolist() if i in self.lower]
        if freed:
            self._free_list.free(np.asarray(freed, dtype=np.int32))
        return len(held) + len(freed)

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Hand the windowed pages of `src` to `dst` where `dst` lacks one (a duplicate's
        window refills the tree page it duplicates); the rest of `src`'s stay put. Pool
        ids."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        go = (self.of_page[src] != self.null) & (self.of_page[dst] == self.null)
        self.of_page[dst[go]] = self.of_page[src[go]]
        self.of_page[src[go]] = self.null

    def take_over(self, src: np.ndarray, dst: np.ndarray) -> None:
        """`dst[i]` ends with exactly the window `src[i]` had (a node changed tier: its ids
        changed); a window `dst` held is freed, `src` ends with none."""
        self.detach(dst)
        windows = self._get(src)
        src_pool, src_lower = self._split(src)
        self.of_page[src_pool] = self.null
        for i in src_lower.tolist():
            self.lower.pop(i, None)
        dst = np.asarray(dst, dtype=np.int64)
        in_pool = dst < len(self.of_page)
        self.of_page[dst[in_pool]] = windows[in_pool]
        for i, w in zip(dst[~in_pool].tolist(), windows[~in_pool].tolist()):
            if w != self.null:
                self.lower[i] = w

    def check(self, owned_full_pages: Iterable[np.ndarray]) -> None:
        """Windowed conservation: every windowed page is free or attached to exactly one
        full page, and only full pages someone owns (tree or lease) have one."""
        owned = np.concatenate([np.asarray(p, dtype=np.int64).ravel()
                                for p in owned_full_pages] or [np.zeros(0, np.int64)])
        attached_to = np.concatenate([np.flatnonzero(self.of_page != self.null),
                                      np.fromiter(self.lower, np.int64, len(self.lower))])
        stray = np.setdiff1d(attached_to, owned)
        problems = []
        if len(stray):
            problems.append(f"full pages {stray[:16].tolist()} are owned by nobody but "
                            "hold windowed pages")
        ids = self._get(attached_to).astype(np.int64)
        uniq, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            problems.append(f"windowed pages attached twice: {uniq[counts > 1][:16].tolist()}")
        free = self._free_list.free_page_ids().astype(np.int64)
        both = np.intersect1d(free, ids)
        if len(both):
            problems.append(f"windowed pages both free and attached: {both[:16].tolist()}")
        if len(free) + len(ids) != self.num_pages:
            problems.append(f"windowed: free {len(free)} + attached {len(ids)} != "
                            f"{self.num_pages}")
        if problems:
            raise AssertionError("windowed page conservation violated: " + "; ".join(problems))
