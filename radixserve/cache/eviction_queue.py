"""EvictionQueue: the tree's unlocked leaves, smallest policy key first.

A binary heap (`heapq`) with lazy removal, not a sorted list: every request adds a leaf and
locks, re-keys or evicts a few, and a heap push or pop is one C call where a sorted list's
add or remove is several Python-level steps (a third of the tree's time per request on long
prompts). Removing a node only marks it (`node.evict_key = None`); its entry stays in the
heap, stale, until it reaches the top or the heap is compacted (when stale entries
outnumber live ones), so every operation stays O(log n) amortised.

An entry is `(key, node.id, seq, node)`, ordered by the policy key and then the node id (the
order the tree has always used); `seq` is unique, so two entries of one node with equal keys
(removed and added back unchanged) never compare the nodes themselves. A node's
`evict_key` *is* its live entry: an entry is live iff `entry[3].evict_key is entry`.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from itertools import count
from typing import Any, Iterator

from .tree_node import TreeNode

__all__ = ["EvictionQueue"]

_COMPACT_FLOOR = 256        # stale entries tolerated before a compaction is considered


class EvictionQueue:
    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._live = 0
        self._seq = count()

    def __len__(self) -> int:
        """Live entries (nodes in the queue)."""
        return self._live

    def add(self, node: TreeNode, key: Any) -> None:
        """Queue `node` (not queued now) under the policy key `key`."""
        entry = node.evict_key = (key, node.id, next(self._seq), node)
        heappush(self._heap, entry)
        self._live += 1

    def discard(self, node: TreeNode) -> None:
        """Take `node` (queued now) out: its entry goes stale."""
        node.evict_key = None
        self._live -= 1
        self._maybe_compact()

    def rekey(self, node: TreeNode, key: Any) -> None:
        """Move `node` (queued now) to `key`; nothing to do when the key is unchanged."""
        if key != node.evict_key[0]:
            entry = node.evict_key = (key, node.id, next(self._seq), node)
            heappush(self._heap, entry)
            self._maybe_compact()

    def first(self) -> TreeNode | None:
        """The node to evict next (it stays queued), or None when the queue is empty."""
        heap = self._heap
        while heap:
            entry = heap[0]
            if entry[3].evict_key is entry:
                return entry[3]
            heappop(heap)
        return None

    def pop(self) -> TreeNode | None:
        """Take the node to evict next out of the queue (None when empty)."""
        node = self.first()
        if node is not None:
            heappop(self._heap)
            node.evict_key = None
            self._live -= 1
        return node

    def clear(self) -> None:
        for entry in self._heap:
            if entry[3].evict_key is entry:
                entry[3].evict_key = None
        self._heap.clear()
        self._live = 0

    def __iter__(self) -> Iterator[TreeNode]:
        """The queued nodes in eviction order, lazily (a copy of the heap, popped as read:
        reading the first k costs O(n + k log n), not a sort of all of them)."""
        heap = self.entries()
        heapify(heap)
        while heap:
            yield heappop(heap)[3]

    def entries(self) -> list[tuple]:
        """The live entries (unordered), for invariant checks."""
        return [e for e in self._heap if e[3].evict_key is e]

    def _maybe_compact(self) -> None:
        """Rebuild the heap from its live entries once stale ones outnumber them."""
        stale = len(self._heap) - self._live
        if stale > _COMPACT_FLOOR and stale > self._live:
            self._heap = self.entries()
            heapify(self._heap)
