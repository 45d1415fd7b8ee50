"""TreeObserver: what the radix tree tells an onlooker about the tokens it holds.

The tree calls these at the few places where tokens enter it, leave it or change tier
(radix_cache.py; tiers.py through `RadixCache.tier_changed`), so something outside the
cache (the KV events publisher, radixserve/events) can follow it without the tree knowing
what it does: the tree imports no transport, and with no observer attached nothing is
called. Calls come on the tree's own thread, while the node is still linked to its parent,
so the observer may walk the path above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .tier_types import Tier

if TYPE_CHECKING:
    from .tree_node import TreeNode

__all__ = ["TreeObserver"]


class TreeObserver(Protocol):
    def stored(self, node: TreeNode) -> None:
        """`node` is new in the tree: its tokens are held in `node.tier` (a new pool leaf,
        or a lower-tier node rebuilt from a saved index). A split is `split`."""

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """`lower`'s edge was cut: its first tokens are now the new node `upper`, between
        it and its old parent. No held token changes (for an observer that mirrors the
        tree's shape)."""

    def removed(self, node: TreeNode) -> None:
        """`node` is about to leave the tree with all its tokens (evicted, dropped from a
        lower tier, or its namespace flushed)."""

    def trimmed(self, node: TreeNode, keep_tokens: int) -> None:
        """A pool leaf is about to keep only its first `keep_tokens` tokens."""

    def moved(self, node: TreeNode, src: Tier) -> None:
        """`node`'s tokens went from tier `src` to `node.tier` (demoted or loaded)."""

    def cleared(self) -> None:
        """The whole tree was flushed."""
