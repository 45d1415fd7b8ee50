"""PagedMemory: allocation that evicts, refusal that changes nothing, conservation checks."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.cache import CacheLockedError, OutOfPages, PagedMemory, RadixCache


def setup(num_pages=8, page_size=1):
    tree = RadixCache(page_size)
    return PagedMemory(num_pages, tree), tree


def test_alloc_evicts_only_what_is_short():
    mem, tree = setup(8)
    r1 = tree.insert([1, 2, 3], mem.alloc(3))
    tree.insert([4, 5, 6], mem.alloc(3))
    tree.match_prefix([4, 5, 6])                          # [1, 2, 3] is the LRU leaf
    assert mem.available_pages() == 8 and mem.num_free == 2
    got = mem.alloc(4)                                    # 2 free + 2 evicted from [1, 2, 3]
    assert len(set(got.tolist())) == 4
    assert tree.total_tokens == 4 and mem.evicted_tokens == 2
    assert tree.peek_prefix([1, 2, 3]) == 1               # its head survives
    assert set(got.tolist()) >= set(r1.pages[1:].tolist())
    mem.check_conservation([got])
    tree.check_invariants()


def test_alloc_refuses_with_nothing_changed_when_locked_pages_block_it():
    mem, tree = setup(6)
    r = tree.insert([1, 2, 3, 4], mem.alloc(4))
    tree.lock(r.node)
    held = mem.alloc(1)
    before = (mem.num_free, tree.total_tokens, tree.tree_page_ids().tolist())
    with pytest.raises(OutOfPages) as e:
        mem.alloc(2)
    assert (e.value.requested, e.value.available) == (2, 1)
    assert (mem.num_free, tree.total_tokens, tree.tree_page_ids().tolist()) == before
    tree.unlock(r.node)
    assert mem.available_pages() == 5
    got = mem.alloc(5)
    mem.check_conservation([held, got])


def test_alloc_all_from_the_tree_at_page_size_4():
    mem, tree = setup(4, page_size=4)
    tree.insert(list(range(16)), mem.alloc(4))
    got = mem.alloc(3)
    assert not got.flags.writeable and len(got) == 3      # ids are values: read-only
    assert tree.total_tokens == 4
    mem.check_conservation([got])


def test_conservation_names_the_problem():
    mem, tree = setup(6)
    tree.insert([1, 2], mem.alloc(2))
    private = mem.alloc(2)
    mem.check_conservation([private])
    with pytest.raises(AssertionError, match="leaked"):
        mem.check_conservation([private[:1]])
    with pytest.raises(AssertionError, match="in both"):
        mem.check_conservation([private, tree.tree_page_ids()[:1]])
    with pytest.raises(AssertionError, match="twice"):
        mem.check_conservation([np.concatenate((private, private[:1]))])
    with pytest.raises(AssertionError, match="out-of-range"):
        mem.check_conservation([private, np.array([6])])


def test_flush_cache_frees_the_tree_and_refuses_while_locked():
    mem, tree = setup(6)
    r = tree.insert([1, 2, 3], mem.alloc(3))
    tree.lock(r.node)
    with pytest.raises(CacheLockedError):
        mem.flush_cache()
    assert tree.total_tokens == 3 and mem.num_free == 3
    tree.unlock(r.node)
    assert mem.flush_cache() == 3
    assert tree.total_tokens == 0 and mem.num_free == 6
    mem.check_conservation([])


class _CountingObserver:
    """Counts the tree's trims (the KV events' capture sees one per trim call)."""

    def __init__(self):
        self.trims = 0

    def trimmed(self, node, keep_tokens):
        self.trims += 1

    def stored(self, node):
        pass

    def split(self, upper, lower):
        pass

    def removed(self, node):
        pass

    def moved(self, node, src):
        pass

    def cleared(self):
        pass


@pytest.mark.parametrize("page_size", [1, 4])
def test_evict_ahead_evicts_once_what_single_allocations_would(page_size):
    """A step's decodes allocate one page each: `evict_ahead` first evicts their pages in
    one pass (one trim of the LRU leaf, not one per page), the same pages the single
    allocations would have evicted, and the allocations then come off the free list."""
    trees = {}
    for ahead in (False, True):
        mem, tree = setup(12, page_size)
        observer = _CountingObserver()
        tree.attach_observer(observer)
        tree.insert(list(range(8 * page_size)), mem.alloc(8))
        tree.insert(list(range(100, 100 + 4 * page_size)), mem.alloc(4))
        tree.match_prefix(list(range(100, 100 + 4 * page_size)))  # the long one is LRU
        assert mem.num_free == 0
        if ahead:
            assert mem.evict_ahead(5) == 5 and mem.num_free == 5
            assert mem.evict_ahead(3) == 0                   # enough free already
        got = [mem.alloc(1) for _ in range(5)]
        mem.check_conservation(got)
        tree.check_invariants()
        trees[ahead] = (tree.tree_page_ids().tolist(), observer.trims, mem.evicted_tokens)
    (kept_single, trims_single, evicted_single) = trees[False]
    (kept_ahead, trims_ahead, evicted_ahead) = trees[True]
    assert sorted(kept_single) == sorted(kept_ahead)     # the same pages stay cached
    assert evicted_single == evicted_ahead == 5 * page_size
    assert (trims_single, trims_ahead) == (5, 1)


def test_evict_ahead_takes_only_what_the_tree_can_give():
    mem, tree = setup(6)
    r = tree.insert([1, 2, 3, 4], mem.alloc(4))
    tree.lock(r.node)
    tree.insert([9, 8], mem.alloc(2))
    assert mem.evict_ahead(5) == 2 and mem.num_free == 2    # the locked 4 stay
    assert tree.peek_prefix([1, 2, 3, 4]) == 4
    tree.unlock(r.node)
    mem.check_conservation()
