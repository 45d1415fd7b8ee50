"""LowerTiers: host memory (L2) and disk (L3) below the KV pool (L1), in the one radix tree.

Every TreeNode records the tier holding its pages (`node.tier`): 1 = the KV pool the model
reads (`pages` are pool page ids), 2 = host memory, 3 = disk (`pages` are that tier's slot
ids). Ids live in one space, `[0, pool)` for the pool, then `[pool, pool + host)` for host
slots, then disk slots, so the ids of two tiers never collide: an insert that compares its
pool pages with a host node's ids can never take them for its own, and conservation checks
see every id once. Orders carry tier-local ids (a pool page, a host slot, a disk slot;
tier_types.SlotId; the disk store names the file holding a slot by another number, its
page key: storage/tier_pages.py).

Shape of the tree: a node's parent is in the same tier or a higher one, so the pool's nodes
form a prefix-closed subtree (what a match serves from the pool is a prefix), and pool plus
host nodes form another.

How pages move (all bookkeeping here and in radix_cache.py; no torch, no I/O but the disk
reads of a load):
- Demote: the tree evicts a pool leaf (`RadixCache.evict_pages`); instead of dropping it,
  `demote` gives it slots in the first lower tier with room and queues a `DemoteOrder`.
  Making room in host memory pushes the host tier's own victims (policy order, unlocked,
  no child in host memory) down to disk; making room on disk drops disk leaves.
- Load: a match reports the lower nodes continuing its pool part (`MatchResult.lower`).
  `plan_load` reads their disk pages (checksums checked by the store: a page that fails is
  treated as missing, the node is cut there and the rest dropped) and locks them. With a
  `reader` the reads run on its thread: the first plan asks for them and raises
  ReadPending (the request waits; nothing changed), a later one takes the results. The
  caller allocates pool pages; `load` moves the nodes into the pool on them and queues
  `LoadOrder`s. An insert running over lower nodes (the tokens were recomputed) moves them
  into the pool on the caller's pages the same way (`RadixCache.enter_pool`).
- Orders are executed by whoever owns the KV data (the engine's runner, at the start of the
  next step, before copy-on-write and the forward pass) strictly in the order they were
  issued. That order is causal: an order that reuses a page or slot was issued after
  the order that read it (the pool page an eviction frees is read by its DemoteOrder before
  the step writes into it; a host slot freed by a load is read before a later demote
  writes it). The one read out of order is a load's disk read, done when the order is
  made: a node whose disk write is not durable yet (`pending_writes`) is not pushed out
  until its write is reported done, and is loaded from the writer's queue (`held_page`) once
  its order has run, not before.
- Disk writes: a DemoteOrder to disk only copies the page bytes out (compute thread) and
  queues them for a writer thread (storage/disk_writer.py). Its results reach the tree on
  the tree's own thread (`collect_io`, from `moves_done` and `plan_load`): a written
  slot stops being pending; a failed one drops its node like an ordinary eviction
  (`counters.failed_writes`). A pending slot whose node leaves the tree meanwhile (flushed,
  dropped, recomputed into the pool) is `orphaned`: neither free nor reused until its
  write is over, then its file is removed and the slot freed. Without a writer (`writer`
  None: writes run inside the order) `moves_done` ends every pending write.
- Inclusive disk tier: a disk node loaded into the pool keeps its files (`kept`, by slot,
  oldest first): a crash, or the next save, finds them on disk. Kept copies are the first to
  go when the disk tier needs room (the pool holds their pages), and go with a flush of
  their namespace. Each page written to the disk tier is first described to `places`
  (engine/disk_places.py), which the disk store's journal records once the write is done.
- Save and restore (engine/kv_persistence.py): the cache saver borrows disk slots for its
  on-disk copies of pool/host pages (`lend_disk_slots`, held outside the tree and counted
  by `check`), so saved copies and the disk tier share one budget; a restart rebuilds the
  saved index as disk nodes (`restore_disk_node`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .page_allocator import PageAllocator
from .tier_queue import TierQueue
from .tier_types import Move, Tier

if TYPE_CHECKING:
    from .radix_cache import RadixCache
    from .tree_node import TreeNode

__all__ = ["POOL", "HOST", "DISK", "DemoteOrder", "DiskPlaces", "LoadOrder", "LoadPlan",
           "IdFollower", "LowerTiers", "PageStore", "ReadPending", "ReadResults",
           "TierCounters", "TierFlow", "WriteResults"]

POOL, HOST, DISK = Tier.POOL, Tier.HOST, Tier.DISK      # short names for this module's users


@dataclass(frozen=True, slots=True)
class DemoteOrder:
    """Copy pages down: `src` slots of `src_tier` into `dst` slots of `dst_tier`.
    `windows` (to disk, with an IdFollower that keeps windows): per page, the windowed
    pool page to write beside it (-1: none), taken when the order is made; a page freed
    after that is rewritten only by a later order or step, so the order reads it intact."""

    src_tier: Tier
    src: np.ndarray
    dst_tier: Tier
    dst: np.ndarray
    windows: np.ndarray | None = None

    @property
    def move(self) -> Move:
        return Move(self.src_tier, self.dst_tier)


@dataclass(frozen=True, slots=True)
class LoadOrder:
    """Copy pages up into the KV pool: `src` ids of `src_tier` into pool pages `dst`.

    From disk the pages were read (and checked) when the order was made: `payloads` holds
    them, one bytes object per page."""

    src_tier: Tier
    src: np.ndarray
    dst: np.ndarray
    payloads: tuple[bytes, ...] = ()

    @property
    def move(self) -> Move:
        return Move(self.src_tier, Tier.POOL)


class PageStore(Protocol):
    """The disk tier's reads (the runner writes pages with the store's `write_page`)."""

    def read_page(self, slot: int) -> bytes | None:
        """The page, or None when it is missing or its checksum fails."""

    def drop_page(self, slot: int) -> None: ...


class WriteResults(Protocol):
    """The disk writer's reports (storage/disk_writer.py: DiskWriter), by disk slot."""

    def take_finished(self) -> tuple[list[int], list[int]]:
        """(written, failed) since the last call."""

    def held_page(self, slot: int) -> bytes | None:
        """A queued page's bytes until its result is taken (None: not queued yet)."""

    def drain(self) -> None:
        """Block until every page queued so far is written or has failed."""

    def close(self) -> None:
        """Drain, then stop."""


