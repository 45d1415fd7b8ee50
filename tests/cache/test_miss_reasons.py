"""cache/miss_reasons.py: each reason on a hand-built tree (page sizes 1 and 4), and a
hypothesis check that the reported match length equals a brute-force longest common prefix
over the inserted prompts, that a divergence's position is where the prompt and the cached
path first differ, and that explaining changes nothing in the tree."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import PageAllocator, RadixCache
from radixserve.cache.miss_reasons import MissReason, SeenPrefixes, explain


def insert(tree: RadixCache, alloc: PageAllocator, tokens, ns=None) -> None:
    n = len(tokens) // tree.page_size
    own = alloc.alloc(n)
    r = tree.insert(tokens[:n * tree.page_size], own, ns)
    alloc.free(r.duplicates(own))


def test_each_reason_on_a_small_tree():
    tree, alloc = RadixCache(), PageAllocator(1000)
    seen = SeenPrefixes()
    base = list(range(100, 300))
    insert(tree, alloc, base)
    assert explain(tree, base + [7], None).reason is MissReason.HIT
    r = explain(tree, base[:150] + [5] + base[151:], None)
    assert r.reason is MissReason.DIVERGED and r.matched_tokens == 150
    d = r.divergence
    assert d.position == 150 and d.start == 146
    assert d.prompt_tokens == (246, 247, 248, 249, 5, 251, 252, 253)
    assert d.cached_tokens == (246, 247, 248, 249, 250, 251, 252, 253)
    assert explain(tree, [1, 2, 3], None).reason is MissReason.NEVER_SEEN
    # another namespace of the same tenant (a cache_salt) holds it; another tenant's is not named
    insert(tree, alloc, [9] * 80, "salt-x")
    assert explain(tree, [9] * 80, None).reason is MissReason.OTHER_NAMESPACE
    insert(tree, alloc, [8] * 80, "key-b")
    assert explain(tree, [8] * 80, "key-a").reason is MissReason.NEVER_SEEN
    # seen once, then evicted (dropped: no lower tier)
    other = list(range(500, 700))
    seen.add(seen.chain(other, None))
    insert(tree, alloc, other)
    tree.evict(tree.evictable_tokens)
    r = explain(tree, other, None, seen)
    assert (r.reason, r.tier, r.matched_tokens) == (MissReason.EVICTED, "dropped", 0)
    assert explain(tree, other, None).reason is MissReason.NEVER_SEEN      # no memory of it


def test_divergence_inside_the_first_page_with_pages_of_four():
    tree, alloc = RadixCache(page_size=4), PageAllocator(1000)
    insert(tree, alloc, list(range(40)))
    r = explain(tree, list(range(10)) + [99] + list(range(11, 40)), None)
    assert r.reason is MissReason.DIVERGED and r.divergence.position == 10
    assert r.divergence.cached_tokens[r.divergence.position - r.divergence.start] == 10


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6),
       st.lists(st.integers(0, 3), min_size=2, max_size=14))
def test_matches_a_brute_force_longest_common_prefix(prompts, query):
    tree, alloc = RadixCache(), PageAllocator(200)
    for p in prompts:
        insert(tree, alloc, p)
    before = (tree.num_nodes, tree.total_tokens, tree.clock)
    r = explain(tree, query, None)
    assert (tree.num_nodes, tree.total_tokens, tree.clock) == before
    limit = len(query) - 1

    def lcp(p):
        n = 0
        while n < min(len(p), limit) and p[n] == query[n]:
            n += 1
        return n

    best = max(lcp(p) for p in prompts)
    assert r.matched_tokens == best == tree.peek_prefix(query, max_tokens=limit)
    if best >= limit:
        assert r.reason is MissReason.HIT
    elif best > 0 and any(len(p) > best for p in prompts if lcp(p) == best):
        assert r.reason is MissReason.DIVERGED
        d = r.divergence
        assert d.position == best
        assert d.prompt_tokens[best - d.start] != d.cached_tokens[best - d.start]
        assert any(list(d.cached_tokens) == p[d.start:d.start + len(d.cached_tokens)]
                   for p in prompts)
    else:
        assert r.reason is MissReason.NEVER_SEEN
