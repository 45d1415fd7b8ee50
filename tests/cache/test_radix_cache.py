"""RadixCache unit tests: splits, locks, trimming, namespaces, flush, copy-on-write, summary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from radixserve.cache import CacheLockedError, PageAllocator, PagedMemory, RadixCache
from radixserve.cache.summary import build_summary


def pages(*ids):
    return np.array(ids, dtype=np.int32)


def fresh(cache: RadixCache, alloc: PageAllocator, tokens, ns=None):
    """Insert `tokens` (whole pages) with newly allocated pages; free what the tree had."""
    n = len(tokens) // cache.page_size
    own = alloc.alloc(n)
    r = cache.insert(tokens, own, ns)
    alloc.free(r.duplicates(own))
    return r


# ---------------------------------------------------------------------- edge splits
def test_match_inside_an_edge_splits_it():
    c = RadixCache()
    c.insert([1, 2, 3, 4, 5], pages(10, 11, 12, 13, 14))
    assert c.num_nodes == 1
    m = c.match_prefix([1, 2, 3, 9])
    assert (m.matched_tokens, m.pages.tolist(), m.cow_page) == (3, [10, 11, 12], -1)
    assert c.num_nodes == 2
    assert m.node.tokens == [1, 2, 3] and m.node.depth == 3
    (tail,) = m.node.children.values()
    assert tail.tokens == [4, 5] and tail.pages.tolist() == [13, 14] and tail.parent is m.node
    c.check_invariants()
    # The split is invisible to later matches.
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).pages.tolist() == [10, 11, 12, 13, 14]


def test_insert_ending_inside_an_edge_splits_it_and_returns_that_node():
    c = RadixCache()
    c.insert([1, 2, 3, 4], pages(0, 1, 2, 3))
    r = c.insert([1, 2], pages(7, 8))
    assert r.already_cached == 2 and r.pages.tolist() == [0, 1]
    assert r.node.tokens == [1, 2] and r.node.depth == 2
    assert r.duplicates(pages(7, 8)).tolist() == [7, 8]
    c.check_invariants()


def test_insert_branching_and_duplicates():
    c = RadixCache()
    c.insert([5, 6, 7], pages(0, 1, 2))
    r = c.insert([5, 6, 8, 9], pages(0, 1, 3, 4))      # shares [5, 6] with the tree's pages
    assert r.already_cached == 2 and r.pages.tolist() == [0, 1, 3, 4]
    assert r.duplicates(pages(0, 1, 3, 4)).size == 0
    r = c.insert([5, 6, 8, 9, 1], pages(20, 21, 22, 23, 24))   # all computed afresh
    assert r.already_cached == 4 and r.pages.tolist() == [0, 1, 3, 4, 24]
    assert r.duplicates(pages(20, 21, 22, 23, 24)).tolist() == [20, 21, 22, 23]
    assert c.total_tokens == 6 and c.num_nodes == 4
    c.check_invariants()


def test_insert_from_a_start_node_skips_the_known_prefix():
    c = RadixCache()
    c.insert([1, 2, 3], pages(0, 1, 2))
    m = c.match_prefix([1, 2, 3, 4])
    c.lock(m.node)
    own = np.concatenate((m.pages, pages(7, 8)))
    r = c.insert([1, 2, 3, 4, 5], own, start=m.node)
    assert r.already_cached == 3 and r.pages is own and r.node.tokens == [4, 5]
    assert r.hint_used
    assert r.node.parent is m.node and r.node.depth == 5
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).pages.tolist() == [0, 1, 2, 7, 8]
    c.check_invariants()


def test_a_start_node_that_does_not_hold_the_prefix_is_ignored():
    c = RadixCache()
    c.insert([1, 2, 3], pages(0, 1, 2))
    other = c.insert([9, 9], pages(5, 6)).node
    c.lock(other)
    # `other` is locked but the caller's pages do not hold it: the walk starts at the root.
    r = c.insert([1, 2, 3, 4], pages(10, 11, 12, 13), start=other)
    assert r.already_cached == 3 and r.pages.tolist() == [0, 1, 2, 13]
    assert not r.hint_used                                   # the caller learns it was wasted
    assert r.duplicates(pages(10, 11, 12, 13)).tolist() == [10, 11, 12]
    unlocked = c.insert([7, 7], pages(20, 21)).node          # not locked: ignored too
    r = c.insert([1, 2, 3, 4, 5], pages(0, 1, 2, 13, 14), start=unlocked)
    assert r.already_cached == 4 and r.node.tokens == [5] and not r.hint_used
    assert not c.insert([1, 2], pages(0, 1)).hint_used       # no hint given
    c.check_invariants()


def test_token_keys_accept_lists_arrays_numpy_and_packed_bytes():
    from array import array

    from radixserve.cache.token_keys import pack, token_at, unpack

    ids = [5, 1 << 40, -1, 0]
    key = pack(ids)
    assert unpack(key) == ids and len(key) == 32
    assert pack(array("q", ids)) == key == pack(np.array(ids)) == pack(key)
    assert pack(ids, 2) == pack(ids[2:]) == pack(array("q", ids), 2) == pack(key, 2)
    assert token_at(key, 1) == 1 << 40 and token_at(key, -2) == -1
    with pytest.raises(ValueError):
        pack(b"123")
    with pytest.raises(TypeError):
        pack(np.array([1.5]))
    c = RadixCache()
    c.insert(np.array(ids), pages(0, 1, 2, 3))
    assert c.match_prefix(array("q", ids[:3])).matched_tokens == 3
    assert c.peek_prefix(key) == 4


def test_paged_split_at_page_boundary_and_copy_on_write_source():
    c = RadixCache(page_size=4)
    c.insert(list(range(12)), pages(7, 8, 9))
    q = [0, 1, 2, 3, 4, 5, 99, 99, 99]
    m = c.match_prefix(q)
    assert m.matched_tokens == 6 and m.pages.tolist() == [7]
    assert (m.cow_page, m.cow_tokens) == (8, 2)
    # Split after the first page; the handle is the node that holds the copy-on-write page.
    assert m.node.tokens == [4, 5, 6, 7, 8, 9, 10, 11] and m.node.parent.tokens == [0, 1, 2, 3]
    c.check_invariants()


def test_paged_insert_needs_whole_pages():
    c = RadixCache(page_size=4)
    with pytest.raises(ValueError, match="whole pages"):
        c.insert([1, 2, 3, 4, 5], pages(0, 1))


def test_max_tokens_caps_the_match():
    c = RadixCache()
    c.insert([1, 2, 3, 4], pages(0, 1, 2, 3))
    m = c.match_prefix([1, 2, 3, 4], max_tokens=3)
    assert m.matched_tokens == 3 and m.pages.tolist() == [0, 1, 2]
    assert c.query_tokens == 3 and c.hit_tokens == 3
    c4 = RadixCache(page_size=4)
    c4.insert(list(range(8)), pages(0, 1))
    m = c4.match_prefix(list(range(8)), max_tokens=7)   # the last page only via COW
    assert (m.matched_tokens, m.pages.tolist(), m.cow_page, m.cow_tokens) == (7, [0], 1, 3)
    assert c4.match_prefix(list(range(8)), max_tokens=0).matched_tokens == 0


def test_peek_prefix_has_no_side_effects():
    c = RadixCache(page_size=2)
    c.insert([1, 2, 3, 4, 5, 6], pages(0, 1, 2))
    before = (c.num_nodes, c.query_tokens, c.hit_tokens, c.clock)
    assert c.peek_prefix([1, 2, 3, 9]) == 3               # one page + one COW token
    assert c.peek_prefix([1, 2, 3, 4, 5, 6], max_tokens=5) == 5
    assert c.peek_prefix([1, 2], namespace="other") == 0
    assert (c.num_nodes, c.query_tokens, c.hit_tokens, c.clock) == before
    assert c.match_prefix([1, 2, 3, 9]).matched_tokens == 3


# ---------------------------------------------------------------------- copy-on-write data
def test_copy_on_write_keeps_the_partial_hit_under_memory_pressure():
    """Request B shares 6 tokens (1.5 pages) with A. B locks, allocs (evicting other
    leaves, never A's), copies the 2 shared tokens of A's second page and computes the
    rest: every page B ends with holds exactly B's tokens."""
    ps = 4
    tree = RadixCache(page_size=ps)
    mem = PagedMemory(5, tree)
    kv = np.full((5, ps), -1)

    def compute(page_ids, tokens, start):
        for pos in range(start, len(tokens)):
            kv[page_ids[pos // ps], pos % ps] = tokens[pos]

    a = [1, 2, 3, 4, 5, 6, 7, 8]
    pa = mem.alloc(2)
    compute(pa, a, 0)
    tree.insert(a, pa)
    filler = [9, 9, 9, 9, 9, 9, 9, 9]                     # an unrelated, unlocked leaf
    pf = mem.alloc(2)
    compute(pf, filler, 0)
    tree.insert(filler, pf)
    assert mem.num_free == 1

    b = [1, 2, 3, 4, 5, 6, 70, 80, 90, 91]
    m = tree.match_prefix(b, max_tokens=len(b) - 1)
    assert (m.matched_tokens, m.pages.tolist(), m.cow_page, m.cow_tokens) == (6, [pa[0]], pa[1], 2)
    tree.lock(m.node)
    new = mem.alloc(2)                # one page short: the filler loses its tail page
    assert pa[1] not in new and pf[1] in new
    assert set(tree.tree_page_ids().tolist()) == {*pa.tolist(), int(pf[0])}
    kv[new[0], :m.cow_tokens] = kv[m.cow_page, :m.cow_tokens]
    own = np.concatenate((m.pages, new))
    compute(own, b, m.matched_tokens)
    assert kv[own].ravel()[:len(b)].tolist() == b
    r = tree.insert(b[:8], own[:2])
    assert r.already_cached == 4 and r.pages.tolist() == [pa[0], new[0]]
    mem.free(r.duplicates(own[:2]))
    mem.free(own[2:])                                 # the partial tail page stays private
    tree.unlock(m.node)
    assert kv[pa].ravel().tolist() == a                  # A's pages untouched by the copy
    mem.check_conservation([])
    tree.check_invariants()


def test_copy_on_write_picks_the_child_sharing_most():
    c = RadixCache(page_size=4)
    c.insert([1, 1, 2, 2], pages(0))
    c.insert([1, 1, 2, 3], pages(1))
    c.insert([1, 5, 5, 5], pages(2))
    m = c.match_prefix([1, 1, 2, 9, 9])
    assert (m.matched_tokens, m.cow_tokens, m.pages.size) == (3, 3, 0)
    assert m.cow_page in (0, 1)
    assert m.node.pages.tolist() == [m.cow_page]


# ---------------------------------------------------------------------- locks
def test_lock_protects_path_and_counters_follow():
    c = RadixCache()
    c.insert([1, 2, 3], pages(0, 1, 2))
    c.insert([1, 2, 4, 5], pages(0, 1, 3, 4))
    m = c.match_prefix([1, 2, 4, 5])
    c.lock(m.node)
    assert (c.total_tokens, c.locked_tokens, c.evictable_tokens) == (5, 4, 1)
    freed = c.evict(100)
    assert freed.tolist() == [2]                          # only the unlocked leaf [3]
    assert c.match_prefix([1, 2, 4, 5]).matched_tokens == 4
    c.unlock(m.node)
    assert c.locked_tokens == 0 and c.evictable_tokens == 4
    assert sorted(c.evict(100).tolist()) == [0, 1, 3, 4]
    assert c.total_tokens == 0 and c.num_nodes == 0
    c.check_invariants()


def test_unbalanced_unlock_is_refused():
    c = RadixCache()
    r = c.insert([1, 2], pages(0, 1))
    with pytest.raises(RuntimeError, match="unlock without lock"):
        c.unlock(r.node)
    c.check_invariants()


def test_stale_handle_is_refused():
    c = RadixCache()
    r = c.insert([1, 2], pages(0, 1))
    c.evict(2)
    with pytest.raises(ValueError, match="stale"):
        c.lock(r.node)


def test_locked_leaf_getting_a_child_stays_locked_and_child_is_evictable():
    c = RadixCache()
    r = c.insert([1, 2], pages(0, 1))
    c.lock(r.node)
    c.insert([1, 2, 3], pages(0, 1, 2))
    assert c.evict(10).tolist() == [2]
    c.unlock(r.node)
    c.check_invariants()


# ---------------------------------------------------------------------- eviction
def test_evict_trims_the_tail_and_keeps_the_head():
    c = RadixCache()
    c.insert(list(range(10)), pages(*range(10)))
    freed = c.evict(3)
    assert freed.tolist() == [7, 8, 9]
    assert c.total_tokens == 7
    assert c.match_prefix(list(range(10))).matched_tokens == 7
    c.check_invariants()


def test_evict_trims_whole_pages():
    c = RadixCache(page_size=4)
    c.insert(list(range(16)), pages(0, 1, 2, 3))
    assert c.evict(5).tolist() == [2, 3]                  # 5 tokens need 2 pages
    assert c.total_tokens == 8 and c.evicted_tokens == 8
    c.check_invariants()


def test_parent_whose_last_child_goes_becomes_a_candidate():
    c = RadixCache()
    c.insert([1, 2, 3], pages(0, 1, 2))
    c.insert([1, 2, 4], pages(0, 1, 3))
    c.insert([7], pages(4))                               # newest: evicted last under LRU
    assert c.num_nodes == 4                               # [1,2] -> [3], [4]; [7]
    assert c.evict(2).tolist() == [2, 3]                  # both leaves of [1, 2]
    assert c.evict(2).tolist() == [0, 1]                  # then [1, 2] itself, before [7]
    assert c.evict(5).tolist() == [4]                     # asked more than there is
    assert c.num_nodes == 0 and c.total_tokens == 0
    c.check_invariants()


def test_lru_order():
    c = RadixCache(policy="lru")
    for i in range(3):
        c.insert([i, i], pages(2 * i, 2 * i + 1))
    c.match_prefix([0, 0])                                 # A becomes the most recent
    assert c.evict(2).tolist() == [2, 3]                  # B
    assert c.evict(2).tolist() == [4, 5]                  # C
    assert c.evict(2).tolist() == [0, 1]                  # A


def _hot_old_and_cold_new(policy):
    c = RadixCache(policy=policy)
    c.insert([1, 1], pages(0, 1))                          # hot: matched 5 times, long ago
    for _ in range(5):
        c.match_prefix([1, 1])
    c.insert([2, 2], pages(2, 3))                          # cold: matched once, just now
    c.match_prefix([2, 2])
    return c


def test_lfu_keeps_the_frequent_leaf_that_lru_drops():
    assert _hot_old_and_cold_new("lru").evict(2).tolist() == [0, 1]
    assert _hot_old_and_cold_new("lfu").evict(2).tolist() == [2, 3]


def test_lfu_aging_lets_an_old_hot_leaf_go():
    from radixserve.cache import LFUPolicy

    c = RadixCache(policy=LFUPolicy(half_life=4))
    c.insert([1, 1], pages(0, 1))
    for _ in range(3):
        c.match_prefix([1, 1])                             # 3 hits, then 40 operations idle
    c.insert([2, 2], pages(2, 3))
    for _ in range(40):
        c.match_prefix([3])
    c.match_prefix([2, 2])                                 # 1 recent hit beats 3 stale ones
    assert c.evict(2).tolist() == [0, 1]


def test_gdsf_prefers_keeping_deep_tails():
    """Same hits, shallow leaf newer: LRU evicts the deep one, GDSF the shallow one."""
    for policy, first in (("lru", "deep"), ("gdsf", "shallow")):
        c = RadixCache(policy=policy)
        long_prefix = list(range(100, 4100))
        c.insert(long_prefix + [1, 2], np.arange(4002, dtype=np.int32))
        c.insert(long_prefix + [3, 4], np.concatenate((np.arange(4000), [5000, 5001])).astype(np.int32))
        c.insert([7, 8], pages(6000, 6001))
        c.match_prefix(long_prefix + [1, 2])                # one hit each, the shallow
        c.match_prefix(long_prefix + [3, 4])                # leaf's the most recent
        c.match_prefix([7, 8])
        freed = c.evict(2).tolist()
        want = {"deep": [4000, 4001], "shallow": [6000, 6001]}[first]
        assert freed == want, policy


def test_ties_break_by_node_id_and_custom_policies_plug_in():
    class Constant:
        name = "constant"

        def key(self, node):
            return 0

    class LargestFirst:
        name = "largest"

        def key(self, node):
            return -node.num_tokens

    c = RadixCache(policy=Constant())
    c.insert([3], pages(0))
    c.insert([1], pages(1))
    c.insert([2], pages(2))
    c.match_prefix([2])
    assert c.evict(3).tolist() == [0, 1, 2]                 # creation order
    c = RadixCache(policy=LargestFirst())
    c.insert([1], pages(0))
    c.insert([2, 2, 2], pages(1, 2, 3))
    c.insert([3, 3], pages(4, 5))
    assert c.evict(3).tolist() == [1, 2, 3]
    c.check_invariants()


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        RadixCache(policy="fifo")


# ---------------------------------------------------------------------- namespaces
def test_namespaces_never_share():
    c = RadixCache()
    c.insert([1, 2, 3], pages(0, 1, 2), namespace="a")
    assert c.match_prefix([1, 2, 3]).matched_tokens == 0
    assert c.match_prefix([1, 2, 3], namespace="b").matched_tokens == 0
    r = c.insert([1, 2, 3], pages(3, 4, 5))                 # default namespace: its own pages
    assert r.already_cached == 0 and r.pages.tolist() == [3, 4, 5]
    assert c.match_prefix([1, 2, 3], namespace="a").pages.tolist() == [0, 1, 2]
    assert c.match_prefix([1, 2, 3]).pages.tolist() == [3, 4, 5]
    assert c.total_tokens == 6 and c.num_nodes == 2
    c.check_invariants()
    c.evict(6)
    assert c.match_prefix([1, 2, 3], namespace="a").matched_tokens == 0
    c.check_invariants()


# ---------------------------------------------------------------------- flush
def test_flush_is_refused_while_locked():
    c = RadixCache()
    r = c.insert([1, 2, 3], pages(0, 1, 2))
    c.insert([4], pages(3))
    c.lock(r.node)
    with pytest.raises(CacheLockedError, match="3 cached tokens are locked"):
        c.flush()
    assert c.total_tokens == 4
    c.unlock(r.node)
    assert sorted(c.flush().tolist()) == [0, 1, 2, 3]
    assert (c.total_tokens, c.num_nodes, c.evictable_tokens) == (0, 0, 0)
    assert c.match_prefix([1, 2, 3]).matched_tokens == 0
    with pytest.raises(ValueError, match="stale"):
        c.lock(r.node)
    c.check_invariants()


# ---------------------------------------------------------------------- counters, summary
def test_counters_and_check_invariants_catch_corruption():
    c = RadixCache()
    c.insert([1, 2, 3], pages(0, 1, 2))
    c.match_prefix([1, 2, 9])
    c.match_prefix([5])
    assert (c.query_tokens, c.hit_tokens) == (4, 2)
    c.check_invariants()
    c._total += 1                                          # simulate a bookkeeping bug
    with pytest.raises(AssertionError, match="total_tokens"):
        c.check_invariants()


def test_check_invariants_catches_a_page_owned_twice():
    c = RadixCache()
    c.insert([1], pages(0))
    c.insert([2], pages(0))
    with pytest.raises(AssertionError, match="owned twice"):
        c.check_invariants()


def test_summary_is_bounded_and_json_serializable():
    c = RadixCache()
    alloc = PageAllocator(10_000)
    system = list(range(1000, 1064))
    for i in range(50):
        fresh(c, alloc, system + [i] * 40, ns="t1" if i % 2 else None)
    for _ in range(7):
        c.match_prefix(system + [4] * 40)
    s = build_summary(c, top_k=5)
    text = json.dumps(s)
    assert len(text) < 8000
    assert len(s["top_by_size"]) == 5 and len(s["top_by_hits"]) == 5
    assert s["cached_tokens"] == c.total_tokens and s["num_nodes"] == c.num_nodes
    # The biggest prefixes are the two system prompts (one per namespace) with their subtrees.
    top = s["top_by_size"][0]
    assert top["prefix_tokens"] == 64 and top["subtree_tokens"] == 64 + 25 * 40
    assert top["preview"] == system[:8]
    assert s["top_by_hits"][0]["hits"] == 7 and s["top_by_hits"][0]["namespace"] is None
    assert len(build_summary(c, top_k=10**9)["top_by_size"]) <= 1000


def test_cache_and_replay_packages_import_no_torch():
    """The replay tool uses radixserve.cache on machines without a model (or torch)."""
    import subprocess
    import sys

    code = ("import sys, radixserve.cache, radixserve.cache.prefix_lease, radixserve.replay, "
            "radixserve.replay.replayer, radixserve.replay.cli; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
            "or m.endswith('kv_pool')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
