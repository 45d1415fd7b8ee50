"""Building the host/disk tiers of an engine from its config, and their stats.

The cache's bookkeeping (cache/tiers.py: LowerTiers) and the runner's data (host slots,
the disk writer thread: storage/disk_writer.py) are sized here from the same page size in
bytes, and handed to the one object that owns them at run time (tier_runtime.py).
The disk tier lives in the persistence's store (one directory, one byte budget), through
TierPages: its pages are the ones a save indexes and a restart restores.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import TYPE_CHECKING

from radixserve.attention.page_bytes import page_payload_bytes
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tiers import LowerTiers
from radixserve.engine.compute_thread import on_compute_thread
from radixserve.engine.config import EngineConfig
from radixserve.engine.disk_places import DiskPlaces
from radixserve.engine.peer_share import PeerShare
from radixserve.engine.tier_costs import TierCosts
from radixserve.share import ShareScope, open_shared_store
from radixserve.share.store import parse_share
from radixserve.engine.tier_runtime import TierRuntime
from radixserve.storage import DiskPageStore, TierPages
from radixserve.storage.disk_reader import DiskReader
from radixserve.storage.disk_writer import DiskWriter
from radixserve.storage.checked_blob import HEADER

if TYPE_CHECKING:
    from radixserve.engine.runner import ModelRunner

log = logging.getLogger(__name__)

def tier_pages(tokens: int | None, nbytes: int | None, page_size: int, page_bytes: int) -> int:
    """Pages of a tier sized in tokens or in bytes (0: no tier)."""
    if tokens:
        return tokens // page_size
    if nbytes:
        return nbytes // page_bytes
    return 0


def make_tiers(config: EngineConfig, runner: ModelRunner, tree: RadixCache,
               store: DiskPageStore | None) -> TierRuntime | None:
    """The engine's tier runtime (None when no tier is configured or the cache is off); the
    runner gets the host slots and the disk writer. `store`: the store of --kv-disk-dir
    (None: no flag, or the directory was refused and is left untouched)."""
    if config.disable_radix_cache:
        return None
    ps = config.page_size
    page_bytes = page_payload_bytes(runner.kv_pool)
    host_pages = tier_pages(config.kv_host_tokens, config.kv_host_bytes, ps, page_bytes)
    disk_pages = (disk_tier_pages(store, page_bytes + window_file_share(runner))
                  if store is not None else 0)
    disk = TierPages(store) if disk_pages else None
    if not host_pages and not disk_pages:
        return None
    writer = DiskWriter(disk, faults=disk.faults) if disk is not None else None  # off the step
    on_compute_thread(runner.attach_tiers, host_pages, writer)
    log.info("KV tiers: host %d tokens (%.1f MiB), disk %d tokens (%.1f MiB)",
             host_pages * ps, host_pages * page_bytes / 2**20, disk_pages * ps,
             disk_pages * page_bytes / 2**20)
    lower = LowerTiers(tree, runner.num_pages, host_pages, disk_pages, disk, page_bytes)
    reader = DiskReader(disk) if disk is not None else None     # reads off the loop
    lower.writer, lower.reader = writer, reader
    if disk is not None:
        lower.places = DiskPlaces(disk, ps)     # each disk page's path, for the journal
    return TierRuntime(lower, TierCosts(), disk, reader, writer)


DEFAULT_KV_SHARE_BYTES = 4 * 2**30


def make_peer_share(config: EngineConfig, runner: ModelRunner,
                    tiers: TierRuntime | None) -> PeerShare | None:
    """--kv-share: the cluster store and this engine's side of it (None: off, or the
    cache is off). Pages are keyed within this engine's model fingerprint, so replicas of
    another model or KV format never read them."""
    if config.disable_radix_cache or parse_share(config.kv_share)[0] == "off":
        return None
    if runner.windowed is not None:
        # A page's sliding-window layers live in another pool that the shared bytes do
        # not carry: a loaded page would lack them. Not shared (yet).
        log.warning("--kv-share is not used with a windowed KV pool (--kv-window-pool off "
                    "shares the full KV)")
        return None
    from radixserve.engine.kv_persistence import engine_fingerprint

    # This engine (several may share a process): its claims are its own (peer_share.py).
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    store = open_shared_store(config.kv_share, config.kv_share_bytes or DEFAULT_KV_SHARE_BYTES,
                              owner, config.kv_share_call_timeout_s)
    peers = PeerShare(store, ShareScope.of(engine_fingerprint(config, runner)),
                      config.page_size, tiers.costs if tiers is not None else None, owner,
                      config.kv_share_lookup_min_s)
    runner.share_publisher = peers.publisher
    log.info("KV sharing: %s store (%s)", store.name, config.kv_share)
    return peers


def window_file_share(runner: ModelRunner) -> int:
    """A hybrid model's disk pages carry window files too (storage/tier_pages.py): the
    bytes of one per page times the share of pages that hold a window, estimated as the
    windowed pool's pages per full page, so the budget's slots leave room for them (0
    without a windowed pool)."""
    if runner.windowed is None:
        return 0
    share = runner.window_pages / max(1, runner.num_pages)
    return int(share * (page_payload_bytes(runner.windowed.pool) + HEADER.size))


def disk_tier_pages(store: DiskPageStore, page_bytes: int) -> int:
    """Disk-tier slots: as many page files as the store's byte budget holds."""
    return (store.capacity_bytes or 0) // (page_bytes + HEADER.size)
