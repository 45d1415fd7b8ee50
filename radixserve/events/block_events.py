"""BlockEvents: the radix tree's changes as vLLM KV events, at a fixed block size.

External routers index blocks of `block_size` tokens (16 by default), whatever our tree's
page size: a block is a whole-block prefix of a cached path, and it is "in" the tier of the
node that holds its last token (a node's parent is in the same tier or a higher one, so
that is the slowest tier the block touches). This observer (cache/tree_observer.py) turns
each tree change into the blocks it changes:
- a node stored: `BlockStored` for the blocks ending in it, in its tier's medium;
- removed (or trimmed): `BlockRemoved` for those blocks (or those past the cut);
- moved between tiers: `BlockRemoved` in the old medium, then `BlockStored` in the new;
- the tree flushed: `AllBlocksCleared`.

Block hashes are the path hashes of cache/path_hash.py (chained over the namespace and
every token to the block's end; `block_int`: the same ids the cluster's digests carry), so
equal hashes are equal namespaced prefixes and every `parent_block_hash` is a block still
announced: a node's parent stays in the tree while it does. The namespace goes into each
block's `extra_keys`, so a consumer that recomputes keys from tokens keeps tenants apart.

Work per change is proportional to the tokens changed: each node's chain state at its end
(the last whole block's hash and the tokens after it) and the hashes of the blocks ending
in it are kept by node id. A split leaves them right (the lower part keeps its id and its
end; blocks are known by their end position, so those now ending in the upper part are
skipped); a trim cuts the hash list and drops the chain state; a node leaving drops both.
So evicting a long leaf page by page (page size 1) hashes nothing again. It observes
either the tree itself or, in the engine, the shadow tree that tree_facts.FactReplay
keeps on the publisher's thread; `take_batch` hands the events gathered since the last
call to the publisher.
"""

from __future__ import annotations

import sys
import time
from array import array
from typing import TYPE_CHECKING

from radixserve.cache.path_hash import DIGEST_BYTES, block_int, chain_blocks, namespace_seed
from radixserve.cache.tier_types import Tier
from radixserve.cache.token_keys import ITEM_BYTES, TYPECODE
from radixserve.events.schema import (MEDIUM_CPU, MEDIUM_CPU_HOST, MEDIUM_DISK, MEDIUM_GPU,
                                      EventClasses)

if TYPE_CHECKING:
    from radixserve.cache.tree_node import TreeNode

__all__ = ["BlockEvents", "media_for"]


def media_for(pool_device: str) -> dict[Tier, str]:
    """The `medium` of each tier: vLLM's "GPU" for a GPU pool and "CPU" for memory below
    it; a pool in CPU memory is "CPU" and the host tier below it "CPU_HOST"."""
    if pool_device.startswith("cuda"):
        return {Tier.POOL: MEDIUM_GPU, Tier.HOST: MEDIUM_CPU, Tier.DISK: MEDIUM_DISK}
    return {Tier.POOL: MEDIUM_CPU, Tier.HOST: MEDIUM_CPU_HOST, Tier.DISK: MEDIUM_DISK}


