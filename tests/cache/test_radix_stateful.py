"""Random operation sequences on RadixCache + PagedMemory against a brute-force model.

Each step is one of: a full engine-style request (match, lock, alloc with eviction,
copy-on-write, insert, free duplicates, keep or drop the lock), the same through a
PrefixLease (acquire, grow, copy orders, extend in chunks, keep or release; page
ownership checked at every step), the release of a held lease, an insert of freshly
computed pages, a bare match, a lock release, an explicit evict, a flush. A simulated KV
pool (one row of token ids per page) follows every write and copy, so wrong pages and
wrong copy-on-write sources show up as wrong data. After every step: the tree's own
recount, page conservation, the model's pages == the tree's, the data in every cached
page, held locks intact, and peek_prefix == the model's match for every sequence seen.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache import CacheLockedError, OutOfPages, PagedMemory, RadixCache
from radixserve.cache.prefix_lease import CopyOrder, PrefixLease

from .radix_model import BruteForceCache

# Shared heads (system prompts) + short random tails over 3 symbols: many common prefixes
# that diverge at and between page boundaries.
HEADS = [[], [0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 1, 2, 2, 2, 1, 0], [1, 1, 1, 1, 2], [2]]
tokens_st = st.tuples(st.sampled_from(HEADS), st.lists(st.integers(0, 2), max_size=12)).map(
    lambda ht: ht[0] + ht[1]).filter(len)
namespace_st = st.sampled_from([None, None, "tenant-b"])


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    policy = "lru"
    num_pages = 24

    def __init__(self):
        super().__init__()
        ps = self.page_size
        NUM_PAGES = self.num_pages
        self.tree = RadixCache(ps, self.policy)
        self.mem = PagedMemory(NUM_PAGES, self.tree)
        self.model = BruteForceCache(ps)
        self.kv = np.full((NUM_PAGES, ps), -1, dtype=np.int64)   # token id held per slot
        self.held: list[tuple] = []        # (node, protected page ids)
        self.leases: list[PrefixLease] = []  # leases kept between steps
        self.seen: list[tuple] = []        # (tokens, namespace) for the peek check

    @initialize()
    def start(self):
        pass

    # ------------------------------------------------------------------ helpers
    def remember(self, tokens, namespace):
        self.seen.append((list(tokens), namespace))
        del self.seen[:-12]

    def locked_pages(self) -> set[int]:
        held = {int(p) for _, pages in self.held for p in pages}
        return held | {int(p) for lease in self.leases
                       for p in lease.pages[:lease.num_tree_pages]}

    def holds_locks(self) -> bool:
        """Some held handle or lease locks a token-holding node."""
        nodes = [node for node, _ in self.held] + [lease.node for lease in self.leases]
        return any(node is not None and node.depth for node in nodes)

    def sync_evictions(self, extra_locked=()):
        """Pages that left the tree since the model last looked: never locked ones."""
        gone = self.model.page_set() - set(self.tree.tree_page_ids().tolist())
        assert not gone & (self.locked_pages() | set(extra_locked)), "evicted a locked page"
        self.model.remove_pages(gone)
        self.model.check_prefix_closed()
        return gone

    def check_match(self, m, tokens, namespace, cap):
        want = self.model.match(tokens, namespace, cap)
        ps = self.page_size
        assert m.pages.tolist() == want.pages
        assert m.cow_tokens == want.cow_tokens
        assert m.matched_tokens == want.matched_tokens(ps)
        if m.cow_tokens:
            assert m.cow_page in want.cow_pages
        else:
            assert m.cow_page == -1
        base = len(want.pages) * ps
        assert self.kv[m.pages].ravel().tolist() == list(tokens[:base])
        if m.cow_tokens:
            assert self.kv[m.cow_page, :m.cow_tokens].tolist() == \
                list(tokens[base:base + m.cow_tokens])

    def write_kv(self, pages, tokens, start):
        """'Compute' tokens[start:] into pages (which cover the sequence from position 0)."""
        ps = self.page_size
        for pos in range(start, len(tokens)):
            self.kv[pages[pos // ps], pos % ps] = tokens[pos]

    def insert_whole_pages(self, tokens, pages, namespace, start=None):
        """Insert the whole pages, check against the model, free duplicates and the tail."""
        ps = self.page_size
        whole = len(tokens) // ps
        r = self.tree.insert(tokens[:whole * ps], pages[:whole], namespace, start=start)
        cached, want_pages = self.model.insert(tokens[:whole * ps], pages[:whole].tolist(),
                                               namespace)
        assert r.already_cached == cached
        assert r.pages.tolist() == want_pages
        assert self.kv[r.pages].ravel().tolist() == list(tokens[:whole * ps])
        dup = r.duplicates(pages[:whole])
        assert sorted(dup.tolist()) == sorted(set(pages[:whole].tolist()) - set(want_pages))
        self.mem.free(dup)
        self.mem.free(pages[whole:])
        return r

    # ------------------------------------------------------------------ rules
    @rule(tokens=tokens_st, namespace=namespace_st, keep=st.booleans(),
          cap_cut=st.integers(0, 3), hint=st.booleans())
    def request(self, tokens, namespace, keep, cap_cut, hint):
        """What the engine does: match at most len-1 (or less), lock, alloc, COW, insert."""
        ps = self.page_size
        self.remember(tokens, namespace)
        cap = max(0, len(tokens) - 1 - cap_cut)
        m = self.tree.match_prefix(tokens, namespace, max_tokens=cap)
        self.check_match(m, tokens, namespace, cap)
        self.tree.lock(m.node)
        protected = [*m.pages.tolist(), *([m.cow_page] if m.cow_tokens else [])]
        need = -(-len(tokens) // ps) - len(m.pages)
        free_before, tree_before = self.mem.num_free, self.tree.tree_page_ids().tolist()
        try:
            new = self.mem.alloc(need)
        except OutOfPages:
            event("request: out of pages")
            assert self.mem.available_pages() < need
            assert self.mem.num_free == free_before
            assert self.tree.tree_page_ids().tolist() == tree_before
            self.tree.unlock(m.node)
            return
        if self.sync_evictions(protected):
            event("request: alloc evicted")
        assert not set(new.tolist()) & set(protected)
        pages = np.concatenate((m.pages, new))
        base = len(m.pages) * ps
        if m.cow_tokens:
            event("request: copy-on-write")
        if m.cow_tokens:   # copy-on-write: the source is still the tree's, with its data
            assert self.model.owner[m.cow_page][1][base:base + m.cow_tokens] == \
                tuple(tokens[base:base + m.cow_tokens])
            self.kv[new[0], :m.cow_tokens] = self.kv[m.cow_page, :m.cow_tokens]
        self.write_kv(pages, tokens, m.matched_tokens)
        # hint: start the insert's walk at the match's handle (ignored for a COW handle).
        r = self.insert_whole_pages(tokens, pages, namespace, m.node if hint else None)
        event(f"request: hit {'some' if m.matched_tokens else 'none'}, "
              f"cached on insert {'some' if r.already_cached > m.matched_tokens else 'no more'}")
        if keep and len(r.pages):
            self.tree.lock(r.node)
            self.held.append((r.node, r.pages.copy()))
        self.tree.unlock(m.node)

    @rule(tokens=tokens_st, namespace=namespace_st, keep=st.booleans(),
          chunk=st.integers(1, 9))
    def lease_request(self, tokens, namespace, keep, chunk):
        """The engine's and the replay tool's path: one PrefixLease from acquire to release."""
        ps = self.page_size
        self.remember(tokens, namespace)
        cap = len(tokens) - 1
        lease = PrefixLease(self.mem, namespace)
        m = lease.acquire(tokens, max_tokens=cap)
        self.check_match(m, tokens, namespace, cap)
        assert lease.matched_tokens == m.matched_tokens
        assert lease.pages.tolist() == m.pages.tolist() and lease.num_tree_pages == len(m.pages)
        protected = [*m.pages.tolist(), *([m.cow_page] if m.cow_tokens else [])]
        need = -(-len(tokens) // ps) - len(m.pages)
        free_before, tree_before = self.mem.num_free, self.tree.tree_page_ids().tolist()
        try:
            lease.grow(need)
        except OutOfPages:
            event("lease: out of pages")
            assert self.mem.available_pages() < need
            assert self.mem.num_free == free_before
            assert self.tree.tree_page_ids().tolist() == tree_before
            assert lease.pages.tolist() == m.pages.tolist() and lease.take_copy_orders() == []
            lease.release()
            assert not lease.active
            return
        self.sync_evictions(protected)
        private = lease.private_pages.tolist()
        assert len(private) == need and not set(private) & set(self.tree.tree_page_ids().tolist())
        orders = lease.take_copy_orders()
        if m.cow_tokens:
            event("lease: copy-on-write")
            assert orders == [CopyOrder(m.cow_page, private[0], m.cow_tokens)]
            self.kv[private[0], :m.cow_tokens] = self.kv[m.cow_page, :m.cow_tokens]
        else:
            assert orders == []
        assert lease.take_copy_orders() == []
        self.write_kv(lease.pages, tokens, m.matched_tokens)
        # Extend in chunks, as prefill does: each extend inserts the whole pages computed.
        done = m.matched_tokens
        while done < len(tokens):
            done = min(len(tokens), done + chunk)
            whole = done // ps
            own = lease.pages.copy()
            tree_pages_before = lease.num_tree_pages
            free_before = self.mem.num_free
            lease.extend(tokens, done)
            if whole <= tree_pages_before:
                assert lease.pages.tolist() == own.tolist()
                continue
            _, want = self.model.insert(tokens[:whole * ps], own[:whole].tolist(), namespace)
            assert lease.pages[:whole].tolist() == want
            assert lease.pages[whole:].tolist() == own[whole:].tolist()
            assert lease.num_tree_pages == whole and lease.node.depth == whole * ps
            dups = set(own[:whole].tolist()) - set(want)
            assert self.mem.num_free == free_before + len(dups), "duplicates freed, once"
            if dups:
                event("lease: freed duplicates")
            assert self.kv[lease.pages[:whole]].ravel().tolist() == list(tokens[:whole * ps])
        tree_pages = set(self.tree.tree_page_ids().tolist())
        assert set(lease.pages[:lease.num_tree_pages].tolist()) <= tree_pages
        assert not set(lease.private_pages.tolist()) & tree_pages
        if keep:
            self.leases.append(lease)
        else:
            self.release_lease(lease)

    def release_lease(self, lease: PrefixLease):
        private = len(lease.private_pages)
        free_before = self.mem.num_free
        lease.release()
        assert self.mem.num_free == free_before + private
        assert not lease.active and lease.node is None
        lease.release()                       # idempotent
        assert self.mem.num_free == free_before + private

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def lease_release(self, data):
        i = data.draw(st.integers(0, len(self.leases) - 1))
        self.release_lease(self.leases.pop(i))

    @rule(tokens=tokens_st, namespace=namespace_st)
    def insert_fresh(self, tokens, namespace):
        """Insert pages computed without matching first: the tree keeps its own, we free ours."""
        ps = self.page_size
        self.remember(tokens, namespace)
        n = -(-len(tokens) // ps)
        try:
            pages = self.mem.alloc(n)
        except OutOfPages:
            assert self.mem.available_pages() < n
            return
        self.sync_evictions()
        self.write_kv(pages, tokens, 0)
        self.insert_whole_pages(tokens, pages, namespace)

    @rule(tokens=tokens_st, namespace=namespace_st, cap=st.none() | st.integers(0, 22),
          hold=st.booleans())
    def match(self, tokens, namespace, cap, hold):
        self.remember(tokens, namespace)
        queries, hits = self.tree.query_tokens, self.tree.hit_tokens
        nodes = self.tree.num_nodes
        m = self.tree.match_prefix(tokens, namespace, max_tokens=cap)
        if self.tree.num_nodes > nodes:
            event("match: split an edge")
        self.check_match(m, tokens, namespace, cap)
        limit = len(tokens) if cap is None else min(cap, len(tokens))
        assert self.tree.query_tokens == queries + limit
        assert self.tree.hit_tokens == hits + m.matched_tokens
        if hold:
            self.tree.lock(m.node)
            self.held.append((m.node, [*m.pages.tolist(), *([m.cow_page] if m.cow_tokens else [])]))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        node, _ = self.held.pop(i)
        self.tree.unlock(node)

    @rule(num_tokens=st.integers(0, 40))
    def evict(self, num_tokens):
        ps = self.page_size
        evictable_pages = self.tree.evictable_tokens // ps
        freed = self.tree.evict(num_tokens)
        event(f"evict: {'freed pages' if len(freed) else 'nothing'}")
        want = min(-(-num_tokens // ps), evictable_pages)
        assert len(freed) == want, "evicts exactly the pages asked for (or all there are)"
        gone = self.sync_evictions()
        assert gone == set(freed.tolist())
        self.mem.free(freed)

    @rule(roll=st.integers(0, 7))
    def flush(self, roll):
        if roll:          # rare: a flush wipes the state the other rules build up
            return
        # A handle on a namespace root (nothing matched) holds nothing: no lock to refuse for.
        if self.holds_locks():
            assert self.tree.locked_tokens > 0
            before = self.tree.tree_page_ids().tolist()
            with pytest.raises(CacheLockedError):
                self.tree.flush()
            event("flush: refused")
            assert self.tree.tree_page_ids().tolist() == before
            return
        pages = self.tree.flush()
        event("flush: done")
        assert set(pages.tolist()) == self.model.page_set()
        self.model.clear()
        self.mem.free(pages)

    # ------------------------------------------------------------------ after every step
    @invariant()
    def consistent(self):
        tree, ps = self.tree, self.page_size
        tree.check_invariants()
        self.mem.check_conservation([lease.private_pages for lease in self.leases])
        tree_pages = set(tree.tree_page_ids().tolist())
        assert tree_pages == self.model.page_set()
        assert tree.total_tokens == len(tree_pages) * ps
        locked = self.locked_pages()
        assert locked <= tree_pages, "a locked page left the tree"
        assert tree.locked_tokens >= len(locked) * ps
        if not self.holds_locks():
            assert tree.locked_tokens == 0
        for (ns, prefix), page in self.model.entries.items():
            assert self.kv[page].tolist() == list(prefix[-ps:]), f"page {page} data"
        for tokens, ns in self.seen:
            for cap in (None, len(tokens) - 1):
                want = self.model.match(tokens, ns, cap).matched_tokens(ps)
                assert tree.peek_prefix(tokens, ns, cap) == want


SETTINGS = settings(max_examples=100, stateful_step_count=50, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class PageSize1(RadixMachine):
    page_size = 1


class PageSize4(RadixMachine):
    page_size = 4
    num_pages = 12


class PageSize2LFU(RadixMachine):
    page_size = 2
    policy = "lfu"


class PageSize4GDSF(RadixMachine):
    page_size = 4
    num_pages = 12
    policy = "gdsf"


TestPageSize1 = PageSize1.TestCase
TestPageSize1.settings = SETTINGS
TestPageSize4 = PageSize4.TestCase
TestPageSize4.settings = SETTINGS
TestPageSize2LFU = PageSize2LFU.TestCase
TestPageSize2LFU.settings = settings(SETTINGS, max_examples=40)
TestPageSize4GDSF = PageSize4GDSF.TestCase
TestPageSize4GDSF.settings = settings(SETTINGS, max_examples=40)


class PageSize2Adaptive(RadixMachine):
    """The learned policy: memoized keys must survive every rule (check_invariants recomputes
    them); explore=2 so both explorers and class-keyed leaves (and admission) show up."""

    page_size = 2
    num_pages = 16

    def __init__(self):
        from radixserve.cache.adaptive_policy import AdaptivePolicy

        self.policy = AdaptivePolicy(explore=2, admission_threshold=0.3)
        super().__init__()


TestPageSize2Adaptive = PageSize2Adaptive.TestCase
TestPageSize2Adaptive.settings = settings(SETTINGS, max_examples=60)
