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

Room in the windowed pool is made by dropping windows of tree pages: first those inside a
path (a turn's old end, a checkpoint), then those at the end of a leaf (a conversation's
next turn matches there) or of a branch node (a shared prefix such as a system prompt,
where every request whose own path the tree lost still matches), least recently used
(attached or used by a match most long ago) first within each. Plain LRU dropped the
system prompt's end window while conversations thrashed, so a conversation evicted whole
matched 0 instead of the system prompt (scripts/bench_hybrid.py: 0.879 of the full-KV
tree's hit rate at 150k tokens, 1.057 now). Never dropped: a lease's private page's
(its live window) nor a pinned one: a lease pins the tree windows it reads right after
its match point until it has computed a window past it. Whole leaves are evicted only
when no tree window is left to drop.

With host/disk tiers (`follow`), a node's windows stay in the windowed pool when its
full-attention pages go down a tier: they follow the node's ids (`moved`), come back with
a load, and go when its lower-tier ids are released. So the lower tiers hold the large
full-attention part, the windowed pool the small part that makes a match point usable,
and its drops apply to those windows like any other tree window. The disk tier also
writes each page's window beside it (`window_pages`), journaled with the page, and a
save writes the windows of the pages it copies the same way; a restart attaches them to
the restored disk-tier ids (`windows.attach_lower`); a restored path without them backs
off (docs/models.md).

Which windows a lease drops while it runs, and where a match may end, is WindowedLease's
and WindowRule's.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .memory import PagedMemory
from .page_allocator import OutOfPages
from .radix_cache import InsertResult, RadixCache
from .tier_types import Tier
from .tiers import DISK, HOST, LowerTiers
from .window_files import StoredWindows
from .window_pages import WindowPages
from .window_rule import WindowRule

__all__ = ["WindowedMemory"]


class WindowedMemory(PagedMemory):
    def __init__(self, num_pages: int, tree: RadixCache, window_pages: int, rule: WindowRule):
        super().__init__(num_pages, tree)
        self.windows = WindowPages(window_pages, num_pages)
        self.rule = rule
        self.dropped_windows = 0        # windowed pages taken from the tree for room
        self._clock = 0
        self._used = np.zeros(num_pages, dtype=np.int64)      # per full page: last use
        self._pins = np.zeros(num_pages, dtype=np.int32)      # leases reading its window
        self._private = np.zeros(num_pages, dtype=bool)       # a lease's own page
        self._loading: set[int] = set()     # lower-tier ids being loaded (keep windows)
        self.stored: StoredWindows | None = None   # disk pages' window files (the engine's)

    def follow(self, tiers: LowerTiers) -> None:
        """Keep the windows of nodes that move to host/disk (`tiers` calls `moved` and
        `released`, cache/tiers.py: IdFollower)."""
        tiers.follower = self

    def moved(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.windows.take_over(src, dst)
        loaded = np.asarray(dst, dtype=np.int64)
        loaded = loaded[loaded < self.num_pages]
        self._private[loaded] = False       # a loaded page is the tree's
        self.touch(loaded)

    def released(self, ids: np.ndarray) -> None:
        self.windows.detach(ids)

    def window_pages(self, ids: np.ndarray) -> np.ndarray:
        """Per tree id, its windowed page (-1: none): written to disk beside the page, so
        the disk tier's journal carries it (cache/tiers.py: DemoteOrder.windows)."""
        pages = self.windows.window_of(ids).astype(np.int64)
        pages[pages == self.windows.null] = -1
        return pages

    def alloc_after(self, head: np.ndarray, n: int) -> np.ndarray:
        """PagedMemory.alloc_after, each new page with a windowed page. OutOfPages when
        either pool is short (tree windows may have been dropped by then)."""
        self._window_room(n)
        pages = super().alloc_after(head, n)
        new = pages[len(head):]
        self.windows.detach(new)     # pages evicted from the tree may still carry windows
        self.windows.attach(new)
        self._private[new] = True
        self.touch(new)
        return pages

    def free(self, pages: np.ndarray) -> None:
        self.windows.detach(pages)
        self._private[pages] = False
        super().free(pages)

    def free_duplicates(self, own: np.ndarray, result: InsertResult) -> None:
        self._private[own] = False          # adopted by the tree, or freed right below
        dup = result.duplicates(own)
        if len(dup):
            mask = np.asarray(own) != result.pages
            self.windows.move(np.asarray(own)[mask], result.pages[mask])
            self.free(dup)

    def drop_windows(self, pages: np.ndarray) -> int:
        """Free the windowed KV of `pages` (their full-attention KV stays); how many."""
        return self.windows.detach(pages)

    def touch(self, pages: np.ndarray) -> None:
        """Mark these pages' windows used now (LRU order of window drops)."""
        self._clock += 1
        self._used[pages] = self._clock

    @property
    def pinned_windows(self) -> int:
        """Full pages whose windows a lease (a running request or a pin) is reading."""
        return int(np.count_nonzero(self._pins))

    def pin(self, pages: np.ndarray, by: int) -> None:
        """`by` = +1 / -1: a lease starts / stops reading these tree pages' windows."""
        np.add.at(self._pins, np.asarray(pages, dtype=np.int64), by)

    def loading(self, ids: np.ndarray | None) -> None:
        """Lower-tier ids a lease is loading: their windows are kept while it makes room
        (None: the load is over)."""
        self._loading = set() if ids is None else set(np.asarray(ids).tolist())

    def make_window_room(self, n: int) -> None:
        """At least `n` free windowed pages by dropping windows only, never evicting a
        node (a match being loaded holds its lower nodes unlocked yet); OutOfPages when
        there are too few to drop."""
        self._window_room(n, evict=False)

    def stored_windows(self, ids: np.ndarray) -> np.ndarray:
        """bool per tree id: its window is not in the pool but in a disk file."""
        if self.stored is None:
            return np.zeros(len(ids), dtype=bool)
        return self.stored.stored(ids)

    def _window_room(self, n: int, evict: bool = True) -> None:
        """At least `n` free windowed pages: drop the windows of demoted nodes, then the
        least recently used tree windows (a sixteenth of the pool at least, so this runs
        rarely), then evict leaves whole; OutOfPages if running requests hold the rest."""
        if n <= self.windows.num_free:
            return
        w = self.windows
        while n > w.num_free:
            want = max(n - w.num_free, w.num_pages // 16)
            # Windows of demoted nodes go first: a node leaves the pool least recently used.
            lower = [i for i in w.lower if i not in self._loading][:want]
            if lower:
                self.dropped_windows += w.detach(np.asarray(lower, dtype=np.int64))
                continue
            droppable = np.flatnonzero((w.of_page != w.null) & (self._pins == 0)
                                       & ~self._private)
            want = min(len(droppable), want)
            if want:
                self.dropped_windows += w.detach(self._drop_order(droppable, want))
            elif evict and self.tree.evictable_tokens:
                # (a leaf demoted to a lower tier keeps its windows: dropped next round)
                self.free(self.tree.evict(self.page_size))
            else:
                raise OutOfPages(n, w.num_free)

    def _drop_order(self, droppable: np.ndarray, want: int) -> np.ndarray:
        """The `want` tree windows to drop: windows inside a path (a turn's old end, a
        checkpoint) before those at the end of a leaf (where the next turn of its
        conversation matches) or of a branch node (a shared prefix such as a system
        prompt, where every request past it that the tree lost matches), least recently
        used first within each."""
        if want >= len(droppable):
            return droppable                    # all of them: no order, no tree walk
        ends = self._end_pages()
        key = self._used[droppable] + np.where(np.isin(droppable, ends), self._clock + 1, 0)
        return droppable[np.argpartition(key, want - 1)[:want]]

    def _end_pages(self) -> np.ndarray:
        """The pool pages whose windows the end point of a leaf or of a branch node (two
        children or more) reads. A walk of the pool's part of the tree only (prefix-closed:
        the walk never enters host/disk nodes, which may be millions while the pool's are
        bounded by its pages), run when windows must go (once per 1/16 of the pool)."""
        per_window = -(-self.rule.window // self.page_size) + 1
        out = []
        for node in self._pool_nodes():
            if len(node.children) == 1:
                continue
            need = per_window
            while need > 0 and node is not None and node.depth:
                out.append(node.pages[-need:])
                need -= len(out[-1])
                node = node.parent
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def _pool_nodes(self):
        """The tree's pool nodes (parents before children), never entering a lower tier."""
        stack = [c for r in self.tree.namespace_roots().values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            if node.tier == Tier.POOL:
                yield node
                stack.extend(node.children.values())

    def usable_point(self, pages: np.ndarray, matched: int, cow_page: int = -1) -> int:
        """The largest match point <= `matched` whose window is present (WindowRule)."""
        if matched == 0:
            return 0
        ids = pages if cow_page < 0 else np.append(pages, cow_page)
        return self.rule.usable_point(self.windows.present(ids), matched)

    def check_conservation(self, private: Iterable[np.ndarray] = ()) -> None:
        private = list(private)
        super().check_conservation(private)
        self.windows.check([self.tree_ids(), *private])

    def tree_ids(self) -> np.ndarray:
        """Every id the tree holds: its pool pages and, with tiers, its host/disk slots."""
        tiers = self.tree.tiers
        lower = ([n.pages for t in (HOST, DISK) for n in tiers.nodes[t].values()]
                 if isinstance(tiers, LowerTiers) else [])
        return np.concatenate([self.tree.tree_page_ids(), *lower])