class ReadResults(Protocol):
    """The disk reader (storage/disk_reader.py: DiskReader), by disk slot."""

    def request(self, slots: list[int]) -> None: ...

    def asked(self, slot: int) -> bool: ...

    def ready(self, slot: int) -> bool: ...

    def take(self, slot: int) -> bytes | None: ...

    def take_finished(self) -> list[int]: ...

    def discard(self, slot: int) -> None: ...


class DiskPlaces(Protocol):
    """Told where each page about to be written to disk sits in the tree (its path), so
    that the disk tier's journal can record it (engine/disk_places.py)."""

    def placed(self, node: TreeNode, slots: list[int]) -> None: ...

    def missing(self, node: TreeNode) -> bool:
        """Whether some page of this (pool/host) node has no file on disk, written or
        queued (False for a node that cannot be journaled: nothing to do)."""

    def touched(self, slots: list[int], last_access: int) -> None:
        """These disk slots' pages moved into the pool (their files stay) at the tree's
        clock `last_access`: the journal records their recency."""

    def spare(self, kept: Sequence[int], n: int) -> list[int]:
        """Up to `n` kept copies (disk slots, oldest first) that can go without leaving
        another disk page without the prefix it needs after a crash."""


class IdFollower(Protocol):
    """Data kept by tree page id outside the tiers' slots, that follows a node when its
    ids change (a hybrid model's sliding-window pages: cache/window_memory.py). Tree ids
    (pool pages, then host and disk slots, as `node.pages`)."""

    def moved(self, src: np.ndarray, dst: np.ndarray) -> None:
        """A node's pages `src` are now `dst` (demoted, pushed down, loaded)."""

    def released(self, ids: np.ndarray) -> None:
        """Lower-tier ids given back (their node dropped, flushed or recomputed)."""

    def window_pages(self, ids: np.ndarray) -> np.ndarray:
        """Per tree id, its page in the follower's pool to write to disk beside it (-1:
        none)."""


class ReadPending(Exception):
    """The match continues on disk and its pages are being read off the tree's thread:
    admit the request later (nothing was changed or locked)."""


