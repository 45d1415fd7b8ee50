"""WindowedLease: a PrefixLease that holds sliding-window KV only where it is needed.

Three differences from PrefixLease, all about the windowed layers (the full-attention
pages are handled exactly as there):

- `acquire` ends the match at the largest point whose window is present
  (WindowRule.usable_point) and remembers why it stopped there (`window_short`: tokens
  that matched but whose window was missing);
- `slide(n)`, after n tokens are computed, drops the windowed pages of its *private*
  pages that slid out of the window [n - W, n) and lie in no kept match point's window
  (first window, checkpoints, its branch point). It never drops a tree page's window: a
  tree page may be shared, and another request may be reading its window. So a running
  request holds at most its window plus one page of windowed KV (plus look-ahead pages
  and the prefill chunk it is computing);
- `extend` inserts only the pages that slid out of the window: the last W tokens stay
  private until the next extend or `release`, so the tree never receives windows that no
  match point needs. `release` inserts everything (its end is a match point).

With host/disk tiers, `load` brings a match's lower part into the pool only when a point
past the pool part has its window (lower nodes keep theirs in the windowed pool,
WindowedMemory.follow; a disk page's window the pool lost is read back from its file
when that moves the point: cache/window_files.py), then ends the match at the largest
such point.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .radix_cache import MatchResult
from .tier_types import Tier
from .token_keys import TokenIds
from .prefix_lease import PrefixLease
from .window_memory import WindowedMemory

__all__ = ["WindowedLease", "new_lease"]


def new_lease(memory, namespace: str | None = None, use_cache: bool = True) -> PrefixLease:
    """The lease `memory` needs: a WindowedLease over per-group pools (WindowedMemory),
    else a PrefixLease. Pins use it too: a pin then also keeps its end window pinned."""
    lease_type = WindowedLease if isinstance(memory, WindowedMemory) else PrefixLease
    return lease_type(memory, namespace, use_cache)


class WindowedLease(PrefixLease):
    memory: WindowedMemory

    def __init__(self, memory: WindowedMemory, namespace: str | None = None,
                 use_cache: bool = True):
        super().__init__(memory, namespace, use_cache)
        self.rule = memory.rule
        self.branch = 0             # the match point where this request's prompt left the tree
        self.window_short = 0       # tokens that matched but whose window was missing
        self._slid = 0              # private pages below this index were slid already
        self._reading: np.ndarray | None = None    # pinned tree windows (after the match)
        self._pool_match: MatchResult | None = None    # the tree's match, before backing off

    def acquire(self, tokens: TokenIds, max_tokens: int | None = None) -> MatchResult | None:
        match = super().acquire(tokens, max_tokens)
        self.branch = self.window_short = self._slid = 0
        if match is None:
            return None
        self._pool_match = match        # before backing off: what `load` continues
        return self._end_at_usable_point(match)

    def load(self, match: MatchResult, max_tier: Tier = Tier.DISK) -> int:
        """PrefixLease.load, when the lower part has a point whose window is present past
        the point `acquire` ended at; the match then ends at the largest such point."""
        match = self._pool_match
        if match is None or not match.lower or match.cow_tokens or \
                self.num_tree_pages != len(self.pages):
            return 0
        ps = self.page_size
        ids = np.concatenate([match.pages, *(n.pages for n in match.lower)])
        self._read_stored_windows(ids, len(match.pages))
        if self.memory.usable_point(ids, len(ids) * ps) <= self.matched_tokens:
            # No window there: loading would not lengthen the hit (the miss says why).
            self.window_short = len(ids) * ps - self.matched_tokens
            return 0
        backed_off = (self.pages, self.matched_tokens, self.window_short)
        self._pin(None)
        self.pages, self.num_tree_pages = match.pages, len(match.pages)
        self.matched_tokens = match.matched_tokens
        lower = np.concatenate([n.pages for n in match.lower])
        self.memory.loading(lower)      # making room in the windowed pool keeps these
        try:
            loaded = super().load(match, max_tier)
        finally:
            self.memory.loading(None)
        if not loaded:              # no room: back to where acquire ended
            self.pages, self.matched_tokens, self.window_short = backed_off
            self.num_tree_pages = len(self.pages)
            self._pin_reads()
            return 0
        self.window_short = 0
        self._end_at_usable_point(replace(match, matched_tokens=self.matched_tokens,
                                          pages=self.pages, lower=()))
        return loaded

    def _read_stored_windows(self, ids: np.ndarray, num_pool: int) -> None:
        """Read back the window files of the match's disk pages (cache/window_files.py)
        when that lets it end at a later point than the windows in the pool do."""
        present = self.memory.windows.present(ids)
        end = len(ids) * self.page_size
        now = self.rule.usable_point(present, end)
        if now == end:
            return                              # every point the match reaches is usable
        stored = self.memory.stored_windows(ids)
        if not stored.any() or self.rule.usable_point(present | stored, end) <= now:
            return
        self.memory.loading(ids[num_pool:])     # making room keeps this match's windows
        try:
            self.memory.stored.load(ids[stored])
        finally:
            self.memory.loading(None)

    def _end_at_usable_point(self, match: MatchResult) -> MatchResult:
        """Back the match off to the largest point whose window is present, and pin the
        tree windows read from there."""
        ps = self.page_size
        self.branch = self.matched_tokens // ps * ps
        cow_page = self._cow[0] if self._cow is not None else -1
        m = self.memory.usable_point(self.pages, self.matched_tokens, cow_page)
        if m < self.matched_tokens:
            # Back off to m: the pages past it are recomputed; the lock stays deeper (it
            # covers m's path too), and a later insert finds its node from the root.
            self.window_short = self.matched_tokens - m
            self.pages = self.pages[:m // ps]
            self.num_tree_pages = len(self.pages)
            self.matched_tokens = m
            if m % ps == 0:
                self._cow = None
            match = replace(match, matched_tokens=m, pages=self.pages,
                            cow_page=self._cow[0] if self._cow else -1,
                            cow_tokens=self._cow[1] if self._cow else 0)
        self._slid = len(self.pages)
        self._pin_reads()
        return match

    def _pin_reads(self) -> None:
        """Pin the tree windows that resuming at `matched_tokens` reads."""
        lo, hi = self.rule.needed_pages(self.matched_tokens)
        reads = self.pages[lo:min(hi, len(self.pages))]
        if self._cow is not None:
            reads = np.append(reads, self._cow[0])
        self._pin(reads)

    def _pin(self, pages: np.ndarray | None) -> None:
        """Pin the tree windows this lease reads (None: unpin them)."""
        if self._reading is not None:
            self.memory.pin(self._reading, -1)
        self._reading = pages if pages is not None and len(pages) else None
        if self._reading is not None:
            self.memory.pin(self._reading, +1)
            self.memory.touch(self._reading)

    def slide(self, num_computed: int) -> None:
        """Drop the windows of private pages now wholly before num_computed - W that no
        kept match point needs (all of them when the cache is off)."""
        ps = self.page_size
        if self._reading is not None and num_computed - self.rule.window >= self.matched_tokens:
            self._pin(None)         # no longer reads the tree's windows
        hi = min(max(0, num_computed - self.rule.window) // ps, len(self.pages))
        lo = max(self._slid, self.num_tree_pages)
        if hi <= lo:
            return
        idx = np.arange(lo, hi)
        if self.use_cache:
            idx = idx[~self.rule.kept(idx, self.branch)]
        if len(idx):
            self.memory.drop_windows(self.pages[idx])
        self._slid = hi

    def extend(self, tokens: TokenIds, num_tokens: int) -> None:
        self.slide(num_tokens)
        keep_private = max(0, num_tokens - self.rule.window)
        super().extend(tokens, keep_private)

    def release(self, tokens: TokenIds | None = None, num_tokens: int = 0) -> None:
        if tokens is not None:
            self.slide(num_tokens)
        self._pin(None)
        self._pool_match = None
        super().release(tokens, num_tokens)
