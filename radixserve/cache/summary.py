"""Bounded, JSON-serializable pictures of a RadixCache for endpoints and tools.

`build_summary`: counters and the top prefixes by size and by hits (size bounded by top_k,
capped at MAX_TOP_K, and PREVIEW_TOKENS). `build_tree`: the tree itself for the cache view
(`GET /cache/tree`): the biggest nodes, at most `limit` of them, the rest folded into one
"other" entry per parent. A "prefix" is a node: the token sequence from its namespace root
to the end of its edge. Sizes are tokens cached at or below a node: the memory it accounts for.
"""

from __future__ import annotations

import heapq
import hmac
from typing import TYPE_CHECKING, Callable, Iterable

from .token_keys import ITEM_BYTES, unpack

if TYPE_CHECKING:
    from .radix_cache import RadixCache
    from .tree_node import TreeNode

__all__ = ["build_summary", "build_tree", "namespace_id", "DEFAULT_NAMESPACE", "MAX_TOP_K",
           "MAX_TREE_LIMIT", "PREVIEW_TOKENS", "TEXT_TOKENS"]

MAX_TOP_K = 1000
PREVIEW_TOKENS = 8
MAX_TREE_LIMIT = 500
TEXT_TOKENS = 64            # at most this many token ids of an edge are revealed
DEFAULT_NAMESPACE = "default"   # the name tree views give the unnamed (None) namespace
HASH_HEX = 12


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


def _subtree_sizes(nodes: list[TreeNode]) -> tuple[dict[int, int], dict[int, int]]:
    """Tokens and nodes at or below each node (`nodes`: parents before children)."""
    tokens = {n.id: n.num_tokens for n in nodes}
    count = dict.fromkeys(tokens, 1)
    for n in reversed(nodes):                  # children before parents
        if n.parent is not None and n.parent.depth:
            tokens[n.parent.id] += tokens[n.id]
            count[n.parent.id] += count[n.id]
    return tokens, count


def _counters(cache: RadixCache, nodes: list[TreeNode]) -> dict:
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
    }


def build_summary(cache: RadixCache, top_k: int = 20) -> dict:
    top_k = max(0, min(int(top_k), MAX_TOP_K))
    nodes = list(cache.iter_nodes())           # parents before children
    subtree, _ = _subtree_sizes(nodes)
    # Ties: the longer prefix (more specific) first, then the older node: deterministic.
    by_size = heapq.nsmallest(top_k, nodes, key=lambda n: (-subtree[n.id], -n.depth, n.id))
    by_hits = heapq.nsmallest(top_k, nodes, key=lambda n: (-n.hit_count, -n.depth, n.id))
    return {
        **_counters(cache, nodes),
        "top_by_size": [_entry(n, subtree[n.id]) for n in by_size],
        "top_by_hits": [_entry(n, subtree[n.id]) for n in by_hits],
    }


# ---------------------------------------------------------------------- tree view
def namespace_id(namespace: str | None) -> str:
    """A namespace as tree views name it (real namespaces are hashes: "key-…", "salt-…")."""
    return DEFAULT_NAMESPACE if namespace is None else namespace


