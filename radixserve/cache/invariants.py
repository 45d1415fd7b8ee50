"""check_tree: recount a RadixCache from scratch and compare with what it keeps incrementally.

The O(1) counters, the evictable set and the lock references are all maintained
incrementally, so a slow, obviously-correct recount is what tests and the debug mode compare
them against. Reads the tree through `CheckedTree` (its public reading API): radix_cache.py
imports this module, never the other way round. The tiers' own bookkeeping is checked by
their hooks (`TierHooks.check`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Protocol

import numpy as np

from .tier_types import Tier
from .token_keys import ITEM_BYTES

if TYPE_CHECKING:
    from .eviction import EvictionPolicy
    from .tree_node import TreeNode

__all__ = ["CheckedTree", "check_tree"]


class CheckedTree(Protocol):
    """What the recount reads of a RadixCache."""

    page_size: int
    policy: EvictionPolicy
    total_tokens: int
    evictable_tokens: int
    num_nodes: int
    hit_tokens: int
    query_tokens: int
    num_evictable: int

    def namespace_roots(self) -> dict[str | None, TreeNode]: ...

    def evictable_entries(self) -> list[tuple]: ...

    def iter_evictable(self) -> Iterator[TreeNode]: ...

    def child_key(self, edge: bytes) -> bytes: ...


def check_tree(cache: CheckedTree) -> None:
    ps = cache.page_size
    cached = unlocked = nodes = 0
    pages: list[np.ndarray] = []
    candidates: dict[int, object] = {}
    seen: set[int] = set()
    for ns, root in cache.namespace_roots().items():
        assert root.depth == 0 and not root.key and root.parent is None, f"bad root {root}"
        assert root.namespace == ns, f"root {root} filed under namespace {ns!r}"
        assert root.children, f"empty namespace root {ns!r} kept"
        stack = [root]
        while stack:
            node = stack.pop()
            assert node.id not in seen, f"{node} reachable twice"
            seen.add(node.id)
            locks_below = 0
            for ck, child in node.children.items():
                assert child.parent is node, f"{child} has parent {child.parent}, not {node}"
                assert child.namespace == ns, f"{child} in namespace {ns!r}"
                k = child.num_tokens
                assert len(child.key) % ITEM_BYTES == 0, f"{child}: key of {len(child.key)} bytes"
                assert k > 0 and k == len(child.pages) * ps, f"{child}: {len(child.pages)} pages"
                assert ck == cache.child_key(child.key), f"{child} filed under {ck!r}"
                assert child.filed_as == ck, f"{child} says it is filed as {child.filed_as!r}"
                assert child.depth == node.depth + k, f"{child} depth vs parent {node.depth}"
                assert child.pages.dtype == np.int32, f"{child} pages {child.pages.dtype}"
                assert child.lock_ref >= 0, f"{child} negative lock_ref"
                assert child.tier >= (node.tier if node.depth else Tier.POOL), \
                    f"{child} in tier {child.tier} under {node} in tier {node.tier}"
                locks_below += child.lock_ref
                stack.append(child)
            if ps > 1 and node.children:
                by_first = {t: sorted(c.id for c in cs) for t, cs in (node.cow_index or {}).items()}
                want: dict[int, list[int]] = {}
                for c in node.children.values():
                    want.setdefault(c.key[:ITEM_BYTES], []).append(c.id)
                assert by_first == {t: sorted(v) for t, v in want.items()}, f"{node} cow_index"
            if not node.depth:
                continue
            assert node.lock_ref >= locks_below, f"{node}: lock_ref < sum over children"
            nodes += 1
            pages.append(node.pages)
            if node.tier != Tier.POOL:  # host/disk: their hooks' check() counts them
                assert node.evict_key is None, f"{node} in tier {node.tier} is keyed"
                continue
            cached += node.num_tokens
            if node.lock_ref == 0:
                unlocked += node.num_tokens
                if not any(c.tier == Tier.POOL for c in node.children.values()):
                    candidates[node.id] = node
                    want_key = (cache.policy.key(node), node.id)
                    assert node.evict_key is not None and node.evict_key[:2] == want_key, \
                        f"{node}: stale eviction key {node.evict_key} != {want_key}"
                    continue
            assert node.evict_key is None, f"{node} not evictable but keyed {node.evict_key}"
    in_set = {n.id: n for n in cache.iter_evictable()}
    live = cache.evictable_entries()
    assert len(in_set) == len(live) == cache.num_evictable, \
        "a node is in the evictable set twice"
    assert in_set.keys() == candidates.keys(), (
        f"evictable set != unlocked leaves: extra {sorted(in_set.keys() - candidates.keys())}, "
        f"missing {sorted(candidates.keys() - in_set.keys())}")
    keys = [n.evict_key[:2] for n in cache.iter_evictable()]
    assert keys == sorted(keys), "evictable set out of order"
    assert cached == cache.total_tokens, f"total_tokens {cache.total_tokens} != {cached}"
    assert unlocked == cache.evictable_tokens, \
        f"evictable_tokens {cache.evictable_tokens} != {unlocked}"
    assert nodes == cache.num_nodes, f"num_nodes {cache.num_nodes} != {nodes}"
    assert cache.hit_tokens <= cache.query_tokens, "more hits than queries"
    all_pages = np.concatenate([np.empty(0, np.int32), *pages])
    uniq, counts = np.unique(all_pages, return_counts=True)
    assert len(uniq) == len(all_pages), f"pages owned twice in the tree: {uniq[counts > 1][:16]}"