@dataclass
class TierFlow:
    """What moved through one tier, cumulative: tokens demoted into it, loaded from it into
    the pool, dropped from it (no room below), and the bytes written into it and read out
    of it. The pool's flow counts only its drops (evicted pages no lower tier took)."""

    demoted_tokens: int = 0
    loaded_tokens: int = 0
    dropped_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class TierCounters:
    """Per tier (`counters[Tier.HOST].loaded_tokens`), and the disk's corrupt pages and
    failed writes (their pages were dropped instead of demoted)."""

    flows: dict[Tier, TierFlow] = field(default_factory=lambda: {t: TierFlow() for t in Tier})
    corrupt_pages: int = 0
    failed_writes: int = 0

    def __getitem__(self, tier: Tier) -> TierFlow:
        return self.flows[tier]


@dataclass
class LoadPlan:
    """Lower nodes to bring into the pool, in path order, locked (via the last one) until
    `LowerTiers.load` or `cancel`; `payloads[i]` holds node i's disk pages (() for host)."""

    nodes: list[TreeNode]
    payloads: list[tuple[bytes, ...]]

    @property
    def num_pages(self) -> int:
        return sum(len(n.pages) for n in self.nodes)

    @property
    def num_tokens(self) -> int:
        return sum(n.num_tokens for n in self.nodes)


