"""DiskPlaces: where each page written to the disk tier sits in the tree, for its journal.

A page file alone cannot be restored after a crash: the restart must know which prefix its
K/V belongs to. Before the tree queues a page's write to disk (cache/tiers.py: `_place`),
this computes the page's path hash, its predecessor's, and its tokens
(cache/path_hash.py), and hands them to the disk tier (storage/tier_pages.py:
`describe`), which appends them to the journal once the file is complete. One walk up the
tree per demoted node: O(depth) hashing, on the thread that owns the tree.

It also orders the kept copies (the inclusive tier's files of pages now in the pool) the
disk tier drops to make room (`spare`): a copy that another disk page continues is the
prefix that page needs to be restored after a crash, so it goes only after that page.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.cache.path_hash import node_page_hashes
from radixserve.cache.token_keys import ITEM_BYTES, unpack
from radixserve.cache.tree_node import TreeNode
from radixserve.storage.journal import PagePlace
from radixserve.storage.tier_pages import TierPages

__all__ = ["DiskPlaces"]


class DiskPlaces:
    """cache/tiers.py's `DiskPlaces` over one disk tier."""

    def __init__(self, disk: TierPages, page_size: int):
        self.disk = disk
        self.page_size = page_size

    def missing(self, node: TreeNode) -> bool:
        found = node_page_hashes(node, self.page_size)
        if found is None:
            return False
        return not all(self.disk.has_hash(h) for h in found[1])

    def placed(self, node: TreeNode, slots: list[int]) -> None:
        found = node_page_hashes(node, self.page_size)
        if found is None:               # not whole pages: not restorable, not journaled
            for slot in slots:
                self.disk.describe(slot, None)
            return
        parent, hashes = found
        step = self.page_size * ITEM_BYTES
        key = node.key
        for i, slot in enumerate(slots):
            if i >= len(hashes):                # a partial last page: not restorable
                self.disk.describe(slot, None)
                continue
            self.disk.describe(slot, PagePlace(hashes[i], parent, node.namespace,
                                               unpack(key[i * step:(i + 1) * step]),
                                               node.last_access))
            parent = hashes[i]

    def touched(self, slots: list[int], last_access: int) -> None:
        self.disk.touched(slots, last_access)

    def spare(self, kept: Sequence[int], n: int) -> list[int]:
        """Up to `n` of the `kept` slots (oldest first) that can be dropped, in an order
        that never drops a page another remaining disk page continues: a copy needed as a
        prefix is skipped, and once its last continuation is chosen it follows (a kept
        run goes tail first)."""
        keeping = set(kept)
        out: list[int] = []
        gone: set[int] = set()
        for slot in kept:
            while slot is not None and len(out) < n and slot not in gone \
                    and not self.disk.needed(slot, gone):
                out.append(slot)
                gone.add(slot)
                slot = next((p for p in self.disk.parent_slots(slot) if p in keeping), None)
            if len(out) >= n:
                break
        return out
