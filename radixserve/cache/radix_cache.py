"""RadixCache: a radix tree over token ids that owns the KV pages holding them.

Every edge (TreeNode) carries token ids and the int32 ids of the pages that hold their KV,
`len(key) == len(pages) * page_size`: the tree stores whole pages only. Children are keyed by
their first token (page_size 1) or first page of tokens (page_size > 1). Each namespace has
its own root, so different namespaces never share a node.

Who owns a page, at every moment
--------------------------------
Exactly one of:
1. the free list (PageAllocator);
2. the tree: from the `insert` that adopted it until `evict` or `flush` hands it back to the
   caller, who frees it -- or, inside `PagedMemory.alloc`, passes it straight to the request
   that asked (tree -> private, never both);
3. one request ("private"): from `alloc` until `insert` adopts it or the request frees it.

Shared use of tree pages is expressed by locks, never by copies or reference counts on the
pages themselves: `lock(node)` adds one to `lock_ref` on node..root, and only leaves with
`lock_ref == 0` are evictable. A request's life -- match, lock, allocate, copy-on-write,
insert, free duplicates, re-lock, release -- is written once, in `PrefixLease`
(prefix_lease.py), which the engine and the replay tool both use.

Copy-on-write (page_size > 1)
-----------------------------
A match may end inside a page: the first `cow_tokens` tokens of tree page `cow_page` equal
the next tokens of the query, but the page as a whole does not. The tree never shares a page
partially, so the request copies those tokens' KV into a fresh private page and computes
the rest of that page itself. Protocol: `lock(m.node)` first -- the handle is the node that
holds `cow_page`, so the source page cannot be evicted -- then allocate the destination
(the allocation may evict), then copy (PrefixLease issues a `CopyOrder`; the engine's
runner executes it with `KVPool.copy_prefix` on the compute thread before the step's
forward), then compute from `m.matched_tokens` on. The copy is private and is adopted by a later insert
like any other new page (or freed as a duplicate if an equal page got there first).
vLLM and SGLang drop such a partial hit (up to page_size - 1 tokens per request).

Keys are token ids packed as int64 bytes (token_keys.py): an edge (bytes) is tested against
a request's tokens with `edge.startswith(view[a:b])` (memcmp; the request's ids are read in
place through a memoryview when they are an `array('q')` or int64 numpy array, packed
lazily otherwise), and a mismatch inside an edge is located by bisection on the same test. Positions inside the loops are
byte offsets. Insert skips the token comparison of an edge when the caller passes exactly
the tree's page ids for it: a page holds the KV of one token sequence, so equal page ids at
the same position prove equal tokens (the caller got them from match_prefix on the same
tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .eviction import EvictionPolicy, make_policy
from .eviction_queue import EvictionQueue
from .invariants import check_tree
from .namespaces import in_namespace
from .tier_types import Tier, TierHooks
from .tree_observer import TreeObserver
from .token_keys import ITEM_BYTES, LazyKey, TokenIds, count, pack
from .tree_node import TreeNode

__all__ = ["CacheLockedError", "InsertResult", "MatchResult", "PoolOnly", "RadixCache",
           "EMPTY_PAGES", "join_pages"]

EMPTY_PAGES = np.empty(0, dtype=np.int32)
EMPTY_PAGES.flags.writeable = False
_INT32 = np.dtype(np.int32)
_ITEM = ITEM_BYTES
_FIRST_WINDOW = 512         # tokens compared at once before the windows grow
_WHOLE_EDGE = 4096          # edges up to this many tokens are compared in one window
_POOL = Tier.POOL           # (a module constant: read on hot paths)


class CacheLockedError(RuntimeError):
    """An operation that needs the whole tree (flush) while requests hold locks on it."""


@dataclass(slots=True)
class MatchResult:
    matched_tokens: int     # = len(pages) * page_size + cow_tokens
    pages: np.ndarray       # int32 ids of the fully matched pages, in order (read-only)
    node: TreeNode          # lock handle: deepest node the match touched (covers cow_page)
    cow_page: int = -1      # page_size > 1: a tree page whose first cow_tokens tokens also
    cow_tokens: int = 0     #   match; the caller copies them into a fresh private page
    lower: tuple = ()       # tiers: the host/disk nodes continuing the match past `node`,
                            #   whole edges, in order (not locked; PrefixLease.load)

    def lower_tokens(self, tier: Tier | None = None) -> int:
        """Tokens of the match held by lower tiers (by one tier when given)."""
        return sum(n.num_tokens for n in self.lower if tier is None or n.tier == tier)


@dataclass(slots=True)
class InsertResult:
    already_cached: int     # leading tokens that were in the tree before this insert; the
                            #   caller's own pages for them are duplicates it must free
                            #   (except those it got from the tree): see duplicates()
    pages: np.ndarray       # the tree's page ids for the whole inserted sequence (the
                            #   caller's own array when they are the same ids)
    node: TreeNode          # the node ending the inserted sequence
    hint_used: bool = False  # the walk began at `start` (False: no hint, or it did not fit)

    def duplicates(self, own_pages: np.ndarray) -> np.ndarray:
        """The caller's pages (for the same sequence) that the tree did not adopt: free them.

        Past `already_cached` the tree adopted the caller's own ids, so a position-wise
        comparison over the whole sequence finds exactly the duplicates. This is the one
        place duplicates are found (PrefixLease.extend frees what it returns).
        """
        if own_pages is self.pages:
            return EMPTY_PAGES
        own = np.asarray(own_pages, dtype=np.int32)
        if own.shape != self.pages.shape:
            raise ValueError(f"own_pages has {own.shape}, the inserted sequence {self.pages.shape}")
        if own.tobytes() == self.pages.tobytes():      # the usual case, at memcmp speed
            return EMPTY_PAGES
        return own[own != self.pages]


def _common_tokens(key: LazyKey, pos: int, edge: TreeNode, end_b: int, edge_b: int) -> int:
    """Tokens shared by the key from byte `pos` (up to byte `end_b`) and the start of the
    node's edge (`edge_b` bytes long).

    Compares windows growing 4x from _FIRST_WINDOW tokens, so neither a key that must be
    packed nor an edge still held as the caller's ids is packed much beyond the first
    difference, then bisects inside the window that differs. The edge side is bytes and
    the key side a memoryview slice: `edge.startswith(key[a:b], offset)` is one memcmp.
    """
    n = min(edge_b, end_b - pos) // _ITEM
    buf, packed = key.buf, edge._key
    stop = pos + n * _ITEM
    if packed is not None and len(buf) >= stop and packed.startswith(buf[pos:stop]):
        return n        # both sides readable that far (the usual case): one memcmp
    lo = 0
    # An edge up to _WHOLE_EDGE tokens is compared in one go (if it differs early, at most
    # that much was packed in vain). What is readable on both sides costs nothing to
    # compare: the key as far as it is packed (all of it when read in place) against a
    # packed edge; a pending edge is packed window by window.
    width = max(_FIRST_WINDOW, n if n <= _WHOLE_EDGE else 0)
    if packed is not None:
        width = max(width, (len(buf) - pos) // _ITEM)
    while lo < n:
        hi = min(n, lo + width)
        buf = key.upto(pos + hi * _ITEM)
        at = pos + lo * _ITEM
        edge_bytes, offset = edge.window(lo, hi)
        if not edge_bytes.startswith(buf[at:pos + hi * _ITEM], offset):
            # Tokens lo..a are equal and the answer lies in [a, b]: each probe compares only
            # tokens a..mid, so the bisection reads the window about twice in all (comparing
            # from lo every time read it log2(window) times: ~0.4 ms on a 32k-token window).
            a, b = lo, hi - 1
            while a < b:
                mid = (a + b + 1) >> 1
                if edge_bytes.startswith(buf[pos + a * _ITEM:pos + mid * _ITEM],
                                         offset + (a - lo) * _ITEM):
                    a = mid
                else:
                    b = mid - 1
            return a
        lo = hi
        width <<= 2
    return n


def _key_and_limit(tokens: TokenIds, max_tokens: int | None) -> tuple[LazyKey, int]:
    """The (lazily packed) key and how many of its tokens a match may use."""
    limit = count(tokens)
    if max_tokens is not None and max_tokens < limit:
        limit = max(max_tokens, 0)
    return LazyKey(tokens, 0, limit), limit


def _keepable(a: np.ndarray, lasting: np.ndarray | None) -> bool:
    """May the tree keep `a` as a view instead of a copy? Only if no one can write into it
    (neither it nor any array it views is writeable), and it would pin little else: the
    buffer it views holds at most one more `a` or one more memory page (4 KiB) beyond it,
    or is `lasting` (a buffer that lives as long as the tree anyway). A leaf viewing a
    request's whole page table would pin the ids of the matched prefix too (2,048 ids kept
    alive for a 384-id leaf on a shared system prompt), and every request's table would
    stay in fresh, never-reused memory."""
    size = a.nbytes
    while True:
        if a.flags.writeable:
            return False
        base = a.base
        if base is None:
            return a is lasting or a.nbytes - size <= max(size, _PAGE_BYTES)
        if type(base) is bytes:
            return len(base) - size <= max(size, _PAGE_BYTES)
        if not isinstance(base, np.ndarray):
            return False                # some other buffer: maybe writeable through it
        a = base


_PAGE_BYTES = 4096


def join_pages(parts: list[np.ndarray]) -> np.ndarray:
    """int32 page-id arrays (contiguous) end to end, read-only; one part is returned as is.

    `bytes.join` + `np.frombuffer`, not `np.concatenate`: a plain memcpy per part without
    numpy's dispatch and casting loop, 1.5x faster on the cold 10k-id arrays that evicted
    edges hand over; the result is read-only, as page-id arrays are (values nobody writes).
    """
    if len(parts) == 1:
        return parts[0]
    return np.frombuffer(b"".join(parts), _INT32) if parts else EMPTY_PAGES


class RadixCache:
    def __init__(self, page_size: int = 1, policy: str | EvictionPolicy = "lru"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._page_bytes = page_size * _ITEM      # a child's dict key: its first page
        self.policy = make_policy(policy)     # (sets _rekey_trimmed: the setter below)
        self._ns_roots: dict[str | None, TreeNode] = {}
        # Unlocked leaves, smallest policy key first (`node.evict_key` is a queued node's entry).
        self._evictable = EvictionQueue()
        self._next_id = 1
        self._clock = 0
        self._total = 0
        self._evictable_tokens = 0
        self._num_nodes = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evicted_tokens = 0
        self._lasting_ids: np.ndarray | None = None     # see keep_views_into
        # Handle for a match in a namespace that holds nothing: locking it is a no-op.
        self._empty_root = TreeNode(0, b"", EMPTY_PAGES, None, 0, None)
        # What happens below the KV pool (tier_types.TierHooks): by default nothing, an
        # evicted page is gone; LowerTiers (tiers.py) attaches host/disk tiers. The O(1)
        # counters above count the KV pool's tokens only.
        self.tiers: TierHooks = PoolOnly(self)
        self._pool_only = True      # evict drops pages itself (no hook call per leaf)
        # Who follows the tokens held (tree_observer.py: the KV events publisher); None: nobody.
        self.observer: TreeObserver | None = None

    def attach_tiers(self, hooks: TierHooks) -> None:
        """Put tiers below the KV pool (before anything is cached; once)."""
        if not isinstance(self.tiers, PoolOnly) or self.num_nodes:
            raise ValueError("attach the tiers to an empty tree without tiers")
        self.tiers = hooks
        self._pool_only = False

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: EvictionPolicy) -> None:
        """Set the eviction policy; whether a trimmed leaf is re-keyed follows it (a
        policy set on a tree that had LRU must re-key its trimmed leaves)."""
        self._policy = policy
        self._rekey_trimmed = getattr(policy, "key_reads_size", True)

    def attach_observer(self, observer: TreeObserver) -> None:
        """Tell `observer` about every token stored, moved or removed from now on (once,
        before anything is cached, so it never misses a node)."""
        if self.observer is not None or self.num_nodes:
            raise ValueError("attach the observer to an empty tree without one")
        self.observer = observer

    def tier_changed(self, node: TreeNode, src: Tier) -> None:
        """A node's pages moved between lower tiers (LowerTiers pushing host to disk)."""
        if self.observer is not None:
            self.observer.moved(node, src)

    @property
    def has_lower_tiers(self) -> bool:
        return not isinstance(self.tiers, PoolOnly)

    def keep_views_into(self, ids: np.ndarray) -> None:
        """Keep page-id arrays that view `ids` (read-only, alive as long as the tree: the
        free list's never-freed ids) as views, however small a part of it they are."""
        self._lasting_ids = ids

    # ------------------------------------------------------------------ counters (O(1))
    @property
    def total_tokens(self) -> int:
        """Tokens the tree holds (evictable + locked)."""
        return self._total

    @property
    def evictable_tokens(self) -> int:
        """Tokens in unlocked nodes: all of them can go, leaves first."""
        return self._evictable_tokens

    @property
    def locked_tokens(self) -> int:
        return self._total - self._evictable_tokens

    @property
    def num_nodes(self) -> int:
        """Token-holding nodes (namespace roots not counted)."""
        return self._num_nodes

    @property
    def query_tokens(self) -> int:
        return self._query_tokens

    @property
    def hit_tokens(self) -> int:
        return self._hit_tokens

    @property
    def evicted_tokens(self) -> int:
        """Tokens handed back by evict() so far (not by flush())."""
        return self._evicted_tokens

    @property
    def clock(self) -> int:
        """The logical clock: bumped once per match_prefix, insert and evict."""
        return self._clock

    # ------------------------------------------------------------------ match
    def match_prefix(self, tokens: TokenIds, namespace: str | None = None,
                     max_tokens: int | None = None) -> MatchResult:
        """Longest cached prefix of `tokens` (at most `max_tokens`), splitting the edge it ends in."""
        key, limit = _key_and_limit(tokens, max_tokens)
        self._clock += 1
        self._query_tokens += limit
        node = self._ns_roots.get(namespace)
        if node is None or limit == 0:
            return MatchResult(0, EMPTY_PAGES, node or self._empty_root)
        ps = self.page_size
        limit_b = limit * _ITEM
        node, pos, parts, partial, m, _, missed = self._walk(node, key,
                                                             limit_b - limit_b % self._page_bytes,
                                                             limit_b)
        cow_node: TreeNode | None = None
        cow_tokens = 0
        if partial is not None:
            # The match ends inside this edge (its first page matched, so m >= page_size).
            m_full = m - m % ps
            node = self.split_at(partial, m_full)
            parts.append(node.pages)
            pos += m_full * _ITEM
            if m > m_full:
                cow_node, cow_tokens = partial, m - m_full
        if ps > 1 and cow_node is None and pos < limit_b and node.cow_index and (
                missed is None or missed[:_ITEM] in node.cow_index):   # else: no candidate
            cow_node, cow_tokens = self._best_cow(node, key, pos, limit_b, missed)
        if cow_node is not None and cow_node.tier != _POOL:
            cow_node, cow_tokens = None, 0  # tiers: its KV is not in the pool to copy
        handle = cow_node or node
        self._touch(handle, hit=True)
        lower: tuple = ()
        if handle.tier != _POOL:                # tiers: the match runs on past the KV pool
            handle, lower, parts = self._lower_tail(handle, parts)
            pos = handle.depth * _ITEM
        if handle.evict_key is not None:
            self._rekey(handle)
        matched = pos // _ITEM + cow_tokens
        self._hit_tokens += matched
        cow_page = cow_node.pages.item(0) if cow_node is not None else -1
        return MatchResult(matched, join_pages(parts), handle, cow_page, cow_tokens, lower)

    @staticmethod
    def _lower_tail(node: TreeNode, parts: list) -> tuple[TreeNode, tuple, list]:
        """Split a match path ending in a lower tier at the last KV-pool node: (that node,
        the lower nodes after it, the KV-pool part of `parts`)."""
        lower = []
        while node.tier != _POOL:
            lower.append(node)
            node = node.parent
        lower.reverse()
        return node, tuple(lower), parts[:len(parts) - len(lower)]

    def peek_prefix(self, tokens: TokenIds, namespace: str | None = None,
                    max_tokens: int | None = None) -> int:
        """What match_prefix would return as matched_tokens, with no side effect at all.

        No split, no counters, no access time: for schedulers ranking waiting requests.
        """
        key, limit = _key_and_limit(tokens, max_tokens)
        node = self._ns_roots.get(namespace)
        if node is None or limit == 0:
            return 0
        limit_b = limit * _ITEM
        node, pos, _, partial, m, _, missed = self._walk(node, key,
                                                         limit_b - limit_b % self._page_bytes,
                                                         limit_b)
        if partial is not None:
            # Full pages of the edge plus the copy-on-write part of the next: pos + m.
            return pos // _ITEM + m
        if self.page_size > 1 and pos < limit_b and node.cow_index:
            return pos // _ITEM + self._best_cow(node, key, pos, limit_b, missed)[1]
        return pos // _ITEM

    def _walk(self, node: TreeNode, key: LazyKey, full_b: int, end_b: int,
              pages: np.ndarray | None = None, first_page: int = 0) -> tuple:
        """Follow the edges that the key matches whole and that end by byte `full_b`.

        The one edge walk of match, peek and insert; no side effects. Tokens are compared
        up to byte `end_b` (>= full_b), so a partly matched child comes with its matched
        token count. With `pages` (the caller's ids, `first_page` being the page at the
        key's start), an edge whose page ids equal the caller's is taken without comparing
        tokens: a page holds the KV of one token sequence, so equal ids at the same
        position prove equal tokens.

        Returns (node, pos, parts, partial, partial_tokens, same_pages, missed): the last
        node whose edge matched whole, the byte offset after it, the page arrays of the
        edges passed, the child whose edge matched only in part (or None) with its matched
        token count, whether every edge passed was taken on the caller's own page ids, and
        the key's first page at `pos` when no child is filed under it (else None: insert
        files its new leaf under it without slicing the key again). (A plain tuple: this
        runs on every match, peek and insert.)
        """
        pb = self._page_bytes
        parts: list[np.ndarray] = []
        same = True
        pos = 0
        while pos < full_b:
            buf = key.buf
            if len(buf) < pos + pb:
                buf = key.upto(pos + pb)
            head = buf[pos:pos + pb].tobytes()
            child = node.children.get(head)
            if child is None:
                return node, pos, parts, None, 0, same, head
            cp = child.pages
            end = pos + len(cp) * pb
            if pages is not None and end <= full_b:
                p0 = first_page + pos // pb
                if pages[p0:p0 + len(cp)].tobytes() == cp.tobytes():
                    parts.append(cp)
                    node, pos = child, end
                    continue
            edge = child._key
            if not (end <= full_b and edge is not None and len(buf) >= end
                    and edge.startswith(buf[pos:end])):     # the usual hit: one memcmp
                m = _common_tokens(key, pos, child, end_b, end - pos)
                if end > full_b or pos + m * _ITEM < end:
                    return node, pos, parts, child, m, same, None
                if child._pending is not None:
                    child.pack()    # matched whole: likely shared, so compared again
            same = False
            parts.append(cp)
            node, pos = child, end
        return node, pos, parts, None, 0, same, None

    def _best_cow(self, node: TreeNode, key: LazyKey, pos: int, limit_b: int,
                  missed: bytes | None = None) -> tuple[TreeNode | None, int]:
        """The child whose first page shares the most tokens with key[pos:limit_b]
        (`missed`: the key's page at `pos`, when the walk has it packed already)."""
        best, best_len = None, 0
        end_b = min(limit_b, pos + self._page_bytes)       # within the first page only
        first = missed[:_ITEM] if missed is not None else \
            key.upto(pos + _ITEM)[pos:pos + _ITEM].tobytes()
        for child in node.cow_index.get(first, ()):
            n = _common_tokens(key, pos, child, end_b, len(child.pages) * self._page_bytes)
            if n > best_len or (n == best_len and best is not None and child.id < best.id):
                best, best_len = child, n
        return best, best_len

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: TokenIds, pages: np.ndarray, namespace: str | None = None,
               start: TreeNode | None = None) -> InsertResult:
        """Add `tokens` held by `pages` (whole pages); the tree adopts the pages it lacked.

        `start` (optional): a node the caller locked and whose pages it holds at the same
        positions in `pages` (its lock handle from an earlier match or insert of these
        tokens). The walk then begins there instead of comparing the prefix again. When
        it does not fit (not locked, evicted, another namespace, or the caller's page at
        the node's last position is not the node's last page) the walk starts at the root
        and the result says so: `hint_used` is False.
        """
        pages = self._check_pages(tokens, pages)
        self._clock += 1
        hint_used = start is not None and self._holds_prefix(start, pages, namespace)
        if hint_used:
            node = start
        else:
            node = self._ns_roots.get(namespace)
            if node is None:
                if len(pages) == 0:
                    return InsertResult(0, EMPTY_PAGES, self._empty_root)
                node = self._ns_roots[namespace] = self._new_node(b"", EMPTY_PAGES, None, 0,
                                                                  namespace)
        base = node.depth                   # tokens known to be in the tree
        n = len(pages) * self.page_size
        key = LazyKey(tokens, base, n - base)   # the rest; positions below are offsets in it
        nb = (n - base) * _ITEM
        first_page = base // self.page_size
        node, pos, parts, partial, m, same_pages, head = self._walk(node, key, nb, nb, pages,
                                                                    first_page)
        if partial is not None:             # the key leaves the tree inside this edge
            m -= m % self.page_size
            node = self.split_at(partial, m)
            same_pages = False
            parts.append(node.pages)
            pos += m * _ITEM
        if node.tier != _POOL:              # tiers: the path runs into host/disk nodes
            self._promote_path(node, pages, parts)
            same_pages = False
        self._touch(node, hit=False)
        already = base + pos // _ITEM
        if pos < nb:
            at = first_page + pos // self._page_bytes
            node = self._add_leaf(node, key, pos, pages[at:] if at else pages, head)
            parts.append(node.pages)
        elif node.evict_key is not None:
            self._rekey(node)
        if same_pages:      # the tree's ids are the caller's own (the usual case): no copy
            return InsertResult(already, pages, node, hint_used)
        if first_page:
            parts.insert(0, pages[:first_page])
        return InsertResult(already, join_pages(parts), node, hint_used)

    def _check_pages(self, tokens: TokenIds, pages: np.ndarray) -> np.ndarray:
        """`pages` as int32; ValueError unless they hold exactly `tokens` in whole pages."""
        if type(pages) is not np.ndarray:
            pages = np.asarray(pages)
        if pages.dtype is not _INT32 and pages.dtype != _INT32:     # `is`: the usual case
            pages = pages.astype(np.int32)
        n = count(tokens)
        if pages.ndim != 1 or n != len(pages) * self.page_size:
            raise ValueError(f"insert needs whole pages: {n} tokens, {pages.shape} "
                             f"pages of {self.page_size} tokens")
        return pages

    def _add_leaf(self, parent: TreeNode, key: LazyKey, pos: int, pages: np.ndarray,
                  first: bytes | None) -> TreeNode:
        """A new evictable leaf under `parent` holding the key from byte `pos` in `pages`
        (kept as a view when that is safe and cheap, see `_keepable`; else copied), filed
        under `first` (its first page, packed; None: sliced from the key)."""
        if parent.evict_key is not None:     # an evictable leaf gets a child: no longer a leaf
            self._remove_evictable(parent)
        if not _keepable(pages, self._lasting_ids):
            pages = pages.copy()
            pages.flags.writeable = False
        packed, pending = key.edge_from(pos)
        n = len(pages) * self.page_size
        leaf = self._new_node(packed, pages, parent, parent.depth + n, parent.namespace,
                              last_access=self._clock, pending=pending)
        if first is None:
            pb = self._page_bytes
            first = key.upto(pos + pb)[pos:pos + pb].tobytes()
        self._add_child(parent, leaf, first)
        self._num_nodes += 1
        self._total += n
        self._evictable_tokens += n
        self._make_evictable(leaf)
        if self.observer is not None:
            self.observer.stored(leaf)
        return leaf

    def _touch(self, node: TreeNode, hit: bool) -> None:
        """Stamp node..root with the clock (and count a hit on each when `hit`)."""
        clock = self._clock
        while node.depth:
            node.last_access = clock
            if hit:
                node.hit_count += 1
            if node.tier is not _POOL:      # a host/disk node: its tier's queue re-sorts it
                self.tiers.rekey(node)
            node = node.parent

    def _holds_prefix(self, node: TreeNode, pages: np.ndarray, namespace: str | None) -> bool:
        """Is `node` a live, locked node whose last page the caller holds at its position?"""
        if node.parent is None or not node.depth or node.namespace != namespace \
                or node.lock_ref <= 0:
            return False
        last = node.depth // self.page_size - 1
        return last < len(pages) and pages.item(last) == node.pages.item(-1)

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """Protect node..root from eviction (one more holder)."""
        if node.parent is None and node.depth:
            raise ValueError(f"stale handle: {node} was evicted or flushed")
        freed_from_pool = 0
        while node.depth:
            if node.lock_ref == 0:
                if node.evict_key is not None:
                    self._remove_evictable(node)
                if node.tier == _POOL:
                    freed_from_pool += node.num_tokens
            node.lock_ref += 1
            node = node.parent
        self._evictable_tokens -= freed_from_pool

    def unlock(self, node: TreeNode) -> None:
        """Drop one holder of node..root; nodes reaching zero become evictable again."""
        if node.depth and node.lock_ref <= 0:
            raise RuntimeError(f"unlock without lock: {node}")
        released = 0
        while node.depth:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.tier == _POOL:
                released += node.num_tokens
                if not node.children or (not self._pool_only
                                         and self._no_pool_children(node)):
                    self._make_evictable(node)
            node = node.parent
        self._evictable_tokens += released

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> np.ndarray:
        """Free at least `num_tokens` tokens' worth of pages (fewer only if nothing is left).

        Takes unlocked leaves in policy order. Without lower tiers a leaf larger than what
        is still needed loses only its tail pages (its head, the more shared part, stays);
        with them, each leaf goes to the tier hooks, which split that tail off and demote
        it. Returns the freed ids; the caller gives them to the allocator.
        """
        return join_pages(self.evict_pages(num_tokens))

    def evict_pages(self, num_tokens: int) -> list[np.ndarray]:
        """`evict`, with the freed ids as the evicted edges' (read-only) arrays, in order:
        a caller that concatenates them with other pages copies them once.

        Without lower tiers the loop is written out here, not run through a hook per leaf:
        this is the hot path of eviction-heavy streams (page size 1 evicts leaves on most
        requests), where a hook call, a queue discard and a lower-tier parent check per
        leaf cost 10-30% (issue 32's regression, found by call counts)."""
        if num_tokens <= 0:
            return []
        self._clock += 1
        freed: list[np.ndarray] = []
        if not self._pool_only:
            remaining = self._evict_to_tiers(num_tokens, freed)
            self._evicted_tokens += num_tokens - remaining
            return freed
        ps = self.page_size
        evictable = self._evictable
        observer = self.observer
        remaining = num_tokens
        while remaining > 0:
            leaf = evictable.first()
            if leaf is None:
                break
            need = -(-remaining // ps)
            npages = len(leaf.pages)
            if npages > need:
                # Only the tail goes: the leaf stays in the set, re-sorted only if its
                # policy key may have changed (LRU's and LFU's do not read the length).
                keep = npages - need
                gone = need * ps
                if observer is not None:
                    observer.trimmed(leaf, keep * ps)
                freed.append(leaf.pages[keep:])
                leaf.pages = leaf.pages[:keep]
                leaf.truncate(keep * ps)
                leaf.depth -= gone
                self._total -= gone
                self._evictable_tokens -= gone
                remaining -= gone
                if self._rekey_trimmed:
                    self._rekey(leaf)
                continue
            evictable.pop()
            freed.append(leaf.pages)
            remaining -= leaf.num_tokens
            self._drop_pool_leaf(leaf)
        self._evicted_tokens += num_tokens - remaining
        return freed

    def _evict_to_tiers(self, remaining: int, freed: list[np.ndarray]) -> int:
        """Eviction with lower tiers: each leaf goes to `TierHooks.evict_leaf`."""
        ps = self.page_size
        evictable = self._evictable
        evict_leaf = self.tiers.evict_leaf
        while remaining > 0:
            leaf = evictable.first()
            if leaf is None:
                break
            pages = evict_leaf(leaf, -(-remaining // ps))
            freed.append(pages)
            remaining -= len(pages) * ps
        return remaining

    def flush(self) -> np.ndarray:
        """Drop the whole tree and return its pages; refused while any request holds a lock."""
        if self.locked_tokens:
            raise CacheLockedError(
                f"cannot flush the prefix cache: {self.locked_tokens} cached tokens are locked "
                f"by running requests; wait until they finish (or abort them)")
        pages = self.tree_page_ids()
        nodes = list(self.iter_nodes())
        self.tiers.forget(nodes)
        if self.observer is not None:
            self.observer.cleared()
        for node in nodes:
            node.parent = None          # stale: a late lock() on it raises
            node.evict_key = None
        self._ns_roots.clear()
        self._evictable.clear()
        self._total = self._evictable_tokens = self._num_nodes = 0
        return pages

    def flush_namespace(self, namespace: str | None) -> np.ndarray:
        """Drop one namespace and those nested under it (`namespace/...`), return their
        pages; refused (CacheLockedError) while a request holds a lock in any of them.
        Other namespaces are untouched: a tenant flushes only its own prefixes."""
        roots = self._namespace_roots(namespace)
        nodes = [n for root in roots for n in self._subtree(root)]
        locked = sum(n.num_tokens for n in nodes if n.lock_ref)
        if locked:
            raise CacheLockedError(
                f"cannot flush namespace {namespace!r}: {locked} cached tokens are locked by "
                f"running requests; wait until they finish (or abort them)")
        pool = [n for n in nodes if n.tier == _POOL]
        if self.observer is not None:       # parents first, all still linked
            for node in nodes:
                self.observer.removed(node)
        self.tiers.forget(nodes)        # the lower ones' slots; kept disk copies of all
        for node in nodes:
            if node.evict_key is not None:
                self._remove_evictable(node)
            node.parent = None          # stale: a late lock() on it raises
            self._num_nodes -= 1
        for node in pool:
            self._total -= node.num_tokens
            self._evictable_tokens -= node.num_tokens
        for root in roots:
            del self._ns_roots[root.namespace]
        return join_pages([EMPTY_PAGES, *(n.pages for n in pool)])

    def namespace_counts(self, namespace: str | None) -> dict[str, int]:
        """`cached_tokens`, `locked_tokens` and `nodes` of one namespace and those nested
        under it (a walk over them: for stats routes, not hot paths)."""
        nodes = [n for root in self._namespace_roots(namespace) for n in self._subtree(root)]
        return {"cached_tokens": sum(n.num_tokens for n in nodes),
                "locked_tokens": sum(n.num_tokens for n in nodes if n.lock_ref),
                "nodes": len(nodes)}

    def _namespace_roots(self, namespace: str | None) -> list[TreeNode]:
        return [r for ns, r in self._ns_roots.items() if in_namespace(ns, namespace)]

    @staticmethod
    def _subtree(root: TreeNode) -> Iterator[TreeNode]:
        """The token-holding nodes under `root` (the root itself holds none)."""
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ introspection
    def namespace_root(self, namespace: str | None) -> TreeNode | None:
        """The root of a namespace's subtree (None: it holds nothing); miss_reasons.py walks it."""
        return self._ns_roots.get(namespace)

    def namespaces(self) -> list[str | None]:
        return list(self._ns_roots)

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every token-holding node, parents before children (a walk: not for hot paths)."""
        stack = list(self._ns_roots.values())
        while stack:
            node = stack.pop()
            if node.depth:
                yield node
            stack.extend(node.children.values())

    def iter_evictable(self) -> Iterator[TreeNode]:
        """The evictable leaves in eviction order (first to go first)."""
        return iter(self._evictable)

    def tree_page_ids(self) -> np.ndarray:
        """Every KV-pool page the tree owns (a walk: for conservation checks)."""
        return np.concatenate([EMPTY_PAGES, *(n.pages for n in self.iter_nodes()
                                              if n.tier == _POOL)])

    def namespace_roots(self) -> dict[str | None, TreeNode]:
        """Each namespace's root node (read-only use: for walks and checks)."""
        return self._ns_roots

    def evictable_entries(self) -> list[tuple]:
        """The evictable set's live entries, unordered (for invariant checks)."""
        return self._evictable.entries()

    @property
    def num_evictable(self) -> int:
        """Leaves in the evictable set (its own count, for invariant checks)."""
        return len(self._evictable)

    def check_invariants(self) -> None:
        """Recount everything and compare with the O(1) counters; AssertionError on a mismatch."""
        check_tree(self)
        self.tiers.check()

    # ------------------------------------------------------------------ tree surgery
    def child_key(self, edge: bytes) -> bytes:
        """Where a child with this edge is filed in its parent: its first page of tokens."""
        return edge[:self._page_bytes]

    def _new_node(self, key: bytes, pages: np.ndarray, parent: TreeNode | None,
                  depth: int, namespace: str | None, last_access: int = 0,
                  pending: tuple | None = None) -> TreeNode:
        node = TreeNode(self._next_id, key, pages, parent, depth, namespace,
                        last_access=last_access, _pending=pending)
        self._next_id += 1
        return node

    def _add_child(self, parent: TreeNode, child: TreeNode, first: bytes | None = None) -> None:
        """File `child` under `parent` by its first page (`first`, when the caller has it)."""
        if first is None:
            first = child.head(self.page_size)
        child.filed_as = first
        parent.children[first] = child
        if self.page_size > 1:
            if parent.cow_index is None:
                parent.cow_index = {}
            parent.cow_index.setdefault(first[:_ITEM], []).append(child)

    def remove_leaf(self, leaf: TreeNode) -> None:
        """Detach an evicted pool leaf (out of the evictable set: `withdraw`); its parent may
        become an evictable leaf (or an empty root), also when its other children are all
        in lower tiers."""
        parent = self._drop_pool_leaf(leaf)
        if parent.children:
            self._check_pool_leaf(parent)

    def _drop_pool_leaf(self, leaf: TreeNode) -> TreeNode:
        """Detach an evicted pool leaf and return its parent, which becomes an evictable leaf
        when it is left childless (an empty namespace root goes). A parent whose other
        children are all in lower tiers is `remove_leaf`'s concern."""
        if self.observer is not None:
            self.observer.removed(leaf)
        parent = self._detach(leaf)
        k = leaf.num_tokens
        self._total -= k
        self._evictable_tokens -= k
        if not parent.children:
            if parent.depth:
                if parent.lock_ref == 0:
                    self._make_evictable(parent)
            else:
                del self._ns_roots[parent.namespace]
        return parent

    def _detach(self, leaf: TreeNode) -> TreeNode:
        """Unlink a childless node from its parent (which is returned)."""
        parent = leaf.parent
        head = leaf.filed_as
        del parent.children[head]
        if self.page_size > 1:
            first = head[:_ITEM]
            same_first = parent.cow_index[first]
            same_first.remove(leaf)
            if not same_first:
                del parent.cow_index[first]
        leaf.parent = None
        self._num_nodes -= 1
        return parent

    # ------------------------------------------------------------------ surgery for tier hooks
    # What TierHooks implementations (PoolOnly below, LowerTiers in tiers.py) do to the tree:
    # withdraw, remove_leaf, leave_pool, enter_pool, drop_lower, split_at.
    @staticmethod
    def _no_pool_children(node: TreeNode) -> bool:
        for child in node.children.values():
            if child.tier == _POOL:
                return False
        return True

    def withdraw(self, leaf: TreeNode) -> None:
        """Take an evictable leaf out of the evictable set (it is being evicted)."""
        self._evictable.discard(leaf)

    def _check_pool_leaf(self, node: TreeNode) -> None:
        """A child of `node` left the KV pool (demoted or dropped): `node` may now be an
        evictable leaf of the pool (its children in lower tiers do not count), or, as a
        namespace root left with no child, go."""
        if not node.depth:
            if not node.children:
                del self._ns_roots[node.namespace]
        elif (node.tier == _POOL and node.lock_ref == 0 and node.evict_key is None
              and self._no_pool_children(node)):
            self._make_evictable(node)

    def leave_pool(self, node: TreeNode) -> None:
        """An evicted KV-pool leaf stays in the tree in a lower tier (LowerTiers.demote)."""
        self._total -= node.num_tokens
        self._evictable_tokens -= node.num_tokens      # evicted leaves are unlocked
        self._check_pool_leaf(node.parent)
        if self.observer is not None:
            self.observer.moved(node, _POOL)

    def drop_lower(self, leaf: TreeNode) -> None:
        """Remove a childless host/disk node from the tree (its slots are the caller's)."""
        if self.observer is not None:
            self.observer.removed(leaf)
        self._check_pool_leaf(self._detach(leaf))

    def _promote_path(self, node: TreeNode, pages: np.ndarray, parts: list) -> None:
        """An insert ran over host/disk nodes ending at `node`: the caller computed them
        again, so the tree takes the caller's KV-pool pages for them (frees their slots)
        and `parts` (one entry per edge of the path) gets those pages."""
        path = []
        while node.tier != _POOL:
            path.append(node)
            node = node.parent
        path.reverse()
        ps = self.page_size
        for x in path:
            self.enter_pool(x, pages[(x.depth - x.num_tokens) // ps: x.depth // ps])
        parts[len(parts) - len(path):] = [x.pages for x in path]

    def add_lower(self, parent: TreeNode | None, tokens: TokenIds, ids: np.ndarray,
                  tier: Tier, namespace: str | None, last_access: int) -> TreeNode | None:
        """A node of a lower tier (ids: that tier's tree ids, whole pages of `tokens`)
        under `parent` (None: the namespace's root), as a restore from the disk index
        rebuilds it: no KV-pool page is taken. None when `parent` has a child filed under
        the same first page (the tokens are in the tree already)."""
        ids = self._check_pages(tokens, ids)
        if parent is None:
            parent = self._ns_roots.get(namespace)
            if parent is None:
                parent = self._ns_roots[namespace] = self._new_node(b"", EMPTY_PAGES, None,
                                                                    0, namespace)
        key = pack(tokens)
        first = self.child_key(key)
        if first in parent.children or not len(ids):
            return None
        ids = ids.copy()
        ids.flags.writeable = False
        node = self._new_node(key, ids, parent, parent.depth + len(ids) * self.page_size,
                              namespace)
        node.tier = tier
        node.last_access = last_access
        self._clock = max(self._clock, last_access)
        self._add_child(parent, node, first)
        self._num_nodes += 1
        self.tiers.added(node)
        if self.observer is not None:
            self.observer.stored(node)
        return node

    def enter_pool(self, node: TreeNode, pages: np.ndarray) -> None:
        """A host/disk node whose parent is in the KV pool moves into it on `pages` (the
        caller's: loaded or recomputed); its lower-tier slots are released."""
        self.tiers.release(node)
        if not _keepable(pages, self._lasting_ids):
            pages = pages.copy()
            pages.flags.writeable = False
        node.pages = pages
        src, node.tier = node.tier, _POOL
        if self.observer is not None:
            self.observer.moved(node, src)
        parent = node.parent
        if parent.evict_key is not None:     # it has a child in the pool now
            self._remove_evictable(parent)
        self._total += node.num_tokens
        if node.lock_ref == 0:
            self._evictable_tokens += node.num_tokens
            self._check_pool_leaf(node)      # evictable unless a child is in the pool

    def split_at(self, child: TreeNode, m: int) -> TreeNode:
        """Cut `child`'s edge after m tokens (a page multiple); return the new upper node."""
        ps = self.page_size
        parent = child.parent
        first = child.filed_as
        depth = child.depth - child.num_tokens + m
        head_key, head_pending = child.cut(m)
        upper = TreeNode(self._next_id, head_key, child.pages[:m // ps], parent, depth,
                         child.namespace, lock_ref=child.lock_ref,
                         last_access=child.last_access, hit_count=child.hit_count,
                         _pending=head_pending, filed_as=first, tier=child.tier)
        self._next_id += 1
        parent.children[first] = upper
        if ps > 1:
            same_first = parent.cow_index[first[:_ITEM]]
            same_first[same_first.index(child)] = upper
        child.pages = child.pages[m // ps:]
        child.parent = upper
        self._add_child(upper, child)
        self._num_nodes += 1
        if self.observer is not None:
            self.observer.split(upper, child)
        if upper.tier != _POOL:
            self.tiers.added(upper)
            self.tiers.rekey(child)         # shorter now
        if child.evict_key is not None:
            self._rekey(child)
        return upper

    def _make_evictable(self, node: TreeNode) -> None:
        self._evictable.add(node, self.policy.key(node))

    def _remove_evictable(self, node: TreeNode) -> None:
        self._evictable.discard(node)

    def _rekey(self, node: TreeNode) -> None:
        """Re-sort an evictable leaf whose fields changed (accessed, split or trimmed)."""
        self._evictable.rekey(node, self.policy.key(node))


class PoolOnly:
    """The tree's tier hooks when nothing lies below the KV pool: an evicted page is gone.

    Eviction itself never reaches these hooks: the tree trims or drops its own leaves
    (`RadixCache._evict_dropping`, the hot path of an eviction-heavy stream).
    """

    def __init__(self, tree: RadixCache):
        self.tree = tree

    def evict_leaf(self, leaf: TreeNode, need_pages: int) -> np.ndarray:
        raise AssertionError("a tree without lower tiers evicts its leaves itself")

    def added(self, node: TreeNode) -> None:
        raise AssertionError(f"{node} outside the pool of a tree without lower tiers")

    def release(self, node: TreeNode) -> None:
        raise AssertionError(f"{node} outside the pool of a tree without lower tiers")

    def rekey(self, node: TreeNode) -> None:
        raise AssertionError(f"{node} outside the pool of a tree without lower tiers")

    def forget(self, nodes: Sequence[TreeNode]) -> None:
        pass

    def check(self) -> None:
        pass

    def plan_load(self, lower: Sequence[TreeNode], max_tier: int = Tier.DISK) -> None:
        return None

    def take_moves(self) -> list:
        return []

    def moves_done(self) -> None:
        pass