class LowerTiers:
    """The host and disk tiers of one RadixCache: its `TierHooks` (attaches itself with
    `tree.attach_tiers`), and the plans and orders that move pages between tiers."""

    def __init__(self, tree: RadixCache, pool_pages: int, host_pages: int = 0,
                 disk_pages: int = 0, disk: PageStore | None = None, page_bytes: int = 0):
        if disk_pages and disk is None:
            raise ValueError("a disk tier needs a page store")
        self.tree = tree
        self.page_bytes = page_bytes            # bytes of one page (for the byte counters)
        self.disk = disk
        self.offset = {HOST: pool_pages, DISK: pool_pages + host_pages}
        self.alloc = {HOST: PageAllocator(host_pages), DISK: PageAllocator(disk_pages)}
        self.nodes: dict[int, dict[int, TreeNode]] = {HOST: {}, DISK: {}}   # by node id
        # The same nodes in eviction order (policy key, then id), re-keyed as they change;
        # None: the policy's key is not stable (eviction.py), the tiers sort instead.
        self.queues = {HOST: TierQueue(tree.policy), DISK: TierQueue(tree.policy)} \
            if getattr(tree.policy, "key_is_stable", True) else None
        self.pending_writes: set[int] = set()   # disk ids whose write is not durable yet
        self.orphaned: set[int] = set()         # pending disk ids whose node left the tree
        self.writer: WriteResults | None = None     # None: writes run inside the orders
        self.reader: ReadResults | None = None      # None: plan_load reads the disk itself
        self.reading: set[int] = set()          # disk ids whose read is in flight
        # Disk slots lent to the cache saver for on-disk copies of pool/host pages (local
        # ids): the saved cache and the disk tier share one budget, the disk tier's slots.
        self.lent: set[int] = set()
        # Disk slots of pages loaded into the pool that keep their file (the inclusive disk
        # tier), oldest first, with their namespace (a flush of it drops them).
        self.kept: dict[int, str | None] = {}
        self.places: DiskPlaces | None = None
        self.follower: IdFollower | None = None     # follows nodes' ids (window pools)
        # Called with the disk slots whose write just became durable (the engine drops
        # older copies of the same pages then: engine/kv_persistence.py).
        self.on_written: Callable[[list[int]], None] | None = None
        self._keeping = False               # load(): a disk node's release keeps its files
        self.counters = TierCounters()
        self._moves: list[DemoteOrder | LoadOrder] = []
        self._below = [t for t in (HOST, DISK) if self.alloc[t].num_pages]
        tree.attach_tiers(self)

    # ------------------------------------------------------------------ state
    def capacity_pages(self, tier: Tier) -> int:
        return self.alloc[tier].num_pages

    def used_pages(self, tier: Tier) -> int:
        a = self.alloc[tier]
        return a.num_pages - a.num_free

    def tokens(self, tier: Tier) -> int:
        return sum(n.num_tokens for n in self.nodes[tier].values())

    def queue(self, order) -> None:
        """Queue an order of another pool's data (a hybrid model's window loads:
        cache/window_files.py) in issue order with the tiers' own."""
        self._moves.append(order)

    def take_moves(self) -> list[DemoteOrder | LoadOrder]:
        """The orders issued since the last call, in the order they must run."""
        moves, self._moves = self._moves, []
        return moves

    def moves_done(self) -> None:
        """Every order taken so far has run. Without a writer thread their disk writes are
        on disk now; with one, collect what it has finished."""
        if self.writer is None:
            off = self.offset[DISK]
            self.writes_finished(sorted(k - off for k in self.pending_writes), [])
        else:
            self.collect_io()

    def collect_io(self) -> None:
        """Apply the disk writer's and reader's results (on the thread that owns the
        tree)."""
        if self.reader is not None and self.reading:
            off = self.offset[DISK]
            self.reading.difference_update(k + off for k in self.reader.take_finished())
            self._settle_orphans()
        if self.writer is not None and self.pending_writes:
            self.writes_finished(*self.writer.take_finished())

    def writes_finished(self, written: Sequence[int], failed: Sequence[int]) -> None:
        """Disk slots now durable, and slots whose write failed: the nodes holding failed
        slots are dropped (with their branch, all disk nodes) as an ordinary eviction
        would; orphaned slots are freed (and their file removed)."""
        off = self.offset[DISK]
        for slot in written:
            self.pending_writes.discard(slot + off)
        if written and self.on_written is not None:
            self.on_written(list(written))
        bad = {slot + off for slot in failed}
        self.pending_writes.difference_update(bad)
        self._drop_kept([slot for slot in failed if slot in self.kept])
        self.counters.failed_writes += len(bad)
        bad -= self.orphaned
        self._settle_orphans()
        if bad:
            hit = [n for n in self.nodes[DISK].values()
                   if not bad.isdisjoint(n.pages.tolist())]
            for node in hit:
                if node.id in self.nodes[DISK]:     # not dropped with an earlier one
                    self._drop_branch(node)

    def local(self, tier: Tier, ids: np.ndarray) -> np.ndarray:
        """Tree ids of `tier` as that tier's own slot ids."""
        return (ids - self.offset[tier]).astype(np.int32) if tier != POOL else ids

    # ------------------------------------------------------------------ demotion
    def evict_leaf(self, leaf: TreeNode, need_pages: int) -> np.ndarray:
        """TierHooks: the tree evicts `leaf`; the part it needs (a tail split off when the
        leaf is larger) is demoted to the first lower tier with room, or dropped."""
        tree = self.tree
        tree.withdraw(leaf)
        npages = len(leaf.pages)
        if npages > need_pages:
            tree.split_at(leaf, (npages - need_pages) * tree.page_size)   # the tail alone
        pages = leaf.pages
        if not self.demote(leaf):
            tree.remove_leaf(leaf)
        return pages

    def demote(self, leaf: TreeNode) -> bool:
        """Move an evicted, unlocked pool leaf down (False: no tier had room; drop it)."""
        n = len(leaf.pages)
        highest_child = min((c.tier for c in leaf.children.values()), default=DISK)
        dst = None
        for tier in self._below:
            dst = self._take(tier, n) if tier <= highest_child else None
            if dst is not None:
                break
        else:
            self.counters[POOL].dropped_tokens += leaf.num_tokens
            for child in list(leaf.children.values()):
                self._drop_branch(child, force=True)
        # Making room may have dropped a child of the leaf, which put the leaf (being
        # evicted, so out of the evictable set) back in: take it out again.
        if leaf.evict_key is not None:
            self.tree.withdraw(leaf)
        if dst is None:
            return False
        src = leaf.pages
        self._place(leaf, tier, dst)
        self._follow(src, dst)
        self.tree.leave_pool(leaf)
        if tier == DISK:
            self._copy_ancestors(leaf)      # queued first: written before the leaf's pages
        self._moves.append(DemoteOrder(POOL, src, tier, self.local(tier, dst),
                                       self._windows(dst) if tier == DISK else None))
        self._count_in(tier, leaf.num_tokens)
        return True

    def _copy_ancestors(self, node: TreeNode) -> None:
        """A disk page can only be restored after a crash if every page before it is on
        disk too: the pool/host ancestors of a node just sent to disk that have no disk
        copy yet get one (kept copies: they stay where they are). Called before the node's
        own order is queued, so the writer (in order) writes a prefix before what
        continues it, and a crash between the two never leaves a page without its prefix."""
        if self.places is None:
            return
        todo = []
        parent = node.parent
        while parent is not None and parent.depth and parent.tier != DISK:
            if self.places.missing(parent):
                todo.append(parent)
            parent = parent.parent
        for anc in reversed(todo):              # from the root down
            n = len(anc.pages)
            if anc.parent is None or n == 0:
                break
            dst = self._take(DISK, n)
            if dst is None or anc.parent is None:   # no room (or dropped making it)
                if dst is not None:
                    self.alloc[DISK].free(self.local(DISK, dst))
                break
            local = self.local(DISK, dst)
            self.pending_writes.update(dst.tolist())
            self.kept.update(dict.fromkeys(local.tolist(), anc.namespace))
            self.places.placed(anc, local.tolist())
            self._moves.append(DemoteOrder(anc.tier, self.local(anc.tier, anc.pages), DISK,
                                           local, self._windows(anc.pages)))

    def _take(self, tier: Tier, n: int) -> np.ndarray | None:
        """`n` free ids of `tier` (making room by pushing its victims down), or None."""
        a = self.alloc[tier]
        if a.num_pages < n or (a.num_free < n and not self._make_room(tier, n)):
            return None
        ids = a.alloc(n) + np.int32(self.offset[tier])
        ids.flags.writeable = False
        return ids

    def _make_room(self, tier: Tier, n: int) -> bool:
        """Free `n` ids of `tier`: its victims in policy order go down a tier (or are
        dropped from the last one)."""
        a = self.alloc[tier]
        if tier == DISK:
            self.collect_io()       # written pages may go; orphaned slots come back
        while a.num_free < n:
            if tier == DISK and self._drop_spare_kept(n - a.num_free):
                continue            # redundant copies go first
            progress = False
            victims = self._victims(tier)
            try:
                for victim in victims:
                    if victim.tier == tier and self._push_down(victim):
                        progress = True
                        if a.num_free >= n:
                            return True
            finally:
                victims.close()         # the nodes it read and that stay are queued again
            if not progress:
                return False
        return True

    def _drop_spare_kept(self, n: int) -> bool:
        """Drop up to `n` kept copies, oldest first (a copy another disk page needs as its
        prefix only after that page: `places.spare`); False when none could go."""
        if not self.kept:
            return False
        spare = (self.places.spare(list(self.kept), n) if self.places is not None
                 else list(self.kept)[:n])
        self._drop_kept(spare)
        return bool(spare)

    def _victims(self, tier: Tier) -> Iterator[TreeNode]:
        """Nodes of `tier` that may leave it, first to go first: unlocked, not waiting for
        their disk write, and with no child in this tier (the pool and host parts of the
        tree stay prefix-closed). Read from the tier's queue for one pass of making room:
        a node whose last child in the tier leaves during the pass waits for the next
        one, as when each pass sorted the tier's nodes that could go at its start (which
        it still does for a policy whose key is not stable: `queues` None)."""
        if self.queues is None:
            policy = self.tree.policy
            ready = [n for n in self.nodes[tier].values()
                     if n.lock_ref == 0 and not self._pending(n)
                     and all(c.tier > tier for c in n.children.values())]
            ready.sort(key=lambda n: (policy.key(n), n.id))
            yield from ready
            return
        opened: set[int] = set()        # parents of this pass's victims
        for node in self.queues[tier].in_order(lambda n: n.id in self.nodes[tier]):
            if node.id in opened or node.lock_ref or self._pending(node) or \
                    any(c.tier <= tier for c in node.children.values()):
                continue
            if node.parent is not None and node.parent.tier == tier:
                opened.add(node.parent.id)
            yield node

    def _push_down(self, node: TreeNode) -> bool:
        tier = node.tier
        dst = None
        if tier == HOST and self.alloc[DISK].num_pages:
            dst = self._take(DISK, len(node.pages))
        if dst is None:
            if node.children:
                return False            # its children would lose their parent
            self._drop(node)
            return True
        src = node.pages
        self._unlist(node)
        self._follow(src, dst)
        self._release_ids(tier, src)
        self._place(node, DISK, dst)
        self.tree.tier_changed(node, tier)
        self._copy_ancestors(node)          # queued first: written before its pages
        self._moves.append(DemoteOrder(tier, self.local(tier, src), DISK,
                                       self.local(DISK, dst), self._windows(dst)))
        self._count_out(tier, node.num_tokens)
        self._count_in(DISK, node.num_tokens)
        return True

    def _drop(self, node: TreeNode) -> None:
        """Remove a childless lower node from the tree; its ids are freed."""
        self.counters[node.tier].dropped_tokens += node.num_tokens
        self._free_node(node)
        self.tree.drop_lower(node)

    def _place(self, node: TreeNode, tier: Tier, ids: np.ndarray) -> None:
        node.pages = ids
        node.tier = tier
        self._list(node)
        if tier == DISK:
            self.pending_writes.update(ids.tolist())
            if self.places is not None:
                self.places.placed(node, self.local(DISK, ids).tolist())

    def _pending(self, node: TreeNode) -> bool:
        return node.tier == DISK and bool(self.pending_writes) and \
            not self.pending_writes.isdisjoint(node.pages.tolist())

    # ------------------------------------------------------------------ loading
    def plan_load(self, lower: Sequence[TreeNode], max_tier: Tier = DISK) -> LoadPlan | None:
        """The leading nodes of a match's lower part that can come into the pool now (tiers
        up to `max_tier`), locked; None when there are none.

        Disk pages are read here: the first one that is missing or fails its checksum ends
        the plan, and the tree is cut before it and the rest of that branch dropped (when
        nobody holds a lock in it), so the prefix from that page on is recomputed.
        """
        self.collect_io()
        if self.reader is not None and self._ask_reads(lower, max_tier):
            raise ReadPending
        nodes: list[TreeNode] = []
        payloads: list[tuple[bytes, ...]] = []
        for node in lower:
            if node.tier > max_tier or node.parent is None:
                break
            if node.tier == DISK:
                if not self._submitted(node):
                    break           # its order has not handed the bytes to the writer
                got = self._read(node)
                if len(got) < len(node.pages):
                    if got:
                        upper = self.tree.split_at(node, len(got) * self.tree.page_size)
                        nodes.append(upper)
                        payloads.append(got)
                    self._drop_branch(node)
                    break
                payloads.append(got)
            else:
                payloads.append(())
            nodes.append(node)
        if not nodes:
            return None
        self.tree.lock(nodes[-1])
        return LoadPlan(nodes, payloads)

    def _submitted(self, node: TreeNode) -> bool:
        """Every page of a disk node whose write is pending is in the writer's hands (an
        order not run yet has not handed them over)."""
        if not self._pending(node):
            return True
        return self.writer is not None and all(
            self.writer.held_page(slot) is not None
            for slot, queued in self._slots(node) if queued)

    def _slots(self, node: TreeNode) -> list[tuple[int, bool]]:
        """A disk node's slots, each with whether its write is still pending (a node's
        pages are written one by one, so a node may have both)."""
        pending = self.pending_writes
        return [(slot, tree_id in pending) for tree_id, slot
                in zip(node.pages.tolist(), self.local(DISK, node.pages).tolist())]

    def _ask_reads(self, lower: Sequence[TreeNode], max_tier: Tier) -> bool:
        """Ask the reader for the disk pages the plan would read and are not read yet;
        True when the plan must wait for some."""
        wait = False
        for node in lower:
            if node.tier > max_tier or node.parent is None:
                break
            if node.tier != DISK:
                continue
            if not self._submitted(node):
                break
            slots = [slot for slot, queued in self._slots(node)
                     if not queued and not self.reader.ready(slot)]
            if slots:
                wait = True
                new = [s for s in slots if not self.reader.asked(s)]
                self.reader.request(new)
                self.reading.update(s + self.offset[DISK] for s in new)
        return wait

    def _read(self, node: TreeNode) -> tuple[bytes, ...]:
        """The node's pages, up to the first missing or corrupt one. A page whose write is
        pending comes from the writer's queue; one written comes from the reader's results
        (read off this thread) or, without a reader, from the disk here."""
        got = []
        for slot, queued in self._slots(node):
            if queued:
                data = self.writer.held_page(slot)
            elif self.reader is not None:
                data = self.reader.take(slot)
            else:
                data = self.disk.read_page(slot)
            if data is None:
                self.counters.corrupt_pages += 1
                break
            got.append(data)
        return tuple(got)

    def _drop_branch(self, node: TreeNode, force: bool = False) -> None:
        """Drop a lower node and everything below it (all in lower tiers), unless locked
        (`force`: the caller knows it is not)."""
        if node.lock_ref and not force:
            return
        stack, order = [node], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):           # children first: each is childless when dropped
            self._drop(n)

    def cancel(self, plan: LoadPlan) -> None:
        """Give up a plan (no pool pages for it): unlock its nodes."""
        self.tree.unlock(plan.nodes[-1])

    def load(self, plan: LoadPlan, pages: np.ndarray) -> TreeNode:
        """Move the plan's nodes into the pool on `pages` (pool ids, `plan.num_pages` of
        them, in path order) and queue their LoadOrders. Returns the last node, still
        locked once by the plan: the caller takes that lock over."""
        i = 0
        for node, data in zip(plan.nodes, plan.payloads):
            n = len(node.pages)
            dst = pages[i:i + n]
            i += n
            tier = node.tier
            self._moves.append(LoadOrder(tier, self.local(tier, node.pages), dst, data))
            self.counters[tier].loaded_tokens += node.num_tokens
            self._count_out(tier, node.num_tokens)
            self._keeping = tier == DISK
            self._follow(node.pages, dst)
            try:
                self.tree.enter_pool(node, dst)
            finally:
                self._keeping = False
        return plan.nodes[-1]

    # ------------------------------------------------------------------ saved copies
    def lend_disk_slots(self, n: int) -> np.ndarray:
        """Up to `n` disk slots (local ids) for the saver's copies of pool/host pages,
        making room by dropping disk victims in policy order; fewer when no more room."""
        got: list[np.ndarray] = []
        want = n
        while want:
            ids = self._take(DISK, want)
            if ids is None:
                if want == 1:
                    break
                want = (want + 1) // 2
                continue
            got.append(self.local(DISK, ids))
            n -= want
            want = min(want, n)
        local = np.concatenate(got) if got else np.zeros(0, dtype=np.int32)
        self.lent.update(local.tolist())
        return local

    def take_kept(self, local: Sequence[int]) -> None:
        """Kept copies the saver takes over as its own (lent) copies."""
        for slot in local:
            del self.kept[slot]
        self.lent.update(local)

    def drop_kept(self, local: Sequence[int]) -> None:
        """Kept copies to remove (their page has another file now)."""
        self._drop_kept(local)

    def _drop_kept(self, local: Sequence[int]) -> None:
        for slot in local:
            del self.kept[slot]
        if local:
            self._release_ids(DISK, np.asarray(local, dtype=np.int64) + self.offset[DISK])

    def return_disk_slots(self, local: Sequence[int]) -> None:
        """Saved copies dropped: their slots are free again (their files are dropped by
        the caller)."""
        self.lent.difference_update(local)
        self.alloc[DISK].free(np.asarray(local, dtype=np.int32))

    # ------------------------------------------------------------------ restore
    def restore_disk_node(self, parent: TreeNode | None, tokens: Sequence[int],
                          namespace: str | None, last_access: int) -> TreeNode | None:
        """A disk node rebuilt from the saved index, under `parent` (a restored node, or
        None: the namespace's root), on free disk slots (no room is made: a smaller disk
        budget than the one that saved keeps what fits). None when there is no room or the
        tokens are in the tree already. The caller maps the slots
        (`local(DISK, node.pages)`) to the saved pages; their checksums are checked when
        they are loaded."""
        n = len(tokens) // self.tree.page_size
        a = self.alloc[DISK]
        if n == 0 or a.num_free < n:
            return None
        ids = a.alloc(n) + np.int32(self.offset[DISK])
        node = self.tree.add_lower(parent, tokens, ids, DISK, namespace, last_access)
        if node is None:
            a.free(self.local(DISK, ids))
        return node

    # ------------------------------------------------------------------ release
    def release(self, node: TreeNode) -> None:
        """TierHooks: a lower node moves into the pool (loaded, or recomputed by an
        insert). A disk node's files stay as kept copies when it was loaded, and always
        with a journaled disk tier (`places`): its disk descendants need them as their
        prefix to be restored after a crash. A kept copy is no node's, so the follower's
        data goes (a load moved it to the pool ids first; a recompute brings its own)."""
        if node.tier == DISK and (self._keeping or self.places is not None):
            self._unlist(node)
            if self.follower is not None:
                self.follower.released(node.pages)
            slots = self.local(DISK, node.pages).tolist()
            self.kept.update(dict.fromkeys(slots, node.namespace))
            if self.places is not None:
                self.places.touched(slots, node.last_access)
            return
        self._free_node(node)

    def _free_node(self, node: TreeNode) -> None:
        """A lower node leaves its tier (dropped or flushed): free its ids."""
        self._unlist(node)
        self._release_ids(node.tier, node.pages)

    def _follow(self, src: np.ndarray, dst: np.ndarray) -> None:
        if self.follower is not None:
            self.follower.moved(src, dst)

    def _windows(self, ids: np.ndarray) -> np.ndarray | None:
        """The follower's pages to write beside these tree ids' disk pages (None: none)."""
        return self.follower.window_pages(ids) if self.follower is not None else None

    def _release_ids(self, tier: Tier, ids: np.ndarray) -> None:
        if self.follower is not None:
            self.follower.released(ids)
        if tier == DISK and (self.pending_writes or self.reading):
            # A write or read still in flight: the slot waits for it (_settle_orphans).
            waiting = [i for i in ids.tolist() if self._busy(i)]
            if waiting:
                self.orphaned.update(waiting)
                ids = np.asarray([i for i in ids.tolist() if not self._busy(i)],
                                 dtype=np.int64)
        local = self.local(tier, ids)
        if tier == DISK:
            for slot in local.tolist():
                if self.reader is not None:
                    self.reader.discard(slot)
                self.disk.drop_page(slot)
        self.alloc[tier].free(local)

    def _busy(self, tree_id: int) -> bool:
        return tree_id in self.pending_writes or tree_id in self.reading

    def _settle_orphans(self) -> None:
        """Orphaned slots whose write and read are over: file removed, slot free."""
        done = [i for i in self.orphaned if not self._busy(i)]
        if done:
            self.orphaned.difference_update(done)
            self._release_ids(DISK, np.asarray(done, dtype=np.int64))

    def forget(self, nodes: Sequence[TreeNode]) -> None:
        """Flushed nodes: the lower ones give their ids back, and the kept copies of their
        namespaces go too."""
        flushed = {n.namespace for n in nodes}
        live = set(self.tree.namespaces())       # a copy whose namespace has no node left
        self._drop_kept([s for s, ns in self.kept.items() if ns in flushed or ns not in live])
        for node in nodes:
            if node.tier != POOL:
                self._free_node(node)

    def added(self, node: TreeNode) -> None:
        """A split made a new lower node (the upper part of an edge)."""
        self._list(node)

    def rekey(self, node: TreeNode) -> None:
        """TierHooks: what a lower node's policy key reads changed (touched, split)."""
        if self.queues is not None:
            self.queues[node.tier].rekey(node)

    def _list(self, node: TreeNode) -> None:
        self.nodes[node.tier][node.id] = node
        if self.queues is not None:
            self.queues[node.tier].add(node)

    def _unlist(self, node: TreeNode) -> None:
        del self.nodes[node.tier][node.id]
        if self.queues is not None:
            self.queues[node.tier].discard(node)

    def _count_in(self, tier: Tier, tokens: int) -> None:
        flow = self.counters[tier]
        flow.demoted_tokens += tokens
        flow.bytes_in += tokens // self.tree.page_size * self.page_bytes

    def _count_out(self, tier: Tier, tokens: int) -> None:
        self.counters[tier].bytes_out += tokens // self.tree.page_size * self.page_bytes

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Each tier's ids are free or held by exactly one of its nodes; the registry is
        the tree's lower nodes. AssertionError naming the problem."""
        found: dict[int, dict[int, TreeNode]] = {HOST: {}, DISK: {}}
        for node in self.tree.iter_nodes():
            if node.tier != POOL:
                found[node.tier][node.id] = node
        for tier in (HOST, DISK):
            name = tier.label
            assert found[tier].keys() == self.nodes[tier].keys(), \
                f"{name}: registry {sorted(self.nodes[tier])} != tree {sorted(found[tier])}"
            if self.queues is not None:
                policy = self.tree.policy
                queued = self.queues[tier].entries()
                assert queued == {i: policy.key(n) for i, n in found[tier].items()}, \
                    f"{name}: the eviction queue is not the tier's nodes under their keys now"
            a = self.alloc[tier]
            held = [self.local(tier, n.pages) for n in found[tier].values()]
            if tier == DISK:
                held.append(np.fromiter(self.lent, dtype=np.int64, count=len(self.lent)))
                held.append(np.fromiter(self.kept, dtype=np.int64, count=len(self.kept)))
                held.append(self.local(DISK, np.fromiter(self.orphaned, dtype=np.int64,
                                                         count=len(self.orphaned))))
            ids = np.concatenate([a.free_page_ids(), *held]).astype(np.int64)
            # Each slot exactly once: a count per slot (np.unique's hashing took seconds on
            # a disk tier of millions of slots).
            in_range = len(ids) == 0 or (ids.min() >= 0 and ids.max() < a.num_pages)
            once = in_range and bool((np.bincount(ids, minlength=a.num_pages) == 1).all())
            assert len(ids) == a.num_pages and once, \
                f"{name}: free {a.num_free} + held {len(ids) - a.num_free} ids are not " \
                f"each of its {a.num_pages} slots once"
