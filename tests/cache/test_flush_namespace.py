"""RadixCache.flush_namespace: a tenant's flush drops its namespace (and the salted ones
nested under it) and nothing else; every page comes back exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.cache.radix_cache import CacheLockedError, RadixCache


def pages(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


@pytest.mark.parametrize("page_size", [1, 4])
def test_flush_namespace_drops_only_that_namespace(page_size):
    tree = RadixCache(page_size=page_size)
    owned = {"k1": [], "k1/salt-a": [], "k2": [], None: [], "k10": []}
    start = 0
    for ns in owned:
        for branch in range(2):                       # two prompts sharing a head: 3 nodes
            tokens = [7] * 8 + [branch + 1] * 8
            p = pages(start, 16 // page_size)
            start += len(p)
            result = tree.insert(tokens, p, ns)
            owned[ns] += list(np.setdiff1d(p, result.duplicates(p)))
    before = {ns: tree.namespace_counts(ns) for ns in owned}
    assert before["k1"]["cached_tokens"] == 48         # k1 and k1/salt-a: 24 tokens each
    assert before["k10"]["cached_tokens"] == 24        # not nested under k1: a name prefix only
    freed = tree.flush_namespace("k1")
    assert sorted(freed) == sorted(owned["k1"] + owned["k1/salt-a"])
    assert tree.namespace_counts("k1") == {"cached_tokens": 0, "locked_tokens": 0, "nodes": 0}
    for ns in ("k2", None, "k10"):
        assert tree.namespace_counts(ns) == before[ns]
        assert tree.match_prefix([7] * 8 + [1] * 8, ns).matched_tokens == 16
    assert tree.match_prefix([7] * 16, "k1").matched_tokens == 0
    assert tree.total_tokens == 72 and tree.evictable_tokens == 72
    tree.check_invariants()
    assert sorted(tree.flush_namespace(None)) == sorted(owned[None])
    assert tree.total_tokens == 48
    tree.check_invariants()


def test_flush_namespace_refuses_while_locked():
    tree = RadixCache()
    tree.insert([1, 2, 3], pages(0, 3), "k1")
    tree.insert([1, 2, 3], pages(3, 3), "k2")
    handle = tree.match_prefix([1, 2, 3], "k1").node
    tree.lock(handle)
    with pytest.raises(CacheLockedError):
        tree.flush_namespace("k1")
    assert list(tree.flush_namespace("k2")) == [3, 4, 5]      # another tenant's lock: no matter
    tree.unlock(handle)
    assert list(tree.flush_namespace("k1")) == [0, 1, 2]
    assert tree.total_tokens == 0
    tree.check_invariants()
