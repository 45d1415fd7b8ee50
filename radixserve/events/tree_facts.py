"""TreeFacts and FactReplay: the tree's changes recorded in O(1) on the scheduler's thread,
turned into KV events later, by the publisher (its thread or its process).

Computing events (hashing each block, listing its token ids, building the structs) costs
far more than the tree change behind it, and whatever runs on the scheduler's thread lengthens
the step. So the tree's observer here (`TreeFacts`) only appends one small tuple per change
(per run of evictions: most of a step's changes), of ints, strings and, for a new node, its
packed key (bytes: the node's own, or one slice of the caller's ids), so a step's facts are
also what the engine sends a publisher process, encoded by one msgpack call
(fact_messages.py). `FactReplay`, in the publisher (its thread
or its process), applies the same changes in the same order to a shadow of the tree's
shape (a ShadowNode per node, no pages) and feeds BlockEvents from it, so the events are
exactly those BlockEvents computes on the tree itself. The shadow needs the tree's splits
(`TreeObserver.split`), which change no token.

`snapshot` lists the whole tree as facts after a clear: what a publisher that had to drop
facts (a stuck thread, publisher.py) sends so that consumers start over from a true index.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from radixserve.cache.tier_types import Tier
from radixserve.cache.token_keys import ITEM_BYTES, TYPECODE, pack_range

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import RadixCache
    from radixserve.cache.tree_node import TreeNode
    from radixserve.events.block_events import BlockEvents

__all__ = ["FactReplay", "ShadowNode", "TreeFacts", "snapshot"]

# The first item of each fact tuple.
STORED, SPLIT, TRIMMED, REMOVED, MOVED, CLEARED, MARK = range(7)


class TreeFacts:
    """A TreeObserver that appends each change as a tuple to `facts` (see FactReplay).

    Evictions are coalesced. A tree removes LRU leaves and trims the last one it takes, once
    per eviction call (the engine's scheduler evicts once a step for its decodes,
    PagedMemory.evict_ahead; other allocations evict as they come, one call each), ~30
    changes a step at 256 running. So `removed` and `trimmed` are C calls with no Python
    frame: a list append (the node), and a dict store (the node -> the tokens it keeps, the
    last trim of a node winning; `operator.setitem` bound by a partial, ~30% quicker than
    the dict's `__setitem__`, a slot wrapper that builds an argument tuple). The run since
    the last other fact becomes one REMOVED fact (the ids) and one TRIMMED fact (the ids,
    the tokens each keeps), appended before the next fact or at `take`. Nothing else
    happens in a run, so applying its removals and then its trims, each at its final
    length, changes the shadow as the single calls did: a node only loses its children
    to removals, and a trimmed leaf that a later call removed is only removed (FactReplay
    skips its trim). BlockEvents joins a run's removals into one BlockRemoved either way."""

    def __init__(self):
        self.facts: list[tuple] = []
        self.marks = 0
        self._removed: list[TreeNode] = []
        self._trims: dict[TreeNode, int] = {}
        # TreeObserver.removed(node) and .trimmed(node, keep_tokens): no Python frame.
        self.removed: Callable[[TreeNode], None] = self._removed.append
        self.trimmed: Callable[[TreeNode, int], None] = partial(operator.setitem,
                                                                self._trims)

    def _end_evictions(self) -> None:
        """Append the run of removals and trims gathered so far: (REMOVED, node ids) and
        (TRIMMED, node ids, tokens each keeps)."""
        removed, trims = self._removed, self._trims
        if removed:
            self.facts.append((REMOVED, [node.id for node in removed]))
            removed.clear()
        if trims:
            self.facts.append((TRIMMED, [node.id for node in trims], list(trims.values())))
            trims.clear()

    def _append(self, fact: tuple) -> None:
        """Any fact but an eviction: the run of evictions before it goes first."""
        self._end_evictions()
        self.facts.append(fact)

    # stored and split run tens of times a step: _append written out in each.
    def stored(self, node: TreeNode) -> None:
        """(STORED, id, parent id or None, packed key, depth, namespace, tier)."""
        if self._removed or self._trims:
            self._end_evictions()
        parent = node.parent
        self.facts.append((STORED, node.id, parent.id if parent.depth else None,
                           _packed(*node.key_parts()), node.depth, node.namespace,
                           node.tier))

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        if self._removed or self._trims:
            self._end_evictions()
        self.facts.append((SPLIT, upper.id, lower.id, upper.num_tokens))

    def moved(self, node: TreeNode, src: Tier) -> None:
        self._append((MOVED, node.id, src, node.tier))

    def cleared(self) -> None:
        self._append((CLEARED,))

    def mark(self) -> int:
        """A place in the stream (BlockEvents.mark, taken when the facts are replayed):
        returns its number; FactReplay.positions[number] is its event index in its batch."""
        self._append((MARK,))
        self.marks += 1
        return self.marks - 1

    def take(self) -> list[tuple]:
        """The facts since the last call."""
        self._end_evictions()
        facts, self.facts = self.facts, []
        return facts


def _packed(key: bytes | None, pending: tuple | None) -> bytes:
    """A stored node's key as bytes, as the node holds it or by one slice of the caller's
    ids (on the engine's thread: a view kept for later would stop the engine's array('q')
    from growing)."""
    if key is not None:
        return key
    ids, start, stop = pending
    if type(ids) is array and ids.typecode == TYPECODE:    # the engine's: packed already
        return ids[start:stop].tobytes()
    if type(ids) is list or type(ids) is array:
        return pack_range(ids[start:stop], 0, stop - start)
    return pack_range(ids, start, stop)     # numpy or bytes: never resized in place


class ShadowNode:
    """A node of FactReplay's shadow tree: what BlockEvents reads of a TreeNode (same
    names), no pages, its key always packed. A slotted class with plain attributes: the
    publisher's thread makes one per stored node and holds the GIL while it does."""

    __slots__ = ("id", "key", "parent", "depth", "namespace", "tier", "num_tokens")

    def __init__(self, nid: int, key: bytes, parent: ShadowNode | None, depth: int,
                 namespace: str | None, tier: Tier = Tier.POOL):
        self.id = nid
        self.key = key
        self.parent = parent
        self.depth = depth
        self.namespace = namespace
        self.tier = tier
        self.num_tokens = len(key) // ITEM_BYTES

    def cut(self, num_tokens: int) -> bytes:
        """Drop the first `num_tokens` tokens; return them (TreeNode.cut)."""
        key, cut = self.key, num_tokens * ITEM_BYTES
        self.key = key[cut:]
        self.num_tokens -= num_tokens
        return key[:cut]

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (TreeNode.truncate); the depth follows."""
        self.depth -= self.num_tokens - num_tokens
        self.key = self.key[:num_tokens * ITEM_BYTES]
        self.num_tokens = num_tokens


def snapshot(tree: RadixCache) -> list[tuple]:
    """A clear, then every node of `tree` as stored, parents first."""
    facts = TreeFacts()
    facts.cleared()
    for node in tree.iter_nodes():
        facts.stored(node)
    return facts.take()


class FactReplay:
    """Applies TreeFacts' facts to a shadow tree and BlockEvents; `batch(facts)` returns
    the KVEventBatch they make (None: no event). After a batch fails, later ones are
    skipped up to the next clear: the producer sends a snapshot (stream.py)."""

    def __init__(self, blocks: BlockEvents):
        self.blocks = blocks
        self.nodes: dict[int, ShadowNode] = {}
        self.positions: list[int] = []      # each MARK's event index in its batch
        self.broken = False     # a batch failed: the shadow is wrong until the next clear

    def batch(self, facts: list[tuple]):
        if self.broken:         # skip to the next clear (the producer's snapshot)
            clears = [i for i, fact in enumerate(facts) if fact[0] == CLEARED]
            if not clears:
                return None
            facts = facts[clears[-1]:]
            self.blocks.take_batch()        # the failed batch's events: never sent
            self.broken = False
        try:
            self.apply(facts)
        except Exception:
            self.broken = True
            raise
        return self.blocks.take_batch()

    def apply(self, facts: list[tuple]) -> None:
        nodes, blocks = self.nodes, self.blocks
        for fact in facts:
            kind = fact[0]
            if kind == STORED:
                _, nid, pid, key, depth, namespace, tier = fact
                parent = nodes[pid] if pid is not None else \
                    ShadowNode(0, b"", None, 0, namespace)
                node = nodes[nid] = ShadowNode(nid, key, parent, depth, namespace, tier)
                blocks.stored(node)
            elif kind == REMOVED:
                for nid in fact[1]:
                    blocks.removed(nodes.pop(nid))
            elif kind == TRIMMED:
                for nid, keep in zip(fact[1], fact[2]):
                    node = nodes.get(nid)
                    if node is not None:    # else removed later in its run (TreeFacts)
                        blocks.trimmed(node, keep)
                        node.truncate(keep)
            elif kind == SPLIT:
                _, uid, lid, m = fact
                lower = nodes[lid]
                start = lower.depth - lower.num_tokens
                nodes[uid] = lower.parent = ShadowNode(
                    uid, lower.cut(m), lower.parent, start + m, lower.namespace, lower.tier)
            elif kind == MOVED:
                _, nid, src, dst = fact
                node = nodes[nid]
                node.tier = dst
                blocks.moved(node, src)
            elif kind == CLEARED:
                nodes.clear()
                blocks.cleared()
            else:
                self.positions.append(blocks.mark())
