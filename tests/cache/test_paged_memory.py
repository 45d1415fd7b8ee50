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
