"""build_summary: a bounded, JSON-serializable picture of a RadixCache for endpoints and tools.

Size is bounded by top_k (capped at MAX_TOP_K) and PREVIEW_TOKENS, whatever the tree holds.
A "prefix" is a node: the token sequence from its namespace root to the end of its edge.
Ranked by size (tokens cached at or below it: the memory it accounts for) and by hits.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .token_keys import ITEM_BYTES, unpack

if TYPE_CHECKING:
    from .radix_cache import RadixCache
    from .tree_node import TreeNode

__all__ = ["build_summary", "MAX_TOP_K", "PREVIEW_TOKENS"]

MAX_TOP_K = 1000
PREVIEW_TOKENS = 8


def _prefix_preview(node: TreeNode) -> list[int]:
    """The first PREVIEW_TOKENS tokens of the node's whole prefix (from its namespace root)."""
    path = []
    while node.depth:
        path.append(node)
        node = node.parent
    out: list[int] = []
    for n in reversed(path):
        out.extend(unpack(n.key[:(PREVIEW_TOKENS - len(out)) * ITEM_BYTES]))
        if len(out) >= PREVIEW_TOKENS:
            break
    return out


def _entry(node: TreeNode, subtree_tokens: int) -> dict:
    return {
        "namespace": node.namespace,
        "prefix_tokens": node.depth,
        "edge_tokens": node.num_tokens,
        "subtree_tokens": subtree_tokens,
        "hits": node.hit_count,
        "locked": node.lock_ref > 0,
        "last_access": node.last_access,
        "preview": _prefix_preview(node),
        "edge_preview": unpack(node.key[:PREVIEW_TOKENS * ITEM_BYTES]),
    }


def build_summary(cache: RadixCache, top_k: int = 20) -> dict:
    top_k = max(0, min(int(top_k), MAX_TOP_K))
    nodes = list(cache.iter_nodes())           # parents before children
    subtree = {n.id: n.num_tokens for n in nodes}
    for n in reversed(nodes):                  # children before parents
        if n.parent is not None and n.parent.depth:
            subtree[n.parent.id] += subtree[n.id]
    # Ties: the longer prefix (more specific) first, then the older node: deterministic.
    by_size = heapq.nsmallest(top_k, nodes, key=lambda n: (-subtree[n.id], -n.depth, n.id))
    by_hits = heapq.nsmallest(top_k, nodes, key=lambda n: (-n.hit_count, -n.depth, n.id))
    queries = cache.query_tokens
    return {
        "page_size": cache.page_size,
        "policy": getattr(cache.policy, "name", type(cache.policy).__name__),
        "cached_tokens": cache.total_tokens,
        "evictable_tokens": cache.evictable_tokens,
        "locked_tokens": cache.locked_tokens,
        "num_nodes": cache.num_nodes,
        "num_namespaces": len({n.namespace for n in nodes}),
        "query_tokens": queries,
        "hit_tokens": cache.hit_tokens,
        "hit_rate": cache.hit_tokens / queries if queries else 0.0,
        "evicted_tokens": cache.evicted_tokens,
        "top_by_size": [_entry(n, subtree[n.id]) for n in by_size],
        "top_by_hits": [_entry(n, subtree[n.id]) for n in by_hits],
    }
