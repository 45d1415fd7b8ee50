"""KVPersistence: the prefix cache saved to a DiskPageStore and restored from it at start.

The store is the one of --kv-disk-dir, shared with the disk tier (L3, storage/tier_pages.py
maps its slots to the store's page files) under one --kv-disk-bytes budget.

Save (SIGTERM, `POST /cache/save`): every page the tree holds in the KV pool (L1) or in
host memory (L2) that has no copy on disk yet is copied out and written, in batches of
~32 MiB (their files SAVE_WRITERS at once), into disk-tier slots lent for it
(LowerTiers.lend_disk_slots: room is made by dropping disk-tier victims, so copies and the
disk tier share the budget); the nodes stay in their tier. Each batch is chosen and copied
while the step loop waits at `step_lock` (tier orders still pending are run first), so no
page is evicted and overwritten between the walk that chose it and its copy; steps run
between batches and while the files are written. Pages the disk tier holds are already on
disk. Then the saved copies the tree no longer holds are dropped, and the index of every
node whose pages are all on disk (L1/L2 nodes by their saved copies, L3 nodes by their own
files; of a node cut short, its leading pages on disk) is written last. Restore (start,
before serving): the index's nodes, parents first, become L3 nodes on its files (nothing
is read and no pool page taken; a hit loads them through the tier's load path, which
checks each page's CRC, so a corrupt page is recomputed).
A budget under one page file means no disk tier: nothing is saved or restored.

A saved copy is known by the hash of its page's whole token path (namespace, then every
token from the root to the page's end): the same prefix saved twice is written once, and
a page of the tree maps to its copy however the tree's edges were split since.

A hybrid model's sliding-window KV (the windowed pool) is written beside each page the
save copies (`write_pages`, as the disk tier writes its own) and restored by `windows`
(engine/window_persistence.py), so a restored path hits as far as its windows reach.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import numpy as np

from radixserve.attention.kv_tiers import TierMover
from radixserve.cache.path_hash import walk_path_hashes
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tier_types import Tier
from radixserve.cache.tiers import DISK, LowerTiers
from radixserve.cache.tree_node import TreeNode
from radixserve.engine.cache_stats import DiskStats
from radixserve.engine.config import DEFAULT_KV_DISK_BYTES, EngineConfig
from radixserve.engine.errors import DiskUnwritable
from radixserve.engine.tier_runtime import TierRuntime
from radixserve.engine.window_persistence import RestoredWindow, SavedWindows
from radixserve.cache.token_keys import ITEM_BYTES, unpack
from radixserve.storage import DiskPageStore, DiskStoreFull, IndexNode, TierPages
from radixserve.storage.journal import PagePlace

if TYPE_CHECKING:
    from radixserve.engine.runner import ModelRunner

log = logging.getLogger(__name__)

BATCH_BYTES = 32 << 20          # page bytes copied out of the pool per step-loop pause
SAVE_WRITERS = 8                # page files a save writes at once (see write_pages)
Compute = Callable[..., Awaitable[Any]]      # runs fn(*args) on the compute thread


@dataclass
class SaveReport:
    pages_written: int = 0      # new page files
    pages_kept: int = 0         # already on disk from an earlier save or the restore
    pages_dropped: int = 0      # on disk, no longer in the tree
    nodes: int = 0              # in the index written
    complete: bool = True       # False: the deadline or the disk budget cut it short
    seconds: float = 0.0
    windows_written: int = 0    # sliding-window pages saved beside them (hybrid models)

    def as_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class RestoreReport:
    nodes: int = 0              # rebuilt in the tree as disk-tier nodes
    tokens: int = 0
    pages: int = 0
    skipped_nodes: int = 0      # lost parent, or no disk-tier slots left
    seconds: float = 0.0
    windows: int = 0            # sliding-window pages read back (hybrid models)


@dataclass
class _Node:                    # a tree node as one save pass saw it
    tier: Tier                  # where `pages` (tree ids) are
    node_id: int
    parent_id: int | None
    namespace: str | None
    key: bytes
    pages: np.ndarray
    hashes: list[bytes]         # each page's path hash
    last_access: int
    parent_hash: bytes | None   # the hash of the block before its first (None: first)
    aligned: bool               # starts on a page boundary


class KVPersistence:
    """Saves and restores through the engine's tiers (`tiers`: None or without a disk tier,
    nothing is saved or restored) and the owner of the KV data (`kv`: the runner's
    TierMover, which holds the pool and the host slots; None without tiers). `windows`:
    a hybrid model's windowed pool, saved beside the pages (None: no windowed pool)."""

    def __init__(self, store: DiskPageStore, tree: RadixCache, tiers: TierRuntime | None,
                 kv: TierMover | None, compute: Compute, step_lock: asyncio.Lock,
                 windows: SavedWindows | None = None):
        self.store = store
        self.windows = windows
        self.tree = tree
        self.tiers = tiers
        self.kv = kv
        self._compute = compute
        self._step_lock = step_lock
        self._copies: dict[bytes, int] = {}     # page path hash -> disk slot of its copy
        # (max: a model whose every layer is windowed keeps no KV in the full pages)
        self._batch_pages = max(1, BATCH_BYTES // max(1, kv.page_bytes)) if kv is not None else 1
        self._saving = asyncio.Lock()
        if tiers is not None:
            tiers.lower.on_written = self._drop_older_copies
        self.restored: RestoreReport | None = None
        self.last_save: SaveReport | None = None
        self.saves = 0

    def stats(self) -> DiskStats:
        """For /cache/stats and /metrics."""
        journal = self.store.journal
        return DiskStats(dir=str(self.store.directory), used_bytes=self.store.used_bytes(),
                         capacity_bytes=self.store.capacity_bytes,
                         pages=len(self.store.page_keys()),
                         corrupt_pages=self.store.corrupt_pages,
                         stale_pages=self.store.stale_pages,
                         **self.store.faults.as_dict(),  # absorbed faults (storage/disk_faults.py)
                         restored_tokens=self.restored.tokens if self.restored else 0,
                         saves=self.saves,
                         last_save=self.last_save.as_dict() if self.last_save else None,
                         recovery=self._recovery(),
                         journal_records=journal.records if journal else 0,
                         journal_bytes=journal.bytes if journal else 0,
                         compactions=self.store.compactions)

    def _recovery(self) -> dict | None:
        """What the start found on disk and how long bringing it back took: the store's
        replay of index + journal, then the restore into the tree."""
        if self.restored is None:
            return None
        found = self.store.recovery
        return {**vars(found), "restored_pages": self.restored.pages,
                "restored_windows": self.restored.windows,
                "seconds": found.seconds + self.restored.seconds}

    @property
    def _tiers(self) -> LowerTiers | None:
        """The tiers' bookkeeping when they have a disk tier (over this store), else None."""
        if self.tiers is None or not self.tiers.lower.capacity_pages(DISK):
            return None
        return self.tiers.lower

    # -- save ---------------------------------------------------------------------------

    async def save(self, deadline: float | None = None) -> SaveReport:
        """Write the tree's pages down, then the index. `deadline` (time.monotonic): stop
        copying pages then, and index what is on disk. One save at a time."""
        async with self._saving:
            started = time.monotonic()
            report = SaveReport()
            tiers = self._tiers
            if tiers is None:                   # a budget under one page: nothing fits
                report.complete = False
                self.last_save = report
                return report
            async with self._step_lock:
                live = {h for n in self._walk() if n.tier != DISK for h in n.hashes}
                self._take_kept_copies(tiers, live)
                report.pages_dropped = self._drop_copies_but(tiers, live)
            new_slots: set[int] = set()
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    report.complete = False
                    break
                async with self._step_lock:      # no step evicts between walk and copy
                    await self._run_pending_moves()
                    walked = self._walk()
                    # copies kept since (loads, ancestors of pages sent to disk) are ours
                    self._take_kept_copies(tiers, {h for n in walked if n.tier != DISK
                                                   for h in n.hashes})
                    todo = [(h, n.tier, int(p), n, i) for n in walked if n.tier != DISK
                            for i, (h, p) in enumerate(zip(n.hashes, n.pages))
                            if h not in self._copies]
                    if not todo:
                        break
                    slots = tiers.lend_disk_slots(min(len(todo), self._batch_pages))
                    todo = todo[:len(slots)]
                    for (_, _, _, n, i), slot in zip(todo, slots.tolist()):
                        # journaled once written: a kill mid-save keeps it
                        tiers.disk.describe(slot, self._place(n, i))
                    payloads, windows = (await self._compute(self._copy_out, todo) if todo
                                         else ([], None))
                written = await asyncio.to_thread(write_pages, tiers.disk, slots.tolist(),
                                                  payloads, SAVE_WRITERS, windows)
                for (h, *_), slot in zip(todo[:written], slots.tolist()):
                    self._copies[h] = slot
                new_slots.update(slots[:written].tolist())
                report.pages_written += written
                report.windows_written += sum(1 for s in slots[:written].tolist()
                                              if tiers.disk.window_key_of(s))
                if written < len(slots):         # failed writes: give their slots back
                    async with self._step_lock:
                        for slot in slots[written:].tolist():
                            tiers.disk.drop_page(slot)
                        tiers.return_disk_slots(slots[written:].tolist())
                if not todo or written < len(todo):
                    report.complete = False      # the disk budget (or the disk) is full
                    log.warning("KV disk store %s: full; the save keeps what fits",
                                self.store.directory)
                    break
            # What the index names stays until written; journal records from the walk on
            # are replayed onto it (storage/disk_store.py: index_mark).
            with tiers.disk.holding_drops(), self.store.index_mark() as mark:
                async with self._step_lock:     # disk-tier writes still queued run first
                    await self._run_pending_moves()
                    index_nodes = self._index_nodes(tiers, self._walk())
                new_keys = {tiers.disk.key_of(s) for s in new_slots}
                report.nodes = len(index_nodes)
                report.pages_kept = sum(k not in new_keys
                                        for n in index_nodes for k in n.page_keys)
                try:
                    await asyncio.to_thread(self.store.write_index,
                                            self.store.new_index(index_nodes), mark)
                except OSError as e:            # read-only, full, failing: a disk fault
                    kind = self.store.faults.write_failed(e, self.store.directory)
                    raise DiskUnwritable(f"the cache could not be saved: the KV disk "
                                         f"directory {self.store.directory} refused the "
                                         f"index ({kind}: {e.strerror or e})", kind) from e
            report.seconds = time.monotonic() - started
            self.last_save = report
            self.saves += 1
            return report

    def _walk(self) -> list[_Node]:
        """The tree's nodes, parents first, with their pages' path hashes (event loop)."""
        nodes = []
        last: dict[int, bytes | None] = {}      # node id -> the hash of its last block
        ps = self.tree.page_size
        for node, hashes in walk_path_hashes(self.tree, ps):
            parent = node.parent
            below_root = parent is None or parent.depth == 0
            before = None if below_root else last.get(parent.id)
            last[node.id] = hashes[-1] if hashes else before
            aligned = (node.depth - node.num_tokens) % ps == 0
            nodes.append(_Node(node.tier, node.id, None if below_root else parent.id,
                               node.namespace,
                               node.key, node.pages, hashes, node.last_access,
                               before if aligned else None, aligned))
        return nodes

    def _place(self, n: _Node, i: int) -> PagePlace | None:
        """Where page i of a walked node sits (None: the node does not start on a page
        boundary, so its pages are not journaled, only indexed by the save)."""
        if not n.aligned:
            return None
        step = self.tree.page_size * ITEM_BYTES
        return PagePlace(n.hashes[i], n.hashes[i - 1] if i else n.parent_hash, n.namespace,
                         unpack(n.key[i * step:(i + 1) * step]), n.last_access)

    async def _run_pending_moves(self) -> None:
        """Run tier orders issued since the last step and drain the disk writer's queue
        (the step lock is held): a host slot or pool page a pending order fills holds its
        content only afterwards, and a disk page is on disk only once its write is done."""
        tiers = self.tiers
        if tiers is None:
            return
        moves = tiers.take_moves()
        if moves:
            await self._compute(self.kv.run, moves)
        await asyncio.to_thread(tiers.drain_writes)
        tiers.moves_done()

    def _copy_out(self, todo: list[tuple]) -> tuple[list[bytes], list[bytes | None] | None]:
        """Page bytes of (hash, tier, tree id) entries, in order, and their windows' (a
        hybrid model's; None without a windowed pool) (compute thread)."""
        out: list[bytes | None] = [None] * len(todo)
        for tier in (Tier.POOL, Tier.HOST):
            rows = [i for i, t in enumerate(todo) if t[1] == tier]
            if not rows:
                continue
            ids = np.array([todo[i][2] for i in rows], dtype=np.int64)
            payloads = self.kv.copy_out(tier, self.tiers.lower.local(tier, ids))
            for i, payload in zip(rows, payloads):
                out[i] = payload
        windows = (self.windows.copy_out(np.array([t[2] for t in todo], dtype=np.int64))
                   if self.windows is not None else None)
        return out, windows

    def _drop_older_copies(self, written: list[int]) -> None:
        """The disk tier just wrote these slots: a kept or saved copy of the same page is
        redundant now, and goes (not while a save runs, whose copies are in flight)."""
        tiers = self._tiers
        if tiers is None:
            return
        for slot in written:
            for other in tiers.disk.copies_of(slot):
                if other in tiers.kept:
                    tiers.drop_kept([other])
                elif other in tiers.lent and not self._saving.locked():
                    h = tiers.disk.hash_of(other)
                    if h is not None and self._copies.get(h) == other:
                        del self._copies[h]
                        tiers.disk.drop_page(other)
                        tiers.return_disk_slots([other])

    def _take_kept_copies(self, tiers: LowerTiers, live: set[bytes]) -> None:
        """The disk copies pages loaded into the pool kept (the inclusive disk tier)
        become the saver's copies of those pages: not written again."""
        taken = []
        for slot in tiers.kept:
            h = tiers.disk.hash_of(slot)
            if h is not None and h in live and h not in self._copies and \
                    slot + tiers.offset[DISK] not in tiers.pending_writes:
                self._copies[h] = slot
                taken.append(slot)
        tiers.take_kept(taken)

    def _drop_copies_but(self, tiers: LowerTiers, live: set[bytes]) -> int:
        """Drop the saved copies of paths no longer in the pool or host memory (the tree
        dropped them, or they went down to the disk tier, which has its own copy)."""
        gone = [h for h in self._copies if h not in live]
        slots = [self._copies.pop(h) for h in gone]
        for slot in slots:
            tiers.disk.drop_page(slot)
        tiers.return_disk_slots(slots)
        return len(gone)

    def _index_nodes(self, tiers: LowerTiers, nodes: list[_Node]) -> list[IndexNode]:
        """Index records of the nodes whose pages, and whose ancestors' pages, are on
        disk: pool/host nodes by their saved copies, disk nodes by their own files. A node
        whose leading pages only are on disk (a save cut short by its deadline or a full
        disk, which writes parents first) is indexed that far; its children are not."""
        saved: set[int] = set()
        out = []
        for n in nodes:
            if n.parent_id is not None and n.parent_id not in saved:
                continue
            if n.tier == DISK:
                slots = tiers.local(DISK, n.pages).tolist()
            else:
                slots = [self._copies.get(h) for h in n.hashes]
            keys = [tiers.disk.key_of(s) if s is not None else None for s in slots]
            on_disk = next((i for i, k in enumerate(keys)
                            if k is None or not self.store.has_page(k)), len(keys))
            # Whole pages only: a partial last page cannot be restored (its node would be
            # refused whole).
            ps = self.tree.page_size
            whole = min(len(n.key) // ITEM_BYTES // ps, on_disk)
            if whole == 0:
                continue
            if on_disk == len(keys):
                saved.add(n.node_id)
            keys = keys[:whole]
            hashes = n.hashes[:whole] if len(n.hashes) >= whole else []
            windows = [tiers.disk.window_key_of(s) for s in slots[:whole]]
            windows = [k if self.store.has_page(k) else 0 for k in windows]
            out.append(IndexNode(n.node_id, n.parent_id, n.namespace,
                                 unpack(n.key)[:whole * ps], keys, n.last_access, hashes,
                                 windows if any(windows) else []))
        return out

    # -- restore ------------------------------------------------------------------------

    async def restore(self) -> RestoreReport:
        """Rebuild the tree from the index (start-up, before any request): the index's
        nodes, parents first, become disk-tier nodes on the saved files. Nothing is read
        and no pool page taken; a hit loads them through the tier's load path, which
        checks each page's CRC. The files of nodes left out (no disk slots left: a
        smaller budget than the one that saved; parent left out) are dropped."""
        started = time.monotonic()
        report = RestoreReport()
        index = await asyncio.to_thread(self.store.read_index)
        tiers = self._tiers
        placed: dict[int, TreeNode] = {}
        last_hash: dict[int, bytes | None] = {}
        adopted: set[int] = set()
        windows: list[RestoredWindow] = []
        for node in index.nodes if index and tiers else []:
            parent = placed.get(node.parent_id) if node.parent_id is not None else None
            made = None
            if node.parent_id is None or parent is not None:
                made = tiers.restore_disk_node(parent, node.token_ids, node.namespace,
                                               node.last_access)
            if made is None:
                report.skipped_nodes += 1
                continue
            parent_hash = last_hash.get(node.parent_id)
            window_keys = (node.window_keys if self.windows is not None
                           and len(node.window_keys) == len(node.page_keys)
                           else [0] * len(node.page_keys))
            for tree_id, slot, place, window in zip(
                    made.pages.tolist(), tiers.local(DISK, made.pages).tolist(),
                    self._places(node, parent_hash), window_keys):
                tiers.disk.adopt(slot, place[0], place[1], window)
                adopted.update((place[0], window))
                if window:
                    windows.append(RestoredWindow(tree_id, window, node.last_access))
            placed[node.node_id] = made
            last_hash[node.node_id] = node.page_hashes[-1] if node.page_hashes else None
            report.nodes += 1
            report.pages += len(node.page_keys)
            report.tokens += made.num_tokens
        if self.windows is not None and windows:
            # The most recent that fit the windowed pool are read back now; every window
            # file stays on disk with its page (tier_pages.py).
            ids, payloads = await asyncio.to_thread(self.windows.read, windows)
            report.windows = await self._compute(self.windows.place, ids, payloads)
        for key in self.store.page_keys():
            if key not in adopted:
                self.store.drop_page(key)
        report.seconds = time.monotonic() - started
        self.restored = report
        if report.nodes or report.skipped_nodes:
            found = self.store.recovery
            log.info("KV disk store %s: restored %d tokens in %d nodes (%d skipped) as "
                     "disk-tier nodes in %.2f s; recovery %.2f s (index of %d pages + %d "
                     "journal records)", self.store.directory, report.tokens,
                     report.nodes, report.skipped_nodes, report.seconds,
                     found.seconds + report.seconds, found.index_pages,
                     found.journal_records)
        return report

    def _places(self, node: IndexNode, parent_hash: bytes | None
                ) -> list[tuple[int, PagePlace | None]]:
        """(key, where it sits) of a restored node's pages (no place: an index written
        before page hashes were)."""
        if len(node.page_hashes) != len(node.page_keys):
            return [(key, None) for key in node.page_keys]
        ps = self.tree.page_size
        out = []
        for i, (key, h) in enumerate(zip(node.page_keys, node.page_hashes)):
            out.append((key, PagePlace(h, parent_hash, node.namespace,
                                       node.token_ids[i * ps:(i + 1) * ps], node.last_access)))
            parent_hash = h
        return out


def write_pages(disk: TierPages, slots: list[int], payloads: list[bytes],
                workers: int = SAVE_WRITERS, windows: list[bytes | None] | None = None) -> int:
    """Write pages into disk slots, `workers` at once; -> how many were written, in order
    (those from the first failure on are not: the caller drops them). Each page file is
    fsynced: one at a time that cost ~6.5 ms a page on a busy disk, so a shutdown's save
    (within the 30 s grace) ended after ~4,300 of a 5,300-token tool block's pages, and
    only whole tree nodes are indexed; concurrent fsyncs share the filesystem's journal
    commits (scripts/bench_save_writes.py). `windows`: a hybrid model's window of each
    page (None: none), written beside it as the disk tier writes its own (tier_pages.py)."""
    failed = threading.Event()

    def write(slot: int, payload: bytes, window: bytes | None) -> bool:
        if failed.is_set():
            return False
        try:
            disk.write_page(slot, payload, window)
            return True
        except (DiskStoreFull, OSError) as e:
            if not failed.is_set():
                log.warning("KV disk store %s: %s; the save keeps what fits",
                            disk.store.directory, e)
            failed.set()
            return False

    with ThreadPoolExecutor(workers, thread_name_prefix="radixserve-save") as pool:
        done = list(pool.map(write, slots, payloads, windows or [None] * len(slots)))
    return done.index(False) if False in done else len(done)


def open_store(config: EngineConfig, runner: ModelRunner) -> DiskPageStore | None:
    """The store of `--kv-disk-dir`, or None (no flag, or the directory refused: the store
    logged why in one line). Bounded by --kv-disk-bytes, it holds the disk tier's pages
    (tier_setup.make_tiers) and the saved cache (KVPersistence)."""
    if not config.kv_disk_dir:
        return None
    if config.disable_radix_cache:
        log.warning("--kv-disk-dir is not used with --disable-radix-cache")
        return None
    store = DiskPageStore(config.kv_disk_dir, engine_fingerprint(config, runner),
                          config.kv_disk_bytes or DEFAULT_KV_DISK_BYTES,
                          journal_sync_ms=config.kv_disk_journal_sync_ms)
    return store if store.usable else None


def engine_fingerprint(config: EngineConfig, runner: ModelRunner):
    """What pages on disk depend on: the weights, dtype, page size and KV layout."""
    from radixserve.model.registry import resolve_model_path
    from radixserve.storage import model_fingerprint

    mc = runner.loaded.config
    return model_fingerprint(
        model_path=resolve_model_path(config.model), dtype=str(runner.dtype),
        page_size=config.page_size, kv_k=runner.kv_format.k, kv_v=runner.kv_format.v,
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        fixed_kv_scale=runner.backend.fixed_kv_scale)