def block_ints(hashes: list[bytes]) -> list[int]:
    """`block_int` of each path hash, in a few C calls instead of one call per hash (the
    publisher's thread holds the GIL while it hashes: every block counts)."""
    words = array("Q", b"".join(hashes))         # 64-bit words, two per 16-byte hash
    if sys.byteorder != "little":
        words.byteswap()
    return words[::DIGEST_BYTES // 8].tolist()


class BlockEvents:
    """A TreeObserver that records vLLM events for whole blocks of `block_size` tokens."""

    def __init__(self, classes: EventClasses, block_size: int, page_size: int,
                 media: dict[Tier, str], data_parallel_rank: int = 0):
        if block_size < 1 or block_size % page_size:
            raise ValueError(f"--kv-events-block-size must be a multiple of the page size "
                             f"({page_size}), got {block_size}")
        self.classes = classes
        self.block_size = block_size
        self.media = media
        self.rank = data_parallel_rank
        self._step = block_size * ITEM_BYTES
        self._carry: dict[int, tuple[bytes, bytes]] = {}     # node id -> (hash, tail bytes)
        # node id -> (end position of its first block, ids of the blocks ending in it)
        self._hashes: dict[int, tuple[int, list[int]]] = {}
        self._seeds: dict[str | None, bytes] = {}
        self._events: list = []
        self._sealed = 0            # events before this index are final (see mark)

    # ------------------------------------------------------------------ TreeObserver
    def stored(self, node: TreeNode) -> None:
        self._store(node, node.tier)

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """Nothing to do: `lower` keeps its id and its end, and the blocks it knows are
        known by their end position (see `_hashes_of`)."""

    def removed(self, node: TreeNode) -> None:
        hashes = self._hashes_of(node)
        self._carry.pop(node.id, None)
        self._hashes.pop(node.id, None)
        if hashes:
            self._remove(hashes, node.tier)

    def trimmed(self, node: TreeNode, keep_tokens: int) -> None:
        start = node.depth - node.num_tokens
        known = self._hashes.get(node.id)
        if known is None or known[0] + (len(known[1]) - 1) * self.block_size \
                > start + keep_tokens:      # else the cut is inside the last partial block
            # (may compute the chain state at the old end: dropped below)
            hashes = self._hashes_of(node)
            # Blocks ending past the cut: those whose end lies beyond start + keep_tokens.
            first_end = (start // self.block_size + 1) * self.block_size
            kept = max(0, (start + keep_tokens - first_end) // self.block_size + 1)
            self._hashes[node.id] = (first_end, hashes[:kept])
            if hashes[kept:]:
                self._remove(hashes[kept:], node.tier)
        self._carry.pop(node.id, None)      # the chain state at the old end

    def moved(self, node: TreeNode, src: Tier) -> None:
        blocks = self._blocks(node)
        if blocks[1]:
            self._remove(blocks[1], src)
            self._store(node, node.tier, blocks)

    def cleared(self) -> None:
        self._carry.clear()
        self._hashes.clear()
        self._events.append(self.classes.AllBlocksCleared())

    # ------------------------------------------------------------------ batches
    def take_batch(self):
        """The events since the last call as one KVEventBatch (None: there were none)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        self._sealed = 0
        return self.classes.KVEventBatch(ts=time.time(), events=events,
                                         data_parallel_rank=self.rank)

    def mark(self) -> int:
        """Where the stream stands: the number of events gathered for the next batch. A
        consumer that applied the batches before it and these events has seen every
        change so far; later events never merge into them."""
        self._sealed = len(self._events)
        return self._sealed

    # ------------------------------------------------------------------ blocks
    def _store(self, node: TreeNode, tier: Tier, blocks: tuple | None = None) -> None:
        parent, hashes, data = blocks or self._blocks(node)
        if not hashes:
            return
        n = len(hashes)
        extra = None if node.namespace is None else [(node.namespace,)] * n
        tokens = array(TYPECODE)          # token_keys.unpack without a copy of `data`
        tokens.frombytes(memoryview(data)[:n * self._step])
        # positional, in vLLM's field order (msgspec checks nothing at construction)
        self._events.append(self.classes.BlockStored(
            hashes, parent, tokens.tolist(), self.block_size, None, self.media[tier], None,
            extra))

    def _remove(self, ids: list[int], tier: Tier) -> None:
        medium = self.media[tier]
        last = self._events[-1] if len(self._events) > self._sealed else None
        if type(last) is self.classes.BlockRemoved and last.medium == medium:
            last.block_hashes.extend(ids)       # one event for a run of evictions
        else:
            self._events.append(self.classes.BlockRemoved(block_hashes=list(ids),
                                                          medium=medium))

    def _blocks(self, node: TreeNode) -> tuple[int | None, list[int], bytes]:
        """(the parent block's id or None, the ids of the blocks ending in `node`, the
        packed tokens from the first of those blocks' start to the node's end)."""
        up = node.parent
        carry = self._carry.get(up.id) if up.depth else None
        h, rest = carry if carry is not None else self._carry_of(up)
        key = node.key
        data = rest + key if rest else key
        hashes = chain_blocks(h, data, self.block_size)
        first_start = node.depth - node.num_tokens - len(rest) // ITEM_BYTES
        whole = len(data) - len(data) % self._step
        if hashes:
            ids = block_ints(hashes)
            self._carry[node.id] = (hashes[-1], data[whole:])
        else:
            ids = []
            self._carry[node.id] = (h, data)
        self._hashes[node.id] = (first_start + self.block_size, ids)
        return (None if first_start == 0 else block_int(h)), ids, data

    def _hashes_of(self, node: TreeNode) -> list[int]:
        """The ids of the blocks ending in `node` (kept from when they were computed;
        those ending above its start since a split are skipped)."""
        known = self._hashes.get(node.id)
        if known is None:
            return self._blocks(node)[1]
        first_end, hashes = known
        start = node.depth - node.num_tokens
        if first_end <= start:
            skip = (start - first_end) // self.block_size + 1
            hashes = hashes[skip:]
            self._hashes[node.id] = (first_end + skip * self.block_size, hashes)
        return hashes

    def _carry_of(self, node: TreeNode) -> tuple[bytes, bytes]:
        """The chain state at `node`'s end: (hash of the last whole block ending there or
        above, the tokens after that block), walking up to the nearest node that has it."""
        path = []
        while node.depth and node.id not in self._carry:
            path.append(node)
            node = node.parent
        if node.depth:
            h, rest = self._carry[node.id]
        else:
            h = self._seeds.get(node.namespace)
            if h is None:
                h = self._seeds[node.namespace] = namespace_seed(node.namespace)
            rest = b""
        step = self._step
        for x in reversed(path):
            data = rest + x.key if rest else x.key
            hashes = chain_blocks(h, data, self.block_size)
            if hashes:
                h = hashes[-1]
            rest = data[len(data) - len(data) % step:]
            self._carry[x.id] = (h, rest)
        return h, rest
