"""KVPersistence: the prefix cache saved to a DiskPageStore and restored from it at start.

Save (SIGTERM, `POST /cache/save`): every page the tree holds in the KV pool (L1) or in
host memory (L2) that the store lacks is copied out and written, in batches of ~32 MiB.
Each batch is chosen and copied while the step loop waits at `step_lock` (tier orders
still pending are run first), so no page is evicted and overwritten between the walk that
chose it and its copy; steps run between batches and while the files are written. Pages
only the disk tier holds are not saved. Then the pages the tree no longer holds are
dropped, and the index of every node whose pages are all on disk is
written last. Restore (start, before serving): the index's nodes, parents first, are read
(each page's checksum verified: a failed page ends its node there and skips everything
below it, so those tokens are recomputed), copied into free pool pages and inserted into
the tree, as far as free pages go.

A page on disk is named by the hash of its whole token path (namespace, then every token
from the root to the page's end): the same prefix saved twice is written once, and a page
of the tree maps to its disk copy however the tree's edges were split since.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from radixserve.attention.page_bytes import (bytes_to_pages, page_payload_bytes, pages_to_bytes,
                                             rows_to_bytes)
from radixserve.attention.kv_pool import KVPool
from radixserve.cache.memory import PagedMemory
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.token_keys import ITEM_BYTES, unpack
from radixserve.storage import DiskPageStore, DiskStoreFull, IndexNode

log = logging.getLogger(__name__)

BATCH_BYTES = 32 << 20          # page bytes copied out of the pool per step-loop pause
Compute = Callable[..., Awaitable[Any]]      # runs fn(*args) on the compute thread


@dataclass
class SaveReport:
    pages_written: int = 0      # new page files
    pages_kept: int = 0         # already on disk from an earlier save or the restore
    pages_dropped: int = 0      # on disk, no longer in the tree
    nodes: int = 0              # in the index written
    complete: bool = True       # False: the deadline or the disk budget cut it short
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class RestoreReport:
    nodes: int = 0              # inserted into the tree
    tokens: int = 0
    skipped_nodes: int = 0      # corrupt page, lost parent, or no free pages left
    seconds: float = 0.0


@dataclass
class _Node:                    # a tree node as one save pass saw it
    tier: int                   # 1: pages are pool pages; 2: host slots (tree ids)
    node_id: int
    parent_id: int | None
    namespace: str | None
    key: bytes
    pages: np.ndarray
    hashes: list[bytes]         # each page's path hash
    last_access: int


def _seed(namespace: str | None) -> bytes:
    return hashlib.blake2b(f"radixserve-kv-path\0{namespace!r}".encode(),
                           digest_size=16).digest()


def _chain(start: bytes, key: bytes | memoryview, page_size: int) -> list[bytes]:
    """Path hashes of the pages of an edge whose packed tokens are `key`."""
    step = page_size * ITEM_BYTES
    hashes, h = [], start
    for i in range(0, len(key), step):
        h = hashlib.blake2b(key[i:i + step], key=h, digest_size=16).digest()
        hashes.append(h)
    return hashes


class KVPersistence:
    def __init__(self, store: DiskPageStore, tree: RadixCache, memory: PagedMemory,
                 runner, compute: Compute, step_lock: asyncio.Lock):
        self.store = store
        self.tree = tree
        self.memory = memory
        self.runner = runner                # its KV pool, and its tier mover (host slots)
        self.pool: KVPool = runner.kv_pool
        self._compute = compute
        self._step_lock = step_lock
        self._disk_key: dict[bytes, int] = {}      # page path hash -> disk page key
        self._batch_pages = max(1, BATCH_BYTES // page_payload_bytes(self.pool))
        self._saving = asyncio.Lock()
        self.restored: RestoreReport | None = None
        self.last_save: SaveReport | None = None
        self.saves = 0

    def stats(self) -> dict:
        """For /cache/stats and /metrics."""
        return {"dir": str(self.store.directory), "used_bytes": self.store.used_bytes(),
                "capacity_bytes": self.store.capacity_bytes,
                "pages": len(self.store.page_keys()),
                "corrupt_pages": self.store.corrupt_pages,
                "stale_pages": self.store.stale_pages,
                "restored_tokens": self.restored.tokens if self.restored else 0,
                "saves": self.saves,
                "last_save": self.last_save.as_dict() if self.last_save else None}

    # -- save ---------------------------------------------------------------------------

    async def save(self, deadline: float | None = None) -> SaveReport:
        """Write the tree's pages down, then the index. `deadline` (time.monotonic): stop
        copying pages then, and index what is on disk. One save at a time."""
        async with self._saving:
            started = time.monotonic()
            report = SaveReport()
            async with self._step_lock:
                live = {h for n in self._walk() for h in n.hashes}
            report.pages_dropped = await asyncio.to_thread(self._drop_all_but, live)
            new_keys: set[int] = set()
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    report.complete = False
                    break
                async with self._step_lock:      # no step evicts between walk and copy
                    await self._run_pending_moves()
                    todo = [(h, n.tier, int(p)) for n in self._walk()
                            for h, p in zip(n.hashes, n.pages) if h not in self._disk_key]
                    todo = todo[:self._batch_pages]
                    if not todo:
                        break
                    payloads = await self._compute(self._copy_out, todo)
                written, full = await asyncio.to_thread(self._write, [t[0] for t in todo],
                                                        payloads)
                report.pages_written += written
                new_keys.update(self._disk_key[t[0]] for t in todo[:written])
                if full:
                    report.complete = False
                    break
            async with self._step_lock:
                nodes = self._walk()
            index_nodes = self._index_nodes(nodes)
            report.nodes = len(index_nodes)
            report.pages_kept = sum(k not in new_keys for n in index_nodes for k in n.page_keys)
            await asyncio.to_thread(self.store.write_index, self.store.new_index(index_nodes))
            report.seconds = time.monotonic() - started
            self.last_save = report
            self.saves += 1
            return report

    def _walk(self) -> list[_Node]:
        """The tree's nodes, parents first, with their pages' path hashes (event loop)."""
        ends: dict[int, bytes] = {}
        nodes = []
        for node in self.tree.iter_nodes():
            if node.tier not in (1, 2):  # the disk tier (and all below it) is not saved
                continue
            parent = node.parent
            below_root = parent is None or parent.depth == 0
            start = _seed(node.namespace) if below_root else ends[parent.id]
            hashes = _chain(start, node.key, self.tree.page_size)
            if hashes:
                ends[node.id] = hashes[-1]
            nodes.append(_Node(node.tier, node.id, None if below_root else parent.id,
                               node.namespace,
                               node.key, node.pages, hashes, node.last_access))
        return nodes

    async def _run_pending_moves(self) -> None:
        """Run tier orders issued since the last step (the step lock is held): a host slot
        or pool page a pending order fills holds its content only afterwards."""
        tiers = self.tree.tiers
        moves = tiers.take_moves() if tiers is not None else []
        if moves:
            await self._compute(self.runner.mover.run, moves)
            tiers.moves_done()

    def _copy_out(self, todo: list[tuple[bytes, int, int]]) -> list[bytes]:
        """Page bytes of (hash, tier, tree id) entries, in order (compute thread)."""
        out: list[bytes | None] = [None] * len(todo)
        for tier in (1, 2):
            rows = [i for i, t in enumerate(todo) if t[1] == tier]
            if not rows:
                continue
            ids = np.array([todo[i][2] for i in rows], dtype=np.int64)
            if tier == 1:
                payloads = pages_to_bytes(self.pool, ids)
            else:
                local = self.tree.tiers.local(tier, ids)
                payloads = rows_to_bytes(self.runner.mover.host.tensors, local)
            for i, payload in zip(rows, payloads):
                out[i] = payload
        return out

    def _write(self, hashes: list[bytes], payloads: list[bytes]) -> tuple[int, bool]:
        """Write pages (a worker thread); -> (how many, whether the disk budget is full)."""
        for i, (h, payload) in enumerate(zip(hashes, payloads)):
            key = self.store.new_page_key()
            try:
                self.store.write_page(key, payload)
            except DiskStoreFull as e:
                log.warning("KV disk store %s: %s; the save keeps what fits",
                            self.store.directory, e)
                return i, True
            self._disk_key[h] = key
        return len(hashes), False

    def _drop_all_but(self, live: set[bytes]) -> int:
        """Drop the disk pages of paths the tree no longer holds (a worker thread)."""
        gone = [h for h in self._disk_key if h not in live]
        for h in gone:
            self.store.drop_page(self._disk_key.pop(h))
        return len(gone)

    def _index_nodes(self, nodes: list[_Node]) -> list[IndexNode]:
        """Index records of the nodes whose pages, and whose ancestors' pages, are on disk."""
        saved: set[int] = set()
        out = []
        for n in nodes:
            if n.parent_id is not None and n.parent_id not in saved:
                continue
            keys = [self._disk_key.get(h) for h in n.hashes]
            if not keys or None in keys or not all(self.store.has_page(k) for k in keys):
                continue
            saved.add(n.node_id)
            out.append(IndexNode(n.node_id, n.parent_id, n.namespace, unpack(n.key), keys,
                                 n.last_access))
        return out

    # -- restore ------------------------------------------------------------------------

    async def restore(self) -> RestoreReport:
        """Rebuild the tree from the index (start-up, before any request)."""
        started = time.monotonic()
        report = RestoreReport()
        index = await asyncio.to_thread(self.store.read_index)
        placed: dict[int, tuple[array, np.ndarray, bytes]] = {}   # id -> path tokens, pages, hash
        page_size = self.tree.page_size
        for node in index.nodes if index else []:
            parent = placed.get(node.parent_id) if node.parent_id is not None else None
            if node.parent_id is not None and parent is None:
                report.skipped_nodes += 1
                continue
            count = len(node.page_keys)
            if self.memory.num_free < count:
                report.skipped_nodes += 1
                continue
            payloads = await asyncio.to_thread(self._read_leading, node.page_keys)
            if not payloads:
                report.skipped_nodes += 1
                continue
            tokens = array("q", parent[0] if parent else ())
            tokens.extend(node.token_ids[:len(payloads) * page_size])
            new_pages = self.memory.alloc(len(payloads))
            await self._compute(bytes_to_pages, self.pool, new_pages, payloads)
            pages = np.concatenate([parent[1] if parent else new_pages[:0], new_pages])
            result = self.tree.insert(tokens, pages, node.namespace)
            duplicates = result.duplicates(pages)
            if len(duplicates):
                self.memory.free(duplicates)
            hashes = _chain(parent[2] if parent else _seed(node.namespace),
                            tokens[len(tokens) - len(payloads) * page_size:].tobytes(),
                            page_size)
            for h, key in zip(hashes, node.page_keys):
                self._disk_key[h] = key
            report.nodes += 1
            report.tokens += len(payloads) * page_size
            if len(payloads) == count:           # whole: its children may hang from it
                placed[node.node_id] = (tokens, result.pages, hashes[-1])
            else:
                report.skipped_nodes += 1
        report.seconds = time.monotonic() - started
        self.restored = report
        if report.nodes or report.skipped_nodes:
            log.info("KV disk store %s: restored %d tokens in %d nodes (%d skipped) in "
                        "%.2f s", self.store.directory, report.tokens, report.nodes,
                        report.skipped_nodes, report.seconds)
        return report

    def _read_leading(self, page_keys: list[int]) -> list[bytes]:
        """The payloads of the leading pages that pass their check (a worker thread)."""
        payloads = []
        size = page_payload_bytes(self.pool)
        for key in page_keys:
            payload = self.store.read_page(key)
            if payload is None or len(payload) != size:
                break
            payloads.append(payload)
        return payloads


def open_persistence(config, runner, tree: RadixCache, memory: PagedMemory, compute: Compute,
                     step_lock: asyncio.Lock) -> KVPersistence | None:
    """The persistence of `--kv-disk-dir`, or None (no flag, or the directory refused:
    the store logged why in one line)."""
    if not config.kv_disk_dir:
        return None
    if config.disable_radix_cache:
        log.warning("--kv-disk-dir is not used with --disable-radix-cache")
        return None
    store = DiskPageStore(config.kv_disk_dir, engine_fingerprint(config, runner),
                          config.kv_disk_bytes)
    if not store.usable:
        return None
    return KVPersistence(store, tree, memory, runner, compute, step_lock)


def engine_fingerprint(config, runner):
    """What pages on disk depend on: the weights, dtype, page size and KV layout."""
    from radixserve.model.registry import resolve_model_path
    from radixserve.storage import model_fingerprint

    mc = runner.loaded.config
    return model_fingerprint(
        model_path=resolve_model_path(config.model), dtype=str(runner.dtype),
        page_size=config.page_size, kv_k=runner.kv_format.k, kv_v=runner.kv_format.v,
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        fixed_kv_scale=runner.backend.fixed_kv_scale)
