"""Belady's offline-optimal eviction, plugged into the RadixCache's policy interface.

Evicting the page whose next use is farthest in the future is optimal for a cache that
must admit every request (Belady 1966). In a prefix tree any request that uses a page
uses all its ancestors, so next use never decreases with depth: the farthest page is the
last page of some evictable leaf, and evicting it is always legal. The unit is the page,
not the leaf: a leaf's head pages may be needed much sooner than its tail, so the replay
evicts one page at a time (``PageAtATimeMemory``) and the leaf is re-ranked by its new
last page after each. A leaf's rank is the next use of its last page, looked up in an
index built from the whole trace before the replay starts.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable

import numpy as np

from radixserve.cache.eviction import EvictionPolicy
from radixserve.cache.eviction import make_policy as cache_policy
from radixserve.cache.memory import PagedMemory
from radixserve.cache.page_allocator import OutOfPages
from radixserve.cache.token_keys import token_at

from .workload import Workload

NEVER = 1 << 62  # next use of a key no later request touches


class NextUseIndex:
    """For each symbol, the sorted indices of the requests that can match it.

    ``extents`` (optional, parallel to the symbols) says how many leading tokens of the
    symbol a request can match: token mode indexes whole blocks, and a request whose match
    is capped (at L-1 tokens) inside its last block uses only that block's head.
    """

    def __init__(self, symbols_per_request: Iterable[np.ndarray],
                 extents_per_request: Iterable[np.ndarray] | None = None):
        arrays = [np.asarray(s, dtype=np.int64) for s in symbols_per_request]
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        owner = np.repeat(np.arange(len(arrays), dtype=np.int64),
                          [len(a) for a in arrays])
        order = np.argsort(flat, kind="stable")  # stable: request order within a symbol
        flat, owner = flat[order], owner[order]
        self.num_symbols = int(flat[-1]) + 1 if len(flat) else 0
        starts = np.searchsorted(flat, np.arange(self.num_symbols + 1), side="left")
        # Python lists: bisect on them is several times faster than on numpy arrays.
        self._uses: list[int] = owner.tolist()
        self._starts: list[int] = starts.tolist()
        self._extents: list[int] | None = None
        if extents_per_request is not None:
            ext = np.concatenate([np.asarray(e, dtype=np.int64)
                                  for e in extents_per_request])
            self._extents = ext[order].tolist()

    def next_use(self, symbol: int, now: int, offset: int = 0) -> int:
        """First request index > now that can match ``symbol`` through ``offset``."""
        if not 0 <= symbol < self.num_symbols:
            return NEVER
        lo, hi = self._starts[symbol], self._starts[symbol + 1]
        j = bisect_right(self._uses, now, lo, hi)
        if self._extents is not None:
            while j < hi and self._extents[j] <= offset:   # rare: capped last blocks
                j += 1
        return self._uses[j] if j < hi else NEVER

    @classmethod
    def for_workload(cls, workload: Workload, capacity_pages: int | None = None
                     ) -> tuple[NextUseIndex, Callable[[int, int], int]]:
        """The index and the next-use function of a node's last key, for either mode.

        A request whose pages exceed ``capacity_pages`` never fits, so it uses nothing: it
        is left out of the index (keeping a page for it would waste the room).
        """
        space = workload.space
        trace = workload.trace
        ps = space.page_size
        fits = [capacity_pages is None or math.ceil((L + m) / ps) <= capacity_pages
                for L, m in workload.lengths()]
        if space.mode == "block":
            index = cls(np.asarray(item.prompt_keys)[0::2][: math.ceil(
                (item.prompt_len - 1) / ps) if fit else 0]
                for item, fit in zip(workload, fits))
            # A block-mode edge ends with [symbol, PAGE_MARK]: its last page's symbol.
            return index, lambda key, now: index.next_use(token_at(key, -2), now)
        if trace.format != "hash":
            raise ValueError("the Belady optimal in token mode needs a hash-id trace; "
                             "use --mode block for text traces")
        bs = trace.block_size
        blocks, extents = [], []
        for r, fit in zip(trace.requests, fits):
            matchable = r.input_length - 1
            n = math.ceil(matchable / bs) if fit else 0
            blocks.append(np.asarray(r.hash_ids[:n]))
            ext = np.full(n, bs, dtype=np.int64)
            if n:
                ext[-1] = matchable - (n - 1) * bs
            extents.append(ext)
        index = cls(blocks, extents)

        def next_use(key, now):
            # A synthesized token names its block; output tokens fall past every block id.
            # The leaf's last page is used by any request that matches its first token
            # (even a copy-on-write match), so look up that token's offset in the block.
            # (When the page size does not divide the block size a page can start in the
            # previous block; this is then an approximation.)
            block, offset = divmod(token_at(key, -1), bs)
            return index.next_use(block, now, max(0, offset - ps + 1))

        return index, next_use


class BeladyPolicy(EvictionPolicy):
    """Evict the leaf whose last key is next used farthest in the future (offline optimal).

    ``set_now(i)`` is called by the replayer before request i; a leaf's key is computed
    when it becomes evictable, and a leaf's next use always re-keys it (the request
    that uses it matches, locks and unlocks it), so keys never go stale.
    """

    name = "belady"
    key_is_stable = False               # it reads the replay's clock (`set_now`)
    evicts_pages_one_at_a_time = True   # the replay gives it a PageAtATimeMemory

    def __init__(self, index: NextUseIndex, next_use: Callable[[int, int], int]):
        self.index = index
        self.next_use = next_use      # (a node's key, now) -> request index or NEVER
        self.now = -1

    def set_now(self, request_index: int) -> None:
        self.now = request_index

    def key(self, node) -> int:
        return -self.next_use(node.key, self.now)


class DeadFirstPolicy(BeladyPolicy):
    """LRU, except that pages no later request uses go first: an offline bound.

    What a perfect "dead on arrival" predictor (admission filter) could add to LRU, with
    LRU's order everywhere else. It knows only *whether* a page is used again, not when;
    the gap between it and Belady is what only a prediction of reuse times could close.
    Page at a time, as Belady: a leaf whose tail is dead loses that tail first and is then
    ranked by its new last page.
    """

    name = "dead-first"

    def key(self, node) -> int:
        dead = self.next_use(node.key, self.now) >= NEVER
        return node.last_access - NEVER if dead else node.last_access


# The replay's offline policies: they read the trace's future, so they need the whole
# request order in advance (no cluster simulation, where routing decides it).
OFFLINE_POLICIES: dict[str, type[BeladyPolicy]] = {
    BeladyPolicy.name: BeladyPolicy, DeadFirstPolicy.name: DeadFirstPolicy}


class PageAtATimeMemory(PagedMemory):
    """PagedMemory that evicts one page per ranking, for the Belady optimal.

    ``RadixCache.evict(n)`` takes whole leaves in policy order, so a leaf whose last page is
    needed last also loses head pages that other leaves' pages outrank. Asking it for one
    page at a time trims the best leaf by its last page and re-ranks it by the page now
    last, so every evicted page is the farthest-next-use page of the moment.
    """

    def alloc_after(self, head: np.ndarray, n: int) -> np.ndarray:
        free = self.num_free
        short = n - free
        if short > 0:
            evictable = self.tree.evictable_tokens // self.page_size
            if short > evictable:
                raise OutOfPages(n, free + evictable)
            for _ in range(short):
                self.free(self.tree.evict(self.page_size))
        return super().alloc_after(head, n)           # from the free list alone now


class _TokenView:
    """A node as a token-mode policy would see it: sizes in tokens, not block-mode keys."""

    __slots__ = ("id", "last_access", "hit_count", "depth", "num_tokens", "namespace")

    def __init__(self, node, tokens_per_key_pair: int):
        self.id = node.id
        self.last_access = node.last_access
        self.hit_count = node.hit_count
        self.namespace = node.namespace
        self.depth = node.depth // 2 * tokens_per_key_pair
        self.num_tokens = node.num_tokens // 2 * tokens_per_key_pair


class TokenUnitPolicy(EvictionPolicy):
    """Block mode: rank leaves with a cache policy that reads sizes (GDSF) in tokens, so that
    it orders them exactly as it would in token mode."""

    def __init__(self, inner: EvictionPolicy, page_size: int):
        self.inner = inner
        self.name = inner.name
        self.page_size = page_size

    def key(self, node):
        return self.inner.key(_TokenView(node, self.page_size))


def make_policy(name: str, workload: Workload,
                capacity_pages: int | None = None) -> EvictionPolicy:
    """A fresh policy for one replay: the offline ones (OFFLINE_POLICIES) are built here,
    the others by the cache."""
    offline = OFFLINE_POLICIES.get(name)
    if offline is not None:
        return offline(*NextUseIndex.for_workload(workload, capacity_pages))
    policy = cache_policy(name)
    if workload.space.mode == "block":
        if hasattr(policy, "tokens_per_key"):    # reads sizes itself (the adaptive policy)
            policy.tokens_per_key = workload.space.page_size / 2
            return policy
        return TokenUnitPolicy(policy, workload.space.page_size)
    return policy
