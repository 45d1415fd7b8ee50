"""Long prompts: the tree packs ids only as far as it reads them, and keeps the caller's ids
unpacked in new leaves until they are read (issue 11, item 10)."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from radixserve.cache import PagedMemory, PrefixLease, RadixCache
from radixserve.cache.token_keys import LazyKey, TokenPrefix, pack, prefix


class CountingList(list):
    """A list that records how many ids each slice of it copied (what packing reads)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = 0

    def __getitem__(self, item):
        out = super().__getitem__(item)
        if isinstance(item, slice):
            self.read += len(out)
        return out


def pages_for(n: int, ps: int, first: int = 0) -> np.ndarray:
    return np.arange(first, first + n // ps, dtype=np.int32)


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("kind", ["list", "array", "numpy"])
def test_long_leaves_keep_the_callers_ids_and_split_without_packing(ps, kind):
    ids = list(range(1000, 21000))                                 # 20,000 tokens
    tokens = {"list": ids, "array": array("q", ids), "numpy": np.array(ids)}[kind]
    c = RadixCache(ps)
    r = c.insert(tokens, pages_for(20000, ps))
    leaf = r.node
    assert leaf._pending is not None and leaf.num_tokens == 20000   # a reference, unpacked
    # A request sharing the first 704 tokens, then differing: the match splits the edge.
    query = ids[:704] + [7] * 100
    m = c.match_prefix(query)
    assert m.matched_tokens == 704 and m.pages.tolist() == list(range(704 // ps))
    upper, lower = m.node, leaf
    assert upper.num_tokens == 704 and lower.num_tokens == 20000 - 704
    assert lower._pending is not None              # the long tail still unpacked
    # Trimming the tail (eviction) cuts the range, still without packing.
    gone = -(-5000 // ps) * ps
    c.evict(5000)
    assert lower.num_tokens == 20000 - 704 - gone and lower._pending is not None
    assert lower.tokens[:3] == ids[704:707]        # reads back right (packs on demand)
    assert lower.tokens[-1] == ids[20000 - gone - 1]
    assert c.peek_prefix(ids) == 20000 - gone
    c.check_invariants()


def test_a_miss_on_a_long_list_packs_only_what_the_walk_reads():
    c = RadixCache(1)
    c.insert(list(range(5000)), pages_for(5000, 1))
    query = CountingList(range(10**6, 10**6 + 12800))             # no shared first token
    assert c.peek_prefix(query) == 0
    m = c.match_prefix(query, max_tokens=len(query) - 1)
    assert m.matched_tokens == 0
    assert query.read <= 2 * LazyKey.FIRST, query.read            # not 2 x 12,800
    # A partial hit packs little beyond the first difference, not the whole prompt.
    query = CountingList([*range(600), *range(10**6, 10**6 + 12200)])
    assert c.peek_prefix(query) == 600
    assert query.read <= 4 * 1024, query.read


def test_token_prefix_reads_only_its_part():
    a = array("q", range(100))
    p = prefix(a, 40)
    assert isinstance(p, TokenPrefix) and len(p) == 40
    c = RadixCache(1)
    r = c.insert(p, pages_for(40, 1))
    a.append(5)                                    # the caller's array may keep growing
    assert r.node.num_tokens == 40 and r.node.key == pack(list(range(40)))
    assert prefix(a, len(a)) is a and prefix(b"12345678" * 3, 2) == b"12345678" * 2


def test_page_ids_are_values_and_one_evicted_edge_is_handed_over_whole():
    tree = RadixCache(4)
    mem = PagedMemory(8, tree)
    lease = PrefixLease(mem)
    lease.acquire(list(range(32)))
    lease.grow(8)
    assert not lease.pages.flags.writeable
    lease.release(list(range(32)), 32)             # all 8 pages into the tree, then unlock
    assert mem.num_free == 0 and tree.total_tokens == 32
    got = mem.alloc(3)                             # evicts the tail of the one leaf
    assert not got.flags.writeable and len(got) == 3
    with pytest.raises(ValueError):
        got[0] = 1
    mem.check_conservation([got])


@pytest.mark.parametrize("ps", [1, 16])
def test_array_ids_are_read_in_place_and_stay_growable(ps):
    """An array('q') or int64 numpy prompt is compared through a view of its buffer (nothing
    packed), and no view outlives a tree call: the engine appends to its arrays after."""
    ids = array("q", range(1000, 1000 + 4096))
    c = RadixCache(ps)
    leaf = c.insert(ids, pages_for(4096, ps)).node
    assert leaf._pending is not None and leaf._pending[0] is ids      # a reference, no copy
    query = array("q", [*range(1000, 1000 + 2048), *[7] * 100])
    m = c.match_prefix(query, max_tokens=len(query) - 1)
    assert m.matched_tokens == 2048
    query.append(5)
    ids.append(6)                                  # would raise BufferError if a view lived on
    assert c.peek_prefix(np.asarray(query)) == 2048
    n = len(query) // ps * ps
    own = np.concatenate((m.pages, pages_for(n - 2048, ps, first=10_000)))
    c.lock(m.node)
    r = c.insert(prefix(query, n), own, start=m.node)
    c.unlock(m.node)
    assert r.hint_used and r.already_cached == 2048
    query.append(7)
    assert c.peek_prefix(query) == n and c.peek_prefix(bytes(query)[:n * 8]) == n
    with pytest.raises(ValueError):
        c.peek_prefix(b"1234567")                  # not whole int64 ids
    c.check_invariants()


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("kind", ["list", "array"])
def test_a_difference_anywhere_in_a_long_edge_is_found_exactly(ps, kind):
    """The bisection inside a differing window finds the first differing token, whatever
    window it lies in (the windows grow 512, 2048, 8192... tokens) and wherever in it."""
    n = 40_000
    ids = list(range(10**6, 10**6 + n))
    rng = np.random.default_rng(0)
    spots = [0, 1, 511, 512, 513, 2559, 2560, 10_751, 10_752, n - 2]
    spots += rng.integers(0, n - 1, size=10).tolist()
    for at in spots:
        c = RadixCache(ps)
        tokens = array("q", ids) if kind == "array" else ids
        c.insert(tokens, pages_for(n, ps))               # one long edge, kept unpacked
        query = ids[:at] + [7] + ids[at + 1:]
        expected = at                                    # brute force: first difference
        assert c.peek_prefix(query) == expected
        m = c.match_prefix(query)
        assert m.matched_tokens == expected, at
        assert len(m.pages) == expected // ps
        assert m.pages.tolist() == list(range(expected // ps))
        c.check_invariants()


@pytest.mark.parametrize("ps", [1, 4])
def test_alloc_after_appends_new_pages_in_one_read_only_table(ps):
    c = RadixCache(ps)
    mem = PagedMemory(12, c)
    head = mem.alloc(3)
    grown = mem.alloc_after(head, 4)                 # from the free list
    assert grown[:3].tolist() == head.tolist() and len(grown) == 7
    assert not grown.flags.writeable and len(set(grown.tolist())) == 7
    keys = array("q", range(7 * ps))
    c.insert(keys, grown)                            # the tree holds all 7; 5 are free
    table = mem.alloc_after(np.array([11], np.int32)[:0], 9)   # 5 free + 4 evicted
    assert len(table) == 9 and not table.flags.writeable and mem.num_free == 0
    assert c.total_tokens == 3 * ps
    mem.free(table)
    mem.check_conservation()


def _root_buffer_bytes(a: np.ndarray) -> int:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return len(a.base) if isinstance(a.base, bytes) else a.nbytes


def test_a_leaf_after_a_long_hit_does_not_pin_the_requests_whole_page_table():
    """The second request's table is the shared prefix's ids + its own: its new leaf keeps
    its own ids (copied), not a view that would keep the prefix's copy alive with it."""
    c = RadixCache(1)
    mem = PagedMemory(10_000, c)
    system = list(range(1000, 3048))                        # 2,048 shared tokens
    for question in ([1, 2, 3, 4], [5, 6, 7, 8]):
        tokens = array("q", system + question * 96)          # + 384 tokens each
        lease = PrefixLease(mem)
        lease.acquire(tokens, max_tokens=len(tokens) - 1)
        lease.grow(len(tokens) - len(lease.pages))
        lease.release(tokens, len(tokens))
    (shared,) = c._ns_roots[None].children.values()
    leaves = list(shared.children.values())
    assert len(leaves) == 2
    first, second = sorted(leaves, key=lambda n: n.id)
    assert len(first.pages) == len(second.pages) == 384
    # the first request's table came from never-freed ids: a view of them, no copy
    assert np.shares_memory(first.pages, mem._free_list.initial_ids)
    # the second's was the prefix's 2,048 ids + 384 new ones: its leaf keeps only its own
    assert _root_buffer_bytes(second.pages) <= 2 * second.pages.nbytes
    mem.check_conservation()
    c.check_invariants()
