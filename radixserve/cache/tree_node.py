"""TreeNode: one edge of the radix tree and the KV pages that hold its tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from .token_keys import ITEM_BYTES, unpack

__all__ = ["TreeNode"]


@dataclass(slots=True, eq=False)
class TreeNode:
    """An edge: `key` (the token ids after the parent) and `pages` (the ids holding them).

    Namespace roots have an empty key and `depth == 0`; they hold nothing, are never locked
    or evicted and are not counted in `num_nodes`. Identity equality (eq=False): two nodes
    with equal fields are still different places in the tree.
    """

    id: int
    key: bytes                     # packed token ids (token_keys.py), num_tokens ==
                                   #   len(pages) * page_size
    pages: np.ndarray              # int32, read-only (callers get views of it)
    parent: TreeNode | None        # None for namespace roots and for evicted (stale) nodes
    depth: int                     # tokens from the namespace root to the end of this edge
    namespace: str | None
    children: dict[Hashable, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0              # locks held at this node or below
    last_access: int = 0           # the cache's logical clock at the last match/insert
    hit_count: int = 0             # match_prefix calls that used this node's tokens
    evict_key: Any = None          # (policy key, id) while in the evictable set, else None
    cow_index: dict[int, list[TreeNode]] | None = None  # page_size > 1: children by 1st token

    @property
    def num_tokens(self) -> int:
        return len(self.key) // ITEM_BYTES

    @property
    def tokens(self) -> list[int]:
        """The edge's token ids (unpacked: for tests and introspection, not hot paths)."""
        return unpack(self.key)

    def __repr__(self) -> str:
        n = self.num_tokens
        head = unpack(self.key[:4 * ITEM_BYTES])
        more = "..." if n > 4 else ""
        return (f"TreeNode(id={self.id}, ns={self.namespace!r}, depth={self.depth}, "
                f"key={head}{more} ({n}), lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")
