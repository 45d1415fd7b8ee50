"""TierQueue: the nodes of one lower tier (host or disk) in eviction order.

Making room in a tier used to sort every node of the tier by its policy key each time: the
replay paid 3.2x CPU for it, and the server paid it on every tier eviction. This keeps the
tier's nodes in an EvictionQueue (the pool's heap, reused), re-keyed when what a key reads
changes (LowerTiers.rekey: a match or insert touched the node, a split shortened it), so
making room reads only the first few.

A lower node is not an evictable pool leaf, so its entry cannot live in `node.evict_key`
(the tree reads that as "in the pool's queue"): each queued node gets a small `_Handle`
whose `id` and `evict_key` the EvictionQueue uses.

Every node of the tier is queued, including those that may not leave now (locked, waiting
for their disk write, with a child in the tier): `in_order` pops the nodes in order for one
pass of making room and puts back those still in the tier when the pass ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .eviction_queue import EvictionQueue
from .tree_node import TreeNode

__all__ = ["TierQueue"]


class _Handle:
    """A queued lower node, as the EvictionQueue sees it."""

    __slots__ = ("id", "evict_key", "node")

    def __init__(self, node: TreeNode):
        self.id = node.id
        self.evict_key = None
        self.node = node


class TierQueue:
    def __init__(self, policy: Any):
        self.policy = policy
        self._queue = EvictionQueue()
        self._handles: dict[int, _Handle] = {}      # node id -> its handle while queued

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, node: TreeNode) -> None:
        handle = self._handles[node.id] = _Handle(node)
        self._queue.add(handle, self.policy.key(node))

    def discard(self, node: TreeNode) -> None:
        """Take `node` out (nothing when it is not queued)."""
        handle = self._handles.pop(node.id, None)
        if handle is not None and handle.evict_key is not None:
            self._queue.discard(handle)

    def rekey(self, node: TreeNode) -> None:
        """The node's key may have changed (nothing when it is not queued)."""
        handle = self._handles.get(node.id)
        if handle is not None and handle.evict_key is not None:
            self._queue.rekey(handle, self.policy.key(node))

    def in_order(self, still_here: Any) -> Iterator[TreeNode]:
        """The queued nodes, first to go first, taken out as they are read; when the
        iteration ends, those for which `still_here(node)` holds are queued again (under
        their key now)."""
        taken: list[TreeNode] = []
        try:
            while True:
                handle = self._queue.pop()
                if handle is None:
                    return
                del self._handles[handle.id]
                taken.append(handle.node)
                yield handle.node
        finally:
            for node in taken:
                if still_here(node) and node.id not in self._handles:
                    self.add(node)

    def entries(self) -> dict[int, Any]:
        """Node id -> the key it is queued under, for invariant checks."""
        return {h.id: h.evict_key[0] for h in self._handles.values()
                if h.evict_key is not None}