class _TreeView:
    """One `build_tree` call: best-first expansion from the root by subtree tokens.

    A parent always holds more tokens than any child, so popping the biggest candidate
    `limit` times yields the `limit` biggest entries, every one with its parent shown. What
    is left on the heap is exactly the frontier: un-shown entries whose parent is shown.
    """

    def __init__(self, cache: RadixCache, nodes: list[TreeNode], label_key: bytes,
                 reveal: Callable[[str | None], bool]):
        self.clock = cache.clock
        self.tokens, self.count = _subtree_sizes(nodes)
        self.label_key = label_key
        self.reveal = reveal
        self.macs: dict[int, hmac.HMAC] = {}   # node id -> MAC of its whole prefix
        self.tops: dict[str | None, list[TreeNode]] = {}
        for n in nodes:
            if not n.parent.depth:             # a child of its namespace root
                self.tops.setdefault(n.namespace, []).append(n)

    def namespace_size(self, ns: str | None) -> tuple[int, int]:
        tops = self.tops[ns]
        return sum(self.tokens[n.id] for n in tops), sum(self.count[n.id] for n in tops)

    def namespace_entry(self, ns: str | None) -> dict:
        tokens, count = self.namespace_size(ns)
        return {"id": "ns:" + namespace_id(ns), "parent": "root", "kind": "namespace",
                "namespace": namespace_id(ns), "subtree_tokens": tokens, "subtree_nodes": count}

    def node_entry(self, node: TreeNode, parent_id: str) -> dict:
        parent_mac = self.macs.get(node.parent.id) if node.parent.depth else None
        if parent_mac is None:
            mac = hmac.new(self.label_key, namespace_id(node.namespace).encode() + b"\0",
                           "sha256")
        else:
            mac = parent_mac.copy()
        mac.update(node.key)
        self.macs[node.id] = mac
        entry = {
            "id": f"n{node.id}", "parent": parent_id, "kind": "node",
            "namespace": namespace_id(node.namespace),
            "hash": mac.hexdigest()[:HASH_HEX],
            "edge_tokens": node.num_tokens,
            "prefix_tokens": node.depth,
            "subtree_tokens": self.tokens[node.id],
            "subtree_nodes": self.count[node.id],
            "hits": node.hit_count,
            "last_access": node.last_access,
            "idle": self.clock - node.last_access,
            "locked": node.lock_ref > 0,
            "evictable": node.evict_key is not None,
        }
        if self.reveal(node.namespace):
            entry["token_ids"] = unpack(node.key[:TEXT_TOKENS * ITEM_BYTES])
        return entry


def _folded(parent_id: str, leftovers: list[tuple[int, int]]) -> dict:
    return {"id": "other:" + parent_id, "parent": parent_id, "kind": "other",
            "subtree_tokens": sum(t for t, _ in leftovers),
            "subtree_nodes": sum(c for _, c in leftovers)}


def build_tree(cache: RadixCache, limit: int = 200, namespace: str | None = None, *,
               label_key: bytes = b"", reveal: Callable[[str | None], bool] = lambda ns: False
               ) -> dict:
    """The biggest `limit` entries of the tree (namespaces and prefix nodes, capped at
    MAX_TREE_LIMIT) as a flat list with parent ids, parents first; the rest of each shown
    entry's children folded into one "other" entry.

    `namespace`: a `namespace_id` to show alone (None: all). Prefixes are named by an HMAC
    of their namespace and tokens under `label_key` (stable while the key is, unguessable
    without it); `reveal(namespace)` says where the first TEXT_TOKENS token ids of each edge
    may be shown (the caller decides who may read which namespace).
    """
    limit = max(1, min(int(limit), MAX_TREE_LIMIT))
    every = list(cache.iter_nodes())           # parents before children
    nodes = [n for n in every if namespace is None or namespace_id(n.namespace) == namespace]
    view = _TreeView(cache, nodes, label_key, reveal)
    # Heap items: (-tokens, kind, tiebreak, parent id, object); kind 0 = namespace, 1 = node.
    heap: list[tuple] = [(-view.namespace_size(ns)[0], 0, namespace_id(ns), "root", ns)
                         for ns in view.tops]
    heapq.heapify(heap)
    entries = [{"id": "root", "parent": None, "kind": "root",
                "subtree_tokens": sum(view.tokens[n.id] for tops in view.tops.values()
                                      for n in tops),
                "subtree_nodes": len(nodes)}]
    while heap and len(entries) <= limit:
        _, kind, _, parent_id, obj = heapq.heappop(heap)
        if kind == 0:
            entry = view.namespace_entry(obj)
            children: Iterable[TreeNode] = view.tops[obj]
        else:
            entry = view.node_entry(obj, parent_id)
            children = obj.children.values()
        entries.append(entry)
        for child in children:
            heapq.heappush(heap, (-view.tokens[child.id], 1, child.id, entry["id"], child))
    leftovers: dict[str, list[tuple[int, int]]] = {}
    for _, kind, _, parent_id, obj in heap:
        size = view.namespace_size(obj) if kind == 0 else (view.tokens[obj.id], view.count[obj.id])
        leftovers.setdefault(parent_id, []).append(size)
    entries.extend(_folded(parent_id, rest) for parent_id, rest in leftovers.items())
    shown = sum(e["kind"] == "node" for e in entries)
    return {**_counters(cache, every), "clock": view.clock, "limit": limit,
            "namespace": namespace, "shown_nodes": shown, "folded_nodes": len(nodes) - shown,
            "nodes": entries}
