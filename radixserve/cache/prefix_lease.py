"""PrefixLease: one request's hold on KV pages -- a locked cached prefix plus its own pages.

The engine (one lease per running sequence) and the replay tool (one per request in
flight) both take and give back pages only through this type, so the replay tool runs
exactly the server's cache logic. Steps:

    lease = PrefixLease(memory, namespace)
    lease.acquire(tokens, max_tokens)   # match the cached prefix and lock it
    lease.grow(n)                       # n private pages (may evict; OutOfPages changes nothing)
    ... compute KV into the private pages (first run lease.take_copy_orders()) ...
    lease.extend(tokens, num_tokens)    # the computed whole pages go into the tree
    lease.release()                     # unlock; private pages back to the free list
                                        # (release(tokens, n): extend first, same result)

Which pages the lease owns, at each moment
-----------------------------------------
`pages` is the sequence's page table from position 0. Always:

- `pages[:num_tree_pages]` are *tree* pages: the tree owns them; the lease only keeps them
  from eviction by its lock on `node` (the lock also covers a copy-on-write source page).
- `pages[num_tree_pages:]` are *private*: owned by this lease alone. `grow` adds them
  (from the free list or straight from evicted leaves); `extend` hands the computed ones
  to the tree -- adopted ones become tree pages, ones the tree already had an equal page
  for (duplicates) go back to the free list -- and `release` frees the rest.
- Before `acquire` and after `release` the lease owns nothing and holds no lock.

Copy-on-write
-------------
A match may end inside a tree page (page_size > 1): its first `cow_tokens` tokens equal
the request's next tokens. The lease then makes the first page that `grow` allocates the
destination and issues a `CopyOrder` (source page, destination page, token count). The
lease does no torch work: whoever owns the KV data executes the order before computing
into that page (the engine: in the next step, on the compute thread; the replay tool has
no KV and drops it). `release` drops an order not yet taken, since its page is freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .memory import PagedMemory
from .page_allocator import OutOfPages
from .radix_cache import EMPTY_PAGES, MatchResult, join_pages
from .tier_types import Tier
from .token_keys import TokenIds, prefix
from .tree_node import TreeNode

__all__ = ["CopyOrder", "PrefixLease"]


@dataclass(frozen=True, slots=True)
class CopyOrder:
    """Copy the KV of the first `num_tokens` tokens of page `src_page` into `dst_page`."""

    src_page: int
    dst_page: int
    num_tokens: int


class PrefixLease:
    def __init__(self, memory: PagedMemory, namespace: str | None = None,
                 use_cache: bool = True):
        self.memory = memory
        self.tree = memory.tree
        self.namespace = namespace
        self.use_cache = use_cache          # False: private pages only, no match, no insert
        self.page_size = memory.tree.page_size
        self.pages: np.ndarray = EMPTY_PAGES
        self.num_tree_pages = 0
        self.node: TreeNode | None = None   # the lock we hold, or None
        self.matched_tokens = 0             # tokens the acquire served from the cache
        self._cow: tuple[int, int] | None = None    # (source page, tokens) until grow
        self.copy_orders: list[CopyOrder] = []     # issued, not yet taken (read-only)

    # ------------------------------------------------------------------ state
    @property
    def tree_tokens(self) -> int:
        """Leading tokens whose pages the tree owns."""
        return self.num_tree_pages * self.page_size

    @property
    def private_pages(self) -> np.ndarray:
        return self.pages[self.num_tree_pages:]

    @property
    def active(self) -> bool:
        """Holds a lock or pages (acquired and not yet released)."""
        return self.node is not None or len(self.pages) > 0

    # ------------------------------------------------------------------ the steps
    def acquire(self, tokens: TokenIds, max_tokens: int | None = None) -> MatchResult | None:
        """Match the longest cached prefix (at most `max_tokens`) and lock it.

        Takes no page and cannot fail. Afterwards `pages` are the matched tree pages and
        `matched_tokens` counts them plus a copy-on-write part, whose page the next `grow`
        allocates. Returns the match (None when the cache is off).
        """
        if self.active:
            raise RuntimeError("acquire on a lease that already holds pages; release it first")
        if not self.use_cache:
            return None
        match = self.tree.match_prefix(tokens, self.namespace, max_tokens)
        self.tree.lock(match.node)
        self.node = match.node
        self.pages = match.pages
        self.num_tree_pages = len(match.pages)
        self.matched_tokens = match.matched_tokens
        if match.cow_tokens:
            self._cow = (match.cow_page, match.cow_tokens)
        return match

    def load(self, match: MatchResult, max_tier: Tier = Tier.DISK) -> int:
        """Bring the host/disk part of this lease's match (`match.lower`) into the pool.

        Right after `acquire`: pool pages are allocated for the nodes that can come (tiers
        up to `max_tier`; disk pages that fail their checksum end it, see tiers.py), the
        nodes move into the pool on them, and LoadOrders wait in `tree.tiers.take_moves()`
        (the caller runs them before computing from here). The lock moves to the last
        loaded node. Returns the tokens loaded: 0 when none (no room: OutOfPages is not
        raised; the caller computes those tokens instead).
        """
        tiers = self.tree.tiers
        if not match.lower or self._cow is not None or \
                self.num_tree_pages != len(self.pages):
            return 0
        plan = tiers.plan_load(match.lower, max_tier)
        if plan is None:
            return 0
        try:
            pages = self.memory.alloc_after(self.pages, plan.num_pages)
        except OutOfPages:
            tiers.cancel(plan)
            return 0
        end = tiers.load(plan, pages[len(self.pages):])
        if self.node is not None:
            self.tree.unlock(self.node)
        self.node = end
        self.pages = pages
        self.num_tree_pages = len(pages)
        self.matched_tokens = len(pages) * self.page_size
        return plan.num_tokens

    def take_loaded(self, tokens: TokenIds, num_pages: int) -> np.ndarray | None:
        """Extend the matched prefix by `num_pages` whole pages whose KV arrives from
        elsewhere (a peer replica's, engine/peer_share.py): new pool pages go straight into
        the tree, locked by this lease, and their ids are returned for the caller to fill
        before anything reads them. Right after `acquire` only (no copy-on-write part, no
        private page); None when not so or when the pages cannot be had (nothing changed).
        """
        if num_pages <= 0 or self._cow is not None or self.num_tree_pages != len(self.pages) \
                or not self.use_cache:
            return None
        try:
            pages = self.memory.alloc_after(self.pages, num_pages)
        except OutOfPages:
            return None
        start, end = len(self.pages), len(pages)
        self.pages = pages
        self.extend(tokens, end * self.page_size)
        self.matched_tokens = self.num_tree_pages * self.page_size
        return self.pages[start:end]        # the tree's pages (ours: the match was longest)

    def grow(self, num_pages: int) -> None:
        """Add `num_pages` private pages (evicting unlocked leaves when short).

        OutOfPages leaves everything as it was. The first page after a copy-on-write match
        is the copy's destination: its order waits in `take_copy_orders()`.
        """
        if num_pages <= 0:
            return
        # Read-only (never written in place: the tree may keep views); one copy in all.
        pages = self.memory.alloc_after(self.pages, num_pages)
        if self._cow is not None:
            src, n = self._cow
            self.copy_orders.append(CopyOrder(src, int(pages[len(self.pages)]), n))
            self._cow = None
        self.pages = pages

    def take_copy_orders(self) -> Sequence[CopyOrder]:
        """The copy-on-write orders issued since the last call (the caller executes them)."""
        if not self.copy_orders:    # the usual case: no list made per call
            return ()
        orders, self.copy_orders = self.copy_orders, []
        return orders

    def extend(self, tokens: TokenIds, num_tokens: int) -> None:
        """Put the whole pages among the first `num_tokens` of `tokens` (computed) in the tree.

        The tree adopts the private pages it lacked; where it already had an equal page
        (another request inserted the same tokens meanwhile, or a copy-on-write page that
        turned out whole) ours is a duplicate and goes back to the free list. The lock then
        moves to the node ending the inserted prefix.
        """
        node = self._insert(tokens, num_tokens)
        if node is not None:
            self.tree.lock(node)
            if self.node is not None:
                self.tree.unlock(self.node)
            self.node = node

    def release(self, tokens: TokenIds | None = None, num_tokens: int = 0) -> None:
        """Give back everything: unlock the prefix, free the private pages. Idempotent.

        With `tokens`, first keep the computed KV: as `extend(tokens, num_tokens)`, minus
        moving the lock that is dropped right after.
        """
        if tokens is not None:
            self._insert(tokens, num_tokens)
        if self.node is not None:
            self.tree.unlock(self.node)
            self.node = None
        if self.num_tree_pages < len(self.pages):    # no slice made when none are private
            self.memory.free(self.pages[self.num_tree_pages:])
        self.pages = EMPTY_PAGES
        self.num_tree_pages = 0
        self.matched_tokens = 0
        self._cow = None
        self.copy_orders = []

    def _insert(self, tokens: TokenIds, num_tokens: int) -> TreeNode | None:
        """The insert of `extend`; the node ending it, or None when there was nothing new."""
        if not self.use_cache:
            return None
        full = num_tokens // self.page_size
        if full <= self.num_tree_pages:
            return None
        if full > len(self.pages):
            raise ValueError(f"extend over {full} pages, the lease holds {len(self.pages)}")
        own = self.pages[:full]
        result = self.tree.insert(prefix(tokens, full * self.page_size), own, self.namespace,
                                  start=self.node)
        self.memory.free_duplicates(own, result)
        if full < len(self.pages):
            self.pages = join_pages([result.pages, self.pages[full:]])
        else:
            self.pages = result.pages
        self.num_tree_pages = full
        return result.node
